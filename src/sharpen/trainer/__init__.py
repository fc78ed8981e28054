"""The trainer: `Trainer.step(batch) -> metrics`, algorithm functions, backends, packing. Never imports rollout."""

from sharpen.trainer.backends import SingleDeviceBackend
from sharpen.trainer.trainer import Trainer

__all__ = ["SingleDeviceBackend", "Trainer"]
