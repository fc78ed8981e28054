"""The state of the episodes in flight and what they become: `EpisodeState` (one episode's tokens, masks, versions
and record so far), `Groups` (each group made once its last episode has ended), `PromptCache` (each distinct first
observation rendered once) and `rollout_of` (an ended episode -> its `Rollout`, an agent's earlier segments
included).

Owns the data of the episode loop, not its control flow (`sharpen.rollout.episodes` drives the turns,
`sharpen.rollout.agent_episodes` the agents).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sharpen.data import render_prompt
from sharpen.data.vision import VisionProcessor
from sharpen.environments import EpisodeContext
from sharpen.environments.base import AgentEnvironment, Environment
from sharpen.rollout.agent_session import Segment
from sharpen.types import (
    EpisodeRecord,
    Example,
    ExpertRoutes,
    ImagePart,
    Message,
    Rollout,
    RolloutGroup,
    prompt_images,
)


@dataclass(kw_only=True)
class EpisodeState:
    """One episode in flight."""

    example_index: int
    sample_index: int
    environment: Environment | AgentEnvironment
    context: EpisodeContext
    record: EpisodeRecord
    prompt_ids: list[int] = field(default_factory=list[int])
    images: tuple[ImagePart, ...] = ()
    """The images the prompt ids hold placeholders for (a vision-language model's first prompt)."""
    completion_ids: list[int] = field(default_factory=list[int])
    logprobs: list[float] = field(default_factory=list[float])
    versions: list[int] = field(default_factory=list[int])
    loss_mask: list[bool] = field(default_factory=list[bool])
    routes: ExpertRoutes | None = None
    """A Mixture-of-Experts engine's routes of the tokens so far (each token's from the first call that ran it);
    None once a call returned none."""
    routes_lost: bool = False
    last_text: str = ""
    env_seconds: float = 0.0
    deadline: float | None = None
    """``time.monotonic()`` by which the episode must end (``rollout.episode_timeout_s``; None: no limit)."""
    is_done: bool = False
    is_truncated: bool = False
    segments: list[Segment] = field(default_factory=list[Segment])
    """An agent episode's earlier segments (its history was rewritten); the tokens above are its last one."""

    def add_routes(self, routes: ExpertRoutes | None) -> None:
        """The routes a model call returned for the episode's tokens before it and the ones it generated."""
        if routes is None or self.routes_lost:
            self.routes, self.routes_lost = None, True
            return
        self.routes = routes if self.routes is None else self.routes.extended_by(routes)

    def end(self, reason: str, *, is_truncated: bool) -> None:
        self.is_done = True
        self.is_truncated = is_truncated
        self.record.stop_reason = reason

    def environment_budget(self) -> tuple[float | None, str]:
        """How long the environment's next call may take, and the stop reason if it takes longer: the rest of its
        wall-clock budget (``wall_clock``) or of the episode's time (``episode_timeout``), whichever ends first."""
        budget = self.context.wall_seconds
        left = None if budget is None else max(budget - self.env_seconds, 0.0)
        episode_left = self.time_left()
        if episode_left is not None and (left is None or episode_left < left):
            return episode_left, "episode_timeout"
        return left, "wall_clock"

    def time_left(self) -> float | None:
        return None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)


class PromptCache:
    """The first prompts of a run's episodes, each distinct observation rendered once (a group's samples share one):
    a chat template is the costliest part of an episode with a real tokenizer (SmolLM2's: ~0.25 ms a prompt).
    ``vision`` (a vision-language model's `data.vision.VisionProcessor`) renders observations that hold images; without
    one they are an error (`chat.render_prompt`)."""

    def __init__(self, tokenizer: Any, *, vision: VisionProcessor | None = None) -> None:
        self.tokenizer = tokenizer
        self.vision = vision
        self._ids: dict[tuple[Message, ...], list[int]] = {}

    def render(self, observation: list[Any]) -> list[int]:
        if not all(isinstance(message, Message) for message in observation):
            return render_prompt(self.tokenizer, observation)
        key = tuple(observation)
        ids = self._ids.get(key)
        if ids is None:
            if self.vision is not None and prompt_images(key):
                ids = self._ids[key] = self.vision.render_prompt(key)
            else:
                ids = self._ids[key] = render_prompt(self.tokenizer, observation)
        return list(ids)  # each rollout owns its list

    @staticmethod
    def images_of(observation: list[Any]) -> tuple[ImagePart, ...]:
        """The images of a rendered observation, in order (none for OpenAI-style dict messages)."""
        return prompt_images([m for m in observation if isinstance(m, Message)])


class Groups:
    """The run's groups, each made (and handed to ``on_group``) once all of its episodes have ended."""

    def __init__(
        self, examples: list[Example], episodes: list[EpisodeState], on_group: Callable[[RolloutGroup], None] | None
    ) -> None:
        self.examples = examples
        self.members: list[list[EpisodeState]] = [[] for _ in examples]
        for episode in episodes:
            self.members[episode.example_index].append(episode)
        self.on_group = on_group
        self.groups: list[RolloutGroup | None] = [None] * len(examples)
        self._ended: set[int] = set()

    def ended(self, episode: EpisodeState) -> None:
        if id(episode) in self._ended:
            return
        self._ended.add(id(episode))
        index = episode.example_index
        if all(id(member) in self._ended for member in self.members[index]):
            group = RolloutGroup(
                example=self.examples[index],
                rollouts=[rollout_of(self.examples[index], e) for e in self.members[index]],
            )
            self.groups[index] = group
            if self.on_group is not None:
                self.on_group(group)

    def all(self) -> list[RolloutGroup]:
        missing = [self.examples[i].task_key for i, group in enumerate(self.groups) if group is None]
        assert not missing, f"episodes of {missing} never ended"
        return [group for group in self.groups if group is not None]


def rollout_of(example: Example, episode: EpisodeState) -> Rollout:
    is_multi_turn = not all(episode.loss_mask)
    num_tokens = len(episode.prompt_ids) + len(episode.completion_ids)  # the last observation's routes are unknown
    segments = [
        Rollout(
            example=example,
            prompt_ids=s.prompt_ids,
            completion_ids=s.completion_ids,
            completion_logprobs=s.logprobs,
            versions=s.versions,
            completion_text=s.calls[-1].text,
            loss_mask=s.loss_mask,
            sample_index=episode.sample_index,
            routes=s.routes(),
        )
        for s in episode.segments
    ]
    return Rollout(
        segments=segments,
        example=example,
        prompt_ids=episode.prompt_ids,
        completion_ids=episode.completion_ids,
        completion_logprobs=episode.logprobs,
        versions=episode.versions,
        images=episode.images,
        routes=None if episode.routes is None else episode.routes.padded_to(num_tokens),
        completion_text=episode.last_text,
        is_truncated=episode.is_truncated,
        loss_mask=episode.loss_mask if is_multi_turn else None,
        episode=episode.record,
        sample_index=episode.sample_index,
    )
