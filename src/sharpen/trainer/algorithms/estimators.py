"""Advantage estimators beyond GRPO: RLOO, REINFORCE++, ReMax, Dr.GRPO, Pass@k, and GAE for PPO with a critic; and
``compute_advantages``, the registry that maps the config's ``trainer.algorithm.advantage`` section to its estimator.

Adding an outcome estimator means: its section in ``config/advantages.py``, a function here and its ``case`` in
``compute_advantages`` (pyright fails on a section of the ``AdvantageConfig`` union without one), and a test.

Pure torch functions over tensors, like ``advantages.py``. The outcome estimators take scores
[num_groups, group_size] with NaN where the reward abstained, exactly as ``compute_grpo_advantages`` does:
abstained entries come back NaN and are left out of every mean and std. Edge cases (a group of one, all-equal
scores, everything abstained, empty tensors) give 0 or NaN-for-abstained, never a NaN from a division.

REINFORCE++ has a token-level form too (``compute_reinforce_pp_token_advantages``: discounted per-token returns,
normalised over the batch's tokens), which is what the loop uses for "reinforce_pp" and "reinforce_pp_baseline".

Deliberately not here: computing the per-token KL penalty (the caller passes it as per-token rewards to
``compute_gae`` or ``compute_reinforce_pp_token_advantages``), loss aggregation (``aggregation.py``; Dr.GRPO's
constant length normaliser lives there), and the critic itself.
"""

from __future__ import annotations

import math
from typing import assert_never

import torch

from sharpen.config.advantages import (
    AdvantageConfig,
    DrGRPOAdvantage,
    GAEAdvantage,
    GiGPOAdvantage,
    GRPOAdvantage,
    PassKAdvantage,
    ReinforcePPAdvantage,
    ReinforcePPBaselineAdvantage,
    ReMaxAdvantage,
    RLOOAdvantage,
    StdConvention,
    TurnGRPOAdvantage,
)
from sharpen.trainer.algorithms.advantages import compute_grpo_advantages


def compute_advantages(
    estimator: AdvantageConfig, scores: torch.Tensor, *, baselines: torch.Tensor | None = None
) -> torch.Tensor:
    """Sequence-level advantages [num_groups, group_size] of the estimator ``estimator``
    (``trainer.algorithm.advantage``), with its section's knobs.

    ``scores``: [num_groups, group_size], NaN where the reward abstained (and where a group is shorter than the
    largest); abstained entries come back NaN. ``baselines``: [num_groups], the score of each group's greedy
    completion, NaN where there is none; needed by ReMax, ignored by the others. GAE is not a group estimator: its
    advantages are per token and come from the critic's values, so the trainer computes them (``compute_gae``);
    the turn-level estimators (``needs_turns``) are per turn (``turn_estimators.py: compute_turn_advantages``).
    """
    match estimator:
        case GRPOAdvantage():
            return compute_grpo_advantages(scores, std=estimator.std)
        case DrGRPOAdvantage():
            return compute_drgrpo_advantages(scores)
        case RLOOAdvantage():
            return compute_rloo_advantages(scores)
        case ReinforcePPAdvantage():
            return compute_reinforce_pp_advantages(scores, std=estimator.std)
        case ReinforcePPBaselineAdvantage():
            return compute_reinforce_pp_baseline_advantages(scores, std=estimator.std)
        case ReMaxAdvantage():
            if baselines is None:
                raise ValueError("ReMax needs baselines: the score of each group's greedy completion")
            return compute_remax_advantages(scores, baselines)
        case PassKAdvantage():
            return compute_passk_advantages(scores, k=estimator.k)
        case GAEAdvantage():
            raise ValueError(
                "GAE is not a group estimator: its per-token advantages need the critic's values, so the trainer "
                "computes them (compute_gae)"
            )
        case TurnGRPOAdvantage() | GiGPOAdvantage():
            raise ValueError(
                f"{estimator.type} is a turn-level estimator: its advantages are per turn of an episode, from the "
                "turns' rewards (compute_turn_advantages)"
            )
        case _:
            assert_never(estimator)


