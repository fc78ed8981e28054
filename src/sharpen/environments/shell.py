"""`SandboxShell`: one persistent shell per episode in a sandbox session, and `snapshot` of its workspace.

Owns the protocol between the host and a small bash controller that runs as the program of one sandbox session
(`Sandbox.open_session`, the relay sessions the code grader uses): the controller reads one request line at a
time, runs each command in a child ``bash`` under ``timeout``, and answers with the command's output (cut to a
head and a tail inside the sandbox, so a flood never crosses the session) and an end marker line carrying a fresh
random nonce, the exit status, whether the time limit cut it, and the output's full size.

Why a controller and a child shell per command instead of one shell that runs the commands itself: a command
that hangs, ``exit``s, or loops in a builtin then costs only its child (killed with its whole process group at
the limit); the controller, and with it the episode's files, survive. The working directory and the exported
variables are carried from one command's child to the next (saved on its exit, sourced by the next one); plain
shell variables, functions and aliases are not. A command cut by its limit keeps the previous working directory.

The workspace is the session's work dir (the sandbox's private home), seeded with the task's files when the
session starts and gone when it closes: nothing of one episode reaches another. The host sees it only through
`snapshot` (a gzip tar of it, through the same session), which a checker then reads or hands to a separate sandbox
execution; files the checker keeps hidden never enter the shell's sandbox. The shell could fake a snapshot, but
only with files it could as well have written, so a snapshot is as good as the workspace for grading. Everything
crossing the session counts against the sandbox's ``max_output_bytes`` and the session lives at most the
sandbox's ``wall_seconds``; a workspace of a large repository needs a host directory mounted instead (not done).

It does not parse tool calls or decide rewards (`sharpen.environments.terminal` does).
"""

from __future__ import annotations

import asyncio
import base64
import io
import secrets
import tarfile
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

from sharpen.environments.sandbox import ExecutionStatus

CONTROLLER_SLACK_SECONDS = 5.0
"""How long past a command's limit the controller may take to answer before the shell counts as lost."""
MAX_SNAPSHOT_BYTES = 64 << 20
"""The most file content a snapshot may unpack to (a gzip of a huge file of zeros is small)."""

_RUNNER = r"""
__terminal_state=$1
cd -- "$(cat "$__terminal_state/cwd")" 2>/dev/null || cd -- "$__terminal_home"
. "$__terminal_state/env" 2>/dev/null
trap 'pwd > "$__terminal_state/cwd"; export -p > "$__terminal_state/env"' EXIT
set --
. "$__terminal_state/cmd"
"""

_CONTROLLER = r"""
RUNNER=$1
S=/tmp/.terminal
mkdir -p "$S" && chmod 700 "$S" || exit 97
export __terminal_home=$PWD
printf '%s' "$PWD" > "$S/cwd"
: > "$S/env"
while IFS=' ' read -r kind nonce limit limit_us keep data; do
  if [ "$kind" = dump ]; then
    tar -C "$__terminal_home" -czf - . 2>/dev/null | base64 -w0
    printf '\n%s %d 0 0\n' "$nonce" "${PIPESTATUS[0]}"
    continue
  fi
  printf '%s' "$data" | base64 -d > "$S/cmd"
  t0=${EPOCHREALTIME/./}
  timeout -s KILL "$limit" bash --noprofile --norc -c "$RUNNER" terminal "$S" </dev/null >"$S/out" 2>&1
  code=$?
  t1=${EPOCHREALTIME/./}
  timed=0
  if [ "$code" -eq 137 ] && [ $((t1 - t0)) -ge "$limit_us" ]; then timed=1; fi
  size=$(stat -c %s "$S/out")
  if [ "$size" -le "$keep" ]; then
    cat "$S/out"
  else
    head -c $((keep / 2)) "$S/out"
    printf '\n[... %d bytes of output cut ...]\n' $((size - keep))
    tail -c $((keep - keep / 2)) "$S/out"
  fi
  : > "$S/out"
  printf '\n%s %d %d %d\n' "$nonce" "$code" "$timed" "$size"
done
"""

SHELL_ARGV = ("bash", "--noprofile", "--norc", "-c", _CONTROLLER, "terminal-shell", _RUNNER)


