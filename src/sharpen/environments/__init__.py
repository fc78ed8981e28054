"""Environments: the `Environment` protocol (multi-turn, async), the shipped environments, tools and the sandbox.

An environment turns the policy's text into observations and (optionally) rewards; it never touches tokens, the
engine or the trainer. The episode loop that drives it is `sharpen.rollout.episodes`.
"""

from sharpen.environments.base import (
    AgentClient,
    AgentEnvironment,
    AgentResult,
    Environment,
    EnvironmentFactory,
    EnvironmentInfraError,
    EpisodeContext,
    EpisodeLimits,
    SingleTurnEnvironment,
    StepResult,
)

__all__ = [
    "AgentClient",
    "AgentEnvironment",
    "AgentResult",
    "Environment",
    "EnvironmentFactory",
    "EnvironmentInfraError",
    "EpisodeContext",
    "EpisodeLimits",
    "SingleTurnEnvironment",
    "StepResult",
]
