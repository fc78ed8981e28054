"""Code-test rewards whose verdict never runs beside candidate code: `CodeTestReward` (function cases, pytest files,
stdin/stdout cases) and `HumanEvalReward` (a HumanEval problem's ``check(candidate)``), both `RewardFn`s.

Owns finding the program in a completion and turning a grading's `Verdict` (code_grading.py) into a
`RewardResult`. The candidate runs in its own sandbox behind a call interface; the tests and expected values stay
in a process it cannot reach (this one for function cases and stdin/stdout cases, a second sandbox for pytest
files and HumanEval checks); only plain values cross, and the trusted side compares them.

Statuses: ``ok`` 1.0; ``wrong`` 0.0 (``fraction_passed`` as a component); ``format_error`` 0.0 (no code block);
``timeout`` 0.0 (the program hung or spun: the policy's fault, so it is scored, never abstained); ``infra_error``
None only for what the policy cannot cause (a sandbox that did not start, tests that cannot run as given).
A flagged rollout scores 0 and carries its ``hack_flags``; what to do with it beyond that (screen, penalise) is
the hack monitor's decision.

Does not import the sandbox (rewards sit below environments): the caller passes any `CodeRunner`, normally a
`sharpen.environments.sandbox.Sandbox`, whose config binds pytest read-only (`pytest_ro_binds`) when pytest files
are used (pytest runs in the checker's sandbox only).
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import re
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from sharpen.rewards.code_grading import (
    CodeRunner,
    Verdict,
    case_call,
    grade_cases,
    grade_with_checker,
    is_program_started,
)
from sharpen.types import Example, RewardResult, RewardStatus

__all__ = ["CodeRunner", "CodeTestReward", "HumanEvalReward", "extract_program", "pytest_ro_binds", "required_names"]

VERSION = "3"  # 3: the block that defines the tested names is graded; cases compare in JSON's types
PYTEST_PATH = "/opt/sharpen-pytest"
"""Where `pytest_ro_binds` makes pytest and its dependencies visible inside the sandbox."""
_PYTEST_PACKAGES = ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "pygments", "py")
_FENCE_OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^\n]*)$")
_PYTHON_LANGUAGES = {"python", "py", "python3", "py3", "pycode", "python-3", "sage"}
_OUTCOME_STATUS = {
    "ok": RewardStatus.OK,
    "wrong": RewardStatus.WRONG,
    "timeout": RewardStatus.TIMEOUT,
    "infra_error": RewardStatus.INFRA_ERROR,
}


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


def _language(info: str) -> str:
    """The language of a fence's info string: ``python``, ``{python}``, ``{.python}``, ``Python title="a.py"``,
    ``python:solution.py``..."""
    word = info.strip().split(maxsplit=1)[0] if info.strip() else ""
    return re.split(r"[:,;]", word.strip("{}").lstrip("."), maxsplit=1)[0].lower()


def _code_blocks(completion: str) -> list[tuple[str, str]]:
    """Every fenced block as (language, code), in order; an unclosed fence runs to the end. A block indented (in
    a list item, say) loses the fence's indentation."""
    blocks, lines, i = [], completion.split("\n"), 0
    while i < len(lines):
        opening = _FENCE_OPEN.match(lines[i].rstrip("\r"))
        i += 1
        if opening is None or (opening["fence"][0] == "`" and "`" in opening["info"]):
            continue
        indent, fence, body, is_closed = opening["indent"], opening["fence"], [], False
        while i < len(lines) and not is_closed:
            line = lines[i].rstrip("\r")
            i += 1
            stripped = line.strip()
            is_closed = stripped.startswith(fence[0] * len(fence)) and not stripped.strip(fence[0])
            if not is_closed:
                body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
        if not is_closed and body and not body[-1]:
            body.pop()  # the completion's final newline
        blocks.append((_language(opening["info"]), "\n".join(body) + "\n"))
    return blocks


