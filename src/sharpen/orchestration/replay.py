"""`sharpen replay`: find a recorded rollout in a run directory and re-run its environment side.

Owns locating things: the run's resolved config, its tasks (rebuilt from the data config and seed, then matched by
task key and checked by content hash), the tokenizer, the environment and its sandbox. The comparison itself is
`sharpen.rollout.replay`.
"""

from __future__ import annotations

import json
from pathlib import Path

from sharpen.config import load_config
from sharpen.config.loader import ConfigError
from sharpen.config.models import resolve_model_path
from sharpen.environments.base import AgentEnvironment
from sharpen.environments.registry import (
    build_environment_factory,
    build_sandbox,
    close_environment_factory,
    episode_limits,
)
from sharpen.monitoring.recorder import ROLLOUTS_FILE_NAME
from sharpen.orchestration.build import load_run_examples, load_vision
from sharpen.rollout.replay import ReplayReport, replay_episode


def replay_recorded(run_dir: Path, *, step: int | None = None, index: int = 0) -> tuple[dict, ReplayReport]:
    """Replay the ``index``-th recorded rollout of ``step`` (default: the last recorded step)."""
    config_path, rollouts_path = run_dir / "config.toml", run_dir / ROLLOUTS_FILE_NAME
    for path in (config_path, rollouts_path):
        if not path.is_file():
            raise ConfigError(f"replay: {path} does not exist (is {run_dir} a run directory with recorded rollouts?)")
    records = [json.loads(line) for line in rollouts_path.read_text().splitlines() if line.strip()]
    if not records:
        raise ConfigError(f"replay: {rollouts_path} holds no rollouts")
    step = records[-1]["step"] if step is None else step
    at_step = [r for r in records if r["step"] == step]
    if not 0 <= index < len(at_step):
        raise ConfigError(f"replay: step {step} has {len(at_step)} recorded rollouts; --index {index} is not one")
    record = at_step[index]
    config = load_config(str(config_path), [])
    examples = {e.task_key: e for e in load_run_examples(config)}
    if record["task_key"] not in examples:
        raise ConfigError(f"replay: task {record['task_key']} is not in the run's data any more")
    vision = load_vision(config)  # a vision-language model renders observations with images (screenshots)
    if vision is not None:
        tokenizer = vision.tokenizer
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(config.model.path))
    make_environment = build_environment_factory(config.environment, model_path=resolve_model_path(config.model.path))
    sandbox = None
    try:
        environment = make_environment()
        if isinstance(environment, AgentEnvironment):
            raise ConfigError(
                f"replay: {environment.name} is an agent environment; its agent calls the model itself, so its "
                "episodes cannot be re-run from the recorded turns (the rollout record holds its exact tokens)"
            )
        sandbox = build_sandbox(config.environment, config.sandbox)
        report = replay_episode(
            record,
            examples[record["task_key"]],
            environment,
            tokenizer=tokenizer,
            limits=episode_limits(config.environment),
            sandbox=sandbox,
            vision=vision,
        )
    finally:
        if sandbox is not None:
            sandbox.close()
        close_environment_factory(make_environment)  # its browsers, its replica client
    return record, report
