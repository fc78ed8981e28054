"""Inference engines behind one protocol: vLLM in process (`vllm.py`; `vllm_async.py`, AsyncLLM), vLLM and SGLang
servers (`vllm_server.py`, `sglang.py`, on the server life cycle of `server.py`), transformers (`hf.py`: fallback,
tests), scripted (unit tests), and `EngineRouter` over replicas (`router.py`, with `failover.py`). The registry is
`build_engine` (one ``case`` per engine config; pyright checks it is exhaustive). Heavy engines are imported lazily
there, so importing this package costs nothing."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, assert_never

from sharpen.config.engines import (
    EngineConfig,
    HfEngineConfig,
    ScriptedEngineConfig,
    SglangEngineConfig,
    VllmEngineConfig,
    VllmServerEngineConfig,
)
from sharpen.rollout.engines.base import (
    AsyncEngine,
    EngineError,
    EngineUnavailable,
    FreezableWeights,
    InferenceEngine,
    MeteredEngine,
    ReplicatedEngine,
    RestartableEngine,
    RouteReplayingEngine,
    SleepableEngine,
    WeightGroupEngine,
    pop_engine_metrics,
    probe_engine,
    replicas_of,
    request_level,
    sleepable,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from sharpen.config.schema import LoraConfig

__all__ = [
    "AsyncEngine",
    "EngineError",
    "EngineUnavailable",
    "FreezableWeights",
    "InferenceEngine",
    "MeteredEngine",
    "ReplicatedEngine",
    "RestartableEngine",
    "RouteReplayingEngine",
    "SleepableEngine",
    "WeightGroupEngine",
    "build_engine",
    "pop_engine_metrics",
    "probe_engine",
    "replicas_of",
    "request_level",
    "sleepable",
]


def build_engine(
    config: EngineConfig,
    *,
    model_path: Path,
    dtype: str,
    seed: int,
    device: str = "cpu",
    encode: Callable[[str], list[int]] | None = None,
    eos_token_id: int | None = None,
    bucket_bytes: int = 128 << 20,
    sleep_mode: bool = False,
    request_timeout_s: float | None = None,
    log_dir: Path | None = None,
    lora: LoraConfig | None = None,
    route_experts: int | None = None,
    lm_head_float32: bool = False,
) -> InferenceEngine:
    """The configured engine; ``bucket_bytes`` sizes the weight-sync buckets of engines in another process;
    ``sleep_mode`` prepares an engine that needs it for `SleepableEngine.sleep` (vLLM's sleep mode). Engine
    servers give up on a request after ``request_timeout_s`` and write the output of servers they start into
    ``log_dir`` (None: a temporary folder). ``route_experts``: the MoE's routed experts per layer, when a vLLM
    engine must return each completion's routes (R3; the `hf` engine returns an MoE's routes always).
    ``lm_head_float32`` (trainer.lm_head_float32): the LM head and its logprobs in float32; the `hf` and in-process
    `vllm` engines do it, the others refuse it."""
    if lm_head_float32 and not (
        isinstance(config, HfEngineConfig) or (isinstance(config, VllmEngineConfig) and not config.async_engine)
    ):
        raise EngineError(
            f"trainer.lm_head_float32 is supported by the hf and the in-process vllm engines, not by {config.type!r}"
            + (" with async_engine" if isinstance(config, VllmEngineConfig) else "")
        )
    match config:
        case VllmEngineConfig(async_engine=True):
            from sharpen.rollout.engines.vllm_async import VllmAsyncEngine

            return VllmAsyncEngine(
                config,
                model_path=model_path,
                dtype=dtype,
                seed=seed,
                bucket_bytes=bucket_bytes,
                sleep_mode=sleep_mode,
                route_experts=route_experts,
            )
        case VllmEngineConfig():
            from sharpen.rollout.engines.vllm import VllmEngine

            return VllmEngine(
                config,
                model_path=model_path,
                dtype=dtype,
                seed=seed,
                bucket_bytes=bucket_bytes,
                sleep_mode=sleep_mode,
                lora=lora,
                route_experts=route_experts,
                lm_head_float32=lm_head_float32,
            )
        case VllmServerEngineConfig():
            from sharpen.rollout.engines.vllm_server import VllmServerEngine

            return VllmServerEngine(
                config,
                model_path=model_path,
                dtype=dtype,
                seed=seed,
                bucket_bytes=bucket_bytes,
                request_timeout_s=request_timeout_s,
                log_dir=log_dir,
                route_experts=route_experts,
            )
        case SglangEngineConfig():
            from sharpen.rollout.engines.sglang import SglangEngine

            return SglangEngine(
                config,
                model_path=model_path,
                dtype=dtype,
                seed=seed,
                request_timeout_s=request_timeout_s,
                log_dir=log_dir,
            )
        case HfEngineConfig():
            from sharpen.rollout.engines.hf import HfEngine

            return HfEngine(model_path, dtype=dtype, device=device, lm_head_float32=lm_head_float32)
        case ScriptedEngineConfig():
            from sharpen.rollout.engines.scripted import ScriptedEngine

            if encode is None:
                raise ValueError("the scripted engine needs an encode function")
            return ScriptedEngine(config.completions, encode=encode, eos_token_id=eos_token_id)
        case _:
            assert_never(config)
