"""Trainer backends: where the model's parameters live and how a forward/backward/step runs on devices.

`single_device` (with `critic`, the value model of PPO with a critic, on the same device) and `fsdp2` (data
parallel, sharded, one process per rank) behind the same methods (`base.TrainerBackend`). Below them, and importing
none of them: `lora` (adapters), `teacher` (the distillation teacher), `frozen` (the models that score without
gradient: the reference policies), `scoring` (the forward pass they all share), `chunked_logits` and `cpu_memory`;
an import-linter contract keeps that order. Above them all, `sharded_reference`: a sharded trainer's reference
policy, an `fsdp2` backend of its own. `fsdp2` is imported from its module
(``from sharpen.trainer.backends.fsdp2 import FSDP2Backend``; ranks join with `mesh.init_distributed`), not
re-exported here: it pulls in torch.distributed's FSDP, DTensor and checkpoint packages, about 1 s on every
``import sharpen.trainer``.
"""

from sharpen.trainer.backends.base import TokenScores
from sharpen.trainer.backends.critic import ValueModel
from sharpen.trainer.backends.frozen import ReferencePolicy
from sharpen.trainer.backends.single_device import SingleDeviceBackend

__all__ = ["ReferencePolicy", "SingleDeviceBackend", "TokenScores", "ValueModel"]
