"""The receiving half inside vLLM workers: a worker extension (vLLM's ``worker_extension_cls``) whose methods take
one bucketed sync (`streaming.py`): begin, load each bucket, finish.

vLLM mixes this class into its worker, so ``self`` is the worker. A sync is one of vLLM's in-place layerwise
reloads spread over several calls: ``begin`` starts it (`initialize_layerwise_reload`: each layer buffers its
tensors and is processed, e.g. repacked for the CPU kernels, as soon as all of them arrived), every bucket goes
through the model's own ``load_weights`` (checkpoint names and fusing, as at start-up), and ``finish`` finalises
the layers that wait for the end. That is what vLLM's ``reload_weights`` does in one call; splitting it lets the
sender stream buckets instead of materialising the whole state dict. Buckets never split a layer, so every layer
of a bucket has been processed (copied out of the shared memory) when the call returns.

Tied weights need one more step. vLLM 0.32's in-place reload re-processes only the modules that received
tensors; a tied output embedding (SmolLM2's ``lm_head``) shares its parameter with the input embedding but gets
no tensor of its own, so on the CPU its prepacked oneDNN matrix stayed stale (the probe check measured a 0.05
nats/token mismatch). Every module that shares a weight with another is therefore re-processed after a sync.

Replies are dicts (``ok``, ``error``): an exception inside a worker would reach the trainer as an opaque RPC
failure, a refusal must read as one.
"""

from __future__ import annotations

from typing import Any

from sharpen.rollout.weight_sync.buckets import BucketError, BucketManifest
from sharpen.rollout.weight_sync.streaming import BucketReceiver


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

    def _sharpen_model(self) -> Any:
        return self.model_runner.get_model()  # type: ignore[attr-defined]

    def sharpen_begin_sync(self, sync_id: str, version: int) -> dict[str, Any]:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        model = self._sharpen_model()

        def load_tensors(tensors: list[tuple[str, Any]]) -> None:
            with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
                model.load_weights(iter(tensors))

        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            initialize_layerwise_reload(model)
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
