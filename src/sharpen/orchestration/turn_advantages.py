"""The turn-level advantage phase: from each rollout's episode record to per-turn rewards, states and token spans,
through the turn estimator (`compute_turn_advantages`), back to per-token advantages on the rollouts.

A multi-turn rollout already carries what a turn-level estimator needs, in its `EpisodeRecord`: each turn's
``reward`` (the environment's step reward), ``num_action_tokens`` (the turn's generated tokens, which are the
rollout's trained tokens in turn order: the observations between them are masked out) and ``observation_ids``
(what the environment answered, the state the next turn starts from). Nothing is copied onto the rollout; this
module reads them, so rollouts pickled before it existed work too.

It does not compute advantages (``trainer/algorithms/turn_estimators.py`` does) nor decide what the score is
(``phases.score_groups``).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch

from sharpen.config.advantages import TurnAdvantageConfig
from sharpen.trainer.algorithms import compute_turn_advantages
from sharpen.types import Rollout, RolloutGroup


@dataclass(kw_only=True, slots=True)
class EpisodeTurns:
    """One scored rollout's turns, in order."""

    rewards: list[float]
    """Each turn's reward: the environment's step reward plus the KL penalties of its tokens (``token_rewards``),
    and on the last turn whatever else the score holds (a rubric's verdict, overlong or hack penalties), so that
    they add up to `Rollout.total_score`."""
    num_tokens: list[int]
    """Each turn's trained tokens (they add up to `Rollout.num_loss_tokens`)."""
    states: list[tuple[int, ...]]
    """The tokens each turn started from beyond the shared history: the prompt for the first turn, the previous
    turn's observation after that (GiGPO's anchor state)."""


def read_turns(rollout: Rollout) -> EpisodeTurns | None:
    """``rollout``'s turns, or None when its reward abstained. A rollout without an episode record (made without an
    environment) or with earlier segments (an agent that rewrote its history) is refused: its tokens have no turns
    to follow."""
    score = rollout.total_score
    if score is None:
        return None
    episode = rollout.episode
    if episode is None or rollout.segments:
        what = "no episode record" if episode is None else "an agent episode's segments"
        raise ValueError(
            f"rollout {rollout.example.task_key} has {what}: a turn-level advantage needs turn-by-turn episodes "
            "of a multi-turn environment (environment.type; docs/algorithms.md, turn-level estimators)"
        )
    turns = episode.turns
    num_tokens = [t.num_action_tokens for t in turns] or [0]  # an episode without a turn: one empty turn
    if sum(num_tokens) != rollout.num_loss_tokens:
        raise ValueError(
            f"rollout {rollout.example.task_key}: its turns hold {sum(num_tokens)} generated tokens but it trains on "
            f"{rollout.num_loss_tokens}"
        )
    penalties = rollout.token_rewards or [0.0] * rollout.num_loss_tokens
    rewards, offset = [], 0
    for index, count in enumerate(num_tokens):
        step_reward = turns[index].reward if turns else None
        rewards.append((step_reward or 0.0) + math.fsum(penalties[offset : offset + count]))
        offset += count
    rewards[-1] += score - math.fsum(rewards)
    states = [tuple(rollout.prompt_ids)] + [tuple(t.observation_ids) for t in turns[:-1]]
    return EpisodeTurns(rewards=rewards, num_tokens=num_tokens, states=states)


def assign_turn_advantages(groups: list[RolloutGroup], estimator: TurnAdvantageConfig) -> None:
    """Per-turn advantages of ``estimator``: every trained token of a turn gets its turn's advantage
    (``token_advantages``), and ``advantage`` is their mean (it marks the rollout trainable, and is logged);
    abstained rollouts get None."""
    episodes = [[read_turns(r) for r in g.rollouts] for g in groups]
    size = max((len(g.rollouts) for g in groups), default=0)
    length = max((len(e.rewards) for es in episodes for e in es if e is not None), default=0)
    rewards = torch.zeros((len(groups), size, length), dtype=torch.float64)
    mask = torch.zeros((len(groups), size, length), dtype=torch.bool)
    states = torch.full((len(groups), size, length), -1, dtype=torch.long)
    for row, group_episodes in enumerate(episodes):
        ids: dict[tuple[int, ...], int] = {}  # state ids within the group
        for col, turns in enumerate(group_episodes):
            if turns is None:
                continue
            count = len(turns.rewards)
            rewards[row, col, :count] = torch.tensor(turns.rewards, dtype=torch.float64)
            mask[row, col, :count] = True
            states[row, col, :count] = torch.tensor([ids.setdefault(s, len(ids)) for s in turns.states])
    advantages = compute_turn_advantages(estimator, rewards, mask, states)  # [groups, n, turns]
    for row, (group, group_episodes) in enumerate(zip(groups, episodes, strict=True)):
        for col, (rollout, turns) in enumerate(zip(group.rollouts, group_episodes, strict=True)):
            if turns is None:
                rollout.advantage, rollout.token_advantages = None, None
                continue
            per_turn = advantages[row, col].tolist()
            values = [per_turn[t] for t, count in enumerate(turns.num_tokens) for _ in range(count)]
            rollout.token_advantages = values
            rollout.advantage = statistics.fmean(values) if values else 0.0
