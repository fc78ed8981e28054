"""`sharpen tasks build | check`: repository task sets from a package's sdist (sharpen.tasks, docs/repo_tasks.md).

A bad package, a package without tests or no surviving mutant is one ``sharpen:`` line (exit 2); a set whose
check finds a problem lists each and exits 1.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from sharpen.config import ConfigError
from sharpen.config.models import cache_dir


def sdist_cache_dir() -> Path:
    """Where `tasks build` keeps the sdists it downloads ($SHARPEN_CACHE/sdists)."""
    return cache_dir() / "sdists"


def add_tasks_parser(commands: argparse._SubParsersAction) -> None:  # pyright: ignore[reportPrivateUsage]
    tasks = commands.add_parser("tasks", help="repository tasks: bugs planted in a package, caught by its own tests")
    task_commands = tasks.add_subparsers(dest="tasks_command", required=True)
    build = task_commands.add_parser(
        "build", help="mutate a package's functions, keep the mutants its tests catch, write a task set"
    )
    build.add_argument(
        "--package", required=True, metavar="NAME==VERSION", help="a pinned PyPI package (its sdist) or an sdist file"
    )
    build.add_argument("--out", required=True, metavar="DIR", help="the task set folder (replaced whole)")
    build.add_argument("--seed", type=int, default=0, help="chooses which mutants are tried (default: 0)")
    build.add_argument("--max-tasks", type=int, default=8, metavar="N", help="tasks to keep at most (default: 8)")
    build.add_argument(
        "--max-tries", type=int, default=None, metavar="N", help="mutants to try at most (default: 8 per task)"
    )
    build.add_argument(
        "--ignore",
        action="append",
        default=[],
        metavar="PATH",
        help="a test file or folder of the package never to run (repeatable): tests whose failures depend on timing",
    )
    check = task_commands.add_parser(
        "check", help="prove each task: its tests fail on the snapshot and pass with the original restored"
    )
    check.add_argument("task_set", help="a task set folder (holds tasks.jsonl)")


def run_tasks_command(args: argparse.Namespace) -> int:
    from sharpen.tasks import BuildSettings, TaskBuildError, build_task_set, check_task_set

    started = time.monotonic()
    if args.tasks_command == "check":
        problems = check_task_set(Path(args.task_set))
        for problem in problems:
            print(f"sharpen: {problem}", file=sys.stderr)
        print(f"{'FAILED' if problems else 'ok'}: checked in {time.monotonic() - started:.1f} s")
        return 1 if problems else 0
    if args.max_tasks < 1 or (args.max_tries is not None and args.max_tries < 1):
        raise ConfigError("--max-tasks and --max-tries must be at least 1")
    settings = BuildSettings(
        seed=args.seed, max_tasks=args.max_tasks, max_tries=args.max_tries, ignore=tuple(args.ignore)
    )
    try:
        report = build_task_set(args.package, Path(args.out), settings, cache_dir=sdist_cache_dir())
    except TaskBuildError as error:
        raise ConfigError(str(error)) from None
    print(
        f"{len(report.tasks)} tasks from {report.num_tried} mutants tried ({report.num_sites} sites, "
        f"{report.num_incomplete} runs timed out or crashed) in {report.seconds:.1f} s: {args.out}"
    )
    return 0
