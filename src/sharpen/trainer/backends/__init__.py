"""Trainer backends: where the model's parameters live and how a forward/backward/step runs on devices.

Only `single_device` exists today (with `critic`, the value model of PPO with a critic, on the same device);
FSDP2 arrives with the scale-out issue behind the same methods.
"""

from sharpen.trainer.backends.critic import ValueModel
from sharpen.trainer.backends.single_device import ReferencePolicy, SingleDeviceBackend, TokenScores

__all__ = ["ReferencePolicy", "SingleDeviceBackend", "TokenScores", "ValueModel"]
