"""trainer.precision = "fp16" and trainer.lm_head_float32: the dynamic loss scale (its rule, its checkpoint), the
backend that scales, unscales and skips, the float32 LM head on the trainer and the hf engine, and the one-line
refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import VOCAB
from sharpen.config.engines import VllmServerEngineConfig
from sharpen.config.schema import ModelConfig, SharpenConfig, TrainerConfig
from sharpen.rollout.engines import EngineError, build_engine
from sharpen.trainer import SingleDeviceBackend
from sharpen.trainer.backends.base import ScoreInputs
from sharpen.trainer.precision import (
    LOSS_SCALER_FILE,
    Float32Head,
    LossScaler,
    choose_precision,
    keep_lm_head_float32,
)

CPU = torch.device("cpu")


def test_loss_scale_halves_on_overflow_and_doubles_after_the_growth_interval():
    scaler = LossScaler(growth_interval=3)
    assert scaler.scale == 65536.0  # torch.amp.GradScaler's init_scale
    scaler.update(is_finite=False)
    assert scaler.scale == 32768.0 and scaler.finite_steps == 0
    scaler.update(is_finite=True)
    scaler.update(is_finite=True)
    assert scaler.scale == 32768.0 and scaler.finite_steps == 2
    scaler.update(is_finite=True)  # the third finite step in a row
    assert scaler.scale == 65536.0 and scaler.finite_steps == 0
    scaler.update(is_finite=True)
    scaler.update(is_finite=False)  # an overflow restarts the count
    assert scaler.scale == 32768.0 and scaler.finite_steps == 0 and scaler.num_overflows == 2


def test_loss_scale_never_drops_below_one():
    scaler = LossScaler(scale=2.0)
    for _ in range(3):
        scaler.update(is_finite=False)
    assert scaler.scale == 1.0


def test_loss_scaler_state_round_trips_and_a_bad_one_is_refused(tmp_path: Path):
    scaler = LossScaler(growth_interval=5)
    scaler.update(is_finite=False)
    scaler.update(is_finite=True)
    scaler.save(tmp_path)
    assert json.loads((tmp_path / LOSS_SCALER_FILE).read_text()) == {
        "scale": 32768.0,
        "finite_steps": 1,
        "growth_interval": 5,
    }
    resumed = LossScaler()
    resumed.load(tmp_path)
    assert resumed.state_dict() == scaler.state_dict()
    with pytest.raises(ValueError, match="must be finite"):
        resumed.load_state_dict({"scale": float("inf"), "finite_steps": 0, "growth_interval": 5})
    with pytest.raises(ValueError, match=r"has no loss_scaler\.json"):
        LossScaler().load(tmp_path / "missing")


def test_fp16_is_kept_on_a_cpu_and_refused_on_a_device_without_a_rule():
    choice = choose_precision("fp16", CPU, cpuinfo="flags\t: fpu sse2 avx2 f16c\n")
    assert choice.precision == "fp16" and choice.autocast_dtype is torch.float16 and not choice.is_bf16
    assert "converted to float32" in choice.reason
    native = choose_precision("fp16", CPU, cpuinfo="flags\t: avx512f avx512_fp16\n")
    assert "avx512_fp16" in native.reason
    with pytest.raises(ValueError, match=r'trainer\.precision = "fp16" cannot run here: no float16 rule') as error:
        choose_precision("fp16", torch.device("mps"), cpuinfo="")
    assert "\n" not in str(error.value)


def test_fp16_engine_dtype_and_the_config_refusals():
    assert ModelConfig().engine_dtype("fp16") == "float16"
    assert ModelConfig().engine_dtype("bf16") == "bfloat16" and ModelConfig().engine_dtype("float32") == "float32"
    with pytest.raises(ValueError, match=r'needs float32 master weights: model\.dtype must be "auto"'):
        SharpenConfig.model_validate({"trainer": {"precision": "fp16"}, "model": {"dtype": "bfloat16"}})
    with pytest.raises(ValueError, match="not supported with pipeline parallelism"):
        SharpenConfig.model_validate(
            {"trainer": {"precision": "fp16", "parallel": {"pp": 2}}, "runtime": {"trainer_ranks": 2}}
        )


def _fp16_backend(model_dir: Path, **options) -> SingleDeviceBackend:
    return SingleDeviceBackend(
        TrainerConfig(device="cpu", precision="fp16", max_grad_norm=1e9, **options),
        model_path=model_dir,
        dtype="float32",
    )


def _rows() -> ScoreInputs:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (2, 12), generator=generator)
    target = torch.zeros(2, 11, dtype=torch.bool)
    target[:, 4:] = True
    return ScoreInputs(input_ids=ids, attention_mask=torch.ones_like(ids), target_mask=target)


def _float32_grads(model_dir: Path, rows: ScoreInputs, factor: float) -> dict[str, torch.Tensor]:
    """The reference: the same loss's gradient in float32, no autocast, no scale."""
    reference = SingleDeviceBackend(
        TrainerConfig(device="cpu", precision="float32"), model_path=model_dir, dtype="float32"
    )
    scores = reference.score_tokens(rows.input_ids, rows.attention_mask, rows.target_mask, temperature=1.0)
    (-scores.logprobs.sum() * factor).backward()
    return {name: p.grad.clone() for name, p in reference.model.named_parameters() if p.grad is not None}


