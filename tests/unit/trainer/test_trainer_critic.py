"""PPO with a critic on a tiny random Llama: the value model starts at exactly 0 and reads the logprobs' positions,
GAE advantages reach the policy loss, the value loss (hand-checked) learns a fixed return and its clip limits the
update, the micro-batch split leaves the critic's gradient alone, and a checkpoint restores the critic exactly."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from sharpen.config.schema import SharpenConfig, TrainerConfig
from sharpen.trainer import SingleDeviceBackend, Trainer, ValueModel
from sharpen.trainer.algorithms.value import compute_value_loss
from sharpen.trainer.packing import pack_micro_batch
from sharpen.types import Rollout, TrainBatch
from support.tiny_trainer import PAD, VOCAB, tiny_critic, uniform_rollout

CRITIC_METRICS = {
    "critic/value_loss",
    "critic/value_mean",
    "critic/return_mean",
    "critic/clip_fraction",
    "critic/explained_variance",
    "critic/grad_norm",
}


def _config(critic: dict | None = None, **overrides) -> TrainerConfig:
    values = {
        "device": "cpu",
        "precision": "float32",  # the checks below are float32 arithmetic ("auto" would depend on the CPU)
        "learning_rate": 1e-3,
        "micro_batch_size": 6,
        "algorithm": {"advantage": "gae"},
        "critic": {"learning_rate": 1e-3, **(critic or {})},
    }
    return TrainerConfig(**{**values, **overrides})


def _trainer(model_dir: Path, config: TrainerConfig, **critic_kwargs) -> Trainer:
    return Trainer(
        config,
        backend=SingleDeviceBackend(config, model_path=model_dir, dtype="float32"),
        critic=tiny_critic(model_dir, config, **critic_kwargs),
        pad_token_id=PAD,
    )


def _rollouts(seed: int, num: int = 6, scores: list[float] | None = None) -> list[Rollout]:
    """Rollouts of different lengths (so micro-batches pad differently) with random or given scores."""
    rng = random.Random(seed)
    out = []
    for index in range(num):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 7))]
        completion = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 6))]
        score = scores[index] if scores is not None else rng.uniform(0.0, 1.0)
        out.append(uniform_rollout(prompt, completion, score, sample_index=index))  # advantage 0: the gae placeholder
    return out


def _values(critic: ValueModel, rollouts: list[Rollout]) -> tuple[torch.Tensor, torch.Tensor]:
    micro = pack_micro_batch(rollouts, pad_token_id=PAD, device=torch.device("cpu"))
    with torch.no_grad():
        return critic.values(micro.input_ids, micro.attention_mask, micro.loss_mask), micro.loss_mask


def test_a_critic_is_needed_exactly_with_gae(model_dir):
    config = _config()
    backend = SingleDeviceBackend(config, model_path=model_dir, dtype="float32")
    with pytest.raises(ValueError, match="gae"):
        Trainer(config, backend=backend, pad_token_id=PAD)
    grpo = _config(algorithm={"advantage": "grpo"})
    with pytest.raises(ValueError, match="gae"):
        Trainer(grpo, backend=backend, pad_token_id=PAD, critic=tiny_critic(model_dir, grpo))
    # nothing but the advantage is needed in a whole config
    assert SharpenConfig.model_validate({"trainer": {"algorithm": {"advantage": "gae"}}}).trainer.critic.lam == 0.95


def test_value_head_starts_at_zero_whatever_the_seed(model_dir):
    from transformers import AutoModelForCausalLM

    rollouts = _rollouts(seed=0)
    for seed in (0, 1):
        torch.manual_seed(seed)
        critic = tiny_critic(model_dir, _config())
        values, mask = _values(critic, rollouts)
        assert values.dtype == torch.float32 and values.shape == mask.shape
        assert torch.count_nonzero(values) == 0
    # the decoder is the policy's model, weight for weight
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).get_decoder().state_dict()
    decoder = critic.network.decoder.state_dict()
    assert decoder.keys() == policy.keys()
    assert all(torch.equal(decoder[name], policy[name]) for name in policy)


def test_values_are_read_at_the_logprob_positions(model_dir):
    critic = tiny_critic(model_dir, _config())
    torch.manual_seed(0)
    torch.nn.init.normal_(critic.network.head.weight)
    torch.nn.init.constant_(critic.network.head.bias, 0.25)
    rollouts = _rollouts(seed=1)
    values, mask = _values(critic, rollouts)
    micro = pack_micro_batch(rollouts, pad_token_id=PAD, device=torch.device("cpu"))
    with torch.no_grad():
        hidden = critic.network.decoder(input_ids=micro.input_ids, attention_mask=micro.attention_mask)
        expected = critic.network.head(hidden.last_hidden_state[:, :-1]).squeeze(-1)  # [batch, seq - 1]
    torch.testing.assert_close(values, torch.where(mask, expected, torch.zeros_like(expected)), rtol=1e-6, atol=1e-6)
    assert torch.count_nonzero(values[~mask]) == 0


def test_pack_micro_batch_places_per_token_inputs_on_the_completion(model_dir):
    rollouts = [uniform_rollout([5, 6, 7], [8, 9], 1.0), uniform_rollout([5, 6], [8, 9, 10], 0.0)]
    micro = pack_micro_batch(
        rollouts,
        pad_token_id=PAD,
        device=torch.device("cpu"),
        token_advantages=[[1.0, 2.0], [3.0, 4.0, 5.0]],
        old_values=[[0.1, 0.2], [0.3, 0.4, 0.5]],
        returns=[[-1.0, -2.0], [-3.0, -4.0, -5.0]],
    )
    assert micro.advantages.shape == micro.loss_mask.shape == (2, 4)
    assert micro.advantages.tolist() == [[0.0, 0.0, 1.0, 2.0], [0.0, 3.0, 4.0, 5.0]]
    assert micro.old_values is not None and micro.returns is not None
    torch.testing.assert_close(micro.old_values, torch.tensor([[0.0, 0.0, 0.1, 0.2], [0.0, 0.3, 0.4, 0.5]]))
    assert micro.returns.tolist() == [[0.0, 0.0, -1.0, -2.0], [0.0, -3.0, -4.0, -5.0]]
    assert micro.old_logprobs is None


def test_gae_advantages_reach_the_policy_loss(model_dir):
    # A zero critic: delta_t = r_t, so A_t = (gamma lam)^(T-1-t) * score and the returns equal the advantages.
    # On-policy (ratio exactly 1) and without the off-policy correction, PPO's loss of a token is -A_t, so the
    # token-mean loss is -sum_t A_t / num_tokens: -(0.9^3 + 0.9^2 + 0.9 + 1) / 7 with per-token advantages, where
    # the sequence score as the advantage of every token would give -4 / 7.
    algorithm = {"advantage": "gae", "off_policy_correction": "none"}
    config = _config(critic={"lam": 0.9, "whiten_advantages": False}, algorithm=algorithm)
    trainer = _trainer(model_dir, config)
    good, bad = uniform_rollout([5, 6, 7], [8, 9, 10, 11], 1.0), uniform_rollout([5, 6, 7], [12, 13, 14], 0.0)
    metrics = trainer.step(TrainBatch(rollouts=[good, bad], step=0))
    discounted = 0.9**3 + 0.9**2 + 0.9 + 1.0
    assert metrics["train/loss"] == pytest.approx(-discounted / 7, abs=1e-6)
    assert metrics.keys() >= CRITIC_METRICS
    assert all(math.isfinite(metrics[name]) for name in CRITIC_METRICS), metrics
    assert metrics["critic/value_mean"] == 0.0
    assert metrics["critic/return_mean"] == pytest.approx(discounted / 7, abs=1e-6)
    assert metrics["critic/explained_variance"] == pytest.approx(0.0, abs=1e-6)  # V = 0 explains nothing
    assert metrics["critic/value_loss"] > 0 and metrics["critic/grad_norm"] > 0

    # whitened (the default): zero mean over the step's tokens, so the same loss is 0
    trainer = _trainer(model_dir, _config(algorithm=algorithm))
    assert trainer.step(TrainBatch(rollouts=[good, bad], step=0))["train/loss"] == pytest.approx(0.0, abs=1e-6)


def test_value_loss_by_hand():
    values = torch.tensor([[1.0, 0.5, 1.0, 7.0]], requires_grad=True)
    old_values = torch.tensor([[0.5, 0.5, 0.5, float("nan")]])
    returns = torch.tensor([[2.0, 0.0, 0.0, float("nan")]])
    mask = torch.tensor([[True, True, True, False]])
    per_token, metrics = compute_value_loss(values, old_values, returns, mask, value_clip=0.2)
    # token 0: V moved 0.5 up towards R = 2, clipped to 0.7: max((1 - 2)^2, (0.7 - 2)^2) = 1.69, clip took effect
    # token 1: V = V_old, both terms (0.5 - 0)^2 = 0.25
    # token 2: V moved 0.5 away from R = 0: max((1 - 0)^2, (0.7 - 0)^2) = 1, the unclipped term
    torch.testing.assert_close(per_token, torch.tensor([[0.845, 0.125, 0.5, 0.0]]))
    assert float(metrics.num_clipped) == 1.0
    per_token.sum().backward()
    assert values.grad is not None
    # the clipped token has no gradient (its loss does not depend on V), the others V - R; padding none (no NaN)
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 0.5, 1.0, 0.0]]))

    plain, metrics = compute_value_loss(values, old_values, returns, mask, value_clip=None)
    torch.testing.assert_close(plain, torch.tensor([[0.5, 0.125, 0.5, 0.0]]))
    assert float(metrics.num_clipped) == 0.0
    with pytest.raises(ValueError, match="same shape"):
        compute_value_loss(values, old_values[:, :2], returns, mask, value_clip=0.2)


def test_value_loss_decreases_towards_a_fixed_return(model_dir):
    # lam = gamma = 1: every token's return is the sequence score, whatever the values (a fixed target)
    config = _config(learning_rate=1e-6, critic={"learning_rate": 3e-3, "lam": 1.0})
    trainer = _trainer(model_dir, config)
    batch = TrainBatch(rollouts=_rollouts(seed=2, scores=[1.0] * 6), step=0)
    losses = [trainer.step(batch)["critic/value_loss"] for _ in range(10)]
    assert losses[0] == pytest.approx(0.5)  # 0.5 (0 - 1)^2 from the zero head
    assert losses[-1] < 0.25 * losses[0], losses


def test_value_clip_limits_the_update(model_dir):
    """Many epochs on one batch: with a small clip each token stops pulling once its value is c past the old one
    (beta1 = 0, so no momentum carries on), without a clip the values keep going towards the returns. The few
    tokens still inside the clip keep moving the shared weights, so the clipped values do pass c somewhat."""
    batch = TrainBatch(rollouts=_rollouts(seed=3, scores=[1.0] * 6), step=0)
    moved = {}
    for value_clip in (0.05, 0.0):
        config = _config(
            algorithm={"advantage": "gae", "num_epochs": 8}, critic={"learning_rate": 3e-3, "value_clip": value_clip}
        )
        trainer = _trainer(model_dir, config, betas=(0.0, 0.999))
        assert trainer.critic is not None
        metrics = trainer.step(batch)
        values, mask = _values(trainer.critic, batch.rollouts)
        moved[value_clip] = float(values[mask].abs().mean())
        assert (metrics["critic/clip_fraction"] > 0) == (value_clip > 0)
    assert moved[0.0] > 3 * moved[0.05], moved  # measured: 0.88 against 0.15


def _captured_critic_gradient(trainer: Trainer, batch: TrainBatch, monkeypatch) -> dict[str, torch.Tensor]:
    """The critic's accumulated gradient when it would step (no optimizer steps, policy or critic)."""
    critic = trainer.critic
    assert critic is not None
    captured: dict[str, torch.Tensor] = {}

    def capture(max_grad_norm: float) -> float:
        for name, param in critic.network.named_parameters():
            assert param.grad is not None, name
            captured[name] = param.grad.detach().clone()
        critic.optimizer.zero_grad(set_to_none=True)
        return 0.0

    def skip(**_: object) -> float:
        trainer.backend.optimizer.zero_grad(set_to_none=True)
        return 0.0

    monkeypatch.setattr(critic, "clip_and_step", capture)
    monkeypatch.setattr(trainer.backend, "clip_and_step", skip)
    trainer.step(batch)
    return captured