class ShellLost(RuntimeError):
    """The episode's shell ended (killed by its own commands, out of memory, or unresponsive): its workspace is
    gone. ``status`` is the session's `ExecutionStatus` value when known."""

    def __init__(self, message: str, *, status: str = "", detail: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.detail = detail
        """The session's `ExecutionResult.detail` (why the sandbox ended it) when known."""


@dataclass(kw_only=True, slots=True, frozen=True)
class CommandResult:
    """What one command did."""

    output: str
    """stdout and stderr together, at most ``keep`` bytes of it (a head and a tail with a note between)."""
    exit_code: int
    is_timed_out: bool
    """The command ran into its limit and was killed with its process group (exit code 137)."""
    num_output_bytes: int
    """Bytes the command wrote in all, before the cut."""
    is_truncated: bool
    """The output was more than ``keep`` bytes: ``output`` is its head and tail."""


class SandboxShell:
    """One episode's shell. ``await SandboxShell.start(sandbox, files)``, then ``run`` commands and ``snapshot``
    the workspace; ``close`` ends it (an unclosed shell is closed when it is garbage-collected, and the sandbox's
    wall clock ends it in any case). ``sandbox`` is a `Sandbox` or `RemoteSandbox` (a pool's ``.sandbox``)."""

    def __init__(self, session: Any) -> None:
        self._session = session
        self._is_closed = False
        self.num_received_bytes = 0
        """Bytes the session has sent the host so far (lines and their ends): what counts against the sandbox's
        ``max_output_bytes``, which ends the session when passed."""
        self._finalizer = weakref.finalize(self, _close_in_background, session)

    @classmethod
    async def start(cls, sandbox: Any, files: Mapping[str, str | bytes]) -> SandboxShell:
        session = await asyncio.to_thread(sandbox.open_session, list(SHELL_ARGV), files=files)
        return cls(session)

    async def run(self, command: str, *, timeout_seconds: float, keep_bytes: int) -> CommandResult:
        """Run ``command`` (any bash, several lines allowed) in the workspace's current directory; its stdin is
        empty. Raises `ShellLost` when the shell is gone."""
        encoded = base64.b64encode(command.encode()).decode()
        limit_us = int(timeout_seconds * 1_000_000)
        lines, marker = await self._exchange(
            f"run {{nonce}} {timeout_seconds:g} {limit_us} {keep_bytes} {encoded}", timeout_seconds
        )
        code, timed, size = (int(field) for field in marker)
        return CommandResult(
            output="\n".join(lines),
            exit_code=code,
            is_timed_out=timed == 1,
            num_output_bytes=size,
            is_truncated=size > keep_bytes,
        )

    async def snapshot(self) -> dict[str, bytes]:
        """The workspace's regular files, by path relative to it (directories, links and modes are not kept).
        Raises `ShellLost` when the shell is gone or its snapshot cannot be read."""
        lines, marker = await self._exchange("dump {nonce} 0 0 0 -", CONTROLLER_SLACK_SECONDS)
        try:
            return _unpack("".join(lines).encode())
        except (ValueError, tarfile.TarError, EOFError, OSError) as error:
            raise ShellLost(f"the workspace could not be read (tar exit {marker[0]}): {error}") from None

    async def _exchange(self, request: str, limit_seconds: float) -> tuple[list[str], list[str]]:
        if self._is_closed:
            raise ShellLost("the shell is closed")
        nonce = secrets.token_hex(16)
        return await asyncio.to_thread(self._exchange_blocking, request.format(nonce=nonce), nonce, limit_seconds)

    def _exchange_blocking(self, request: str, nonce: str, limit_seconds: float) -> tuple[list[str], list[str]]:
        """Send one request and read lines up to its marker; only the controller writes to the session after the
        command ended, so the lines are the answer (a stray writer can add lines, never the nonce)."""
        if not self._session.send(request.encode(), timeout=CONTROLLER_SLACK_SECONDS):
            self._lose("the shell did not take the command")
        deadline = time.monotonic() + limit_seconds + CONTROLLER_SLACK_SECONDS
        lines: list[str] = []
        prefix = nonce + " "
        while True:
            line = self._session.receive(timeout=deadline - time.monotonic())
            if line is None:
                self._lose("the shell ended" if self._session.has_ended else "the shell stopped answering")
            self.num_received_bytes += len(line) + 1
            text = line.decode(errors="replace")
            if text.startswith(prefix):
                return lines[:-1] if lines and not lines[-1] else lines, text[len(prefix) :].split()
            lines.append(text)

    def _lose(self, message: str) -> NoReturn:
        result = self.close_blocking()
        status = result.status.value if result is not None else ""
        detail = f" ({result.detail})" if result is not None and result.detail else ""
        raise ShellLost(
            f"{message}: status {status}{detail}", status=status, detail=result.detail if result is not None else ""
        )

    def close_blocking(self) -> Any:
        """End the shell now; the session's `ExecutionResult` (None when it was closed before)."""
        if self._is_closed:
            return None
        self._is_closed = True
        self._finalizer.detach()
        return self._session.close(grace_seconds=0.0)

    async def close(self) -> None:
        await asyncio.to_thread(self.close_blocking)


def is_infrastructure_loss(error: ShellLost) -> bool:
    """Whether a lost shell is not the policy's doing: the sandbox failed, or the session ran into the sandbox's own
    wall clock (its ``wall_seconds`` shorter than the episode). A session the sandbox ended for its output (past
    ``max_output_bytes``) is the policy's doing: the controller cuts every command's output inside the sandbox and
    the environment's own traffic is bounded below the budget (each grading asks for at most what is left, the
    config's worst case is checked before the run), so only a command writing around the controller (to its
    output directly) gets there; counting that as an abstention would let a policy turn a failing episode into no
    episode."""
    return error.status in (ExecutionStatus.SANDBOX_ERROR.value, ExecutionStatus.TIMEOUT.value)


def _unpack(encoded: bytes) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    total = 0
    with tarfile.open(fileobj=io.BytesIO(base64.b64decode(encoded, validate=True)), mode="r:gz") as archive:
        for member in archive:
            if not member.isfile():
                continue
            total += member.size
            if total > MAX_SNAPSHOT_BYTES:
                raise ValueError(f"the workspace holds more than {MAX_SNAPSHOT_BYTES} bytes")
            extracted = archive.extractfile(member)
            assert extracted is not None  # a regular file always has content
            name = member.name.removeprefix("./")
            files[name] = extracted.read()
    return files


def _close_in_background(session: Any) -> None:
    """Close a shell whose environment was dropped without closing it (an episode the loop ended for a reason
    the environment is not told, such as its token budget); closing joins a thread, so not on the collector's."""
    threading.Thread(target=session.close, kwargs={"grace_seconds": 0.0}, daemon=True).start()
