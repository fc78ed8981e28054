"""Weight-sync proof: the probe check and the checksum that catches a corrupted weights file."""

from __future__ import annotations

import pytest

from sharpen.rollout.weight_sync import WeightSyncError, verify_probe

_PROBE = [-1.0, -2.0, -0.5, -3.0]


def test_probe_passes_when_engine_and_trainer_agree():
    check = verify_probe(
        engine=list(_PROBE),
        trainer=list(_PROBE),
        previous_engine=None,
        previous_trainer=None,
        tolerance=0.05,
        version=1,
    )
    assert (check.mismatch_mean, check.mismatch_max, check.trainer_delta, check.engine_delta) == (0.0, 0.0, 0.0, 0.0)
    assert set(check.metrics()) == {
        "sync/probe_mismatch_mean",
        "sync/probe_mismatch_max",
        "sync/probe_trainer_delta",
        "sync/probe_engine_delta",
    }


def test_probe_within_tolerance_reports_the_numbers():
    engine = [-1.01, -2.0, -0.5, -3.03]  # |diff| = [0.01, 0, 0, 0.03]
    trainer_before = [-1.2, -2.0, -0.5, -3.0]
    engine_before = [-1.21, -2.0, -0.5, -3.0]
    check = verify_probe(
        engine=engine,
        trainer=_PROBE,
        previous_engine=engine_before,
        previous_trainer=trainer_before,
        tolerance=0.05,
        version=2,
    )
    assert check.mismatch_mean == pytest.approx(0.01)
    assert check.mismatch_max == pytest.approx(0.03)
    assert check.trainer_delta == pytest.approx(0.2 / 4)
    assert check.engine_delta == pytest.approx((0.2 + 0.03) / 4)


def test_probe_mismatch_over_tolerance_fails():
    engine = [x - 0.1 for x in _PROBE]
    with pytest.raises(WeightSyncError, match=r"version 4 .* differ from the trainer's by 0\.1 nats/token"):
        verify_probe(
            engine=engine, trainer=_PROBE, previous_engine=None, previous_trainer=None, tolerance=0.05, version=4
        )


def test_sync_that_left_the_engine_unchanged_fails_even_inside_the_tolerance():
    trainer_before = [x + 0.01 for x in _PROBE]  # the trainer moved by 0.01 (inside the tolerance)
    engine_unchanged = list(_PROBE)
    with pytest.raises(WeightSyncError, match="had no effect"):
        verify_probe(
            engine=engine_unchanged,
            trainer=_PROBE,
            previous_engine=list(engine_unchanged),
            previous_trainer=trainer_before,
            tolerance=0.05,
            version=3,
        )
    # a trainer that did not move (e.g. a skipped step) leaves an unchanged engine unremarkable
    verify_probe(
        engine=engine_unchanged,
        trainer=_PROBE,
        previous_engine=list(engine_unchanged),
        previous_trainer=list(_PROBE),
        tolerance=0.05,
        version=3,
    )


def test_probe_of_different_lengths_fails():
    with pytest.raises(WeightSyncError, match="different lengths: 3 vs 4"):
        verify_probe(
            engine=_PROBE[:3], trainer=_PROBE, previous_engine=None, previous_trainer=None, tolerance=1.0, version=1
        )
