"""Inference engines behind one protocol: vLLM (real), transformers (fallback, tests), scripted (unit tests).
The registry is `build_engine` (one ``case`` per engine config; pyright checks it is exhaustive). Heavy engines are
imported lazily there, so importing this package costs nothing."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, assert_never

from sharpen.config.schema import EngineConfig, HfEngineConfig, ScriptedEngineConfig, VllmEngineConfig
from sharpen.rollout.engines.base import (
    EngineError,
    FreezableWeights,
    InferenceEngine,
    ReplicatedEngine,
    SleepableEngine,
    WeightGroupEngine,
    replicas_of,
    sleepable,
)

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = [
    "EngineError",
    "FreezableWeights",
    "InferenceEngine",
    "ReplicatedEngine",
    "SleepableEngine",
    "WeightGroupEngine",
    "build_engine",
    "replicas_of",
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
) -> InferenceEngine:
    """The configured engine; ``bucket_bytes`` sizes the weight-sync buckets of engines in another process;
    ``sleep_mode`` prepares an engine that needs it for `SleepableEngine.sleep` (vLLM's sleep mode)."""
    match config:
        case VllmEngineConfig():
            from sharpen.rollout.engines.vllm import VllmEngine

            return VllmEngine(
                config, model_path=model_path, dtype=dtype, seed=seed, bucket_bytes=bucket_bytes, sleep_mode=sleep_mode
            )
        case HfEngineConfig():
            from sharpen.rollout.engines.hf import HfEngine

            return HfEngine(model_path, dtype=dtype, device=device)
        case ScriptedEngineConfig():
            from sharpen.rollout.engines.scripted import ScriptedEngine

            if encode is None:
                raise ValueError("the scripted engine needs an encode function")
            return ScriptedEngine(config.completions, encode=encode, eos_token_id=eos_token_id)
        case _:
            assert_never(config)
