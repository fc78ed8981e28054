"""The embedded runtime with several trainer ranks (`orchestration/local_ranks.py`: torchrun-style local processes,
no Ray) runs the same loop as one device: the same rewards and token counts at a fixed seed, losses and gradient
norms to float32 rounding, a verified weight sync every step; and a rank that fails to start is one clear error."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest
from test_tiny_loop import run_in_this_process, tiny_config

from sharpen.monitoring import read_jsonl

pytestmark = pytest.mark.slow  # spawns 2 rank processes per run (each imports torch and loads its shard)


PIPELINE = {"trainer.parallel.pp": "2", "weight_sync.assemble": '"receiver"'}


@pytest.mark.parametrize("layout", [{}, PIPELINE], ids=["dp_shard2", "pp2-pieces"])
def test_two_local_trainer_ranks_match_one_device(tiny_model_path: Path, tmp_path: Path, layout, monkeypatch) -> None:
    """2 local rank processes (gloo) and the engine in this process vs the single-device backend, 3 steps: FSDP2's
    data shards (synced by rank 0's gathered tensors), or a 2-stage pipeline (one layer each; synced by each rank's
    pieces, assembled in this process). The ranks sum in another order, so losses agree to float32
    rounding, and the engine, synced with weights that close, samples the same tokens: rewards are identical."""
    from sharpen.orchestration import embedded
    from sharpen.orchestration.local_ranks import LocalTrainerRanks

    started: list[LocalTrainerRanks] = []

    class Recorded(LocalTrainerRanks):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            started.append(self)

    monkeypatch.setattr(embedded, "LocalTrainerRanks", Recorded)
    options = {"trainer.num_threads": "1"}
    one = run_in_this_process(tiny_config(tiny_model_path, tmp_path, name="one", num_steps=3, **options))
    two = run_in_this_process(
        tiny_config(
            tiny_model_path, tmp_path, name="two", num_steps=3, **options, **layout, **{"runtime.trainer_ranks": "2"}
        )
    )
    assert len(started) == 1 and started[0].num_ranks == 2  # the run's trainer was the two rank processes
    assert started[0].assemble_at_receiver == (layout is PIPELINE)
    assert [process.exitcode for process in started[0]._processes] == [0, 0]  # and they left the group cleanly
    manifest = json.loads((two / "checkpoints" / "step_000003" / "manifest.json").read_text())
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(manifest["files"])  # every rank's shard, in the manifest
    one_rows, two_rows = read_jsonl(one / "metrics.jsonl"), read_jsonl(two / "metrics.jsonl")
    assert [row["reward/mean"] for row in two_rows] == [row["reward/mean"] for row in one_rows]
    assert [row["train/num_loss_tokens"] for row in two_rows] == [row["train/num_loss_tokens"] for row in one_rows]
    for got, expected in zip(two_rows, one_rows, strict=True):
        assert got["train/loss"] == pytest.approx(expected["train/loss"], rel=1e-4, abs=1e-6)
        assert got["train/grad_norm"] == pytest.approx(expected["train/grad_norm"], rel=1e-4)
        assert got["sync/probe_mismatch_mean"] < 1e-4  # rank 0's gathered weights reached the engine


def test_a_rank_that_cannot_start_is_one_clear_error(tiny_model_path: Path, tmp_path: Path) -> None:
    """A rank whose model folder lacks its weights: the start fails with that rank's error, and no rank is left."""
    from sharpen.orchestration.local_ranks import LocalTrainerRanks

    broken = tmp_path / "no-weights"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (broken / name).write_bytes((tiny_model_path / name).read_bytes())
    config = tiny_config(broken, tmp_path, name="broken", num_steps=1, **{"runtime.trainer_ranks": "2"})
    with pytest.raises(RuntimeError, match=r"^trainer rank \d failed in start:\n.*Traceback"):
        LocalTrainerRanks(config, model_path=broken)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("sharpen trainer rank")]
