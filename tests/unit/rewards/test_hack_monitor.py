"""Hack monitoring: flagged rollouts are screened out of the gradient (default) or penalised; batch metrics."""

from __future__ import annotations

import pytest

from sharpen.config.algorithm import AlgorithmConfig
from sharpen.orchestration.phases import assign_advantages
from sharpen.rewards.hack_monitor import PolicyErrorMonitor, hack_metrics, penalise_flagged, screen_flagged
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


def _policy_errors(task: str, num_errors: int, num: int = 4) -> list[Rollout]:
    example = Example(task_key=task, prompt=(Message(role="user", content="q"),))
    return [
        Rollout(
            example=example,
            prompt_ids=[1],
            completion_ids=[2],
            completion_logprobs=[-1.0],
            versions=[0],
            reward=RewardResult(score=0.0, status=RewardStatus.TIMEOUT, is_policy_error=i < num_errors),
        )
        for i in range(num)
    ]


def test_a_per_task_rise_in_policy_caused_errors_is_flagged_and_counted():
    monitor = PolicyErrorMonitor()
    steady = monitor.observe(_policy_errors("a", 1) + _policy_errors("b", 0))  # one error: below min_errors
    assert steady == {"hack/policy_error_fraction": 1 / 8, "hack/policy_error_rising": 0.0}
    rollouts = _policy_errors("a", 4) + _policy_errors("b", 0)
    metrics = monitor.observe(rollouts)
    assert metrics == {"hack/policy_error_fraction": 0.5, "hack/policy_error_rising": 1.0}
    assert [r.reward.hack_flags for r in rollouts if r.reward] == [["policy_error_rise"]] * 4 + [[]] * 4
    for _ in range(20):  # a task that always errs becomes its own baseline: no longer a rise
        settled = monitor.observe(_policy_errors("a", 4))
    assert settled["hack/policy_error_rising"] == 0.0


def test_policy_error_monitor_refuses_bad_settings():
    with pytest.raises(ValueError, match="min_rise"):
        PolicyErrorMonitor(min_rise=0.0)
