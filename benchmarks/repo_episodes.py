"""Repository environment episodes: how fast a workspace is made, and episodes per second against how many run
at once.

Run: .venv/bin/python benchmarks/repo_episodes.py [--tasks-dir .sharpen-tasks/h11-0.16.0-seed0] [--episodes 8]
[--concurrency 1 2 4]

Each episode is scripted like a policy that knows the fix: reset (the workspace: the task's snapshot read on the
host and unpacked into the shell's sandbox home), one turn that writes the mutated file as the package ships it
(graded: the package's suite in a fresh sandbox, 1), a last turn without a tool call. The episodes run as asyncio
tasks in this one process on one bwrap `SandboxPool` (``max_concurrency`` = the episodes at once), the way the
episode runner drives them; "replicas" here are concurrent episodes, not `sharpen serve-sandbox` replicas (a
fleet is a Ray cluster's business and not cheap to start on one small machine). Prints, per concurrency: the
median and p90 reset (workspace creation) time, episodes/s and whether every episode scored 1.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import statistics
import time
from pathlib import Path

from sharpen.config.environments import RepositoryEnvironmentConfig
from sharpen.config.sandbox import SandboxConfig
from sharpen.data.repo_tasks import ORIGINAL_DIR, read_repo_tasks
from sharpen.environments import EpisodeContext
from sharpen.environments.registry import build_sandbox
from sharpen.environments.repository import RepositoryEnvironment
from sharpen.environments.sandbox import SandboxPool


def _fix_action(tasks_dir: Path, path: str) -> str:
    data = base64.b64encode((tasks_dir / ORIGINAL_DIR / path).read_bytes()).decode()
    command = f"printf %s {data} | base64 -d > {path}"
    return f"<tool_call>{json.dumps({'name': 'run_command', 'arguments': {'command': command}})}</tool_call>"


async def _episode(pool: SandboxPool, tasks_dir: Path, index: int) -> tuple[float, float]:
    """(reset seconds, the episode's summed reward)."""
    environment = RepositoryEnvironment(tasks_dir=str(tasks_dir))
    task_ids = list(environment.task_set.tasks)
    (example,) = RepositoryEnvironment.make_tasks(
        1, seed=0, tasks_dir=str(tasks_dir), task_ids=[task_ids[index % len(task_ids)]]
    )
    ctx = EpisodeContext(seed=index, sample_index=0, max_turns=4, max_tokens=99999, sandbox=pool)
    start = time.perf_counter()
    await environment.reset(example, ctx)
    reset_seconds = time.perf_counter() - start
    task = environment.repo_task
    assert task is not None
    total = 0.0
    for action in (_fix_action(tasks_dir, task.mutation.path), "Fixed."):
        result = await environment.step(action)
        total += result.reward or 0.0
    return reset_seconds, total


async def _run(pool: SandboxPool, tasks_dir: Path, num_episodes: int, concurrency: int) -> list[tuple[float, float]]:
    limit = asyncio.Semaphore(concurrency)

    async def one(index: int) -> tuple[float, float]:
        async with limit:
            return await _episode(pool, tasks_dir, index)

    return await asyncio.gather(*(one(index) for index in range(num_episodes)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks-dir", type=Path, default=Path(RepositoryEnvironmentConfig().tasks_dir))
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    tasks = read_repo_tasks(args.tasks_dir)
    print(f"{len(tasks)} tasks of {args.tasks_dir}; {args.episodes} episodes per row")
    print(f"{'at once':>8} {'reset p50 ms':>13} {'reset p90 ms':>13} {'episodes/s':>11} {'all 1':>6}")
    for concurrency in args.concurrency:
        sandbox = SandboxConfig(backend="bwrap", wall_seconds=120, max_concurrency=max(2, concurrency))
        pool = build_sandbox(RepositoryEnvironmentConfig(tasks_dir=str(args.tasks_dir)), sandbox)
        assert isinstance(pool, SandboxPool)
        with pool:
            asyncio.run(_run(pool, args.tasks_dir, 1, 1))  # warm: the first sandbox and the page cache
            start = time.perf_counter()
            outcomes = asyncio.run(_run(pool, args.tasks_dir, args.episodes, concurrency))
            seconds = time.perf_counter() - start
        resets = sorted(reset * 1000 for reset, _ in outcomes)
        p90 = resets[min(len(resets) - 1, round(0.9 * (len(resets) - 1)))]
        solved = all(total == 1.0 for _, total in outcomes)
        print(
            f"{concurrency:>8} {statistics.median(resets):>13.1f} {p90:>13.1f} "
            f"{args.episodes / seconds:>11.2f} {'yes' if solved else 'NO':>6}"
        )


if __name__ == "__main__":
    main()
