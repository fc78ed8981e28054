"""The trainer: `Trainer.step(batch) -> metrics`, algorithm functions, backends, packing. Never imports rollout."""

from sharpen.trainer.backends import ReferencePolicy, SingleDeviceBackend, ValueModel
from sharpen.trainer.trainer import Trainer

__all__ = ["ReferencePolicy", "SingleDeviceBackend", "Trainer", "ValueModel"]
