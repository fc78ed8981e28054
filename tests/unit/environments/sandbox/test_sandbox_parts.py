"""The sandbox's parts: the probe and the refusal of weak isolation, the medium and weak backends, cgroup
discovery, the seccomp filter, output capture, status classification and argument checks."""

from __future__ import annotations

import logging
import socket
import tempfile
import textwrap
import uuid
from pathlib import Path

import pytest
from pydantic import ValidationError
from sandbox_checks import (
    IS_ROOT,
    SHORT_WALL_SECONDS,
    assert_nothing_left,
    cgroup_names,
    needs_bwrap,
    needs_root,
    sandbox_config,
    sandbox_processes,
)

from sharpen.config.sandbox import SandboxConfig
from sharpen.environments.sandbox import ExecutionResult, ExecutionStatus, IsolationReport, Sandbox, SandboxUnavailable
from sharpen.environments.sandbox.backends import Backend
from sharpen.environments.sandbox.capture import StreamCapture
from sharpen.environments.sandbox.cgroups import find_controller_dirs
from sharpen.environments.sandbox.probe import host_gaps, select_backend
from sharpen.environments.sandbox.result import IsolationLevel, ProcessOutcome, classify
from sharpen.environments.sandbox.seccomp import seccomp_filter

# ---------------------------------------------------------------------------------------------- probe and report


class _FakeBackend(Backend):
    def __init__(self, name: str, level: IsolationLevel, works: bool) -> None:
        self.name, self.level, self.works = name, level, works


def _fake_probe(backend: Backend) -> ExecutionResult:
    assert isinstance(backend, _FakeBackend)
    status = ExecutionStatus.OK if backend.works else ExecutionStatus.SANDBOX_ERROR
    return ExecutionResult(
        status=status, exit_code=0, stdout="", stderr="", wall_seconds=0.0, is_output_truncated=False, backend=""
    )


def test_auto_takes_the_strongest_backend_that_works():
    candidates = [_FakeBackend("bwrap", "strong", False), _FakeBackend("unshare", "medium", True)]
    config = SandboxConfig(min_isolation="medium")
    backend, report = select_backend(config, candidates, _fake_probe, host_missing=[])
    assert backend.name == "unshare" and report == IsolationReport(backend="unshare", level="medium")


def test_auto_never_falls_below_min_isolation_and_says_how_to_accept_it():
    probed: list[str] = []

    def probe(backend: Backend) -> ExecutionResult:
        probed.append(backend.name)
        return _fake_probe(backend)

    candidates = [_FakeBackend("bwrap", "strong", False), _FakeBackend("unshare", "medium", True)]
    with pytest.raises(SandboxUnavailable) as error:
        select_backend(SandboxConfig(), candidates, probe, host_missing=[])  # min_isolation = "strong" by default
    assert probed == ["bwrap"]  # the weaker backend never ran anything
    message = str(error.value)
    assert "bwrap: probe ended sandbox_error" in message and "sandbox.min_isolation to 'medium'" in message


def test_a_named_backend_that_does_not_work_is_unavailable():
    candidates = [_FakeBackend("bwrap", "strong", False), _FakeBackend("unshare", "medium", True)]
    with pytest.raises(SandboxUnavailable, match="bwrap: probe ended sandbox_error"):
        select_backend(SandboxConfig(backend="bwrap"), candidates, _fake_probe, host_missing=[])


def test_weak_isolation_is_refused_unless_allowed(caplog: pytest.LogCaptureFixture):
    candidates = [_FakeBackend("bwrap", "strong", False), _FakeBackend("process", "weak", True)]
    with pytest.raises(SandboxUnavailable, match="min_isolation"):
        select_backend(SandboxConfig(), candidates, _fake_probe, host_missing=[])
    with pytest.raises(SandboxUnavailable, match="min_isolation"):
        select_backend(SandboxConfig(min_isolation="medium"), candidates, _fake_probe, host_missing=[])
    with caplog.at_level(logging.WARNING):
        _, report = select_backend(SandboxConfig(min_isolation="weak"), candidates, _fake_probe, host_missing=[])
    assert report.level == "weak" and "weak isolation" in caplog.text  # never silent


@needs_bwrap
@needs_root
def test_this_host_gets_strong_isolation_with_nothing_missing():
    with Sandbox(sandbox_config()) as sandbox:
        assert sandbox.report == IsolationReport(backend="bwrap", level="strong", missing=())


@needs_root
def test_the_real_weak_backend_is_refused_and_cleans_up():
    before = set(Path("/dev/shm").iterdir())
    with pytest.raises(SandboxUnavailable, match="min_isolation to 'weak'"):
        Sandbox(sandbox_config(backend="process"))
    assert set(Path("/dev/shm").iterdir()) == before


