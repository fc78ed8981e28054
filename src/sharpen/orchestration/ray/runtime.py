"""The Ray runtime: the same loop as the embedded runtime, with the trainer and the engine in Ray actors.

Owns connecting to (or starting) Ray, placing the actors with the resources of `RuntimeConfig`, the check that
checkpoints have one place for the driver and every trainer actor (`storage.check_storage`: a shared run directory
or the object store), and stopping
them. Everything else (run directory, resume, export, sinks, sandboxes, the loop itself) is
`sharpen.orchestration.session.run_session`'s, which receives the actors' proxies as the run's trainer and engine.
A dead actor ends the attempt; the run then starts again with new actors from its newest checkpoint, up to
``runtime.max_restarts`` times (`session.run_restarting`, with `lost_actor` saying which deaths count).
The trainer is one actor, or several FSDP2 rank actors behind one `TrainerGroupProxy` (``runtime.trainer_ranks``);
the engine is one actor, or ``rollout.num_engines`` replica actors behind an `EngineRouter`; all actors share one
placement group.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from sharpen.config import SharpenConfig
from sharpen.config.models import resolve_model_path
from sharpen.config.runtime import RuntimeConfig
from sharpen.monitoring import Timeline
from sharpen.orchestration.handles import TrainerHandle
from sharpen.orchestration.ray.actors import EngineActor, TrainerActor
from sharpen.orchestration.ray.cluster import start_ray
from sharpen.orchestration.ray.fleets import start_fleets
from sharpen.orchestration.ray.proxies import (
    ActorCallError,
    ActorDeathError,
    BroadcastEngines,
    EngineProxy,
    TrainerGroupProxy,
    TrainerProxy,
    join_weight_group,
)
from sharpen.orchestration.ray.reward_actors import start_reward_model_pools
from sharpen.orchestration.session import Resume, run_directory, run_restarting, run_session
from sharpen.orchestration.storage import check_storage
from sharpen.orchestration.trainer_layout import check_trainer_layout
from sharpen.rewards import RewardFn
from sharpen.rollout.engines import InferenceEngine
from sharpen.rollout.engines.router import EngineRouter

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Placement:
    """The run's bundles of resources, and which bundle each trainer rank and engine replica goes into."""

    bundles: list[dict[str, float]]
    trainer_bundles: list[int]
    engine_bundles: list[int]


def plan_placement(runtime: RuntimeConfig, *, num_engines: int = 1, node_group: int = 1) -> Placement:
    """A bundle per group of ``node_group`` consecutive trainer ranks (the tensor-parallel ranks of one data shard:
    a bundle is placed on one node, so their per-layer collectives stay inside it), then one per engine replica;
    colocated (``runtime.colocate``), engine replica i shares trainer rank i's bundle, which holds both actors'
    resources."""
    trainer = {"CPU": runtime.trainer_cpus, **({"GPU": runtime.trainer_gpus} if runtime.trainer_gpus else {})}
    engine = {"CPU": runtime.engine_cpus, **({"GPU": runtime.engine_gpus} if runtime.engine_gpus else {})}
    num_ranks = runtime.trainer_ranks
    if num_ranks % node_group:
        raise ValueError(f"{num_ranks} trainer ranks do not split into groups of {node_group} on one node")
    num_groups = num_ranks // node_group
    trainer_bundles = [rank // node_group for rank in range(num_ranks)]
    if runtime.colocate:
        if num_engines != num_ranks:
            raise ValueError(f"colocated placement needs one engine per trainer rank: {num_engines} for {num_ranks}")
        both = {key: (trainer.get(key, 0.0) + engine.get(key, 0.0)) * node_group for key in {**trainer, **engine}}
        return Placement(
            bundles=[dict(both) for _ in range(num_groups)],
            trainer_bundles=trainer_bundles,
            engine_bundles=list(trainer_bundles),
        )
    group = {key: value * node_group for key, value in trainer.items()}
    return Placement(
        bundles=[dict(group) for _ in range(num_groups)] + [dict(engine) for _ in range(num_engines)],
        trainer_bundles=trainer_bundles,
        engine_bundles=list(range(num_groups, num_groups + num_engines)),
    )


def place(runtime: RuntimeConfig, plan: Placement) -> PlacementGroup:
    """One placement group of ``plan``'s bundles, placed by ``runtime.placement_strategy``; waits for the cluster to
    have room, at most ``start_timeout_s``."""
    group = placement_group(plan.bundles, strategy=runtime.placement_strategy)
    try:
        ray.get(group.ready(), timeout=runtime.start_timeout_s)
    except GetTimeoutError as error:
        remove_placement_group(group)
        raise ActorCallError(
            f"ray could not place the bundles {plan.bundles} of {runtime.trainer_ranks} trainer rank(s) and "
            f"{len(plan.engine_bundles)} engine(s){' (colocated)' if runtime.colocate else ''} "
            f"({runtime.placement_strategy}) within {runtime.start_timeout_s:g} s; the cluster has "
            f"{ray.available_resources()} available"
        ) from error
    return group


def _actor_options(*, num_cpus: float, num_gpus: float, group: PlacementGroup, bundle: int) -> dict[str, Any]:
    """Ray options of an actor in ``bundle`` of ``group``; Ray never restarts an actor alone (its state would be
    lost): a dead one ends the attempt, and the run restarts as a whole (``runtime.max_restarts``)."""
    strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=bundle)
    return {"num_cpus": num_cpus, "num_gpus": num_gpus, "max_restarts": 0, "scheduling_strategy": strategy}


