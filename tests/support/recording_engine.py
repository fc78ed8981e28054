"""`RecordingEngine`: a scripted engine that keeps every prompt it served and the completion it gave, for the tests
that check the tokens an agent's episode trains on are exactly the engine's."""

from __future__ import annotations

from typing import Any

from sharpen.rollout.engines.scripted import ScriptedEngine
from sharpen.types import Completion, SamplingParams


class RecordingEngine(ScriptedEngine):
    """A scripted engine (texts in turn, each ended by the tokenizer's EOS) that keeps ``served``: every (prompt,
    completion) pair, in order."""

    def __init__(self, tokenizer: Any, texts: list[str]) -> None:
        super().__init__(
            texts, encode=lambda t: tokenizer.encode(t, add_special_tokens=False), eos_token_id=tokenizer.eos_token_id
        )
        self.served: list[tuple[list[int], Completion]] = []

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        completions = super().generate(prompts, params)
        self.served.extend(zip(prompts, completions, strict=True))
        return completions
