"""Throughput of the code sandbox beside bare process spawns, measured in one run, interleaved.

Run: .venv/bin/python benchmarks/sandbox.py [--seconds 2] [--rounds 5]
Prints executions per second of: a bare `python3 -I -S -c pass` spawn; the same command in a cold bwrap sandbox
(`Sandbox.run`: fresh namespaces, cgroups, work dir and cleanup each time), with and without preparing the next
sandbox while one runs; and a warm pool job (`SandboxPool` with warm_workers: `run_python("pass")` forked in a
long-lived sandbox). Each is measured one at a time and two at a
time (this machine has 2 cores); the rounds alternate between them because the machine is shared and noisy, and
the table shows the median round. The goal for cold sandboxing is at least 0.8 of bare.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from sharpen.config.sandbox import SandboxConfig
from sharpen.environments.sandbox import ExecutionResult, ExecutionStatus, Sandbox, SandboxPool

BARE = ["/usr/bin/python3", "-I", "-S", "-c", "pass"]


def _rate(batch: Callable[[], None], *, jobs_per_batch: int, seconds: float) -> float:
    """Jobs per second over about ``seconds`` of back-to-back batches."""
    done = 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        batch()
        done += jobs_per_batch
    return done / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=2.0, help="length of one measurement")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    config = SandboxConfig(backend="bwrap", max_concurrency=2, warm_workers=True)
    sandbox = Sandbox(config)
    unprepared = Sandbox(config.model_copy(update={"prepare_ahead": False}))
    pool = SandboxPool(config)
    loop = asyncio.new_event_loop()

    def bare() -> None:
        subprocess.run(BARE, check=True)

    def cold() -> None:
        assert sandbox.run(BARE).status == ExecutionStatus.OK

    def cold_unprepared() -> None:
        assert unprepared.run(BARE).status == ExecutionStatus.OK

    def warm() -> None:
        assert loop.run_until_complete(pool.run_python("pass")).status == ExecutionStatus.OK

    async def two_warm() -> tuple[ExecutionResult, ExecutionResult]:
        return await asyncio.gather(pool.run_python("pass"), pool.run_python("pass"))

    def warm_pair() -> None:  # two jobs in flight through the pool's own bounded concurrency
        assert all(r.status == ExecutionStatus.OK for r in loop.run_until_complete(two_warm()))

    threads = ThreadPoolExecutor(2)

    def pair_of(job: Callable[[], None]) -> Callable[[], None]:
        def two() -> None:
            for future in [threads.submit(job), threads.submit(job)]:
                future.result()

        return two

    kinds = {
        "bare python3 -I -S -c pass": (bare, pair_of(bare)),
        "sandboxed, cold (bwrap)": (cold, pair_of(cold)),
        "  same, not prepared ahead": (cold_unprepared, pair_of(cold_unprepared)),
        "sandboxed, warm pool": (warm, warm_pair),
    }
    rates: dict[tuple[str, int], list[float]] = {(name, n): [] for name in kinds for n in (1, 2)}
    try:
        for _ in range(args.rounds):
            for name, (one, two) in kinds.items():
                rates[name, 1].append(_rate(one, jobs_per_batch=1, seconds=args.seconds))
                rates[name, 2].append(_rate(two, jobs_per_batch=2, seconds=args.seconds))
    finally:
        threads.shutdown()
        pool.close()
        sandbox.close()
        unprepared.close()
        loop.close()
    median = {key: statistics.median(values) for key, values in rates.items()}
    print(f"sandbox report: {sandbox.report}")
    print(f"{'executions per second (ms each)':32s} {'1 at a time':>20s} {'2 at a time':>20s}")
    for name in kinds:
        cells = [f"{median[name, p]:8.1f}/s ({1000 * p / median[name, p]:5.1f} ms)" for p in (1, 2)]
        print(f"{name:32s} {cells[0]:>20s} {cells[1]:>20s}")
    bare_name, cold_name, _, warm_name = kinds
    for label, name in (("cold / bare", cold_name), ("warm / bare", warm_name)):
        ratios = [median[name, p] / median[bare_name, p] for p in (1, 2)]
        print(f"{'ratio ' + label:32s} {ratios[0]:20.2f} {ratios[1]:20.2f}")
    print("goal: cold / bare >= 0.8")


if __name__ == "__main__":
    main()
