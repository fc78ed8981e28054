"""The trainer step with chained off-policy rejection criteria and batch-normalised importance weights, on a tiny
random Llama: the step's metrics by hand, the gradient scaled by the normaliser, and neither depending on the
micro-batch split."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from sharpen.config.algorithm import AlgorithmConfig
from sharpen.config.schema import TrainerConfig
from sharpen.trainer import SingleDeviceBackend, Trainer
from sharpen.types import Rollout, TrainBatch
from support.tiny_trainer import EXAMPLE, PAD, VOCAB, captured_step, random_rollouts

_REJECT = [
    {"level": "token", "low": 0.8, "high": 1.25},
    {"level": "sequence", "statistic": "max", "divergence": "k2", "high": 0.08},
]


def _config(*, micro_batch_size: int = 4, **algorithm) -> TrainerConfig:
    return TrainerConfig(
        device="cpu",
        precision="float32",
        learning_rate=1e-3,
        micro_batch_size=micro_batch_size,
        algorithm=AlgorithmConfig(**algorithm),
    )


def _rollouts(seed: int, num: int = 6) -> list[Rollout]:
    """Rollouts of different lengths, engine logprobs near the tiny model's (so some tokens are rejected and some
    are not) and random advantages."""
    return random_rollouts(seed, num, completion_lengths=(2, 6), spread=0.3)


def _step(trainer: Trainer, rollouts: list[Rollout], monkeypatch) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """The step's metrics and its accumulated gradient (the optimizer step itself is skipped)."""
    return captured_step(trainer, TrainBatch(rollouts=rollouts, step=0), monkeypatch)


@pytest.fixture(scope="module")
def backend(model_dir: Path) -> SingleDeviceBackend:
    return SingleDeviceBackend(_config(), model_path=model_dir, dtype="float32")


@pytest.mark.parametrize("mode", ["token_tis", "sequence_tis", "icepop"])
def test_rejection_and_normalisation_do_not_depend_on_the_micro_batch_size(backend, monkeypatch, mode):
    rollouts = _rollouts(seed=11)
    reject = [_REJECT[0], {**_REJECT[1], "high": 0.02}]  # rows go once a |log r| passes 0.2
    algorithm = {"off_policy_correction": {"type": mode, "reject": reject, "normalize": True}}
    results = {}
    for size in (6, 1):
        trainer = Trainer(_config(micro_batch_size=size, **algorithm), backend=backend, pad_token_id=PAD)
        results[size] = _step(trainer, rollouts, monkeypatch)
    (whole, whole_grad), (single, single_grad) = results[6], results[1]
    # the case is not trivial: both criteria reject something, not everything, and the weights are rescaled
    assert 0 < whole["offpolicy/reject/token_k1/token_fraction"] < 1
    assert 0 < whole["offpolicy/reject/seq_max_k2/sequence_fraction"] < 1
    assert whole["offpolicy/weight_normalizer"] != pytest.approx(1.0, abs=1e-3)
    for name, value in whole.items():
        if name.startswith(("offpolicy/ess", "offpolicy/ratio_p")):
            continue  # statistics of each micro-batch (documented)
        assert single[name] == pytest.approx(value, rel=1e-6, abs=1e-7), name
    assert max(g.abs().max().item() for g in whole_grad.values()) > 1e-3
    for name, grad in whole_grad.items():
        diff = (single_grad[name] - grad).abs().max().item()
        assert diff < 1e-5, f"{name} differs by {diff}"


def _exact_ratio_rollouts(trainer: Trainer, deltas: list[list[float]]) -> list[Rollout]:
    """Rollouts whose engine logprobs are the trainer's own minus ``deltas``: log r_t = delta_t (to float32)."""
    rng = random.Random(5)
    rollouts = []
    for index, delta in enumerate(deltas):
        prompt = [rng.randrange(1, VOCAB) for _ in range(3)]
        completion = [rng.randrange(1, VOCAB) for _ in delta]
        own = trainer.compute_logprobs(prompt + completion)[len(prompt) - 1 :]
        rollouts.append(
            Rollout(
                example=EXAMPLE,
                prompt_ids=prompt,
                completion_ids=completion,
                completion_logprobs=[lp - d for lp, d in zip(own, delta, strict=True)],
                versions=[0] * len(completion),
                sample_index=index,
                advantage=[1.0, -0.5, 0.8, -1.2][index],
            )
        )
    return rollouts


