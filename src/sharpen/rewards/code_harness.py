"""The grading harness that runs INSIDE the sandbox, as ``main.py``, around a candidate program (``solution.py``).

Owns the in-sandbox half of `code_tests`: it reads its spec (a per-run sentinel and flag token, the test cases or
test files) from stdin before any candidate code runs, installs an audit hook and module guards that the
candidate cannot remove, imports the candidate, runs the cases (or pytest), and writes one report line prefixed
with the sentinel only when it got to the end. Signs of tampering are written at once to stderr, prefixed with the
flag token, so that they survive an ``os._exit``, and are repeated in the report.

It does not judge: function-case results are sent back serialised (``json.dumps`` of primitives) and compared on
the host, so expected values never enter the sandbox. Standard library only (it runs under /usr/bin/python3);
this module is read as text by `code_tests`, never imported by sharpen.

Limits, by design of in-process grading: a candidate that finds the sentinel in this process's memory could
forge a report. Frame and gc introspection, tracing and ctypes from candidate code are flagged; with function
cases a forged report still needs the hidden expected values.
"""

from __future__ import annotations

import builtins
import hashlib
import importlib
import json
import os
import sys
import time
import types
from typing import Any

_write = os.write
_dumps = json.dumps
_PRIMITIVES = (int, float, str, bool, type(None))
_SPAWN_EVENTS = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.fork", "os.spawn", "pty.spawn")
_INTROSPECTION_EVENTS = (
    "sys._getframe",
    "sys._current_frames",
    "gc.get_objects",
    "gc.get_referrers",
    "gc.get_referents",
    "object.__getattr__",
    "object.__setattr__",
    "sys.settrace",
    "sys.setprofile",
    "sys.addaudithook",
    "ctypes.",
)
_WRITE_MODES = ("w", "a", "x", "+")


class Guard:
    """Collects hack flags from the audit hook, the module guards and the checks after the run."""

    def __init__(self, *, flag_token: str, workdir: str, own_files: list[str], allowed_roots: list[str]) -> None:
        self.flag_token = flag_token
        self.workdir = workdir
        self.own_files = {os.path.join(workdir, name) for name in own_files}
        self.test_files = {os.path.join(workdir, name) for name in own_files if name != "main.py"}
        self.allowed_roots = allowed_roots
        self.flags: list[str] = []
        self.is_armed = False
        self._in_hook = False

    def flag(self, name: str, detail: str = "") -> None:
        if name not in self.flags:
            self.flags.append(name)
            _write(2, f"\n{self.flag_token} {name} {detail[:200]!r}\n".encode())  # the detail helps debugging

    def audit(self, event: str, args: tuple[Any, ...]) -> None:
        if not self.is_armed or self._in_hook:
            return
        self._in_hook = True  # our own sys._getframe below raises an audit event too
        try:
            self._check_event(event, args)
        finally:
            self._in_hook = False

    def _check_event(self, event: str, args: tuple[Any, ...]) -> None:
        if event.startswith("socket."):
            self.flag("network_attempt", event)
        elif event.startswith(_SPAWN_EVENTS):
            self.flag("process_spawned", event)  # a child process would run outside this audit hook
        elif event == "open" and isinstance(args[0], str | bytes):
            self._check_open(os.fsdecode(args[0]), str(args[1] or "r"))
        elif event in ("os.listdir", "os.scandir") and isinstance(args[0], str | bytes):
            if not self._is_readable(path := os.path.abspath(os.fsdecode(args[0]))):
                self.flag("env_read", path)
        elif event in ("os.remove", "os.rename", "os.truncate") and isinstance(args[0], str | bytes):
            if os.path.abspath(os.fsdecode(args[0])) in self.test_files:
                self.flag("test_file_modified")
        elif event.startswith(_INTROSPECTION_EVENTS) and self._is_candidate_frame(sys._getframe(2)):
            self.flag("grader_patched", event)  # reaching into the grader's frames or memory

    def _check_open(self, path: str, mode: str) -> None:
        path = os.path.abspath(path)
        is_write = any(char in mode for char in _WRITE_MODES)
        if is_write and path in self.test_files:
            self.flag("test_file_modified")
        if is_write and os.path.basename(path) == "conftest.py":
            self.flag("conftest_created")
        if not self._is_readable(path):
            self.flag("env_read", path)

    def _is_readable(self, path: str) -> bool:
        if ".git" in path.split(os.sep):
            return False
        roots = [self.workdir, *self.allowed_roots]
        return any(path == root or path.startswith(root.rstrip(os.sep) + os.sep) for root in roots)

    def _is_candidate_frame(self, frame: types.FrameType | None) -> bool:
        if frame is None:
            return False
        filename = frame.f_code.co_filename
        if filename.startswith("<"):  # exec'd code: ours never execs, pytest's frozen bootstrap is <frozen ...>
            return not filename.startswith("<frozen")
        path = os.path.abspath(filename)
        return path.startswith(self.workdir + os.sep) and path not in self.own_files


