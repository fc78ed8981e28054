"""The embedded runtime: the trainer and the engine live in this process (the engine's own workers may be child
processes of it), built with `build.py`'s builders; the run itself is `session.run_session`'s. With
``runtime.trainer_ranks > 1`` the trainer is that many local rank processes instead (`local_ranks`, torchrun-style).

Owns only that placement (with the start-up check of where checkpoints go, `storage.check_storage`: the run
directory shared with local rank processes, or the object store) and the closing of the engine it built. An engine
or trainer the caller passes is used as it is and not closed here (one engine per test session, say).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sharpen.config import SharpenConfig
from sharpen.config.episodes import EpisodeLimitsSection
from sharpen.orchestration.build import build_run_engine, build_trainer
from sharpen.orchestration.handles import TrainerHandle
from sharpen.orchestration.local_ranks import LocalTrainerRanks
from sharpen.orchestration.session import Resume, run_directory, run_session
from sharpen.orchestration.storage import check_storage
from sharpen.orchestration.trainer_layout import check_trainer_layout
from sharpen.rewards import RewardFn
from sharpen.rollout.engines import InferenceEngine
from sharpen.trainer import Trainer
from sharpen.trainer.backends.single_device import resolve_device


def run_embedded(
    config: SharpenConfig,
    *,
    resume: Resume = False,
    reward_fn: RewardFn | None = None,
    engine: InferenceEngine | None = None,
    trainer: Trainer | None = None,
) -> Path:
    """Run (or resume) a recipe in this process; returns the run directory.

    ``reward_fn`` replaces the configured rubric (any callable ``(example, completion) -> RewardResult``);
    ``engine`` and ``trainer`` reuse components the caller owns (they are not closed here)."""
    with contextlib.ExitStack() as owned:
        environment = config.environment
        if config.sandbox.fleet is not None or (isinstance(environment, EpisodeLimitsSection) and environment.fleet):
            from sharpen.orchestration.ray.fleets import start_fleets  # replicas as Ray actors: Ray only when asked

            config = start_fleets(config, stack=owned)

        def place(model_path: Path, tokenizer: Any) -> tuple[TrainerHandle, InferenceEngine]:
            live_trainer: TrainerHandle
            if trainer is not None:
                live_trainer, device = trainer, trainer.backend.device
            elif config.runtime.trainer_ranks > 1:  # torchrun-style ranks, local processes
                check_trainer_layout(config)
                ranks = LocalTrainerRanks(config, model_path=model_path)
                owned.callback(ranks.close)
                live_trainer, device = ranks, resolve_device(config.trainer.device)
            else:
                built = build_trainer(config, model_path=model_path, tokenizer=tokenizer)
                live_trainer, device = built, built.backend.device
            check_storage(config.run, run_directory(config), live_trainer)
            live_engine = engine
            if live_engine is None:  # the hf engine samples on the trainer's device
                live_engine = build_run_engine(config, model_path=model_path, tokenizer=tokenizer, device=str(device))
                owned.callback(live_engine.close)
            return live_trainer, live_engine

        def serve_rewards(stack: contextlib.ExitStack) -> Mapping[str, RewardFn]:
            from sharpen.orchestration.ray.reward_actors import start_reward_model_pools  # Ray only when asked for

            return start_reward_model_pools(config, stack=stack)

        return run_session(config, place=place, resume=resume, reward_fn=reward_fn, serve_rewards=serve_rewards)
