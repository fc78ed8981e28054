"""Resumable run state: the trainer's files plus the loop's own state (next step, data position, RNG states).

A checkpoint is its manifest (`manifest.py`): the trainer's files (every rank's, into one folder the ranks share),
the loop's state, then ``manifest.json`` listing them all with sizes and checksums, written last. A crash mid-save
leaves a folder without a manifest, which is never picked; a file truncated or lost later is found by its size when
the newest checkpoint is chosen and by its checksum when it is loaded, and the load is refused naming the file.

With ``run.checkpoint_uri`` the checkpoints live in an object store instead (`object_store.py`): each trainer rank
writes its files locally and uploads them, the driver uploads its own and writes the manifest from the store's
listing and the ranks' checksums, last; a load checks sizes from one listing, then each process downloads what it
loads and checks it against the manifest's checksums before using it.

Checkpoints of a sharpen before manifests (``state.json`` without a ``format``; such a folder was renamed only once
complete) are still picked and loaded, with a warning that their files cannot be verified.
"""

from __future__ import annotations

import json
import logging
import random
import re
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from sharpen.config.loader import ConfigError
from sharpen.config.schema import RunConfig
from sharpen.orchestration.batches.base import PENDING_FILE_NAME, ProducedBatch, load_pending, save_pending
from sharpen.orchestration.handles import TrainerHandle, TrainerProcesses
from sharpen.orchestration.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    Entries,
    files_problem,
    manifest_problem,
    read_manifest,
    write_manifest,
)
from sharpen.orchestration.object_store import (
    RANK_CALLS,
    StoreFolder,
    download_files,
    folder_names,
    merge_rank_files,
    open_folder,
    run_store_folder,
    upload_folder,
)

if TYPE_CHECKING:
    from sharpen.data import ExampleSampler

logger = logging.getLogger(__name__)

_PREFIX = "step_"
_NAME = re.compile(r"step_\d{6}")
_DRIVER_FILES = {"state.json", "rng.pt", PENDING_FILE_NAME}


class CheckpointError(ConfigError):
    """A checkpoint that cannot be written or loaded as it is; the message names the folder and the first problem."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointScan:
    """A run directory's checkpoints: the newest complete one, and why each newer one is not."""

    latest: Path | StoreFolder | None = None
    skipped: list[str] = field(default_factory=list)


def checkpoint_home(run: RunConfig, run_dir: Path) -> Path | StoreFolder:
    """Where a run's checkpoints (``checkpoints/step_N``) and exported model (``model``) go: its run directory, or
    its folder in the object store (``run.checkpoint_uri``)."""
    return run_store_folder(run) or run_dir


def checkpoint_dir(home: Path | StoreFolder, next_step: int) -> Path | StoreFolder:
    return home / "checkpoints" / f"{_PREFIX}{next_step:06d}"


def scan_checkpoints(home: Path | StoreFolder) -> CheckpointScan:
    """The newest checkpoint under ``home`` (`checkpoint_home`) whose files match its manifest by size (checksums
    are checked when it is loaded), skipping newer ones that do not, each with the reason."""
    root = home / "checkpoints"
    skipped = []
    for folder in (root / name for name in sorted(filter(_NAME.fullmatch, folder_names(root)), reverse=True)):
        problem = checkpoint_problem(folder, checksums=False)
        if problem is None:
            return CheckpointScan(latest=folder, skipped=skipped)
        skipped.append(f"{folder.name}: {problem}")
    return CheckpointScan(skipped=skipped)


def latest_checkpoint(run_dir: Path | StoreFolder) -> Path | StoreFolder | None:
    """The newest complete checkpoint of ``run_dir`` (`scan_checkpoints`), or None."""
    scan = scan_checkpoints(run_dir)
    for reason in scan.skipped:
        logger.warning("skipping incomplete checkpoint %s", reason)
    return scan.latest


def checkpoint_problem(folder: Path | StoreFolder, *, checksums: bool) -> str | None:
    """Why ``folder`` is not a complete checkpoint, or None (a checkpoint from before manifests, on a disk, counts as
    complete when it has its ``state.json``)."""
    if isinstance(folder, Path) and _is_from_before_manifests(folder):
        return None
    fs, path = open_folder(folder)
    return manifest_problem(path, checksums=checksums, fs=fs)


def _is_from_before_manifests(folder: Path) -> bool:
    if (folder / MANIFEST_NAME).is_file():
        return False
    try:
        return "format" not in json.loads((folder / "state.json").read_text())
    except (OSError, ValueError):
        return False


def save_checkpoint(
    home: Path | StoreFolder,
    *,
    next_step: int,
    trainer: TrainerHandle,
    sampler_state: dict[str, Any],
    pending: Sequence[ProducedBatch] = (),
) -> Path | StoreFolder:
    """Write the checkpoint of ``next_step`` under ``home`` (`checkpoint_home`), replacing an earlier attempt's;
    returns its folder. ``sampler_state``: the data position after the last batch drawn that the checkpoint keeps
    (the step's own in sync mode); ``pending``: batches generated before the checkpoint by older weights (async
    mode), kept so a resumed run trains on exactly them."""
    target = checkpoint_dir(home, next_step)
    if isinstance(target, StoreFolder):
        return _save_to_store(target, trainer=trainer, state=_DriverState(next_step, sampler_state, pending))
    shutil.rmtree(target, ignore_errors=True)  # an earlier attempt's, complete or not: this one replaces it
    target.mkdir(parents=True)
    trainer.save_checkpoint(target)
    if not any(path.is_file() and path.name not in _DRIVER_FILES for path in target.rglob("*")):
        raise CheckpointError(
            f"checkpoint {target}: the trainer wrote no file that this process can see; put run.output_dir on a "
            "filesystem every node mounts"
        )
    _write_driver_files(target, _DriverState(next_step, sampler_state, pending))
    write_manifest(target)  # last: the checkpoint exists from here on
    return target


