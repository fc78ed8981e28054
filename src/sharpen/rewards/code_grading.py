"""The host's side of a code grading: two sandboxes and the relay between them, and what their ends mean.

Owns the grading protocol. The candidate program runs in one sandbox behind a narrow call interface
(code_candidate.py); the dataset's tests run in another (code_checker.py), or here, for function cases whose
expected values never leave this process. Between them only plain values travel (code_values.py), and every line
the candidate writes is parsed and checked here before anything is passed on: the checker gets a message this
module built, never the candidate's bytes.

Who is at fault decides between a score and an abstention. The candidate's sandbox starts before any candidate
code runs; from then on every end (a timeout, a crash, an exit mid-call, garbage on the channel, a sandbox
"error" after the program started) is the policy's: it fails. Only what the policy cannot cause abstains: a
sandbox that did not start, or tests that cannot run before any candidate value reached them.

Does not import the sandbox (rewards sit below environments): the runner is any `CodeRunner` (a `Sandbox`).
"""

from __future__ import annotations

import ast
import hashlib
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from sharpen.rewards import code_values
from sharpen.rewards.code_compare import matches_expected

_HERE = Path(__file__).parent
CANDIDATE_RUNNER = (_HERE / "code_candidate.py").read_text()
CHECKER = (_HERE / "code_checker.py").read_text()
VALUES_MODULE = (_HERE / "code_values.py").read_text()
_VALUES_FILE = "_sharpen_values.py"
_GRACE_SECONDS = 2.0
"""How long past the sandbox's own wall clock the relay waits for a line (the sandbox ends the program first)."""
_CLOSE_SECONDS = 0.5
"""How long a program may take to exit once its stdin closed, before it is killed."""

Outcome = Literal["ok", "wrong", "timeout", "infra_error"]


class CodeSession(Protocol):
    """A running sandboxed program exchanging lines with the host (a `SandboxSession` fits)."""

    def send(self, message: bytes, *, timeout: float) -> bool: ...

    def receive(self, *, timeout: float) -> bytes | None: ...

    def close(self, *, grace_seconds: float | None = None) -> Any: ...


class CodeRunner(Protocol):
    """Runs Python code in isolation (a `Sandbox` fits): one-shot (``run_python``, for stdin/stdout cases) or as a
    session (``open_python_session``). Results (`ExecutionResult`s) are read for ``status`` (by its string value),
    ``stdout``, ``detail`` and ``is_program_started``."""

    def run_python(self, code: str, *, files: Mapping[str, str | bytes] = ..., stdin: str | bytes = "") -> Any: ...

    def open_python_session(self, code: str, *, files: Mapping[str, str | bytes] = ...) -> CodeSession: ...


@dataclass(kw_only=True, slots=True)
class Verdict:
    """What a grading found: the outcome, the fraction of tests passed, hack flags and why, in words."""

    outcome: Outcome
    fraction: float = 0.0
    flags: list[str] = field(default_factory=list[str])
    detail: str = ""
    is_policy_error: bool = False
    """The candidate's program ended the grading (hung, crashed, exited mid-call, broke the protocol)."""


def is_program_started(result: Any) -> bool:
    """Whether the sandbox got as far as starting the program: before that, nothing was the program's doing."""
    started = getattr(result, "is_program_started", None)
    return bool(started) if started is not None else str(result.status) != "sandbox_error"


def _ended(result: Any, *, detail: str) -> Verdict:
    """The verdict when the candidate's sandbox ended before the grading did."""
    if not is_program_started(result):
        return Verdict(outcome="infra_error", detail=f"the sandbox did not start: {result.detail}")
    outcome: Outcome = "timeout" if str(result.status) == "timeout" else "wrong"
    return Verdict(outcome=outcome, detail=f"{detail} ({result.status}: {result.detail})", is_policy_error=True)


_MAX_NAMES = 1000


def _is_public_name(name: str) -> bool:
    return name.isidentifier() and not name.startswith("__") and len(name) <= 200


class _Protocol(Exception):
    """The candidate broke the protocol (a line that is not a well-formed message)."""


def _parse_line(line: bytes) -> dict[str, Any]:
    try:
        message = json.loads(line)
    except (ValueError, RecursionError):
        raise _Protocol("a line that is not JSON") from None
    if not isinstance(message, dict):
        raise _Protocol("a message that is not an object")
    return message


