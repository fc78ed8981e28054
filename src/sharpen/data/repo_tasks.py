"""Repository tasks as data: a task set on disk and its records (`RepoTask`), read and written here so that an
environment (which sits below the builder in the layers) can load them without the builder.

A task set is a folder:

- ``tasks.jsonl``: one `RepoTask` per line, in the order they were built;
- ``snapshots/<id>/``: each task's repository snapshot (the package's sdist with one planted bug);
- ``original/``: the package as its sdist ships it (for checking that restoring the function fixes the task);
- ``manifest.json``: how the set was built (package, sdist sha256, seed, counts), for people and for `check`.

A task's ``content_hash`` covers its snapshot's files, its failing tests and its statement, nothing else: two
builds that agree on all three give the same hash. ``mutation`` says where the bug is: it is for checking and
analysis, and an environment must not show it to the policy. This module builds nothing (sharpen.tasks does).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from sharpen.data.sources import DataError

TASKS_FILE = "tasks.jsonl"
MANIFEST_FILE = "manifest.json"
SNAPSHOTS_DIR = "snapshots"
ORIGINAL_DIR = "original"


@dataclass(kw_only=True, slots=True, frozen=True)
class MutationRecord:
    """Where the planted bug is: for restoring the original and for analysis, never for the policy."""

    operator: str
    path: str
    function: str
    line: int
    description: str


@dataclass(kw_only=True, slots=True, frozen=True)
class RepoTask:
    id: str
    """The first 16 hex digits of ``content_hash``; also the snapshot's folder name."""
    content_hash: str
    package: str
    version: str
    failing_tests: tuple[str, ...]
    """pytest node ids that fail on the snapshot and pass once the bug is fixed, sorted."""
    num_tests: int
    """Tests that ran (passed or failed) on the snapshot."""
    statement: str
    """The problem as the policy sees it: the failing tests and their failure lines; no diff, no location."""
    mutation: MutationRecord

    def snapshot_dir(self, task_set: Path) -> Path:
        return task_set / SNAPSHOTS_DIR / self.id

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def snapshot_digest(files: dict[str, bytes]) -> dict[str, str]:
    """Each file's sha256, by path."""
    return {path: hashlib.sha256(files[path]).hexdigest() for path in sorted(files)}


def content_hash(files: dict[str, bytes], failing_tests: tuple[str, ...], statement: str) -> str:
    payload = {"files": snapshot_digest(files), "failing_tests": sorted(failing_tests), "statement": statement}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def read_tree(root: Path) -> dict[str, bytes]:
    """A folder's regular files, by POSIX relative path."""
    return {path.relative_to(root).as_posix(): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()}


def write_tree(root: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def read_repo_tasks(task_set: Path) -> list[RepoTask]:
    """The records of a task set folder; DataError (one line) when it is not one."""
    tasks_file = task_set / TASKS_FILE
    if not tasks_file.is_file():
        raise DataError(f"{task_set}: not a task set (no {TASKS_FILE}); build one with `sharpen tasks build`")
    tasks = []
    for number, line in enumerate(tasks_file.read_text().splitlines(), start=1):
        try:
            record = json.loads(line)
            mutation = MutationRecord(**record.pop("mutation"))
            tasks.append(RepoTask(**{**record, "failing_tests": tuple(record["failing_tests"]), "mutation": mutation}))
        except (ValueError, TypeError, KeyError) as error:
            raise DataError(f"{tasks_file}:{number}: not a repository task ({error})") from None
    return tasks