def load_checkpoint(
    folder: Path | StoreFolder, *, trainer: TrainerHandle, sampler: ExampleSampler
) -> tuple[int, list[ProducedBatch]]:
    """Verify ``folder`` against its manifest (sizes and checksums), then restore everything; returns the step to
    run next and the batches the checkpoint kept for it."""
    if isinstance(folder, StoreFolder):
        return _load_from_store(folder, trainer=trainer, sampler=sampler)
    if _is_from_before_manifests(folder):
        logger.warning("checkpoint %s was written before checkpoint manifests: its files are not verified", folder)
    elif problem := manifest_problem(folder, checksums=True):
        raise CheckpointError(f"checkpoint {folder} cannot be loaded: {problem}")
    trainer.load_checkpoint(folder)
    return _restore_driver_state(folder, sampler)


def export_model(home: Path | StoreFolder, *, trainer: TrainerHandle) -> Path | StoreFolder:
    """Write the policy as a HF model folder, ``home/model``; in the object store each rank uploads what it wrote
    and a manifest, written last, says the upload is whole."""
    target = home / "model"
    if isinstance(target, Path):
        trainer.export(target)
        return target
    _clear(target)
    try:
        write_manifest(target.path, fs=target.filesystem(), hashed=_on_every_rank(trainer, "export_to_store", target))
    except ValueError as error:
        raise CheckpointError(f"exported model {target}: {error}") from error
    return target


@dataclass(frozen=True, slots=True)
class _DriverState:
    next_step: int
    sampler_state: dict[str, Any]
    pending: Sequence[ProducedBatch]


def _write_driver_files(folder: Path, state: _DriverState) -> None:
    """The loop's own state: the pending batches, the RNG states and ``state.json``."""
    save_pending(folder, state.pending)
    torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, folder / "rng.pt")
    fields: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "next_step": state.next_step,
        "sampler": state.sampler_state,
        "num_pending_batches": len(state.pending),
    }
    (folder / "state.json").write_text(json.dumps(fields, indent=2))


def _restore_driver_state(folder: Path, sampler: ExampleSampler) -> tuple[int, list[ProducedBatch]]:
    state = json.loads((folder / "state.json").read_text())
    sampler.load_state_dict(state["sampler"])
    rng = torch.load(folder / "rng.pt", weights_only=False)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    return int(state["next_step"]), load_pending(folder)


def _save_to_store(target: StoreFolder, *, trainer: TrainerHandle, state: _DriverState) -> StoreFolder:
    _clear(target)
    try:
        hashed = _on_every_rank(trainer, "save_to_store", target)
        if not hashed:
            raise ValueError("the trainer wrote no file")
        with tempfile.TemporaryDirectory(prefix="sharpen-checkpoint-") as staging:
            _write_driver_files(Path(staging), state)
            hashed.update(upload_folder(Path(staging), target))
        write_manifest(target.path, fs=target.filesystem(), hashed=hashed)  # last: the checkpoint exists from here on
    except ValueError as error:
        raise CheckpointError(f"checkpoint {target}: {error}") from error
    return target


def _load_from_store(
    folder: StoreFolder, *, trainer: TrainerHandle, sampler: ExampleSampler
) -> tuple[int, list[ProducedBatch]]:
    """Sizes from one listing first; then the driver's files, and on every rank the trainer's, each downloaded and
    checked against its sha256 before anything is restored."""
    fs = folder.filesystem()
    files, problem = read_manifest(folder.path, fs=fs)
    if files is not None:
        problem = files_problem(folder.path, files, checksums=False, fs=fs)
    if files is None or problem is not None:
        raise CheckpointError(f"checkpoint {folder} cannot be loaded: {problem}")
    driver_files = {name: entry for name, entry in files.items() if name in _DRIVER_FILES}
    trainer_files = {name: entry for name, entry in files.items() if name not in _DRIVER_FILES}
    with tempfile.TemporaryDirectory(prefix="sharpen-checkpoint-") as staging:
        if problem := download_files(folder, driver_files, Path(staging)):
            raise CheckpointError(f"checkpoint {folder} cannot be loaded: {problem}")
        for rank, problem in enumerate(_on_every_rank_answers(trainer, "load_from_store", folder, trainer_files)):
            if problem is not None:
                raise CheckpointError(
                    f"checkpoint {folder} cannot be loaded: {problem} (as trainer rank {rank} read it)"
                )
        return _restore_driver_state(Path(staging), sampler)


def _clear(target: StoreFolder) -> None:
    """Remove an earlier attempt's files (complete or not): this one replaces them."""
    fs = target.filesystem()
    if fs.isdir(target.path):
        fs.rm(target.path, recursive=True)


def _on_every_rank(trainer: TrainerHandle, method: str, target: StoreFolder) -> Entries:
    """The files every trainer rank uploaded with ``method`` (`object_store.RANK_CALLS`), merged."""
    return merge_rank_files(_on_every_rank_answers(trainer, method, target))


def _on_every_rank_answers(trainer: TrainerHandle, method: str, *args: Any) -> list[Any]:
    """``method`` of the rank side on every trainer process (ranks in other processes serve it), or here for a
    trainer in this process; every rank's answer, in rank order."""
    if isinstance(trainer, TrainerProcesses):
        return trainer.call_all(method, *args)
    return [RANK_CALLS[method](trainer, *args)]
