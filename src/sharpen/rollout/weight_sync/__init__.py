"""Weight sync: moving the trainer's full tensors into engines, and checking that they arrived.

Sender half (`files.write_weights_file`): full tensors -> one safetensors file in shared memory, with a checksum.
Receiver half (`vllm_receiver.VllmWeightReceiver`): a vLLM worker extension that loads such a file in place.
Verification (`verify.verify_probe`): engine and trainer logprobs on a fixed probe must agree after every sync,
and a sync that left the engine unchanged while the trainer changed fails loudly.
Bucketed transports (Ray object store, torch.distributed) arrive with the scale-out issue.
"""

from sharpen.rollout.weight_sync.files import WeightsFile, write_weights_file
from sharpen.rollout.weight_sync.verify import ProbeCheck, WeightSyncError, verify_probe

__all__ = ["ProbeCheck", "WeightSyncError", "WeightsFile", "verify_probe", "write_weights_file"]