def compute_rloo_advantages(scores: torch.Tensor) -> torch.Tensor:
    """REINFORCE Leave-One-Out advantages (Kool et al. 2019, "Buy 4 REINFORCE samples, get a baseline for free!";
    Ahmadian et al. 2024, "Back to Basics").

    ``scores``: [num_groups, group_size], NaN where abstained. Over the k valid scores of a group,
    A_i = r_i - 1/(k-1) sum_{j != i} r_j = k/(k-1) (r_i - mean_j r_j), so each sample's baseline is independent
    of its own reward and the advantages of a group sum to zero. A group with one valid score, or all-equal
    scores, gets exactly 0; abstained entries stay NaN.
    """
    centred = _center_in_groups(scores)  # [groups, n]: r_i - group mean, NaN where abstained
    num_valid = (~torch.isnan(scores)).sum(dim=1, keepdim=True).to(centred.dtype)  # [groups, 1]
    # k/(k-1) for k >= 2; a group with k <= 1 is already 0 (or all NaN), so any finite factor would do there.
    safe_num_valid = num_valid.clamp(min=2)
    return centred * (safe_num_valid / (safe_num_valid - 1))


def compute_reinforce_pp_advantages(
    scores: torch.Tensor, *, eps: float = 1e-6, std: StdConvention = "unbiased"
) -> torch.Tensor:
    """REINFORCE++ advantages (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning LLMs").

    ``scores``: [num_groups, group_size], NaN where abstained. No per-group baseline: the raw score is
    normalised over the whole batch, A_i = (r_i - mean_batch r) / (std_batch r + eps), with the mean and the
    std (``std`` convention) taken over every valid score of the batch. This is the outcome-reward form (one score per
    sample, gamma = 1, statistics over samples); the paper's per-token form, with the KL penalty to go on each
    token and statistics over tokens, is ``compute_reinforce_pp_token_advantages``, which the loop uses. A batch
    whose valid scores are all equal (std 0) gets exactly 0; abstained entries stay NaN.
    """
    return _normalize_over_batch(scores, eps=eps, std=std)


def compute_reinforce_pp_baseline_advantages(
    scores: torch.Tensor, *, eps: float = 1e-6, std: StdConvention = "unbiased"
) -> torch.Tensor:
    """REINFORCE++-baseline advantages (Hu 2025): the group mean is subtracted first, then the result is
    normalised over the whole batch.

    ``scores``: [num_groups, group_size], NaN where abstained. c_i = r_i - mean_group r, then
    A_i = (c_i - mean_batch c) / (std_batch c + eps) over the valid entries of the batch. Unlike GRPO, the std is
    the batch's, not the group's, so a group with a small spread is not blown up to unit scale. Groups without
    signal contribute zeros (and still count in the batch std); a batch without any signal is exactly 0.
    """
    return _normalize_over_batch(_center_in_groups(scores), eps=eps, std=std)