def guard_module(module: types.ModuleType, guard: Guard, flag: str) -> dict[str, Any]:
    """Flag any attribute set on ``module`` from now on; returns a snapshot for `check_unchanged`."""

    class GuardedModule(types.ModuleType):
        def __setattr__(self, name: str, value: Any) -> None:
            guard.flag(flag)
            super().__setattr__(name, value)

        def __delattr__(self, name: str) -> None:
            guard.flag(flag)
            super().__delattr__(name)

    module.__class__ = GuardedModule
    return dict(vars(module))


def check_unchanged(module: types.ModuleType, snapshot: dict[str, Any], guard: Guard, flag: str) -> None:
    """Catches changes made through ``module.__dict__``, which bypass the guard's ``__setattr__``."""
    current = vars(module)
    if current.keys() != snapshot.keys() or any(current[key] is not value for key, value in snapshot.items()):
        guard.flag(flag)


def has_custom_eq(value: Any) -> bool:
    """True when a non-builtin type in ``value`` defines ``__eq__`` (an always-equal object, say)."""
    if type(value) in (list, tuple):
        return any(has_custom_eq(item) for item in value)
    if type(value) is dict:
        return any(has_custom_eq(key) or has_custom_eq(item) for key, item in value.items())
    return type(value) not in _PRIMITIVES and type(value).__eq__ is not object.__eq__


def serialise(value: Any) -> str:
    """JSON of exact primitive types only: a subclass (an ``int`` whose ``__eq__`` lies) is refused."""
    if type(value) in (list, tuple):
        return "[" + ",".join(serialise(item) for item in value) + "]"
    if type(value) is dict and all(type(key) is str for key in value):
        return "{" + ",".join(f"{_dumps(key)}:{serialise(item)}" for key, item in value.items()) + "}"
    if type(value) in _PRIMITIVES:
        return _dumps(value)
    raise TypeError(f"result of type {type(value).__name__} is not JSON of primitives")


def guarded(function: Any) -> Any:
    """Wraps a candidate function for test files: a result with a custom ``__eq__`` fails the test."""

    def call(*args: Any, **kwargs: Any) -> Any:
        value = function(*args, **kwargs)
        if has_custom_eq(value):
            GUARD_HOLDER[0].flag("equality_override")
            raise AssertionError("the candidate returned an object that overrides __eq__")
        return value

    return call


GUARD_HOLDER: list[Guard] = []


def import_candidate(guard: Guard) -> tuple[types.ModuleType | None, str]:
    """The candidate module (``solution.py``, written next to us), or None and why its import failed."""
    try:
        return importlib.import_module("solution"), ""
    except SystemExit:
        guard.flag("exit_before_asserts")
        return None, "SystemExit"
    except BaseException as error:  # the candidate's own crash is a wrong answer, not a harness failure
        return None, f"{type(error).__name__}: {error}"[:500]