@needs_root
def test_the_weak_backend_when_allowed_warns_and_still_limits(caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.WARNING), Sandbox(sandbox_config(backend="process", min_isolation="weak")) as box:
        assert box.report.level == "weak" and "network isolation" in " ".join(box.report.missing)
        assert "weak isolation" in caplog.text
        shadow = box.run(["cat", "/etc/shadow"])
        assert shadow.status == ExecutionStatus.NONZERO_EXIT and "Permission denied" in shadow.stderr  # uid 65534
        daemon = box.run(["sh", "-c", "(setsid sleep 4242 &); echo started"])
        assert (daemon.status, daemon.stdout) == (ExecutionStatus.OK, "started\n")
        assert box.run_python("while True:\n    pass").status == ExecutionStatus.TIMEOUT
        # Killed processes of a namespace-less sandbox are reaped by the host's init: only zombies may linger.
        assert sandbox_processes(cgroup_names(box), include_zombies=False) == []


@needs_root
def test_the_unshare_backend_is_medium_and_contains_the_basics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SHARPEN_TEST_SECRET", "hunter2")
    token = uuid.uuid4().hex
    with (
        Sandbox(sandbox_config(backend="unshare", min_isolation="medium", wall_seconds=SHORT_WALL_SECONDS)) as box,
        socket.socket() as listener,
    ):
        assert (box.report.backend, box.report.level) == ("unshare", "medium")
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        code = f"""
            import os, socket
            interfaces = [name for _, name in socket.if_nameindex()]
            print(interfaces, os.getuid(), os.getcwd(), "SHARPEN_TEST_SECRET" in os.environ)
            open("/tmp/{token}", "w").write("x")
            open("/etc/shadow")
        """
        result = box.run_python(textwrap.dedent(code))
        assert result.stdout == "['lo'] 65534 /home/sandbox False\n" and "PermissionError" in result.stderr
        assert not Path("/tmp", token).exists()
        assert box.run(["sh", "-c", "kill -9 -1; echo alive"]).stdout == "alive\n"
        assert box.run(["sleep", "30"]).status == ExecutionStatus.TIMEOUT
        assert_nothing_left(box)


@needs_bwrap
def test_extra_ro_binds_are_visible_and_read_only():
    with tempfile.TemporaryDirectory() as shared:  # not under pytest's tmp_path: the sandbox uid cannot reach that
        Path(shared).chmod(0o755)
        (Path(shared) / "lib.py").write_text("VALUE = 7\n")
        _check_extra_bind(shared)


def _check_extra_bind(shared: str) -> None:
    with Sandbox(sandbox_config(backend="bwrap", extra_ro_binds=[f"{shared}:/opt/extra"])) as box:
        result = box.run_python("import sys\nsys.path.append('/opt/extra')\nimport lib\nprint(lib.VALUE)")
        assert (result.status, result.stdout) == (ExecutionStatus.OK, "7\n")
        assert "Read-only file system" in box.run(["touch", "/opt/extra/x"]).stderr


def test_config_rejects_binds_that_are_not_absolute_or_cover_the_sandbox():
    for bind in ("relative/path", "/src:relative", "/src:/tmp", "/src:/home/sandbox/x", "/src:/"):
        with pytest.raises(ValidationError, match="extra_ro_binds"):
            SandboxConfig(extra_ro_binds=[bind])
    with pytest.raises(ValidationError, match="absolute"):
        SandboxConfig(python_executable="python3")


# ------------------------------------------------------------------------------------------------------- cgroups

_MOUNTS_V1 = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
_OWN_V1 = "8:pids:/\n4:memory:/process_api/abc\n2:cpu,cpuacct:/\n0::/\n"
_MOUNTS_V2 = "30 23 0:27 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
_OWN_V2 = "0::/user.slice/session-1.scope\n"


def test_cgroup_discovery_finds_v1_groups_under_our_own_and_v2_at_the_root():
    assert find_controller_dirs(_MOUNTS_V1, _OWN_V1) == {
        "pids": (1, Path("/sys/fs/cgroup/pids")),
        "memory": (1, Path("/sys/fs/cgroup/memory/process_api/abc")),
        "cpu": (1, Path("/sys/fs/cgroup/cpu,cpuacct")),
    }
    assert find_controller_dirs(_MOUNTS_V2, _OWN_V2) == {
        "pids": (2, Path("/sys/fs/cgroup")),
        "memory": (2, Path("/sys/fs/cgroup")),
        "cpu": (2, Path("/sys/fs/cgroup")),
    }


# ------------------------------------------------------------------------------------------------------- seccomp