# log ratios per token. Token band [0.8, 1.25] (|log r| <= 0.2231) and max k2 = 0.5 (log r)^2 <= 0.08 (|log r| <= 0.4):
# row 0 kept; row 1's 0.5 fails both (the row goes); row 2's 0.3 fails the band only; row 3 kept.
_DELTAS = [[0.0, 0.0, 0.0], [0.5, 0.0, 0.1], [0.3, 0.0, -0.2], [-0.1, 0.1, 0.15]]
_KEPT_LOG_RATIOS = [0.0, 0.0, 0.0, 0.0, -0.2, -0.1, 0.1, 0.15]


def test_step_metrics_and_normaliser_by_hand(backend, monkeypatch):
    algorithm = {"off_policy_correction": {"type": "token_tis", "reject": _REJECT, "normalize": True}}
    trainer = Trainer(_config(micro_batch_size=2, **algorithm), backend=backend, pad_token_id=PAD)
    metrics, normalised = _step(trainer, _exact_ratio_rollouts(trainer, _DELTAS), monkeypatch)
    kept = [math.exp(d) for d in _KEPT_LOG_RATIOS]  # every ratio is under the cap 2
    normalizer = sum(kept) / len(kept)
    expected = {
        "offpolicy/reject/token_k1/token_fraction": 2 / 12,
        "offpolicy/reject/seq_max_k2/token_fraction": 3 / 12,
        "offpolicy/reject/seq_max_k2/sequence_fraction": 1 / 4,
        "offpolicy/masked_fraction": 4 / 12,
        "offpolicy/weight_normalizer": normalizer,
        "offpolicy/weight_mean": 1.0,
        "offpolicy/weight_max": math.exp(0.15) / normalizer,
        "offpolicy/weight_ess": sum(kept) ** 2 / (len(kept) * sum(w * w for w in kept)),
    }
    assert {name: metrics[name] for name in expected} == pytest.approx(expected, abs=2e-6)

    # the policy loss is linear in the weights, so normalising divides its gradient by the normaliser exactly
    plain_algorithm = {"off_policy_correction": {"type": "token_tis", "reject": _REJECT}}
    plain_trainer = Trainer(_config(micro_batch_size=2, **plain_algorithm), backend=backend, pad_token_id=PAD)
    plain_metrics, plain = _step(plain_trainer, _exact_ratio_rollouts(plain_trainer, _DELTAS), monkeypatch)
    assert plain_metrics["offpolicy/weight_mean"] == pytest.approx(normalizer, abs=2e-6)
    assert "offpolicy/weight_normalizer" not in plain_metrics
    for name, grad in plain.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(normalised[name] * normalizer, grad, rtol=1e-4, atol=1e-7, msg=name)


def test_sequence_tis_is_normalised_per_kept_sequence(backend, monkeypatch):
    algorithm = {"off_policy_correction": {"type": "sequence_tis", "reject": _REJECT, "normalize": True}}
    trainer = Trainer(_config(micro_batch_size=3, **algorithm), backend=backend, pad_token_id=PAD)
    metrics, _ = _step(trainer, _exact_ratio_rollouts(trainer, _DELTAS), monkeypatch)
    # rows 0, 2, 3 are kept with their product ratios e^0, e^0.1, e^0.15 (row 2's rejected 0.3 still counts in it)
    sequence_weights = [1.0, math.exp(0.1), math.exp(0.15)]
    normalizer = sum(sequence_weights) / 3
    assert metrics["offpolicy/weight_normalizer"] == pytest.approx(normalizer, abs=2e-6)
    # token-weighted: row 0 has 3 kept tokens, row 2 has 2, row 3 has 3
    token_weights = [w / normalizer for w, n in zip(sequence_weights, (3, 2, 3), strict=True) for _ in range(n)]
    assert metrics["offpolicy/weight_mean"] == pytest.approx(sum(token_weights) / 8, abs=2e-6)
    assert metrics["offpolicy/weight_max"] == pytest.approx(math.exp(0.15) / normalizer, abs=2e-6)