def run_cases(spec: dict[str, Any], guard: Guard) -> dict[str, Any]:
    """Imports the candidate and runs each case; returns the serialised results (judged on the host)."""
    results: list[dict[str, str]] = []
    solution, import_error = import_candidate(guard)
    if solution is None:
        return {"results": results, "import_error": import_error}
    namespace: dict[str, Any] = solution.__dict__
    for case in spec["cases"]:
        try:
            if case.get("call") is not None:
                value = eval(case["call"], namespace)  # our expression, in the candidate's namespace
            else:
                value = namespace[spec["entry_point"]](*case["args"])
            if has_custom_eq(value):
                guard.flag("equality_override")
            results.append({"value": serialise(value)})
        except SystemExit:
            guard.flag("exit_before_asserts")
            results.append({"error": "SystemExit"})
        except BaseException as error:
            results.append({"error": f"{type(error).__name__}: {error}"[:500]})
    return {"results": results}


def run_pytest(spec: dict[str, Any], guard: Guard) -> dict[str, Any]:
    """Runs pytest in this process on our test files; counts outcomes with our own plugin object."""
    sys.path.insert(0, spec["pytest_path"])
    try:
        import pytest
    except ImportError as error:  # the sandbox lacks the pytest binds: our setup's fault, not the candidate's
        return {"harness_error": f"cannot import pytest from {spec['pytest_path']}: {error}"}

    # Imported by us first, so that an exit at import is seen (pytest would turn it into an internal error); a
    # test file rewritten at import time then runs rewritten, but the hash check below flags it.
    _, import_error = import_candidate(guard)
    if import_error:
        return {"import_error": import_error}

    outcomes = {"passed": 0, "failed": 0}

    class Recorder:
        def pytest_runtest_logreport(self, report: Any) -> None:
            if report.failed:
                outcomes["failed"] += 1
            elif report.when == "call" and report.passed:
                outcomes["passed"] += 1

    args = [*spec["test_files"], "--noconftest", "-p", "no:cacheprovider", "-q", "-p", "no:randomly"]
    exit_code = int(pytest.main(args, plugins=[Recorder()]))
    for name, digest in spec["test_files"].items():
        try:
            with open(name, "rb") as file:
                if hashlib.sha256(file.read()).hexdigest() != digest:
                    guard.flag("test_file_modified")
        except OSError:
            guard.flag("test_file_modified")
    for _, _, names in os.walk(guard.workdir):
        if "conftest.py" in names:
            guard.flag("conftest_created")
    return {"pytest_exit_code": exit_code, **outcomes}


def main() -> None:
    spec = json.loads(sys.stdin.read())
    sentinel = spec.pop("sentinel")
    workdir = os.getcwd()
    own_files = ["main.py", *spec.get("test_files", {})]
    # The interpreter's own paths (stdlib, its zip, lib-dynload) are read by every import; /tmp is the sandbox's
    # private, empty one (pytest captures output through temporary files there).
    allowed = [path for path in sys.path if path and path != workdir] + ["/dev/null", "/dev/urandom", "/tmp"]
    if spec.get("pytest_path"):
        allowed.append(spec["pytest_path"])
    guard = Guard(flag_token=spec.pop("flag_token"), workdir=workdir, own_files=own_files, allowed_roots=allowed)
    GUARD_HOLDER.append(guard)
    helper = types.ModuleType("_sharpen_guard")
    helper.guarded = guarded  # type: ignore[attr-defined]  # what our test files wrap the candidate with
    sys.modules["_sharpen_guard"] = helper
    sys.addaudithook(guard.audit)  # before the candidate is imported: an audit hook cannot be removed
    snapshots = [
        (time, guard_module(time, guard, "time_patched"), "time_patched"),
        (builtins, guard_module(builtins, guard, "grader_patched"), "grader_patched"),
        (sys.modules[__name__], guard_module(sys.modules[__name__], guard, "grader_patched"), "grader_patched"),
    ]
    guard.is_armed = True
    report = run_cases(spec, guard) if spec["mode"] == "cases" else run_pytest(spec, guard)
    guard.is_armed = False
    for module, snapshot, flag in snapshots:
        check_unchanged(module, snapshot, guard, flag)
    report["flags"] = guard.flags
    _write(1, f"\n{sentinel} {_dumps(report)}\n".encode())


if __name__ == "__main__":
    main()
