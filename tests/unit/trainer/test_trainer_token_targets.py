"""Per-token targets on a tiny random Llama: REINFORCE++'s ``token_advantages`` reach the policy loss, and the
critic bootstraps a truncated completion's GAE with the value of the state after its last token (a finished one
ends at 0)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from sharpen.config.advantages import ReinforcePPAdvantage
from sharpen.config.algorithm import AlgorithmConfig, CriticConfig
from sharpen.config.corrections import NoCorrection
from sharpen.config.schema import TrainerConfig
from sharpen.trainer import SingleDeviceBackend, Trainer, ValueModel
from sharpen.trainer.critic_step import CriticStep
from sharpen.trainer.packing import pack_micro_batch
from sharpen.types import TrainBatch
from support.tiny_trainer import PAD, tiny_critic, uniform_rollout


def test_token_advantages_reach_the_policy_loss(model_dir: Path):
    # On-policy (ratio exactly 1), no off-policy correction: PPO's loss of a token is -A_t, and token_mean gives
    # -sum_t A_t / num_tokens. The first rollout's token advantages [0.5, -1, 2] override its marker advantage 0;
    # the second has none, so each of its tokens gets its advantage 1: -(0.5 - 1 + 2 + 1 + 1) / 5 = -0.7.
    config = TrainerConfig(
        device="cpu",
        precision="float32",
        learning_rate=1e-3,
        micro_batch_size=4,
        algorithm=AlgorithmConfig(advantage=ReinforcePPAdvantage(), off_policy_correction=NoCorrection()),
    )
    trainer = Trainer(
        config, backend=SingleDeviceBackend(config, model_path=model_dir, dtype="float32"), pad_token_id=PAD
    )
    rollouts = [
        uniform_rollout([5, 6, 7], [8, 9, 10], token_advantages=[0.5, -1.0, 2.0]),
        uniform_rollout([5, 6], [12, 13], advantage=1.0),
    ]
    metrics = trainer.step(TrainBatch(rollouts=rollouts, step=0))
    assert metrics["train/loss"] == pytest.approx(-0.7, abs=1e-6)


def _critic(model_dir: Path, config: TrainerConfig) -> ValueModel:
    critic = tiny_critic(model_dir, config)
    torch.manual_seed(0)  # a nonzero head: the zero-initialised one would make every bootstrap 0
    torch.nn.init.normal_(critic.network.head.weight)
    torch.nn.init.constant_(critic.network.head.bias, 0.25)
    return critic


def _critic_config(**critic) -> TrainerConfig:
    return TrainerConfig(
        device="cpu", precision="float32", algorithm=AlgorithmConfig(advantage="gae"), critic=CriticConfig(**critic)
    )


def test_final_value_is_the_state_after_the_last_token_of_each_padded_row(model_dir: Path):
    # The state after a sequence's last token is the one its next token would be predicted from: in a rollout one
    # token longer, the value at that token's target position. Rows of different lengths: padding is not read.
    critic = _critic(model_dir, _critic_config())
    short, long = uniform_rollout([5, 6, 7], [8, 9]), uniform_rollout([5, 6], [8, 9, 10, 11])
    micro = pack_micro_batch([short, long], pad_token_id=PAD, device=torch.device("cpu"))
    with torch.no_grad():
        values, final = critic.values_and_final_values(micro.input_ids, micro.attention_mask, micro.loss_mask)
        assert torch.equal(values, critic.values(micro.input_ids, micro.attention_mask, micro.loss_mask))
        for row, rollout in enumerate([short, long]):
            extended = uniform_rollout(rollout.prompt_ids, [*rollout.completion_ids, 3])
            one = pack_micro_batch([extended], pad_token_id=PAD, device=torch.device("cpu"))
            next_values = critic.values(one.input_ids, one.attention_mask, one.loss_mask)  # [1, seq - 1]
            torch.testing.assert_close(final[row], next_values[0, extended.num_tokens - 2], rtol=1e-5, atol=1e-6)
    assert final[0] != final[1]


def test_critic_bootstraps_truncated_completions_only(model_dir: Path):
    # gamma 0.9, lam 0.95, no whitening; the same tokens finished and truncated. With V_t the critic's values and
    # V(s_T) its value after the last token, by hand (backwards): delta_t = r_t + gamma * V_{t+1} - V_t with
    # V_T = V(s_T) if truncated else 0, A_t = delta_t + gamma * lam * A_{t+1}; the score is r at the last token.
    gamma, lam = 0.9, 0.95
    config = _critic_config(gamma=gamma, lam=lam, whiten_advantages=False)
    critic = _critic(model_dir, config)
    finished = uniform_rollout([5, 6, 7], [8, 9, 10], score=1.0)
    truncated = replace(finished, is_truncated=True)
    step = CriticStep(critic, config.critic, [finished, truncated], micro_batch_size=2, pad_token_id=PAD)
    micro = pack_micro_batch([finished], pad_token_id=PAD, device=torch.device("cpu"))
    with torch.no_grad():
        _, final = critic.values_and_final_values(micro.input_ids, micro.attention_mask, micro.loss_mask)
    bootstrap = float(final[0])
    assert abs(bootstrap) > 0.1  # the check below would pass with any bootstrap near 0

    for rollout, next_value in ((finished, 0.0), (truncated, bootstrap)):
        targets = step.targets[id(rollout)]
        values = targets.old_values
        rewards = [0.0, 0.0, 1.0]
        expected, advantage = [0.0] * 3, 0.0
        for t in reversed(range(3)):
            delta = rewards[t] + gamma * next_value - values[t]
            advantage = delta + gamma * lam * advantage
            expected[t], next_value = advantage, values[t]
        assert targets.advantages == pytest.approx(expected, abs=1e-5)
        assert targets.returns == pytest.approx([a + v for a, v in zip(expected, values, strict=True)], abs=1e-5)
    # the bootstrap's share of each token's advantage: (gamma * lam)^(T - 1 - t) * gamma * V(s_T)
    cut, ended = step.targets[id(truncated)].advantages, step.targets[id(finished)].advantages
    difference = [a - b for a, b in zip(cut, ended, strict=True)]
    shares = [(gamma * lam) ** (2 - t) * gamma * bootstrap for t in range(3)]
    assert difference == pytest.approx(shares, abs=1e-5)
