"""The expert routes of a Mixture-of-Experts model: recorded from one forward pass, replayed in another.

A transformers MoE layer asks its router (``*TopKRouter``: ``forward(hidden) -> (logits, weights, indices)``) which
``top_k`` experts each token goes to and with what weights, then runs those experts. `RouterReplay` wraps every
router of a model once, and then, per forward pass:
- `capture` records each router's chosen expert indices (`Routes`: per MoE layer, ``[tokens, top_k]``, the tokens of
  the forward's flattened ``[batch x seq]`` in order), or, with ``rows``, those of every call in turn (a
  generation's prefill, then each decoding step);
- `replay` makes each router use given indices instead of its own top-k; a token whose indices are `UNROUTED` (-1)
  keeps the router's own choice (padding, or a token the engine never ran). The weights are the router's own
  probabilities at those experts, computed from its current logits as the family does (softmax or sigmoid,
  normalised over the chosen experts where the family normalises, scaled where it scales), so gradients reach the
  router weights through the chosen experts' probabilities, as routing replay (R2: the old policy's routes; R3: the
  inference engine's, arXiv 2510.11370) keeps them. A forward recomputed by activation checkpointing calls each
  router again and gets the same routes. Under replay, a capture also records, per layer, which replayed tokens
  the router would have sent elsewhere on its own (`Routes.differs`: the route disagreement the trainer logs).

Families: softmax routers (Mixtral, Qwen2-MoE, Qwen3-MoE) and sigmoid routers with a correction bias (DeepSeek-V3:
the bias only chooses, so a replayed route ignores it). Any other router is refused with the family's name.
Outside `capture` and `replay` a wrapped router runs its own forward unchanged.

The rest converts between the trainer's tensors and `sharpen.types.ExpertRoutes`, the compact per-token routes a
rollout carries from the engine to the trainer (`routes_tensor`, `expert_routes`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from sharpen.types import ExpertRoutes

UNROUTED = -1
"""An expert index that replays nothing: the router chooses this token's experts itself."""

REPLAY_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
"""The ``model_type`` (config.json) of the families whose routers `RouterReplay` knows."""

_SOFTMAX = ("MixtralTopKRouter", "Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter")
_SIGMOID = ("DeepseekV3TopkRouter",)


_LIVE: weakref.WeakSet[RouterReplay] = weakref.WeakSet()
"""Every `RouterReplay` in this process (`checkpoint_contexts` notes what each replays)."""


class RoutingError(ValueError):
    """Routes that do not fit the model (a dense model, a router family without replay, routes of another shape)."""


@dataclass(kw_only=True, slots=True)
class Routes:
    """The experts each token of one forward pass went to: per MoE layer (in the model's order), ``[tokens, top_k]``
    int64 indices, the tokens of the flattened ``[batch x seq]`` input in order (`UNROUTED` where a replay leaves
    the choice to the router). ``differs``, captured under replay: per layer, ``[tokens]`` bool, True where the
    replayed experts are not the ones the router would have chosen itself (as a set). ``probs``, captured by a pass
    with gradient: per layer, ``[tokens, experts]`` float32, the router's probability of each expert (softmax of its
    logits; a sigmoid router's scores over their sum), with the router's graph (the load-balancing loss,
    `balance_loss`)."""

    layers: list[torch.Tensor] = field(default_factory=list)
    differs: list[torch.Tensor] | None = None
    probs: list[torch.Tensor] | None = None


class Routers(Protocol):
    """What a trainer step needs of a policy's routers, however its layers are placed: `RouterReplay` (every MoE
    layer on this rank), or a pipeline's stages together (`pipeline_routes.PipelineRouters`)."""

    @property
    def num_layers(self) -> int:
        """The model's MoE layers (all of them, wherever they run)."""
        ...

    @property
    def top_k(self) -> int: ...

    @property
    def num_experts(self) -> int: ...

    def update_bias(self, loads: list[list[float]], rate: float) -> None:
        """`RouterReplay.update_bias` with the loads of every MoE layer of the model."""
        ...


def is_moe_model(model: nn.Module) -> bool:
    """Whether ``model`` has routers of a family `RouterReplay` knows."""
    return any(type(module).__name__ in _SOFTMAX + _SIGMOID for module in model.modules())


