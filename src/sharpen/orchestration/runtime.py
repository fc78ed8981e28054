"""The choice of runtime: `run` hands a recipe to the embedded runtime or to the Ray runtime.

Owns only the dispatch on `RuntimeConfig.type`; the runtimes own everything else. Ray is imported only when the
Ray runtime is chosen.
"""

from __future__ import annotations

from pathlib import Path

from sharpen.config import SharpenConfig
from sharpen.config.runtime import RuntimeConfig
from sharpen.orchestration.local import run_local
from sharpen.rewards import RewardFn


def run(
    config: SharpenConfig,
    *,
    runtime: RuntimeConfig | None = None,
    resume: bool = False,
    reward_fn: RewardFn | None = None,
) -> Path:
    """Run (or resume) a recipe in the configured runtime; returns the run directory."""
    runtime = runtime or config.runtime  # until SharpenConfig mounts the section: `runtime or config.runtime`
    if runtime.type == "ray":
        from sharpen.orchestration.ray.runtime import run_ray

        return run_ray(config, runtime=runtime, resume=resume, reward_fn=reward_fn)
    return run_local(config, resume=resume, reward_fn=reward_fn)
