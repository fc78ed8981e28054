"""Resumable run state: the trainer's files plus the loop's own state (next step, data position, RNG states).

A checkpoint is its manifest (`manifest.py`): the trainer's files (every rank's, into one folder the ranks share),
the loop's state, then ``manifest.json`` listing them all with sizes and checksums, written last. A crash mid-save
leaves a folder without a manifest, which is never picked; a file truncated or lost later is found by its size when
the newest checkpoint is chosen and by its checksum when it is loaded, and the load is refused naming the file.

Checkpoints of a sharpen before manifests (``state.json`` without a ``format``; such a folder was renamed only once
complete) are still picked and loaded, with a warning that their files cannot be verified.
"""

from __future__ import annotations

import json
import logging
import random
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from sharpen.config.loader import ConfigError
from sharpen.orchestration.batches.base import PENDING_FILE_NAME, ProducedBatch, load_pending, save_pending
from sharpen.orchestration.manifest import FORMAT_VERSION, MANIFEST_NAME, manifest_problem, write_manifest

if TYPE_CHECKING:
    from sharpen.data import ExampleSampler
    from sharpen.orchestration.handles import TrainerHandle

logger = logging.getLogger(__name__)

_PREFIX = "step_"
_NAME = re.compile(r"step_\d{6}")
_DRIVER_FILES = {"state.json", "rng.pt", PENDING_FILE_NAME}


class CheckpointError(ConfigError):
    """A checkpoint that cannot be written or loaded as it is; the message names the folder and the first problem."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointScan:
    """A run directory's checkpoints: the newest complete one, and why each newer one is not."""

    latest: Path | None = None
    skipped: list[str] = field(default_factory=list)


def checkpoint_dir(run_dir: Path, next_step: int) -> Path:
    return run_dir / "checkpoints" / f"{_PREFIX}{next_step:06d}"


def scan_checkpoints(run_dir: Path) -> CheckpointScan:
    """The newest checkpoint whose files match its manifest by size (checksums are checked when it is loaded),
    skipping newer ones that do not, each with the reason."""
    root = run_dir / "checkpoints"
    folders = sorted((p for p in root.iterdir() if _NAME.fullmatch(p.name)), reverse=True) if root.is_dir() else []
    skipped = []
    for folder in folders:
        problem = checkpoint_problem(folder, checksums=False)
        if problem is None:
            return CheckpointScan(latest=folder, skipped=skipped)
        skipped.append(f"{folder.name}: {problem}")
    return CheckpointScan(skipped=skipped)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of ``run_dir`` (`scan_checkpoints`), or None."""
    scan = scan_checkpoints(run_dir)
    for reason in scan.skipped:
        logger.warning("skipping incomplete checkpoint %s", reason)
    return scan.latest


def checkpoint_problem(folder: Path, *, checksums: bool) -> str | None:
    """Why ``folder`` is not a complete checkpoint, or None (a checkpoint from before manifests counts as complete
    when it has its ``state.json``)."""
    if not (folder / MANIFEST_NAME).is_file() and _is_from_before_manifests(folder):
        return None
    return manifest_problem(folder, checksums=checksums)


def _is_from_before_manifests(folder: Path) -> bool:
    try:
        return "format" not in json.loads((folder / "state.json").read_text())
    except (OSError, ValueError):
        return False


def save_checkpoint(
    run_dir: Path,
    *,
    next_step: int,
    trainer: TrainerHandle,
    sampler_state: dict[str, Any],
    pending: Sequence[ProducedBatch] = (),
) -> Path:
    """``sampler_state``: the data position after the last batch drawn that the checkpoint keeps (the step's own
    in sync mode); ``pending``: batches generated before the checkpoint by older weights (async mode), kept so a
    resumed run trains on exactly them."""
    target = checkpoint_dir(run_dir, next_step)
    shutil.rmtree(target, ignore_errors=True)  # an earlier attempt's, complete or not: this one replaces it
    target.mkdir(parents=True)
    trainer.save_checkpoint(target)
    if not any(path.is_file() and path.name not in _DRIVER_FILES for path in target.rglob("*")):
        raise CheckpointError(
            f"checkpoint {target}: the trainer wrote no file that this process can see; put run.output_dir on a "
            "filesystem every node mounts"
        )
    save_pending(target, pending)
    torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, target / "rng.pt")
    state: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "next_step": next_step,
        "sampler": sampler_state,
        "num_pending_batches": len(pending),
    }
    (target / "state.json").write_text(json.dumps(state, indent=2))
    write_manifest(target)  # last: the checkpoint exists from here on
    return target


def load_checkpoint(
    folder: Path, *, trainer: TrainerHandle, sampler: ExampleSampler
) -> tuple[int, list[ProducedBatch]]:
    """Verify ``folder`` against its manifest (sizes and checksums), then restore everything; returns the step to
    run next and the batches the checkpoint kept for it."""
    if not (folder / MANIFEST_NAME).is_file() and _is_from_before_manifests(folder):
        logger.warning("checkpoint %s was written before checkpoint manifests: its files are not verified", folder)
    elif problem := manifest_problem(folder, checksums=True):
        raise CheckpointError(f"checkpoint {folder} cannot be loaded: {problem}")
    state = json.loads((folder / "state.json").read_text())
    trainer.load_checkpoint(folder)
    sampler.load_state_dict(state["sampler"])
    rng = torch.load(folder / "rng.pt", weights_only=False)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    return int(state["next_step"]), load_pending(folder)
