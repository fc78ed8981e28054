"""The weight-sync check under bf16: the tolerance measured at the first sync (`ProbeTolerance`), chosen from the
config (`build.probe_tolerance`), and a red team of bad syncs after real optimizer steps.

The engine is the cheapest that shows it: the hf engine in bfloat16 on the tiny random Llama (SmolLM2's 49k vocab),
the trainer that model's float32 master weights under bf16 autocast. Its bf16 mismatch is ~5e-4 nats/token, so
the measured tolerance is its 0.01 floor; an AdamW step at lr 1e-3 moves the probe by ~7e-3, at lr 1e-5 by ~7e-5
(measured here).
Each attack is a sync gone wrong; the protected path (WeightSync with the measured tolerance) must raise, and the
naive path it names must accept the same sync, so each attack is shown to be real.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from sharpen.config import load_config
from sharpen.orchestration.build import probe_tolerance
from sharpen.orchestration.weight_sync import WeightSync
from sharpen.rollout.engines.hf import HfEngine
from sharpen.rollout.weight_sync import ProbeTolerance, WeightSyncError
from sharpen.rollout.weight_sync.verify import BF16_FACTOR, BF16_FIRST_LIMIT, BF16_FLOOR, FLOAT32_TOLERANCE
from sharpen.trainer import SingleDeviceBackend, Trainer

PROBE = list(range(100, 140))
Weights = list[tuple[str, torch.Tensor]]


# ---- the tolerance itself --------------------------------------------------------------------------------------


def test_a_fixed_tolerance_never_moves():
    tolerance = ProbeTolerance(fixed=1e-3)
    tolerance.record(0.5)
    assert tolerance.limit() == 1e-3 and tolerance.baseline is None and not tolerance.is_measured


def test_a_measured_tolerance_takes_the_first_mismatch_as_its_baseline():
    tolerance = ProbeTolerance()
    assert tolerance.limit() == BF16_FIRST_LIMIT  # nothing measured yet
    tolerance.record(0.034)  # SmolLM2's default probe, engine in bfloat16
    assert tolerance.baseline == 0.034 and tolerance.limit() == pytest.approx(BF16_FACTOR * 0.034)
    tolerance.record(0.02)  # a smaller mismatch later keeps the baseline
    assert tolerance.baseline == 0.034
    tolerance.record(0.05)  # a larger one that passed raises it (bf16 noise grows as the logits sharpen)
    assert tolerance.limit() == pytest.approx(BF16_FACTOR * 0.05)
    small = ProbeTolerance()
    small.record(4.5e-4)  # the tiny model's bf16 mismatch: the floor
    assert small.limit() == BF16_FLOOR


@pytest.mark.parametrize(
    ("overrides", "is_measured"),
    [
        (["trainer.precision=float32"], False),
        (["trainer.precision=bf16"], True),  # model.dtype auto: the engine runs in bfloat16
        (["trainer.precision=bf16", "model.dtype=float32"], False),  # both compute the probe in float32
        (["trainer.precision=float32", "model.dtype=bfloat16"], True),
        (["trainer.precision=bf16", "weight_sync.tolerance=0.05"], False),
    ],
)
def test_the_config_chooses_fixed_or_measured(overrides, is_measured):
    tolerance = probe_tolerance(load_config(None, overrides))
    assert tolerance.is_measured == is_measured
    if not is_measured:
        assert tolerance.limit() == (0.05 if "weight_sync.tolerance=0.05" in overrides else FLOAT32_TOLERANCE)


# ---- a bf16 engine and a trainer that really steps -------------------------------------------------------------


def _trainer(model_path: Path, *, learning_rate: float) -> Trainer:
    config = load_config(
        None, ["trainer.precision=bf16", "trainer.device=cpu", f"trainer.learning_rate={learning_rate}"]
    )
    backend = SingleDeviceBackend(config.trainer, model_path=model_path, dtype="float32")
    return Trainer(config.trainer, backend=backend, pad_token_id=2)


def _optimizer_step(trainer: Trainer, seed: int) -> None:
    """One real AdamW step of the trainer's backend, under bf16 autocast, on a random policy-gradient loss."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 49152, (4, 24), generator=generator)
    backend = trainer.backend
    logprobs = backend.score_tokens(ids, torch.ones_like(ids), torch.ones((4, 23), dtype=torch.bool), temperature=1.0)
    (-(logprobs.logprobs * torch.randn(4, 1, generator=generator)).mean()).backward()
    assert backend.clip_and_step() > 0


def _snapshot(trainer: Trainer) -> Weights:
    return trainer.snapshot_weights()


@dataclass(kw_only=True, frozen=True)
class BadSync:
    name: str
    learning_rate: float
    num_steps: int
    """Steps before the bad sync (each but the last followed by a correct sync)."""
    weights: Callable[[Weights, Weights], Weights]
    """(weights at version 0, current weights) -> what the bad sync loads into the engine."""
    error: str
    """What the protected check's error says."""
    naive: str
    """The naive check that accepts it: ``raised`` (tolerance only, a fixed 0.1 raised by hand for bf16) or
    ``unbounded_first`` (a measured tolerance whose first sync is trusted whatever it shows)."""