def extract_program(completion: str, *, required_names: Collection[str] = ()) -> str | None:
    """The program to grade: the last fenced Python block of the completion (any common spelling: ```python, ```py,
    ```Python3, ~~~python, ```{python}, an indented fence), else the last unlabelled block; None when there is neither.

    With ``required_names`` (the functions the tests call, `required_names`), the last block of that kind that
    defines them all at its top level wins, so a correct solution followed by a usage example (```python
    print(add(1, 2))```) is graded by its solution. One block is graded, never several joined: a later block cannot
    patch an earlier one, and an example's top-level code never runs. A block that defines none of them all (or
    does not parse) is skipped; when none does, the last block is graded as before (and fails its tests)."""
    blocks = _code_blocks(completion)
    for wanted in (lambda lang: lang in _PYTHON_LANGUAGES, lambda lang: lang == ""):
        chosen = [code for language, code in blocks if wanted(language)]
        if chosen:
            defining = [code for code in chosen if set(required_names) <= _top_level_names(code)]
            return defining[-1] if defining else chosen[-1]
    return None


def required_names(metadata: Mapping[str, Any]) -> frozenset[str]:
    """The names a program must define for ``metadata``'s tests: the functions its cases call, the names its pytest
    files import from ``solution`` (``from solution import f`` or ``solution.f``), HumanEval's ``entry_point``; empty
    for stdin/stdout cases. A case that is not a plain call is the dataset's error (`case_call` says so)."""
    if metadata.get("cases"):
        entry_point = metadata.get("entry_point")
        return frozenset(case_call(case, entry_point)[0] for case in metadata["cases"])
    if metadata.get("test_files"):
        return frozenset(name for source in dict(metadata["test_files"]).values() for name in _solution_imports(source))
    if metadata.get("prompt_code") and metadata.get("entry_point"):
        return frozenset([str(metadata["entry_point"])])
    return frozenset()


def _top_level_names(code: str) -> set[str]:
    """Names bound at the top level of ``code`` (def, class, assignment, import); empty when it does not parse."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return set()
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return names


def _solution_imports(source: str) -> set[str]:
    """What a pytest file takes from the ``solution`` module; empty when it does not parse (the checker says so)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return set()
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "solution":
            names.update(alias.name for alias in node.names if alias.name != "*")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "solution":
            names.add(node.attr)
    return names


def _normalised_output(text: str) -> str:
    """Output as compared: trailing spaces of each line and trailing blank lines do not count."""
    return "\n".join(line.rstrip() for line in text.replace("\r\n", "\n").split("\n")).rstrip("\n")


