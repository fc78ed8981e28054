"""Rubric: components, weights, statuses, verifier choice by data source, and abstaining when a verifier crashes."""

from __future__ import annotations

import logging

import pytest

from sharpen.config.schema import ReasoningGymDataConfig, RewardConfig
from sharpen.data import load_examples
from sharpen.rewards import RewardFn, Rubric
from sharpen.types import Example, Message, RewardStatus


def _jsonl_example(answer: str = "19") -> Example:
    return Example(
        task_key="t/0", prompt=(Message(role="user", content="12+7?"),), answer=answer, metadata={"source": "jsonl"}
    )


def test_rubric_is_a_reward_fn():
    assert isinstance(Rubric(RewardConfig()), RewardFn)


@pytest.mark.parametrize(
    ("completion", "status", "correct", "format_score"),
    [
        ("12+7 is 19. <answer>19.0</answer>", RewardStatus.OK, 1.0, 1.0),
        ("<answer>18</answer>", RewardStatus.WRONG, 0.0, 1.0),
        ("the answer is 19", RewardStatus.FORMAT_ERROR, 0.0, 0.0),
    ],
)
def test_statuses_components_and_weights(completion, status, correct, format_score):
    rubric = Rubric(RewardConfig(correct_weight=2.0, format_weight=0.5))
    result = rubric(_jsonl_example(), completion)
    assert result.status is status
    assert result.components == {"correct": correct, "format": format_score}
    assert result.score == pytest.approx(2.0 * correct + 0.5 * format_score)
    assert result.verifier == "exact_match"


def test_default_weights_score_is_correctness_only():
    result = Rubric(RewardConfig())(_jsonl_example(), "<answer>18</answer>")
    assert result.score == 0.0 and result.components["format"] == 1.0


def test_last_line_format():
    rubric = Rubric(RewardConfig(answer_format="last_line"))
    assert rubric(_jsonl_example(), "thinking\n19\n").status is RewardStatus.OK
    assert rubric(_jsonl_example(), "<answer>19</answer>\nso that's it").status is RewardStatus.WRONG
    assert rubric(_jsonl_example(), "  \n").status is RewardStatus.FORMAT_ERROR


def test_reasoning_gym_examples_use_reasoning_gym_scoring():
    rubric = Rubric(RewardConfig(format_weight=0.1))
    example = load_examples(ReasoningGymDataConfig(task="basic_arithmetic", size=1), seed=0)[0]
    right = rubric(example, f"<answer>{example.answer}</answer>")
    assert right.status is RewardStatus.OK and right.score == pytest.approx(1.1)
    assert right.verifier == "reasoning_gym"
    partial = rubric(example, f"<answer>{example.answer} or so</answer>")  # reasoning-gym's partial credit
    assert partial.status is RewardStatus.WRONG
    assert 0.0 < partial.components["correct"] < 1.0


class _CrashingVerifier:
    name = "crashy"

    def __call__(self, example: Example, answer: str) -> float:
        raise RuntimeError("third-party scorer blew up")


def test_crashing_verifier_abstains_with_infra_error(caplog):
    rubric = Rubric(RewardConfig(), verifiers={"jsonl": _CrashingVerifier()})
    with caplog.at_level(logging.WARNING, logger="sharpen.rewards.rubric"):
        result = rubric(_jsonl_example(), "<answer>19</answer>")
    assert result.score is None
    assert result.status is RewardStatus.INFRA_ERROR
    assert result.verifier == "crashy"
    assert "crashy failed on t/0" in caplog.text and "blew up" in caplog.text
    # No answer: a format error is decided before the verifier runs, so it is still scored.
    assert rubric(_jsonl_example(), "nothing").status is RewardStatus.FORMAT_ERROR


def test_missing_reference_answer_abstains():
    example = Example(task_key="t/1", prompt=(), metadata={"source": "jsonl"})
    result = Rubric(RewardConfig())(example, "<answer>1</answer>")
    assert result.score is None and result.status is RewardStatus.INFRA_ERROR


def test_unknown_source_is_a_clear_error():
    example = Example(task_key="t/0", prompt=(), answer="1", metadata={"source": "hf"})
    with pytest.raises(ValueError, match="metadata source 'hf'; no verifier for it"):
        Rubric(RewardConfig())(example, "<answer>1</answer>")


def test_jsonl_data_can_ask_for_math_equivalence(tmp_path):
    from sharpen.config.schema import JsonlDataConfig

    path = tmp_path / "math.jsonl"
    path.write_text('{"prompt": "Half of one?", "answer": "\\\\frac{1}{2}"}\n')
    [example] = load_examples(JsonlDataConfig(path=str(path), verifier="math"), seed=0)
    assert example.metadata["verifier"] == "math"
    rubric = Rubric(RewardConfig())
    assert rubric(example, "<answer>0.5</answer>").score == 1.0  # equivalent, not equal
    assert rubric(example, "<answer>0.25</answer>").status == RewardStatus.WRONG
    [exact] = load_examples(JsonlDataConfig(path=str(path)), seed=0)
    assert rubric(exact, "<answer>0.5</answer>").score == 0.0  # the default is exact match
