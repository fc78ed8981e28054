"""Pure torch functions of the PPO/GRPO family: advantages, policy losses, aggregation, KL, off-policy corrections.

No modules, no knowledge of models or batches beyond tensors: each function is tested on hand-computed cases. The
registries (`compute_advantages`, `compute_turn_advantages`, `compute_policy_loss`, `compute_correction`,
`build_kl_controller`) map the objective's typed config sections to their functions; the trainer's `Objective` and
the loop call them. They import nothing of sharpen's but the config sections.
"""

from sharpen.trainer.algorithms.advantages import compute_grpo_advantages
from sharpen.trainer.algorithms.aggregation import aggregate_loss, aggregation_normalizer
from sharpen.trainer.algorithms.estimators import (
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
from sharpen.trainer.algorithms.kl import (
    AdaptiveKLController,
    FixedKLController,
    build_kl_controller,
    entropy_from_logits,
    kl_per_token,
)
from sharpen.trainer.algorithms.offpolicy import OffPolicyCorrection, compute_correction
from sharpen.trainer.algorithms.policy_losses import (
    cispo_per_token,
    compute_policy_loss,
    gspo_per_token,
    pg_per_token,
    ppo_clip_per_token,
)
from sharpen.trainer.algorithms.turn_estimators import (
    compute_gigpo_advantages,
    compute_turn_advantages,
    compute_turn_grpo_advantages,
    compute_turn_returns,
)

__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "OffPolicyCorrection",
    "aggregate_loss",
    "aggregation_normalizer",
    "build_kl_controller",
    "cispo_per_token",
    "compute_advantages",
    "compute_correction",
    "compute_discounted_returns",
    "compute_drgrpo_advantages",
    "compute_gae",
    "compute_gigpo_advantages",
    "compute_grpo_advantages",
    "compute_passk_advantages",
    "compute_policy_loss",
    "compute_reinforce_pp_advantages",
    "compute_reinforce_pp_baseline_advantages",
    "compute_reinforce_pp_token_advantages",
    "compute_remax_advantages",
    "compute_rloo_advantages",
    "compute_turn_advantages",
    "compute_turn_grpo_advantages",
    "compute_turn_returns",
    "entropy_from_logits",
    "gspo_per_token",
    "kl_per_token",
    "pg_per_token",
    "ppo_clip_per_token",
    "whiten",
]
