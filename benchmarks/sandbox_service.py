"""Load test of `sharpen serve-sandbox` on loopback: executions/s and p99 latency per replica count, and a replica
killed mid-run.

Run: .venv/bin/python benchmarks/sandbox_service.py [--replicas 1,2,4] [--executions 120] [--clients 8] [--warm]
Each replica is `sharpen serve-sandbox` in its own process (bwrap, ``--per-replica`` executions at once) on a free
loopback port. Client threads send short Python programs through `RemoteSandbox` (sandbox.backend = "remote"),
which spreads them over the replicas. The last column runs the largest count again and SIGKILLs one replica once a
third of the executions are done: every execution must still return exactly one result, its own (lost and wrong
must be 0). Bounded: ``--executions`` per run, and each run stops waiting after ``--max-seconds``.

On a 2-core host the replicas share the cores, so more replicas add fault tolerance and queue room, not speed;
the numbers are honest about that.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait

from sharpen.config.sandbox import SandboxConfig
from sharpen.environments.sandbox import ExecutionStatus
from sharpen.environments.sandbox.remote import RemoteSandbox

PROGRAM = "import sys; sum(range(20000)); print('exec-{}')"


def _start(count: int, args: argparse.Namespace) -> list[tuple[subprocess.Popen[str], str]]:
    settings = ["sandbox.backend=bwrap", f"sandbox.max_concurrency={args.per_replica}"]
    settings += [f"sandbox.warm_workers={'true' if args.warm else 'false'}", "sandbox.service.max_queue_size=16"]
    command = [sys.executable, "-m", "sharpen.cli.main", "serve-sandbox", "--port", "0", *settings]
    started = []
    for _ in range(count):
        server = subprocess.Popen(
            command, stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
        assert server.stdout is not None
        line = server.stdout.readline()
        if " at http://" not in line:
            raise SystemExit(f"replica did not start: {line!r}")
        started.append((server, line.rsplit(" at ", 1)[1].strip()))
    return started


def _stop(replicas: list[tuple[subprocess.Popen[str], str]]) -> None:
    for server, _ in replicas:
        if server.poll() is None:
            server.terminate()
    for server, _ in replicas:
        server.wait(timeout=30)


def _run(count: int, args: argparse.Namespace, *, kill: bool) -> dict[str, float]:
    replicas = _start(count, args)
    config = SandboxConfig(backend="remote", remote={"urls": [url for _, url in replicas], "max_retries": 30})
    latencies: list[float] = []
    lock = threading.Lock()
    num_done = [0]

    def one(index: int) -> tuple[int, object]:
        started = time.perf_counter()
        result = remote.run_python(PROGRAM.format(index))
        with lock:
            latencies.append(time.perf_counter() - started)
            num_done[0] += 1
        return index, result

    try:
        with RemoteSandbox(config) as remote, ThreadPoolExecutor(max_workers=args.clients) as threads:
            for index in range(2 * count):  # warm-up: each replica's first sandboxes
                remote.run_python(PROGRAM.format(index))
            started = time.perf_counter()
            futures = [threads.submit(one, i) for i in range(args.executions)]
            if kill:
                while num_done[0] < args.executions // 3 and time.perf_counter() - started < args.max_seconds:
                    time.sleep(0.005)
                replicas[0][0].send_signal(signal.SIGKILL)
            done, _ = wait(futures, timeout=args.max_seconds)
            wall = time.perf_counter() - started
        results = dict(future.result() for future in done)
    finally:
        _stop(replicas)
    num_wrong = sum(
        1
        for i, r in results.items()
        if r.status != ExecutionStatus.OK or r.stdout != f"exec-{i}\n"  # type: ignore[attr-defined]
    )
    return {
        "executions/s": len(results) / wall,
        "p50 ms": statistics.median(latencies) * 1000,
        "p99 ms": statistics.quantiles(latencies, n=100)[98] * 1000,
        "lost": args.executions - len(results),
        "wrong": num_wrong,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replicas", default="1,2,4", help="replica counts to compare")
    parser.add_argument("--executions", type=int, default=120, help="executions per run")
    parser.add_argument("--clients", type=int, default=8, help="client threads (calls in flight)")
    parser.add_argument("--per-replica", type=int, default=2, help="sandbox.max_concurrency of each replica")
    parser.add_argument("--warm", action="store_true", help="replicas keep warm workers (sandbox.warm_workers)")
    parser.add_argument("--max-seconds", type=float, default=120.0, help="longest a run waits for its executions")
    args = parser.parse_args()
    os.environ.setdefault("SHARPEN_SERVICE_TOKEN", "benchmark-token")

    counts = [int(c) for c in args.replicas.split(",")]
    columns = {f"{n} replica{'s' * (n > 1)}": _run(n, args, kill=False) for n in counts}
    if max(counts) > 1:  # a kill with one replica would take the whole service down: nothing to fail over to
        columns[f"{max(counts)}, one killed"] = _run(max(counts), args, kill=True)
    mode = "warm workers" if args.warm else "cold sandboxes"
    shape = f"{args.executions} executions, {args.clients} clients, {args.per_replica} per replica, {mode}"
    print(f"cpus: {os.cpu_count()}; {shape}")
    print(f"{'':>14}" + "".join(f"{name:>20}" for name in columns))
    for row in ("executions/s", "p50 ms", "p99 ms", "lost", "wrong"):
        print(f"{row:>14}" + "".join(f"{values[row]:>20.1f}" for values in columns.values()))


if __name__ == "__main__":
    main()