class CandidateProcess:
    """The candidate's sandbox, seen from the host: its hello, and calls answered as checked plain values."""

    def __init__(self, runner: CodeRunner, program: str, *, wall_seconds: float) -> None:
        self.deadline = time.monotonic() + wall_seconds + _GRACE_SECONDS
        files = {"solution.py": program, _VALUES_FILE: VALUES_MODULE}
        self.session = runner.open_python_session(CANDIDATE_RUNNER, files=files)
        self.flags: list[str] = []
        self.names: dict[str, Any] = {}
        self._ids = 0

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def _receive(self) -> dict[str, Any] | None:
        line = self.session.receive(timeout=self.remaining())
        return None if line is None else _parse_line(line)

    def hello(self) -> bool:
        """Read what the candidate module defines; False when the program ended first."""
        message = self._receive()
        if message is None:
            return False
        callables, plain = message.get("callables"), message.get("values")
        if message.get("ready") is not True or not isinstance(callables, list) or not isinstance(plain, dict):
            raise _Protocol("a malformed hello")
        names = [*callables, *plain]
        if len(names) > _MAX_NAMES or not all(isinstance(n, str) and _is_public_name(n) for n in names):
            raise _Protocol("a malformed name, or too many names")
        try:
            checked = {name: code_values.encode(code_values.decode(tree)) for name, tree in plain.items()}
        except (ValueError, TypeError, RecursionError):
            raise _Protocol("a module value that is not a plain value") from None
        import_error = message.get("import_error")
        self.names = {
            "callables": list(callables),
            "values": checked,
            "import_error": _described(import_error) if import_error is not None else None,
        }
        return True

    def call(self, name: str, args: Any, kwargs: Any) -> dict[str, Any] | None:
        """One call (``args``/``kwargs`` already encoded); the checked reply, or None when the program ended."""
        self._ids += 1
        request = {"id": self._ids, "call": name, "args": args, "kwargs": kwargs}
        line = json.dumps(request, allow_nan=False, separators=(",", ":")).encode()
        if not self.session.send(line, timeout=self.remaining()):
            return None
        message = self._receive()
        if message is None:
            return None
        if message.get("id") != self._ids:
            raise _Protocol("a reply to another call")
        if "value" in message:
            try:
                value = code_values.decode(message["value"])
                tree = code_values.encode(value)
            except (ValueError, TypeError, RecursionError):
                raise _Protocol("a value that is not a plain value") from None
            if message.get("overrides_eq") is True and "equality_override" not in self.flags:
                self.flags.append("equality_override")
            return {"value": tree, "decoded": value}
        if "raised" in message:
            return {"raised": _described(message["raised"])}
        if isinstance(message.get("unencodable"), str):
            return {"unencodable": message["unencodable"][:100]}
        raise _Protocol("a reply with no value")

    def close(self) -> Any:
        return self.session.close(grace_seconds=_CLOSE_SECONDS)


def _described(raised: Any) -> dict[str, str]:
    if not isinstance(raised, dict):
        raise _Protocol("a malformed exception")
    return {"type": str(raised.get("type", ""))[:100], "message": str(raised.get("message", ""))[:300]}


# --- function cases: the expected values never leave this process ------------------------------------------------


def case_call(case: Mapping[str, Any], entry_point: str | None) -> tuple[str, list[Any], dict[str, Any]]:
    """A case's call as (function name, args, kwargs): ``{"args": [...]}`` calls ``entry_point``; ``{"call":
    "f(1, x=[2])"}`` is parsed here (a function name and literal arguments only) and never evaluated."""
    if case.get("call") is None:
        if entry_point is None:
            raise ValueError("a case with 'args' needs the example's 'entry_point'")
        return entry_point, list(case.get("args", [])), dict(case.get("kwargs", {}))
    text = str(case["call"])
    try:
        node = ast.parse(text, mode="eval").body
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            raise ValueError("not a call of a function by name")
        args = [ast.literal_eval(arg) for arg in node.args]
        kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        if len(kwargs) != len(node.keywords):
            raise ValueError("** arguments")
    except (SyntaxError, ValueError) as error:
        raise ValueError(f"case call {text!r}: write it as name(literal, ...), e.g. add(1, [2, 3]) ({error})") from None
    return node.func.id, args, kwargs


