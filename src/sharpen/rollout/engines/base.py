"""The `InferenceEngine` protocol: token ids in; token ids and per-token logprobs out.

Engines know nothing of examples, rewards or the loop. Their logprobs are the behaviour policy's: logprobs of the
sampled tokens after temperature (and top-p, where set), so the trainer's importance ratio is exact when the
weights match. Each engine carries the `PolicyVersion` of the weights it holds; `load_weights` sets it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from sharpen.types import Completion, PolicyVersion, SamplingParams

if TYPE_CHECKING:
    import torch


class InferenceEngine(Protocol):
    @property
    def policy_version(self) -> PolicyVersion:
        """The version of the weights the engine holds (set by `load_weights`)."""
        ...

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        """One completion per prompt (repeat a prompt for several samples; give each its own seed)."""
        ...

    def score(self, token_ids: list[int]) -> list[float]:
        """Logprobs of ``token_ids[1:]`` given their prefixes, at temperature 1 (the weight-sync probe)."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: PolicyVersion) -> dict[str, float]:
        """Replace the engine's weights (full tensors, HF checkpoint names), record their version, and return
        timing metrics of the transfer (``sync/...``)."""
        ...

    def close(self) -> None: ...


class EngineError(RuntimeError):
    """The engine failed in a way the run cannot recover from (the message names the engine and the cause)."""
