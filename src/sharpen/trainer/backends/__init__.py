"""Trainer backends: where the model's parameters live and how a forward/backward/step runs on devices.

`single_device` (with `critic`, the value model of PPO with a critic, on the same device) and `fsdp2` (data
parallel, sharded, one process per rank) behind the same methods. `fsdp2` is imported from its module
(``from sharpen.trainer.backends.fsdp2 import FSDP2Backend, init_distributed``), not re-exported here: it pulls in
torch.distributed's FSDP, DTensor and checkpoint packages, about 1 s on every ``import sharpen.trainer``.
"""

from sharpen.trainer.backends.base import TokenScores
from sharpen.trainer.backends.critic import ValueModel
from sharpen.trainer.backends.single_device import ReferencePolicy, SingleDeviceBackend

__all__ = ["ReferencePolicy", "SingleDeviceBackend", "TokenScores", "ValueModel"]