def test_fp16_backend_scales_the_loss_so_tiny_gradients_survive(model_dir: Path):
    """A loss whose activation gradients are below float16's smallest subnormal (6e-8): without the scale they
    flush to zero; with it the unscaled gradient matches float32's to float16's rounding."""
    rows, factor = _rows(), 1e-6
    expected = _float32_grads(model_dir, rows, factor)
    backend = _fp16_backend(model_dir)
    assert backend.loss_scaler is not None
    backend.train_micro_batches([rows], lambda _, scores: -scores.logprobs.sum() * factor, temperature=1.0)
    scaler = backend.loss_scaler
    grads = {name: p.grad.clone() for name, p in backend.model.named_parameters() if p.grad is not None}
    scaler.unscale_(list(grads.values()))
    name = "model.layers.0.self_attn.q_proj.weight"  # reached only through float16 activation gradients
    assert expected[name].abs().max() > 0
    cosine = torch.nn.functional.cosine_similarity(grads[name].flatten(), expected[name].flatten(), dim=0)
    assert cosine > 0.99  # float16 keeps ~3 decimal digits per element

    unscaled = _fp16_backend(model_dir)
    unscaled.loss_scaler = None  # what fp16 autocast does without a scale
    unscaled.train_micro_batches([rows], lambda _, scores: -scores.logprobs.sum() * factor, temperature=1.0)
    q_proj = dict(unscaled.model.named_parameters())[name]
    assert q_proj.grad is not None
    zeros = float((q_proj.grad == 0).float().mean())
    assert zeros > 0.9, zeros  # underflowed: float16's smallest subnormal is 6e-8


def test_fp16_overflow_skips_the_step_halves_the_scale_and_the_scale_is_checkpointed(model_dir: Path, tmp_path):
    backend = _fp16_backend(model_dir)
    assert backend.loss_scaler is not None
    before = {name: p.detach().clone() for name, p in backend.model.named_parameters()}
    backend.loss_scaler.scale = 1e30  # the scaled loss's gradient overflows float16 (max 65504)
    backend.train_micro_batches([_rows()], lambda _, scores: -scores.logprobs.sum(), temperature=1.0)
    norm = backend.clip_and_step()
    assert not torch.isfinite(torch.tensor(norm))
    assert backend.loss_scaler.scale == 5e29 and backend.loss_scaler.num_overflows == 1
    for name, p in backend.model.named_parameters():
        assert torch.equal(p.detach(), before[name]), name  # the step was skipped
    assert all(p.grad is None for p in backend.model.parameters())

    backend.loss_scaler.scale = 1024.0  # d loss / d logit is at most 1 per token: 1024 x that fits float16
    backend.train_micro_batches([_rows()], lambda _, scores: -scores.logprobs.sum(), temperature=1.0)
    assert torch.isfinite(torch.tensor(backend.clip_and_step()))
    assert backend.loss_scaler.finite_steps == 1
    changed = [name for name, p in backend.model.named_parameters() if not torch.equal(p.detach(), before[name])]
    assert changed  # a finite step updates the weights

    backend.save(tmp_path)
    resumed = _fp16_backend(model_dir)
    resumed.load(tmp_path)
    assert resumed.loss_scaler is not None
    assert resumed.loss_scaler.state_dict() == {"scale": 1024.0, "finite_steps": 1, "growth_interval": 2000}


def test_float32_head_ignores_autocast_and_keeps_names_and_tie(model_dir: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    names = list(model.state_dict())
    keep_lm_head_float32(model)
    head = model.get_output_embeddings()
    assert isinstance(head, Float32Head) and list(model.state_dict()) == names
    assert head.weight is model.get_input_embeddings().weight  # still tied
    hidden = torch.randn(3, 32, generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.float16):
        logits = head(hidden)
    expected = (hidden.double() @ head.weight.detach().double().T).float()
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)  # float32 arithmetic, not float16's 1e-3


