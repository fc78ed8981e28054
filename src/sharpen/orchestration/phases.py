"""The loop's phases as small functions: score (and normalise components), the advantage phase (KL penalties, the
hack policy, the estimator, the overlong filter: `compute_step_advantages`), summarise rewards.

Each takes components as arguments and returns what it computes (it also writes it onto the rollouts, which carry
their reward and advantage to the trainer); the order in which they run is `loop.py`'s.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sharpen.config.advantages import (
    GiGPOAdvantage,
    ReinforcePPAdvantage,
    ReinforcePPBaselineAdvantage,
    TurnGRPOAdvantage,
)
from sharpen.config.algorithm import AlgorithmConfig
from sharpen.config.schema import RewardConfig, SharpenConfig
from sharpen.orchestration.filters import is_informative, overlong_filter, shape_overlong_reward
from sharpen.orchestration.turn_advantages import assign_turn_advantages
from sharpen.rewards import RewardFn, score_weights
from sharpen.rewards.hack_monitor import penalise_flagged, screen_flagged
from sharpen.rewards.scoring import score_rollout
from sharpen.trainer.algorithms import (
    compute_advantages,
    compute_grpo_advantages,
    compute_reinforce_pp_token_advantages,
)
from sharpen.types import EpisodeRecord, RewardResult, Rollout, RolloutGroup

if TYPE_CHECKING:
    from sharpen.orchestration.handles import TrainerHandle


def score_groups(
    rubric: RewardFn, groups: list[RolloutGroup], *, config: RewardConfig | None = None, max_new_tokens: int = 0
) -> list[RewardResult]:
    """Reward every rollout (`score_rollout`, which evaluation shares); with ``config.component_normalization =
    "group"`` rebuild each score from its components normalised within the group (`normalize_components`); with
    ``config.overlong_buffer_tokens`` then apply DAPO's soft overlong punishment (logged as the
    ``overlong_penalty`` component)."""
    shaping = config is not None and config.overlong_buffer_tokens > 0
    results: list[RewardResult] = []
    for group in groups:
        rewards = [score_rollout(rubric, group.example, rollout) for rollout in group.rollouts]
        if config is not None and config.component_normalization == "group":
            normalize_components(rewards, score_weights(config))
        for rollout, reward in zip(group.rollouts, rewards, strict=True):
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
        results += rewards
    return results


def normalize_components(rewards: list[RewardResult], weights: Mapping[str, float]) -> None:
    """GDPO's decoupled normalisation (Liu et al. 2026, "GDPO: Group reward-Decoupled Normalization Policy
    Optimization for Multi-reward RL Optimization"), over the verdicts of one group: each component with a weight
    above 0 is normalised within the group before the weighted sum, so a component with a large scale or spread
    does not drown the others:
        score_i = sum_j w_j (v_ij - mean_group v_j) / (std_group v_j + 1e-6)
    over the group's scored verdicts (unbiased std, as the paper's reference code; a component without spread in
    the group adds exactly 0: `compute_grpo_advantages`, one row per component). Each scored verdict keeps its
    score before normalisation as the ``rubric_score`` component and gains ``normalized/<name>`` for each weighted
    component (rollout records, ``reward/normalized/<name>`` metrics); abstained ones are left out and stay
    abstained. A score that is not the weighted sum of its components (an environment's own reward, a reward
    function other than the Rubric) is refused: there is nothing to normalise."""
    weighted = {name: weight for name, weight in weights.items() if weight > 0}
    scored = [(r, r.score) for r in rewards if r.score is not None]
    if not scored or not weighted:
        return
    for reward, score in scored:
        is_sum = all(name in reward.components for name in weighted) and math.isclose(
            math.fsum(w * reward.components[name] for name, w in weighted.items()), score, abs_tol=1e-9
        )
        if not is_sum:
            raise ValueError(
                f'reward.component_normalization = "group" needs every score to be the weighted sum of the '
                f"components {weighted}; {reward.verifier or 'the reward'} scored {score} with components "
                f"{reward.components}"
            )
    values = torch.tensor([[r.components[name] for r, _ in scored] for name in weighted], dtype=torch.float64)
    normalized = compute_grpo_advantages(values)  # [components, scored]: each component over the group
    for col, (reward, score) in enumerate(scored):
        reward.components["rubric_score"] = score
        for row, name in enumerate(weighted):
            reward.components[f"normalized/{name}"] = float(normalized[row, col])
        reward.score = math.fsum(w * float(normalized[row, col]) for row, w in enumerate(weighted.values()))


@dataclass(kw_only=True, slots=True)
class StepAdvantages:
    """What the advantage phase computed for one step."""

    trained: list[Rollout]
    """The rollouts the trainer steps on (those cut off at the token limit left out under mask_truncated); each
    carries its advantage, None where its reward abstained or it was screened."""
    num_screened: int
    """Rollouts flagged by the hack monitor and left out of the gradient (reward.hack_policy = "screen")."""


def compute_step_advantages(
    trainer: TrainerHandle, groups: list[RolloutGroup], config: SharpenConfig
) -> StepAdvantages:
    """The advantage phase, in order: the KL reward penalties (``kl.type = "reward"``), the hack policy's penalty
    (before the advantages) or screening (after), the estimator (`assign_advantages`), and DAPO's overlong filter."""
    algorithm, reward = config.trainer.algorithm, config.reward
    rollouts = [r for g in groups for r in g.rollouts]
    if algorithm.kl.in_reward:
        add_kl_penalties(trainer, groups)
    if reward.hack_policy == "penalise":
        penalise_flagged(rollouts, penalty=reward.hack_penalty)
    assign_advantages(groups, algorithm)
    num_screened = screen_flagged(rollouts) if reward.hack_policy == "screen" else 0
    trained = overlong_filter(rollouts) if algorithm.mask_truncated else rollouts
    return StepAdvantages(trained=trained, num_screened=num_screened)