def grade_cases(
    runner: CodeRunner, program: str, cases: list[Mapping[str, Any]], *, entry_point: str | None, wall_seconds: float
) -> Verdict:
    """Each case called in the candidate's sandbox; the reply compared here with the case's ``expected``, in JSON's
    data model with its types (`code_compare.matches_expected`: ``True`` is not ``1``, ``{1: x}`` is ``{"1": x}``)."""
    calls = []
    for name, args, kwargs in (case_call(case, entry_point) for case in cases):  # the dataset's error: raise now
        calls.append((name, code_values.encode(args), {key: code_values.encode(v) for key, v in kwargs.items()}))
    candidate = CandidateProcess(runner, program, wall_seconds=wall_seconds)
    num_passed, ended = 0, ""
    try:
        if not candidate.hello():
            ended = "the program ended before it was imported"
        for (name, args, kwargs), case in zip(calls, cases, strict=True):
            if ended:
                break
            reply = candidate.call(name, args, kwargs)
            if reply is None:
                ended = f"the program ended in {name}()"
            elif "decoded" in reply and matches_expected(reply["decoded"], case["expected"]):
                num_passed += 1
    except _Protocol as error:
        candidate.flags.append("grader_patched")
        ended = f"the candidate broke the protocol: {error}"
    result = candidate.close()
    if ended:
        is_protocol = "protocol" in ended
        verdict = (
            Verdict(outcome="wrong", detail=ended, is_policy_error=True)
            if is_protocol
            else _ended(result, detail=ended)
        )
    else:
        is_ok = num_passed == len(cases) and not candidate.flags
        verdict = Verdict(
            outcome="ok" if is_ok else "wrong", detail="" if is_ok else f"{num_passed}/{len(cases)} passed"
        )
    verdict.fraction = num_passed / len(cases)
    verdict.flags = sorted(set(candidate.flags))
    return verdict


# --- tests in the checker's sandbox, calls relayed -----------------------------------------------------------------


def grade_with_checker(
    runner: CodeRunner, program: str, spec: dict[str, Any], *, test_files: Mapping[str, str], wall_seconds: float
) -> Verdict:
    """The dataset's tests (``spec["mode"]``: ``humaneval`` or ``pytest``) run by the checker, each call of the
    candidate's functions relayed to the candidate's sandbox, checked, and answered with a message built here."""
    digests = {name: hashlib.sha256(text.encode()).hexdigest() for name, text in test_files.items()}
    files = {**test_files, "spec.json": json.dumps({**spec, "test_files": digests}), _VALUES_FILE: VALUES_MODULE}
    candidate = CandidateProcess(runner, program, wall_seconds=wall_seconds)
    checker = runner.open_python_session(CHECKER, files=files)
    relay = _Relay(candidate, checker)
    verdict: Verdict | None = None
    try:
        verdict = relay.run()
    except _Protocol as error:
        candidate.flags.append("grader_patched")
        verdict = Verdict(outcome="wrong", detail=f"the candidate broke the protocol: {error}", is_policy_error=True)
    finally:
        checker_result = checker.close(grace_seconds=_CLOSE_SECONDS)
        candidate_result = candidate.close()
    if verdict is None:
        if relay.has_candidate_ended or not is_program_started(candidate_result):
            verdict = _ended(candidate_result, detail="the program ended while the tests ran")
        elif not relay.has_names_sent or not is_program_started(checker_result):
            verdict = Verdict(outcome="infra_error", detail=f"the checker did not start: {checker_result.detail}")
        else:  # the tests ended without a verdict after candidate values reached them
            detail = f"the tests did not finish ({checker_result.status})"
            verdict = Verdict(outcome="wrong", detail=detail, is_policy_error=True)
    verdict.flags = sorted({*verdict.flags, *candidate.flags})
    return verdict


class _Relay:
    """Carries the checker's calls to the candidate and the checked replies back, until the checker's verdict."""

    def __init__(self, candidate: CandidateProcess, checker: CodeSession) -> None:
        self.candidate, self.checker = candidate, checker
        self.has_candidate_ended = False
        self.has_names_sent = False
        self.num_calls = 0

    def run(self) -> Verdict | None:
        """The verdict, or None when one side ended without one (see the flags on self)."""
        candidate, checker = self.candidate, self.checker
        if not candidate.hello():
            self.has_candidate_ended = True
            return None
        if not checker.send(json.dumps(candidate.names).encode(), timeout=candidate.remaining()):
            return None
        self.has_names_sent = True
        while (line := checker.receive(timeout=candidate.remaining())) is not None:
            message = json.loads(line)  # the checker is our code running the dataset's: a bad line is a bug
            if "done" in message:
                return self._verdict(message["done"])
            reply = candidate.call(message["call"], message["args"], message["kwargs"])
            if reply is None:
                self.has_candidate_ended = True
                return None
            reply.pop("decoded", None)
            self.num_calls += 1
            if not checker.send(json.dumps(reply, allow_nan=False).encode(), timeout=candidate.remaining()):
                return None
        return None

    def _verdict(self, done: dict[str, Any]) -> Verdict:
        if "harness_error" in done:  # the dataset's tests cannot run; once values went in, the policy may be why
            detail = f"the tests cannot run: {done['harness_error']}"
            if self.num_calls:
                return Verdict(outcome="wrong", detail=detail, is_policy_error=True)
            return Verdict(outcome="infra_error", detail=detail)
        is_ok = done.get("passed") is True and not self.candidate.flags
        return Verdict(outcome="ok" if is_ok else "wrong", fraction=float(is_ok), detail=str(done.get("failure", "")))
