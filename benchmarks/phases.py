"""Time per phase (generate / score / train / sync) and peak memory of a run, from its metrics.jsonl.

Run a recipe first (e.g. `make demo`), then: .venv/bin/python benchmarks/phases.py runs/demo
Prints each phase's median seconds per step and its share of the step, side by side, plus peak RSS.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

PHASES = ("generate", "score", "train", "sync")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args()
    rows = [json.loads(line) for line in (args.run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if not rows:
        raise SystemExit(f"{args.run_dir}/metrics.jsonl has no steps")
    step = statistics.median(r["time/step"] for r in rows)
    print(f"{len(rows)} steps, median {step:.1f} s/step")
    for phase in PHASES:
        seconds = statistics.median(r.get(f"time/{phase}", 0.0) for r in rows)
        print(f"  {phase:<9} {seconds:7.2f} s  {seconds / step:6.1%}")
    sync = [r["sync/seconds"] for r in rows if "sync/seconds" in r]
    if sync:
        print(f"  weight sync alone: median {statistics.median(sync):.2f} s")
    print(f"peak RSS of the trainer process: {max(r.get('memory/peak_rss_gib', 0.0) for r in rows):.2f} GiB")
    tokens = statistics.median(r["throughput/tokens_per_second"] for r in rows)
    print(f"throughput: median {tokens:.0f} tokens/s (prompt + completion tokens per step / step time)")


if __name__ == "__main__":
    main()