def test_critic_gradient_does_not_depend_on_the_micro_batch_size(model_dir, monkeypatch):
    batch = TrainBatch(rollouts=_rollouts(seed=4), step=0)
    first = _trainer(model_dir, _config())
    assert first.critic is not None
    torch.manual_seed(0)  # a non-zero head, so the gradient reaches the decoder too
    torch.nn.init.normal_(first.critic.network.head.weight, std=0.5)
    gradients = {}
    for size in (6, 1):
        trainer = Trainer(_config(micro_batch_size=size), backend=first.backend, critic=first.critic, pad_token_id=PAD)
        gradients[size] = _captured_critic_gradient(trainer, batch, monkeypatch)
    whole = gradients[6]
    assert max(g.abs().max().item() for name, g in whole.items() if name.startswith("decoder.")) > 1e-4
    for name, grad in gradients[1].items():
        diff = (grad - whole[name]).abs().max().item()
        assert diff < 1e-5, f"{name} differs by {diff}"


def test_checkpoint_round_trip_restores_the_critic_exactly(model_dir, tmp_path):
    config = _config(micro_batch_size=3)
    first, second = TrainBatch(rollouts=_rollouts(seed=5), step=0), TrainBatch(rollouts=_rollouts(seed=6), step=1)
    original = _trainer(model_dir, config)
    original.step(first)
    original.save_checkpoint(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "critic" / "model.safetensors").is_file()

    restored = _trainer(model_dir, config)
    restored.load_checkpoint(tmp_path / "ckpt")
    assert original.critic is not None and restored.critic is not None
    for (name, a), (_, b) in zip(
        original.critic.network.named_parameters(), restored.critic.network.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name
    assert torch.count_nonzero(restored.critic.network.head.weight) > 0  # it did train before the save
    state_a, state_b = original.critic.optimizer.state_dict(), restored.critic.optimizer.state_dict()
    assert state_a["param_groups"] == state_b["param_groups"]
    for key, slot in state_a["state"].items():
        for field, value in slot.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(state_b["state"][key][field])), (key, field)

    metrics_a, metrics_b = original.step(second), restored.step(second)
    assert metrics_a == metrics_b
    for (name, a), (_, b) in zip(
        original.critic.network.named_parameters(), restored.critic.network.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name
