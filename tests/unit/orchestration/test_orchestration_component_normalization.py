"""reward.component_normalization = "group" (GDPO): the Rubric's weighted components normalised within the group
before the weighted sum, on hand-computed groups with two components of very different scales."""

from __future__ import annotations

import math
from typing import Any, Literal

import pytest

from sharpen.config.rewards import CustomComponentConfig, RewardConfig
from sharpen.config.schema import SharpenConfig
from sharpen.orchestration.phases import assign_advantages, reward_metrics, score_groups
from sharpen.rewards import Rubric, score_weights
from sharpen.types import Example, Message, RewardResult, RewardStatus, Rollout, RolloutGroup

EPS = 1e-6  # compute_grpo_advantages' default

# Four rollouts: correct [1, 0, 1, 0] (weight 1), and a "big" component [100, 300, 200, 400] (weight 0.5) whose
# scale drowns correctness in the raw score: [51, 150, 101, 200] ranks the wrong answers first.
_COMPLETIONS = ["<answer>1</answer> a", "<answer>2</answer>", "<answer>1</answer> b", "<answer>3</answer>"]
_BIG_BY_COMPLETION = dict(zip(_COMPLETIONS, [100.0, 300.0, 200.0, 400.0], strict=True))
# correct: mean 1/2, unbiased std sqrt((4 * 1/4) / 3) = sqrt(1/3)
_CORRECT_STD = math.sqrt(1 / 3)
# big: mean 250, deviations [-150, 50, -50, 150], squares sum to 50000, unbiased std sqrt(50000 / 3)
_BIG_STD = math.sqrt(50000 / 3)
_NORMALIZED_CORRECT = [d / (_CORRECT_STD + EPS) for d in (0.5, -0.5, 0.5, -0.5)]
_NORMALIZED_BIG = [d / (_BIG_STD + EPS) for d in (-150.0, 50.0, -50.0, 150.0)]
_SCORES = [c + 0.5 * b for c, b in zip(_NORMALIZED_CORRECT, _NORMALIZED_BIG, strict=True)]


class _BigComponent:
    """A component of large scale, keyed by completion; an unknown completion abstains."""

    def __call__(self, example: Example, completion: str) -> RewardResult:
        value = _BIG_BY_COMPLETION.get(completion)
        if value is None:
            return RewardResult(score=None, status=RewardStatus.INFRA_ERROR, verifier="big")
        return RewardResult(score=value, status=RewardStatus.OK, verifier="big")


def _config(normalization: Literal["none", "group"] = "group", **fields: Any) -> RewardConfig:
    big = CustomComponentConfig(name="big", weight=0.5, function="unused:unused")
    return RewardConfig(components=[big], component_normalization=normalization, **fields)


def _group(completions: list[str]) -> RolloutGroup:
    example = Example(
        task_key="t/0", prompt=(Message(role="user", content="q"),), answer="1", metadata={"source": "jsonl"}
    )
    rollouts = [
        Rollout(
            example=example,
            prompt_ids=[1],
            completion_ids=[5, 6],
            completion_logprobs=[-1.0, -1.0],
            versions=[0, 0],
            completion_text=text,
        )
        for text in completions
    ]
    return RolloutGroup(example=example, rollouts=rollouts)


def _scored(config: RewardConfig, completions: list[str] = _COMPLETIONS) -> RolloutGroup:
    group = _group(completions)
    score_groups(Rubric(config, components={"big": _BigComponent()}), [group], config=config)
    return group


def test_none_keeps_the_rubrics_raw_weighted_sum():
    group = _scored(_config("none"))
    assert group.scores == [51.0, 150.0, 101.0, 200.0]
    assert all("rubric_score" not in r.reward.components for r in group.rollouts if r.reward is not None)


def test_group_normalises_each_component_before_the_weighted_sum():
    group = _scored(_config())
    for rollout, score, correct, big, raw in zip(
        group.rollouts, _SCORES, _NORMALIZED_CORRECT, _NORMALIZED_BIG, [51.0, 150.0, 101.0, 200.0], strict=True
    ):
        assert rollout.reward is not None
        assert rollout.reward.score == pytest.approx(score, abs=1e-12)
        assert rollout.reward.components["normalized/correct"] == pytest.approx(correct, abs=1e-12)
        assert rollout.reward.components["normalized/big"] == pytest.approx(big, abs=1e-12)
        assert rollout.reward.components["rubric_score"] == raw
        assert "normalized/format" not in rollout.reward.components  # weight 0: logged, not part of the score
    scores = [s for s in group.scores if s is not None]
    # correctness now ranks first: both right answers above both wrong ones (the raw score put them last)
    assert min(scores[0], scores[2]) > max(scores[1], scores[3])


def test_abstained_rollouts_are_left_out_of_the_group_statistics():
    group = _scored(_config(), [*_COMPLETIONS, "<answer>1</answer> unknown"])  # its big component abstains
    assert group.scores[4] is None
    assert group.scores[:4] == pytest.approx(_SCORES, abs=1e-12)


def test_a_component_without_spread_adds_exactly_zero():
    group = _scored(_config(format_weight=0.25))  # every completion is formatted: format [1, 1, 1, 1]
    for rollout, score in zip(group.rollouts, _SCORES, strict=True):
        assert rollout.reward is not None
        assert rollout.reward.components["normalized/format"] == 0.0
        assert rollout.reward.score == pytest.approx(score, abs=1e-12)


def test_normalised_values_reach_the_step_metrics_and_the_advantages():
    config = _config()
    group = _scored(config)
    metrics = reward_metrics([group])
    assert metrics["reward/rubric_score"] == pytest.approx((51 + 150 + 101 + 200) / 4)
    assert metrics["reward/normalized/correct"] == pytest.approx(0.0, abs=1e-12)
    assert metrics["reward/correct"] == 0.5
    assign_advantages([group], SharpenConfig().trainer.algorithm)
    advantages = [r.advantage for r in group.rollouts]
    assert all(a is not None for a in advantages)
    assert min(advantages[0], advantages[2]) > max(advantages[1], advantages[3])  # type: ignore[operator]


def test_a_score_that_is_not_the_weighted_sum_of_its_components_is_refused():
    def environment_like(example: Example, completion: str) -> RewardResult:
        return RewardResult(score=2.0, status=RewardStatus.OK, components={"environment": 2.0}, verifier="env")

    config = RewardConfig(component_normalization="group")
    with pytest.raises(ValueError, match="weighted sum of the components"):
        score_groups(environment_like, [_group(_COMPLETIONS[:2])], config=config)


def test_score_weights_name_every_weighted_part_of_the_rubrics_score():
    assert score_weights(_config(correct_weight=2.0, format_weight=0.1)) == {"correct": 2.0, "format": 0.1, "big": 0.5}


def test_the_config_refuses_remax_and_reserves_rubric_score():
    with pytest.raises(ValueError, match="remax"):
        SharpenConfig.model_validate(
            {"reward": {"component_normalization": "group"}, "trainer": {"algorithm": {"advantage": "remax"}}}
        )
    with pytest.raises(ValueError, match="taken"):
        CustomComponentConfig(name="rubric_score", function="unused:unused")
    assert RewardConfig().component_normalization == "none"
