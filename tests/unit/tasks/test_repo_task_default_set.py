"""The acceptance of the default task set that `make tasks` builds (h11, seed 0): every task's failing tests fail
on its snapshot and every test passes once the original file is back; and a rebuild from the same sdist and seed
gives the same set, byte for byte."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sharpen.cli.tasks import sdist_cache_dir
from sharpen.data.repo_tasks import MANIFEST_FILE, TASKS_FILE, read_repo_tasks
from sharpen.tasks import BuildSettings, build_task_set, check_task_set

ROOT = Path(__file__).resolve().parents[3]
DEFAULT_TASKS = ROOT / ".sharpen-tasks" / "h11-0.16.0-seed0"  # the Makefile's DEFAULT_TASKS


@pytest.fixture(scope="module")
def default_set() -> Path:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (make system-deps)")
    if not (DEFAULT_TASKS / TASKS_FILE).is_file():
        pytest.fail(f"no default task set at {DEFAULT_TASKS} (`make test` builds it first: `make tasks`)")
    return DEFAULT_TASKS


def test_every_default_task_fails_on_its_snapshot_and_passes_restored(default_set):
    tasks = read_repo_tasks(default_set)
    assert len(tasks) >= 5
    assert check_task_set(default_set, progress=lambda line: None) == []


@pytest.mark.slow
def test_rebuilding_the_default_set_gives_the_same_tasks(default_set, tmp_path):
    manifest = json.loads((default_set / MANIFEST_FILE).read_text())
    sdist = sdist_cache_dir() / manifest["sdist"]
    if not sdist.is_file():
        pytest.fail(f"the default set's sdist is not cached at {sdist} (`make tasks` downloads it)")
    settings = BuildSettings(
        seed=manifest["seed"],
        max_tasks=manifest["max_tasks"],
        max_tries=manifest["max_tries"],
        ignore=tuple(manifest["ignored"]),
    )
    report = build_task_set(str(sdist), tmp_path / "again", settings, cache_dir=tmp_path, progress=lambda line: None)
    assert [task.content_hash for task in report.tasks] == [task.content_hash for task in read_repo_tasks(default_set)]
    assert (tmp_path / "again" / TASKS_FILE).read_bytes() == (default_set / TASKS_FILE).read_bytes()
