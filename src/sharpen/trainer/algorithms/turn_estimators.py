"""Turn-level advantage estimators for multi-turn episodes: turn-level GRPO (discounted turn returns normalised over
the group's turns) and GiGPO (an episode-level group advantage plus a step-level one over the turns of the group that
started from the same state); and ``compute_turn_advantages``, their registry.

Pure torch functions over tensors of turns, [num_groups, group_size, max_turns], like ``estimators.py``'s over
samples: ``turn_mask`` is true on the turns a sample played (a prefix of its row), ``turn_rewards`` holds each
turn's reward there. A sample without any turn abstained (its reward did): it comes back NaN on every turn, and is
left out of every mean and std. Positions past a sample's last turn come back 0. Each group is computed on its own,
so the advantages do not depend on which groups share a step (split invariance).

Deliberately not here: which tokens make a turn, what a turn's reward is (the environment's step reward plus its
tokens' KL penalties, the rest of the score on the last turn) and which observations are the same state; the
orchestration reads those off the rollouts' episode records (`orchestration/turn_advantages.py`).
"""

from __future__ import annotations

from typing import assert_never

import torch

from sharpen.config.advantages import GiGPOAdvantage, StdConvention, TurnAdvantageConfig, TurnGRPOAdvantage
from sharpen.trainer.algorithms.advantages import compute_grpo_advantages
from sharpen.trainer.algorithms.estimators import compute_discounted_returns


def compute_turn_advantages(
    estimator: TurnAdvantageConfig, turn_rewards: torch.Tensor, turn_mask: torch.Tensor, states: torch.Tensor
) -> torch.Tensor:
    """Per-turn advantages [num_groups, group_size, max_turns] of the turn-level estimator ``estimator``
    (``trainer.algorithm.advantage`` with ``needs_turns``), with its section's knobs. ``states``: [num_groups,
    group_size, max_turns] integer ids, equal for turns of one group that started from the same state (GiGPO's
    anchor states; turn-level GRPO ignores them)."""
    match estimator:
        case TurnGRPOAdvantage():
            return compute_turn_grpo_advantages(turn_rewards, turn_mask, gamma=estimator.gamma, std=estimator.std)
        case GiGPOAdvantage():
            return compute_gigpo_advantages(
                turn_rewards,
                turn_mask,
                states,
                gamma=estimator.gamma,
                omega=estimator.omega,
                normalize_std=estimator.normalize_std,
            )
        case _:
            assert_never(estimator)


def compute_turn_returns(turn_rewards: torch.Tensor, turn_mask: torch.Tensor, *, gamma: float) -> torch.Tensor:
    """R_t = sum_{k >= t} gamma^(k - t) r_k over each sample's turns; 0 past its last turn (and for samples without
    turns). Shapes [num_groups, group_size, max_turns]."""
    _check_shapes(turn_rewards, turn_mask)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    played = turn_mask.bool()
    rewards = torch.where(played, turn_rewards, torch.zeros_like(turn_rewards))  # NaN of abstained rows dropped
    return compute_discounted_returns(rewards, played, gamma=gamma)


def compute_turn_grpo_advantages(
    turn_rewards: torch.Tensor,
    turn_mask: torch.Tensor,
    *,
    gamma: float,
    std: StdConvention = "unbiased",
    eps: float = 1e-6,
) -> torch.Tensor:
    """Turn-level GRPO: A_it = (R_it - mean_g R) / (std_g R + eps), R_it the discounted return of sample i's turn t
    (`compute_turn_returns`), the mean and std (``std`` convention) over **every turn of the group** (all samples,
    all turn indices; each turn counts once, whatever its number of tokens). Not per turn index: the samples still
    playing at a late turn are the ones that have not yet succeeded, so a per-index group would compare failures
    with failures and leave a lone late turn without signal. A group whose returns are all equal gets exactly 0.
    With gamma = 1 and one reward at each episode's end every turn of an episode has its episode's return, and
    with equal numbers of turns this is GRPO on the episodes. Returns [num_groups, group_size, max_turns]."""
    returns = compute_turn_returns(turn_rewards, turn_mask, gamma=gamma)  # [groups, n, turns]
    played = turn_mask.bool()
    num_groups, group_size, max_turns = returns.shape
    if max_turns == 0 or group_size == 0:
        return _finish(returns, played)
    values = torch.where(played, returns, torch.full_like(returns, float("nan")))
    flat = compute_grpo_advantages(values.reshape(num_groups, group_size * max_turns), std=std, eps=eps)
    return _finish(flat.reshape(num_groups, group_size, max_turns), played)


