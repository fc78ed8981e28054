"""The trainer with SAPO, GMPO, Clip-Cov, KL-Cov and the IcePop correction on a tiny random Llama: the step's
gradient does not depend on the micro-batch split, and the metrics stay finite."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from sharpen.config.schema import TrainerConfig
from sharpen.trainer import SingleDeviceBackend, Trainer
from sharpen.types import Example, Message, Rollout, TrainBatch

VOCAB, PAD = 128, 0  # the tiny model of conftest.model_dir
_EXAMPLE = Example(task_key="t/0", prompt=(Message(role="user", content="q"),), answer="a")
_CASES = {
    "sapo_icepop": {
        "policy_loss": "sapo",
        "off_policy_correction": "icepop",
        "loss_aggregation": "seq_mean_token_mean",
    },
    "gmpo": {"policy_loss": "gmpo", "loss_aggregation": "seq_mean_token_mean"},
    # large fractions and a low bound so that several tokens are selected in this small batch
    "clip_cov": {"policy_loss": "clip_cov", "clip_cov_fraction": 0.3, "clip_cov_min": 0.01},
    "kl_cov": {"policy_loss": "kl_cov", "kl_cov_fraction": 0.3},
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


def _rollouts(seed: int, num: int = 6) -> list[Rollout]:
    rng = random.Random(seed)
    out = []
    for index in range(num):
        completion = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 6))]
        out.append(
            Rollout(
                example=_EXAMPLE,
                prompt_ids=[rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 7))],
                completion_ids=completion,
                completion_logprobs=[math.log(1 / VOCAB) + rng.uniform(-0.9, 0.9) for _ in completion],
                versions=[0] * len(completion),
                sample_index=index,
                advantage=rng.uniform(-1.5, 1.5),
            )
        )
    return out


@pytest.mark.parametrize("case", list(_CASES))
def test_gradient_does_not_depend_on_the_micro_batch_size(model_dir: Path, monkeypatch, case: str):
    batch = TrainBatch(rollouts=_rollouts(seed=3), step=0)
    first = _config(_CASES[case], 6)
    backend = SingleDeviceBackend(first, model_path=model_dir, dtype="float32")
    gradients: dict[int, dict[str, torch.Tensor]] = {}
    for size in (6, 2, 1):
        trainer = Trainer(_config(_CASES[case], size), backend=backend, pad_token_id=PAD)
        captured: dict[str, torch.Tensor] = {}

        def capture(captured: dict[str, torch.Tensor] = captured) -> float:
            for name, param in backend.model.named_parameters():
                assert param.grad is not None, name
                captured[name] = param.grad.detach().clone()
            backend.optimizer.zero_grad(set_to_none=True)
            return 0.0

        monkeypatch.setattr(backend, "clip_and_step", capture)
        metrics = trainer.step(batch)
        assert all(math.isfinite(v) for k, v in metrics.items() if k != "train/grad_norm"), metrics
        gradients[size] = captured
    whole = gradients[6]
    assert max(g.abs().max().item() for g in whole.values()) > 1e-3
    for size in (2, 1):
        for name, grad in gradients[size].items():
            assert (grad - whole[name]).abs().max().item() < 1e-5, f"micro_batch_size={size}: {name}"
