"""Expert routes on the trainer's micro-batches: laid out for a forward pass, read back per rollout, and measured.

A rollout's routes are ``[tokens, layers, top_k]`` over its prompt and completion tokens (`sharpen.expert_routes`).
A forward pass flattens its rows: `forward_routes` puts each rollout's routes where its tokens are in the pass
(padded rows: `UNROUTED` on the padding, which then routes itself; a packed row: end to end), and
`rollout_routes` reads a captured pass's routes back per rollout. `RouteStats` adds up what the ``moe/*`` metrics
report (docs/moe.md): how often a replayed route is not the one the trainer's router would choose, per layer and
over any layer, how evenly the experts are loaded, and the load-balancing loss (`balance_loss`). `probe_scores` is
the weight-sync probe's pass with the routes it took, for an engine to replay.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from sharpen.expert_routes import UNROUTED, RouterReplay, Routes, expert_routes, layer_balance_losses
from sharpen.trainer.backends.base import ScoreInputs, TrainerBackend, scored_routes
from sharpen.trainer.packing import MicroBatch
from sharpen.types import ProbeScores


def forward_routes(
    micro: MicroBatch, per_rollout: Sequence[torch.Tensor | None], *, packed: bool | None = None
) -> Routes | None:
    """The routes to replay in ``micro``'s forward (its packed row, or its padded rows; ``packed`` False: its
    padded rows even when it has a packed one), from each row's ``[tokens, layers, top_k]`` routes (None: the row
    routes itself); None when no row has any."""
    known = [routes for routes in per_rollout if routes is not None]
    if not known:
        return None
    _, num_layers, top_k = known[0].shape
    lengths = micro.attention_mask.sum(dim=1).tolist()
    rows = []
    for routes, length in zip(per_rollout, lengths, strict=True):
        if routes is None:
            routes = torch.full((length, num_layers, top_k), UNROUTED, dtype=torch.long)
        elif routes.shape != (length, num_layers, top_k):
            raise ValueError(
                f"expert routes of {tuple(routes.shape)} ([tokens, layers, top_k]) for a rollout of {length} tokens "
                f"and {num_layers} MoE layers"
            )
        rows.append(routes)
    if (micro.packed is not None) if packed is None else packed:
        flat = torch.cat(rows)
    else:
        width = micro.input_ids.shape[1]
        grid = torch.full((len(rows), width, num_layers, top_k), UNROUTED, dtype=torch.long)
        for row, routes in enumerate(rows):
            grid[row, : routes.shape[0]] = routes
        flat = grid.reshape(-1, num_layers, top_k)
    return Routes(layers=[flat[:, layer] for layer in range(num_layers)])


def rollout_routes(micro: MicroBatch, routes: Routes) -> list[torch.Tensor]:
    """The ``[tokens, layers, top_k]`` routes of each of ``micro``'s rollouts in a pass that captured ``routes``."""
    flat = torch.stack([indices.cpu() for indices in routes.layers], dim=1)  # [pass tokens, layers, top_k]
    lengths = micro.attention_mask.sum(dim=1).tolist()
    if micro.packed is not None:
        return list(torch.split(flat, lengths))
    grid = flat.reshape(micro.input_ids.shape[0], micro.input_ids.shape[1], *flat.shape[1:])
    return [grid[row, :length] for row, length in enumerate(lengths)]


def real_tokens(micro: MicroBatch) -> torch.Tensor:
    """``[pass tokens]`` bool: which tokens of ``micro``'s forward are a rollout's (not padding)."""
    if micro.packed is not None:
        return torch.ones(micro.packed.num_tokens, dtype=torch.bool)
    return micro.attention_mask.reshape(-1).cpu().bool()


@dataclass(kw_only=True, slots=True)
class RouteStats:
    """Sums over a step's passes of one kind (counts add over passes and ranks: `sums`, then `metrics`)."""

    num_experts: int
    replayed: float = 0.0
    """Tokens routed by a replay."""
    differs: list[float] = field(default_factory=list[float])
    """Per layer: replayed tokens the router would have sent to other experts."""
    any_differs: float = 0.0
    """Replayed tokens that some layer's router would have sent elsewhere."""
    load: list[list[float]] = field(default_factory=list[list[float]])
    """Per layer, per expert: token assignments of the rollouts' tokens."""
    probs: list[list[float]] = field(default_factory=list[list[float]])
    """Per layer, per expert: the router's probabilities summed over the real tokens of passes that kept them."""
    prob_tokens: float = 0.0
    """The real tokens in ``probs``."""

    def add(self, used: Routes, tokens: torch.Tensor, replayed: Routes | None = None) -> None:
        """A pass's captured routes ``used`` on its ``tokens`` (real ones, `real_tokens`), and what it replayed."""
        if not self.load:
            self.load = [[0.0] * self.num_experts for _ in used.layers]
            self.differs = [0.0] * len(used.layers)
        for layer, indices in enumerate(used.layers):
            counts = torch.bincount(indices.cpu()[tokens].reshape(-1), minlength=self.num_experts)
            self.load[layer] = [a + float(b) for a, b in zip(self.load[layer], counts.tolist(), strict=True)]
        if used.probs is not None:
            if not self.probs:
                self.probs = [[0.0] * self.num_experts for _ in used.probs]
            for layer, probs in enumerate(used.probs):
                summed = probs.detach()[tokens.to(probs.device)].sum(dim=0).tolist()
                self.probs[layer] = [a + b for a, b in zip(self.probs[layer], summed, strict=True)]
            self.prob_tokens += float(tokens.sum())
        if replayed is None or used.differs is None:
            return
        given = tokens & (replayed.layers[0].cpu()[:, 0] != UNROUTED)
        self.replayed += float(given.sum())
        differs = torch.stack([d.cpu() & given for d in used.differs])  # [layers, pass tokens]
        self.differs = [a + float(b) for a, b in zip(self.differs, differs.sum(dim=1).tolist(), strict=True)]
        self.any_differs += float(differs.any(dim=0).sum())

    def sums(self, prefix: str) -> dict[str, float]:
        """Named sums (every rank names the same ones for the same model)."""
        out = {f"{prefix}replayed": self.replayed, f"{prefix}any_differs": self.any_differs}
        out[f"{prefix}tokens_with_probs"] = self.prob_tokens
        out |= {f"{prefix}differs_{layer:03d}": value for layer, value in enumerate(self.differs)}
        out |= {
            f"{prefix}load_{layer:03d}_{expert:04d}": value
            for layer, counts in enumerate(self.load)
            for expert, value in enumerate(counts)
        }
        out |= {
            f"{prefix}prob_{layer:03d}_{expert:04d}": value
            for layer, sums in enumerate(self.probs)
            for expert, value in enumerate(sums)
        }
        return out


