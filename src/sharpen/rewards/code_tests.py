"""Code-test rewards that resist reward hacking: `CodeTestReward` (function cases or pytest files) and
`HumanEvalReward` (a HumanEval problem's ``check(candidate)``), both `RewardFn`s.

Owns extracting the program from a completion, building the run (our harness `code_harness.py` as ``main.py``,
the candidate as ``solution.py``, test files copied fresh from the verifier's in-memory copy for every run), and
turning what came back into a `RewardResult`. Success is "the per-run sentinel is in stdout AND every expected
output matches", never the exit code. A flagged rollout scores 0 and carries its ``hack_flags``; what to do with
flagged rollouts beyond that (screen, penalise) is the hack monitor's decision, not ours.

Statuses: ``ok`` 1.0; ``wrong`` 0.0 (``fraction_passed`` as a component); ``format_error`` 0.0 (no fenced
python block); ``timeout`` 0.0 (the program hung or spun: the policy's fault, so it is scored, not abstained);
``infra_error`` None (the sandbox failed: abstain, never 0).

Does not import the sandbox (rewards sit below environments): the caller passes any `CodeRunner`, normally a
`sharpen.environments.sandbox.Sandbox` whose config binds pytest read-only (`pytest_ro_binds`) when test files
are used. Test files must wrap the candidate with ``_sharpen_guard.guarded`` for the always-equal check.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from sharpen.types import Example, RewardResult, RewardStatus

VERSION = "1"
PYTEST_PATH = "/opt/sharpen-pytest"
"""Where `pytest_ro_binds` makes pytest and its dependencies visible inside the sandbox."""
_PYTEST_PACKAGES = ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "pygments", "py")
_HARNESS = (Path(__file__).with_name("code_harness.py")).read_text()
_FENCE = re.compile(r"```(?:python|py|python3)[ \t]*\n(.*?)```", re.DOTALL)


class CodeRunner(Protocol):
    """Runs Python code in isolation (a `Sandbox` fits): ``code`` as ``main.py`` with ``files`` beside it. The result
    (an `ExecutionResult`) is read for its ``status`` (compared by its string value), ``stdout`` and ``stderr``."""

    def run_python(self, code: str, *, files: Mapping[str, str | bytes] = ..., stdin: str | bytes = "") -> Any: ...


def pytest_ro_binds(dest: str = PYTEST_PATH) -> list[str]:
    """``extra_ro_binds`` entries that show this interpreter's pytest (and its dependencies) at ``dest``: the
    sandbox's /usr/bin/python3 has no pytest of its own."""
    binds = []
    for name in _PYTEST_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            continue  # optional ones (pygments, the py shim) may be missing
        path = Path(spec.origin)
        source = path.parent if path.name == "__init__.py" else path
        binds.append(f"{source}:{dest}/{source.name}")
    return binds


