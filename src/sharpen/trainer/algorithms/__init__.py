"""Pure torch functions of the PPO/GRPO family: advantages, policy losses, aggregation, KL, off-policy corrections.

No modules, no state, no knowledge of models or batches beyond tensors: each function is tested on
hand-computed cases. The trainer and the loop call them; they call nothing of sharpen's.
"""

from sharpen.trainer.algorithms.advantages import compute_grpo_advantages
from sharpen.trainer.algorithms.aggregation import aggregate_loss, aggregation_normalizer
from sharpen.trainer.algorithms.estimators import (
    AdvantageEstimator,
    compute_advantages,
    compute_discounted_returns,
    compute_drgrpo_advantages,
    compute_gae,
    compute_passk_advantages,
    compute_reinforce_pp_advantages,
    compute_reinforce_pp_baseline_advantages,
    compute_reinforce_pp_token_advantages,
    compute_remax_advantages,
    compute_rloo_advantages,
    whiten,
)
from sharpen.trainer.algorithms.kl import AdaptiveKLController, FixedKLController, entropy_from_logits, kl_per_token
from sharpen.trainer.algorithms.offpolicy import OffPolicyCorrection, compute_correction
from sharpen.trainer.algorithms.policy_losses import (
    PolicyLoss,
    cispo_per_token,
    compute_policy_loss,
    gspo_per_token,
    pg_per_token,
    ppo_clip_per_token,
)

__all__ = [
    "AdaptiveKLController",
    "AdvantageEstimator",
    "FixedKLController",
    "OffPolicyCorrection",
    "PolicyLoss",
    "aggregate_loss",
    "aggregation_normalizer",
    "cispo_per_token",
    "compute_advantages",
    "compute_correction",
    "compute_discounted_returns",
    "compute_drgrpo_advantages",
    "compute_gae",
    "compute_grpo_advantages",
    "compute_passk_advantages",
    "compute_policy_loss",
    "compute_reinforce_pp_advantages",
    "compute_reinforce_pp_baseline_advantages",
    "compute_reinforce_pp_token_advantages",
    "compute_remax_advantages",
    "compute_rloo_advantages",
    "entropy_from_logits",
    "gspo_per_token",
    "kl_per_token",
    "pg_per_token",
    "ppo_clip_per_token",
    "whiten",
]
