"""The expert routes of a Mixture-of-Experts model: recorded from one forward pass, replayed in another.

A transformers MoE layer asks its router (``*TopKRouter``: ``forward(hidden) -> (logits, weights, indices)``) which
``top_k`` experts each token goes to and with what weights, then runs those experts. `RouterReplay` wraps every
router of a model once, and then, per forward pass:
- `capture` records each router's chosen expert indices (`Routes`: per MoE layer, ``[tokens, top_k]``, the tokens of
  the forward's flattened ``[batch x seq]`` in order);
- `replay` makes each router use given indices instead of its own top-k. The weights are the router's own
  probabilities at those experts, computed from its current logits as the family does (softmax or sigmoid,
  normalised over the chosen experts where the family normalises, scaled where it scales), so gradients reach the
  router weights through the chosen experts' probabilities, as routing replay (R2: the old policy's routes; R3: the
  inference engine's, arXiv 2510.11370) keeps them. A forward recomputed by activation checkpointing calls each
  router again and gets the same routes.

Families: softmax routers (Mixtral, Qwen2-MoE, Qwen3-MoE) and sigmoid routers with a correction bias (DeepSeek-V3:
the bias only chooses, so a replayed route ignores it). Any other router is refused with the family's name.
Outside `capture` and `replay` a wrapped router runs its own forward unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_SOFTMAX = ("MixtralTopKRouter", "Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter")
_SIGMOID = ("DeepseekV3TopkRouter",)


class RoutingError(ValueError):
    """Routes that do not fit the model (a dense model, a router family without replay, routes of another shape)."""


@dataclass(kw_only=True, slots=True)
class Routes:
    """The experts each token of one forward pass went to: per MoE layer (in the model's order), ``[tokens, top_k]``
    int64 indices, the tokens of the flattened ``[batch x seq]`` input in order."""

    layers: list[torch.Tensor] = field(default_factory=list)


def is_moe_model(model: nn.Module) -> bool:
    """Whether ``model`` has routers of a family `RouterReplay` knows."""
    return any(type(module).__name__ in _SOFTMAX + _SIGMOID for module in model.modules())


class RouterReplay:
    """Capture and replay the expert routes of ``model``'s routers (see the module docstring). Wraps the routers
    once, at construction."""

    def __init__(self, model: nn.Module, *, name: str = "the model") -> None:
        routers = [m for m in model.modules() if type(m).__name__.endswith(("TopKRouter", "TopkRouter"))]
        unknown = sorted({type(m).__name__ for m in routers} - set(_SOFTMAX + _SIGMOID))
        if unknown:
            raise RoutingError(
                f"routing replay knows the routers of Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V3, not {unknown[0]}"
            )
        if not routers:
            raise RoutingError(f"routing replay needs a Mixture-of-Experts model: {name} has no expert router")
        if any(isinstance(router.forward, _Routed) for router in routers):
            raise RoutingError(f"the routers of {name} are already wrapped by another RouterReplay")
        self.routers = routers
        self._captured: list[torch.Tensor | None] | None = None
        self._replayed: Routes | None = None
        for index, router in enumerate(routers):
            router.forward = _Routed(self, index, router)  # an instance attribute: module() calls it

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    @contextlib.contextmanager
    def capture(self) -> Iterator[Routes]:
        """Record the routes of the forward passes inside (the last pass's, per layer; inside `replay`: the
        replayed ones)."""
        if self._captured is not None:
            raise RoutingError("routes are already being captured")
        routes = Routes()
        captured: list[torch.Tensor | None] = [None] * self.num_layers
        self._captured = captured
        try:
            yield routes
        finally:
            self._captured = None
        missing = [index for index, indices in enumerate(captured) if indices is None]
        if missing:
            raise RoutingError(f"no forward pass reached MoE layer(s) {missing} while routes were captured")
        routes.layers = [indices for indices in captured if indices is not None]

    @contextlib.contextmanager
    def replay(self, routes: Routes) -> Iterator[None]:
        """Route every token of the forward passes inside as ``routes`` say."""
        if self._replayed is not None:
            raise RoutingError("routes are already being replayed")
        if len(routes.layers) != self.num_layers:
            raise RoutingError(f"routes of {len(routes.layers)} MoE layers for a model of {self.num_layers}")
        self._replayed = routes
        try:
            yield
        finally:
            self._replayed = None


class _Routed:
    """A router's forward under `RouterReplay`: its own, or with replayed indices; records what it chose."""

    def __init__(self, replay: RouterReplay, index: int, router: nn.Module) -> None:
        self.replay = replay
        self.index = index
        self.router = router
        self.original = router.forward  # the bound method of the class

    def __call__(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        replayed = self.replay._replayed
        if replayed is None:
            logits, weights, indices = self.original(hidden_states)
        else:
            logits, weights, indices = self._replayed(hidden_states, replayed.layers[self.index])
        captured = self.replay._captured
        if captured is not None:
            captured[self.index] = indices.detach()
        return logits, weights, indices

    def _replayed(
        self, hidden_states: torch.Tensor, indices: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        router: Any = self.router
        hidden = hidden_states.reshape(-1, router.hidden_dim)
        indices = indices.to(hidden.device, torch.long)
        if tuple(indices.shape) != (hidden.shape[0], router.top_k):
            raise RoutingError(
                f"MoE layer {self.index}: routes for {tuple(indices.shape)} tokens x experts, the forward has "
                f"{hidden.shape[0]} tokens of top_k {router.top_k}"
            )
        if type(router).__name__ in _SIGMOID:  # DeepSeek-V3: the bias chose; the weights are the plain scores
            logits = F.linear(hidden.type(torch.float32), router.weight.type(torch.float32))
            weights = logits.sigmoid().gather(1, indices)
            if router.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
            return logits, weights * router.routed_scaling_factor, indices
        logits = F.linear(hidden, router.weight)
        weights = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(1, indices)
        if getattr(router, "norm_topk_prob", True):  # Mixtral always normalises
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if hasattr(router, "norm_topk_prob"):  # the Qwen MoE routers return the weights in the logits' dtype
            weights = weights.to(logits.dtype)
        return logits, weights, indices
