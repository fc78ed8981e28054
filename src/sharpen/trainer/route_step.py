"""The expert routes' part of one trainer step for a Mixture-of-Experts policy (``trainer.moe``, docs/moe.md).

A `RouteStep` lives for one `Trainer.step`. At its start it reads and checks the routes the engine returned with
each rollout, and (`measure_engine`) scores one micro-batch twice without gradient, with the engine's routes
replayed and with the trainer's own, for the ``moe/engine_*`` and ``moe/logprob_gap_*`` metrics. It holds the
routes the step's passes replay: the engine's (R3), or those of the old-policy pass (R2, `replay_old_policy`), and
lays them over each micro-batch (`with_routes`). Each training pass hands it the routes it used
(`training_pass`): their disagreement and load add up for the ``moe/train_*`` metrics, and the pass's
load-balancing loss comes back to be added to its loss (``trainer.moe.aux_loss_coef``). At the end (`finish`) the
metrics are summed over the ranks and, with ``trainer.moe.expert_bias_update_rate``, the routers' expert biases move
toward balance. It owns no parameters (the backend's `RouterReplay` wraps the model's routers) and decides no
schedule (`Trainer.step` does).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace

import torch

from sharpen.config.moe import MoeConfig
from sharpen.expert_routes import Routers, Routes, routes_tensor
from sharpen.trainer.backends.base import TokenScores
from sharpen.trainer.lockstep import RankLockstep
from sharpen.trainer.packing import MicroBatch, pack_micro_batch, split_micro_batches
from sharpen.trainer.routes import (
    RouteStats,
    balance_loss,
    forward_routes,
    layer_loads,
    real_tokens,
    route_metrics,
)
from sharpen.types import Rollout

ScorePass = Callable[[MicroBatch, Routes | None], TokenScores]
"""Score a micro-batch with the policy, without gradient, replaying the given routes (None: its own)."""


class RouteStep:
    """One step's routes (see the module docstring)."""

    def __init__(self, router: Routers, config: MoeConfig, rollouts: list[Rollout], *, lockstep: RankLockstep) -> None:
        self.router = router
        self.config = config
        self.lockstep = lockstep
        self.engine = _engine_routes(router, config, rollouts)
        """The engine's ``[tokens, layers, top_k]`` routes, per rollout id (the rollouts that came with them)."""
        self.replayed: dict[int, torch.Tensor] = self.engine if config.routing_replay == "r3" else {}
        """The routes the policy's passes replay, per rollout id (none: the routers choose)."""
        self.train = RouteStats(num_experts=router.num_experts)

    @property
    def captures_old_policy(self) -> bool:
        """Whether the old-policy pass's routes are captured for the training passes (R2)."""
        return self.config.routing_replay == "r2"

    def replay_old_policy(self, captured: dict[int, torch.Tensor]) -> None:
        """R2: the old-policy pass's ``captured`` routes (per rollout id) are what the training passes replay."""
        self.replayed = captured

    def with_routes(self, micro: MicroBatch, chunk: list[Rollout]) -> MicroBatch:
        """``micro`` (of ``chunk``) with the routes to replay over its forward and over its padded rows (a reference
        policy's); with none: as it is."""
        if self.replayed:
            per_rollout = [self.replayed.get(id(r)) for r in chunk]
            micro.routes = forward_routes(micro, per_rollout)
            micro.row_routes = (
                micro.routes if micro.packed is None else forward_routes(micro, per_rollout, packed=False)
            )
        return micro

    def measure_engine(
        self, rollouts: list[Rollout], *, score: ScorePass, micro_batch_size: int, pad_token_id: int, device: object
    ) -> dict[str, float]:
        """The ``moe/`` gap between the engine's and the trainer's routes on one micro-batch of this rank's share,
        scored twice without gradient before any update: replaying the engine's routes (how often each layer's
        router would have chosen other experts: ``moe/engine_disagreement``) and with the trainer's own routes
        (their expert load), and the mean absolute gap of each pass's logprobs to the engine's
        (``moe/logprob_gap_replayed``, ``moe/logprob_gap_unreplayed``). Collective; {} when no rank has engine
        routes."""
        engine = self.engine
        if self.lockstep.sum_over_ranks({"with": float(bool(engine))})["with"] == 0:
            return {}
        local = self.lockstep.local_share(rollouts)
        with_routes = [r for r in local if id(r) in engine]
        is_filler = not with_routes
        chunk = split_micro_batches(with_routes, micro_batch_size)[0] if with_routes else rollouts[:1]
        micro = pack_micro_batch(
            [replace(r, advantage=0.0) for r in chunk],
            pad_token_id=pad_token_id,
            device=device,  # pyright: ignore[reportArgumentType]
        )
        stats = {name: RouteStats(num_experts=self.router.num_experts) for name in ("engine", "trainer")}
        sums: dict[str, float] = defaultdict(float)
        tokens = real_tokens(micro)
        with torch.no_grad():
            replays = {"engine": forward_routes(micro, [engine.get(id(r)) for r in chunk]), "trainer": None}
            for name, routes in replays.items():
                scores = score(micro, routes)
                if is_filler:
                    continue
                gap = (scores.logprobs - micro.engine_logprobs).abs()[micro.loss_mask]
                sums[f"gap_{name}"] += float(gap.sum())
                sums["gap_tokens"] = float(gap.numel())  # the same tokens in both passes
                if scores.routes is not None:
                    stats[name].add(scores.routes, tokens, routes)
        for name, stat in stats.items():
            sums.update(stat.sums(f"{name}/"))
        sums = self.lockstep.sum_over_ranks(dict(sums))
        metrics = route_metrics(sums, "engine/", "engine") | route_metrics(sums, "trainer/", "trainer")
        metrics.pop("moe/engine_load_max_over_mean", None)  # the same routes' load as the replay's
        metrics.pop("moe/engine_aux_loss", None)
        if sums.get("gap_tokens", 0.0) > 0:
            metrics["moe/logprob_gap_replayed"] = sums["gap_engine"] / sums["gap_tokens"]
            metrics["moe/logprob_gap_unreplayed"] = sums["gap_trainer"] / sums["gap_tokens"]
        return metrics

    def training_pass(self, micro: MicroBatch, routes: Routes | None, *, mini_batch_tokens: int) -> torch.Tensor | None:
        """A training pass over ``micro`` used ``routes``: adds them to the ``moe/train_*`` sums, and returns the
        pass's load-balancing loss (`balance_loss`, over the pass's own tokens, as transformers and Megatron compute
        it per forward: it depends on the micro-batches) times ``trainer.moe.aux_loss_coef`` and the pass's share of
        the mini-batch's ``mini_batch_tokens`` real tokens (the passes and ranks add up to the token-weighted mean),
        or None when the coefficient is 0 or the pass kept no probabilities. A filler pass is not handed in."""
        if routes is None:
            return None
        tokens = real_tokens(micro)
        self.train.add(routes, tokens, micro.routes)
        balance = balance_loss(routes, tokens) if self.config.aux_loss_coef > 0 else None
        if balance is None:
            return None
        return balance * self.balance_weight(micro, mini_batch_tokens=mini_batch_tokens)

    def balance_weight(self, micro: MicroBatch, *, mini_batch_tokens: int) -> float:
        """What `training_pass` multiplies a pass's balancing loss by (0: the loss is off), for a backend that adds
        the loss itself (`ScoreInputs.balance_weight`: a pipeline)."""
        return self.config.aux_loss_coef * float(real_tokens(micro).sum()) / mini_batch_tokens

    def finish(self, share_loss_sums: Callable[[dict[str, float]], dict[str, float]]) -> dict[str, float]:
        """The ``moe/train_*`` metrics of the step's training passes, summed over the ranks (``share_loss_sums``:
        a pipeline's from its last stage); then, with ``trainer.moe.expert_bias_update_rate``, every rank moves its
        routers' expert biases by the same summed loads. Collective."""
        sums = self.lockstep.sum_over_ranks(share_loss_sums(self.train.sums("train/")))
        rate = self.config.expert_bias_update_rate
        if rate > 0:
            loads = layer_loads(sums, "train/load_")
            if loads:
                self.router.update_bias(loads, rate)
        return route_metrics(sums, "train/", "train")


def _engine_routes(router: Routers, config: MoeConfig, rollouts: list[Rollout]) -> dict[int, torch.Tensor]:
    """Each rollout's engine routes as ``[tokens, layers, top_k]``, per rollout id, checked against the model; a
    rollout without any is an error under R3."""
    engine: dict[int, torch.Tensor] = {}
    for rollout in rollouts:
        if rollout.routes is None:
            if config.routing_replay == "r3":
                raise ValueError(
                    f'trainer.moe.routing_replay = "r3": rollout {rollout.example.task_key} came without the '
                    'engine\'s expert routes (an engine that returns routes: rollout.engine.type = "hf")'
                )
            continue
        routes = routes_tensor(rollout.routes)
        expected = (rollout.num_tokens, router.num_layers, router.top_k)
        if tuple(routes.shape) != expected:
            raise ValueError(
                f"rollout {rollout.example.task_key}: expert routes of {tuple(routes.shape)} ([tokens, layers, "
                f"top_k]) for {expected[0]} tokens of a model of {expected[1]} MoE layers and top_k {expected[2]}"
            )
        engine[id(rollout)] = routes
    return engine
