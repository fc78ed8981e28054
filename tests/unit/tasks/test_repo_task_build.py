"""Task sets built from a tiny hand-made sdist in the real bwrap sandbox: the same seed gives the same set byte for
byte, another seed another set; every task checks out; bad input is one clear error line."""

from __future__ import annotations

import io
import shutil
import tarfile
import textwrap
from pathlib import Path

import pytest

from sharpen.cli.main import EXIT_USER_ERROR, main
from sharpen.data.repo_tasks import TASKS_FILE, read_repo_tasks, read_tree
from sharpen.tasks import BuildSettings, TaskBuildError, build_task_set, check_task_set

MODULE = '''\
"""A tiny package for mutation tests."""


def clamp(x, low, high):
    if x < low:
        return low
    if x > high:
        return high
    return x


def mean(values):
    if not values:
        raise ValueError("no values")
    return sum(values) / len(values)


def window(items, size):
    out = []
    for start in range(0, len(items) - size + 1):
        out.append(items[start : start + size])
    return out
'''

TESTS = """\
import pytest

from tinycalc import clamp, mean, window


def test_clamp_inside():
    assert clamp(5, 0, 10) == 5


def test_clamp_edges():
    assert clamp(-1, 0, 10) == 0
    assert clamp(11, 0, 10) == 10
    assert clamp(0, 0, 10) == 0


def test_mean():
    assert mean([1, 2, 3, 6]) == 3


def test_mean_of_nothing():
    with pytest.raises(ValueError):
        mean([])


def test_window():
    assert window([1, 2, 3], 2) == [[1, 2], [2, 3]]
"""

NOTHING_CHECKED = """\
from tinycalc import clamp


def test_imports():
    assert callable(clamp)
"""


def _sdist(folder: Path, files: dict[str, str], *, name: str = "tinycalc-1.0") -> Path:
    path = folder / f"{name}.tar.gz"
    with tarfile.open(path, "w:gz") as archive:
        for relative, text in sorted(files.items()):
            data = text.encode()
            info = tarfile.TarInfo(f"{name}/{relative}")
            info.size, info.mtime = len(data), 0
            archive.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture(scope="module")
def needs_bwrap() -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (make system-deps)")


@pytest.fixture(scope="module")
def tiny_sdist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    files = {"tinycalc/__init__.py": MODULE, "tests/test_tinycalc.py": TESTS, "setup.py": "raise SystemExit\n"}
    return _sdist(tmp_path_factory.mktemp("sdist"), files)


def _build(sdist: Path, out: Path, *, seed: int) -> list[str]:
    settings = BuildSettings(seed=seed, max_tasks=3, max_tries=12)
    report = build_task_set(str(sdist), out, settings, cache_dir=out.parent / "cache", progress=lambda line: None)
    return [task.content_hash for task in report.tasks]


