"""Where a task set's package comes from: its source distribution (a local file, or ``pip download`` of
``NAME==VERSION`` into a cache), read into memory as a snapshot (relative path -> bytes), and which of its files
are the package's own source (the ones mutated) rather than its tests, docs or build scripts.

Owns nothing but files: it runs no tests and plants no bugs. The one network access is pip's, once per
requirement; a cached sdist is used as it is (its sha256 goes into the task set's manifest).
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

REQUIREMENT = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[A-Za-z0-9][A-Za-z0-9.+!_-]*)$")
TEST_DIRS = frozenset({"test", "tests", "testing"})
NOT_SOURCE_DIRS = frozenset({"docs", "doc", "examples", "example", "benchmarks", "bench", "scripts", "fuzz", "tools"})
NOT_SOURCE_FILES = frozenset({"setup.py", "conftest.py", "noxfile.py", "tasks.py", "fabfile.py", "_version.py"})
Snapshot = dict[str, bytes]
"""A source tree in memory: POSIX relative path -> content."""


class TaskBuildError(ValueError):
    """The package, its tests or the mutations cannot give a task set (a user's input to change, one line)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class PackageSource:
    name: str
    version: str
    sdist_name: str
    sdist_sha256: str
    files: Snapshot


def fetch_sdist(spec: str, *, cache_dir: Path) -> Path:
    """The sdist of ``spec``: a path to a ``.tar.gz``/``.zip`` file, or ``NAME==VERSION`` (from ``cache_dir``, or
    downloaded there by pip, sdists only: ``--no-binary :all:``)."""
    path = Path(spec)
    if spec.endswith((".tar.gz", ".zip")):
        if not path.is_file():
            raise TaskBuildError(f"sdist {spec!r} does not exist")
        return path
    match = REQUIREMENT.match(spec)
    if match is None:
        raise TaskBuildError(f"package {spec!r}: expected NAME==VERSION (a pinned version) or an sdist file")
    cached = _cached_sdist(cache_dir, match["name"], match["version"])
    if cached is not None:
        return cached
    cache_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(cache_dir)]
    result = subprocess.run([*command, spec], capture_output=True, text=True, check=False)
    cached = _cached_sdist(cache_dir, match["name"], match["version"])
    if result.returncode != 0 or cached is None:
        errors = [line for line in result.stderr.splitlines() if line.startswith("ERROR")]
        reason = errors[0].removeprefix("ERROR: ") if errors else f"pip exited with {result.returncode}"
        raise TaskBuildError(f"cannot download the sdist of {spec} (pip download): {reason}")
    return cached


def _cached_sdist(cache_dir: Path, name: str, version: str) -> Path | None:
    wanted = f"{_normalise(name)}-{version}"
    if not cache_dir.is_dir():
        return None
    for path in sorted(cache_dir.iterdir()):
        for suffix in (".tar.gz", ".zip"):
            if path.name.endswith(suffix) and _normalise(path.name.removesuffix(suffix)) == _normalise(wanted):
                return path
    return None


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_sdist(path: Path) -> PackageSource:
    """The sdist's regular files under its single top folder, with the name and version that folder gives."""
    data = path.read_bytes()
    entries: dict[str, bytes] = {}
    if path.name.endswith(".zip"):
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                if not info.is_dir():
                    entries[info.filename] = archive.read(info)
    else:
        with tarfile.open(path, "r:gz") as archive:
            for member in archive.getmembers():
                extracted = archive.extractfile(member) if member.isreg() else None
                if extracted is not None:
                    entries[member.name] = extracted.read()
    tops = {PurePosixPath(name).parts[0] for name in entries}
    if len(tops) != 1:
        raise TaskBuildError(f"{path.name}: an sdist has one top folder, this one has {len(tops)}")
    top = tops.pop()
    name, _, version = top.rpartition("-")
    files: Snapshot = {}
    for entry, content in sorted(entries.items()):
        relative = PurePosixPath(entry).relative_to(top)
        if ".." in relative.parts or relative.is_absolute() or "__pycache__" in relative.parts:
            continue
        files[str(relative)] = content
    return PackageSource(
        name=name, version=version, sdist_name=path.name, sdist_sha256=hashlib.sha256(data).hexdigest(), files=files
    )


def is_test_file(path: str) -> bool:
    parts = PurePosixPath(path).parts
    name = parts[-1]
    return bool(TEST_DIRS & set(parts[:-1])) or name.startswith("test_") or name.endswith("_test.py")


def source_files(files: Snapshot) -> list[str]:
    """The package's own Python modules, sorted: files of a top-level package (a folder with ``__init__.py``, at
    the root or under ``src/``) and top-level modules, without tests, docs, examples and build scripts."""
    found = []
    for path in sorted(files):
        parts = PurePosixPath(path).parts
        if not path.endswith(".py") or is_test_file(path) or parts[-1] in NOT_SOURCE_FILES:
            continue
        package = parts[1:] if parts[0] == "src" else parts
        if NOT_SOURCE_DIRS & set(package[:-1]):
            continue
        in_package = len(package) > 1 and f"{'/'.join(parts[: len(parts) - len(package) + 1])}/__init__.py" in files
        if len(package) == 1 or in_package:
            found.append(path)
    return found