class RouterReplay:
    """Capture and replay the expert routes of ``model``'s routers (see the module docstring). Wraps the routers
    once, at construction."""

    def __init__(self, model: nn.Module, *, name: str = "the model", float32: bool = False) -> None:
        """``float32``: a softmax router computes its logits, probabilities and top-k in float32 whatever the
        autocast or the weights' dtype (a sigmoid router, DeepSeek-V3's, always does)."""
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
        self.float32 = float32
        self._captured: list[list[_Call]] | None = None
        self._accumulates = False
        self._replayed: Routes | None = None
        for index, router in enumerate(routers):
            router.forward = _Routed(self, index, router)  # an instance attribute: module() calls it
        _LIVE.add(self)

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    @property
    def top_k(self) -> int:
        router: Any = self.routers[0]
        return int(router.top_k)

    @property
    def num_experts(self) -> int:
        router: Any = self.routers[0]
        return int(router.weight.shape[0])

    @contextlib.contextmanager
    def capture(self, *, rows: int | None = None) -> Iterator[Routes]:
        """Record the routes of the forward passes inside: the last pass's, per layer (a pass that activation
        checkpointing recomputes records the same again). With ``rows``: every call's, each a batch of that many
        rows, put back on its rows and concatenated along the positions in call order (a generation's prefill,
        then one position per decoding step): per layer ``[rows, positions, top_k]`` (`stack_layers`). Inside
        `replay`: the replayed routes, with ``differs``."""
        if self._captured is not None:
            raise RoutingError("routes are already being captured")
        routes = Routes()
        captured: list[list[_Call]] = [[] for _ in range(self.num_layers)]
        self._captured, self._accumulates = captured, rows is not None
        try:
            yield routes
        finally:
            self._captured = None
        missing = [index for index, calls in enumerate(captured) if not calls]
        if missing:
            raise RoutingError(f"no forward pass reached MoE layer(s) {missing} while routes were captured")
        if rows is None:
            routes.layers = [torch.cat([call.indices for call in calls]) for calls in captured]
        else:
            routes.layers = [torch.cat([_on_rows(call.indices, rows) for call in calls], dim=1) for calls in captured]
        calls = [call for layer in captured for call in layer]
        if all(call.differs is not None for call in calls):
            routes.differs = [torch.cat([c.differs for c in layer if c.differs is not None]) for layer in captured]
        if rows is None and all(call.probs is not None for call in calls):
            routes.probs = [torch.cat([c.probs for c in layer if c.probs is not None]) for layer in captured]

    @contextlib.contextmanager
    def replay(self, routes: Routes) -> Iterator[None]:
        """Route every token of the forward passes inside as ``routes`` say (`UNROUTED`: the router's choice).
        Nested, the inner routes hold until its end, then the outer ones again (a LoRA policy's reference pass, its
        adapters off, inside the policy's training pass)."""
        if len(routes.layers) != self.num_layers:
            raise RoutingError(f"routes of {len(routes.layers)} MoE layers for a model of {self.num_layers}")
        outer, self._replayed = self._replayed, routes
        try:
            yield
        finally:
            self._replayed = outer

    def _record(self, index: int, indices: torch.Tensor, differs: torch.Tensor | None, logits: torch.Tensor) -> None:
        captured = self._captured
        if captured is None:
            return
        if not self._accumulates:
            captured[index].clear()
        probs = None
        if torch.is_grad_enabled() and not self._accumulates:  # a training pass: the balancing loss's probabilities
            probs = _expert_probs(self.routers[index], logits)
        captured[index].append(_Call(indices.detach(), differs, probs))

    def update_bias(self, loads: list[list[float]], rate: float) -> None:
        """DeepSeek-V3's balancing without an auxiliary loss: each router's ``e_score_correction_bias`` moves by
        ``rate`` toward balance given its layer's expert ``loads`` (token assignments): up for an expert loaded below
        the layer's mean, down above it, unchanged at the mean."""
        if len(loads) != self.num_layers:
            raise RoutingError(f"expert loads of {len(loads)} MoE layers for a model of {self.num_layers}")
        for router, counts in zip(self.routers, loads, strict=True):
            bias = getattr(router, "e_score_correction_bias", None)
            if bias is None:
                raise RoutingError(f"{type(router).__name__} has no expert bias to update (DeepSeek-V3's routers do)")
            load = torch.tensor(counts, dtype=torch.float32)
            step = rate * torch.sign(load.mean() - load)
            with torch.no_grad():
                bias.add_(step.to(bias.device, bias.dtype))


