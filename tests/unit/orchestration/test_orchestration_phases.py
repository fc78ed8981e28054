"""assign_advantages and reward_metrics on hand-built groups."""

from __future__ import annotations

import math

import pytest

from sharpen.config.advantages import GRPOAdvantage, PassKAdvantage
from sharpen.config.algorithm import AlgorithmConfig
from sharpen.orchestration.phases import assign_advantages, reward_metrics
from sharpen.types import Example, Message, RewardResult, RewardStatus, Rollout, RolloutGroup

EPS = 1e-6  # compute_grpo_advantages' default


def _example(index: int) -> Example:
    return Example(task_key=f"t/{index}", prompt=(Message(role="user", content=f"q{index}"),), answer="1")


def _rollout(
    example: Example,
    score: float | None,
    status: RewardStatus = RewardStatus.OK,
    length: int = 2,
    truncated: bool = False,
    components: dict[str, float] | None = None,
) -> Rollout:
    return Rollout(
        example=example,
        prompt_ids=[1, 2],
        completion_ids=[5] * length,
        completion_logprobs=[-1.0] * length,
        versions=[0] * length,
        is_truncated=truncated,
        reward=RewardResult(score=score, status=status, components=components or {}),
    )


def _group(index: int, *rollouts_args) -> RolloutGroup:
    example = _example(index)
    return RolloutGroup(example=example, rollouts=[_rollout(example, *args) for args in rollouts_args])


def test_assign_advantages_normalises_per_group_and_leaves_abstained_rollouts_out():
    groups = [
        _group(0, (1.0,), (None,), (0.0,)),  # valid [1, 0]: mean 0.5, unbiased std sqrt(0.5), population std 0.5
        _group(1, (2.0,), (2.0,)),  # flat: no signal
        _group(2, (None,), (None,)),  # everything abstained
    ]
    assign_advantages(groups, AlgorithmConfig())  # GRPO's std = "unbiased" by default
    first = [r.advantage for r in groups[0].rollouts]
    assert first[1] is None
    assert first[0] == pytest.approx(0.5 / (0.5**0.5 + EPS), abs=1e-12)
    assert first[2] == pytest.approx(-0.5 / (0.5**0.5 + EPS), abs=1e-12)
    assign_advantages(groups, AlgorithmConfig(advantage=GRPOAdvantage(std="population")))
    first = [r.advantage for r in groups[0].rollouts]
    assert first[0] == pytest.approx(0.5 / (0.5 + EPS), abs=1e-12)
    assert first[2] == pytest.approx(-0.5 / (0.5 + EPS), abs=1e-12)
    assert [r.advantage for r in groups[1].rollouts] == [0.0, 0.0]
    assert [r.advantage for r in groups[2].rollouts] == [None, None]


def test_assign_advantages_without_std_normalisation_and_with_unequal_group_sizes():
    groups = [_group(0, (3.0,), (1.0,), (2.0,)), _group(1, (1.0,), (0.0,))]
    assign_advantages(groups, AlgorithmConfig(advantage="drgrpo"))
    assert [r.advantage for r in groups[0].rollouts] == [1.0, -1.0, 0.0]
    assert [r.advantage for r in groups[1].rollouts] == [0.5, -0.5]
    assign_advantages([], AlgorithmConfig())  # nothing to do, no error


def test_assign_advantages_under_gae_marks_scored_rollouts_trainable():
    """GAE's advantages are per token and come from the critic in the trainer; here only a 0.0 placeholder."""
    groups = [_group(0, (1.0,), (None,), (0.0,)), _group(1, (2.0,), (2.0,))]
    assign_advantages(groups, AlgorithmConfig(advantage="gae"))
    assert [r.advantage for r in groups[0].rollouts] == [0.0, None, 0.0]
    assert [r.advantage for r in groups[1].rollouts] == [0.0, 0.0]


def test_reward_metrics_on_a_hand_built_batch():
    groups = [
        _group(
            0,
            (1.0, RewardStatus.OK, 2, False, {"correct": 1.0, "format": 1.0}),
            (0.0, RewardStatus.WRONG, 4, False, {"correct": 0.0, "format": 1.0}),
            (None, RewardStatus.INFRA_ERROR, 6, True, {}),
        ),
        _group(
            1,
            (0.5, RewardStatus.OK, 1, False, {"correct": 0.0, "format": 1.0}),
            (0.5, RewardStatus.OK, 3, False, {"correct": 0.0, "format": 1.0}),
        ),
    ]
    metrics = reward_metrics(groups)
    expected = {
        "reward/mean": 0.5,  # over the 4 scores that did not abstain
        "reward/std": math.sqrt((0.25 + 0.25 + 0 + 0) / 4),  # population std
        "reward/num_abstained": 1.0,
        "reward/abstained_fraction": 1 / 5,
        "rollout/completion_length_mean": (2 + 4 + 6 + 1 + 3) / 5,
        "rollout/completion_length_max": 6.0,
        "rollout/truncated_fraction": 1 / 5,
        "rollout/num_tokens": 16.0,
        "rollout/groups_all_equal_fraction": 1 / 2,  # group 1 scores [0.5, 0.5]
        "reward/correct": 1 / 4,
        "reward/format": 1.0,
        "reward/status_ok": 3 / 5,
        "reward/status_wrong": 1 / 5,
        "reward/status_infra_error": 1 / 5,
    }
    assert set(metrics) == set(expected)
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, abs=1e-12), key


