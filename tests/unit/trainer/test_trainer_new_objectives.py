"""The trainer with SAPO, GMPO, Clip-Cov, KL-Cov and the IcePop correction on a tiny random Llama: the step's
gradient does not depend on the micro-batch split, and the metrics stay finite."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from sharpen.config.schema import TrainerConfig
from sharpen.trainer import SingleDeviceBackend, Trainer
from sharpen.types import TrainBatch
from support.tiny_trainer import PAD, captured_step, random_rollouts

_CASES = {
    "sapo_icepop": {
        "policy_loss": "sapo",
        "off_policy_correction": "icepop",
        "loss_aggregation": "seq_mean_token_mean",
    },
    "gmpo": {"policy_loss": "gmpo", "loss_aggregation": "seq_mean_token_mean"},
    # large fractions and a low bound so that several tokens are selected in this small batch
    "clip_cov": {"policy_loss": {"type": "clip_cov", "fraction": 0.3, "cov_min": 0.01}},
    "kl_cov": {"policy_loss": {"type": "kl_cov", "fraction": 0.3}},
}


def _config(algorithm: dict[str, object], micro_batch_size: int) -> TrainerConfig:
    return TrainerConfig.model_validate(
        {
            "device": "cpu",
            "precision": "float32",
            "learning_rate": 1e-3,
            "micro_batch_size": micro_batch_size,
            "num_threads": 1,
            "algorithm": algorithm,
        }
    )


@pytest.mark.parametrize("case", list(_CASES))
def test_gradient_does_not_depend_on_the_micro_batch_size(model_dir: Path, monkeypatch, case: str):
    batch = TrainBatch(rollouts=random_rollouts(seed=3, spread=0.9, completion_first=True), step=0)
    first = _config(_CASES[case], 6)
    backend = SingleDeviceBackend(first, model_path=model_dir, dtype="float32")
    gradients: dict[int, dict[str, torch.Tensor]] = {}
    for size in (6, 2, 1):
        trainer = Trainer(_config(_CASES[case], size), backend=backend, pad_token_id=PAD)
        metrics, gradients[size] = captured_step(trainer, batch, monkeypatch)
        assert all(math.isfinite(v) for k, v in metrics.items() if k != "train/grad_norm"), metrics
    whole = gradients[6]
    assert max(g.abs().max().item() for g in whole.values()) > 1e-3
    for size in (2, 1):
        for name, grad in gradients[size].items():
            assert (grad - whole[name]).abs().max().item() < 1e-5, f"micro_batch_size={size}: {name}"
