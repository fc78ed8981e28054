"""What turns vLLM's routed experts (R3, ``enable_return_routed_experts``) into a completion's routes: vLLM 0.32
returns, per request, ``[prompt + completion - 1, layers, top_k]`` expert indices, every token it ran (the last
sampled token never ran), in process as ``CompletionOutput.routed_experts`` and from a server as base64 of a
``.npy`` in the generate reply. A rollout carries ``[tokens, layers, top_k]`` routes with the last token unknown,
as the `hf` engine returns them (docs/moe.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sharpen.expert_routes import UNROUTED, expert_routes
from sharpen.rollout.engines.base import EngineError
from sharpen.types import ExpertRoutes


def routes_of(prompt: list[int], route_experts: int | None) -> RoutesOf | None:
    """What `vllm_completion` needs to return the routes of a completion of ``prompt`` (None: no routes)."""
    return None if route_experts is None else RoutesOf(len(prompt), route_experts)


@dataclass(frozen=True, slots=True)
class RoutesOf:
    """What turns vLLM's routed experts of one request into a completion's routes: its prompt's length and the
    model's expert count."""

    prompt_length: int
    num_experts: int

    def routes(self, rows: Any, num_generated: int) -> ExpertRoutes:
        return vllm_routes(rows, num_tokens=self.prompt_length + num_generated, num_experts=self.num_experts)


def vllm_routes(rows: Any, *, num_tokens: int, num_experts: int) -> ExpertRoutes:
    """vLLM's routed experts of one request (``rows``: ``[num_tokens - 1, layers, top_k]``, every token it ran: the
    prompt's and the generated ones but the last) as the ``[num_tokens, layers, top_k]`` routes a rollout carries,
    the last token unknown (`UNROUTED`)."""
    import numpy as np
    import torch

    if rows is None:
        raise EngineError(
            "vLLM returned no routed experts: the engine must run with enable_return_routed_experts (R3), on a "
            "build that can (not the CPU build, docs/moe.md)"
        )
    array = np.asarray(rows)
    if array.ndim != 3 or array.shape[0] != num_tokens - 1:
        raise EngineError(
            f"vLLM returned routed experts of shape {tuple(array.shape)} for {num_tokens} tokens (expected "
            f"[{num_tokens - 1}, layers, top_k]: every token but the last)"
        )
    indices = torch.from_numpy(array.astype(np.int64))
    unknown = torch.full((1, *indices.shape[1:]), UNROUTED, dtype=torch.long)
    return expert_routes(torch.cat([indices, unknown]), num_experts=num_experts)


def decode_routed(encoded: str) -> Any:
    """The array of a generate reply's ``routed_experts``: base64 of numpy's ``.npy`` bytes (vLLM 0.32's scale-out
    protocol), ``[tokens - 1, layers, top_k]``; a `ValueError` for anything else. Never unpickles."""
    import base64
    import binascii
    import io

    import numpy as np

    try:
        return np.load(io.BytesIO(base64.b64decode(encoded, validate=True)), allow_pickle=False)
    except (binascii.Error, OSError, EOFError) as error:
        raise ValueError(str(error) or type(error).__name__) from None
