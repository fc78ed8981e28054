"""The proof, at start, that the run's checkpoints have one place for the driver and every trainer process: the
driver writes a marker holding a random token, each trainer rank reads it back and writes its own, and the driver
reads theirs. Checkpoints and the exported model are written by the trainer ranks into folders the driver names and
then completes (`checkpoint.py` writes the manifest from the driver's view), so a place that is not shared would
give checkpoints that look whole and hold no weights.

The place is the run directory, checked when trainer ranks run in other processes; or, with ``run.checkpoint_uri``,
the run's folder in the object store (`object_store.py`), checked always, a trainer in the driver's process
included, since a store can be unreachable or read-only for anyone (`check_storage` chooses).

Owns both halves: `answer_marker` runs in each trainer process (a local rank process, a Ray trainer actor, or the
driver for a trainer in its own process), and the checks in the driver.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from fsspec import AbstractFileSystem

from sharpen.config.loader import ConfigError
from sharpen.config.schema import RunConfig
from sharpen.orchestration.handles import TrainerHandle, TrainerProcesses
from sharpen.orchestration.object_store import StoreFolder, one_line, open_folder, run_store_folder

_DRIVER_MARKER = "driver"


@dataclass(frozen=True, kw_only=True, slots=True)
class MarkerAnswer:
    """One trainer rank's side of the check: its host, the marker it wrote (a name in the marker folder), or what
    went wrong."""

    host: str
    marker: str | None = None
    problem: str | None = None


def check_storage(run: RunConfig, run_dir: Path, trainer: TrainerHandle) -> None:
    """The start-up check for this run: the object store when ``run.checkpoint_uri`` is set (`check_store`), else
    the run directory when the trainer's ranks run in other processes (`check_shared_run_dir`)."""
    store = run_store_folder(run)
    if store is not None:
        check_store(store, trainer)
    elif isinstance(trainer, TrainerProcesses):
        check_shared_run_dir(run_dir, trainer, output_dir=run.output_dir)


def answer_marker(folder: Path | StoreFolder, token: str, *, rank: int) -> MarkerAnswer:
    """A trainer rank's half: read the driver's marker in ``folder`` (it must hold ``token``), then write this
    rank's own marker beside it."""
    host = socket.gethostname()
    try:
        fs, path = open_folder(folder)
        seen = cast(bytes, fs.cat_file(f"{path}/{_DRIVER_MARKER}")).decode()
    except OSError as error:
        return MarkerAnswer(host=host, problem=f"cannot read the driver's marker ({error.strerror or error})")
    except Exception as error:  # a store's client: no credentials, no endpoint, ...
        return MarkerAnswer(host=host, problem=f"cannot read the driver's marker ({one_line(error)})")
    if seen != token:
        return MarkerAnswer(host=host, problem="reads another run's marker, not the driver's")
    name = f"rank-{rank}"
    try:
        fs.pipe_file(f"{path}/{name}", f"{token} {host} {os.getpid()}".encode())
    except OSError as error:
        return MarkerAnswer(host=host, problem=f"cannot write into it ({error.strerror or error})")
    except Exception as error:
        return MarkerAnswer(host=host, problem=f"cannot write into it ({one_line(error)})")
    return MarkerAnswer(host=host, marker=name)


def check_shared_run_dir(run_dir: Path, trainer: TrainerProcesses, *, output_dir: str) -> None:
    """Refuse (one line, naming the first rank that fails and what to set) unless every trainer rank reads the
    driver's marker under ``run_dir`` and the driver reads each rank's; the markers are removed after."""
    token = secrets.token_hex(16)
    _check_markers(
        run_dir / f".shared-check-{token[:12]}",
        token,
        trainer.call_all,
        refusal=lambda where: (
            f"run.output_dir {output_dir} is not shared: {where}; put run.output_dir on a filesystem every node "
            "mounts, or the checkpoints in an object store (run.checkpoint_uri)"
        ),
    )


def check_store(store: StoreFolder, trainer: TrainerHandle) -> None:
    """Refuse (one line, naming the process that fails) unless the driver writes a marker into the run's folder in
    the object store, every trainer rank reads it and writes its own, and the driver reads theirs; a trainer in this
    process answers here. The markers are removed after."""

    def call_all(method: str, folder: StoreFolder, token: str) -> list[MarkerAnswer]:
        if isinstance(trainer, TrainerProcesses):
            return trainer.call_all(method, folder, token)
        return [answer_marker(folder, token, rank=0)]

    token = secrets.token_hex(16)
    _check_markers(
        store / f".shared-check-{token[:12]}",
        token,
        call_all,
        refusal=lambda where: (
            f"run.checkpoint_uri is not usable: {where}; check that the bucket exists, run.object_store.endpoint_url, "
            "and the credentials in the environment of every process"
        ),
    )


def _check_markers(
    folder: Path | StoreFolder,
    token: str,
    call_all: Callable[..., list[MarkerAnswer]],
    *,
    refusal: Callable[[str], str],
) -> None:
    """The driver's marker in ``folder``, every rank's answer (``call_all("check_shared_dir", folder, token)``), and
    the driver's reading of theirs; raises `ConfigError` with ``refusal(where it failed)``."""
    fs, path = open_folder(folder)
    try:
        if isinstance(folder, Path):
            folder.mkdir(parents=True)
        try:
            fs.pipe_file(f"{path}/{_DRIVER_MARKER}", token.encode())
        except Exception as error:  # the driver's own access: a missing bucket, no credentials, a wrong endpoint
            raise ConfigError(refusal(f"the driver cannot write into {folder} ({one_line(error)})")) from error
        for rank, answer in enumerate(call_all("check_shared_dir", folder, token)):
            problem = answer.problem or _driver_side(fs, path, answer, token)
            if problem is not None:
                raise ConfigError(refusal(f"trainer rank {rank} on host {answer.host} {problem} in {folder}"))
    finally:
        with contextlib.suppress(Exception):  # nothing was written, or the store is unreachable: the refusal says why
            fs.rm(path, recursive=True)


def _driver_side(fs: AbstractFileSystem, path: str, answer: MarkerAnswer, token: str) -> str | None:
    """What the driver finds of a rank's marker: None when it holds the token."""
    assert answer.marker is not None  # a rank without a problem wrote one
    try:
        written = cast(bytes, fs.cat_file(f"{path}/{answer.marker}")).decode()
    except OSError:
        return "wrote its marker where the driver cannot read it"
    return None if written.startswith(f"{token} ") else "wrote a marker the driver reads with other contents"
