"""The repository environment's workspace tools as the program that runs them inside the episode's sandbox: read a
file, search the files, edit a file by exact string replacement, run the package's tests; and, for the grader
(never offered to the policy), ``changes``: the workspace's source files that changed, shipped only when their
digest differs from the last graded one.

`RepositoryEnvironment` (repository.py) sends this module's source to the episode's shell with each call
(``python3 -I -c SOURCE HOME``) and the call's request as base64 JSON on stdin, so a tool touches only the episode's
own workspace and nothing runs on the host. Every path is taken relative to the workspace's root ``HOME`` (fixed
at reset, not read from the shell's variables) and must resolve inside it, symlinks followed: an absolute path, a
``..`` that climbs out, or a link that leads out is refused. The program prints what the policy sees (a refusal is
one ``error: ...`` line) and exits 0, or 1 after a refusal; ``run_tests`` replaces itself with pytest, whose exit
status is the call's. The output's size is bounded by the shell (head and tail), like a command's.

Standard library only, and Python 3.8 syntax at most: it runs on the sandbox's interpreter, not the project's. It
does not decide what a call means for the grade (repository.py does), and the tools confine themselves only: the
sandbox, not this module, is what keeps the task set's hidden material out of reach (the policy also has a shell).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import stat
import sys
import zlib

MAX_MATCHES = 50
"""Matching lines a search shows; the rest are counted."""
MAX_LINE_CHARS = 200
"""Characters of one matching line a search shows."""
SKIPPED_FOLDERS = frozenset({".git", "__pycache__", ".pytest_cache"})
PYTEST_OPTIONS = ("-q", "-p", "no:cacheprovider", "-o", "addopts=", "--tb=short")
"""As the grader runs the suite (`sharpen.environments.pytest_suite`): no cache files, the package's addopts off."""
TEST_FOLDERS = frozenset({"tests", "test", "testing"})
ROOT_TEST_FILES = frozenset({"pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml", "conftest.py"})
"""Files at the repository's root that shape how pytest collects and runs: restored like the tests."""


def is_test_path(path: str) -> bool:
    """Whether the grader takes ``path`` from the pristine snapshot rather than from the workspace (repository.py
    adds the suite's driver): test folders, ``test_*``, names ending in ``_test`` plus ``.py``, every
    ``conftest.py``, the root's pytest configuration files."""
    parts = path.split("/")
    name = parts[-1]
    return (
        any(part in TEST_FOLDERS for part in parts[:-1])
        or name.startswith("test_")
        or name.endswith("_test.py")
        or name == "conftest.py"
        or (len(parts) == 1 and name in ROOT_TEST_FILES)
    )


def is_bytecode(path: str) -> bool:
    return "__pycache__" in path.split("/") or path.endswith((".pyc", ".pyo"))


def source_digest(files: dict) -> str:
    """The digest of a workspace's source files (``{path: bytes}``, tests and bytecode already left out), the
    same on the host and in the sandbox."""
    hasher = hashlib.sha256()
    for path in sorted(files):
        hasher.update(f"{path}\0{len(files[path])}\0".encode())
        hasher.update(files[path])
    return hasher.hexdigest()


def source_files(home: str) -> dict:
    """The workspace's regular files that the grader takes from it (not tests, not bytecode), by relative path;
    links are not followed and unreadable files are left out (a tar snapshot would lose them too)."""
    files = {}
    for folder, folders, names in os.walk(home):
        folders.sort()
        for name in sorted(names):
            full = os.path.join(folder, name)
            path = os.path.relpath(full, home).replace(os.sep, "/")
            if is_test_path(path) or is_bytecode(path) or not stat.S_ISREG(os.lstat(full).st_mode):
                continue
            try:
                with open(full, "rb") as handle:
                    files[path] = handle.read()
            except OSError:
                continue
    return files


def changes(home: str, known: dict, last: str, limit: int) -> str:
    """What the grader needs of the workspace, as little of it as possible: ``unchanged DIGEST`` when its source
    files' digest is ``last`` (graded already); else ``changed DIGEST PAYLOAD``, the source files whose sha256
    differs from ``known`` (the pristine snapshot's, by path) and the known paths now gone, as base64 of zlib'd
    JSON; ``too_large DIGEST SIZE`` when the payload would be more than ``limit`` bytes."""
    files = source_files(home)
    digest = source_digest(files)
    if digest == last:
        return "unchanged " + digest
    changed = {
        path: data.decode("latin-1")
        for path, data in files.items()
        if hashlib.sha256(data).hexdigest() != known.get(path)
    }
    deleted = sorted(set(known) - set(files))
    payload = base64.b64encode(zlib.compress(json.dumps({"changed": changed, "deleted": deleted}).encode(), 6))
    if len(payload) > limit:
        return f"too_large {digest} {len(payload)}"
    return f"changed {digest} {payload.decode()}"


class ToolError(Exception):
    """The call cannot be done as asked: its one-line message is what the policy sees."""


def resolve(home: str, path: str) -> str:
    """The real path of ``path`` (relative to the workspace's root ``home``); ToolError when it is outside."""
    if not path:
        raise ToolError("the path is empty (give it relative to the repository's root, e.g. pkg/module.py)")
    if os.path.isabs(path):
        raise ToolError(f"{path}: absolute paths are refused; give the path relative to the repository's root")
    full = os.path.realpath(os.path.join(home, path))
    if full != home and not full.startswith(home + os.sep):
        raise ToolError(f"{path}: outside the repository")
    return full


