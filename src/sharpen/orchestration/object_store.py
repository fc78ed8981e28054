"""Checkpoints and the exported model in an S3-compatible object store (``run.checkpoint_uri``), through fsspec's
s3fs.

Owns where a run's files go in the store (`StoreFolder`: picklable and holding no secret, so the driver hands it to
every trainer rank, and each process connects with the credentials of its own environment) and the trainer ranks'
half of moving files (`RANK_CALLS`): a rank writes its files into a local staging folder exactly as it would on a
disk, hashes them and uploads them (`save_to_store`, `export_to_store`), or downloads a checkpoint's trainer files,
checks each against the manifest and loads from that copy (`load_from_store`). Staging folders are temporary
folders (``TMPDIR``), removed after each call.

It does not decide which files a checkpoint holds or write its manifest (`checkpoint.py`, on the driver), nor check
at start that every process reaches the store (`storage.py`).
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from fsspec import AbstractFileSystem

from sharpen.config.loader import ConfigError
from sharpen.config.schema import RunConfig
from sharpen.orchestration.manifest import LOCAL, Entries, files_problem, folder_entries

_SCHEME = "s3://"


@dataclass(frozen=True, kw_only=True, slots=True)
class StoreAccess:
    """How to reach the store (`ObjectStoreConfig`): the endpoint, and the names (never the values) of the
    environment variables with the credentials."""

    endpoint_url: str | None = None
    key_env: str | None = None
    secret_env: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class StoreFolder:
    """A folder in the store, ``s3://bucket/prefix/...``; ``folder / "name"`` is the folder (or object) in it."""

    uri: str
    access: StoreAccess = field(default_factory=StoreAccess)

    def __truediv__(self, name: str) -> StoreFolder:
        return StoreFolder(uri=f"{self.uri}/{name}", access=self.access)

    def __str__(self) -> str:
        return self.uri

    @property
    def name(self) -> str:
        return self.uri.rsplit("/", 1)[-1]

    @property
    def path(self) -> str:
        """The folder as s3fs names it: ``bucket/prefix/...``."""
        return self.uri.removeprefix(_SCHEME)

    def filesystem(self) -> AbstractFileSystem:
        """s3fs with this process's credentials; listings are not cached (other processes write the same folders)."""
        try:
            from s3fs import S3FileSystem
        except ImportError as error:
            raise ConfigError("run.checkpoint_uri needs s3fs: pip install 'sharpen[s3]'") from error
        options: dict[str, Any] = {"use_listings_cache": False, "endpoint_url": self.access.endpoint_url}
        if self.access.key_env is not None and self.access.secret_env is not None:
            options.update(key=_from_environment(self.access.key_env), secret=_from_environment(self.access.secret_env))
        return S3FileSystem(**options)


def run_store_folder(run: RunConfig) -> StoreFolder | None:
    """The run's folder in the object store (``<run.checkpoint_uri>/<run.name>``), or None without one."""
    if run.checkpoint_uri is None:
        return None
    store = run.object_store
    access = StoreAccess(endpoint_url=store.endpoint_url, key_env=store.key_env, secret_env=store.secret_env)
    return StoreFolder(uri=f"{run.checkpoint_uri}/{run.name}", access=access)


def open_folder(folder: Path | StoreFolder) -> tuple[AbstractFileSystem, str]:
    """The filesystem that holds ``folder`` and its path there: the local disk, or the store."""
    if isinstance(folder, StoreFolder):
        return folder.filesystem(), folder.path
    return LOCAL, str(folder)


def folder_names(folder: Path | StoreFolder) -> list[str]:
    """The names directly in ``folder`` (none when there is no such folder); a store that cannot be listed (no
    bucket, no credentials, no endpoint) is a `ConfigError` in one line."""
    fs, path = open_folder(folder)
    if isinstance(folder, Path):
        return [entry.name for entry in folder.iterdir()] if folder.is_dir() else []
    bucket = path.split("/", 1)[0]
    try:
        if not fs.exists(bucket):  # a listing would only find nothing
            raise FileNotFoundError(f"no bucket {bucket}")
        return [entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(path, detail=False)] if fs.isdir(path) else []
    except Exception as error:
        raise ConfigError(
            f"run.checkpoint_uri: cannot list {folder} ({one_line(error)}); check that the bucket exists, "
            "run.object_store.endpoint_url, and the credentials in the environment"
        ) from error


