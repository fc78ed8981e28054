"""Trainer on a tiny random Llama: micro-batch invariance of the step's gradient, step metrics, on-policy
mismatch of zero, logprobs against a plain HF forward, and an exact checkpoint round trip."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from sharpen.config.kl import KLReward
from sharpen.config.schema import TrainerConfig
from sharpen.trainer import SingleDeviceBackend, Trainer
from sharpen.types import Rollout, TrainBatch
from support.tiny_trainer import EXAMPLE, PAD, captured_step, random_rollouts, single_device_trainer


def _config(**overrides) -> TrainerConfig:
    # float32 arithmetic ("auto" would depend on the CPU)
    values = {"device": "cpu", "precision": "float32", "learning_rate": 1e-3, "micro_batch_size": 6}
    return TrainerConfig(**{**values, **overrides})


def _trainer(model_dir: Path, **overrides) -> Trainer:
    return single_device_trainer(_config(**overrides), model_dir)


def test_gradient_does_not_depend_on_the_micro_batch_size(model_dir, monkeypatch):
    batch = TrainBatch(rollouts=random_rollouts(seed=1), step=0)
    backend = _trainer(model_dir).backend
    gradients = {}
    for size in (6, 2, 1):
        trainer = Trainer(_config(micro_batch_size=size), backend=backend, pad_token_id=PAD)
        gradients[size] = captured_step(trainer, batch, monkeypatch)[1]
    whole = gradients[6]
    assert max(g.abs().max().item() for g in whole.values()) > 1e-3  # a real gradient, not all zeros
    for size in (2, 1):
        for name, grad in gradients[size].items():
            diff = (grad - whole[name]).abs().max().item()
            assert diff < 1e-5, f"micro_batch_size={size}: {name} differs by {diff}"


def test_abstained_and_empty_rollouts_do_not_change_the_gradient(model_dir, monkeypatch):
    rollouts = random_rollouts(seed=2, num=4)
    extra = [
        Rollout(example=EXAMPLE, prompt_ids=[5, 6], completion_ids=[7], completion_logprobs=[-1.0], versions=[0]),
        Rollout(
            example=EXAMPLE, prompt_ids=[5, 6], completion_ids=[], completion_logprobs=[], versions=[], advantage=1.0
        ),
    ]
    trainer = _trainer(model_dir, micro_batch_size=2)
    plain = captured_step(trainer, TrainBatch(rollouts=rollouts, step=0), monkeypatch)[1]
    mixed = captured_step(trainer, TrainBatch(rollouts=[extra[0], *rollouts, extra[1]], step=0), monkeypatch)[1]
    for name, grad in plain.items():
        assert (grad - mixed[name]).abs().max().item() < 1e-6, name


def test_step_changes_weights_and_returns_finite_metrics(model_dir):
    trainer = _trainer(model_dir, micro_batch_size=2)
    before = {name: p.detach().clone() for name, p in trainer.backend.model.named_parameters()}
    rollouts = random_rollouts(seed=3)
    metrics = trainer.step(TrainBatch(rollouts=rollouts, step=0))

    assert set(metrics) == {
        "train/loss",
        "train/grad_norm",
        "train/clip_fraction",
        "train/dual_clip_fraction",
        "train/ratio_mean",
        "train/entropy",
        "train/num_loss_tokens",
        "train/num_sequences",
        "train/num_optimizer_steps",
        "train/num_nonfinite_updates",
        "train/kl_coef",
        "offpolicy/kl_k1",
        "offpolicy/kl_k3",
        "offpolicy/ratio_p01",
        "offpolicy/ratio_p50",
        "offpolicy/ratio_p99",
        "offpolicy/masked_fraction",
        "offpolicy/capped_fraction",
        "offpolicy/ess",
    }
    assert all(math.isfinite(value) for value in metrics.values()), metrics
    assert metrics["train/num_loss_tokens"] == sum(len(r.completion_ids) for r in rollouts)
    assert metrics["train/num_sequences"] == len(rollouts)
    assert metrics["train/num_optimizer_steps"] == 1
    assert metrics["train/grad_norm"] > 0
    assert 0.0 <= metrics["train/clip_fraction"] <= 1.0
    assert metrics["train/entropy"] > 0.0
    assert metrics["offpolicy/kl_k3"] > 0.0  # the hand-made engine logprobs are not the trainer's
    assert metrics["offpolicy/ratio_p99"] >= metrics["offpolicy/ratio_p50"] >= metrics["offpolicy/ratio_p01"] > 0.0
    assert 0.0 < metrics["offpolicy/ess"] <= 1.0
    after = dict(trainer.backend.model.named_parameters())
    assert all(not torch.equal(before[name], after[name]) for name in before), "every parameter should move"
    assert all(p.grad is None for p in trainer.backend.model.parameters()), "gradients are cleared after the step"


def test_batch_without_trainable_rollouts_is_skipped(model_dir):
    trainer = _trainer(model_dir)
    before = {name: p.detach().clone() for name, p in trainer.backend.model.named_parameters()}
    rollouts = random_rollouts(seed=4, num=2)
    for rollout in rollouts:
        rollout.advantage = None
    assert trainer.step(TrainBatch(rollouts=rollouts, step=0)) == {"train/num_loss_tokens": 0.0, "train/skipped": 1.0}
    assert all(torch.equal(before[n], p) for n, p in trainer.backend.model.named_parameters())


def test_on_policy_engine_logprobs_give_zero_mismatch_and_unit_ratio(model_dir):
    trainer = _trainer(model_dir, micro_batch_size=3)
    rollouts = random_rollouts(seed=5)
    for rollout in rollouts:
        own = trainer.compute_logprobs(rollout.prompt_ids + rollout.completion_ids)
        rollout.completion_logprobs = own[len(rollout.prompt_ids) - 1 :]
    metrics = trainer.step(TrainBatch(rollouts=rollouts, step=0))
    assert abs(metrics["offpolicy/kl_k1"]) < 1e-6
    assert abs(metrics["offpolicy/kl_k3"]) < 1e-6
    assert metrics["offpolicy/ratio_p99"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["offpolicy/ess"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["train/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["train/clip_fraction"] == 0.0
    # with ratio 1 the loss is minus the token-weighted mean advantage
    num_tokens = sum(len(r.completion_ids) for r in rollouts)
    expected = -sum(r.advantage * len(r.completion_ids) for r in rollouts if r.advantage is not None) / num_tokens
    assert metrics["train/loss"] == pytest.approx(expected, abs=1e-5)


def test_compute_logprobs_matches_a_plain_hf_forward(model_dir):
    from transformers import AutoModelForCausalLM

    trainer = _trainer(model_dir)
    token_ids = [3, 17, 99, 4, 56, 120, 7]
    reference_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = reference_model(torch.tensor([token_ids])).logits[0, :-1]  # [seq - 1, vocab]
    expected = logits.log_softmax(-1).gather(-1, torch.tensor(token_ids[1:])[:, None]).squeeze(-1)
    got = torch.tensor(trainer.compute_logprobs(token_ids))
    assert got.shape == (len(token_ids) - 1,)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_temperature_scales_the_logits(model_dir):
    config = _config()
    backend = SingleDeviceBackend(config, model_path=model_dir, dtype="float32")
    ids = torch.tensor([[3, 17, 99, 4]])
    mask = torch.ones_like(ids)
    targets = torch.ones((1, 3), dtype=torch.bool)
    with torch.no_grad():
        hot = backend.token_logprobs(ids, mask, targets, temperature=2.0)
        logits = backend.model(ids).logits[0, :-1] / 2.0
    expected = logits.log_softmax(-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    torch.testing.assert_close(hot[0], expected, rtol=0, atol=1e-5)


def test_checkpoint_round_trip_restores_weights_and_optimizer_exactly(model_dir, tmp_path):
    first = TrainBatch(rollouts=random_rollouts(seed=6), step=0)
    second = TrainBatch(rollouts=random_rollouts(seed=7), step=1)
    original = _trainer(model_dir, micro_batch_size=3)
    original.step(first)
    original.save_checkpoint(tmp_path / "ckpt")

    restored = _trainer(model_dir, micro_batch_size=3)
    restored.load_checkpoint(tmp_path / "ckpt")
    for (name, a), (_, b) in zip(
        original.backend.model.named_parameters(), restored.backend.model.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name
    model = restored.backend.model
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight, "tie survives the load"
    state_a, state_b = original.backend.optimizer.state_dict(), restored.backend.optimizer.state_dict()
    assert state_a["param_groups"] == state_b["param_groups"]
    for key, slot in state_a["state"].items():
        for field, value in slot.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(state_b["state"][key][field])), (key, field)

    metrics_a, metrics_b = original.step(second), restored.step(second)
    assert metrics_a == metrics_b
    for (name, a), (_, b) in zip(
        original.backend.model.named_parameters(), restored.backend.model.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name


def test_kl_penalties_are_minus_coef_times_k1_of_engine_against_the_reference(model_dir):
    from sharpen.config.algorithm import AlgorithmConfig
    from sharpen.trainer import ReferencePolicy

    config = _config().model_copy(update={"algorithm": AlgorithmConfig(kl=KLReward(coef=0.5, estimator="k1"))})
    reference = ReferencePolicy(model_path=model_dir, dtype="float32", device=torch.device("cpu"), precision="float32")
    backend = SingleDeviceBackend(config, model_path=model_dir, dtype="float32")
    trainer = Trainer(config, backend=backend, pad_token_id=PAD, reference=reference)
    rollouts = random_rollouts(seed=7, num=3)
    for rollout in rollouts:  # engine logprobs = the reference's own + 0.25 per token
        own = trainer.compute_logprobs(rollout.prompt_ids + rollout.completion_ids)[len(rollout.prompt_ids) - 1 :]
        rollout.completion_logprobs = [lp + 0.25 for lp in own]
    penalties = trainer.kl_penalties(rollouts)
    for rollout, row in zip(rollouts, penalties, strict=True):
        assert len(row) == len(rollout.completion_ids)
        assert row == pytest.approx([-0.5 * 0.25] * len(row), abs=1e-5)


def test_a_non_finite_gradient_skips_the_optimizer_step_and_training_goes_on(model_dir, monkeypatch):
    trainer = _trainer(model_dir)
    before = {name: tensor.clone() for name, tensor in trainer.backend.named_weights()}
    exp_avg_before = [s["exp_avg"].clone() for s in trainer.backend.optimizer.state.values()]  # empty: no step yet
    score_tokens = trainer.backend.score_tokens

    def poisoned(*args, **kwargs):
        scores = score_tokens(*args, **kwargs)
        scores.logprobs = scores.logprobs * float("nan")  # NaN logprobs -> NaN loss -> NaN gradient
        return scores

    monkeypatch.setattr(trainer.backend, "score_tokens", poisoned)
    metrics = trainer.step(TrainBatch(rollouts=random_rollouts(0), step=0))
    assert metrics["train/num_nonfinite_updates"] == 1.0 and metrics["train/num_optimizer_steps"] == 0.0
    assert math.isnan(metrics["train/grad_norm"])
    after = dict(trainer.backend.named_weights())
    assert all(torch.equal(before[name], after[name]) for name in before)  # nothing moved
    assert [s["exp_avg"] for s in trainer.backend.optimizer.state.values()] == exp_avg_before  # AdamW untouched
    monkeypatch.undo()
    healthy = trainer.step(TrainBatch(rollouts=random_rollouts(1), step=1))
    assert healthy["train/num_nonfinite_updates"] == 0.0 and math.isfinite(healthy["train/grad_norm"])
    assert any(not torch.equal(before[n], t) for n, t in trainer.backend.named_weights())


def test_weight_snapshots_do_not_change_when_the_trainer_steps(model_dir):
    trainer = _trainer(model_dir, micro_batch_size=2)
    snapshot = trainer.snapshot_weights()
    live = dict(trainer.named_weights())
    trainer.step(TrainBatch(rollouts=random_rollouts(seed=3), step=0))
    assert [name for name, _ in snapshot] == list(live)
    moved = dict(trainer.named_weights())
    assert any(not torch.equal(tensor, moved[name]) for name, tensor in snapshot), "the step moves the weights"
    again = trainer.snapshot_weights()
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(again, trainer.named_weights(), strict=True))
    assert all(not torch.equal(tensor, moved[name]) for name, tensor in snapshot if name in moved and tensor.dim())
