"""Code grader throughput, before and after the redesign, measured side by side in one run.

Run: .venv/bin/python benchmarks/code_grader.py [--problems 40] [--rounds 3]
Grades the canonical solutions of the first HumanEval problems with (and counts those that score 1.0):
- ``relay`` (now): the candidate in one sandbox behind a call interface, ``check`` in a second sandbox, plain
  values relayed by the host (`HumanEvalReward`);
- ``in-process`` (before): the grader of commit 1d5cfbc, read from git history: one sandbox per sample running
  pytest, the guard harness and the candidate in one process (skipped where git history is missing);
- ``one run``: the floor of a grader that runs ``program + test + check(...)`` in one sandbox and trusts the exit
  status (what HumanEval's own harness does; not safe, shown for the cost of one cold sandbox per sample).
All share one cold bwrap `Sandbox` configuration (prepared ahead). The rounds alternate between the graders, since
the machine is shared and noisy; the table shows the median round and the ratio to ``in-process``.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from sharpen.config.sandbox import SandboxConfig
from sharpen.data.humaneval import humaneval_examples
from sharpen.environments.sandbox import Sandbox
from sharpen.rewards.code_tests import HumanEvalReward, pytest_ro_binds
from sharpen.types import Example

BEFORE = "1d5cfbc"


def _old_grader_module(root: Path) -> ModuleType | None:
    """The pre-redesign code_tests module (with its harness beside it), from git history."""
    folder = Path(tempfile.mkdtemp(prefix="sharpen-old-grader-"))
    for name in ("code_tests.py", "code_harness.py"):
        shown = subprocess.run(
            ["git", "-C", str(root), "show", f"{BEFORE}:src/sharpen/rewards/{name}"], capture_output=True, text=True
        )
        if shown.returncode != 0:
            return None
        (folder / name).write_text(shown.stdout)
    spec = importlib.util.spec_from_file_location("old_code_tests", folder / "code_tests.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _completion(example: Example) -> str:
    return f"```python\n{example.metadata['prompt_code']}{example.metadata['canonical_solution']}```"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--problems", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    examples = humaneval_examples(limit=args.problems)
    config = SandboxConfig(backend="bwrap", wall_seconds=20.0, memory_mb=512, extra_ro_binds=pytest_ro_binds())
    old = _old_grader_module(Path(__file__).resolve().parents[1])
    with Sandbox(config) as sandbox:
        graders: dict[str, Callable[[Example], float | None]] = {}
        relay = HumanEvalReward(sandbox)
        graders["relay (now)"] = lambda example: relay(example, _completion(example)).score
        if old is not None:
            before = old.HumanEvalReward(sandbox)
            graders["in-process (before)"] = lambda example: before(example, _completion(example)).score

        def one_run(example: Example) -> float | None:
            metadata = example.metadata
            program = metadata["prompt_code"] + metadata["canonical_solution"]
            code = f"{program}\n\n{metadata['test']}\n\ncheck({metadata['entry_point']})\n"
            return 1.0 if str(sandbox.run_python(code).status) == "ok" else 0.0

        graders["one run (unsafe floor)"] = one_run
        rates: dict[str, list[float]] = {name: [] for name in graders}
        num_passed: dict[str, int] = {}
        for _ in range(args.rounds):
            for name, grade in graders.items():
                started = time.perf_counter()
                scores = [grade(example) for example in examples]
                rates[name].append(len(examples) / (time.perf_counter() - started))
                num_passed[name] = scores.count(1.0)
    base = statistics.median(rates["in-process (before)"]) if old is not None else None
    print(f"HumanEval canonical solutions, {len(examples)} problems, median of {args.rounds} rounds")
    print(f"{'grader':<26}{'graded/s':>10}{'vs before':>11}{'canonical = 1.0':>17}")
    for name, values in rates.items():
        rate = statistics.median(values)
        ratio = f"{rate / base:.2f}x" if base else "-"
        print(f"{name:<26}{rate:>10.1f}{ratio:>11}{num_passed[name]:>11}/{len(examples)}")
    if old is None:
        print(f"(the before column needs git history with commit {BEFORE})")


if __name__ == "__main__":
    main()