class CodeTestReward:
    """Scores the completion's program (`extract_program`: the last fenced Python block that defines the tested
    names) against ``example.metadata``: ``cases`` (a list of ``{"args": [...], "expected": ...}`` or ``{"call":
    "f(1)", "expected": ...}``, with ``entry_point``; results compared by `code_compare.matches_expected`),
    ``test_files`` (name -> pytest source, run in the checker's sandbox against the candidate's functions), or
    ``io_cases`` (``{"stdin": ..., "stdout": ...}``: the program run on stdin, its stdout compared here).
    ``runner`` runs the programs (a `Sandbox`); ``wall_seconds`` is its wall clock (the relay's bound)."""

    name = "code_tests"

    def __init__(
        self, runner: CodeRunner, *, pytest_path: str = PYTEST_PATH, wall_seconds: float | None = None
    ) -> None:
        self.runner = runner
        self.pytest_path = pytest_path
        config = getattr(runner, "config", None)
        self.wall_seconds = wall_seconds or float(getattr(config, "wall_seconds", 10.0))

    def __call__(self, example: Example, completion: str) -> RewardResult:
        program = extract_program(completion, required_names=required_names(example.metadata))
        if program is None:
            return self._result(example, completion, Verdict(outcome="wrong"), status=RewardStatus.FORMAT_ERROR)
        return self.score_program(example, completion, program)

    def score_program(self, example: Example, completion: str, program: str) -> RewardResult:
        metadata = example.metadata
        if metadata.get("cases"):
            verdict = grade_cases(
                self.runner,
                program,
                list(metadata["cases"]),
                entry_point=metadata.get("entry_point"),
                wall_seconds=self.wall_seconds,
            )
        elif metadata.get("test_files"):
            spec = {"mode": "pytest", "pytest_path": self.pytest_path}
            verdict = grade_with_checker(
                self.runner, program, spec, test_files=dict(metadata["test_files"]), wall_seconds=self.wall_seconds
            )
        elif metadata.get("io_cases"):
            verdict = self._grade_io(program, list(metadata["io_cases"]))
        else:
            raise ValueError(
                f"{type(self).__name__}: example {example.task_key} has none of 'cases', 'test_files', 'io_cases'"
            )
        return self._result(example, completion, verdict)

    def _grade_io(self, program: str, cases: list[Mapping[str, Any]]) -> Verdict:
        num_passed, is_timed_out, is_crashed = 0, False, False
        for case in cases:
            if not isinstance(case.get("stdin", ""), str) or not isinstance(case.get("stdout"), str):
                raise ValueError("an io case is {'stdin': str, 'stdout': str}")
            result = self.runner.run_python(program, stdin=case.get("stdin", ""))
            if not is_program_started(result):
                return Verdict(outcome="infra_error", detail=f"the sandbox did not start: {result.detail}")
            is_timed_out |= str(result.status) == "timeout"
            is_crashed |= str(result.status) in ("killed", "oom", "sandbox_error")
            is_passed = str(result.status) == "ok" and not result.is_output_truncated
            num_passed += is_passed and _normalised_output(result.stdout) == _normalised_output(case["stdout"])
        outcome = "ok" if num_passed == len(cases) else ("timeout" if is_timed_out else "wrong")
        return Verdict(outcome=outcome, fraction=num_passed / len(cases), is_policy_error=is_crashed or is_timed_out)

    def _result(
        self, example: Example, completion: str, verdict: Verdict, *, status: RewardStatus | None = None
    ) -> RewardResult:
        status = status or _OUTCOME_STATUS[verdict.outcome]
        score = None if status is RewardStatus.INFRA_ERROR else (1.0 if status is RewardStatus.OK else 0.0)
        components = {"format": 0.0 if status is RewardStatus.FORMAT_ERROR else 1.0}
        if score is not None:
            components |= {"correct": score, "fraction_passed": verdict.fraction}
        key = hashlib.sha256(f"{self.name}\0{VERSION}\0{example.task_hash}\0{completion}".encode()).hexdigest()
        return RewardResult(
            score=score,
            status=status,
            components=components,
            verifier=self.name,
            verifier_version=VERSION,
            hack_flags=verdict.flags,
            cache_key=key[:32],
            is_policy_error=verdict.is_policy_error,
            detail=verdict.detail[:500],
        )


class HumanEvalReward(CodeTestReward):
    """A HumanEval problem (``metadata``: ``prompt_code``, ``entry_point``, ``test``): its ``check(candidate)`` runs
    in the checker's sandbox with the prompt's helper functions defined there, the candidate in its own. The
    completion either continues the prompt's function (no fence) or gives a fenced block (which may redefine the
    whole function: the prompt's imports and helpers stay, the later ``def`` wins)."""

    name = "humaneval"

    def __call__(self, example: Example, completion: str) -> RewardResult:
        metadata = example.metadata
        block = extract_program(completion, required_names=required_names(metadata))
        prompt_code = metadata["prompt_code"]
        program = prompt_code + completion if block is None else f"{prompt_code}\n\n{block}"
        return self.score_program(example, completion, program)

    def score_program(self, example: Example, completion: str, program: str) -> RewardResult:
        metadata = example.metadata
        spec = {
            "mode": "humaneval",
            "prompt_code": metadata["prompt_code"],
            "entry_point": metadata["entry_point"],
            "test": metadata["test"],
        }
        verdict = grade_with_checker(self.runner, program, spec, test_files={}, wall_seconds=self.wall_seconds)
        return self._result(example, completion, verdict)
