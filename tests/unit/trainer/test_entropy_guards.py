"""The trainer's half of the stability guards on the tiny random Llama: the adaptive entropy coefficient (its
values by hand, kept in checkpoints), a spiking optimizer step left out, and a policy driven to collapse whose
entropy alarm fires at the step its streak reaches the patience."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from sharpen.config.algorithm import AlgorithmConfig
from sharpen.config.guards import GuardsConfig
from sharpen.config.schema import TrainerConfig
from sharpen.monitoring import StabilityAlarms
from sharpen.trainer.objective import Objective
from sharpen.types import TrainBatch
from support.tiny_trainer import random_rollouts, single_device_trainer, uniform_rollout


def adaptive(**entropy: float) -> AlgorithmConfig:
    return AlgorithmConfig.model_validate({"entropy_coef": 0.0, "entropy": entropy})


def test_adaptive_entropy_coefficient_moves_toward_the_target_and_is_clamped():
    objective = Objective(
        adaptive(target=1.0, adapt_rate=0.01, coef_max=0.01), reference=None, temperature=1.0, constant_length=1.0
    )
    coefs = []
    for entropy in [0.5, 0.6, 2.0, math.nan, 0.0, 0.0]:
        objective.update_entropy(entropy)
        coefs.append(objective.entropy_coef)
    # 0 + .01 * .5 = .005; + .01 * .4 = .009; + .01 * -1 = -.001 -> 0; nan: unchanged; + .01 * 1 = .01; .02 -> .01
    assert coefs == pytest.approx([0.005, 0.009, 0.0, 0.0, 0.01, 0.01], abs=1e-15)
    restored = Objective(adaptive(target=1.0), reference=None, temperature=1.0, constant_length=1.0)
    restored.load_state(objective.state())
    assert restored.entropy_coef == 0.01
    restored.load_state({"kl_coef": 0.0})  # a checkpoint from before the adaptive coefficient
    assert restored.entropy_coef == 0.0


def test_without_a_target_the_coefficient_is_entropy_coef():
    objective = Objective(AlgorithmConfig(entropy_coef=0.02), reference=None, temperature=1.0, constant_length=1.0)
    objective.update_entropy(0.0)
    assert objective.entropy_coef == 0.02


def test_a_start_above_the_largest_coefficient_is_one_error():
    with pytest.raises(ValueError, match=r"entropy_coef = 0\.5 .* above entropy\.coef_max = 0\.01"):
        AlgorithmConfig.model_validate({"entropy_coef": 0.5, "entropy": {"target": 1.0}})


def test_trainer_logs_the_coefficient_it_trained_with_and_checkpoints_the_next(model_dir: Path, tmp_path: Path):
    config = TrainerConfig.model_validate(
        {"micro_batch_size": 4, "algorithm": {"entropy_coef": 0.001, "entropy": {"target": 10.0, "adapt_rate": 1e-4}}}
    )
    trainer = single_device_trainer(config, model_dir)
    first = trainer.step(TrainBatch(rollouts=random_rollouts(seed=1), step=0))
    second = trainer.step(TrainBatch(rollouts=random_rollouts(seed=2), step=1))
    assert first["entropy/coef"] == 0.001
    # the tiny model's entropy is about log(128) = 4.85 < 10: the bonus grows by 1e-4 per nat below the target
    assert second["entropy/coef"] == pytest.approx(0.001 + 1e-4 * (10.0 - first["train/entropy"]), rel=1e-12)
    trainer.save_checkpoint(tmp_path)
    resumed = single_device_trainer(config, model_dir)
    resumed.load_checkpoint(tmp_path)
    assert resumed.objective.entropy_coef == trainer.objective.entropy_coef > second["entropy/coef"]


def test_an_optimizer_step_over_the_skip_bound_is_not_applied(model_dir: Path):
    trainer = single_device_trainer(TrainerConfig(micro_batch_size=4, learning_rate=1e-2), model_dir)
    before = {name: w.clone() for name, w in trainer.named_weights()}
    metrics = trainer.step(TrainBatch(rollouts=random_rollouts(seed=3), step=0, skip_grad_norm_above=1e-9))
    assert metrics["train/num_skipped_updates"] == 1.0
    assert metrics["train/num_optimizer_steps"] == 0.0
    assert metrics["train/grad_norm"] > 1e-9
    assert all(torch.equal(before[name], w) for name, w in trainer.named_weights())
    applied = trainer.step(TrainBatch(rollouts=random_rollouts(seed=3), step=1, skip_grad_norm_above=1e9))
    assert applied["train/num_skipped_updates"] == 0.0 and applied["train/num_optimizer_steps"] == 1.0
    assert not all(torch.equal(before[name], w) for name, w in trainer.named_weights())


def test_a_policy_driven_to_collapse_fires_the_entropy_alarm(model_dir: Path):
    """Every step rewards one token repeated, at a large learning rate with a plain policy gradient: the policy
    piles its mass onto that token and its entropy falls from ~log(128) = 4.85 nats toward 0."""
    config = TrainerConfig.model_validate(
        {
            "micro_batch_size": 8,
            "learning_rate": 0.05,
            "max_grad_norm": 100.0,
            "algorithm": {"policy_loss": "pg", "off_policy_correction": "none"},
        }
    )
    trainer = single_device_trainer(config, model_dir)
    alarms = StabilityAlarms(config=GuardsConfig(entropy_floor=1.0, patience=2))
    entropies, fired = [], []
    for step in range(8):
        rollouts = [uniform_rollout([1, 2, 3], [7] * 6, advantage=1.0) for _ in range(4)]
        metrics = trainer.step(TrainBatch(rollouts=rollouts, step=step))
        entropies.append(metrics["train/entropy"])
        fired += [alarm.step for alarm in alarms.observe(step, metrics)]
    assert entropies[0] > 4.0 and entropies[-1] < 0.5
    below = [entropy < 1.0 for entropy in entropies]
    first_two_in_a_row = next(step for step in range(1, 8) if below[step - 1] and below[step])
    assert fired == [first_two_in_a_row]