def route_metrics(sums: dict[str, float], prefix: str, name: str) -> dict[str, float]:
    """The ``moe/`` metrics of `RouteStats.sums` added over ranks: ``moe/{name}_disagreement`` (replayed tokens
    some layer's router would route elsewhere), ``moe/{name}_disagreement/layer_NNN``, and the experts' load spread
    ``moe/{name}_load_max_over_mean`` (the most loaded expert's tokens over the mean, averaged over layers; 1 is
    even), and ``moe/{name}_aux_loss``: `balance_loss` over all the passes' real tokens at once (whatever the
    micro-batches and ranks: ``top_k`` at perfect balance), where the passes kept the routers' probabilities."""
    metrics: dict[str, float] = {}
    num_tokens = sums.get(f"{prefix}tokens_with_probs", 0.0)
    if num_tokens > 0:
        loads, probs = layer_loads(sums, f"{prefix}load_"), layer_loads(sums, f"{prefix}prob_")
        per_layer = [
            len(counts) * sum(c / num_tokens * p / num_tokens for c, p in zip(counts, prob, strict=True))
            for counts, prob in zip(loads, probs, strict=True)
        ]
        metrics[f"moe/{name}_aux_loss"] = sum(per_layer) / len(per_layer)
    replayed = sums.get(f"{prefix}replayed", 0.0)
    if replayed > 0:
        metrics[f"moe/{name}_disagreement"] = sums[f"{prefix}any_differs"] / replayed
        for key, value in sums.items():
            if key.startswith(f"{prefix}differs_"):
                metrics[f"moe/{name}_disagreement/layer_{key.removeprefix(f'{prefix}differs_')}"] = value / replayed
    loads = layer_loads(sums, f"{prefix}load_")
    spreads = [max(counts) * len(counts) / sum(counts) for counts in loads if sum(counts) > 0]
    if spreads:
        metrics[f"moe/{name}_load_max_over_mean"] = sum(spreads) / len(spreads)
    return metrics


def layer_loads(sums: dict[str, float], prefix: str) -> list[list[float]]:
    """Per layer, per expert, the values named ``{prefix}LLL_EEEE`` in `RouteStats.sums` (added over ranks), in
    order: ``.../load_``, the token assignments; ``.../prob_``, the summed router probabilities."""
    loads: dict[int, dict[int, float]] = {}
    for key, value in sums.items():
        if key.startswith(prefix):
            layer, expert = key.removeprefix(prefix).split("_")
            loads.setdefault(int(layer), {})[int(expert)] = value
    return [[counts[expert] for expert in sorted(counts)] for _, counts in sorted(loads.items())]


def balance_loss(routes: Routes, tokens: torch.Tensor) -> torch.Tensor | None:
    """Switch Transformer's load-balancing loss of one pass (arXiv 2101.03961, eq. 4-6) over its real ``tokens``
    (`real_tokens`): per MoE layer, the number of experts times the sum over experts of the expert's share of the
    layer's top-k assignments (``f``, summing to ``top_k``) and its mean router probability (``P``, with the router's
    gradient), averaged over layers; ``top_k`` at perfect balance. transformers' Mixtral pools ``f`` and ``P`` over
    all layers before the product; this keeps each layer's own, as the paper adds one loss per layer. None when the
    pass kept no probabilities (no gradient) or has no real token."""
    if routes.probs is None or not bool(tokens.any()):
        return None
    return torch.stack(layer_balance_losses(routes, tokens)).mean()


def probe_scores(backend: TrainerBackend, token_ids: list[int]) -> ProbeScores | None:
    """The weight-sync probe's logprobs with the experts each token went to, when ``backend`` records a
    Mixture-of-Experts policy's routes (a `RouterReplay`: ``trainer.moe``; not a pipeline, whose stages hold theirs);
    None otherwise (the caller scores without routes). Master weights' dtype, temperature 1, as the probe's
    `Trainer.compute_logprobs`. Collective on a sharded backend."""
    router: RouterReplay | None = getattr(backend, "router", None)
    if router is None:
        return None
    ids = torch.tensor([token_ids], dtype=torch.long, device=backend.device)
    targets = torch.ones((1, len(token_ids) - 1), dtype=torch.bool, device=backend.device)
    with torch.no_grad():
        scores = scored_routes(
            backend,
            ScoreInputs(input_ids=ids, attention_mask=torch.ones_like(ids), target_mask=targets),
            temperature=1.0,
            use_autocast=False,
        )
    assert scores.routes is not None  # a backend with a router captures them
    routes = torch.stack(scores.routes.layers, dim=1)  # [tokens, layers, top_k]
    return ProbeScores(
        logprobs=scores.logprobs[0].tolist(), routes=expert_routes(routes, num_experts=router.num_experts)
    )
