"""The Rubric: the default reward function, a weighted sum of named components.

Owns two things. `VerifierReward`, the built-in component: extract the answer in the configured format, pick the
verifier for the example's data source, score ``correct_weight * correct + format_weight * format``, set the status;
a verifier that crashes abstains (``score=None``, INFRA_ERROR) so a scorer bug never reads as a wrong answer. And
`Rubric`, which adds the ``[[reward.components]]`` (judge, reward model, length, custom; see `components`) to it:
``score = verifier score + sum(weight_i * score_i)``. A component with weight 0 is computed and logged only; when
a weighted one abstains, the whole verdict abstains with its status, never a made-up 0.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from sharpen.config.rewards import RewardConfig
from sharpen.rewards.answers import extract_answer
from sharpen.rewards.base import RewardContractError, RewardFn
from sharpen.rewards.components import build_component
from sharpen.rewards.judge import Judge
from sharpen.rewards.math_verify import MathVerifyVerifier
from sharpen.rewards.verifiers import CompletionVerifier, ExactMatchVerifier, ReasoningGymVerifier, Verifier
from sharpen.types import Example, RewardResult, RewardStatus

logger = logging.getLogger(__name__)


def default_verifiers() -> dict[str, Verifier]:
    """One verifier per name that `sharpen.data.load_examples` writes: ``metadata["verifier"]`` when the data
    names one (``data.verifier`` of JSONL and HF data), else ``metadata["source"]``. The math pool starts on its
    first use."""
    return {
        "reasoning_gym": ReasoningGymVerifier(),
        "jsonl": ExactMatchVerifier(),
        "exact_match": ExactMatchVerifier(),
        "math": MathVerifyVerifier(),
    }


class VerifierReward:
    """``score = correct_weight * correct + format_weight * format``; a `RewardFn`, the Rubric's default component."""

    def __init__(self, config: RewardConfig, *, verifiers: Mapping[str, Verifier] | None = None) -> None:
        self.config = config
        self._verifiers = dict(verifiers) if verifiers is not None else default_verifiers()

    def __call__(self, example: Example, completion: str) -> RewardResult:
        verifier = self._verifier_for(example)
        answer = extract_answer(completion, self.config.answer_format)
        if answer is None:
            return self._result(correct=0.0, is_formatted=False, status=RewardStatus.FORMAT_ERROR, verifier=verifier)
        try:
            if isinstance(verifier, CompletionVerifier):  # every final answer in the completion counts (math)
                correct = verifier.score_completion(example, completion, answer)
            else:
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


def score_weights(config: RewardConfig) -> dict[str, float]:
    """The weight of each named component in the score the `Rubric` builds from ``config``: the verifier's
    ``correct`` and ``format``, then each ``[[reward.components]]`` entry (0: logged only). The group-level step
    of ``reward.component_normalization`` rebuilds scores with them."""
    return {
        "correct": config.correct_weight,
        "format": config.format_weight,
        **{component.name: component.weight for component in config.components},
    }


@dataclass(kw_only=True, slots=True, frozen=True)
class WeightedComponent:
    """One ``[[reward.components]]`` entry, built."""

    name: str
    weight: float
    """0: computed and logged, not part of the score."""
    reward_fn: RewardFn


class Rubric:
    """The run's reward: the default component (``base``: the `VerifierReward` unless the data brings its own
    scorer, e.g. HumanEval's tests) plus the weighted components of ``config.components``; a `RewardFn`.

    ``components`` supplies ready reward functions by component name (the Ray reward-model pool, a test's fake);
    the others are built from their config. With no extra components the verdict is exactly the base's."""

    def __init__(
        self,
        config: RewardConfig,
        *,
        verifiers: Mapping[str, Verifier] | None = None,
        base: RewardFn | None = None,
        components: Mapping[str, RewardFn] | None = None,
        count_tokens: Callable[[str], int] | None = None,
    ) -> None:
        self.config = config
        self.base: RewardFn = base if base is not None else VerifierReward(config, verifiers=verifiers)
        # The built-in verifier weighs its own parts; with both weights 0 it is logged only, like any component.
        self.is_base_weighted = base is not None or config.correct_weight > 0 or config.format_weight > 0
        given = dict(components or {})
        unknown = sorted(set(given) - {c.name for c in config.components})
        if unknown:
            raise ValueError(f"Rubric: components {unknown} are not in reward.components")
        self.components = [
            WeightedComponent(
                name=c.name,
                weight=c.weight,
                reward_fn=given[c.name] if c.name in given else build_component(c, count_tokens=count_tokens),
            )
            for c in config.components
        ]

    def __call__(self, example: Example, completion: str) -> RewardResult:
        base = self.base(example, completion)
        if not self.components:
            return base
        results = [self._score(c, example, completion) for c in self.components]
        return self._combine(base, results)

    def judges(self) -> dict[str, Judge]:
        """The judge components by name (whose canaries `sharpen.rewards.canaries` runs)."""
        return {c.name: c.reward_fn for c in self.components if isinstance(c.reward_fn, Judge)}

    def _score(self, component: WeightedComponent, example: Example, completion: str) -> RewardResult:
        try:
            return component.reward_fn(example, completion)
        except RewardContractError:  # a bug in the component, the same on every rollout: stop the run
            raise
        except Exception:  # fault tolerance: one failing service abstains for its component, not the whole run
            logger.warning(
                "reward component %s failed on %s; abstaining", component.name, example.task_key, exc_info=True
            )
            return RewardResult(score=None, status=RewardStatus.INFRA_ERROR, verifier=component.name)

    def _combine(self, base: RewardResult, results: list[RewardResult]) -> RewardResult:
        weighted = [
            (self.is_base_weighted, base),
            *((c.weight > 0, r) for c, r in zip(self.components, results, strict=True)),
        ]
        combined = RewardResult(
            score=None,
            status=base.status,
            components=dict(base.components),
            verifier="+".join(r.verifier for r in [base, *results]),
            verifier_version=self._version([base, *results]),
            hack_flags=list(dict.fromkeys(flag for r in [base, *results] for flag in r.hack_flags)),
        )
        for component, result in zip(self.components, results, strict=True):
            if result.score is not None:
                combined.components[component.name] = result.score
        abstained = next((r for is_weighted, r in weighted if is_weighted and r.score is None), None)
        if abstained is not None:
            combined.status = abstained.status
            return combined
        # the status says whether the answer was right: the first weighted component's (the verifier's, usually)
        combined.status = next((r.status for is_weighted, r in weighted if is_weighted), base.status)
        combined.score = (base.score or 0.0) if self.is_base_weighted else 0.0
        for component, result in zip(self.components, results, strict=True):
            if component.weight > 0:
                assert result.score is not None  # weighted abstentions returned above
                combined.score += component.weight * result.score
        return combined

    def _version(self, results: list[RewardResult]) -> str:
        """Hash of what the combination is made of (names, weights, each verifier and version)."""
        names = ["base", *(c.name for c in self.components)]
        weights = [float(self.is_base_weighted), *(c.weight for c in self.components)]
        parts = [[n, w, r.verifier, r.verifier_version] for n, w, r in zip(names, weights, results, strict=True)]
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]
