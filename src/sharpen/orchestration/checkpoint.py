"""Resumable run state: the trainer's files plus the loop's own state (next step, data position, RNG states).

A checkpoint folder is written under a temporary name and renamed when complete, so a crash mid-save never
leaves a checkpoint that looks valid but is not.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from sharpen.orchestration.batches.base import ProducedBatch, load_pending, save_pending

if TYPE_CHECKING:
    from sharpen.data import ExampleSampler
    from sharpen.orchestration.handles import TrainerHandle

_PREFIX = "step_"


def checkpoint_dir(run_dir: Path, next_step: int) -> Path:
    return run_dir / "checkpoints" / f"{_PREFIX}{next_step:06d}"


def latest_checkpoint(run_dir: Path) -> Path | None:
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return None
    done = sorted(p for p in root.iterdir() if p.name.startswith(_PREFIX) and (p / "state.json").is_file())
    return done[-1] if done else None


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
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    trainer.save_checkpoint(staging)
    save_pending(staging, pending)
    state: dict[str, Any] = {"next_step": next_step, "sampler": sampler_state, "num_pending_batches": len(pending)}
    torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, staging / "rng.pt")
    (staging / "state.json").write_text(json.dumps(state, indent=2))
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target


def load_checkpoint(
    folder: Path, *, trainer: TrainerHandle, sampler: ExampleSampler
) -> tuple[int, list[ProducedBatch]]:
    """Restore everything; returns the step to run next and the batches the checkpoint kept for it."""
    state = json.loads((folder / "state.json").read_text())
    trainer.load_checkpoint(folder)
    sampler.load_state_dict(state["sampler"])
    rng = torch.load(folder / "rng.pt", weights_only=False)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    return int(state["next_step"]), load_pending(folder)
