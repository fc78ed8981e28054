"""Building a task set from a package, and checking one: `build_task_set` and `check_task_set`.

A build reads the package's sdist, runs its tests once as they ship (the baseline: tests failing already are left
out of every later run), lists every mutation site of its functions (mutations.py), shuffles them with the seed,
and runs the suite on each mutant in turn until ``max_tasks`` are kept or ``max_tries`` were tried. A mutant is
kept when the suite ran to its end and some, but not all, tests failed; one that times out, crashes the run or
breaks collection (an import error fails everything) is dropped. Equal mutated files are tried once.

Determinism: the sites' order is fixed and the seed alone shuffles it; mutants are judged in that order whatever
the number of parallel runs; the failure lines are taken with hash randomisation fixed and object addresses
blanked. So the same sdist and seed give the same tasks.jsonl, byte for byte, as long as the package's tests are
themselves deterministic (a flaky test can flip a mutant; `check_task_set` would show it).
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from sharpen.data.repo_tasks import (
    MANIFEST_FILE,
    ORIGINAL_DIR,
    TASKS_FILE,
    MutationRecord,
    RepoTask,
    content_hash,
    read_repo_tasks,
    read_tree,
    write_tree,
)
from sharpen.environments.pytest_suite import SuiteResult, run_suite, suite_sandbox_config
from sharpen.environments.sandbox import Sandbox
from sharpen.tasks.mutations import Mutation, find_mutations
from sharpen.tasks.sources import (
    PackageSource,
    Snapshot,
    TaskBuildError,
    fetch_sdist,
    is_test_file,
    read_sdist,
    source_files,
)

BUILDER_VERSION = "1"
BASELINE_WALL_SECONDS = 300.0
MAX_LISTED_FAILURES = 10
Progress = Callable[[str], None]


@dataclass(kw_only=True, slots=True, frozen=True)
class BuildSettings:
    seed: int = 0
    max_tasks: int = 8
    max_tries: int | None = None
    """Mutants to try at most (None: 8 per task wanted)."""
    jobs: int = 2
    """Suites run at once (each in its own sandbox)."""
    ignore: tuple[str, ...] = ()
    """Test files or folders never run (pytest's ``--ignore``), e.g. tests whose failure lines depend on timing."""
    min_wall_seconds: float = 10.0
    """A mutant's suite may run max(this, 5 x the baseline's time), rounded up to 10 s: longer is an endless loop."""


@dataclass(kw_only=True, slots=True, frozen=True)
class BuildReport:
    tasks: list[RepoTask]
    num_sites: int
    num_tried: int
    num_incomplete: int
    seconds: float


def build_task_set(
    package: str, out: Path, settings: BuildSettings, *, cache_dir: Path, progress: Progress = print
) -> BuildReport:
    """Build a task set from ``package`` (``NAME==VERSION`` or an sdist file) into ``out`` (replaced whole)."""
    started = time.monotonic()
    source = read_sdist(fetch_sdist(package, cache_dir=cache_dir))
    label = f"{source.name} {source.version}"
    modules = source_files(source.files)
    if not any(is_test_file(path) and path.endswith(".py") for path in source.files):
        raise TaskBuildError(f"{label}: its sdist ships no tests (no test_*.py file, no tests/ folder)")
    missing = [
        path
        for path in settings.ignore
        if not any(f == path or f.startswith(path.rstrip("/") + "/") for f in source.files)
    ]
    if missing:
        raise TaskBuildError(f"{label}: --ignore {missing[0]!r} is no file or folder of the sdist")
    mutants = _distinct_mutants(source.files, modules)
    if not mutants:
        raise TaskBuildError(f"{label}: no mutation site in its {len(modules)} source modules")
    baseline_config = suite_sandbox_config(wall_seconds=BASELINE_WALL_SECONDS, max_concurrency=1)
    with Sandbox(baseline_config) as sandbox:
        baseline = run_suite(sandbox, source.files, ignore=settings.ignore)
    if not baseline.is_complete:
        raise TaskBuildError(f"{label}: its tests do not run in the sandbox ({baseline.detail})")
    if not baseline.passed:
        raise TaskBuildError(f"{label}: no test passes as the package ships (pytest exit code {baseline.exit_code})")
    deselect = tuple(sorted(baseline.failed))
    wall = max(settings.min_wall_seconds, 5 * baseline.wall_seconds)
    wall = 10.0 * math.ceil(wall / 10.0)
    progress(
        f"{label}: {len(baseline.passed)} tests pass in {baseline.wall_seconds:.1f} s ({len(deselect)} failing "
        f"as shipped, left out); {len(mutants)} distinct mutants in {len(modules)} modules; limit {wall:g} s a run"
    )
    order = list(range(len(mutants)))
    random.Random(settings.seed).shuffle(order)
    max_tries = settings.max_tries if settings.max_tries is not None else 8 * settings.max_tasks
    tried = [mutants[index] for index in order[:max_tries]]
    kept: list[tuple[Mutation, Snapshot, SuiteResult]] = []
    num_tried = num_incomplete = 0
    config = suite_sandbox_config(wall_seconds=wall, max_concurrency=settings.jobs)
    with Sandbox(config) as sandbox:
        for (mutation, files), result in _judged(sandbox, tried, deselect, settings.ignore, jobs=settings.jobs):
            num_tried += 1
            num_incomplete += not result.is_complete
            if _is_task(result):
                kept.append((mutation, files, result))
                progress(
                    f"  kept {len(kept)}/{settings.max_tasks} after {num_tried} tried: {mutation.operator} in "
                    f"{mutation.path}:{mutation.line} ({len(result.failed)} tests fail)"
                )
            if len(kept) == settings.max_tasks:
                break
    if not kept:
        raise TaskBuildError(
            f"{label}: none of the {num_tried} mutants tried made some but not all of its tests fail (try more "
            "with --max-tries, or another seed)"
        )
    tasks = [_task(source, mutation, files, result) for mutation, files, result in kept]
    manifest = {
        "builder_version": BUILDER_VERSION,
        "package": source.name,
        "version": source.version,
        "sdist": source.sdist_name,
        "sdist_sha256": source.sdist_sha256,
        "seed": settings.seed,
        "max_tasks": settings.max_tasks,
        "max_tries": max_tries,
        "num_sites": len(mutants),
        "num_tried": num_tried,
        "num_tasks": len(tasks),
        "num_tests": len(baseline.passed),
        "deselected": list(deselect),
        "ignored": list(settings.ignore),
        "suite_wall_seconds": wall,
    }
    _write_task_set(out, source, tasks, [files for _, files, _ in kept], manifest)
    return BuildReport(
        tasks=tasks,
        num_sites=len(mutants),
        num_tried=num_tried,
        num_incomplete=num_incomplete,
        seconds=time.monotonic() - started,
    )


def _distinct_mutants(files: Snapshot, modules: list[str]) -> list[tuple[Mutation, Snapshot]]:
    """Every mutant (its mutation and mutated snapshot), in site order; a mutated file equal to an earlier one, or
    one that does not compile, is left out."""
    mutants, seen = [], set()
    for path in modules:
        text = files[path].decode()
        for mutation in find_mutations(path, text):
            mutated = mutation.apply(text)
            if (path, mutated) in seen:
                continue
            seen.add((path, mutated))
            try:
                compile(mutated, path, "exec")
            except (SyntaxError, ValueError):
                continue
            mutants.append((mutation, {**files, path: mutated.encode()}))
    return mutants


def _judged(
    sandbox: Sandbox,
    mutants: list[tuple[Mutation, Snapshot]],
    deselect: tuple[str, ...],
    ignore: tuple[str, ...],
    *,
    jobs: int,
) -> Iterator[tuple[tuple[Mutation, Snapshot], SuiteResult]]:
    """Each mutant with its suite's result, in the given order, ``jobs`` suites running at a time."""
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for start in range(0, len(mutants), jobs):
            chunk = mutants[start : start + jobs]
            results = list(
                pool.map(lambda mutant: run_suite(sandbox, mutant[1], deselect=deselect, ignore=ignore), chunk)
            )
            yield from zip(chunk, results, strict=True)


def _is_task(result: SuiteResult) -> bool:
    """Some tests failed, some passed, and every failure is a test's (not a module that failed to collect)."""
    failures_are_tests = all("::" in node for node in result.failed)
    return result.is_complete and bool(result.failed) and bool(result.passed) and failures_are_tests


def _task(source: PackageSource, mutation: Mutation, files: Snapshot, result: SuiteResult) -> RepoTask:
    failing = tuple(sorted(result.failed))
    statement = problem_statement(source.name, source.version, {node: result.failed[node] for node in failing})
    digest = content_hash(files, failing, statement)
    record = MutationRecord(
        operator=mutation.operator,
        path=mutation.path,
        function=mutation.function,
        line=mutation.line,
        description=mutation.description,
    )
    return RepoTask(
        id=digest[:16],
        content_hash=digest,
        package=source.name,
        version=source.version,
        failing_tests=failing,
        num_tests=len(result.passed) + len(result.failed),
        statement=statement,
        mutation=record,
    )


def problem_statement(package: str, version: str, failures: dict[str, str]) -> str:
    """What a solver is told: which tests fail and pytest's short line for each (the first MAX_LISTED_FAILURES),
    never the changed code or where it is."""
    lines = [
        f"This repository is the Python package `{package}` ({version}). These of its tests fail:",
        "",
    ]
    for node, message in list(failures.items())[:MAX_LISTED_FAILURES]:
        lines.append(f"- {node}")
        lines += [f"    {line}" for line in message.splitlines()]
    if len(failures) > MAX_LISTED_FAILURES:
        lines.append(f"- ... and {len(failures) - MAX_LISTED_FAILURES} more")
    lines += [
        "",
        "Find the bug in the package's source and fix it, so that these tests pass and the others keep passing. "
        "Do not change the tests.",
    ]
    return "\n".join(lines)


def _write_task_set(
    out: Path, source: PackageSource, tasks: list[RepoTask], snapshots: list[Snapshot], manifest: dict
) -> None:
    """Write into a fresh folder beside ``out``, then put it in ``out``'s place: a build that fails half-way leaves
    the previous set as it was."""
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    write_tree(partial / ORIGINAL_DIR, source.files)
    for task, files in zip(tasks, snapshots, strict=True):
        write_tree(task.snapshot_dir(partial), files)
    (partial / TASKS_FILE).write_text("".join(task.to_json() + "\n" for task in tasks))
    (partial / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)


def check_task_set(task_set: Path, *, jobs: int = 2, progress: Progress = print) -> list[str]:
    """Each task's problems (none: the set is sound): its snapshot matches its hash; on the snapshot exactly its
    failing tests fail; with the mutated file restored from ``original/``, every test passes."""
    tasks = read_repo_tasks(task_set)
    manifest = json.loads((task_set / MANIFEST_FILE).read_text())
    original = read_tree(task_set / ORIGINAL_DIR)
    deselect, ignore = tuple(manifest["deselected"]), tuple(manifest["ignored"])
    runs: list[tuple[RepoTask, Snapshot, Snapshot]] = []
    problems: list[str] = []
    for task in tasks:
        files = read_tree(task.snapshot_dir(task_set))
        if content_hash(files, task.failing_tests, task.statement) != task.content_hash:
            problems.append(f"{task.id}: its snapshot, failing tests or statement do not match its content hash")
            continue
        restored = {**files, task.mutation.path: original[task.mutation.path]}
        runs.append((task, files, restored))
    config = suite_sandbox_config(wall_seconds=manifest["suite_wall_seconds"], max_concurrency=jobs)
    with Sandbox(config) as sandbox, ThreadPoolExecutor(max_workers=jobs) as pool:
        suites = [(files, restored) for _, files, restored in runs]
        before = list(pool.map(lambda pair: run_suite(sandbox, pair[0], deselect=deselect, ignore=ignore), suites))
        after = list(pool.map(lambda pair: run_suite(sandbox, pair[1], deselect=deselect, ignore=ignore), suites))
    for (task, _, _), mutated, fixed in zip(runs, before, after, strict=True):
        found = _check_one(task, mutated, fixed)
        problems += found
        progress(f"{task.id}: {'ok' if not found else 'FAILED'} ({len(task.failing_tests)} failing tests)")
    return problems


def _check_one(task: RepoTask, mutated: SuiteResult, fixed: SuiteResult) -> list[str]:
    problems = []
    if not mutated.is_complete or tuple(sorted(mutated.failed)) != task.failing_tests:
        seen = sorted(mutated.failed) if mutated.is_complete else mutated.detail
        problems.append(f"{task.id}: on the snapshot, expected exactly {list(task.failing_tests)} to fail, got {seen}")
    if not fixed.is_complete or fixed.failed or fixed.exit_code != 0:
        seen = sorted(fixed.failed) if fixed.is_complete else fixed.detail
        problems.append(f"{task.id}: with {task.mutation.path} restored, tests still fail: {seen}")
    return problems
