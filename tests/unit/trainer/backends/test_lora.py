"""LoRA on the single-device backend (tiny random Llama): only the adapters train, the base weights stay put, the
merged weights are W + (alpha / r) B A, the step's gradient does not depend on the micro-batch split, resume is
exact, the export is the merged model, and the disabled-adapter reference is the base model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sharpen.config.schema import TrainerConfig
from sharpen.trainer import SingleDeviceBackend, Trainer
from sharpen.trainer.backends.frozen import LoraReferencePolicy
from sharpen.trainer.backends.lora import adapter_num_bytes
from sharpen.types import TrainBatch
from support.tiny_trainer import PAD, captured_step, random_rollouts, single_device_trainer

_LORA = {"enabled": True, "rank": 4, "alpha": 8}


def _config(**overrides) -> TrainerConfig:
    values = {"device": "cpu", "precision": "float32", "learning_rate": 1e-2, "micro_batch_size": 6, "lora": _LORA}
    return TrainerConfig(**{**values, **overrides})


def _trainer(model_dir: Path, **overrides) -> Trainer:
    return single_device_trainer(_config(**overrides), model_dir)


def _params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.backend.model.named_parameters()}


def test_only_the_adapters_train_and_the_base_weights_stay(model_dir):
    trainer = _trainer(model_dir)
    model = trainer.backend.model
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    # 2 layers x 7 projections, an A and a B each
    assert len(trainable) == 2 * 7 * 2
    optimized = {id(p) for group in trainer.backend.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in model.parameters() if p.requires_grad}
    before = _params(trainer)
    for seed in (1, 2):
        trainer.step(TrainBatch(rollouts=random_rollouts(seed), step=seed))
    after = _params(trainer)
    for name in before:
        if name in trainable:
            if ".lora_B." in name:  # B starts at zero and must have moved; A moves too (its gradient is B-driven)
                assert after[name].abs().max() > 1e-4, name
        else:
            assert torch.equal(before[name], after[name]), name
    assert any(not torch.equal(before[name], after[name]) for name in trainable if ".lora_A." in name)


def test_merged_weights_are_base_plus_scaled_low_rank_product(model_dir):
    from transformers import AutoModelForCausalLM

    trainer = _trainer(model_dir)
    trainer.step(TrainBatch(rollouts=random_rollouts(1), step=0))
    merged = dict(trainer.named_weights())
    assert len(merged) == 2 * 7 and all(name.startswith("model.layers.") for name in merged)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    params = dict(trainer.backend.model.named_parameters())
    name = "model.layers.1.self_attn.q_proj"
    a = params[f"{name}.lora_A.default.weight"].double()  # [r, in]
    b = params[f"{name}.lora_B.default.weight"].double()  # [out, r]
    expected = base[f"{name}.weight"].double() + (8.0 / 4) * b @ a
    assert (b @ a).abs().max() > 1e-5  # a real update
    torch.testing.assert_close(merged[f"{name}.weight"].double(), expected, rtol=0, atol=1e-6)
    # the trainer's forward is the merged model's forward
    ids = torch.tensor([[5, 9, 17, 33, 2, 70]])
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    plain.load_state_dict({**plain.state_dict(), **merged})
    reference = torch.log_softmax(plain(input_ids=ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(trainer.compute_logprobs(ids[0].tolist())), reference, atol=1e-5, rtol=0)


def test_lora_gradient_does_not_depend_on_the_micro_batch_size(model_dir, monkeypatch):
    batch = TrainBatch(rollouts=random_rollouts(seed=3), step=0)
    backend = _trainer(model_dir).backend
    # a nonzero B so that A's gradient is nonzero too
    for name, param in backend.model.named_parameters():
        if ".lora_B." in name:
            torch.nn.init.normal_(param.data, std=0.1, generator=torch.Generator().manual_seed(len(name)))
    gradients = {}
    for size in (6, 2, 1):
        trainer = Trainer(_config(micro_batch_size=size), backend=backend, pad_token_id=PAD)
        gradients[size] = captured_step(trainer, batch, monkeypatch)[1]  # the frozen base gets no gradient at all
    whole = gradients[6]
    assert max(g.abs().max().item() for g in whole.values()) > 1e-4
    for size in (2, 1):
        for name, grad in gradients[size].items():
            torch.testing.assert_close(grad, whole[name], rtol=1e-4, atol=1e-6)


def test_resume_from_a_lora_checkpoint_is_exact(model_dir, tmp_path):
    first = _trainer(model_dir)
    first.step(TrainBatch(rollouts=random_rollouts(1), step=0))
    first.save_checkpoint(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "lora" / "adapter.safetensors").is_file()
    assert not (tmp_path / "ckpt" / "model.safetensors").exists()  # the base weights are the model folder's
    first.step(TrainBatch(rollouts=random_rollouts(2), step=1))
    resumed = _trainer(model_dir)
    resumed.load_checkpoint(tmp_path / "ckpt")
    resumed.step(TrainBatch(rollouts=random_rollouts(2), step=1))
    expected, got = _params(first), _params(resumed)
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


def test_export_writes_the_merged_model_and_the_adapter(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    trainer = _trainer(model_dir)
    trainer.step(TrainBatch(rollouts=random_rollouts(1), step=0))
    trainer.export(tmp_path / "out")
    assert (tmp_path / "out" / "adapter" / "adapter_config.json").is_file()
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    ids = [5, 9, 17, 33, 2, 70]
    tensor = torch.tensor([ids])
    logprobs = torch.log_softmax(exported(input_ids=tensor).logits[0, :-1], -1).gather(-1, tensor[0, 1:, None])[:, 0]
    torch.testing.assert_close(logprobs, torch.tensor(trainer.compute_logprobs(ids)), atol=1e-5, rtol=0)


def test_disabled_adapters_are_the_base_model(model_dir):
    from transformers import AutoModelForCausalLM

    trainer = _trainer(model_dir)
    for seed in (1, 2):
        trainer.step(TrainBatch(rollouts=random_rollouts(seed), step=seed))
    backend = trainer.backend
    assert isinstance(backend, SingleDeviceBackend) and backend.lora is not None
    reference = LoraReferencePolicy(backend.lora, device=backend.device, precision="float32")
    ids = torch.tensor([[5, 9, 17, 33, 2, 70]])
    mask = torch.ones_like(ids)
    targets = torch.ones((1, 5), dtype=torch.bool)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    expected = torch.log_softmax(base(input_ids=ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
    torch.testing.assert_close(
        reference.token_logprobs(ids, mask, targets, temperature=1.0)[0], expected, atol=1e-5, rtol=0
    )
    policy = torch.tensor(trainer.compute_logprobs(ids[0].tolist()))
    assert (policy - expected).abs().max() > 1e-4  # the adapters are back on after the reference pass


def test_sync_sends_fewer_bytes_than_full_fine_tuning(model_dir):
    lora = _trainer(model_dir)
    full = _trainer(model_dir, lora={"enabled": False})
    lora_bytes = sum(t.numel() * t.element_size() for _, t in lora.named_weights())
    full_bytes = sum(t.numel() * t.element_size() for _, t in full.named_weights())
    linear = sum(t.numel() * 4 for name, t in full.named_weights() if name.endswith("_proj.weight"))
    assert lora_bytes == linear < full_bytes  # the projections only: no embedding, no norms
    backend = lora.backend
    assert isinstance(backend, SingleDeviceBackend) and backend.lora is not None
    # float32 x 2 layers x rank 4 x (in + out) of q, k, v, o (hidden 32, kv 16), gate, up, down (MLP 64)
    assert adapter_num_bytes(backend.lora) == 4 * 2 * 4 * (64 + 48 + 48 + 64 + 96 + 96 + 96)


def test_a_target_that_matches_no_module_is_refused(model_dir):
    # (an adapter-only sync with an engine that cannot serve adapters: test_lora_adapter_sync.py)
    with pytest.raises(ValueError, match="matched no module"):
        _trainer(model_dir, lora={**_LORA, "target_modules": ["nope_proj"]})


def test_lora_with_a_colocated_engine_is_refused():
    from sharpen.config import load_config

    with pytest.raises(ValueError, match=r"trainer\.lora\.enabled with runtime\.colocate"):
        load_config(None, ["trainer.lora.enabled=true", "runtime.colocate=true"])
