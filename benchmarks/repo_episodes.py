"""Repository environment episodes: how fast a workspace is made, and episodes per second, with the sandboxes in
this process and on 1, 2 and 4 `sharpen serve-sandbox` replicas.

Run: .venv/bin/python benchmarks/repo_episodes.py [--tasks-dir .sharpen-tasks/h11-0.16.0-seed0] [--episodes 12]
[--replicas 1 2 4] [--per-replica 2]

Each episode is scripted like a policy that knows the fix: reset (the workspace: the task's snapshot read on the
host and unpacked into the shell's sandbox home), one turn that writes the mutated file as the package ships it
(graded: the package's suite in a fresh sandbox, 1), a last turn without a tool call. The episodes run as asyncio
tasks in this one process, the way the episode runner drives them, N at once for each N of ``--replicas``, twice:

- in-process: on one bwrap `SandboxPool` here (``max_concurrency`` = N, at least 2);
- fleet: on N `sharpen serve-sandbox` processes (bwrap, ``--per-replica`` executions each, served from a repository
  config so that pytest is bound in, as a run's replicas are), reached through ``sandbox.backend = "remote"``: each
  episode's shell is a session pinned to one replica, its gradings executions spread over them.

Before each row, N episodes warm the sandboxes and the page cache. Prints, per N and per side: the median and p90
reset (workspace creation) time, episodes/s and how many episodes scored 1 (an episode that raised is
counted, its first error printed); and the host's cores and load
average. The replicas share this host's cores with the client, so on a small machine more replicas than cores add
queue room and fault tolerance, not speed.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sharpen.config.environments import RepositoryEnvironmentConfig
from sharpen.config.sandbox import SandboxConfig
from sharpen.config.service import RemoteConfig
from sharpen.data.repo_tasks import ORIGINAL_DIR, read_repo_tasks
from sharpen.environments import EpisodeContext
from sharpen.environments.registry import build_sandbox
from sharpen.environments.repository import RepositoryEnvironment
from sharpen.environments.sandbox import SandboxPool
from sharpen.environments.sandbox.remote import RemoteSandboxPool

WALL_SECONDS = 150.0
"""The sandboxes' wall clock: longer than an episode's (environment.wall_seconds, 120 s by default)."""
Pool = SandboxPool | RemoteSandboxPool


def _fix_action(tasks_dir: Path, path: str) -> str:
    data = base64.b64encode((tasks_dir / ORIGINAL_DIR / path).read_bytes()).decode()
    command = f"printf %s {data} | base64 -d > {path}"
    return f"<tool_call>{json.dumps({'name': 'run_command', 'arguments': {'command': command}})}</tool_call>"


@dataclass(kw_only=True, slots=True)
class Outcome:
    reset_seconds: float | None
    """None when the reset failed."""
    total: float
    error: str = ""
    """Why the episode raised (an infrastructure fault: a shell that stopped answering on an overloaded host)."""


async def _episode(pool: Pool, tasks_dir: Path, index: int) -> Outcome:
    environment = RepositoryEnvironment(tasks_dir=str(tasks_dir))
    task_ids = list(environment.task_set.tasks)
    (example,) = RepositoryEnvironment.make_tasks(
        1, seed=0, tasks_dir=str(tasks_dir), task_ids=[task_ids[index % len(task_ids)]]
    )
    ctx = EpisodeContext(seed=index, sample_index=0, max_turns=4, max_tokens=99999, sandbox=pool)
    start = time.perf_counter()
    outcome = Outcome(reset_seconds=None, total=0.0)
    try:  # counted, not fatal: the table says how many episodes failed and the first reason
        await environment.reset(example, ctx)
        outcome.reset_seconds = time.perf_counter() - start
        task = environment.repo_task
        assert task is not None
        for action in (_fix_action(tasks_dir, task.mutation.path), "Fixed."):
            result = await environment.step(action)
            outcome.total += result.reward or 0.0
    except Exception as error:  # any fault is counted in the table, not fatal
        outcome.error = f"{type(error).__name__}: {error}"
    return outcome


async def _run(pool: Pool, tasks_dir: Path, num_episodes: int, concurrency: int) -> list[Outcome]:
    limit = asyncio.Semaphore(concurrency)

    async def one(index: int) -> Outcome:
        async with limit:
            return await _episode(pool, tasks_dir, index)

    return await asyncio.gather(*(one(index) for index in range(num_episodes)))


@contextmanager
def _replicas(count: int, per_replica: int) -> Iterator[list[str]]:
    """``count`` `sharpen serve-sandbox` processes on free loopback ports; their URLs."""
    settings = ["sandbox.backend=bwrap", f"sandbox.wall_seconds={WALL_SECONDS}"]
    settings += [f"sandbox.max_concurrency={per_replica}", "environment.type=repository"]
    command = [sys.executable, "-m", "sharpen.cli.main", "serve-sandbox", "--port", "0", *settings]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    servers = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env) for _ in range(count)]
    try:
        urls = []
        for server in servers:
            assert server.stdout is not None
            line = server.stdout.readline()
            if " at http://" not in line:
                raise SystemExit(f"a replica did not start: {line!r}")
            urls.append(line.rsplit(" at ", 1)[1].strip())
        yield urls
    finally:
        for server in servers:
            server.terminate()
        for server in servers:
            server.wait(timeout=30)


def _measure(pool: Pool, tasks_dir: Path, num_episodes: int, at_once: int) -> dict[str, Any]:
    asyncio.run(_run(pool, tasks_dir, at_once, at_once))  # warm: each replica's first sandboxes, the page cache
    start = time.perf_counter()
    outcomes = asyncio.run(_run(pool, tasks_dir, num_episodes, at_once))
    seconds = time.perf_counter() - start
    resets = sorted(o.reset_seconds * 1000 for o in outcomes if o.reset_seconds is not None) or [math.nan]
    errors = [o.error for o in outcomes if o.error]
    return {
        "p50": statistics.median(resets),
        "p90": resets[min(len(resets) - 1, round(0.9 * (len(resets) - 1)))],
        "episodes/s": num_episodes / seconds,
        "solved": f"{sum(o.total == 1.0 for o in outcomes)}/{num_episodes}",
        "errors": errors,
    }


def _cells(row: dict[str, Any]) -> str:
    return f"{row['p50']:>9.1f} {row['p90']:>9.1f} {row['episodes/s']:>10.2f} {row['solved']:>8}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks-dir", type=Path, default=Path(RepositoryEnvironmentConfig().tasks_dir))
    parser.add_argument("--episodes", type=int, default=12, help="episodes per row (after the warm-up)")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4], help="replicas (= episodes at once)")
    parser.add_argument("--per-replica", type=int, default=2, help="sandbox.max_concurrency of each replica")
    args = parser.parse_args()
    os.environ.setdefault("SHARPEN_SERVICE_TOKEN", "benchmark-token")
    environment = RepositoryEnvironmentConfig(tasks_dir=str(args.tasks_dir))
    tasks = read_repo_tasks(args.tasks_dir)
    print(f"{len(tasks)} tasks of {args.tasks_dir}; {args.episodes} episodes per row; cpus {os.cpu_count()}")
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    side = f"{'reset p50':>9} {'reset p90':>9} {'episodes/s':>10} {'scored 1':>8}"
    print(f"{'N':>3} | in-process, N at once: {side} | N replicas, N at once: {side}")
    for count in args.replicas:
        local = build_sandbox(
            environment, SandboxConfig(backend="bwrap", wall_seconds=WALL_SECONDS, max_concurrency=max(2, count))
        )
        assert isinstance(local, SandboxPool)
        with local:
            in_process = _measure(local, args.tasks_dir, args.episodes, count)
        with _replicas(count, args.per_replica) as urls:
            remote = SandboxConfig(backend="remote", wall_seconds=WALL_SECONDS, remote=RemoteConfig(urls=urls))
            fleet_pool = build_sandbox(environment, remote)
            assert isinstance(fleet_pool, RemoteSandboxPool)
            with fleet_pool:
                fleet = _measure(fleet_pool, args.tasks_dir, args.episodes, count)
        print(f"{count:>3} | {'':>22}{_cells(in_process)} | {'':>21}{_cells(fleet)}", flush=True)
        for side, row in (("in-process", in_process), ("fleet", fleet)):
            if row["errors"]:
                print(f"      {side}: {len(row['errors'])} episodes failed, the first: {row['errors'][0][:300]}")
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
