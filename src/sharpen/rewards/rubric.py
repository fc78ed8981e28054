"""The Rubric: the default reward function, a weighted sum of named components (``correct``, ``format``).

Owns turning one completion into a `RewardResult`: extract the answer in the configured format, pick the verifier
for the example's data source, weigh the components, set the status. A verifier that crashes makes the rubric
abstain (``score=None``, INFRA_ERROR) so a scorer bug never reads as a wrong answer.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from sharpen.config.schema import RewardConfig
from sharpen.rewards.answers import extract_answer
from sharpen.rewards.math_verify import MathVerifyVerifier
from sharpen.rewards.verifiers import ExactMatchVerifier, ReasoningGymVerifier, Verifier
from sharpen.types import Example, RewardResult, RewardStatus

logger = logging.getLogger(__name__)


def default_verifiers() -> dict[str, Verifier]:
    """One verifier per name that `sharpen.data.load_examples` writes: ``metadata["verifier"]`` when the data
    names one (JSONL's ``data.verifier``), else ``metadata["source"]``. The math pool starts on its first use."""
    return {
        "reasoning_gym": ReasoningGymVerifier(),
        "jsonl": ExactMatchVerifier(),
        "exact_match": ExactMatchVerifier(),
        "math": MathVerifyVerifier(),
    }


class Rubric:
    """``score = correct_weight * correct + format_weight * format``; a `RewardFn`."""

    def __init__(self, config: RewardConfig, *, verifiers: Mapping[str, Verifier] | None = None) -> None:
        self.config = config
        self._verifiers = dict(verifiers) if verifiers is not None else default_verifiers()

    def __call__(self, example: Example, completion: str) -> RewardResult:
        verifier = self._verifier_for(example)
        answer = extract_answer(completion, self.config.answer_format)
        if answer is None:
            return self._result(correct=0.0, is_formatted=False, status=RewardStatus.FORMAT_ERROR, verifier=verifier)
        try:
            correct = verifier(example, answer)
        except Exception:  # a bug or crash in the scorer (often third-party): abstain rather than score 0
            logger.warning("verifier %s failed on %s; abstaining", verifier.name, example.task_key, exc_info=True)
            return RewardResult(
                score=None, status=RewardStatus.INFRA_ERROR, components={"format": 1.0}, verifier=verifier.name
            )
        status = RewardStatus.OK if correct >= 1.0 else RewardStatus.WRONG
        return self._result(correct=correct, is_formatted=True, status=status, verifier=verifier)

    def _verifier_for(self, example: Example) -> Verifier:
        source = example.metadata.get("verifier", example.metadata.get("source"))
        if source not in self._verifiers:
            raise ValueError(
                f"Rubric: example {example.task_key} has metadata source {source!r}; "
                f"no verifier for it (known: {', '.join(self._verifiers)})"
            )
        return self._verifiers[source]

    def _result(self, *, correct: float, is_formatted: bool, status: RewardStatus, verifier: Verifier) -> RewardResult:
        format_score = 1.0 if is_formatted else 0.0
        score = self.config.correct_weight * correct + self.config.format_weight * format_score
        return RewardResult(
            score=score,
            status=status,
            components={"correct": correct, "format": format_score},
            verifier=verifier.name,
        )
