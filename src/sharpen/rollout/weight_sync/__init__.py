"""Weight sync: moving the trainer's full tensors into engines, and checking that they arrived.

Format (`buckets`): tensors packed into shared-memory buckets with a manifest and an xxh3 checksum each.
Protocol (`streaming`): `BucketedSender` streams buckets (filling the next while the receiver loads the current);
`BucketReceiver` verifies them (checksum, order, count) and hands the tensors to an engine's loader.
vLLM's half (`vllm_receiver.VllmWeightReceiver`): a worker extension that loads buckets in one layerwise reload.
Between Ray actors (`broadcast`): a `torch.distributed` weight group (gloo or NCCL) over which trainer rank 0
broadcasts checksummed buckets to every engine at once. LoRA (`adapter`): adapter-only syncs as checked peft folders.
Verification (`verify.verify_probe`): engine and trainer logprobs on a fixed probe must agree after every sync,
and a sync that left the engine unchanged while the trainer changed fails loudly; `verify.ProbeTolerance` is the
bound, fixed in float32 and measured at the first sync with bfloat16.
The Ray object-store transport is not here: the Ray runtime (`orchestration/ray/`) puts a dict of full tensors
into the object store and hands it to the engine's `load_weights`.
"""

from sharpen.rollout.weight_sync.buckets import BucketError, BucketManifest
from sharpen.rollout.weight_sync.streaming import BucketedSender, BucketReceiver, SyncReport
from sharpen.rollout.weight_sync.verify import ProbeCheck, ProbeTolerance, WeightSyncError, verify_probe

__all__ = [
    "BucketError",
    "BucketManifest",
    "BucketReceiver",
    "BucketedSender",
    "ProbeCheck",
    "ProbeTolerance",
    "SyncReport",
    "WeightSyncError",
    "verify_probe",
]