def add_kl_penalties(trainer: TrainerHandle, groups: list[RolloutGroup]) -> list[list[float]]:
    """``kl.type = "reward"``: each rollout gets per-token reward terms -coef * KL_t(engine || reference), which the
    advantages then see (sequence estimators through `Rollout.total_score`, GAE token by token). An agent episode's
    earlier segments get theirs too (its total score adds them up)."""
    rollouts = [s for g in groups for r in g.rollouts for s in (*r.segments, r) if s.num_loss_tokens]
    all_penalties = trainer.kl_penalties(rollouts)
    for rollout, penalties in zip(rollouts, all_penalties, strict=True):
        rollout.token_rewards = penalties
    return all_penalties


def assign_advantages(groups: list[RolloutGroup], config: AlgorithmConfig) -> list[float | None]:
    """Sequence-level advantages from the configured estimator, one per rollout of ``groups`` in order (also set on
    each rollout); rollouts whose reward abstained keep ``advantage = None`` (not trained on).

    With ``advantage = "gae"`` (PPO with a critic) no group estimator runs: the advantages are per token and need
    the critic's values, so the trainer computes them from each rollout's score. Here every scored rollout gets the
    placeholder ``advantage = 0.0``, which only marks it as trainable; abstained ones get None as usual.
    With ``advantage = "remax"`` each group's baseline is its greedy completion's score (``baseline_score``); a
    group without one abstains as a whole. REINFORCE++ (both variants) is per token: `assign_token_advantages`; the
    turn-level estimators (``needs_turns``) per turn: `turn_advantages.assign_turn_advantages`."""
    _set_advantages(groups, config)
    return [r.advantage for g in groups for r in g.rollouts]


def _set_advantages(groups: list[RolloutGroup], config: AlgorithmConfig) -> None:
    if config.advantage.needs_critic:
        for group in groups:
            for rollout, score in zip(group.rollouts, group.scores, strict=True):
                rollout.advantage = None if score is None else 0.0
        return
    if not groups:
        return
    if isinstance(config.advantage, ReinforcePPAdvantage | ReinforcePPBaselineAdvantage):
        assign_token_advantages(groups, config.advantage)
        return
    if isinstance(config.advantage, TurnGRPOAdvantage | GiGPOAdvantage):  # needs_turns: per turn
        assign_turn_advantages(groups, config.advantage)
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


