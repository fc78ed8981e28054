"""A multi-turn text game: guess a secret whole number; after each guess the environment says higher or lower.

It is the smallest real multi-turn task: the policy must read the feedback of earlier turns to do better than
chance, the reward comes from the environment (1 when found, 0 otherwise), and a task is fully determined by its
`Example` (the secret is the example's answer), so every sample of a group plays the same game.
"""

from __future__ import annotations

import random
import re

from sharpen.environments.base import EpisodeContext, StepResult
from sharpen.types import Example, Message

_INTEGER = re.compile(r"-?\d+")


class GuessNumberEnvironment:
    name = "guess_number"
    version = "1"

    def __init__(self, *, low: int = 1, high: int = 16) -> None:
        if low >= high:
            raise ValueError(f"guess_number: low ({low}) must be below high ({high})")
        self.low, self.high = low, high
        self.secret: int | None = None

    @staticmethod
    def make_tasks(num_tasks: int, *, seed: int, low: int = 1, high: int = 16) -> list[Example]:
        """``num_tasks`` games with secrets drawn from ``seed``."""
        rng = random.Random(seed)
        prompt = (
            Message(
                role="user",
                content=f"I am thinking of a whole number from {low} to {high}. Guess it: reply with one number. "
                "After each guess I will tell you whether my number is higher or lower.",
            ),
        )
        return [
            Example(
                task_key=f"guess_number/{index}",
                prompt=prompt,
                answer=str(rng.randint(low, high)),
                metadata={"source": "guess_number", "low": low, "high": high},
            )
            for index in range(num_tasks)
        ]

    async def reset(self, example: Example, ctx: EpisodeContext) -> list[Message]:
        if example.answer is None or not _INTEGER.fullmatch(example.answer.strip()):
            raise ValueError(f"guess_number: example {example.task_key} needs a whole-number answer (the secret)")
        self.secret = int(example.answer)
        return list(example.prompt)

    async def step(self, action: str) -> StepResult:
        assert self.secret is not None, "step() before reset()"
        numbers = _INTEGER.findall(action)
        if not numbers:
            return StepResult(observation=[Message(role="user", content="Reply with one whole number.")], reward=0.0)
        guess = int(numbers[-1])
        if guess == self.secret:
            return StepResult(reward=1.0, terminated=True, info={"guess": guess})
        hint = "higher" if self.secret > guess else "lower"
        return StepResult(
            observation=[Message(role="user", content=f"No, my number is {hint} than {guess}.")],
            reward=0.0,
            info={"guess": guess},
        )