def compute_reinforce_pp_token_advantages(
    scores: torch.Tensor,
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    baseline: bool = False,
    gamma: float = 1.0,
    eps: float = 1e-6,
    std: StdConvention = "unbiased",
) -> torch.Tensor:
    """REINFORCE++ token-level advantages, the paper's form (Hu 2025, section 3): per-token returns, normalised over
    every completion token of the batch. Returns [num_groups, group_size, seq].

    ``scores``: [num_groups, group_size], the sequence rewards, NaN where abstained. ``token_rewards``,
    ``mask``: [num_groups, group_size, seq]; ``mask`` is true on the trained tokens of each sample, in order, and
    ``token_rewards`` holds the per-token terms there (the KL penalty -coef * KL_k under ``kl.type = "reward"``, else
    0). With R the score (``baseline``: the score minus its group's mean over valid scores, REINFORCE++-baseline),
    rew_k = token_rewards_k + R * [k is the sample's last trained token], and
        G_t = sum_{k >= t} gamma^(k - t) rew_k,    A_t = (G_t - mean G) / (std G + eps),
    with the mean and the std (``std`` convention) over all trained tokens of the valid samples of the batch.
    The discount counts trained tokens only (masked positions are neither steps nor rewards). Masked positions
    get 0; abstained samples NaN everywhere. A batch whose returns are all equal gets exactly 0. With zero
    ``token_rewards`` and gamma = 1, G_t = R on every token: `compute_reinforce_pp_advantages` (or its baseline
    form) up to the statistics, which weigh each sample by its number of tokens.
    """
    if scores.dim() != 2 or token_rewards.shape != mask.shape or token_rewards.shape[:2] != scores.shape:
        raise ValueError(
            "scores must be [num_groups, group_size] and token_rewards, mask [num_groups, group_size, seq]; got "
            f"{list(scores.shape)}, {list(token_rewards.shape)}, {list(mask.shape)}"
        )
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    is_valid = ~torch.isnan(scores)  # [groups, n]
    sequence_rewards = _center_in_groups(scores) if baseline else scores  # [groups, n], NaN where abstained
    trained = mask.bool() & is_valid.unsqueeze(-1)  # [groups, n, seq]
    zeros = torch.zeros_like(token_rewards)
    nan = torch.full_like(token_rewards, float("nan"))
    if trained.shape[-1] == 0:  # no tokens at all (amax below rejects an empty dimension)
        return torch.where(is_valid.unsqueeze(-1), zeros, nan)
    positions = torch.arange(trained.shape[-1], device=trained.device)  # [seq]
    last = torch.where(trained, positions, torch.full_like(positions, -1)).amax(dim=-1)  # [groups, n], -1: none
    is_last = trained & (positions == last.unsqueeze(-1))  # [groups, n, seq]
    rewards = torch.where(trained, token_rewards, zeros)
    rewards = rewards + torch.where(is_last, sequence_rewards.unsqueeze(-1).expand_as(rewards), zeros)
    returns = compute_discounted_returns(rewards, trained, gamma=gamma)  # [groups, n, seq]
    advantages = _normalize_over_batch(torch.where(trained, returns, nan), eps=eps, std=std)
    advantages = torch.where(trained, advantages, zeros)
    return torch.where(is_valid.unsqueeze(-1), advantages, nan)


def compute_discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, *, gamma: float) -> torch.Tensor:
    """G_t = rew_t + gamma * G_t' along the last dimension, t' the next position where ``mask`` is true (0 past the
    last), so masked positions are skipped rather than counted as steps; 0 at masked positions. ``rewards``,
    ``mask``: same shape ([..., seq]). No gradient flows through."""
    rewards = rewards.detach()
    valid = mask.bool()
    returns = torch.zeros_like(rewards)
    running = rewards.new_zeros(rewards.shape[:-1])  # [...]: G at t', 0 past the last valid position
    for t in reversed(range(rewards.shape[-1])):
        running = torch.where(valid[..., t], rewards[..., t] + gamma * running, running)
        returns[..., t] = torch.where(valid[..., t], running, torch.zeros_like(running))
    return returns


def compute_remax_advantages(scores: torch.Tensor, greedy_scores: torch.Tensor) -> torch.Tensor:
    """ReMax advantages (Li et al. 2023, "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method
    for Aligning Large Language Models").

    ``scores``: [num_groups, group_size], NaN where abstained; ``greedy_scores``: [num_groups], the score of the
    greedy (argmax) decode of each group's prompt. A_i = r_i - r_greedy: the greedy response is the baseline.
    A NaN greedy score (its reward abstained) leaves the whole group without a baseline, so it abstains (NaN).
    """
    if greedy_scores.shape != scores.shape[:1]:
        raise ValueError(
            f"greedy_scores must have shape [num_groups] = {list(scores.shape[:1])}, got {list(greedy_scores.shape)}"
        )
    return scores - greedy_scores.unsqueeze(1)  # [groups, n]: NaN propagates from either side