def test_seccomp_filter_exists_for_known_architectures_only():
    for machine in ("x86_64", "aarch64"):
        program = seccomp_filter(machine)
        assert program is not None and len(program) % 8 == 0
    assert seccomp_filter("riscv64") is None


@needs_bwrap
def test_seccomp_denies_sysv_ipc_and_ptrace_but_not_threads_or_processes(sandbox: Sandbox):
    code = """
        import ctypes, subprocess, threading
        libc = ctypes.CDLL(None, use_errno=True)
        print(libc.shmget(0, 4096, 0o1600), ctypes.get_errno(), libc.ptrace(0, 0, 0, 0), ctypes.get_errno())
        thread = threading.Thread(target=print, args=("thread",))
        thread.start()
        thread.join()
        print(subprocess.run(["true"]).returncode)
    """
    result = sandbox.run_python(textwrap.dedent(code))
    assert (result.status, result.stdout) == (ExecutionStatus.OK, "-1 1 -1 1\nthread\n0\n")


# ------------------------------------------------------------------------------------ capture and classification


def test_stream_capture_checks_the_marker_across_chunks_and_caps_the_rest():
    stream = StreamCapture(max_bytes=5, marker=b"<ok>")
    assert not stream.feed(b"<o") and not stream.is_marker_seen
    assert not stream.feed(b"k>abc") and stream.is_marker_seen
    assert stream.feed(b"defgh") and stream.is_truncated and bytes(stream.data) == b"abcde"
    forged = StreamCapture(max_bytes=5, marker=b"<ok>")
    forged.feed(b"bwrap: error")
    assert forged.is_marker_broken and not forged.is_marker_seen


def test_classification_prefers_what_the_sandbox_did_over_the_signal():
    cases = [
        (ProcessOutcome(is_started=True, signal=9, is_timed_out=True), ExecutionStatus.TIMEOUT),
        (ProcessOutcome(is_started=True, exit_code=137, signal=9, is_oom=True), ExecutionStatus.OOM),
        (ProcessOutcome(is_started=True, signal=9, is_output_overflow=True), ExecutionStatus.KILLED),
        (ProcessOutcome(is_started=True, exit_code=152, signal=24), ExecutionStatus.TIMEOUT),  # SIGXCPU: the CPU limit
        (ProcessOutcome(is_started=True, exit_code=139, signal=11), ExecutionStatus.KILLED),
        (ProcessOutcome(is_started=True, exit_code=0), ExecutionStatus.OK),
        (ProcessOutcome(is_started=True, exit_code=3), ExecutionStatus.NONZERO_EXIT),
        (ProcessOutcome(is_started=False, exit_code=0), ExecutionStatus.SANDBOX_ERROR),
        (ProcessOutcome(is_started=False, error="bwrap: setting up uid map"), ExecutionStatus.SANDBOX_ERROR),
        # Once the program started, no fault is the sandbox's: the program's own failure, never an abstention.
        (ProcessOutcome(is_started=True, exit_code=0, error="cleanup failed"), ExecutionStatus.KILLED),
        (ProcessOutcome(is_started=True, exit_code=137), ExecutionStatus.NONZERO_EXIT),  # exit(137) is no SIGKILL
        (ProcessOutcome(is_started=True, signal=40), ExecutionStatus.KILLED),  # a real-time signal
    ]
    for outcome, status in cases:
        assert classify(outcome, wall_seconds=1.0)[0] == status, outcome


@needs_bwrap
def test_bad_arguments_raise_value_error(sandbox: Sandbox):
    for name in ("/etc/passwd", "../up.txt", "a/../../b", "", "."):
        with pytest.raises(ValueError, match="relative path"):
            sandbox.run(["true"], files={name: "x"})
    with pytest.raises(ValueError, match="argv is empty"):
        sandbox.run([])
    with pytest.raises(ValueError, match=r"main\.py"):
        sandbox.run_python("pass", files={"main.py": "x"})


def test_a_host_without_a_cpu_controller_reports_the_cpu_limit_missing():
    gaps = host_gaps(has_pids_cgroup=True, has_memory_cgroup=True, has_cpu_cgroup=False)
    assert any(gap.startswith("CPU-bandwidth limit (cpu_fraction)") for gap in gaps)
    assert not any("CPU" in gap for gap in host_gaps(has_pids_cgroup=True, has_memory_cgroup=True, has_cpu_cgroup=True))


def test_not_root_is_reported_as_missing():
    if IS_ROOT:
        pytest.skip("runs as root: the uid gap does not exist here")
    with Sandbox(sandbox_config()) as box:
        assert any("separate uid" in gap for gap in box.report.missing)
