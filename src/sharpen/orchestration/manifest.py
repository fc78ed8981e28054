"""A checkpoint's manifest: every file of its folder (relative path, size, sha256) and the format version, in
``manifest.json``, written last, so a folder is complete exactly when its manifest is there and its files match it.

Owns writing and checking the manifest of one folder. It does not know what a checkpoint holds (`checkpoint.py`) or
who wrote the files: the driver writes the manifest from its own view of the folder, after every trainer rank has
written its files into it, which is every rank's file only on a folder the ranks share (`storage.py` proves that at
start).
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 2
"""1: a checkpoint of a sharpen before manifests (a folder renamed once its ``state.json`` was written); 2: with
``manifest.json``."""

_CHUNK_BYTES = 1 << 20
_MAX_HASH_THREADS = 8  # hashlib releases the GIL on large buffers: a few files hash at once


def write_manifest(folder: Path) -> dict[str, dict[str, int | str]]:
    """Hash every file under ``folder`` and write ``folder/manifest.json`` (atomically: a crash leaves none or a
    whole one); returns the entries by relative path."""
    paths = sorted(path for path in folder.rglob("*") if path.is_file() and path != folder / MANIFEST_NAME)
    with ThreadPoolExecutor(max_workers=_MAX_HASH_THREADS) as pool:
        digests = list(pool.map(file_sha256, paths))
    files = {
        path.relative_to(folder).as_posix(): {"size": path.stat().st_size, "sha256": digest}
        for path, digest in zip(paths, digests, strict=True)
    }
    staging = folder / f"{MANIFEST_NAME}.tmp"
    staging.write_text(json.dumps({"format": FORMAT_VERSION, "files": files}, indent=1))
    os.replace(staging, folder / MANIFEST_NAME)
    return files


def manifest_problem(folder: Path, *, checksums: bool) -> str | None:
    """The first way ``folder`` differs from its manifest, in words (a missing manifest, a missing file, a size,
    with ``checksums`` a content), or None when it matches. Files the manifest does not list are ignored."""
    path = folder / MANIFEST_NAME
    if not path.is_file():
        return f"{MANIFEST_NAME} is missing (the save did not finish)"
    try:
        manifest = json.loads(path.read_text())
        version = manifest["format"]
        files = {str(name): (int(entry["size"]), str(entry["sha256"])) for name, entry in manifest["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"{MANIFEST_NAME} is not a manifest (unreadable JSON, or no format and files with size and sha256)"
    if version != FORMAT_VERSION:
        return f"{MANIFEST_NAME} has format {version}; this sharpen reads format {FORMAT_VERSION}"
    for name, (expected, _) in files.items():
        file = folder / name
        if not file.is_file():
            return f"{name} is missing"
        if (size := file.stat().st_size) != expected:
            return f"{name} has {size} bytes, its manifest says {expected}"
    if checksums:
        names = list(files)
        with ThreadPoolExecutor(max_workers=_MAX_HASH_THREADS) as pool:
            digests = pool.map(file_sha256, [folder / name for name in names])
            for name, digest in zip(names, digests, strict=True):
                if digest != files[name][1]:
                    return f"{name} does not match its sha256 in the manifest (changed after the save)"
    return None


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while chunk := stream.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()
