"""Verifiers: reasoning-gym's own scoring from Example.metadata alone, and exact match with numeric equality."""

from __future__ import annotations

import pickle

import pytest

from sharpen.config.schema import ReasoningGymDataConfig
from sharpen.data import load_examples
from sharpen.rewards import ExactMatchVerifier, ReasoningGymVerifier, answers_match
from sharpen.types import Example, Message


@pytest.mark.parametrize("task", ["basic_arithmetic", "chain_sum", "spell_backward"])
def test_reasoning_gym_scores_the_reference_answer_1_and_a_wrong_one_below_1(task):
    examples = load_examples(ReasoningGymDataConfig(task=task, size=5), seed=7)
    verifier = ReasoningGymVerifier()
    for example in examples:
        assert example.answer is not None
        # A copy that crossed a process boundary scores the same: only metadata is used.
        assert verifier(pickle.loads(pickle.dumps(example)), example.answer) == 1.0
        assert 0.0 <= verifier(example, "definitely not it") < 1.0  # spell_backward gives similarity credit
        assert 0.0 <= verifier(example, "x" + example.answer) < 1.0


def test_reasoning_gym_uses_each_task_own_scoring_rule():
    # chain_sum compares decimals ("5.00" == "5"); basic_arithmetic keeps the base rule: partial credit
    # len(reference) / len(answer) when the reference is inside the answer.
    verifier = ReasoningGymVerifier()
    for task, expected in (("chain_sum", lambda ref: 1.0), ("basic_arithmetic", lambda ref: len(ref) / (len(ref) + 3))):
        example = load_examples(ReasoningGymDataConfig(task=task, size=1), seed=0)[0]
        assert example.answer is not None
        assert verifier(example, example.answer + ".00") == pytest.approx(expected(example.answer))


def test_reasoning_gym_caches_datasets():
    examples = load_examples(ReasoningGymDataConfig(size=3), seed=0)
    verifier = ReasoningGymVerifier()
    for example in examples:
        verifier(example, "1")
    assert len(verifier._datasets) == 1


def test_reasoning_gym_score_outside_0_1_raises(monkeypatch):
    # Real case: spell_backward sums 1/len per matching letter, so "abc" + "x" can score 1.0000000000000002.
    import reasoning_gym

    class _Dataset:
        def score_answer(self, answer, entry):
            return 1.0000000000000002

    monkeypatch.setattr(reasoning_gym, "create_dataset", lambda task, **kwargs: _Dataset())
    example = Example(task_key="t/0", prompt=(), metadata={"task": "spell_backward", "entry": {}})
    with pytest.raises(ValueError, match=r"'spell_backward' scored 1.0000000000000002, outside \[0, 1\]"):
        ReasoningGymVerifier()(example, "x")


def _example(answer: str | None) -> Example:
    return Example(task_key="t/0", prompt=(Message(role="user", content="q"),), answer=answer)


@pytest.mark.parametrize(
    ("answer", "reference", "expected"),
    [
        ("19", "19.0", True),
        ("19.0", "19", True),
        ("1e3", "1000", True),
        ("-0.5", "-.5", True),
        ("0.1", "0.1000001", False),
        ("0.3", "0.30000000000000004", True),  # float noise is equal
        ("Paris", " paris ", True),
        ("New   York", "new york", True),
        ("New York", "NewYork", False),
        ("20", "19", False),
        ("nan", "nan", True),  # equal as text
        ("inf", "1e400", False),  # non-finite numbers only match as text
    ],
)
def test_answers_match(answer, reference, expected):
    assert answers_match(answer, reference) is expected


def test_exact_match_verifier():
    verifier = ExactMatchVerifier()
    assert verifier(_example("19"), "19.0") == 1.0
    assert verifier(_example("19"), "18") == 0.0
    with pytest.raises(ValueError, match="no reference answer"):
        verifier(_example(None), "19")
