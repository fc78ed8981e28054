"""The cold sandbox (bwrap) against attacks: each test asserts the attack is contained AND the status is right,
and that the execution left nothing behind on the host."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from sandbox_checks import (
    SHORT_WALL_SECONDS,
    SMALL_LIMITS,
    assert_nothing_left,
    cgroup_names,
    needs_bwrap,
    needs_root,
    sandbox_config,
    sandbox_processes,
)

from sharpen.environments.sandbox import ExecutionStatus, Sandbox
from sharpen.environments.sandbox.bwrap import BwrapBackend
from sharpen.environments.sandbox.launch import Launch

OK, NONZERO, TIMEOUT, OOM, KILLED = (
    ExecutionStatus.OK,
    ExecutionStatus.NONZERO_EXIT,
    ExecutionStatus.TIMEOUT,
    ExecutionStatus.OOM,
    ExecutionStatus.KILLED,
)


def test_code_runs_with_files_stdin_and_sibling_imports(sandbox: Sandbox):
    files = {"helper.py": "ANSWER = 42\n", "data/in.txt": b"\x00\x01"}
    code = "import sys, helper; print(helper.ANSWER, open('data/in.txt','rb').read(), sys.stdin.read().upper())"
    result = sandbox.run_python(code, files=files, stdin="hello")
    assert (result.status, result.exit_code, result.stdout) == (OK, 0, "42 b'\\x00\\x01' HELLO\n")
    assert result.backend == "bwrap" and not result.is_output_truncated
    assert_nothing_left(sandbox)


def test_code_is_not_root_and_sees_a_minimal_filesystem(sandbox: Sandbox):
    code = "import os; print(os.getuid(), os.getgid(), os.getcwd(), sorted(os.listdir('/')))"
    result = sandbox.run_python(code)
    assert result.stdout.split(" ", 3)[:3] == ["65534", "65534", "/home/sandbox"]
    assert "work" not in result.stdout and "root" not in result.stdout


def test_network_sees_only_its_own_loopback(sandbox: Sandbox, host_listener: socket.socket):
    port = host_listener.getsockname()[1]
    code = f"""
        import socket
        print([name for _, name in socket.if_nameindex()])
        try:
            socket.create_connection(("127.0.0.1", {port}), timeout=1)
            print("connected")
        except OSError as error:
            print(type(error).__name__)
    """
    result = sandbox.run_python(textwrap.dedent(code))
    assert (result.status, result.stdout) == (OK, "['lo']\nConnectionRefusedError\n")
    with pytest.raises(BlockingIOError):
        host_listener.accept()  # nothing reached the host


def test_host_files_do_not_exist_inside(sandbox: Sandbox):
    project_file = Path(__file__).resolve()
    result = sandbox.run(["cat", str(project_file), "/etc/shadow", "/root/.bashrc", "/work/main/pyproject.toml"])
    assert result.status == NONZERO and result.exit_code == 1
    assert result.stdout == "" and result.stderr.count("No such file or directory") == 4
    assert sandbox.run(["ls", "/root", "/work"]).status == NONZERO


def test_writes_outside_the_work_dir_fail_and_never_reach_the_host(sandbox: Sandbox):
    token = uuid.uuid4().hex
    script = f"for p in /{token} /etc/{token} /usr/{token} /home/{token}; do echo x > $p; done; echo x > /tmp/{token}"
    result = sandbox.run(["sh", "-c", script + "; ls /tmp"])
    assert result.status == OK and result.stdout == f"{token}\n"  # its private /tmp only
    assert result.stderr.count("Read-only file system") == 4
    for host_dir in ("/", "/tmp", "/dev/shm", "/etc", "/home"):
        assert not Path(host_dir, token).exists()


def test_symlinks_in_the_work_dir_escape_nothing(sandbox: Sandbox, tmp_path: Path):
    canary = tmp_path / "canary"
    canary.write_text("keep")
    script = f"ln -s /etc/shadow shadow; cat shadow; ln -s ../../.. up; ls up; ln -s {tmp_path} host; ls host"
    result = sandbox.run(["sh", "-c", script])
    assert "No such file" in result.stderr and "canary" not in result.stdout
    assert canary.read_text() == "keep"  # removing the work dir did not follow the link
    assert_nothing_left(sandbox)


def test_secrets_in_the_parent_environment_do_not_leak(sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SHARPEN_TEST_SECRET", "hunter2")
    result = sandbox.run(["sh", "-c", "env; echo; tr '\\0' '\\n' < /proc/self/environ; cat /proc/1/environ"])
    assert result.status == NONZERO and "hunter2" not in result.stdout and "SHARPEN_TEST_SECRET" not in result.stdout
    assert "Permission denied" in result.stderr  # the init (pid 1) is not dumpable: its environ is not readable
    own_environment = result.stdout.split("\n\n")[0]
    assert {line.split("=")[0] for line in own_environment.splitlines()} == {"HOME", "LANG", "PATH", "PWD", "TMPDIR"}


@pytest.mark.parametrize(
    ("code", "status", "exit_code"),
    [
        ("import sys; sys.exit(0)", OK, 0),
        ("import os; os._exit(0)", OK, 0),
        ("print('done')", OK, 0),
        ("import sys; sys.exit(3)", NONZERO, 3),
        ("import os; os._exit(7)", NONZERO, 7),
        ("raise ValueError('no')", NONZERO, 1),
        ("import sys; sys.exit('message')", NONZERO, 1),
    ],
)
def test_exit_codes_are_reported_faithfully(sandbox: Sandbox, code: str, status: ExecutionStatus, exit_code: int):
    result = sandbox.run_python(code)
    assert (result.status, result.exit_code, result.signal) == (status, exit_code, None)


def test_a_death_by_signal_is_killed(sandbox: Sandbox):
    result = sandbox.run_python("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    assert (result.status, result.signal, result.exit_code) == (KILLED, 11, None)  # the real wait status


@needs_root
def test_fork_bomb_is_contained_and_leaves_no_process(short_sandbox: Sandbox):
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    result = short_sandbox.run_python(code)
    assert result.status == TIMEOUT
    assert subprocess.run(["true"]).returncode == 0  # the host can still fork
    assert_nothing_left(short_sandbox)


@needs_root
def test_process_count_is_capped_by_the_pids_cgroup(sandbox: Sandbox):
    code = """
        import os, time
        children = 0
        while True:
            try:
                pid = os.fork()
            except OSError as error:
                print(children, error.errno)
                break
            if pid == 0:
                time.sleep(60)
                os._exit(0)
            children += 1
    """
    result = sandbox.run_python(textwrap.dedent(code))
    children, errno = map(int, result.stdout.split())
    # The program itself counts too; RLIMIT_NPROC would not have stopped root-mapped processes.
    assert (result.status, errno) == (OK, 11) and children == SMALL_LIMITS["max_processes"] - 1
    assert_nothing_left(sandbox)  # the sleeping children went with the execution


@needs_root
def test_shell_fork_bomb_is_contained(short_sandbox: Sandbox):
    result = short_sandbox.run(["bash", "-c", "b() { b | b & }; b"])
    assert result.status in (TIMEOUT, OK, NONZERO)  # bash gives up on fork failures; never past the wall clock
    assert result.wall_seconds < SHORT_WALL_SECONDS + 1
    assert_nothing_left(short_sandbox)


@needs_root
def test_memory_bomb_is_oom(sandbox: Sandbox):
    result = sandbox.run_python("chunks = []\nwhile True:\n    chunks.append(bytearray(8 << 20))")
    assert result.status == OOM
    assert_nothing_left(sandbox)


def test_one_huge_allocation_fails_inside(sandbox: Sandbox):
    result = sandbox.run_python("x = bytearray(8 << 30)")
    assert result.status == NONZERO and result.stderr.strip().endswith("MemoryError")


def test_cpu_spin_ends_at_the_cpu_limit(sandbox: Sandbox):
    result = sandbox.run_python("while True:\n    pass")  # 1 CPU second, far below the wall clock
    assert (result.status, result.signal) == (TIMEOUT, 24) and result.detail.startswith("CPU-time limit")


def test_sleeping_past_the_wall_clock_is_a_timeout(short_sandbox: Sandbox):
    result = short_sandbox.run(["sleep", "30"])
    assert result.status == TIMEOUT and result.exit_code is None
    assert SHORT_WALL_SECONDS <= result.wall_seconds < SHORT_WALL_SECONDS + 1
    assert_nothing_left(short_sandbox)


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_endless_output_is_truncated_and_killed(sandbox: Sandbox, stream: str):
    result = sandbox.run_python(f"import sys\nwhile True:\n    sys.{stream}.write('x' * 1000)")
    assert result.status == KILLED and result.is_output_truncated
    assert len(getattr(result, stream)) == SMALL_LIMITS["max_output_bytes"]
    assert_nothing_left(sandbox)


def test_file_descriptor_exhaustion_stops_at_the_limit(sandbox: Sandbox):
    code = "files = []\ntry:\n    while True:\n        files.append(open('/dev/null'))\nexcept OSError as e:\n"
    result = sandbox.run_python(code + "    print(len(files), e.errno)")
    count, errno = map(int, result.stdout.split())
    assert result.status == OK and errno == 24 and count < SMALL_LIMITS["max_open_files"]


@needs_root
def test_signalling_the_parent_or_everything_hurts_no_one_outside(sandbox: Sandbox):
    # A host process of the sandbox uid: `kill -9 -1` would reach it if the pid namespace did not hold.
    canary = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sleep", "30"])
    try:
        parent = sandbox.run_python("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('alive')")
        everyone = sandbox.run(["sh", "-c", "kill -9 -1; echo alive"])
        assert (parent.status, parent.stdout) == (OK, "alive\n")
        assert (everyone.status, everyone.stdout) == (OK, "alive\n")
        assert canary.poll() is None
        assert_nothing_left(sandbox, allowed_pids=(canary.pid,))
    finally:
        canary.kill()
        canary.wait()


@needs_root
def test_a_daemon_that_outlives_the_job_is_killed(sandbox: Sandbox):
    token = str(4000 + os.getpid() % 1000)
    daemon = f"""
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execvp("sleep", ["sleep", "{token}"])
            os._exit(0)
        print("started")
    """
    result = sandbox.run_python(textwrap.dedent(daemon))
    assert (result.status, result.stdout) == (OK, "started\n")
    assert result.wall_seconds < SMALL_LIMITS["wall_seconds"] / 2  # it did not wait for the daemon
    assert sandbox_processes(cgroup_names(sandbox)) == []
    assert_nothing_left(sandbox)


def test_writing_a_huge_file_hits_the_file_size_limit(sandbox: Sandbox):
    python = sandbox.run_python("open('big', 'wb').write(b'x' * (4 << 20))")
    assert python.status == NONZERO and "File too large" in python.stderr  # Python ignores SIGXFSZ
    shell = sandbox.run(["dd", "if=/dev/zero", "of=big", "bs=1M", "count=4"])
    assert (shell.status, shell.signal) == (KILLED, 25)  # SIGXFSZ


def test_new_user_namespaces_and_keyrings_are_denied(sandbox: Sandbox):
    assert sandbox.run(["unshare", "--user", "true"]).status == NONZERO
    keyctl = {"x86_64": 250, "aarch64": 219}[platform.machine()]
    code = f"import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nprint(libc.syscall({keyctl}, 0, -3, 0))"
    code += "\nprint(ctypes.get_errno())"
    assert sandbox.run_python(code).stdout == "-1\n1\n"  # keyctl(KEYCTL_GET_KEYRING_ID, session keyring): EPERM


def test_a_sandbox_failure_is_never_ok_or_nonzero_exit(sandbox: Sandbox):
    # The program cannot fake a sandbox failure: this is its own exit, after the sandbox started it.
    faked = sandbox.run(["sh", "-c", "echo 'bwrap: setting up uid map: Permission denied' >&2; exit 1"])
    assert faked.status == NONZERO
    # A chain that fails before the program starts (no ready marker) is a sandbox error.
    config = sandbox.config.model_copy(update={"extra_ro_binds": ["/nonexistent-sharpen-source:/opt/x"]})
    broken = BwrapBackend(config)
    launch = Launch(sandbox.plan_for(broken))
    launch.start(["true"], files={}, stdin=b"")
    result = launch.finish()
    assert result.status == ExecutionStatus.SANDBOX_ERROR and "nonexistent-sharpen-source" in result.detail
    assert not result.is_program_started and faked.is_program_started
    assert_nothing_left(sandbox)


@needs_bwrap
@needs_root
def test_sandbox_prepared_ahead_is_fresh_for_every_execution():
    with Sandbox(sandbox_config(backend="bwrap", prepare_ahead=True)) as box:
        names = cgroup_names(box)
        first = box.run(["sh", "-c", "echo secret > left.txt; echo x > /tmp/left.txt; (sleep 60 &); ls"])
        assert (first.status, first.stdout) == (OK, "left.txt\n")
        # The next sandbox was set up while the first ran; it has run nothing and sees nothing of the first.
        second = box.run(["sh", "-c", "ls -A . /tmp; ps -eo comm="], files={"mine.txt": "x"})
        assert second.stdout.split("\n\n")[0] == ".:\nmine.txt"
        assert second.stdout.split("\n\n")[1].splitlines()[:1] == ["/tmp:"] and "sleep" not in second.stdout
        # Idle, it holds one prepared sandbox (a job cgroup, bwrap's monitor and the init); close removes it.
        assert list((box.state_dir / "runs").iterdir()) == []  # and nothing on a host filesystem
        deadline = time.monotonic() + 10
        while _prepared_pids(box) != set(sandbox_processes(names)) or len(_prepared_pids(box)) != 2:
            assert time.monotonic() < deadline, (_prepared_pids(box), sandbox_processes(names))
            time.sleep(0.01)  # it is still setting itself up in the background
    assert sandbox_processes(names) == []


def _prepared_pids(box: Sandbox) -> set[int]:
    jobs = [job for controller_dir in box.cgroup_dirs for job in controller_dir.path.iterdir() if job.is_dir()]
    return {int(pid) for job in jobs for pid in (job / "cgroup.procs").read_text().split()}