@dataclass(slots=True)
class _Call:
    """What one router call chose (`Routes`)."""

    indices: torch.Tensor
    differs: torch.Tensor | None
    probs: torch.Tensor | None


def _expert_probs(router: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """``[tokens, experts]`` float32: the router's probability of each expert, from its ``logits``."""
    if type(router).__name__ in _SIGMOID:
        scores = logits.float().sigmoid()
        return scores / scores.sum(dim=-1, keepdim=True)
    return torch.softmax(logits.float(), dim=-1)


class _Routed:
    """A router's forward under `RouterReplay`: its own, or with replayed indices; records what it chose."""

    def __init__(self, replay: RouterReplay, index: int, router: nn.Module) -> None:
        self.replay = replay
        self.index = index
        self.router = router
        self.original = router.forward  # the bound method of the class

    def __call__(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.replay.float32 and type(self.router).__name__ in _SOFTMAX:
            logits, weights, indices = self._own_float32(hidden_states)
        else:  # a router replicated over tensor-parallel ranks returns DTensors: each rank has them whole
            logits, weights, indices = (_plain(x) for x in self.original(hidden_states))
        replayed = self.replay._replayed
        differs = None
        if replayed is not None:
            own = indices
            given = replayed.layers[self.index].to(own.device, torch.long)
            if tuple(given.shape) != tuple(own.shape):
                raise RoutingError(
                    f"MoE layer {self.index}: routes for {tuple(given.shape)} tokens x experts, the forward has "
                    f"{own.shape[0]} tokens of top_k {own.shape[1]}"
                )
            is_given = given[:, 0] >= 0
            chosen = torch.where(is_given.unsqueeze(1), given, own)
            differs = is_given & (chosen.sort(dim=1).values != own.sort(dim=1).values).any(dim=1)
            logits, weights, indices = self._replayed(hidden_states, chosen)
        self.replay._record(self.index, indices, differs, logits)
        return logits, weights, indices

    def _logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The router's logits: in float32 outside autocast (`RouterReplay.float32`), else as the router runs."""
        router: Any = self.router
        hidden = hidden_states.reshape(-1, router.hidden_dim)
        if not self.replay.float32:
            return _plain(F.linear(hidden, router.weight))
        with torch.autocast(hidden.device.type, enabled=False):
            return _plain(F.linear(hidden.float(), router.weight.float()))

    def _own_float32(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A softmax router's own choice, as its family computes it, in float32."""
        router: Any = self.router
        logits = self._logits(hidden_states)
        weights, indices = torch.softmax(logits, dim=-1).topk(router.top_k, dim=-1)
        if getattr(router, "norm_topk_prob", True):  # Mixtral always normalises
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights, indices

    def _replayed(
        self, hidden_states: torch.Tensor, indices: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        router: Any = self.router
        hidden = hidden_states.reshape(-1, router.hidden_dim)
        if type(router).__name__ in _SIGMOID:  # DeepSeek-V3: the bias chose; the weights are the plain scores
            logits = _plain(F.linear(hidden.type(torch.float32), router.weight.type(torch.float32)))
            weights = logits.sigmoid().gather(1, indices)
            if router.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
            return logits, weights * router.routed_scaling_factor, indices
        logits = self._logits(hidden)
        weights = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(1, indices)
        if getattr(router, "norm_topk_prob", True):  # Mixtral always normalises
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if hasattr(router, "norm_topk_prob"):  # the Qwen MoE routers return the weights in the logits' dtype
            weights = weights.to(logits.dtype)
        return logits, weights, indices


def layer_balance_losses(routes: Routes, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Switch Transformer's load-balancing loss (arXiv 2101.03961, eq. 4-6) of each layer of ``routes`` over the real
    ``tokens`` (``[tokens]`` bool; some must be real): the number of experts times the sum over experts of the
    expert's share of the layer's top-k assignments (``f``, summing to ``top_k``) and its mean router probability
    (``P``, with the router's gradient); ``top_k`` at perfect balance. ``routes`` must hold the probabilities (a
    pass with gradient: `Routes.probs`)."""
    assert routes.probs is not None, "a balancing loss needs the routers' probabilities"
    losses = []
    for indices, probs in zip(routes.layers, routes.probs, strict=True):
        mask = tokens.to(probs.device)
        num_experts = probs.shape[1]
        assignments = torch.bincount(indices[mask].reshape(-1), minlength=num_experts).to(probs.dtype)
        share = assignments / mask.sum()
        losses.append(num_experts * (share * probs[mask].mean(dim=0)).sum())
    return losses


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """A router's output as a local tensor: a DTensor replicated over tensor-parallel ranks holds it whole (asked by
    its ``to_local``: DTensor stays imported by the trainer backends alone, `tests/unit/test_import_fences.py`)."""
    to_local = getattr(tensor, "to_local", None)
    return cast(torch.Tensor, to_local()) if callable(to_local) else tensor


def checkpoint_contexts() -> tuple[contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]]:
    """``torch.utils.checkpoint``'s ``context_fn`` for a model with routers (non-reentrant activation checkpointing):
    called at each checkpointed forward, it notes what every `RouterReplay` replays then, and whether it captures,
    and returns, for the recomputation in the backward, a context that replays those same routes and computes what
    a capture computes (into a capture that is dropped: the recomputation must save the tensors the forward saved),
    whatever is being replayed or captured when the backward runs (a pipeline's schedule runs other micro-batches'
    forwards in between)."""
    states = [(replay, replay._replayed, replay._captured is not None and not replay._accumulates) for replay in _LIVE]

    @contextlib.contextmanager
    def recomputing() -> Iterator[None]:
        saved = [(replay, replay._replayed, replay._captured, replay._accumulates) for replay, _, _ in states]
        for replay, replayed, captures in states:
            replay._replayed, replay._accumulates = replayed, False
            replay._captured = [[] for _ in replay.routers] if captures else None
        try:
            yield
        finally:
            for replay, replayed, captured, accumulates in saved:
                replay._replayed, replay._captured, replay._accumulates = replayed, captured, accumulates

    return contextlib.nullcontext(), recomputing()


def _on_rows(indices: torch.Tensor, rows: int) -> torch.Tensor:
    """One call's ``[tokens, top_k]`` indices of a batch of ``rows`` rows as ``[rows, positions, top_k]``."""
    if indices.shape[0] % rows:
        raise RoutingError(f"{indices.shape[0]} routed tokens do not split into {rows} rows")
    return indices.reshape(rows, -1, indices.shape[1])


def stack_layers(routes: Routes) -> torch.Tensor:
    """The ``[rows, positions, layers, top_k]`` routes of a capture with ``rows``."""
    return torch.stack(routes.layers, dim=2)


def routes_tensor(routes: ExpertRoutes) -> torch.Tensor:
    """``routes`` as a ``[tokens, layers, top_k]`` int64 tensor (`UNROUTED` where unknown)."""
    dtype = torch.uint8 if routes.itemsize == 1 else torch.int16
    flat = torch.frombuffer(bytearray(routes.data), dtype=dtype).to(torch.long) if routes.data else torch.empty(0)
    if routes.itemsize == 1:
        flat = torch.where(flat == 255, UNROUTED, flat)
    return flat.to(torch.long).reshape(routes.num_tokens, routes.num_layers, routes.top_k)


def expert_routes(indices: torch.Tensor, *, num_experts: int) -> ExpertRoutes:
    """``[tokens, layers, top_k]`` expert indices (`UNROUTED` where unknown) as compact `ExpertRoutes`: one byte
    per index for fewer than 255 experts, else two."""
    if indices.dim() != 3:
        raise RoutingError(f"expert routes are [tokens, layers, top_k], not {tuple(indices.shape)}")
    itemsize = 1 if num_experts < 255 else 2
    values = indices.detach().to("cpu", torch.long)
    values = torch.where(values < 0, 255, values).to(torch.uint8) if itemsize == 1 else values.to(torch.int16)
    tokens, layers, top_k = values.shape
    return ExpertRoutes(
        data=values.contiguous().numpy().tobytes(), num_tokens=tokens, num_layers=layers, top_k=top_k, itemsize=itemsize
    )