def one_line(error: BaseException) -> str:
    """An exception of the store's client as one line (botocore's messages may span several)."""
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


def _from_environment(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise ConfigError(
            f"run.object_store names the environment variable {name}, which is not set in this process "
            f"(host {socket.gethostname()}, pid {os.getpid()})"
        )
    return value


# -- the trainer ranks' half ------------------------------------------------------------------------------------------


class RankTrainer(Protocol):
    """What the rank side needs of a trainer: writing and reading its files in a local folder."""

    def save_checkpoint(self, folder: Path) -> None: ...

    def load_checkpoint(self, folder: Path) -> None: ...

    def export(self, folder: Path) -> None: ...


def save_to_store(trainer: RankTrainer, target: StoreFolder) -> Entries:
    """This rank's files of a checkpoint, written locally and uploaded under ``target``; returns them (relative name
    -> size, sha256) for the driver's manifest."""
    return _upload_written(trainer.save_checkpoint, target)


def export_to_store(trainer: RankTrainer, target: StoreFolder) -> Entries:
    """This rank's files of the exported model (the writing rank's; none from the others), as `save_to_store`."""
    return _upload_written(trainer.export, target)


def load_from_store(trainer: RankTrainer, source: StoreFolder, files: Entries) -> str | None:
    """Download ``files`` (a checkpoint's trainer files, as its manifest lists them) from ``source``, check each
    by size and sha256, and load the trainer from that copy; returns the first problem (naming the file) instead of
    loading. Every rank downloads the same files, so a bad one stops every rank before any collective load."""
    with tempfile.TemporaryDirectory(prefix="sharpen-download-") as staging:
        if problem := download_files(source, files, Path(staging)):
            return problem
        trainer.load_checkpoint(Path(staging))
    return None


RANK_CALLS: dict[str, Callable[..., Any]] = {
    "save_to_store": save_to_store,
    "export_to_store": export_to_store,
    "load_from_store": load_from_store,
}
"""The rank side's calls by name, ``call(trainer, *args)``: a local rank process and a Ray trainer actor serve them,
and `checkpoint.py` calls them directly for a trainer in the driver's process."""


def upload_folder(local: Path, target: StoreFolder) -> Entries:
    """Hash every file under ``local`` and upload it to the same relative name under ``target``; returns them."""
    entries = folder_entries(local)
    if entries:
        names = list(entries)
        target.filesystem().put([str(local / name) for name in names], [f"{target.path}/{name}" for name in names])
    return entries


def download_files(source: StoreFolder, files: Entries, local: Path) -> str | None:
    """Download ``files`` of ``source`` into ``local``; the first one missing or not matching its size and sha256,
    in words, or None."""
    fs = source.filesystem()
    for name in files:  # one by one, so a missing object is named (a checkpoint is a few large files)
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        try:
            fs.get_file(f"{source.path}/{name}", str(local / name))
        except FileNotFoundError:
            return f"{name} is missing"
    return files_problem(local, files, checksums=True)


def merge_rank_files(per_rank: Sequence[Entries]) -> Entries:
    """The files every rank uploaded, as one set of entries; raises ValueError when two ranks wrote one name with
    different contents (the second upload replaced the first)."""
    merged: Entries = {}
    writers: dict[str, int] = {}
    for rank, entries in enumerate(per_rank):
        for name, entry in entries.items():
            if name in merged and merged[name] != entry:
                raise ValueError(f"trainer ranks {writers[name]} and {rank} both wrote {name}, with different contents")
            merged[name], writers[name] = entry, writers.get(name, rank)
    return merged


def _upload_written(write: Callable[[Path], None], target: StoreFolder) -> Entries:
    with tempfile.TemporaryDirectory(prefix="sharpen-upload-") as staging:
        write(Path(staging))
        return upload_folder(Path(staging), target)