def compute_drgrpo_advantages(scores: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO advantages (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective").

    ``scores``: [num_groups, group_size], NaN where abstained. A_i = r_i - mean_group r: GRPO without the
    division by the group std, which the paper shows up-weights too-easy and too-hard questions. Dr.GRPO's other
    half, dividing the summed token loss by a constant (e.g. the max generation length) instead of each
    sequence's length, is loss aggregation: it lives in the ``normalizer`` passed to the policy loss, not here.
    """
    return _center_in_groups(scores)


def compute_passk_advantages(scores: torch.Tensor, *, k: int) -> torch.Tensor:
    """Pass@k advantages in analytic form (Chen et al. 2025, "Pass@k Training for Adaptively Balancing Exploration
    and Exploitation of Large Reasoning Models", arXiv 2508.10751): the GRPO advantage of the reward "the best of k
    samples drawn from the group is correct", averaged over every k-subset of the group, in closed form.

    ``scores``: [num_groups, group_size], NaN where abstained. A score >= 1 counts as correct, anything below as
    incorrect (the paper's rewards are binary; >= 1 is the verifier's own rule for an ``ok`` status, so partial
    credit, a format bonus or a penalty only matter through it). Over a group's n valid scores, c of them correct:
        rho = 1 - C(n-c, k) / C(n, k)                  the group's pass@k estimate
        sigma = sqrt(rho (1 - rho))
        A_correct = (1 - rho) / sigma
        A_incorrect = (1 - rho - C(n-c-1, k-1) / C(n-1, k-1)) / sigma
    A group whose estimate is 0 or 1 (every sample wrong, or every k-subset holds a correct one: n - c < k,
    including all correct) has sigma = 0 and gets exactly 0, as does a group with fewer than k valid scores (no
    k-subset to draw). k = 1 is GRPO with the population std (and no eps). The advantages of a group sum to 0.
    Abstained entries stay NaN. The binomials are exact integers (``math.comb``), their ratios correctly rounded.
    """
    if k < 1:
        raise ValueError(f"pass@k advantages need k >= 1, got k = {k}")
    valid = ~torch.isnan(scores)  # [groups, n]
    is_correct = valid & (scores >= 1.0)  # [groups, n]
    advantages = torch.where(valid, torch.zeros_like(scores), torch.full_like(scores, float("nan")))
    for row in range(scores.shape[0]):
        n, c = int(valid[row].sum()), int(is_correct[row].sum())  # valid and correct scores of the group
        if n < k:
            continue
        all_wrong = math.comb(n - c, k) / math.comb(n, k)  # 1 - rho: P(a k-subset holds no correct sample)
        if not 0.0 < all_wrong < 1.0:
            continue
        sigma = math.sqrt(all_wrong * (1.0 - all_wrong))
        # P(the other k - 1 samples of a k-subset that holds this incorrect one are incorrect too)
        others_wrong = math.comb(n - c - 1, k - 1) / math.comb(n - 1, k - 1)
        advantages[row] = torch.where(
            is_correct[row],
            torch.full_like(scores[row], all_wrong / sigma),
            torch.full_like(scores[row], (all_wrong - others_wrong) / sigma),
        )
    return torch.where(valid, advantages, torch.full_like(scores, float("nan")))


def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float,
    lam: float,
    bootstrap_values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation for PPO with a critic (Schulman et al. 2016, "High-Dimensional Continuous
    Control Using Generalized Advantage Estimation"). Returns ``(advantages, returns)``, both [batch, seq].

    ``rewards``, ``values``, ``mask``: [batch, seq]; ``mask`` is true (or 1) on the response tokens the policy
    generated. Over the valid tokens only, t' being the next valid token after t:
        delta_t = r_t + gamma * V_t' - V_t,    A_t = delta_t + gamma * lam * A_t',
    with A after the last valid token taken as 0 and V there taken as ``bootstrap_values`` ([batch]; None: 0,
    every episode ends at its last valid token). A completion cut at the token limit did not end: its
    bootstrap is V(s_T), the value of the state after its last token, so the last delta is
    r_T-1 + gamma * V(s_T) - V_T-1; a finished one gets 0 (terminal state). Masked positions are skipped,
    not treated as steps: right padding ends the episode, and an interior masked stretch (e.g. tool output in a
    multi-turn rollout) is passed over, its rewards and values ignored. With a contiguous mask this is the usual
    delta_t = r_t + gamma * V_{t+1} * m_{t+1} - V_t. returns = advantages + values on valid tokens; masked
    positions get 0 for both. Advantages are not whitened here (see ``whiten``). No gradient flows through.
    """
    if rewards.dim() != 2 or rewards.shape != values.shape or rewards.shape != mask.shape:
        raise ValueError(
            "rewards, values and mask must all be [batch, seq]; got "
            f"{list(rewards.shape)}, {list(values.shape)}, {list(mask.shape)}"
        )
    if bootstrap_values is not None and bootstrap_values.shape != values.shape[:1]:
        raise ValueError(
            f"bootstrap_values must be [batch] = {list(values.shape[:1])}, got {list(bootstrap_values.shape)}"
        )
    # Advantages and returns are regression/policy targets: no gradient into the critic through them.
    rewards = rewards.detach()
    values = values.detach()
    valid = mask.bool()  # [batch, seq]
    zeros = torch.zeros_like(values)  # [batch, seq]
    advantages = torch.zeros_like(values)  # [batch, seq]
    next_value = values.new_zeros(values.shape[0])  # [batch]: V at t'; past the last valid token, the bootstrap
    if bootstrap_values is not None:
        next_value = bootstrap_values.detach().to(values.dtype)
    next_advantage = values.new_zeros(values.shape[0])  # [batch]: A at t', likewise
    for t in reversed(range(values.shape[1])):
        is_valid = valid[:, t]  # [batch]
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # [batch]
        advantage = delta + gamma * lam * next_advantage  # [batch]
        # ``torch.where`` rather than multiplying by the mask: a NaN in padding must not leak into valid tokens.
        advantages[:, t] = torch.where(is_valid, advantage, zeros[:, t])
        next_value = torch.where(is_valid, values[:, t], next_value)
        next_advantage = torch.where(is_valid, advantage, next_advantage)
    returns = torch.where(valid, advantages + values, zeros)  # [batch, seq]
    return advantages, returns


def whiten(
    values: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, std: StdConvention = "unbiased"
) -> torch.Tensor:
    """Masked whitening: (x - mean) / (std + 1e-8), mean and std (``std`` convention: unbiased, as veRL's
    masked_whiten, or population) over the entries where ``mask`` is true, 0 where it is false.

    ``values``, ``mask``: same shape (typically [batch, seq]). With ``shift_mean=False`` the mean is added back
    after scaling, (x - mean) / (std + eps) + mean, so only the spread is normalised (the TRL/verl convention,
    used to whiten rewards without moving their level). A mask with no true entries gives all zeros; all-equal
    masked entries give exactly 0 (or the mean, with ``shift_mean=False``).
    """
    if values.shape != mask.shape:
        raise ValueError(f"values and mask must have the same shape; got {list(values.shape)}, {list(mask.shape)}")
    valid = mask.bool()
    nan = torch.full_like(values, float("nan"))
    whitened = _normalize_over_batch(torch.where(valid, values, nan), eps=1e-8, std=std)
    if not shift_mean:
        whitened = whitened + _masked_mean(values, valid)
    return torch.where(valid, whitened, torch.zeros_like(values))


def _center_in_groups(scores: torch.Tensor) -> torch.Tensor:
    """r_i - mean_group r over valid scores, NaN where abstained, exactly 0 for groups without signal."""
    if scores.numel() == 0:  # ``compute_grpo_advantages`` reduces with amax, which rejects an empty group dim
        return scores.clone()
    return compute_grpo_advantages(scores, normalize_std=False)


def _masked_mean(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Scalar mean of ``x`` over the true entries of ``valid``; 0 when there are none."""
    filled = torch.where(valid, x, torch.zeros_like(x))
    return filled.sum() / valid.sum().clamp(min=1)


def _normalize_over_batch(x: torch.Tensor, *, eps: float, std: StdConvention) -> torch.Tensor:
    """(x - mean) / (std + eps) with the mean and std (``std`` convention) over every non-NaN entry of ``x``; NaN
    stays NaN.

    A batch whose valid entries are all equal is exactly 0: ``x - mean`` would keep the mean's rounding error,
    which the division would then turn into a small nonzero advantage (same reasoning as GRPO's flat groups).
    """
    valid = ~torch.isnan(x)
    if not bool(valid.any()):  # also covers empty tensors, where amax/amin below would raise
        return x.clone()
    num_valid = valid.sum()
    mean = _masked_mean(x, valid)
    highest = torch.where(valid, x, torch.full_like(x, -torch.inf)).amax()
    lowest = torch.where(valid, x, torch.full_like(x, torch.inf)).amin()
    has_spread = valid & (highest > lowest)
    centred = torch.where(has_spread, x - mean, torch.zeros_like(x))
    divisor = num_valid if std == "population" else (num_valid - 1).clamp(min=1)  # spread implies >= 2 entries
    deviation = (centred.pow(2).sum() / divisor).sqrt()
    return torch.where(valid, centred / (deviation + eps), torch.full_like(x, float("nan")))