def assign_token_advantages(
    groups: list[RolloutGroup], estimator: ReinforcePPAdvantage | ReinforcePPBaselineAdvantage
) -> None:
    """REINFORCE++'s per-token advantages (`compute_reinforce_pp_token_advantages`): each scored rollout gets
    ``token_advantages`` (its segments their share) and ``advantage`` = their mean; abstained ones get None.

    An agent episode is one trajectory: its segments' trained tokens, then the rollout's, in order; the score
    lands on the last of them and the KL penalties (``token_rewards``, under ``kl.type = "reward"``) on their own
    tokens.
    """
    episodes = [[(*r.segments, r) for r in g.rollouts] for g in groups]
    size = max(len(g.rollouts) for g in groups)
    length = max((sum(s.num_loss_tokens for s in e) for es in episodes for e in es), default=0)
    scores = torch.full((len(groups), size), float("nan"), dtype=torch.float64)
    token_rewards = torch.zeros((len(groups), size, length), dtype=torch.float64)
    mask = torch.zeros((len(groups), size, length), dtype=torch.bool)
    for row, (group, group_episodes) in enumerate(zip(groups, episodes, strict=True)):
        for col, (rollout, episode) in enumerate(zip(group.rollouts, group_episodes, strict=True)):
            if rollout.reward is None or rollout.reward.score is None:
                continue
            scores[row, col] = rollout.reward.score
            terms = [t for s in episode for t in (s.token_rewards or [0.0] * s.num_loss_tokens)]
            assert len(terms) == sum(s.num_loss_tokens for s in episode), "one KL penalty per trained token"
            token_rewards[row, col, : len(terms)] = torch.tensor(terms, dtype=torch.float64)
            mask[row, col, : len(terms)] = True
    advantages = compute_reinforce_pp_token_advantages(
        scores,
        token_rewards,
        mask,
        baseline=isinstance(estimator, ReinforcePPBaselineAdvantage),
        gamma=estimator.gamma,
        std=estimator.std,
    )  # [groups, n, length]
    for row, group_episodes in enumerate(episodes):
        for col, episode in enumerate(group_episodes):
            rollout = episode[-1]
            if math.isnan(float(scores[row, col])):
                rollout.advantage = None
                for segment in episode:
                    segment.token_advantages = None
                continue
            values = advantages[row, col, : int(mask[row, col].sum())].tolist()
            offset = 0
            for segment in episode:
                segment.token_advantages = values[offset : offset + segment.num_loss_tokens]
                offset += segment.num_loss_tokens
            rollout.advantage = statistics.fmean(values) if values else 0.0


def reward_metrics(groups: list[RolloutGroup]) -> dict[str, float]:
    rollouts: list[Rollout] = [r for g in groups for r in g.rollouts]
    scores = [r.reward.score for r in rollouts if r.reward is not None and r.reward.score is not None]
    lengths = [len(r.completion_ids) for r in rollouts]
    statuses = Counter(r.reward.status.value for r in rollouts if r.reward is not None)
    metrics = {
        "reward/mean": statistics.fmean(scores) if scores else float("nan"),
        "reward/std": statistics.pstdev(scores) if len(scores) > 1 else 0.0,
        "reward/num_abstained": float(len(rollouts) - len(scores)),
        "reward/abstained_fraction": (len(rollouts) - len(scores)) / max(len(rollouts), 1),
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
        metrics.update(environment_info_metrics(episodes))
    return metrics


def environment_info_metrics(episodes: list[EpisodeRecord]) -> dict[str, float]:
    """The numbers environments put in their steps' ``info``: ``env/<key>_mean`` over the turns that report the
    key (a browser's step_seconds, num_invalid_actions), and for counts (``num_*`` keys) also
    ``env/<key>_per_episode``, the mean of their sums over the episodes that report the key (actions per episode).
    Booleans, strings and lists are not numbers."""
    per_turn: dict[str, list[float]] = {}
    per_episode: dict[str, list[float]] = {}
    for episode in episodes:
        totals: dict[str, float] = {}
        for turn in episode.turns:
            for key, value in turn.info.items():
                if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                    per_turn.setdefault(key, []).append(float(value))
                    if key.startswith("num_"):
                        totals[key] = totals.get(key, 0.0) + float(value)
        for key, total in totals.items():
            per_episode.setdefault(key, []).append(total)
    metrics = {f"env/{key}_mean": statistics.fmean(values) for key, values in sorted(per_turn.items())}
    metrics.update({f"env/{key}_per_episode": statistics.fmean(v) for key, v in sorted(per_episode.items())})
    return metrics
