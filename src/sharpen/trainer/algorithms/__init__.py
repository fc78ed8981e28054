"""Pure torch functions of the PPO/GRPO family: advantages, policy losses, mismatch metrics.

No modules, no state, no knowledge of models or batches beyond tensors: each function is tested on
hand-computed cases. The trainer and the loop call them; they call nothing of sharpen's.
"""

from sharpen.trainer.algorithms.advantages import compute_grpo_advantages
from sharpen.trainer.algorithms.losses import PolicyLossOutput, compute_ppo_clip_loss
from sharpen.trainer.algorithms.mismatch import compute_mismatch_metrics

__all__ = ["PolicyLossOutput", "compute_grpo_advantages", "compute_mismatch_metrics", "compute_ppo_clip_loss"]
