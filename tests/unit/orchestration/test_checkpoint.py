"""Checkpoints as manifests: written last, listing every rank's file; an incomplete checkpoint is never picked, and a
changed or missing file refuses the load in one line naming it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from sharpen.data import ExampleSampler
from sharpen.orchestration import checkpoint as checkpoint_module
from sharpen.orchestration.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    scan_checkpoints,
)
from sharpen.orchestration.manifest import MANIFEST_NAME
from sharpen.types import Example, Message


class ShardedTrainer:
    """Writes what a 2-rank FSDP2 trainer writes (a shard file per rank, DCP's metadata, the objective's state),
    into ``folder`` as a rank sees it (``view`` maps the driver's folder to another one: a rank on a node whose
    disk is not the driver's)."""

    def __init__(self, view: Path | None = None) -> None:
        self.view = view
        self.loaded: list[Path] = []

    def save_checkpoint(self, folder: Path) -> None:
        folder = self.view or folder
        folder.mkdir(parents=True, exist_ok=True)
        for rank in range(2):
            (folder / f"__{rank}_0.distcp").write_bytes(bytes([rank]) * 1000)
        (folder / ".metadata").write_bytes(b"metadata")
        (folder / "critic").mkdir(exist_ok=True)
        (folder / "critic" / "model.safetensors").write_bytes(b"critic weights")
        (folder / "trainer.json").write_text("{}")

    def load_checkpoint(self, folder: Path) -> None:
        self.loaded.append(folder)


def _sampler() -> ExampleSampler:
    examples = [Example(task_key=f"t/{i}", prompt=(Message(role="user", content=f"q{i}"),)) for i in range(4)]
    return ExampleSampler(examples, seed=0)


def _save(run_dir: Path, step: int, trainer: ShardedTrainer | None = None) -> Path:
    sampler = _sampler()
    sampler.next_batch(step)
    return save_checkpoint(
        run_dir, next_step=step, trainer=trainer or ShardedTrainer(), sampler_state=sampler.state_dict()
    )


def test_the_manifest_lists_every_file_and_is_written_last(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    present_at_manifest: list[set[str]] = []
    write = checkpoint_module.write_manifest

    def spy(folder: Path) -> dict:
        present_at_manifest.append({p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()})
        return write(folder)

    monkeypatch.setattr(checkpoint_module, "write_manifest", spy)
    folder = _save(tmp_path / "run", 2)

    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    files = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()} - {MANIFEST_NAME}
    assert present_at_manifest == [files]  # nothing was written after the manifest
    assert set(manifest["files"]) == files
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "critic/model.safetensors", "state.json", "rng.pt"} <= files
    assert manifest["files"]["__1_0.distcp"]["size"] == 1000 and len(manifest["files"]["rng.pt"]["sha256"]) == 64
    assert manifest["format"] == json.loads((folder / "state.json").read_text())["format"] == 2


def test_an_incomplete_checkpoint_is_skipped_for_the_previous_complete_one(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _save(run_dir, 2)
    newest = _save(run_dir, 4)
    assert latest_checkpoint(run_dir) == newest

    shard = newest / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:10])  # a rank's file cut short
    scan = scan_checkpoints(run_dir)
    assert scan.latest == run_dir / "checkpoints" / "step_000002"
    assert scan.skipped == ["step_000004: __1_0.distcp has 10 bytes, its manifest says 1000"]

    (newest / MANIFEST_NAME).unlink()  # a save that did not finish
    assert scan_checkpoints(run_dir).skipped == ["step_000004: manifest.json is missing (the save did not finish)"]
    (newest / MANIFEST_NAME).write_text("{not json")
    assert latest_checkpoint(run_dir) == run_dir / "checkpoints" / "step_000002"
    (run_dir / "checkpoints" / "step_000002" / "critic" / "model.safetensors").unlink()
    assert latest_checkpoint(run_dir) is None


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        ("flip", "__0_0.distcp does not match its sha256 in the manifest (changed after the save)"),
        ("delete", "critic/model.safetensors is missing"),
    ],
)
def test_loading_a_changed_checkpoint_refuses_in_one_line_naming_the_file(
    tmp_path: Path, damage: str, problem: str
) -> None:
    folder = _save(tmp_path / "run", 2)
    if damage == "flip":  # same size: only the checksum sees it
        (folder / "__0_0.distcp").write_bytes(b"\x07" * 1000)
    else:
        (folder / "critic" / "model.safetensors").unlink()
    trainer = ShardedTrainer()
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(folder, trainer=trainer, sampler=_sampler())
    assert str(refused.value) == f"checkpoint {folder} cannot be loaded: {problem}"
    assert trainer.loaded == []  # refused before the trainer read anything


def test_a_verified_checkpoint_loads(tmp_path: Path) -> None:
    folder = _save(tmp_path / "run", 3)
    trainer, sampler = ShardedTrainer(), _sampler()
    next_step, pending = load_checkpoint(folder, trainer=trainer, sampler=sampler)
    assert (next_step, pending, trainer.loaded) == (3, [], [folder])
    reference = _sampler()
    reference.next_batch(3)
    assert sampler.state_dict() == reference.state_dict()


def test_a_checkpoint_from_before_manifests_loads_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = _save(tmp_path / "run", 2)
    (folder / MANIFEST_NAME).unlink()
    state = json.loads((folder / "state.json").read_text())
    del state["format"]  # as an older sharpen wrote it (and renamed the folder only once complete)
    (folder / "state.json").write_text(json.dumps(state))
    assert latest_checkpoint(tmp_path / "run") == folder
    with caplog.at_level(logging.WARNING):
        next_step, _ = load_checkpoint(folder, trainer=ShardedTrainer(), sampler=_sampler())
    assert next_step == 2 and "written before checkpoint manifests" in caplog.text


def test_a_trainer_writing_where_the_driver_cannot_see_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "other-node" / "step_000002"
    with pytest.raises(
        CheckpointError, match=r"the trainer wrote no file that this process can see; put run\.output_dir"
    ):
        _save(tmp_path / "run", 2, ShardedTrainer(view=elsewhere))
    assert latest_checkpoint(tmp_path / "run") is None
