"""Verifiers: how right an extracted answer is, as a float in [0, 1], for each kind of data source.

Owns correctness only. Finding the answer in the completion is `answers.py`; weighting, statuses and abstaining on
a crash are the `Rubric`'s. A verifier that cannot judge raises; it never returns a made-up score.
"""

from __future__ import annotations

import json
import math
import threading
from typing import Any, Protocol, runtime_checkable

from sharpen.types import Example


class Verifier(Protocol):
    """Scores an extracted answer against what the example knows about the right one."""

    name: str

    def __call__(self, example: Example, answer: str) -> float: ...


@runtime_checkable
class CompletionVerifier(Verifier, Protocol):
    """A verifier that also reads the whole completion, for kinds of answer where every final answer in it counts
    (math: a second, different boxed answer beside the tagged one is a hedge). The `Rubric` calls
    `score_completion` instead of ``__call__`` when a verifier has it."""

    def score_completion(self, example: Example, completion: str, answer: str) -> float:
        """The score of ``completion``, whose answer in the requested format is ``answer``."""
        ...


class ReasoningGymVerifier:
    """Reasoning-gym's own scorer for the example's task (``dataset.score_answer(answer, entry)``).

    Works from ``Example.metadata`` alone (``task``, ``entry`` and the ``dataset_kwargs`` that generated it, as
    written by `sharpen.data.load_examples`; without them, the task's default config), so it scores examples that
    crossed a process boundary. Dataset objects are built once per (task, kwargs) and cached: some tasks load word
    lists or puzzles when built.
    """

    name = "reasoning_gym"

    def __init__(self) -> None:
        self._datasets: dict[tuple[str, str], Any] = {}
        self._lock = threading.Lock()

    def __call__(self, example: Example, answer: str) -> float:
        metadata = example.metadata
        dataset = self._dataset(metadata["task"], metadata.get("dataset_kwargs", {}))
        score = float(dataset.score_answer(answer, metadata["entry"]))
        if not 0.0 <= score <= 1.0:  # also rejects NaN
            raise ValueError(f"reasoning-gym task {metadata['task']!r} scored {score}, outside [0, 1]")
        return score

    def _dataset(self, task: str, dataset_kwargs: dict[str, Any]) -> Any:
        key = (task, json.dumps(dataset_kwargs, sort_keys=True))
        with self._lock:
            if key not in self._datasets:
                import reasoning_gym  # slow to import (~2 s): only when a reasoning-gym example is scored

                self._datasets[key] = reasoning_gym.create_dataset(task, **dataset_kwargs)
            return self._datasets[key]


class ExactMatchVerifier:
    """1.0 when the answer equals ``example.answer`` up to whitespace and case, or numerically ("19" == "19.0")."""

    name = "exact_match"

    def __call__(self, example: Example, answer: str) -> float:
        if example.answer is None:
            raise ValueError(f"example {example.task_key} has no reference answer to match")
        return 1.0 if answers_match(answer, example.answer) else 0.0


def answers_match(answer: str, reference: str) -> bool:
    """Equal after collapsing whitespace and case, or both finite numbers that are equal (to 1e-9 relative)."""
    normalized, normalized_reference = _normalize(answer), _normalize(reference)
    if normalized == normalized_reference:
        return True
    number, reference_number = _as_number(normalized), _as_number(normalized_reference)
    if number is None or reference_number is None:
        return False
    return math.isclose(number, reference_number, rel_tol=1e-9, abs_tol=1e-12)


def _normalize(text: str) -> str:
    return " ".join(text.split()).casefold()


def _as_number(text: str) -> float | None:
    try:
        number = float(text)
    except ValueError:
        return None
    return number if math.isfinite(number) else None
