"""The limits of an episode that the episode loop enforces, and where its episodes run (in this process or on
`sharpen serve-env` replicas): the base of every environment section that has episodes of its own.

Pydantic only. Apart from `sharpen.config.environments` so that environment sections in modules of their own (the
browser's) can derive from it while that module imports them for its union.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from sharpen.config.section import Section
from sharpen.config.service import RemoteConfig, ServiceConfig, ServiceFleetConfig

ToolParserName = Literal["hermes", "json", "llama3_json", "qwen3_coder", "mistral", "harmony", "auto"]
"""How tool calls are read from a policy's turn: a parser of `sharpen.environments.tool_formats.TOOL_CALL_PARSERS`
(kept equal to it by a test), or ``auto``: the format the model's chat template renders."""


class EpisodeLimitsSection(Section):
    max_turns: int = Field(default=1, ge=1)
    """Policy turns per episode (each turn's token limit is rollout.max_new_tokens)."""
    max_episode_tokens: int = Field(default=1024, ge=1)
    """Completion tokens per episode, generated plus appended by the environment (keep prompt + this within the
    engine's max_model_len)."""
    wall_seconds: float | None = Field(default=120.0, gt=0.0)
    """Wall-clock budget of the environment's side of one episode (its reset and steps); an episode that exceeds
    it ends and abstains (status timeout). None: unbounded."""
    remote: RemoteConfig | None = None
    """Run the episodes on `sharpen serve-env` replicas at ``remote.urls`` (each serves this same environment section
    from its own recipe) instead of in this process. A replica lost mid-episode is replaced by replaying the
    episode's seed and actions on another; an episode that does not replay identically abstains."""
    service: ServiceConfig = Field(default_factory=ServiceConfig)
    """How `sharpen serve-env` admits work and when it forgets idle episodes; read by the server."""
    fleet: ServiceFleetConfig | None = None
    """The run starts the replicas itself, as Ray actors that each serve this section (and the run's [sandbox], for
    environments that run code, with ``fleet.backend``), and runs its episodes on them: it fills ``remote.urls``
    (``remote``'s other settings, or their defaults, apply to the calls)."""

    @model_validator(mode="after")
    def _check_remote(self) -> EpisodeLimitsSection:
        if self.remote is not None and not self.remote.urls and self.fleet is None:
            raise ValueError(
                "environment.remote needs the replicas' URLs in environment.remote.urls (or an environment.fleet)"
            )
        return self