def test_reward_metrics_when_every_reward_abstained():
    metrics = reward_metrics([_group(0, (None, RewardStatus.TIMEOUT), (None, RewardStatus.TIMEOUT))])
    assert math.isnan(metrics["reward/mean"])
    assert metrics["reward/std"] == 0.0
    assert metrics["reward/num_abstained"] == 2.0 and metrics["reward/abstained_fraction"] == 1.0
    assert metrics["reward/status_timeout"] == 1.0
    assert metrics["rollout/groups_all_equal_fraction"] == 1.0


def test_remax_advantages_subtract_the_greedy_baseline_and_a_group_without_one_abstains():
    with_baseline = _group(0, (1.0,), (0.0,))
    with_baseline.baseline_score = 0.25
    without = _group(1, (1.0,), (0.0,))
    assign_advantages([with_baseline, without], AlgorithmConfig(advantage="remax"))
    assert [r.advantage for r in with_baseline.rollouts] == [0.75, -0.25]
    assert [r.advantage for r in without.rollouts] == [None, None]


def test_kl_penalties_reach_the_advantages_but_not_the_task_reward_metric():
    from sharpen.orchestration.phases import add_kl_penalties

    class FakeTrainer:
        def kl_penalties(self, rollouts):
            return [
                [-0.1] * len(r.completion_ids) if i == 0 else [0.0] * len(r.completion_ids)
                for i, r in enumerate(rollouts)
            ]

    group = _group(0, (1.0,), (1.0,))  # equal task rewards: no signal without the penalty
    add_kl_penalties(FakeTrainer(), [group])  # type: ignore[arg-type]
    assert group.scores == [pytest.approx(0.8), 1.0]  # 2 tokens x -0.1
    assign_advantages([group], AlgorithmConfig(advantage="drgrpo"))
    assert [r.advantage for r in group.rollouts] == [pytest.approx(-0.1), pytest.approx(0.1)]
    metrics = reward_metrics([group])
    assert metrics["reward/mean"] == 1.0
    assert metrics["reward/kl_penalty"] == pytest.approx(-0.1)


def test_an_agent_episodes_earlier_segments_get_kl_penalties_that_count_in_its_score():
    from dataclasses import replace

    from sharpen.orchestration.phases import add_kl_penalties

    class FakeTrainer:
        def kl_penalties(self, rollouts):
            return [[-0.1] * len(r.completion_ids) for r in rollouts]

    group = _group(0, (1.0,), (1.0,))
    first = group.rollouts[0]
    first.segments = [replace(first, segments=[], reward=None)]  # an earlier segment of the same length
    add_kl_penalties(FakeTrainer(), [group])  # type: ignore[arg-type]
    assert first.segments[0].token_rewards == [-0.1, -0.1]
    assert group.scores == [pytest.approx(0.6), pytest.approx(0.8)]  # 4 tokens x -0.1 vs 2 tokens x -0.1


def test_passk_advantages_reach_the_rollouts_with_the_configured_k():
    # valid [0, 1, 0, 0] with k = 2: rho = 1/2, sigma = 1/2 -> correct 1, incorrect (1/2 - 2/3)/(1/2) = -1/3
    groups = [_group(0, (0.0,), (1.0,), (None,), (0.0,), (0.0,))]
    assign_advantages(groups, AlgorithmConfig(advantage=PassKAdvantage(k=2)))
    advantages = [r.advantage for r in groups[0].rollouts]
    assert advantages[2] is None
    assert [a for a in advantages if a is not None] == pytest.approx([-1 / 3, 1.0, -1 / 3, -1 / 3], abs=1e-12)


def test_numbers_in_step_infos_become_env_metrics_per_turn_and_counts_per_episode():
    from sharpen.orchestration.phases import environment_info_metrics
    from sharpen.types import EpisodeRecord, TurnRecord

    def turn(**info):
        return TurnRecord(action_text="", num_action_tokens=1, observation_ids=[], info=info)

    episodes = [
        EpisodeRecord(
            environment="browser",
            environment_version="1",
            seed=0,
            turns=[
                turn(num_actions=1, num_invalid_actions=1, step_seconds=0.5, actions=["invalid"]),
                turn(num_actions=2, num_invalid_actions=0, step_seconds=0.25, is_done=True, stop="done"),
            ],
        ),
        EpisodeRecord(environment="browser", environment_version="1", seed=1, turns=[turn(num_actions=1)]),
    ]
    metrics = environment_info_metrics(episodes)
    assert metrics == {
        "env/num_actions_mean": pytest.approx(4 / 3),
        "env/num_invalid_actions_mean": 0.5,
        "env/step_seconds_mean": 0.375,
        "env/num_actions_per_episode": 2.0,  # (1 + 2) and 1
        "env/num_invalid_actions_per_episode": 1.0,  # only the first episode reports it
    }
