"""Scripted engines for tests and benchmarks of everything but generation: they return configured texts.

`ScriptedEngine` returns the texts in turn, so what a request gets depends on the order of the calls.
`SeededScriptedEngine` chooses the text by a hash of the request (prompt ids and sampling seed), as vLLM's
per-request seeds make a real engine's output a function of the request, so a run's rollouts do not depend on
batching, call order, concurrency, scheduling or the number of replicas; `AsyncSeededScriptedEngine` takes those
requests one at a time (an `AsyncEngine`, like an engine server) and answers them after a seeded delay, out of order.
The seeded ones encode each text once, so a request costs a hash and a few list copies (benchmarks of millions of
episodes measure the episode path, not the engine).

Logprobs are a fixed value per token (so ratios against a trainer are not 1: tests see real numbers), and
`load_weights` only records the version and a count, which is what the loop's bookkeeping needs. They sleep like a
real engine (``runtime.colocate``): generating or scoring while asleep, or before a load after waking, raises.
"""

from __future__ import annotations

import asyncio
import hashlib
from array import array
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


class SeededScriptedEngine(ScriptedEngine):
    """Each completion is one of ``completions``, chosen by a hash of the prompt ids and the sampling seed (of the
    prompt alone for a request without a seed: greedy), with per-token versions; the engine keeps no per-request
    state, so millions of requests leave its memory as it was."""

    def __init__(
        self,
        completions: list[str],
        *,
        encode: Callable[[str], list[int]],
        logprob: float = -1.0,
        eos_token_id: int | None = None,
    ) -> None:
        super().__init__(completions, encode=encode, logprob=logprob, eos_token_id=eos_token_id)
        self._encoded = [encode(text) for text in completions]

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        self._check_awake("generate")
        self.num_calls += len(prompts)
        return [self.complete(prompt, param) for prompt, param in zip(prompts, params, strict=True)]

    def request_digest(self, prompt: list[int], params: SamplingParams) -> bytes:
        """8 bytes that are a function of the request alone: the first chooses the text."""
        seed = -1 if params.seed is None else params.seed
        data = array("q", prompt)
        data.append(seed)
        return hashlib.blake2b(data.tobytes(), digest_size=8).digest()

    def complete(self, prompt: list[int], params: SamplingParams, *, digest: bytes | None = None) -> Completion:
        """The completion of one request (what `generate` returns for it in any batch); ``digest``: its
        `request_digest`, when the caller has it already."""
        digest = self.request_digest(prompt, params) if digest is None else digest
        choice = int.from_bytes(digest[:4], "little") % len(self.completions)
        ids = self._encoded[choice][: params.max_new_tokens]
        is_length = len(ids) == params.max_new_tokens
        if not is_length and self.eos_token_id is not None:
            ids = [*ids, self.eos_token_id]
        return Completion(
            token_ids=ids,
            logprobs=[self.logprob] * len(ids),
            text=self.completions[choice],
            finish_reason="length" if is_length else "stop",
            versions=[self.policy_version] * len(ids),
        )


class AsyncSeededScriptedEngine(SeededScriptedEngine):
    """`SeededScriptedEngine` taking requests one at a time (an `AsyncEngine`: the episode runner sends each on its
    own, as to an engine server), each answered on the caller's event loop after a delay drawn from the request's
    hash in ``[0, max_delay_s]``, so completions come back in another order than they were asked."""

    def __init__(
        self,
        completions: list[str],
        *,
        encode: Callable[[str], list[int]],
        logprob: float = -1.0,
        eos_token_id: int | None = None,
        max_delay_s: float = 0.0,
    ) -> None:
        super().__init__(completions, encode=encode, logprob=logprob, eos_token_id=eos_token_id)
        self.max_delay_s = max_delay_s

    async def generate_async(self, prompt: list[int], params: SamplingParams) -> Completion:
        self._check_awake("generate")
        self.num_calls += 1
        digest = self.request_digest(prompt, params)
        await asyncio.sleep(self.max_delay_s * digest[4] / 255)  # 0 still yields: other episodes go on first
        return self.complete(prompt, params, digest=digest)
