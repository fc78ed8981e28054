"""The trainer scores the engine's truncated distribution: with rollout.top_k / top_p its logprobs of the tokens the
`hf` engine sampled are the engine's own (same weights), and without the mask they are not; tokens sampled outside
the trainer's kept set leave the loss and are counted; tensor parallelism refuses a truncation in one line."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from sharpen.config import ConfigError, load_config
from sharpen.config.algorithm import AlgorithmConfig
from sharpen.config.schema import TrainerConfig
from sharpen.rollout.engines.hf import HfEngine
from sharpen.trainer import SingleDeviceBackend, Trainer
from sharpen.trainer.algorithms.sampling_mask import SamplingMask
from sharpen.types import Rollout, SamplingParams, TrainBatch
from support.tiny_trainer import EXAMPLE, PAD, captured_step

TEMPERATURE, MASK = 0.7, SamplingMask(top_k=5, top_p=0.8)
PROMPTS = [[1, 5, 9, 200, 300], [1, 8, 9, 10, 11, 12, 13]]


def _config(**algorithm: object) -> TrainerConfig:
    return TrainerConfig(
        device="cpu", precision="float32", micro_batch_size=4, algorithm=AlgorithmConfig.model_validate(algorithm)
    )


@pytest.fixture(scope="module")
def sampled(tiny_model_path: Path) -> list[Rollout]:
    """The hf engine's completions of PROMPTS at temperature 0.7, top_k 5, top_p 0.8 (two seeds each)."""
    engine = HfEngine(tiny_model_path)
    params = [
        SamplingParams(max_new_tokens=6, temperature=TEMPERATURE, top_k=MASK.top_k, top_p=MASK.top_p, seed=seed)
        for seed in (1, 2, 3, 4)
    ]
    completions = engine.generate([PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]], params)
    return [
        Rollout(
            example=EXAMPLE,
            prompt_ids=PROMPTS[index // 2],
            completion_ids=completion.token_ids,
            completion_logprobs=completion.logprobs,
            versions=[0] * len(completion.token_ids),
            sample_index=index,
            advantage=1.0 if index % 2 else -1.0,
        )
        for index, completion in enumerate(completions)
    ]


@pytest.fixture(scope="module")
def backend(tiny_model_path: Path) -> SingleDeviceBackend:
    return SingleDeviceBackend(_config(), model_path=tiny_model_path, dtype="float32")


def _scored(backend: SingleDeviceBackend, rollout: Rollout, mask: SamplingMask | None) -> list[float]:
    ids = torch.tensor([rollout.prompt_ids + rollout.completion_ids])
    targets = torch.zeros(1, ids.shape[1] - 1, dtype=torch.bool)
    targets[0, len(rollout.prompt_ids) - 1 :] = True
    with torch.no_grad():
        scores = backend.score_tokens(ids, torch.ones_like(ids), targets, temperature=TEMPERATURE, sampling_mask=mask)
    return scores.logprobs[0][targets[0]].tolist()


def test_the_trainers_logprobs_of_sampled_tokens_are_the_hf_engines(backend, sampled) -> None:
    for rollout in sampled:
        assert len(rollout.completion_ids) == 6
        # the same float32 weights and ops on one device: the logits agree to ~1e-6, their log-softmax as well
        assert _scored(backend, rollout, MASK) == pytest.approx(rollout.completion_logprobs, abs=1e-4)
        # the full distribution is lower by the log of the kept mass: 5 of 49k near-uniform tokens, several nats
        full = _scored(backend, rollout, None)
        assert all(e - f > 1.0 for e, f in zip(rollout.completion_logprobs, full, strict=True))


def test_a_step_with_the_mask_is_on_policy_and_one_without_is_not(backend, sampled, monkeypatch) -> None:
    batch = TrainBatch(rollouts=sampled, step=0)
    masked = Trainer(_config(), backend=backend, pad_token_id=PAD, temperature=TEMPERATURE, sampling_mask=MASK)
    metrics, gradient = captured_step(masked, batch, monkeypatch)
    assert abs(metrics["offpolicy/kl_k1"]) < 1e-5  # old (the trainer's) vs engine logprobs, per token
    assert metrics["offpolicy/outside_truncation"] == 0.0
    assert all(torch.isfinite(g).all() for g in gradient.values())
    full = Trainer(_config(), backend=backend, pad_token_id=PAD, temperature=TEMPERATURE)
    metrics, _ = captured_step(full, batch, monkeypatch)
    assert metrics["offpolicy/kl_k1"] > 1.0  # mean of engine - old: the full distribution is lower by -log(mass)
    assert "offpolicy/outside_truncation" not in metrics


def test_tokens_outside_the_trainers_set_leave_the_loss_and_are_counted(model_dir: Path, monkeypatch) -> None:
    """Completions of the 128-token tiny model at top_k 3 whose even positions are the model's most likely token and
    odd ones its least likely (outside the top 3): the odd ones leave the loss, counted. Two mini-batches, so the old
    logprobs are scored apart and hold -inf too; the step stays finite and the kept tokens still train."""
    config = _config(num_mini_batches=2)
    backend = SingleDeviceBackend(config, model_path=model_dir, dtype="float32")
    rollouts = []
    for index, (prompt, length) in enumerate([([3, 17, 40], 5), ([9, 2], 4), ([77, 5, 6, 8], 3), ([50], 6)]):
        completion: list[int] = []
        with torch.no_grad():
            for position in range(length):
                logits = backend.model(torch.tensor([prompt + completion])).logits[0, -1]  # [vocab]
                completion.append(int(logits.argmax() if position % 2 == 0 else logits.argmin()))
        rollouts.append(
            Rollout(
                example=EXAMPLE,
                prompt_ids=prompt,
                completion_ids=completion,
                completion_logprobs=[math.log(1 / 3)] * length,
                versions=[0] * length,
                sample_index=index,
                advantage=1.0 if index % 2 else -1.0,
            )
        )
    num_odd = 2 + 2 + 1 + 3  # positions 1, 3, 5 of each completion (5, 4, 3 and 6 tokens)
    trainer = Trainer(config, backend=backend, pad_token_id=PAD, temperature=1.0, sampling_mask=SamplingMask(top_k=3))
    metrics, gradient = captured_step(trainer, TrainBatch(rollouts=rollouts, step=0), monkeypatch)
    assert metrics["offpolicy/outside_truncation"] == pytest.approx(num_odd / 18)
    assert all(math.isfinite(value) for value in metrics.values())
    assert all(torch.isfinite(g).all() for g in gradient.values())
    assert any(bool(g.abs().sum() > 0) for g in gradient.values())


def test_tensor_parallelism_refuses_a_truncation_in_one_line() -> None:
    ray = ['runtime.type="ray"', "runtime.trainer_ranks=2", "trainer.parallel.tp=2"]
    assert load_config(None, ray).rollout.top_k == 0  # no truncation: fine
    for cut in ("rollout.top_p=0.9", "rollout.top_k=20"):
        with pytest.raises(ConfigError, match=r"cannot be used with trainer\.parallel\.tp = 2: the trainer scores"):
            load_config(None, [*ray, cut])


def test_distillation_refuses_a_truncation_in_one_line() -> None:
    distil = ["trainer.distillation.enabled=true"]
    assert load_config(None, distil).trainer.distillation.enabled  # no truncation: fine
    for cut in ("rollout.top_p=0.9", "rollout.top_k=20"):
        with pytest.raises(ConfigError, match=r"cannot be used with trainer\.distillation: the student's truncated"):
            load_config(None, [*distil, cut])
