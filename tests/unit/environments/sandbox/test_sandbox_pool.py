"""SandboxPool: bounded concurrency for asyncio callers, and warm workers held to the same statuses as the cold
sandbox on a subset of attacks, with nothing of one job visible to the next and nothing left after close."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sandbox_checks import (
    SHORT_WALL_SECONDS,
    cgroup_names,
    needs_bwrap,
    needs_root,
    sandbox_config,
    sandbox_processes,
)

from sharpen.environments.sandbox import ExecutionResult, ExecutionStatus, SandboxPool

OK, NONZERO, TIMEOUT, OOM, KILLED = (
    ExecutionStatus.OK,
    ExecutionStatus.NONZERO_EXIT,
    ExecutionStatus.TIMEOUT,
    ExecutionStatus.OOM,
    ExecutionStatus.KILLED,
)

pytestmark = needs_bwrap


def _max_overlap(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return peak


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_pool_runs_at_most_max_concurrency_jobs_at_once(warm: bool):
    code = "import time\nstart = time.time()\ntime.sleep(0.4)\nprint(start, time.time())"

    async def main() -> list[ExecutionResult]:
        async with SandboxPool(sandbox_config(max_concurrency=2, warm_workers=warm)) as pool:
            return await asyncio.gather(*(pool.run_python(code) for _ in range(6)))

    results = asyncio.run(main())
    assert [r.status for r in results] == [OK] * 6
    intervals = [(float(a), float(b)) for a, b in (r.stdout.split() for r in results)]
    assert _max_overlap(intervals) == 2  # concurrent, and never more than max_concurrency


@pytest.fixture(scope="module")
def warm_pool() -> Iterator[SandboxPool]:
    pool = SandboxPool(sandbox_config(max_concurrency=1, warm_workers=True))
    sandbox = pool.sandbox
    cgroup_paths, names = [d.path for d in sandbox.cgroup_dirs], cgroup_names(sandbox)
    yield pool
    pool.close()
    assert not sandbox.state_dir.exists() and not any(path.exists() for path in cgroup_paths)
    assert sandbox_processes(names) == []


def run(pool: SandboxPool, code: str | None = None, argv: list[str] | None = None, **kwargs) -> ExecutionResult:
    if argv is not None:
        return asyncio.run(pool.run(argv, **kwargs))
    assert code is not None
    return asyncio.run(pool.run_python(textwrap.dedent(code), **kwargs))


def test_warm_job_runs_like_python_main_py(warm_pool: SandboxPool):
    code = """
        import os, sys, helper
        print(__name__, __file__, sys.argv, os.getcwd(), os.getuid(), helper.X, sys.stdin.read())
    """
    result = run(warm_pool, code, files={"helper.py": "X = 1"}, stdin="in")
    assert (result.status, result.stdout) == (
        OK,
        "__main__ /home/sandbox/main.py ['main.py'] /home/sandbox 65534 1 in\n",
    )
    traceback = run(warm_pool, "def f():\n    1 / 0\nf()")
    assert traceback.status == NONZERO and traceback.stderr.splitlines()[1].startswith('  File "/home/sandbox/main.py"')
    threads = run(
        warm_pool, "import threading, time\nthreading.Thread(target=lambda: (time.sleep(0.1), print(2))).start()"
    )
    assert threads.stdout == "2\n"  # non-daemon threads are joined at exit, as by the interpreter


@pytest.mark.parametrize(
    ("code", "status", "exit_code"),
    [
        ("import sys; sys.exit(0)", OK, 0),
        ("import os; os._exit(0)", OK, 0),
        ("import sys; sys.exit(3)", NONZERO, 3),
        ("import os; os._exit(7)", NONZERO, 7),
        ("import sys; sys.exit('message')", NONZERO, 1),
    ],
)
def test_warm_exit_codes_are_faithful(warm_pool: SandboxPool, code: str, status: ExecutionStatus, exit_code: int):
    result = run(warm_pool, code)
    assert (result.status, result.exit_code) == (status, exit_code)


def test_warm_job_sees_no_network_host_file_or_secret(
    warm_pool: SandboxPool, host_listener: socket.socket, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("SHARPEN_TEST_SECRET", "hunter2")
    port = host_listener.getsockname()[1]
    code = f"""
        import os, socket
        print([name for _, name in socket.if_nameindex()], os.path.exists("/etc/shadow"), os.path.exists("/work"))
        print("SHARPEN_TEST_SECRET" in os.environ)
        socket.create_connection(("127.0.0.1", {port}), timeout=1)
    """
    result = run(warm_pool, code)
    assert result.status == NONZERO and result.stdout == "['lo'] False False\nFalse\n"
    assert "ConnectionRefusedError" in result.stderr
    with pytest.raises(BlockingIOError):
        host_listener.accept()


def test_warm_job_cannot_kill_or_read_its_worker(warm_pool: SandboxPool):
    code = """
        import os, signal
        for number in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
            os.kill(os.getppid(), number)
        try:
            open("/proc/1/mem", "rb")
        except OSError as error:
            print(os.getppid(), error.errno)
    """
    assert run(warm_pool, code).stdout == "1 13\n"  # the worker is pid 1; its memory is not readable
    assert run(warm_pool, argv=["sh", "-c", "kill -9 -1; echo alive"]).stdout == "alive\n"
    assert run(warm_pool, "print('next')").stdout == "next\n"  # the same worker serves the next job


def test_warm_job_leaves_nothing_for_the_next(warm_pool: SandboxPool):
    daemon = """
        import os, subprocess
        open("mine.txt", "w").write("x")
        open("/tmp/left.txt", "w").write("x")
        if os.fork() == 0:
            os.setsid()
            subprocess.Popen(["sleep", "60"])
            os._exit(0)
        print("started")
    """
    assert run(warm_pool, daemon).stdout == "started\n"
    after = run(warm_pool, argv=["sh", "-c", "ls -A . /tmp; ps -eo comm="])
    assert after.status == OK
    lines = after.stdout.splitlines()
    assert lines[:3] == [".:", "", "/tmp:"]  # both directories empty
    assert not any("sleep" in line for line in lines)  # only the worker (pid 1) and this job's processes


@needs_root
def test_warm_resource_attacks_get_the_cold_statuses(warm_pool: SandboxPool):
    cases = {
        "while True:\n    pass": (TIMEOUT, None),  # cpu_seconds (SIGXCPU)
        "x = []\nwhile True:\n    x.append(bytearray(8 << 20))": (OOM, None),
        "while True:\n    print('x' * 1000)": (KILLED, None),
        "open('big', 'wb').write(b'x' * (4 << 20))": (NONZERO, 1),
    }
    for code, (status, exit_code) in cases.items():
        result = run(warm_pool, code)
        assert (result.status, result.exit_code) == (status, exit_code), (code, result)
    processes = "import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()) == [1, os.getpid()])"
    assert run(warm_pool, processes).stdout == "True\n"  # the worker and this job: every attacker is gone


@needs_root
def test_warm_wall_clock_attacks_time_out_and_the_worker_recovers():
    with SandboxPool(sandbox_config(max_concurrency=1, warm_workers=True, wall_seconds=SHORT_WALL_SECONDS)) as pool:
        for code in (
            "import time\ntime.sleep(30)",
            "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        ):
            result = run(pool, code)
            assert result.status == TIMEOUT and SHORT_WALL_SECONDS <= result.wall_seconds < SHORT_WALL_SECONDS + 1
        assert run(pool, "print('fine')").stdout == "fine\n"


@needs_root
def test_a_warm_worker_that_died_between_jobs_is_replaced():
    with SandboxPool(sandbox_config(max_concurrency=1, warm_workers=True)) as pool:
        assert run(pool, "print(1)").stdout == "1\n"
        # The host kills the worker's controller, as the OOM killer might (bwrap's monitor then reaps it and exits).
        pids = {
            int(pid)
            for d in pool.sandbox.cgroup_dirs
            for job in d.path.iterdir()
            if job.is_dir()
            for pid in (job / "cgroup.procs").read_text().split()
        }
        for pid in pids:
            if _parent(pid) in pids:
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
        assert run(pool, "print(2)").stdout == "2\n"


def _parent(pid: int) -> int:
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(status["PPid"])


@needs_root
def test_pool_close_leaves_nothing():
    async def main() -> frozenset[str]:
        async with SandboxPool(sandbox_config(max_concurrency=2, warm_workers=True)) as pool:
            results = await asyncio.gather(*(pool.run(["sh", "-c", "sleep 60 & echo x"]) for _ in range(4)))
            assert {r.stdout for r in results} == {"x\n"}
            state_dir, cgroups = pool.sandbox.state_dir, [d.path for d in pool.sandbox.cgroup_dirs]
            names = cgroup_names(pool.sandbox)
        assert not state_dir.exists() and not any(path.exists() for path in cgroups)
        return names

    names = asyncio.run(main())
    assert sandbox_processes(names) == []  # another module-scoped pool may be alive: its processes do not count
