"""The receiving half inside vLLM workers: a worker extension (vLLM's ``worker_extension_cls``) whose methods take
one bucketed sync (`streaming.py`): begin, load each bucket, finish.

vLLM mixes this class into its worker, so ``self`` is the worker. A sync is one of vLLM's in-place layerwise
reloads spread over several calls: ``begin`` starts it (`initialize_layerwise_reload`: each layer buffers its
tensors and is processed, e.g. repacked for the CPU kernels, as soon as all of them arrived), every bucket goes
through the model's own ``load_weights`` (checkpoint names and fusing, as at start-up; a family that transformers
holds fused in memory, the MoE experts, is named per expert first: `checkpoint_names`), and ``finish`` finalises
the layers that wait for the end. That is what vLLM's ``reload_weights`` does in one call; splitting it lets the
sender stream buckets instead of materialising the whole state dict. Buckets never split a layer, so every layer
of a bucket has been processed (copied out of the shared memory) when the call returns.

Tied weights need one more step. vLLM 0.32's in-place reload re-processes only the modules that received
tensors; a tied output embedding (SmolLM2's ``lm_head``) shares its parameter with the input embedding but gets
no tensor of its own, so on the CPU its prepacked oneDNN matrix stayed stale (the probe check measured a 0.05
nats/token mismatch). Every module that shares a weight with another is therefore re-processed after a sync.

vLLM warns "RotaryEmbedding: Failed to load weights" and "ParallelLMHead: Failed to load weights" on every sync:
`finalize_layerwise_reload` warns for each layer that received no tensor and then restores its current ones. The
rotary cache is computed, never in a checkpoint, and the tied head has no tensor of its own, so those two layers
never receive one: the warnings are expected (docs/weight-sync.md) and the restored tensors are right.

The same worker can instead be a member of a weight group (`broadcast.py`, ``weight_sync.transport =
"broadcast"``): ``sharpen_join_weight_group`` joins it (gloo, or NCCL on the worker's own GPU), and
``sharpen_receive_broadcast`` takes one broadcast sync straight into the model through the same layerwise reload,
so the weights never pass through the engine's host process or shared memory.

Replies are dicts (``ok``, ``error``): an exception inside a worker would reach the trainer as an opaque RPC
failure, a refusal must read as one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from sharpen.rollout.weight_sync.buckets import BucketError, BucketManifest
from sharpen.rollout.weight_sync.checkpoint_names import CheckpointNames
from sharpen.rollout.weight_sync.streaming import BucketReceiver


def _repack_cpu_experts(model: Any, received: set[str]) -> int:
    """Prepack again the expert weights of the CPU MoE kernels that this sync reloaded (a tensor of ``received``
    under the layer's name); returns how many layers. vLLM 0.32 prepacks them (its grouped-gemm layout) only when
    the kernel is first set up: a later reload copies plain weights into the packed storage and leaves the kernel
    reading them as packed (reloading a model's own weights moved the probe by 0.048 nats/token here). Running the
    experts' own prepack again puts them in its layout; a layer the sync did not reach is still packed."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a vLLM without the CPU experts
        return 0
    num = 0
    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        # the kernel's module is ``...experts.routed_experts``; checkpoint tensors are ``...experts.<e>.w1.weight``
        prefix = name.removesuffix(".routed_experts") + "."
        if isinstance(experts, CPUUnquantizedExperts) and any(r.startswith(prefix) for r in received):
            experts.process_weights_after_loading(module)
            num += 1
    return num


def _reprocess_tied_modules(model: Any) -> int:
    owners: dict[int, list[Any]] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if weight is not None and getattr(module, "quant_method", None) is not None:
            owners.setdefault(id(weight), []).append(module)
    num = 0
    for modules in owners.values():
        if len(modules) > 1:
            for module in modules:
                module.quant_method.process_weights_after_loading(module)
                num += 1
    return num


class VllmWeightReceiver:
    _sharpen_receiver: BucketReceiver | None = None
    _sharpen_group: Any = None
    _sharpen_group_device: Any = None
    _sharpen_names: CheckpointNames | None
    _sharpen_received: set[str] = set()  # noqa: RUF012  (replaced per sync, never mutated here)

    def _sharpen_model(self) -> Any:
        return self.model_runner.get_model()  # type: ignore[attr-defined]

    def _sharpen_begin_reload(self) -> Callable[[Iterable[tuple[str, Any]]], None]:
        """Start vLLM's layerwise reload; returns the function that loads tensors into it."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        model = self._sharpen_model()
        if not hasattr(self, "_sharpen_names"):  # the trainer's fused MoE experts, named per expert (built once)
            self._sharpen_names = CheckpointNames.of(self.vllm_config.model_config.hf_config)  # type: ignore[attr-defined]
        names = self._sharpen_names
        received = self._sharpen_received = set()

        def renamed(tensors: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
            for name, tensor in tensors if names is None else names(tensors):
                received.add(name)
                yield name, tensor

        def load_tensors(tensors: Iterable[tuple[str, Any]]) -> None:
            with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
                model.load_weights(renamed(tensors))

        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            initialize_layerwise_reload(model)
        return load_tensors

    def sharpen_join_weight_group(
        self, master_addr: str, master_port: int, first_rank: int, world_size: int, backend: str
    ) -> dict[str, Any]:
        """Join the weight group as rank ``first_rank`` + this worker's rank within its engine."""
        import torch

        from sharpen.rollout.weight_sync.broadcast import open_weight_group

        rank = first_rank + int(getattr(self, "rank", 0))
        try:
            self._sharpen_group = open_weight_group(
                rank=rank, world_size=world_size, master_addr=master_addr, master_port=master_port, backend=backend
            )
        except Exception as error:  # a refusal the engine can name, not an opaque RPC failure
            return {"ok": False, "error": f"joining the weight group as rank {rank}: {type(error).__name__}: {error}"}
        self._sharpen_group_device = self.device if backend == "nccl" else torch.device("cpu")  # type: ignore[attr-defined]
        return {"ok": True, "rank": rank}

    def sharpen_receive_broadcast(self, version: int) -> dict[str, Any]:
        """Load one broadcast sync (verified bucket by bucket by `receive_weights`). On any failure the rest of the
        sync is still drained, so the sender and the other receivers finish, and the reload is ended."""
        from sharpen.rollout.weight_sync.broadcast import receive_weights

        if self._sharpen_group is None:
            return {"ok": False, "error": "this worker has not joined a weight group"}
        started = time.perf_counter()
        tensors = receive_weights(self._sharpen_group, version=version, device=self._sharpen_group_device)
        counted = _Counted(tensors)
        load_tensors = self._sharpen_begin_reload()
        error: Exception | None = None
        try:
            load_tensors(counted)
        except Exception as failure:
            error = failure
            try:
                for _ in tensors:  # drain: the sender is mid-send
                    pass
            except BucketError:
                pass
        num_tied = self._sharpen_finalize()
        if error is not None:
            message = str(error) if isinstance(error, BucketError) else f"{type(error).__name__}: {error}"
            return {"ok": False, "error": message}
        return {
            "ok": True,
            "version": version,
            "num_tensors": counted.count,
            "num_tied_reprocessed": num_tied,
            "load_seconds": time.perf_counter() - started,
        }

    def sharpen_begin_sync(self, sync_id: str, version: int) -> dict[str, Any]:
        load_tensors = self._sharpen_begin_reload()
        self._sharpen_receiver = BucketReceiver(load_tensors)
        self._sharpen_receiver.begin(sync_id, version)
        return {"ok": True}

    def sharpen_load_bucket(self, manifest: dict[str, Any]) -> dict[str, Any]:
        if self._sharpen_receiver is None:
            return {"ok": False, "error": "a bucket arrived outside a sync"}
        try:
            self._sharpen_receiver.load(BucketManifest.from_dict(manifest))
        except BucketError as error:
            return {"ok": False, "error": str(error)}
        return {"ok": True}

    def _sharpen_finalize(self) -> int:
        """End vLLM's reload: layers that got nothing are put back as they were, never left on the meta device."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        model = self._sharpen_model()
        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            finalize_layerwise_reload(model, self.vllm_config.model_config)  # type: ignore[attr-defined]
        num_tied = _reprocess_tied_modules(model)
        _repack_cpu_experts(model, self._sharpen_received)
        self.model_runner.reset_encoder_cache()  # type: ignore[attr-defined]
        self.model_runner.reset_mm_cache()  # type: ignore[attr-defined]
        return num_tied

    def sharpen_abort_sync(self, sync_id: str) -> dict[str, Any]:
        if self._sharpen_receiver is not None:
            self._sharpen_receiver = None
            self._sharpen_finalize()
        return {"ok": True}

    def sharpen_finish_sync(self, sync_id: str, num_buckets: int, checksum: str) -> dict[str, Any]:
        receiver, self._sharpen_receiver = self._sharpen_receiver, None
        num_tied = self._sharpen_finalize()
        if receiver is None:
            return {"ok": False, "error": "finish without a sync"}
        try:
            reply = receiver.finish(sync_id, num_buckets, checksum)
        except BucketError as error:
            return {"ok": False, "error": str(error)}
        return {"ok": True, **reply, "num_tied_reprocessed": num_tied}


class _Counted:
    """Iterates ``items`` and counts them."""

    def __init__(self, items: Iterable[Any]) -> None:
        self.items = items
        self.count = 0

    def __iter__(self) -> Iterator[Any]:
        for item in self.items:
            self.count += 1
            yield item