def read_text(full: str, path: str) -> str:
    if os.path.isdir(full):
        raise ToolError(f"{path} is a directory: list it with run_command (ls), or search it")
    if not os.path.isfile(full):
        raise ToolError(f"{path}: no such file")
    with open(full, "rb") as handle:
        return handle.read().decode("utf-8", errors="replace")


def read_file(home: str, path: str, start_line: int, end_line: int) -> str:
    """Lines ``start_line`` to ``end_line`` (0: the last) of the file, numbered, under a header."""
    lines = read_text(resolve(home, path), path).splitlines()
    last = len(lines) if end_line == 0 else min(end_line, len(lines))
    if start_line < 1 or end_line < 0 or (end_line and end_line < start_line):
        raise ToolError(f"lines {start_line}-{end_line}: start_line is at least 1, end_line 0 or at least start_line")
    if start_line > max(len(lines), 1):
        raise ToolError(f"{path} has {len(lines)} lines; start_line {start_line} is past its end")
    shown = [f"{number:6d}\t{lines[number - 1]}" for number in range(start_line, last + 1)]
    return "\n".join([f"{path}: lines {start_line}-{last} of {len(lines)}", *shown])


def search(home: str, pattern: str, path: str) -> str:
    """The lines matching the regular expression ``pattern`` in the text files under ``path``, as path:line: text."""
    try:
        expression = re.compile(pattern)
    except re.error as error:
        raise ToolError(f"the pattern is not a regular expression (Python re): {error}") from None
    top = resolve(home, path)
    if not os.path.exists(top):
        raise ToolError(f"{path}: no such file or directory")
    matches, num_matches = [], 0
    for full in _files(home, top):
        with open(full, "rb") as handle:
            data = handle.read()
        if b"\0" in data:
            continue  # a binary file
        name = os.path.relpath(full, home)
        for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
            if expression.search(line):
                num_matches += 1
                if num_matches <= MAX_MATCHES:
                    matches.append(f"{name}:{number}: {line[:MAX_LINE_CHARS]}")
    if not matches:
        return f"no line matches {pattern!r} under {path}"
    if num_matches > MAX_MATCHES:
        matches.append(f"[{num_matches - MAX_MATCHES} more matching lines not shown: narrow the pattern or the path]")
    return "\n".join(matches)


def _files(home: str, top: str) -> list[str]:
    if os.path.isfile(top):
        return [top]
    found = []
    for folder, folders, names in os.walk(top):
        folders[:] = sorted(name for name in folders if name not in SKIPPED_FOLDERS)
        for name in sorted(names):
            full = os.path.realpath(os.path.join(folder, name))
            if full.startswith(home + os.sep) and os.path.isfile(full):  # a link that leads out is not followed
                found.append(full)
    return found


def edit_file(home: str, path: str, old_string: str, new_string: str) -> str:
    """Replace the one occurrence of ``old_string`` in the file by ``new_string``; the edited lines, numbered."""
    full = resolve(home, path)
    text = read_text(full, path)
    if not old_string:
        raise ToolError("old_string is empty: give the exact text to replace, with enough lines to be unique")
    count = text.count(old_string)
    if count == 0:
        raise ToolError(f"old_string does not occur in {path} (it must match exactly, whitespace included)")
    if count > 1:
        raise ToolError(f"old_string occurs {count} times in {path}: include more lines around it to make it unique")
    start = text.index(old_string)
    with open(full, "wb") as handle:
        handle.write((text[:start] + new_string + text[start + len(old_string) :]).encode("utf-8"))
    first = text.count("\n", 0, start) + 1
    new_lines = new_string.splitlines() or [""]
    shown = [f"{first + offset:6d}\t{line}" for offset, line in enumerate(new_lines)]
    return "\n".join([f"edited {path}: lines {first}-{first + len(new_lines) - 1} now read", *shown])


def run_tests(home: str, tests: list[str], ignore: list[str], deselect: list[str], pytest_path: str) -> str:
    """Replace this process by pytest at the workspace's root on ``tests`` (paths or node ids inside the
    workspace; none: the task's whole suite, with the task set's ignored and deselected tests), with pytest from
    ``pytest_path`` and, as the grader has it, a ``src`` folder on the path."""
    for test in tests:
        if test.startswith("-"):
            raise ToolError(f"{test}: options are refused; give test files, folders or node ids")
        resolve(home, test.split("::")[0])
    options = [*(f"--ignore={path}" for path in ignore), *(f"--deselect={node}" for node in deselect)]
    argv = [sys.executable, "-m", "pytest", *PYTEST_OPTIONS, *([] if tests else options), *tests]
    paths = [pytest_path, *([os.path.join(home, "src")] if os.path.isdir(os.path.join(home, "src")) else [])]
    environment = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", PYTHONPATH=os.pathsep.join(paths))
    os.chdir(home)
    sys.stdout.flush()
    os.execve(sys.executable, argv, environment)
    raise AssertionError("unreachable: execve does not return")


TOOLS = {"read_file": read_file, "search": search, "edit_file": edit_file, "run_tests": run_tests, "changes": changes}


def main() -> int:
    home = os.path.realpath(sys.argv[1])
    request = json.loads(base64.b64decode(sys.stdin.read()))
    try:
        print(TOOLS[request["tool"]](home, **request["arguments"]))
    except ToolError as error:
        print(f"error: {error}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
