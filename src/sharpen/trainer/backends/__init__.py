"""Trainer backends: where the model's parameters live and how a forward/backward/step runs on devices.

Only `single_device` exists today; FSDP2 arrives with the scale-out issue behind the same methods.
"""

from sharpen.trainer.backends.single_device import ReferencePolicy, SingleDeviceBackend, TokenScores

__all__ = ["ReferencePolicy", "SingleDeviceBackend", "TokenScores"]
