"""The Ray runtime: the same loop as the embedded runtime, with the trainer and the engine in Ray actors.

Owns connecting to (or starting) Ray, placing the two actors with the resources of `RuntimeConfig`, and stopping
them. Everything else (run directory, resume, export, sinks, sandboxes, the loop itself) is `run_local`'s, which
receives the actors' proxies as a caller-owned trainer and engine. One actor each: no sharded trainer, no engine
replicas yet (see docs/scaling.md).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import cast

import ray

from sharpen.config import SharpenConfig
from sharpen.config.models import resolve_model_path
from sharpen.config.runtime import RuntimeConfig
from sharpen.monitoring import Timeline
from sharpen.orchestration.local import run_local
from sharpen.orchestration.ray.actors import EngineActor, TrainerActor
from sharpen.orchestration.ray.proxies import EngineProxy, TrainerProxy
from sharpen.rewards import RewardFn
from sharpen.rollout.engines import InferenceEngine
from sharpen.trainer import Trainer

logger = logging.getLogger(__name__)


def start_ray(runtime: RuntimeConfig) -> bool:
    """Connect to ``runtime.address`` or start a local instance; False when this process was already connected
    (then whoever connected it shuts it down)."""
    if ray.is_initialized():
        return False
    if runtime.address is None:
        ray.init(num_cpus=runtime.num_cpus, include_dashboard=False)
    else:
        ray.init(address=runtime.address)
    return True


def start_trainer(config: SharpenConfig, runtime: RuntimeConfig) -> TrainerProxy:
    actor = (
        ray.remote(TrainerActor)
        .options(num_cpus=runtime.trainer_cpus, num_gpus=runtime.trainer_gpus, max_restarts=0)
        .remote(config)
    )
    return TrainerProxy(
        actor, name="trainer", timeout_s=runtime.call_timeout_s, start_timeout_s=runtime.start_timeout_s
    )


def start_engine(config: SharpenConfig, runtime: RuntimeConfig) -> EngineProxy:
    actor = (
        ray.remote(EngineActor)
        .options(num_cpus=runtime.engine_cpus, num_gpus=runtime.engine_gpus, max_restarts=0)
        .remote(config)
    )
    return EngineProxy(actor, name="engine", timeout_s=runtime.call_timeout_s, start_timeout_s=runtime.start_timeout_s)


def run_ray(
    config: SharpenConfig, *, runtime: RuntimeConfig, resume: bool = False, reward_fn: RewardFn | None = None
) -> Path:
    """Run (or resume) a recipe with the trainer and the engine as Ray actors; returns the run directory.

    The actors are stopped at the end (after a graceful close when the run succeeded, at once when it failed, so
    a hung actor cannot hold the error back); Ray is shut down only if this call started it."""
    resolve_model_path(config.model.path)  # a user error, before any actor exists
    started = start_ray(runtime)
    proxies: list[TrainerProxy | EngineProxy] = []

    def attach_timeline(timeline: Timeline | None) -> None:  # the actors' spans go on the driver's timeline
        for proxy in proxies:
            proxy.attach_timeline(timeline)

    try:
        trainer = start_trainer(config, runtime)
        proxies.append(trainer)
        engine = start_engine(config, runtime)
        proxies.append(engine)
        # The proxies stand in for the components the loop types as `Trainer` and `InferenceEngine`.
        run_dir = run_local(
            config,
            resume=resume,
            reward_fn=reward_fn,
            engine=cast(InferenceEngine, engine),
            trainer=cast(Trainer, trainer),
            attach_timeline=attach_timeline,
        )
        for proxy in proxies:
            proxy.close()
        return run_dir
    finally:
        for proxy in proxies:
            proxy.kill()
        if started:
            ray.shutdown()
