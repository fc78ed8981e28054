"""Connecting to Ray: the run's cluster at ``runtime.address``, or a local instance sized by the runtime section.

Owns only the connection; the Ray runtime (`runtime.py`) and the reward-model actors (`reward_actors.py`) both use
it, so whichever starts first connects and the other finds Ray initialised.
"""

from __future__ import annotations

import ray

from sharpen.config.runtime import RuntimeConfig


def start_ray(runtime: RuntimeConfig) -> bool:
    """Connect to ``runtime.address`` or start a local instance; False when this process was already connected
    (then whoever connected it shuts it down)."""
    if ray.is_initialized():
        return False
    if runtime.address is None:
        ray.init(num_cpus=runtime.ray_cpus, include_dashboard=False)
    else:
        ray.init(address=runtime.address)
    return True
