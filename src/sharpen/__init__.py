"""sharpen: reinforcement-learning post-training of language models.

The public surface is `sharpen.api` (``sharpen.train``, ``sharpen.run``, ``sharpen.evaluate`` and the config and
reward types), reachable from here without importing anything heavy until it is used. Layers (lowest first):
types | plugins, config, monitoring | serving, rewards | data, environments, trainer | rollout, evaluation,
orchestration, api | simulation, cli. See docs/architecture.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from sharpen.api import ConfigError, SharpenConfig, evaluate, load_config, run, train

__all__ = ["ConfigError", "SharpenConfig", "evaluate", "load_config", "run", "train"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("sharpen.api"), name)
    raise AttributeError(f"module 'sharpen' has no attribute {name!r}")
