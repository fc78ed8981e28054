"""Throughput of the browser environment: resets and steps per second with pools of 1 and 2 browsers, and what the
isolation of episodes costs a reset.

Run: .venv/bin/python benchmarks/browser.py [--seconds 3] [--rounds 3] [--task click-test-2]
A reset wipes the browser (`isolation.wipe_browser`: what the last episode left in it), loads the task page, draws
a new seeded task instance and reads the page; a step is one ``scroll`` tool call (it never ends
the task) plus reading the outcome and the page, as an episode turn does. Beside the pools that isolate episodes,
the same rounds measure a pool of 1 that reuses its browser as the last episode left it (``isolate_episodes=False``:
no wipe, and the loaded page is reused, as before the wipe existed) and a fresh profile per episode (a new browser
started, its task page loaded and the browser killed). ``concurrent``
episodes run at once (as many as the pool has browsers), each on its own asyncio task, so a pool of 2 on 2 cores
shows how far the browsers run in parallel. The rounds alternate between the pool sizes (the machine is shared and
noisy); the table shows the median round, per pool and per core (the rate divided by min(pool, cores)).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

from sharpen.environments.base import EpisodeContext
from sharpen.environments.browser import BrowserEnvironment, BrowserPool
from sharpen.environments.browser.page import start_task, task_url
from sharpen.environments.browser.pool import start_browser
from sharpen.types import Example

CONTEXT = EpisodeContext(seed=0, sample_index=0, max_turns=1 << 20, max_tokens=1 << 30)


async def _resets(pool: BrowserPool, examples: list[Example], seconds: float) -> float:
    done = 0

    async def worker(index: int) -> None:
        nonlocal done
        environment = BrowserEnvironment(pool=pool)
        while time.perf_counter() < deadline:
            await environment.reset(examples[(done + index) % len(examples)], CONTEXT)
            done += 1

    started = time.perf_counter()
    deadline = started + seconds
    await asyncio.gather(*(worker(i) for i in range(pool.size)))
    return done / (time.perf_counter() - started)


async def _steps(pool: BrowserPool, example: Example, action: str, seconds: float) -> float:
    done = 0

    async def worker() -> None:
        nonlocal done
        environment = BrowserEnvironment(pool=pool)
        await environment.reset(example, CONTEXT)
        while time.perf_counter() < deadline:
            result = await environment.step(action)
            assert not result.terminated, "the benchmark's action must not end the task"
            done += 1

    deadline = time.perf_counter() + seconds
    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(pool.size)))
    return done / (time.perf_counter() - started)


def _fresh_profiles(example: Example, num_episodes: int) -> float:
    """Episodes per second when each gets a browser of its own: started, its task shown, killed."""
    url = task_url(str(example.metadata["task"]))
    started = time.perf_counter()
    for _ in range(num_episodes):
        browser = start_browser(chromium="chromium", chromedriver="chromedriver", js_heap_mb=256)
        try:
            start_task(browser.driver, url, int(example.metadata["seed"]))
        finally:
            browser.kill()
    return num_episodes / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=3.0, help="length of one measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--task", default="click-button")
    args = parser.parse_args()

    examples = BrowserEnvironment.make_tasks(16, seed=0, tasks=[args.task])
    # a real action (a wheel event on the page) that never ends a click task, so one episode takes many steps
    action = '<tool_call>{"name": "scroll", "arguments": {"dx": 0, "dy": 1}}</tool_call>'
    sizes = (1, 2)
    pools = {size: BrowserPool(size=size) for size in sizes}
    reused = BrowserPool(size=1, isolate_episodes=False)
    results: dict[int, dict[str, list[float]]] = {size: {"resets": [], "steps": []} for size in sizes}
    baseline: dict[str, list[float]] = {"reused": [], "fresh": []}
    try:
        for pool in (*pools.values(), reused):  # warm-up: start the browsers, load the task page
            asyncio.run(_resets(pool, examples, 0.5))
        for _ in range(args.rounds):
            for size, pool in pools.items():
                results[size]["resets"].append(asyncio.run(_resets(pool, examples, args.seconds)))
                results[size]["steps"].append(asyncio.run(_steps(pool, examples[0], action, args.seconds)))
            baseline["reused"].append(asyncio.run(_resets(reused, examples, args.seconds)))
            baseline["fresh"].append(_fresh_profiles(examples[0], num_episodes=3))
    finally:
        for pool in (*pools.values(), reused):
            pool.close()

    cores = os.cpu_count() or 1
    print(f"browser environment, task {args.task}, median of {args.rounds} rounds of {args.seconds:g} s")
    print(f"{'pool':>5} {'resets/s':>10} {'steps/s':>10} {'resets/s/core':>14} {'steps/s/core':>13}")
    base = {kind: statistics.median(results[1][kind]) for kind in ("resets", "steps")}
    for size in sizes:
        resets, steps = (statistics.median(results[size][kind]) for kind in ("resets", "steps"))
        per_core = min(size, cores)
        print(f"{size:>5} {resets:>10.1f} {steps:>10.1f} {resets / per_core:>14.1f} {steps / per_core:>13.1f}")
    two = {kind: statistics.median(results[2][kind]) / base[kind] for kind in ("resets", "steps")}
    print(f"pool 2 / pool 1: resets {two['resets']:.2f}x, steps {two['steps']:.2f}x")
    print("reset of one episode on a pool of 1 (median rate; its inverse):")
    rows = {"isolated (wipe, reload the page)": base["resets"]}
    rows |= {"reused as left (no isolation)": statistics.median(baseline["reused"])}
    rows |= {"fresh profile (a new browser)": statistics.median(baseline["fresh"])}
    for name, rate in rows.items():
        print(f"  {name:<34} {rate:>8.1f} resets/s {1000 / rate:>8.1f} ms")


if __name__ == "__main__":
    main()
