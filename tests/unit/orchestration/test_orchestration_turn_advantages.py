"""assign_advantages under the turn-level estimators, on a hand-built 3-turn group of guess-number episodes: each
turn's reward and tokens come from the episode record, every generated token of a turn gets its turn's advantage,
the observation tokens between turns are not trained on; KL penalties and the rest of the score land on their turns;
rollouts that are not turn-by-turn episodes are refused in one line."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sharpen.config.advantages import GiGPOAdvantage, TurnGRPOAdvantage
from sharpen.config.algorithm import AlgorithmConfig
from sharpen.orchestration.phases import assign_advantages
from sharpen.orchestration.turn_advantages import read_turns
from sharpen.types import (
    EpisodeRecord,
    Example,
    Message,
    RewardResult,
    RewardStatus,
    Rollout,
    RolloutGroup,
    TurnRecord,
)

_EXAMPLE = Example(task_key="guess_number/0", prompt=(Message(role="user", content="guess"),), answer="11")
_HIGHER_THAN_8, _LOWER_THAN_12, _LOWER_THAN_4 = [40, 41], [42, 43, 44], [45]  # observation tokens


def _episode(turns: list[tuple[int, float, list[int]]], *, score: float | None = None) -> Rollout:
    """A rollout of turns (action tokens, step reward, observation after it), tokens in order: action, observation,
    action, ...; its score the sum of the step rewards (the environment's reward) unless given."""
    completion: list[int] = []
    mask: list[bool] = []
    records = []
    for index, (num_action, reward, observation) in enumerate(turns):
        completion += [10 + index] * num_action + observation
        mask += [True] * num_action + [False] * len(observation)
        records.append(TurnRecord(action_text="", num_action_tokens=num_action, observation_ids=observation))
        records[-1].reward = reward
    total = sum(r for _, r, _ in turns) if score is None else score
    return Rollout(
        example=_EXAMPLE,
        prompt_ids=[1, 2, 3],
        completion_ids=completion,
        completion_logprobs=[-1.0] * len(completion),
        versions=[0] * len(completion),
        loss_mask=mask,
        episode=EpisodeRecord(environment="guess_number", environment_version="1", seed=0, turns=records),
        reward=RewardResult(score=total, status=RewardStatus.OK),
    )


def _group() -> RolloutGroup:
    # The group of tests/unit/trainer/algorithms/test_trainer_turn_estimators.py, as episodes (gamma 0.5):
    #   e0: 2 tokens "8" -> higher than 8; 1 token "12" -> lower than 12; 3 tokens "11" found (1)   returns [.25, .5, 1]
    #   e1: 1 token "8" -> higher than 8; 2 tokens "11" found (1)                                returns [.5, 1]
    #   e2: 2 tokens "5" -> lower than 4 ...: never found in 3 turns, its last turn hears "higher than 8" before it
    return RolloutGroup(
        example=_EXAMPLE,
        rollouts=[
            _episode([(2, 0.0, _HIGHER_THAN_8), (1, 0.0, _LOWER_THAN_12), (3, 1.0, [])]),
            _episode([(1, 0.0, _HIGHER_THAN_8), (2, 1.0, [])]),
            _episode([(2, 0.0, _LOWER_THAN_4), (1, 0.0, _HIGHER_THAN_8), (1, 0.0, [])]),
        ],
    )


def _approx(values: list[float]) -> list:
    return [pytest.approx(v, abs=1e-12) for v in values]


def test_gigpo_gives_every_token_of_a_turn_its_turns_advantage():
    # per-turn advantages worked out in test_trainer_turn_estimators.py (same returns, same states):
    #   e0 [1/3, 1/3, 1/3], e1 [7/12, 5/6], e2 [-11/12, -2/3, -7/6]
    group = _group()
    assign_advantages([group], AlgorithmConfig(advantage=GiGPOAdvantage(gamma=0.5)))
    e0, e1, e2 = group.rollouts
    assert e0.token_advantages == _approx([1 / 3] * 6)
    assert e1.token_advantages == _approx([7 / 12, 5 / 6, 5 / 6])
    assert e2.token_advantages == _approx([-11 / 12, -11 / 12, -2 / 3, -7 / 6])
    for rollout in group.rollouts:  # one per trained token: the observations are not trained on
        assert rollout.token_advantages is not None and len(rollout.token_advantages) == rollout.num_loss_tokens
    assert e1.advantage == pytest.approx((7 / 12 + 5 / 6 + 5 / 6) / 3, abs=1e-12)  # their mean


def test_turn_grpo_follows_the_turns_and_an_abstained_rollout_gets_none():
    group = _group()
    group.rollouts.append(replace(_group().rollouts[0], reward=RewardResult(score=None, status=RewardStatus.TIMEOUT)))
    assign_advantages([group], AlgorithmConfig(advantage=TurnGRPOAdvantage(gamma=0.5, std="population")))
    # returns [0.25, 0.5, 1 | 0.5, 1 | 0, 0, 0]: mean 0.40625, squared deviations 1.2421875 over 8 turns
    scale = (1.2421875 / 8) ** 0.5 + 1e-6
    e0, e1, e2, abstained = group.rollouts
    assert e0.token_advantages == _approx([-0.15625 / scale] * 2 + [0.09375 / scale] + [0.59375 / scale] * 3)
    assert e1.token_advantages == _approx([0.09375 / scale] + [0.59375 / scale] * 2)
    assert e2.token_advantages == _approx([-0.40625 / scale] * 4)
    assert abstained.advantage is None and abstained.token_advantages is None


def test_turn_rewards_carry_their_kl_penalties_and_the_rest_of_the_score_lands_on_the_last_turn():
    # step rewards [0, 0, 1]; per-token KL penalties on the 6 trained tokens; the score 0.7 (an overlong penalty of
    # 0.3 taken off the environment's 1) plus the penalties is the total score
    rollout = _episode([(2, 0.0, _HIGHER_THAN_8), (1, 0.0, _LOWER_THAN_12), (3, 1.0, [])], score=0.7)
    rollout.token_rewards = [-0.01, -0.02, -0.04, 0.0, -0.1, 0.0]
    turns = read_turns(rollout)
    assert turns is not None
    assert turns.rewards == _approx([-0.03, -0.04, 1.0 - 0.1 - 0.3])
    assert sum(turns.rewards) == pytest.approx(rollout.total_score, abs=1e-12)
    assert turns.num_tokens == [2, 1, 3]
    assert turns.states == [(1, 2, 3), tuple(_HIGHER_THAN_8), tuple(_LOWER_THAN_12)]


def test_rollouts_without_turns_are_refused_in_one_line():
    single = Rollout(
        example=_EXAMPLE,
        prompt_ids=[1],
        completion_ids=[5],
        completion_logprobs=[-1.0],
        versions=[0],
        reward=RewardResult(score=1.0, status=RewardStatus.OK),
    )
    group = RolloutGroup(example=_EXAMPLE, rollouts=[single])
    with pytest.raises(ValueError, match="has no episode record: a turn-level advantage needs turn-by-turn") as info:
        assign_advantages([group], AlgorithmConfig(advantage="gigpo"))
    assert "\n" not in str(info.value)
    agent = _episode([(1, 1.0, [])])
    agent.segments = [replace(agent, segments=[], reward=None, episode=None)]
    with pytest.raises(ValueError, match="an agent episode's segments"):
        assign_advantages([RolloutGroup(example=_EXAMPLE, rollouts=[agent])], AlgorithmConfig(advantage="gigpo"))
