"""The loop's phases as small functions: score, add KL penalties, assign advantages, summarise rewards.

Each takes components as arguments and returns data or metrics; the order in which they run is `loop.py`'s.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from typing import TYPE_CHECKING

import torch

from sharpen.config.schema import AlgorithmConfig, RewardConfig
from sharpen.orchestration.filters import is_informative, shape_overlong_reward
from sharpen.rewards import RewardFn
from sharpen.rewards.scoring import score_rollout
from sharpen.trainer.algorithms import compute_advantages
from sharpen.types import Rollout, RolloutGroup

if TYPE_CHECKING:
    from sharpen.orchestration.handles import TrainerHandle


def score_groups(
    rubric: RewardFn, groups: list[RolloutGroup], *, config: RewardConfig | None = None, max_new_tokens: int = 0
) -> None:
    """Reward every rollout (`score_rollout`, which evaluation shares); with ``config.overlong_buffer_tokens``
    also apply DAPO's soft overlong punishment (logged as the ``overlong_penalty`` component)."""
    shaping = config is not None and config.overlong_buffer_tokens > 0
    for group in groups:
        for rollout in group.rollouts:
            reward = score_rollout(rubric, group.example, rollout)
            if shaping and config is not None and reward.score is not None:
                shaped = shape_overlong_reward(
                    reward.score,
                    len(rollout.completion_ids),
                    max_tokens=max_new_tokens,
                    buffer_tokens=config.overlong_buffer_tokens,
                    penalty=config.overlong_penalty,
                )
                reward.components["overlong_penalty"] = reward.score - shaped
                reward.score = shaped
            rollout.reward = reward


def add_kl_penalties(trainer: TrainerHandle, groups: list[RolloutGroup]) -> None:
    """``kl_in_reward``: each rollout gets per-token reward terms -kl_coef * KL_t(engine || reference), which the
    advantages then see (sequence estimators through `Rollout.total_score`, GAE token by token). An agent episode's
    earlier segments get theirs too (its total score adds them up)."""
    rollouts = [s for g in groups for r in g.rollouts for s in (*r.segments, r) if s.num_loss_tokens]
    for rollout, penalties in zip(rollouts, trainer.kl_penalties(rollouts), strict=True):
        rollout.token_rewards = penalties


def assign_advantages(groups: list[RolloutGroup], config: AlgorithmConfig) -> None:
    """Sequence-level advantages from the configured estimator; rollouts whose reward abstained keep
    ``advantage = None`` (not trained on).

    With ``advantage = "gae"`` (PPO with a critic) no group estimator runs: the advantages are per token and need
    the critic's values, so the trainer computes them from each rollout's score. Here every scored rollout gets the
    placeholder ``advantage = 0.0``, which only marks it as trainable; abstained ones get None as usual.
    With ``advantage = "remax"`` each group's baseline is its greedy completion's score (``baseline_score``); a
    group without one abstains as a whole."""
    if config.advantage == "gae":
        for group in groups:
            for rollout, score in zip(group.rollouts, group.scores, strict=True):
                rollout.advantage = None if score is None else 0.0
        return
    if not groups:
        return
    size = max(len(g.rollouts) for g in groups)
    scores = torch.full((len(groups), size), float("nan"), dtype=torch.float64)
    for row, group in enumerate(groups):
        for col, score in enumerate(group.scores):
            if score is not None:
                scores[row, col] = score
    baselines = torch.tensor(
        [float("nan") if g.baseline_score is None else g.baseline_score for g in groups], dtype=torch.float64
    )
    advantages = compute_advantages(config.advantage, scores, baselines=baselines)
    for row, group in enumerate(groups):
        for col, rollout in enumerate(group.rollouts):
            value = float(advantages[row, col])
            rollout.advantage = None if math.isnan(value) else value


def reward_metrics(groups: list[RolloutGroup]) -> dict[str, float]:
    rollouts: list[Rollout] = [r for g in groups for r in g.rollouts]
    scores = [r.reward.score for r in rollouts if r.reward is not None and r.reward.score is not None]
    lengths = [len(r.completion_ids) for r in rollouts]
    statuses = Counter(r.reward.status.value for r in rollouts if r.reward is not None)
    metrics = {
        "reward/mean": statistics.fmean(scores) if scores else float("nan"),
        "reward/std": statistics.pstdev(scores) if len(scores) > 1 else 0.0,
        "reward/num_abstained": float(len(rollouts) - len(scores)),
        "rollout/completion_length_mean": statistics.fmean(lengths) if lengths else 0.0,
        "rollout/completion_length_max": float(max(lengths, default=0)),
        "rollout/truncated_fraction": sum(r.is_truncated for r in rollouts) / max(len(rollouts), 1),
        "rollout/num_tokens": float(sum(lengths)),
        "rollout/groups_all_equal_fraction": sum(not is_informative(g) for g in groups) / max(len(groups), 1),
    }
    for name in sorted({n for r in rollouts if r.reward is not None for n in r.reward.components}):
        values = [r.reward.components[name] for r in rollouts if r.reward is not None and name in r.reward.components]
        metrics[f"reward/{name}"] = statistics.fmean(values)
    penalised = [sum(r.token_rewards) for r in rollouts if r.token_rewards is not None]
    if penalised:
        metrics["reward/kl_penalty"] = statistics.fmean(penalised)
    for status, count in statuses.items():
        metrics[f"reward/status_{status}"] = count / len(rollouts)
    episodes = [r.episode for r in rollouts if r.episode is not None]
    if episodes:
        metrics["rollout/num_turns_mean"] = statistics.fmean(len(e.turns) for e in episodes)
        for reason, count in Counter(e.stop_reason for e in episodes).items():
            metrics[f"rollout/stop_{reason}"] = count / len(episodes)
    return metrics
