"""The checker's side of a code grading: runs INSIDE its own sandbox, as ``main.py``, with the dataset's tests.

It runs the tests (a HumanEval ``check(candidate)``, or pytest files) against a stand-in ``solution`` module whose
functions forward each call, as plain values, through the host to the candidate's sandbox (code_candidate.py) and
return the plain value that came back. No candidate code ever runs in this process: what the tests compare are
builtin values rebuilt here by ``_sharpen_values``, so ``==`` is the builtin one, and the tests, expected values
and verdict are out of the candidate's reach (another sandbox, no shared file, no shared memory).

Protocol on private copies of stdin and stdout (the tests' own prints go to stderr): the host first sends
``{"callables", "values", "import_error"}`` (what the candidate module defines); then each call is a line
``{"id", "call", "args", "kwargs"}`` out and one reply line in; the last line out is ``{"done": {...}}``:
``passed`` (bool) with ``failure`` (why not), or ``harness_error`` (our or the dataset's fault: the tests could not
be run). Standard library only, plus pytest from ``spec["pytest_path"]`` in pytest mode; sharpen reads this file as
text and never imports it.
"""

import builtins
import hashlib
import itertools
import json
import os
import sys
import traceback
import types

import _sharpen_values as values  # pyright: ignore[reportMissingImports]  # shipped beside us by the grader

_FAILURE_CHARS = 500


class CandidateEnded(BaseException):
    """The candidate's sandbox stopped answering: no test may catch this (it is not an Exception)."""


class CandidateError(Exception):
    """The candidate raised an exception that is not a builtin one (its type name is in the message)."""


class HarnessError(BaseException):
    """The tests cannot be run as the dataset gives them (not the candidate's doing)."""


class Channel:
    def __init__(self) -> None:
        self.reader = os.fdopen(os.dup(0), "rb")
        self.writer = os.dup(1)
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.dup2(2, 1)
        self.ids = itertools.count(1)

    def send(self, message: dict) -> None:
        data = (json.dumps(message, separators=(",", ":")) + "\n").encode()
        while data:
            data = data[os.write(self.writer, data) :]

    def receive(self) -> dict:
        line = self.reader.readline()
        if not line:
            raise CandidateEnded("the host closed the channel")
        return json.loads(line)

    def call(self, name: str, args: tuple, kwargs: dict) -> object:
        try:
            request = {
                "call": name,
                "args": values.encode(list(args)),
                "kwargs": {key: values.encode(value) for key, value in kwargs.items()},
            }
        except values.Unencodable as error:
            raise HarnessError(f"the tests pass {error.type_name} to {name}(), which cannot cross") from None
        request["id"] = next(self.ids)
        self.send(request)
        reply = self.receive()
        if "ended" in reply:
            raise CandidateEnded(reply["ended"])
        if "unencodable" in reply:
            raise TypeError(f"{name}() returned a {reply['unencodable']}, which is not a plain value")
        if "raised" in reply:
            raise _exception(reply["raised"])
        return values.decode(reply["value"])


def _exception(raised: dict) -> Exception:
    """The candidate's exception, rebuilt as the builtin exception of that name (or a CandidateError)."""
    kind = getattr(builtins, str(raised.get("type")), None)
    message = str(raised.get("message", ""))
    if isinstance(kind, type) and issubclass(kind, Exception) and kind.__module__ == "builtins":
        try:
            return kind(message)
        except Exception:  # an exception type whose constructor wants other arguments
            pass
    return CandidateError(f"{raised.get('type')}: {message}")


def _proxy(channel: Channel, name: str) -> object:
    def call(*args: object, **kwargs: object) -> object:
        return channel.call(name, args, kwargs)

    call.__name__ = call.__qualname__ = name
    return call


def solution_module(channel: Channel, names: dict) -> types.ModuleType:
    """The stand-in for the candidate's module: its functions as proxies, its plain values rebuilt."""
    module = types.ModuleType("solution")
    for name in names.get("callables", []):
        setattr(module, name, _proxy(channel, name))
    for name, tree in names.get("values", {}).items():
        setattr(module, name, values.decode(tree))
    sys.modules["solution"] = module
    guard = types.ModuleType("_sharpen_guard")  # what test files written for the old in-process grader import
    guard.guarded = lambda function: function  # type: ignore[attr-defined]
    sys.modules["_sharpen_guard"] = guard
    return module


def run_humaneval(spec: dict, module: types.ModuleType) -> dict:
    """The problem's ``check(candidate)``, with the prompt's own helpers (``poly``, ``encode_cyclic``...) defined."""
    entry_point = spec["entry_point"]
    candidate = getattr(module, entry_point, None)
    if candidate is None:
        return {"passed": False, "failure": f"the candidate defines no {entry_point}()"}
    namespace: dict = {"__name__": "__check__"}
    try:
        exec(compile(spec["prompt_code"], "<prompt>", "exec"), namespace)
        namespace[entry_point] = candidate
        exec(compile(spec["test"], "<test>", "exec"), namespace)
    except Exception as error:
        raise HarnessError(f"the problem's prompt or test does not run: {type(error).__name__}: {error}") from None
    try:
        namespace["check"](candidate)
    except Exception as error:
        return {"passed": False, "failure": _failure(error)}
    return {"passed": True}


def run_pytest(spec: dict) -> dict:
    """pytest on the test files, counted by our own plugin object; all must pass and at least one must run."""
    sys.path.insert(0, spec["pytest_path"])
    try:
        import pytest
    except ImportError as error:
        raise HarnessError(f"cannot import pytest from {spec['pytest_path']}: {error}") from None
    outcomes = {"num_passed": 0, "num_failed": 0}

    class Recorder:
        def pytest_runtest_logreport(self, report: object) -> None:
            if report.failed:  # type: ignore[attr-defined]
                outcomes["num_failed"] += 1
            elif report.when == "call" and report.passed:  # type: ignore[attr-defined]
                outcomes["num_passed"] += 1

    args = [*spec["test_files"], "--noconftest", "-p", "no:cacheprovider", "-q", "-p", "no:randomly"]
    exit_code = int(pytest.main(args, plugins=[Recorder()]))
    for name, digest in spec["test_files"].items():  # nothing else writes here; a check against our own mistakes
        with open(name, "rb") as file:
            if hashlib.sha256(file.read()).hexdigest() != digest:
                raise HarnessError(f"test file {name} changed while it ran")
    is_passed = exit_code == 0 and outcomes["num_failed"] == 0 and outcomes["num_passed"] > 0
    return {"passed": is_passed, "failure": "" if is_passed else f"pytest: exit {exit_code}, {outcomes}", **outcomes}


def _failure(error: BaseException) -> str:
    text = "".join(traceback.format_exception_only(type(error), error)).strip()
    return text[:_FAILURE_CHARS]


def main() -> None:
    with open("spec.json") as file:
        spec = json.load(file)
    channel = Channel()
    try:
        names = channel.receive()
        module = solution_module(channel, names)
        verdict = run_humaneval(spec, module) if spec["mode"] == "humaneval" else run_pytest(spec)
    except CandidateEnded as ended:
        verdict = {"passed": False, "failure": f"the candidate ended: {ended}"}
    except HarnessError as error:
        verdict = {"harness_error": str(error)[:_FAILURE_CHARS]}
    channel.send({"done": verdict})


if __name__ == "__main__":
    main()
