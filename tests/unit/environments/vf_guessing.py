"""A multi-turn verifiers environment for the adapter's tests: its `Env` plays the user of a guessing game, turn by
turn, through ``agents.player.interaction`` (as verifiers' own textarena environment does), and records the reward
(importable by id ``vf-guessing`` while this folder is on ``sys.path``)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import verifiers.v1 as vf

SECRETS = [6, 3, 8, 5]
MAX_GUESSES = 4


class GuessData(vf.TaskData):
    secret: int


class GuessTask(vf.Task[GuessData, vf.State, vf.TaskConfig]):
    pass


class GuessTaskset(vf.Taskset[GuessTask, vf.TasksetConfig]):
    def load(self) -> Iterator[GuessTask]:
        for secret in SECRETS:
            data = GuessData.model_validate(
                {"prompt": "Guess my number from 1 to 9. Reply with one number.", "secret": secret}
            )
            yield GuessTask(data, self.config.task)


class GuessEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task: Any, agents: Any) -> None:
        secret = task.data.secret
        guesses: list[int] = []
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()
            while not segment.terminated and len(guesses) < MAX_GUESSES:
                numbers = re.findall(r"\d+", segment.last_reply)
                guesses.append(int(numbers[-1]) if numbers else 0)
                if guesses[-1] == secret:
                    break
                segment = await interaction.turn("Higher." if guesses[-1] < secret else "Lower.")
        interaction.trace.record_reward("solved", 1.0 if secret in guesses else 0.0)
        interaction.trace.record_metric("num_guesses", len(guesses))


__all__ = ["GuessEnv", "GuessTaskset"]
