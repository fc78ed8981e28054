"""Memory of colocated training and inference, side by side in one run: the same recipe with and without
``runtime.colocate``, each in its own process, reporting the process's peak resident memory and seconds per step.

On this CPU machine both the trainer and the transformers (``hf``) engine live in the one process, so what the
sleeping engine gives back (its whole copy of the weights) shows in the process's peak memory when the training
step is the peak. (vLLM's sleep mode needs a GPU; there the same switch frees the engine's weights and KV cache on
the device: `benchmarks/gpu_check.sh`.)

    .venv/bin/python benchmarks/colocate_memory.py [--steps 3] [--recipe recipes/demo.toml]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

GIB = 1 << 30


def run_once(recipe: Path, out: Path, *, colocate: bool, steps: int) -> dict[str, float]:
    """One run in a fresh process (peak RSS is per process); the numbers from its metrics."""
    name = "colocated" if colocate else "separate"
    overrides = [
        f"run.output_dir={json.dumps(str(out))}",
        f'run.name="{name}"',
        f"run.num_steps={steps}",
        "run.export_model=false",
        'rollout.engine.type="hf"',
        f"runtime.colocate={'true' if colocate else 'false'}",
        "monitoring.progress=false",
        "monitoring.parity_probe_every=0",
    ]
    code = (
        "import sys, json; from pathlib import Path; from sharpen.config import load_config; "
        "from sharpen.orchestration.embedded import run_embedded; "
        "print(run_embedded(load_config(Path(sys.argv[1]), json.loads(sys.argv[2]))))"
    )
    subprocess.run([sys.executable, "-c", code, str(recipe), json.dumps(overrides)], check=True)
    from sharpen.monitoring import read_jsonl

    rows = read_jsonl(out / name / "metrics.jsonl")
    return {
        "peak_rss_gib": max(row["memory/peak_rss_gib"] for row in rows),
        "seconds_per_step": statistics.median(row["time/step"] for row in rows[1:] or rows),
        "freed_gib": rows[-1].get("colocate/freed_bytes", 0.0) / GIB,
        "sleep_wake_seconds": statistics.median(row.get("time/sleep", 0.0) + row.get("time/wake", 0.0) for row in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", type=Path, default=Path(__file__).parents[1] / "recipes" / "demo.toml")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        separate = run_once(args.recipe, Path(tmp), colocate=False, steps=args.steps)
        colocated = run_once(args.recipe, Path(tmp), colocate=True, steps=args.steps)
    print(f"{'':>10} {'peak RSS GiB':>13} {'s/step':>8} {'freed GiB':>10} {'sleep+wake s':>13}")
    for name, row in (("separate", separate), ("colocated", colocated)):
        print(
            f"{name:>10} {row['peak_rss_gib']:>13.3f} {row['seconds_per_step']:>8.2f} {row['freed_gib']:>10.3f} "
            f"{row['sleep_wake_seconds']:>13.3f}"
        )
    saved = separate["peak_rss_gib"] - colocated["peak_rss_gib"]
    print(
        f"colocated peak RSS: {colocated['peak_rss_gib'] / separate['peak_rss_gib']:.2f}x of separate "
        f"({saved:+.3f} GiB saved); s/step {colocated['seconds_per_step'] / separate['seconds_per_step']:.2f}x"
    )


if __name__ == "__main__":
    main()