def compute_gigpo_advantages(
    turn_rewards: torch.Tensor,
    turn_mask: torch.Tensor,
    states: torch.Tensor,
    *,
    gamma: float,
    omega: float = 1.0,
    normalize_std: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GiGPO advantages (Feng et al. 2025, "Group-in-Group Policy Optimization for LLM Agent Training", arXiv
    2505.10978, section 4): A_it = A^E_i + omega * A^S_it.

    Episode level: A^E_i = (R_i - mean_g R) / F, R_i = sum_t r_it the episode's (undiscounted) return, over the
    group's samples. Step level: the turns of a group that started from the same state (equal ``states`` ids, at any
    turn index: the paper's anchor states) form a step group, and A^S_it = (R_it - mean R) / F over it, R_it the
    discounted return of the turn (`compute_turn_returns`). F is the group's std (unbiased) + eps with
    ``normalize_std``, else 1 (the paper's F_norm = 1). A group (or step group) of one, or without spread, gives
    exactly 0 at its level. Returns [num_groups, group_size, max_turns]."""
    _check_shapes(turn_rewards, states)
    returns = compute_turn_returns(turn_rewards, turn_mask, gamma=gamma)  # [groups, n, turns]
    played = turn_mask.bool()
    if returns.shape[1] == 0 or returns.shape[2] == 0:
        return _finish(returns, played)
    has_turns = played.any(dim=-1)  # [groups, n]
    filled = torch.where(played, turn_rewards, torch.zeros_like(turn_rewards))
    nan = torch.full(has_turns.shape, float("nan"), dtype=filled.dtype)
    episode_returns = torch.where(has_turns, filled.sum(dim=-1), nan)  # [groups, n]: NaN where abstained
    episode = compute_grpo_advantages(episode_returns, normalize_std=normalize_std, eps=eps)  # [groups, n]
    step = _step_group_advantages(returns, played, states, normalize_std=normalize_std, eps=eps)
    return _finish(episode.unsqueeze(-1) + omega * step, played)


def _step_group_advantages(
    returns: torch.Tensor, played: torch.Tensor, states: torch.Tensor, *, normalize_std: bool, eps: float
) -> torch.Tensor:
    """GiGPO's step level: each played turn's return relative to the played turns of its group with the same
    state id; 0 elsewhere. One row per (group, state) through `compute_grpo_advantages`."""
    members: list[list[tuple[int, int, int]]] = []  # per step group: its turns as (group, sample, turn)
    for group in range(returns.shape[0]):
        by_state: dict[int, list[tuple[int, int, int]]] = {}
        for sample in range(returns.shape[1]):
            for turn in range(returns.shape[2]):
                if played[group, sample, turn]:
                    by_state.setdefault(int(states[group, sample, turn]), []).append((group, sample, turn))
        members += by_state.values()
    advantages = torch.zeros_like(returns)
    if not members:
        return advantages
    size = max(len(m) for m in members)
    table = torch.full((len(members), size), float("nan"), dtype=returns.dtype)  # [step groups, largest]
    for row, turns in enumerate(members):
        table[row, : len(turns)] = torch.stack([returns[t] for t in turns])
    relative = compute_grpo_advantages(table, normalize_std=normalize_std, eps=eps)
    for row, turns in enumerate(members):
        for col, turn in enumerate(turns):
            advantages[turn] = relative[row, col]
    return advantages


def _finish(advantages: torch.Tensor, played: torch.Tensor) -> torch.Tensor:
    """0 past each sample's last turn, NaN on every turn of a sample without turns (abstained)."""
    has_turns = played.any(dim=-1, keepdim=True).expand_as(played)  # [groups, n, turns]
    zeros = torch.zeros_like(advantages)
    return torch.where(has_turns, torch.where(played, advantages, zeros), torch.full_like(advantages, float("nan")))


def _check_shapes(turn_rewards: torch.Tensor, other: torch.Tensor) -> None:
    if turn_rewards.dim() != 3 or turn_rewards.shape != other.shape:
        raise ValueError(
            "turn tensors must all be [num_groups, group_size, max_turns]; got "
            f"{list(turn_rewards.shape)} and {list(other.shape)}"
        )
