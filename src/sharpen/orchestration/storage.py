"""The proof, at start, that the run directory is one folder for the driver and every trainer process: the driver
writes a marker holding a random token, each trainer rank reads it back and writes its own, and the driver reads
theirs. Checkpoints and the exported model are written by the trainer ranks into folders the driver names and then
completes (`checkpoint.py` writes the manifest from the driver's view), so a folder that is not shared would give
checkpoints that look whole and hold no weights.

Owns both halves: `answer_marker` runs in each trainer process (a local rank process, a Ray trainer actor), and
`check_shared_run_dir` in the driver. A trainer in the driver's own process needs no check, and the runtimes make
none for it.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from sharpen.config.loader import ConfigError

_DRIVER_MARKER = "driver"


class TrainerProcesses(Protocol):
    """A trainer whose ranks run in other processes: each call goes to every rank, and every rank's answer comes
    back in rank order (`LocalTrainerRanks`, the Ray `TrainerProxy`)."""

    def call_all(self, method: str, *args: Any) -> list[Any]: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class MarkerAnswer:
    """One trainer rank's side of the check: its host, the marker it wrote (a name in the marker folder), or what
    went wrong."""

    host: str
    marker: str | None = None
    problem: str | None = None


def answer_marker(folder: Path, token: str, *, rank: int) -> MarkerAnswer:
    """A trainer rank's half: read the driver's marker in ``folder`` (it must hold ``token``), then write this
    rank's own marker beside it."""
    host = socket.gethostname()
    try:
        seen = (folder / _DRIVER_MARKER).read_text()
    except OSError as error:
        return MarkerAnswer(host=host, problem=f"cannot read the driver's marker ({error.strerror or error})")
    if seen != token:
        return MarkerAnswer(host=host, problem="reads another run's marker, not the driver's")
    name = f"rank-{rank}"
    try:
        (folder / name).write_text(f"{token} {host} {os.getpid()}")
    except OSError as error:
        return MarkerAnswer(host=host, problem=f"cannot write into it ({error.strerror or error})")
    return MarkerAnswer(host=host, marker=name)


def check_shared_run_dir(run_dir: Path, trainer: TrainerProcesses, *, output_dir: str) -> None:
    """Refuse (one line, naming the first rank that fails and what to set) unless every trainer rank reads the
    driver's marker under ``run_dir`` and the driver reads each rank's; the markers are removed after."""
    token = secrets.token_hex(16)
    folder = run_dir / f".shared-check-{token[:12]}"
    folder.mkdir(parents=True)
    try:
        (folder / _DRIVER_MARKER).write_text(token)
        answers: list[MarkerAnswer] = trainer.call_all("check_shared_dir", folder, token)
        for rank, answer in enumerate(answers):
            problem = answer.problem or _driver_side(folder, answer, token)
            if problem is not None:
                raise ConfigError(
                    f"run.output_dir {output_dir} is not shared: trainer rank {rank} on host {answer.host} {problem} "
                    f"in {folder}; put run.output_dir on a filesystem every node mounts"
                )
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _driver_side(folder: Path, answer: MarkerAnswer, token: str) -> str | None:
    """What the driver finds of a rank's marker: None when it holds the token."""
    assert answer.marker is not None  # a rank without a problem wrote one
    try:
        written = (folder / answer.marker).read_text()
    except OSError:
        return "wrote its marker where the driver cannot read it"
    return None if written.startswith(f"{token} ") else "wrote a marker the driver reads with other contents"