def _scaled(weights: Weights) -> Weights:
    return [(name, tensor * 8) for name, tensor in weights]


ATTACKS = [
    BadSync(
        name="missed_sync_after_a_step",
        learning_rate=1e-3,
        num_steps=1,
        weights=lambda v0, now: [],
        error="had no effect",
        naive="raised",
    ),
    BadSync(
        # one step at lr 1e-5 moves the probe 7e-5, inside any bf16 tolerance: only the exact check sees it
        name="missed_sync_of_a_small_step",
        learning_rate=1e-5,
        num_steps=1,
        weights=lambda v0, now: [],
        error="had no effect",
        naive="raised",
    ),
    BadSync(
        name="stale_weights_of_version_0",  # two steps at lr 3e-3 move the probe ~0.037: 3.7x the tolerance
        learning_rate=3e-3,
        num_steps=2,
        weights=lambda v0, now: v0,
        error="differ from the trainer's",
        naive="raised",
    ),
    BadSync(
        name="partial_sync_of_one_layer",  # one step at lr 5e-3, layer 1 and the embedding left behind: ~0.032
        learning_rate=5e-3,
        num_steps=1,
        weights=lambda v0, now: [(name, tensor) for name, tensor in now if ".layers.0." in name],
        error="differ from the trainer's",
        naive="raised",
    ),
    BadSync(
        name="corrupted_first_sync",
        learning_rate=1e-3,
        num_steps=0,
        weights=lambda v0, now: _scaled(now),
        error="differ from the trainer's",
        naive="unbounded_first",
    ),
]


def _mean_abs_diff(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)


def _history(
    attack: BadSync, model_path: Path, tolerance: ProbeTolerance
) -> tuple[Trainer, HfEngine, WeightSync, Weights]:
    """What the run did before the bad sync, with the run's own WeightSync (version 0 synced and measured, then the
    attack's steps, each but the last synced correctly); returns what the bad sync loads."""
    torch.manual_seed(0)
    trainer = _trainer(model_path, learning_rate=attack.learning_rate)
    engine = HfEngine(model_path, dtype="bfloat16")
    v0 = _snapshot(trainer)
    sync = WeightSync(probe_ids=PROBE, tolerance=tolerance, verify=True)
    if attack.num_steps:
        sync(trainer, engine, version=0)
    for step in range(1, attack.num_steps + 1):
        _optimizer_step(trainer, seed=step)
        if step < attack.num_steps:
            sync(trainer, engine, version=step)
    return trainer, engine, sync, attack.weights(v0, _snapshot(trainer))


@pytest.mark.parametrize("attack", ATTACKS, ids=lambda a: a.name)
def test_the_measured_bf16_check_refuses_a_bad_sync(attack: BadSync, tiny_model_path: Path):
    trainer, engine, sync, weights = _history(attack, tiny_model_path, ProbeTolerance())
    with pytest.raises(WeightSyncError, match=attack.error):
        sync.load(weights, engine, version=attack.num_steps, reference=lambda: sync.reference(trainer))


@pytest.mark.parametrize("attack", ATTACKS, ids=lambda a: a.name)
def test_the_naive_check_accepts_the_same_bad_sync(attack: BadSync, tiny_model_path: Path):
    if attack.naive == "unbounded_first":
        unbounded = ProbeTolerance(first_limit=float("inf"))
        trainer, engine, sync, weights = _history(attack, tiny_model_path, unbounded)
        metrics = sync.load(weights, engine, version=attack.num_steps, reference=lambda: sync.reference(trainer))
        assert metrics["sync/probe_mismatch_mean"] > BF16_FIRST_LIMIT  # accepted, and now the baseline
        return
    trainer, engine, _, weights = _history(attack, tiny_model_path, ProbeTolerance())
    engine.load_weights(weights, version=attack.num_steps)
    mismatch = _mean_abs_diff(engine.score(PROBE), trainer.compute_logprobs(PROBE))
    assert mismatch <= 0.1  # a tolerance raised by hand for bf16, without the exact unchanged-engine check


def test_correct_bf16_syncs_pass_the_measured_check(tiny_model_path: Path):
    """Real steps, each synced: the measured tolerance holds them all, and the metrics say what it was."""
    trainer = _trainer(tiny_model_path, learning_rate=1e-3)
    engine = HfEngine(tiny_model_path, dtype="bfloat16")
    sync = WeightSync(probe_ids=PROBE, tolerance=ProbeTolerance(), verify=True)
    first = sync(trainer, engine, version=0)
    assert first["sync/probe_tolerance"] == BF16_FIRST_LIMIT
    assert 0 < first["sync/probe_mismatch_mean"] < FLOAT32_TOLERANCE  # bf16 noise of this tiny model
    largest = first["sync/probe_mismatch_mean"]
    for version in (1, 2, 3):
        _optimizer_step(trainer, seed=version)
        metrics = sync(trainer, engine, version=version)
        assert metrics["sync/probe_tolerance"] == max(BF16_FLOOR, BF16_FACTOR * largest)  # the bound it met
        largest = max(largest, metrics["sync/probe_mismatch_mean"])
        assert metrics["sync/probe_baseline"] == largest
        assert metrics["sync/probe_trainer_delta"] > metrics["sync/probe_mismatch_mean"]  # the steps are visible
