"""assign_advantages under REINFORCE++: per-token advantages from the KL penalties to go and the score, on hand-built
groups (agent segments included), with the statistics over the batch's tokens."""

from __future__ import annotations

import math
import statistics
from dataclasses import replace

import pytest

from sharpen.config.advantages import ReinforcePPAdvantage
from sharpen.config.algorithm import AlgorithmConfig
from sharpen.orchestration.phases import assign_advantages
from sharpen.types import Example, Message, RewardResult, RewardStatus, Rollout, RolloutGroup, with_segments

EPS = 1e-6  # the REINFORCE++ estimators' default
_EXAMPLE = Example(task_key="t/0", prompt=(Message(role="user", content="q"),), answer="1")


def _rollout(score: float | None, length: int, token_rewards: list[float] | None = None) -> Rollout:
    return Rollout(
        example=_EXAMPLE,
        prompt_ids=[1, 2],
        completion_ids=[5] * length,
        completion_logprobs=[-1.0] * length,
        versions=[0] * length,
        reward=RewardResult(score=score, status=RewardStatus.OK),
        token_rewards=token_rewards,
    )


def _approx(values: list[float]) -> list:
    return [pytest.approx(v, abs=1e-12) for v in values]


def test_reinforce_pp_gives_each_token_its_discounted_kl_to_go_plus_score():
    # G [-0.025, 0.15, 0.7] and [-0.4, 0.0] (tests/unit/trainer/algorithms/test_trainer_token_returns.py works them
    # out): mean 0.085, squared deviations sum to 0.637, unbiased std sqrt(0.637 / 4); the abstained one is left out
    group = RolloutGroup(
        example=_EXAMPLE,
        rollouts=[_rollout(1.0, 3, [-0.1, -0.2, -0.3]), _rollout(0.0, 2, [-0.4, 0.0]), _rollout(None, 2, [5.0, 5.0])],
    )
    assign_advantages([group], AlgorithmConfig(advantage=ReinforcePPAdvantage(gamma=0.5)))
    scale = math.sqrt(0.637 / 4) + EPS
    first, second, abstained = group.rollouts
    assert first.token_advantages == _approx([-0.11 / scale, 0.065 / scale, 0.615 / scale])
    assert second.token_advantages == _approx([-0.485 / scale, -0.085 / scale])
    assert first.advantage == pytest.approx((-0.11 + 0.065 + 0.615) / 3 / scale, abs=1e-12)  # their mean
    assert abstained.advantage is None and abstained.token_advantages is None


def test_reinforce_pp_baseline_without_kl_is_the_centred_score_on_every_token():
    # centred [0.5, -0.5] over 3 + 1 tokens: mean 0.25, squared deviations 3 * 0.25^2 + 0.75^2 = 0.75, unbiased
    # std sqrt(0.75 / 3) = 0.5 (over the two sequences it would be the +-1 of the sequence form)
    group = RolloutGroup(example=_EXAMPLE, rollouts=[_rollout(1.0, 3), _rollout(0.0, 1)])
    assign_advantages([group], AlgorithmConfig(advantage="reinforce_pp_baseline"))
    up, down = 0.25 / (0.5 + EPS), -0.75 / (0.5 + EPS)
    assert group.rollouts[0].token_advantages == _approx([up, up, up])
    assert group.rollouts[1].token_advantages == _approx([down])
    assert [r.advantage for r in group.rollouts] == _approx([up, down])


def test_an_agent_episode_is_one_trajectory_across_its_segments():
    # segment tokens [-0.1, -0.1], then the rollout's [-0.2, -0.2 + 1]: gamma 1 returns [0.4, 0.5, 0.6, 0.8];
    # the other sample scores 0 without penalties: [0, 0]. Population statistics over the 6 tokens.
    episode = _rollout(1.0, 2, [-0.2, -0.2])
    episode.segments = [replace(episode, segments=[], reward=None, token_rewards=[-0.1, -0.1])]
    group = RolloutGroup(example=_EXAMPLE, rollouts=[episode, _rollout(0.0, 2, [0.0, 0.0])])
    assign_advantages([group], AlgorithmConfig(advantage=ReinforcePPAdvantage(std="population")))
    returns = [0.4, 0.5, 0.6, 0.8, 0.0, 0.0]
    mean, std = statistics.fmean(returns), statistics.pstdev(returns)
    a = [(g - mean) / (std + EPS) for g in returns]
    assert episode.segments[0].token_advantages == _approx(a[0:2])
    assert episode.token_advantages == _approx(a[2:4])
    assert group.rollouts[1].token_advantages == _approx(a[4:6])
    trained = with_segments(group.rollouts)  # the segment is trainable with its own per-token share
    assert trained[0].advantage == episode.advantage == pytest.approx(statistics.fmean(a[0:4]), abs=1e-12)
