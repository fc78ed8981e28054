"""The checks of a whole config that concern scale-out: what the runtime's placement, the trainer's ranks and parallel
layout, the engines and the weight transport cannot do together. Pydantic-free functions over a validated
`SharpenConfig` (`schema.SharpenConfig` calls `check_scale_out` from its model validator); each raises ValueError with
one line for the user."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sharpen.config.engines import VllmEngineConfig

if TYPE_CHECKING:
    from sharpen.config.schema import SharpenConfig


def check_scale_out(config: SharpenConfig) -> None:
    """What the runtime's placement, the trainer's ranks, the engines and the weight transport cannot do together."""
    runtime, engine = config.runtime, config.rollout.engine
    parallel = config.trainer.parallel
    if runtime.trainer_ranks % parallel.ranks_per_shard:
        raise ValueError(
            f"trainer.parallel spans {parallel.ranks_per_shard} ranks per data shard (tp {parallel.tp} x "
            f"dp_replicate {parallel.dp_replicate} x pp {parallel.pp} x cp {parallel.cp}), which does not divide "
            f"runtime.trainer_ranks = {runtime.trainer_ranks}: make trainer_ranks a multiple of it"
        )
    if runtime.trainer_ranks > 1 and config.trainer.algorithm.advantage.needs_critic:
        raise ValueError(
            f"runtime.trainer_ranks = {runtime.trainer_ranks} shards the policy with FSDP2, but advantage = "
            f'"{config.trainer.algorithm.advantage.type}" needs a critic, which runs on one device only: use '
            "trainer_ranks = 1"
        )
    if runtime.colocate and config.rollout.mode == "async":
        raise ValueError(
            'runtime.colocate puts the engine to sleep while the trainer steps, but rollout.mode = "async" '
            "generates during training: use one or the other"
        )
    if runtime.colocate and runtime.type == "ray" and config.rollout.num_engines != runtime.trainer_ranks:
        raise ValueError(
            f"runtime.colocate places engine replica i beside trainer rank i: rollout.num_engines = "
            f"{config.rollout.num_engines} must equal runtime.trainer_ranks = {runtime.trainer_ranks}"
        )
    if config.weight_sync.assemble == "receiver":
        if config.weight_sync.transport == "broadcast":
            raise ValueError(
                'weight_sync.assemble = "receiver" sends each trainer rank\'s pieces through the object store; '
                'transport = "broadcast" sends rank 0\'s whole tensors: use one or the other'
            )
        if config.trainer.lora.enabled:
            raise ValueError(
                'weight_sync.assemble = "receiver" assembles the base weights, not LoRA\'s merged or adapter '
                'weights: use assemble = "trainer" with trainer.lora'
            )
    if config.weight_sync.transport == "broadcast" and runtime.type != "ray":
        raise ValueError(
            'weight_sync.transport = "broadcast" sends weights between Ray actors: it needs runtime.type = "ray"'
        )
    tensor_parallel = engine.tensor_parallel_size if isinstance(engine, VllmEngineConfig) else 1
    if runtime.type == "ray" and tensor_parallel > 1 and 0 < runtime.engine_gpus < tensor_parallel:
        raise ValueError(
            f"rollout.engine.tensor_parallel_size = {tensor_parallel} puts one vLLM worker on each of "
            f"{tensor_parallel} GPUs, but runtime.engine_gpus = {runtime.engine_gpus:g} gives the engine "
            "actor fewer"
        )
    if config.weight_sync.broadcast_backend == "nccl":
        if not (runtime.trainer_gpus > 0 and runtime.engine_gpus > 0):
            raise ValueError(
                'weight_sync.broadcast_backend = "nccl" needs GPUs on both ends (runtime.trainer_gpus and '
                "runtime.engine_gpus > 0)"
            )
        if runtime.colocate:
            raise ValueError(
                'weight_sync.broadcast_backend = "nccl" cannot join a trainer rank and an engine that share a GPU '
                '(runtime.colocate): use "gloo" or transport = "object_store"'
            )
