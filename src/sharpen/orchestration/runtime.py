"""The choice of runtime: `run` hands a recipe to the embedded runtime or to the Ray runtime.

Owns only the dispatch on `RuntimeConfig.type`; the runtimes own everything else. Ray is imported only when the
Ray runtime is chosen.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from sharpen.config import SharpenConfig
from sharpen.config.loader import ConfigError, format_validation_error
from sharpen.config.runtime import RuntimeConfig
from sharpen.orchestration.embedded import run_embedded
from sharpen.orchestration.session import Resume
from sharpen.rewards import RewardFn


def run(
    config: SharpenConfig,
    *,
    runtime: RuntimeConfig | None = None,
    resume: Resume = False,
    reward_fn: RewardFn | None = None,
) -> Path:
    """Run (or resume) a recipe in the configured runtime, or in ``runtime`` instead of the recipe's; returns the run
    directory. ``resume``: where the run starts (`session.Resume`: False, True for ``--resume``, ``"auto"``)."""
    if runtime is not None and runtime != config.runtime:
        config = with_runtime(config, runtime)
    runtime = config.runtime
    if runtime.type == "ray":
        from sharpen.orchestration.ray.runtime import run_ray

        return run_ray(config, resume=resume, reward_fn=reward_fn)
    return run_embedded(config, resume=resume, reward_fn=reward_fn)


def with_runtime(config: SharpenConfig, runtime: RuntimeConfig) -> SharpenConfig:
    """``config`` with its runtime section replaced, validated as a whole (so every component, in the driver and in
    the actors, reads the same runtime, and combinations the recipe alone could not show are refused)."""
    try:
        return SharpenConfig.model_validate({**config.model_dump(), "runtime": runtime.model_dump()})
    except ValidationError as error:
        raise ConfigError(format_validation_error(error).replace("\n", "; ")) from None
