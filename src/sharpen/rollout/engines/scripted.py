"""A scripted engine for unit tests of everything but generation: returns configured texts in turn.

Logprobs are a fixed value per token (so ratios against a trainer are not 1: tests see real numbers), and
`load_weights` only records the version and a count, which is what the loop's bookkeeping needs. It sleeps like a
real engine (``runtime.colocate``): generating or scoring while asleep, or before a load after waking, raises.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from sharpen.rollout.engines.base import EngineError
from sharpen.types import Completion, PolicyVersion, SamplingParams

if TYPE_CHECKING:
    import torch


class ScriptedEngine:
    def __init__(
        self,
        completions: list[str],
        *,
        encode: Callable[[str], list[int]],
        logprob: float = -1.0,
        eos_token_id: int | None = None,
    ) -> None:
        if not completions:
            raise ValueError("a scripted engine needs at least one completion text")
        self.completions = completions
        self.encode = encode
        self.logprob = logprob
        self.eos_token_id = eos_token_id
        self.policy_version: PolicyVersion = 0
        self.num_calls = 0
        self.num_weight_loads = 0
        self.is_asleep = False
        self.needs_weights = False
        self.num_sleeps = 0

    def sleep(self) -> dict[str, float]:
        self.num_sleeps += not self.is_asleep
        self.is_asleep = True
        return {"colocate/freed_bytes": 0.0}

    def wake_up(self) -> dict[str, float]:
        if self.is_asleep:
            self.is_asleep = False
            self.needs_weights = True
        return {}

    def _check_awake(self, call: str) -> None:
        if self.is_asleep or self.needs_weights:
            raise EngineError(f"scripted engine: {call}() while asleep or before weights were loaded after waking")

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        self._check_awake("generate")
        out = []
        for _prompt, param in zip(prompts, params, strict=True):
            text = self.completions[self.num_calls % len(self.completions)]
            self.num_calls += 1
            ids = self.encode(text)[: param.max_new_tokens]
            is_length = len(ids) == param.max_new_tokens
            if not is_length and self.eos_token_id is not None:
                ids = [*ids, self.eos_token_id]
            out.append(
                Completion(
                    token_ids=ids,
                    logprobs=[self.logprob] * len(ids),
                    text=text,
                    finish_reason="length" if is_length else "stop",
                )
            )
        return out

    def score(self, token_ids: list[int]) -> list[float]:
        self._check_awake("score")
        return [self.logprob] * (len(token_ids) - 1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: PolicyVersion) -> dict[str, float]:
        if self.is_asleep:
            raise EngineError("scripted engine: load_weights() while asleep")
        num_tensors = sum(1 for _ in weights)
        self.needs_weights = False
        self.num_weight_loads += 1
        self.policy_version = version
        return {"sync/num_tensors": float(num_tensors)}

    def close(self) -> None:
        pass
