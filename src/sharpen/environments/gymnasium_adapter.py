"""An adapter that turns a gymnasium environment with a discrete action space into a text `Environment`.

Observations are shown as text: the environment's ANSI rendering (``render_mode="ansi"``; colour codes are
stripped, a highlighted cell such as the agent's is shown in brackets) when it has one, else
``str(observation)``. The policy names an action by its index or by one of ``action_names`` (the last one
mentioned in its turn); an unreadable action costs a turn and is answered with the legal actions. Rewards,
termination and truncation are gymnasium's. The gymnasium seed is the example's ``metadata["env_seed"]`` (so a
group's samples face the same layout), else the episode seed.
"""

from __future__ import annotations

import re
from typing import Any

from sharpen.environments.base import EpisodeContext, StepResult
from sharpen.types import Example, Message

_HIGHLIGHT = re.compile(r"\x1b\[4[0-7](?:;[0-9]+)*m(.*?)\x1b\[0m")  # a background colour marks e.g. the agent
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class GymnasiumEnvironment:
    name = "gymnasium"
    version = "1"

    def __init__(
        self,
        env_id: str,
        *,
        env_kwargs: dict[str, Any] | None = None,
        action_names: list[str] | None = None,
        instructions: str = "",
    ) -> None:
        self.env_id = env_id
        self.env_kwargs = dict(env_kwargs or {})
        self.action_names = [name.casefold() for name in action_names or []]
        self.instructions = instructions
        self.env: Any = None

    @staticmethod
    def make_tasks(num_tasks: int, *, seed: int, env_id: str, instructions: str) -> list[Example]:
        """``num_tasks`` episodes of ``env_id``, each with its own gymnasium seed."""
        return [
            Example(
                task_key=f"{env_id}/{index}",
                prompt=(Message(role="system", content=instructions),),
                metadata={"source": "gymnasium", "env_seed": seed * 1_000_003 + index},
            )
            for index in range(num_tasks)
        ]

    async def reset(self, example: Example, ctx: EpisodeContext) -> list[Message]:
        import gymnasium  # only environments that use it pay for the import

        self.env = gymnasium.make(self.env_id, render_mode="ansi", **self.env_kwargs)
        if not isinstance(self.env.action_space, gymnasium.spaces.Discrete):
            raise ValueError(f"gymnasium environment {self.env_id}: only discrete action spaces can be played as text")
        num_actions = int(self.env.action_space.n)
        if self.action_names and len(self.action_names) != num_actions:
            raise ValueError(f"{self.env_id} has {num_actions} actions but {len(self.action_names)} action_names")
        observation, _ = self.env.reset(seed=int(example.metadata.get("env_seed", ctx.seed)))
        system = [m for m in example.prompt if m.role == "system"] or [
            Message(role="system", content=self.instructions)
        ]
        return [*system, Message(role="user", content=self._describe(observation))]

    async def step(self, action: str) -> StepResult:
        assert self.env is not None, "step() before reset()"
        index = self._parse_action(action)
        if index is None:
            legal = ", ".join(self.action_names) or f"0 to {self.env.action_space.n - 1}"
            return StepResult(observation=[Message(role="user", content=f"Unknown action. Legal actions: {legal}.")])
        observation, reward, terminated, truncated, _ = self.env.step(index)
        if terminated or truncated:
            self.env.close()
        return StepResult(
            observation=[Message(role="user", content=self._describe(observation))],
            reward=float(reward),
            terminated=bool(terminated),
            truncated=bool(truncated),
            info={"action": index},
        )

    def _parse_action(self, text: str) -> int | None:
        words = re.findall(r"[a-z]+|\d+", text.casefold())
        for word in reversed(words):
            if word.isdigit() and int(word) < self.env.action_space.n:
                return int(word)
            if word in self.action_names:
                return self.action_names.index(word)
        return None

    def _describe(self, observation: Any) -> str:
        rendered = self.env.render()
        if not isinstance(rendered, str):
            return f"Observation: {observation}"
        return _ANSI.sub("", _HIGHLIGHT.sub(r"[\1]", rendered)).strip()
