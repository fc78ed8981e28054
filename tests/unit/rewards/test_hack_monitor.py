"""Hack monitoring: flagged rollouts are screened out of the gradient (default) or penalised; batch metrics."""

from __future__ import annotations

import pytest

from sharpen.config.schema import AlgorithmConfig
from sharpen.orchestration.phases import assign_advantages
from sharpen.rewards.hack_monitor import hack_metrics, penalise_flagged, screen_flagged
from sharpen.types import Example, Message, RewardResult, RewardStatus, Rollout, RolloutGroup

EXAMPLE = Example(task_key="t/0", prompt=(Message(role="user", content="q"),))


def _group(scores_and_flags: list[tuple[float, list[str]]]) -> RolloutGroup:
    rollouts = [
        Rollout(
            example=EXAMPLE,
            prompt_ids=[1],
            completion_ids=[2] * (i + 1),
            completion_logprobs=[-1.0] * (i + 1),
            versions=[0] * (i + 1),
            reward=RewardResult(score=score, status=RewardStatus.OK, hack_flags=flags),
        )
        for i, (score, flags) in enumerate(scores_and_flags)
    ]
    return RolloutGroup(example=EXAMPLE, rollouts=rollouts)


def test_screening_keeps_the_flagged_verdict_in_the_baseline_but_out_of_the_gradient():
    group = _group([(1.0, []), (0.0, ["exit_before_asserts"]), (0.0, []), (1.0, [])])
    assign_advantages([group], AlgorithmConfig())
    unscreened = [r.advantage for r in group.rollouts]
    assert screen_flagged(group.rollouts) == 1
    assert [r.advantage for r in group.rollouts] == [unscreened[0], None, unscreened[2], unscreened[3]]


def test_penalising_lowers_the_score_before_the_advantages():
    group = _group([(1.0, []), (1.0, ["conftest_created"]), (0.0, [])])
    penalise_flagged(group.rollouts, penalty=2.0)
    assert [r.total_score for r in group.rollouts] == [1.0, -2.0, 0.0]
    assign_advantages([group], AlgorithmConfig())
    advantages = [r.advantage for r in group.rollouts]
    assert advantages[1] is not None and advantages[1] < advantages[2] < advantages[0]  # type: ignore[operator]


def test_metrics_count_flags_and_the_reward_length_correlation():
    group = _group([(0.0, []), (0.5, ["network_attempt", "network_attempt"]), (1.0, ["env_read"]), (1.0, [])])
    metrics = hack_metrics(group.rollouts)
    assert metrics["hack/flag_network_attempt"] == 0.25 and metrics["hack/flag_env_read"] == 0.25
    assert metrics["hack/flagged_fraction"] == 0.5
    assert metrics["hack/reward_length_corr"] == pytest.approx(0.9439, abs=1e-4)  # longer completions scored higher
