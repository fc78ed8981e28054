"""`sharpen eval`'s runtime: build a recipe's tokenizer, engine, environment and rubric, and evaluate its model.

Owns the wiring only, with `build.py`'s builders so an evaluated model is sampled and scored as in training; the
evaluation itself is `sharpen.evaluation.evaluate`. No trainer is built: the model is ``model.path`` as it is on
disk (a pulled model, or a run's exported ``run_dir/model``).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from sharpen.config import SharpenConfig
from sharpen.config.evaluation import EvalConfig
from sharpen.config.loader import ConfigError
from sharpen.config.models import resolve_model_path
from sharpen.environments.registry import build_environment_factory, build_sandbox, close_environment_factory
from sharpen.evaluation import EvalReport, eval_sampling, evaluate
from sharpen.orchestration.build import (
    build_episode_runner,
    build_reward_fn,
    build_run_engine,
    load_run_examples,
    load_tokenizer,
    uses_ray_reward_models,
)
from sharpen.rewards import RewardFn
from sharpen.rollout.engines import InferenceEngine
from sharpen.trainer.backends.single_device import resolve_device


def run_eval(
    config: SharpenConfig,
    eval_config: EvalConfig,
    *,
    reward_fn: RewardFn | None = None,
    engine: InferenceEngine | None = None,
) -> EvalReport:
    """Evaluate ``model.path`` on the first ``eval_config.num_tasks`` tasks of the recipe's data.

    ``reward_fn`` replaces the configured rubric; ``engine`` reuses an engine the caller owns (not closed here).
    """
    _check_model_path(config.model.path)
    model_path = resolve_model_path(config.model.path)  # user errors first: before anything slow is loaded
    make_environment = build_environment_factory(config.environment, model_path=model_path)  # user errors first
    with contextlib.ExitStack() as stack:
        stack.callback(close_environment_factory, make_environment)  # its browsers, its replica client
        examples = load_run_examples(config)
        if eval_config.num_tasks is not None:
            if eval_config.num_tasks > len(examples):
                raise ConfigError(
                    f"num_tasks = {eval_config.num_tasks}, but the recipe's data has {len(examples)} tasks"
                )
            examples = examples[: eval_config.num_tasks]
        tokenizer = load_tokenizer(model_path)
        device = str(resolve_device(config.trainer.device))
        sandbox = build_sandbox(config.environment, config.sandbox)
        if sandbox is not None:
            stack.callback(sandbox.close)
        if reward_fn is None:
            served = {}
            if uses_ray_reward_models(config):
                from sharpen.orchestration.ray.reward_actors import start_reward_model_pools  # Ray only when asked

                served = start_reward_model_pools(config, stack=stack)
            reward_fn = build_reward_fn(config, stack, served=served)
        live_engine = engine or build_run_engine(config, model_path=model_path, tokenizer=tokenizer, device=device)
        if engine is None:
            stack.callback(live_engine.close)
        return evaluate(
            live_engine,
            examples,
            runner=build_episode_runner(
                config, tokenizer=tokenizer, sandbox=sandbox, make_environment=make_environment
            ),
            rubric=reward_fn,
            sampling=eval_sampling(config, eval_config),
            num_samples=eval_config.num_samples,
            ks=eval_config.ks,
            seed=config.run.seed,
            answer_format=config.reward.answer_format,
            prompts_per_batch=eval_config.prompts_per_batch,
        )


def _check_model_path(path: str) -> None:
    """A run's checkpoint folder holds trainer state, not a loadable model: say what to evaluate instead."""
    folder = Path(path).expanduser()
    if (folder / "state.json").is_file() and not (folder / "config.json").is_file():
        raise ConfigError(
            f"model.path: {path!r} is a training checkpoint (trainer state), not a HF model folder; "
            "evaluate the run's exported model (run_dir/model) instead"
        )
