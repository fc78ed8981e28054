"""The vLLM engine: an in-process `vllm.LLM` (its engine core runs in a child process), on the CPU build here and
the same code on a GPU.

Prompts go in as token ids and the sampled tokens' logprobs come back in vLLM's ``processed_logprobs`` mode
(after temperature and top-p), which is the behaviour policy the trainer's ratio needs. Weights arrive as a
safetensors file in shared memory, loaded by the worker extension in `rollout/weight_sync/vllm_receiver.py`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from sharpen.config.schema import VllmEngineConfig
from sharpen.rollout.engines.base import EngineError
from sharpen.rollout.weight_sync.files import write_weights_file
from sharpen.types import Completion, PolicyVersion, SamplingParams

if TYPE_CHECKING:
    import torch
    from vllm.config.model import ModelDType
    from vllm.logprobs import LogprobsOnePosition

_RECEIVER = "sharpen.rollout.weight_sync.vllm_receiver.VllmWeightReceiver"


def _prepare_cpu_environment() -> None:
    """Settings the CPU build needs (see MACHINE.md); a user's own values win."""
    import torch

    if torch.cuda.is_available():
        return
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{max(os.cpu_count() or 1, 1) - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


class VllmEngine:
    def __init__(self, config: VllmEngineConfig, *, model_path: Path, dtype: str, seed: int) -> None:
        _prepare_cpu_environment()
        from vllm import LLM

        self.config = config
        started = time.perf_counter()
        self.llm = LLM(
            model=str(model_path),
            dtype=cast("ModelDType", dtype),  # validated by the config schema
            seed=seed,
            max_model_len=config.max_model_len,
            enforce_eager=config.enforce_eager,
            gpu_memory_utilization=config.gpu_memory_utilization,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=_RECEIVER,
        )
        self.startup_seconds = time.perf_counter() - started
        self.policy_version: PolicyVersion = 0

    def _sampling_params(self, params: SamplingParams) -> Any:
        from vllm import SamplingParams as VllmSamplingParams

        return VllmSamplingParams(
            n=1,
            max_tokens=params.max_new_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=-1,
            seed=params.seed,
            logprobs=0,
            stop_token_ids=list(params.stop_token_ids),
        )

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        requests: Any = [{"prompt_token_ids": ids} for ids in prompts]
        outputs = self.llm.generate(requests, [self._sampling_params(p) for p in params], use_tqdm=False)
        completions = []
        for output in outputs:
            sample = output.outputs[0]
            ids = list(sample.token_ids)
            if sample.logprobs is None or len(sample.logprobs) != len(ids):
                raise EngineError(f"vLLM returned {len(sample.logprobs or [])} logprobs for {len(ids)} tokens")
            # every sampled position has its logprobs (FlatLogprobs is typed as a sequence of optional positions)
            steps = cast("Sequence[LogprobsOnePosition]", sample.logprobs)
            logprobs = [step[token].logprob for step, token in zip(steps, ids, strict=True)]
            completions.append(
                Completion(
                    token_ids=ids,
                    logprobs=logprobs,
                    text=sample.text,
                    finish_reason="length" if sample.finish_reason == "length" else "stop",
                )
            )
        return completions

    def score(self, token_ids: list[int]) -> list[float]:
        from vllm import SamplingParams as VllmSamplingParams

        params = VllmSamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
        request: Any = {"prompt_token_ids": token_ids}
        (output,) = self.llm.generate([request], params, use_tqdm=False)
        prompt_logprobs = output.prompt_logprobs
        if prompt_logprobs is None:
            raise EngineError("vLLM returned no prompt logprobs for the probe")
        # only the first prompt position has no logprobs
        steps = cast("Sequence[LogprobsOnePosition]", prompt_logprobs[1:])
        return [step[token].logprob for step, token in zip(steps, token_ids[1:], strict=True)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: PolicyVersion) -> dict[str, float]:
        started = time.perf_counter()
        sent = write_weights_file(weights)
        written = time.perf_counter()
        try:
            replies = self.llm.collective_rpc("sharpen_load_weights_file", args=(str(sent.path), sent.checksum))
        finally:
            sent.path.unlink(missing_ok=True)
        for rank, reply in enumerate(replies):
            if not reply.get("ok"):
                raise EngineError(f"vLLM worker {rank} rejected weights version {version}: {reply.get('error')}")
        self.llm.reset_prefix_cache()  # cached KV entries were computed with the old weights
        self.policy_version = version
        done = time.perf_counter()
        return {
            "sync/num_tensors": float(sent.num_tensors),
            "sync/write_seconds": written - started,
            "sync/load_seconds": done - written,
            "sync/gib": sent.num_bytes / 2**30,
        }

    def close(self) -> None:
        engine = getattr(self.llm, "llm_engine", None)
        shutdown = getattr(engine, "shutdown", None)
        if callable(shutdown):
            shutdown()
        del self.llm