@pytest.fixture(scope="module")
def built(needs_bwrap, tiny_sdist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny package's task set of seed 0 (read-only: a test that changes it works on a copy)."""
    out = tmp_path_factory.mktemp("built") / "set"
    _build(tiny_sdist, out, seed=0)
    return out


def test_same_seed_same_set_other_seed_other_set(built, tiny_sdist, tmp_path):
    first = [task.content_hash for task in read_repo_tasks(built)]
    again = _build(tiny_sdist, tmp_path / "again", seed=0)
    other = _build(tiny_sdist, tmp_path / "other", seed=1)
    assert len(first) == 3
    assert first == again
    assert (built / TASKS_FILE).read_bytes() == (tmp_path / "again" / TASKS_FILE).read_bytes()
    assert read_tree(built / "snapshots") == read_tree(tmp_path / "again" / "snapshots")
    assert first != other


def test_every_task_fails_as_recorded_and_passes_restored(built):
    for task in read_repo_tasks(built):
        assert task.failing_tests and len(task.failing_tests) < task.num_tests
        assert all(node in task.statement for node in task.failing_tests)
        snapshot = read_tree(task.snapshot_dir(built))
        assert snapshot["tests/test_tinycalc.py"].decode() == TESTS, "the tests are never mutated"
        changed = snapshot["tinycalc/__init__.py"].decode()
        assert changed != MODULE
        mutated_line = changed.splitlines()[task.mutation.line - 1].strip()
        assert mutated_line == "pass" or mutated_line not in task.statement, "the statement shows no code"
        assert task.mutation.path not in task.statement
    assert check_task_set(built, progress=lambda line: None) == []


def test_check_notices_a_changed_snapshot_and_a_task_that_no_longer_fails(built, tmp_path):
    copy = tmp_path / "set"
    shutil.copytree(built, copy)
    first, second = (copy / TASKS_FILE).read_text().splitlines()[:2]
    (copy / TASKS_FILE).write_text(first + "\n" + second + "\n")
    tasks = read_repo_tasks(copy)
    (tasks[0].snapshot_dir(copy) / tasks[0].mutation.path).write_text(MODULE)  # fixed, but the hash says otherwise
    (copy / "original" / tasks[1].mutation.path).write_bytes(  # an "original" that keeps the bug
        (tasks[1].snapshot_dir(copy) / tasks[1].mutation.path).read_bytes()
    )
    problems = check_task_set(copy, progress=lambda line: None)
    assert problems[0] == f"{tasks[0].id}: its snapshot, failing tests or statement do not match its content hash"
    assert problems[1].startswith(f"{tasks[1].id}: with {tasks[1].mutation.path} restored, tests still fail: ")
    assert len(problems) == 2


def _error_line(capsys) -> str:
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("sharpen: ")
    return lines[0]


def test_unknown_package_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SHARPEN_CACHE", str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip answers as PyPI would for a name it does not have, offline
    code = main(["tasks", "build", "--package", "sharpen-no-such-package==0.0.1", "--out", str(tmp_path / "out")])
    assert code == EXIT_USER_ERROR
    line = _error_line(capsys)
    assert line.startswith("sharpen: cannot download the sdist of sharpen-no-such-package==0.0.1 (pip download): ")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("package", ["h11", "h11>=0.16", "missing-1.0.tar.gz"])
def test_unpinned_or_missing_package_is_one_line(tmp_path, capsys, package):
    assert main(["tasks", "build", "--package", package, "--out", str(tmp_path / "out")]) == EXIT_USER_ERROR
    line = _error_line(capsys)
    assert "expected NAME==VERSION" in line or "does not exist" in line


def test_package_without_tests_is_one_line(tmp_path, capsys):
    sdist = _sdist(tmp_path, {"tinycalc/__init__.py": MODULE})
    assert main(["tasks", "build", "--package", str(sdist), "--out", str(tmp_path / "out")]) == EXIT_USER_ERROR
    assert (
        _error_line(capsys) == "sharpen: tinycalc 1.0: its sdist ships no tests (no test_*.py file, no tests/ folder)"
    )


def test_no_surviving_mutant_is_an_error(needs_bwrap, tmp_path):
    sdist = _sdist(tmp_path, {"tinycalc/__init__.py": MODULE, "tests/test_tinycalc.py": NOTHING_CHECKED})
    with pytest.raises(TaskBuildError) as raised:
        build_task_set(str(sdist), tmp_path / "out", BuildSettings(max_tries=2), cache_dir=tmp_path, progress=print)
    assert str(raised.value) == (
        "tinycalc 1.0: none of the 2 mutants tried made some but not all of its tests fail (try more with "
        "--max-tries, or another seed)"
    )
    assert not (tmp_path / "out").exists()


def test_tests_that_fail_as_shipped_are_left_out(needs_bwrap, tmp_path):
    broken = TESTS + textwrap.dedent(
        """

        def test_broken_as_shipped():
            assert clamp(1, 2, 3) == 1
        """
    )
    sdist = _sdist(tmp_path, {"tinycalc/__init__.py": MODULE, "tests/test_tinycalc.py": broken})
    report = build_task_set(
        str(sdist), tmp_path / "set", BuildSettings(max_tasks=1), cache_dir=tmp_path, progress=lambda line: None
    )
    assert report.tasks
    assert all("test_broken_as_shipped" not in node for task in report.tasks for node in task.failing_tests)
    assert (
        '"deselected": [\n    "tests/test_tinycalc.py::test_broken_as_shipped"'
        in (tmp_path / "set" / "manifest.json").read_text()
    )


def test_checking_a_folder_that_is_not_a_task_set_is_one_line(tmp_path, capsys):
    assert main(["tasks", "check", str(tmp_path)]) == EXIT_USER_ERROR
    assert _error_line(capsys) == (
        f"sharpen: {tmp_path}: not a task set (no tasks.jsonl); build one with `sharpen tasks build`"
    )


def test_ignoring_a_path_the_sdist_lacks_is_one_line(tiny_sdist, tmp_path, capsys):
    argv = ["tasks", "build", "--package", str(tiny_sdist), "--ignore", "tests/nope.py", "--out", str(tmp_path / "o")]
    assert main(argv) == EXIT_USER_ERROR
    assert _error_line(capsys) == "sharpen: tinycalc 1.0: --ignore 'tests/nope.py' is no file or folder of the sdist"