def start_trainer(config: SharpenConfig, group: PlacementGroup, plan: Placement) -> TrainerProxy:
    """The trainer: one actor, or ``runtime.trainer_ranks`` FSDP2 rank actors joined into one process group, split as
    ``trainer.parallel`` says (`check_trainer_layout` first)."""
    runtime = config.runtime
    num_ranks = runtime.trainer_ranks
    ranks = []
    for rank in range(num_ranks):
        options = _actor_options(
            num_cpus=runtime.trainer_cpus, num_gpus=runtime.trainer_gpus, group=group, bundle=plan.trainer_bundles[rank]
        )
        actor = ray.remote(TrainerActor).options(**options).remote(config, rank=rank, world_size=num_ranks)
        name = "trainer" if num_ranks == 1 else f"trainer rank {rank}"
        ranks.append(
            TrainerProxy(actor, name=name, timeout_s=runtime.call_timeout_s, start_timeout_s=runtime.start_timeout_s)
        )
    if num_ranks == 1:
        return ranks[0]
    trainer = TrainerGroupProxy(ranks, name="trainer", timeout_s=runtime.start_timeout_s)
    master_addr, master_port = ranks[0].call("rendezvous_address")
    trainer.call("join", master_addr, master_port)  # every rank loads the model and takes its shard
    trainer.timeout_s = runtime.call_timeout_s
    trainer.assemble_at_receiver = config.weight_sync.assemble == "receiver"
    return trainer


def start_engines(config: SharpenConfig, group: PlacementGroup, plan: Placement) -> list[EngineProxy]:
    """``rollout.num_engines`` engine actors (replicas), each in its bundle of ``plan``."""
    runtime = config.runtime
    num_engines = config.rollout.num_engines
    engines = []
    for replica in range(num_engines):
        bundle = plan.engine_bundles[replica]
        options = _actor_options(num_cpus=runtime.engine_cpus, num_gpus=runtime.engine_gpus, group=group, bundle=bundle)
        actor = ray.remote(EngineActor).options(**options).remote(config, replica=replica, num_replicas=num_engines)
        name = "engine" if num_engines == 1 else f"engine replica {replica}"
        engines.append(
            EngineProxy(actor, name=name, timeout_s=runtime.call_timeout_s, start_timeout_s=runtime.start_timeout_s)
        )
    return engines


def run_ray(config: SharpenConfig, *, resume: Resume = False, reward_fn: RewardFn | None = None) -> Path:
    """Run (or resume) a recipe with the trainer and the engine as Ray actors, placed as ``config.runtime`` says;
    returns the run directory.

    A trainer rank or engine actor that dies mid-run restarts the run (new actors, from the newest complete
    checkpoint) up to ``runtime.max_restarts`` times (`session.run_restarting`). The actors are stopped at the end
    of each attempt (after a graceful close when the run succeeded, at once when it failed, so a hung actor cannot
    hold the error back); Ray is shut down only if this call started it."""
    resolve_model_path(config.model.path)  # user errors, before any actor exists
    if config.runtime.trainer_ranks > 1:  # one trainer rank runs the single-device backend: no layout
        check_trainer_layout(config)
    started = start_ray(config.runtime)
    fleets = contextlib.ExitStack()
    try:
        config = start_fleets(config, stack=fleets)  # the run's clients then call the fleets' URLs
        return run_restarting(
            config,
            lambda resume_as: _run_attempt(config, resume=resume_as, reward_fn=reward_fn),
            resume=resume,
            lost=lost_actor,
        )
    finally:
        fleets.close()
        if started:
            ray.shutdown()


def lost_actor(error: BaseException) -> str | None:
    """What died, when ``error`` (or an error it was raised from) is an actor's death (`ActorDeathError`)."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, ActorDeathError):
            return f"ray actor {seen.actor!r} died during {seen.call}()"
        seen = seen.__cause__ or seen.__context__
    return None


def _run_attempt(config: SharpenConfig, *, resume: Resume, reward_fn: RewardFn | None) -> Path:
    """One attempt of the run: the placement group and the actors, `run_session` with their proxies, and stopping
    them."""
    runtime = config.runtime
    proxies: list[TrainerProxy | EngineProxy] = []

    def attach_timeline(timeline: Timeline | None) -> None:  # the actors' spans go on the driver's timeline
        for proxy in proxies:
            proxy.attach_timeline(timeline)

    group = None
    try:
        plan = plan_placement(runtime, num_engines=config.rollout.num_engines, node_group=config.trainer.parallel.tp)
        group = place(runtime, plan)
        trainer = start_trainer(config, group, plan)
        proxies.append(trainer)
        engines = start_engines(config, group, plan)
        proxies.extend(engines)
        names = [e.name for e in engines]
        engine: InferenceEngine = (
            engines[0] if len(engines) == 1 else EngineRouter(engines, names=names, failover=config.rollout.failover)
        )
        if config.weight_sync.transport == "broadcast":
            join_weight_group(trainer, engines, timeout_s=runtime.start_timeout_s, backend=config.broadcast_backend)
            engine = BroadcastEngines(engine, trainer=trainer, engines=engines)

        def placed(model_path: Path, tokenizer: Any) -> tuple[TrainerHandle, InferenceEngine]:
            check_storage(config.run, run_directory(config), trainer)
            return trainer, engine

        run_dir = run_session(
            config,
            place=placed,
            resume=resume,
            reward_fn=reward_fn,
            serve_rewards=lambda stack: start_reward_model_pools(config, stack=stack),
            attach_timeline=attach_timeline,
        )
        for proxy in proxies:
            proxy.close()
        return run_dir
    finally:
        for proxy in proxies:
            proxy.kill()
        if group is not None:
            remove_placement_group(group)
