"""sharpen's public Python surface: train a recipe, run a config, evaluate a model — what the CLI does, callable.

Everything here is a thin door into `sharpen.orchestration` (which owns building and running) and
`sharpen.config` (which owns recipes). Names outside this module and the types it re-exports may move between
releases; these do not without a deprecation. Nothing heavy is imported until a function is called, so
``import sharpen.api`` is fast.

    import sharpen

    run_dir = sharpen.train("recipes/demo.toml", ["run.num_steps=5"], reward_fn=my_reward)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from sharpen.config import ConfigError, SharpenConfig, load_config
from sharpen.types import Example, Message, RewardResult, RewardStatus

if TYPE_CHECKING:
    from sharpen.config.evaluation import EvalConfig
    from sharpen.evaluation import EvalReport
    from sharpen.rewards import RewardFn

__all__ = [
    "ConfigError",
    "Example",
    "Message",
    "RewardResult",
    "RewardStatus",
    "SharpenConfig",
    "evaluate",
    "load_config",
    "run",
    "train",
]


def run(config: SharpenConfig, *, resume: bool = False, reward_fn: RewardFn | None = None) -> Path:
    """Run (or, with ``resume``, continue) ``config`` in its runtime (``runtime.type``: this process or Ray);
    returns the run directory.

    ``reward_fn`` replaces the configured rubric: any callable ``(example, completion_text) -> RewardResult``."""
    from sharpen.orchestration.runtime import run as run_in_runtime

    return run_in_runtime(config, resume=resume, reward_fn=reward_fn)


def train(
    recipe: str | Path | SharpenConfig | None = None,
    overrides: Sequence[str] = (),
    *,
    resume: bool = False,
    reward_fn: RewardFn | None = None,
) -> Path:
    """``sharpen train RECIPE OVERRIDES...`` from Python: a recipe file (or a config, or None for the defaults)
    with dotted overrides in the CLI's syntax (``"trainer.learning_rate=2e-5"``); returns the run directory."""
    if isinstance(recipe, SharpenConfig):
        if overrides:
            raise ConfigError("train: overrides apply to a recipe file; change a SharpenConfig with model_copy")
        config = recipe
    else:
        config = load_config(recipe, list(overrides))
    return run(config, resume=resume, reward_fn=reward_fn)


def evaluate(
    config: SharpenConfig, evaluation: EvalConfig | None = None, *, reward_fn: RewardFn | None = None
) -> EvalReport:
    """``sharpen eval``: sample ``model.path`` on the recipe's tasks and measure pass@k / maj@k / mean@k
    (``evaluation``: the settings, default the recipe's evaluation section)."""
    from sharpen.orchestration.evaluate import run_eval

    return run_eval(config, evaluation or config.evaluation, reward_fn=reward_fn)
