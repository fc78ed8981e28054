"""Three sandbox replicas in their own processes, one killed (SIGKILL) while it runs executions: every execution
still returns exactly one result, its own, and none ran twice except where the first run died with its replica
(each replica logs what it finished: remote_replica.py)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from sharpen.config.sandbox import SandboxConfig
from sharpen.environments.sandbox import ExecutionStatus
from sharpen.environments.sandbox.remote import RemoteSandbox

TOKEN = "remote-kill-test-token"
NUM_EXECUTIONS = 60
pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


@pytest.fixture
def replicas(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[list[tuple[subprocess.Popen[str], str, Path]]]:
    monkeypatch.setenv("SHARPEN_SERVICE_TOKEN", TOKEN)
    script = Path(__file__).with_name("remote_replica.py")
    started = []
    for index in range(3):
        log = tmp_path / f"replica-{index}.log"
        process = subprocess.Popen([sys.executable, str(script), str(log)], stdout=subprocess.PIPE, text=True)
        started.append((process, log))
    try:
        found = []
        for process, log in started:
            assert process.stdout is not None
            url = process.stdout.readline().strip()
            assert url.startswith("http://"), f"replica did not start: {url!r}"
            found.append((process, url, log))
        yield found
    finally:
        for process, _ in started:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process, _ in started:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _running(url: str) -> float:
    metrics = httpx.get(url + "/metrics", timeout=5).text
    return float(next(line.split()[1] for line in metrics.splitlines() if line.startswith("sharpen_requests_running ")))


def test_a_replica_killed_mid_run_loses_no_execution_and_repeats_none(
    replicas: list[tuple[subprocess.Popen[str], str, Path]],
) -> None:
    urls = [url for _, url, _ in replicas]
    config = SandboxConfig(backend="remote", remote={"urls": urls, "backoff_s": 0.05, "max_retries": 20})
    code = "import time; time.sleep(0.2); print('exec-{}')"
    with RemoteSandbox(config) as remote, ThreadPoolExecutor(max_workers=9) as threads:
        futures = [threads.submit(remote.run_python, code.format(i)) for i in range(NUM_EXECUTIONS)]
        victim, victim_url, victim_log = replicas[0]
        deadline = time.monotonic() + 30
        while not (victim_log.exists() and victim_log.read_text().count("\n") >= 2 and _running(victim_url) >= 1):
            assert time.monotonic() < deadline, "the replica to kill never got busy"
            time.sleep(0.02)
        victim.send_signal(signal.SIGKILL)  # mid-execution: it has work running
        victim.wait(timeout=10)
        results = [future.result(timeout=120) for future in futures]
    assert [(r.status, r.stdout) for r in results] == [
        (ExecutionStatus.OK, f"exec-{i}\n") for i in range(NUM_EXECUTIONS)
    ]
    finished = [Counter(log.read_text().split()) for _, _, log in replicas]
    survivors = finished[1] + finished[2]
    assert max(survivors.values()) == 1, "a live replica never runs one execution twice"
    assert max(finished[0].values()) == 1
    assert set(survivors) | set(finished[0]) == {f"exec-{i}" for i in range(NUM_EXECUTIONS)}
    assert all(process.poll() is None for process, _, _ in replicas[1:])
