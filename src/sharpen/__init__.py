"""sharpen: reinforcement-learning post-training of language models.

Layers (lowest first): types, config, monitoring, data | rewards, environments, trainer | rollout, evaluation,
orchestration, cli. See docs/architecture.md.
"""

__version__ = "0.1.0"
