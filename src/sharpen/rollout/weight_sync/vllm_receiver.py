"""The receiving half inside vLLM workers: a worker extension (vLLM's ``worker_extension_cls``) whose method
loads a safetensors weights file into the running model in place.

vLLM mixes this class into its worker, so ``self`` is the worker: ``self.reload_weights`` is vLLM's in-place
reload of checkpoint-format tensors (the CPU build repacks layers after loading, so the model's own
``load_weights`` cannot be used there). The method recomputes the checksum of what it read, so a truncated or
corrupted file is reported instead of loaded.

Tied weights need one more step. vLLM 0.32's in-place reload re-processes only the modules that received
tensors; a tied output embedding (SmolLM2's ``lm_head``) shares its parameter with the input embedding but gets
no tensor of its own, so on the CPU its prepacked oneDNN matrix stayed stale (the probe check measured a 0.05
nats/token mismatch). Every module that shares a weight with another is therefore re-processed after a reload.
"""

from __future__ import annotations

from typing import Any


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
    def sharpen_load_weights_file(self, path: str, expected_checksum: str) -> dict[str, Any]:
        from safetensors.torch import load_file

        from sharpen.rollout.weight_sync.files import tensor_checksum

        state = load_file(path)
        checksum = tensor_checksum(sorted(state.items()))
        if checksum != expected_checksum:
            return {"ok": False, "checksum": checksum, "error": f"checksum {checksum} != sent {expected_checksum}"}
        self.reload_weights(weights_iterator=iter(state.items()), is_checkpoint_format=True)  # type: ignore[attr-defined]
        num_tied = _reprocess_tied_modules(self.model_runner.get_model())  # type: ignore[attr-defined]
        return {"ok": True, "checksum": checksum, "num_tensors": len(state), "num_tied_reprocessed": num_tied}
