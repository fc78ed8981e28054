"""A checkpoint's manifest: every file of its folder (relative path, size, sha256) and the format version, in
``manifest.json``, written last, so a folder is complete exactly when its manifest is there and its files match it.

Owns writing and checking the manifest of one folder, on any fsspec filesystem: the local disk (the default) or an
object store (`object_store.py`), where sizes come from one listing and checksums from reading the objects. It does
not know what a checkpoint holds (`checkpoint.py`) or who wrote the files: the driver writes the manifest from its
own view of the folder, after every trainer rank has written its files into it (on a disk, every rank's file only
on a folder the ranks share, which `storage.py` proves at start); a rank that uploaded its files to a store hands
the driver their checksums (``hashed``), so the driver does not read them back.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import cast

from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 2
"""1: a checkpoint of a sharpen before manifests (a folder renamed once its ``state.json`` was written); 2: with
``manifest.json``."""

LOCAL = LocalFileSystem()
Entries = dict[str, dict[str, int | str]]
"""A manifest's files: relative path -> ``{"size": bytes, "sha256": hex digest}``."""
Hashed = Mapping[str, Mapping[str, int | str]]
"""Files that their writer hashed, as `Entries`."""

_CHUNK_BYTES = 1 << 20
_MAX_HASH_THREADS = 8  # hashlib releases the GIL on large buffers: a few files hash at once


def write_manifest(folder: Path | str, *, fs: AbstractFileSystem = LOCAL, hashed: Hashed | None = None) -> Entries:
    """Write ``folder/manifest.json`` listing every file under ``folder`` (a crash leaves none or a whole one: a
    rename on a disk, one object in a store); returns the entries. A file of ``hashed`` keeps the sha256 its writer
    computed, and its size in the folder must be the one the writer gave; the others are read and hashed here.
    Raises ValueError when a file of ``hashed`` is not in the folder or has another size."""
    root, hashed = _root(fs, folder), hashed or {}
    entries = folder_entries(root, fs=fs, hashed=hashed)
    if missing := sorted(set(hashed) - set(entries)):
        raise ValueError(f"{missing[0]} was written but is not in the folder")
    for name, entry in hashed.items():
        if entries[name]["size"] != entry["size"]:
            raise ValueError(
                f"{name} has {entries[name]['size']} bytes in the folder, its writer wrote {entry['size']}"
            )
    staging = f"{root}/{MANIFEST_NAME}.tmp"
    fs.pipe_file(staging, json.dumps({"format": FORMAT_VERSION, "files": entries}, indent=1).encode())
    fs.mv(staging, f"{root}/{MANIFEST_NAME}")
    return entries


def folder_entries(folder: Path | str, *, fs: AbstractFileSystem = LOCAL, hashed: Hashed | None = None) -> Entries:
    """Every file under ``folder`` but a manifest, with its size and sha256 (taken from ``hashed`` where given)."""
    root, hashed = _root(fs, folder), hashed or {}
    sizes = {
        name: size for name, size in _listing(fs, root).items() if name not in (MANIFEST_NAME, f"{MANIFEST_NAME}.tmp")
    }
    to_hash = sorted(name for name in sizes if name not in hashed)
    with ThreadPoolExecutor(max_workers=_MAX_HASH_THREADS) as pool:
        digests = dict(zip(to_hash, pool.map(lambda name: file_sha256(f"{root}/{name}", fs=fs), to_hash), strict=True))
    return {
        name: {"size": size, "sha256": str(hashed[name]["sha256"]) if name in hashed else digests[name]}
        for name, size in sorted(sizes.items())
    }


def read_manifest(folder: Path | str, *, fs: AbstractFileSystem = LOCAL) -> tuple[Entries | None, str | None]:
    """The files ``folder``'s manifest lists, or None and why it cannot be read (missing, not a manifest, another
    format)."""
    try:
        raw = fs.cat_file(f"{_root(fs, folder)}/{MANIFEST_NAME}")
    except FileNotFoundError:
        return None, f"{MANIFEST_NAME} is missing (the save did not finish)"
    try:
        manifest = json.loads(raw)
        version = manifest["format"]
        files = {
            str(name): {"size": int(entry["size"]), "sha256": str(entry["sha256"])}
            for name, entry in manifest["files"].items()
        }
    except (ValueError, KeyError, TypeError, AttributeError):
        return None, f"{MANIFEST_NAME} is not a manifest (unreadable JSON, or no format and files with size and sha256)"
    if version != FORMAT_VERSION:
        return None, f"{MANIFEST_NAME} has format {version}; this sharpen reads format {FORMAT_VERSION}"
    return files, None


def manifest_problem(folder: Path | str, *, checksums: bool, fs: AbstractFileSystem = LOCAL) -> str | None:
    """The first way ``folder`` differs from its manifest, in words (a missing manifest, a missing file, a size,
    with ``checksums`` a content), or None when it matches. Files the manifest does not list are ignored."""
    files, problem = read_manifest(folder, fs=fs)
    if files is None:
        return problem
    return files_problem(folder, files, checksums=checksums, fs=fs)


def files_problem(folder: Path | str, files: Entries, *, checksums: bool, fs: AbstractFileSystem = LOCAL) -> str | None:
    """The first file of ``files`` that ``folder`` lacks or holds with another size (or, with ``checksums``, other
    contents), in words; None when all match."""
    root = _root(fs, folder)
    sizes = _listing(fs, root)
    for name, entry in files.items():
        if name not in sizes:
            return f"{name} is missing"
        if (size := sizes[name]) != entry["size"]:
            return f"{name} has {size} bytes, its manifest says {entry['size']}"
    if checksums:
        names = list(files)
        with ThreadPoolExecutor(max_workers=_MAX_HASH_THREADS) as pool:
            digests = pool.map(lambda name: file_sha256(f"{root}/{name}", fs=fs), names)
            for name, digest in zip(names, digests, strict=True):
                if digest != files[name]["sha256"]:
                    return f"{name} does not match its sha256 in the manifest (changed after the save)"
    return None


def file_sha256(path: Path | str, *, fs: AbstractFileSystem = LOCAL) -> str:
    digest = hashlib.sha256()
    with fs.open(str(path), "rb") as stream:
        while chunk := stream.read(_CHUNK_BYTES):
            assert isinstance(chunk, bytes)  # opened "rb"
            digest.update(chunk)
    return digest.hexdigest()


def _root(fs: AbstractFileSystem, folder: Path | str) -> str:
    return cast(str, fs._strip_protocol(str(folder))).rstrip("/")


def _listing(fs: AbstractFileSystem, root: str) -> dict[str, int]:
    """Every file under ``root`` (one listing, also of an object store) by its path relative to ``root``."""
    if not fs.isdir(root):
        return {}
    found = fs.find(root, detail=True)
    assert isinstance(found, dict)
    prefix = f"{root}/"
    return {
        path.removeprefix(prefix): int(info["size"])
        for path, info in found.items()
        if info["type"] == "file" and path.startswith(prefix)
    }