def extract_program(completion: str) -> str | None:
    """The last fenced python block of the completion, or None when there is none."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else None


class CodeTestReward:
    """Scores a completion's last fenced python block against ``example.metadata``: ``cases`` (a list of
    ``{"args": [...], "expected": ...}`` or ``{"call": "f(1)", "expected": ...}``, with ``entry_point``) or
    ``test_files`` (name -> pytest source). ``runner`` runs the harness (a `Sandbox`)."""

    name = "code_tests"

    def __init__(self, runner: CodeRunner, *, pytest_path: str = PYTEST_PATH) -> None:
        self.runner = runner
        self.pytest_path = pytest_path

    def __call__(self, example: Example, completion: str) -> RewardResult:
        program = extract_program(completion)
        if program is None:
            return self._result(example, completion, score=0.0, status=RewardStatus.FORMAT_ERROR, fmt=0.0)
        return self.score_program(example, completion, program)

    def score_program(
        self, example: Example, completion: str, program: str, *, test_files: Mapping[str, str] | None = None
    ) -> RewardResult:
        """Runs ``program`` under the harness; ``test_files`` overrides ``metadata["test_files"]``."""
        metadata = example.metadata
        test_files = dict(test_files if test_files is not None else metadata.get("test_files", {}))
        cases: list[dict[str, Any]] = list(metadata.get("cases", []))
        if not cases and not test_files:
            raise ValueError(f"CodeTestReward: example {example.task_key} has neither 'cases' nor 'test_files'")
        sentinel, flag_token = secrets.token_hex(16), secrets.token_hex(16)
        spec: dict[str, Any] = {"sentinel": sentinel, "flag_token": flag_token, "pytest_path": self.pytest_path}
        if cases:
            runnable = [{k: v for k, v in case.items() if k != "expected"} for case in cases]  # expected stays here
            spec |= {"mode": "cases", "cases": runnable, "entry_point": metadata.get("entry_point")}
        else:
            digests = {name: hashlib.sha256(source.encode()).hexdigest() for name, source in test_files.items()}
            spec |= {"mode": "pytest", "test_files": digests}
        outcome = self.runner.run_python(_HARNESS, files={**test_files, "solution.py": program}, stdin=json.dumps(spec))
        return self._judge(example, completion, outcome, cases, sentinel=sentinel, flag_token=flag_token)

    def _judge(
        self, example: Example, completion: str, outcome: Any, cases: list[dict[str, Any]], *, sentinel: str,
        flag_token: str,
    ) -> RewardResult:  # fmt: skip
        status = str(outcome.status)
        if status == "sandbox_error":
            return self._result(example, completion, score=None, status=RewardStatus.INFRA_ERROR)
        flags = [line.split(" ")[1] for line in outcome.stderr.splitlines() if line.startswith(flag_token + " ")]
        reports = [line[len(sentinel) + 1 :] for line in outcome.stdout.splitlines() if line.startswith(sentinel + " ")]
        if len(reports) > 1:
            flags.append("grader_patched")  # a second report line can only be forged
        report: dict[str, Any] = json.loads(reports[-1]) if reports else {}
        if "harness_error" in report:  # e.g. pytest not bound into the sandbox: abstain, as for a sandbox error
            return self._result(example, completion, score=None, status=RewardStatus.INFRA_ERROR)
        flags += report.get("flags", [])
        if not reports and status == "ok":
            flags.append("exit_before_asserts")  # exited 0 without getting to the end of the harness
        fraction = _fraction_passed(report, cases) if reports else 0.0
        flags = sorted(set(flags))
        if status == "timeout":
            return self._result(example, completion, score=0.0, status=RewardStatus.TIMEOUT, flags=flags)
        is_ok = fraction == 1.0 and not flags
        return self._result(
            example,
            completion,
            score=1.0 if is_ok else 0.0,
            status=RewardStatus.OK if is_ok else RewardStatus.WRONG,
            flags=flags,
            fraction=fraction,
        )

    def _result(
        self, example: Example, completion: str, *, score: float | None, status: RewardStatus, fmt: float = 1.0,
        flags: list[str] | None = None, fraction: float = 0.0,
    ) -> RewardResult:  # fmt: skip
        components = {"format": fmt}
        if score is not None:
            components |= {"correct": score, "fraction_passed": fraction}
        key = hashlib.sha256(f"{self.name}\0{VERSION}\0{example.task_hash}\0{completion}".encode()).hexdigest()
        return RewardResult(
            score=score,
            status=status,
            components=components,
            verifier=self.name,
            verifier_version=VERSION,
            hack_flags=flags or [],
            cache_key=key[:32],
        )


def _fraction_passed(report: dict[str, Any], cases: list[dict[str, Any]]) -> float:
    if not cases:  # pytest mode: all tests passed and pytest returned 0, or nothing counts
        is_passed = report.get("pytest_exit_code") == 0 and report.get("failed") == 0 and report.get("passed", 0) > 0
        return 1.0 if is_passed else 0.0
    results = report.get("results", [])
    if len(results) != len(cases):
        return 0.0  # the import failed or the run was cut short
    num_passed = sum(_matches(result, case["expected"]) for result, case in zip(results, cases, strict=True))
    return num_passed / len(cases)


def _matches(result: dict[str, str], expected: Any) -> bool:
    if "value" not in result:
        return False
    # Compare through JSON on both sides: tuples and lists alike, and only primitives ever compared.
    return json.loads(result["value"]) == json.loads(json.dumps(expected))


def humaneval_test_file(test: str, entry_point: str) -> str:
    """A pytest file for a HumanEval problem: its ``check`` against the guarded candidate."""
    return (
        "from _sharpen_guard import guarded\n"
        f"from solution import {entry_point} as _candidate\n"
        f"{test}\n\n"
        "def test_check():\n"
        "    check(guarded(_candidate))\n"
    )


class HumanEvalReward:
    """A HumanEval problem (``metadata``: ``prompt_code``, ``entry_point``, ``test``) run under the harness with
    pytest. The completion either continues the prompt's function (no fence) or gives a fenced block (which may
    redefine the whole function: the prompt's imports stay, the later ``def`` wins)."""

    name = "humaneval"

    def __init__(self, runner: CodeRunner, *, pytest_path: str = PYTEST_PATH) -> None:
        self._reward = CodeTestReward(runner, pytest_path=pytest_path)
        self._reward.name = self.name

    def __call__(self, example: Example, completion: str) -> RewardResult:
        metadata = example.metadata
        block = extract_program(completion)
        prompt_code = metadata["prompt_code"]
        program = prompt_code + completion if block is None else f"{prompt_code}\n\n{block}"
        test_file = humaneval_test_file(metadata["test"], metadata["entry_point"])
        return self._reward.score_program(example, completion, program, test_files={"test_solution.py": test_file})