def test_trainer_head_in_float32_under_fp16_is_closer_to_float32(model_dir: Path):
    rows = _rows()
    exact = SingleDeviceBackend(TrainerConfig(device="cpu", precision="float32"), model_path=model_dir, dtype="float32")

    def logprobs(backend: SingleDeviceBackend) -> torch.Tensor:
        with torch.no_grad():
            scores = backend.score_tokens(rows.input_ids, rows.attention_mask, rows.target_mask, temperature=1.0)
        return scores.logprobs[rows.target_mask]

    reference = logprobs(exact)
    plain = (logprobs(_fp16_backend(model_dir)) - reference).abs().max()
    head32 = (logprobs(_fp16_backend(model_dir, lm_head_float32=True)) - reference).abs().max()
    assert 0 < head32 < plain


def test_hf_engine_head_in_float32_and_the_engines_that_refuse_it(tiny_model_path: Path):
    from sharpen.rollout.engines.hf import HfEngine

    engine = HfEngine(tiny_model_path, dtype="float16", lm_head_float32=True)
    head = engine.model.get_output_embeddings()
    assert head.weight.dtype == torch.float16
    assert head(torch.zeros(1, 32, dtype=torch.float16)).dtype == torch.float32
    with pytest.raises(EngineError, match=r"supported by the hf and the in-process vllm engines, not by 'vllm_server'"):
        build_engine(
            VllmServerEngineConfig(), model_path=tiny_model_path, dtype="float16", seed=0, lm_head_float32=True
        )


def test_vllm_gets_its_float32_head_switch_only_when_asked(tmp_path: Path):
    from sharpen.config.engines import VllmEngineConfig
    from sharpen.rollout.engines.vllm import engine_arguments

    plain = engine_arguments(VllmEngineConfig(), model_path=tmp_path, dtype="float16", seed=0, sleep_mode=False)
    head32 = engine_arguments(
        VllmEngineConfig(), model_path=tmp_path, dtype="float16", seed=0, sleep_mode=False, lm_head_float32=True
    )
    assert "hf_overrides" not in plain
    assert head32["hf_overrides"] == {"head_dtype": "float32"} and head32["dtype"] == "float16"


def test_a_loss_scale_overflow_is_reported_apart_and_is_no_bad_step(model_dir: Path, tmp_path: Path, monkeypatch):
    """Dynamic scaling overflows on purpose (it starts at 2^16 and halves until the gradient fits): the trainer
    reports such a step as ``train/num_loss_scale_overflows``, not as a non-finite update, so a ``stop`` guard goes
    on; a non-finite gradient at the scale's floor of 1 is a real one and stops it."""
    from sharpen.config.guards import GuardsConfig
    from sharpen.monitoring.health import RunHealth
    from sharpen.types import TrainBatch
    from support.tiny_trainer import random_rollouts, single_device_trainer

    config = TrainerConfig(device="cpu", precision="fp16", learning_rate=1e-3, micro_batch_size=6)
    trainer = single_device_trainer(config, model_dir)
    scaler = trainer.backend.loss_scaler  # type: ignore[attr-defined]
    assert scaler is not None
    health = RunHealth(tmp_path, spike_factor=10.0, spike_window=8, guards=GuardsConfig(on_bad_step="stop"))

    scaler.scale = 1e30  # the scaled gradient overflows float16
    metrics = trainer.step(TrainBatch(rollouts=random_rollouts(0), step=0))
    assert metrics["train/num_loss_scale_overflows"] == 1.0 and metrics["train/num_nonfinite_updates"] == 0.0
    assert metrics["train/loss_scale"] == 5e29 and metrics["train/num_optimizer_steps"] == 0.0
    health.check(0, [], metrics)
    assert health.stop_reason is None and not (tmp_path / "nonfinite").exists()

    scaler.scale = 1024.0
    metrics = trainer.step(TrainBatch(rollouts=random_rollouts(1), step=1))
    assert metrics["train/num_loss_scale_overflows"] == 0.0 and metrics["train/num_optimizer_steps"] == 1.0
    assert metrics["train/loss_scale"] == 1024.0

    scaler.scale = 1.0
    score_tokens = trainer.backend.score_tokens

    def poisoned(*args, **kwargs):
        scores = score_tokens(*args, **kwargs)
        scores.logprobs = scores.logprobs * float("nan")
        return scores

    monkeypatch.setattr(trainer.backend, "score_tokens", poisoned)
    metrics = trainer.step(TrainBatch(rollouts=random_rollouts(2), step=2))
    assert metrics["train/num_loss_scale_overflows"] == 0.0 and metrics["train/num_nonfinite_updates"] == 1.0
    health.check(2, [], metrics)
    assert health.stop_reason == 'step 2: a non-finite gradient; monitoring.guards.on_bad_step = "stop"'
