"""The red-team suite: every attack of attacks.py against the cold `Sandbox` and warm `SandboxPool` workers,
each asserting that the defence holds (and that no attack can make the sandbox abstain: the program always
started, and its outcome is never ``sandbox_error``), and the same attacks against the naive path (naive.py),
asserting that each one does succeed there, so that every check here can fail."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from attacks import ATTACKS, CPU_FRACTION, Attack
from naive import run_naive
from sandbox_checks import assert_nothing_left, cgroup_names, needs_bwrap, needs_root, sandbox_config, sandbox_processes

from sharpen.environments.sandbox import ExecutionResult, ExecutionStatus, Sandbox, SandboxPool

pytestmark = [needs_bwrap, needs_root]
_SECRET = "SHARPEN_TEST_SECRET"


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    """What an attacker hunts for on the host: our pid, a file, a loopback listener; a token to find its own."""
    token = uuid.uuid4().hex
    canary = tmp_path_factory.mktemp("host") / "canary.txt"
    canary.write_text(f"canary-{token}")
    with socket.create_server(("127.0.0.1", 0)) as listener:
        yield {
            "host_pid": __import__("os").getpid(),
            "canary": str(canary),
            "port": listener.getsockname()[1],
            "token": token,
            "sleep": f"7.{random.randrange(10**6, 10**7)}",
        }


@pytest.fixture(scope="module")
def cold() -> Iterator[Sandbox]:
    with Sandbox(sandbox_config(backend="bwrap", cpu_fraction=CPU_FRACTION)) as box:
        names = cgroup_names(box)
        yield box
        assert_nothing_left(box)
    assert sandbox_processes(names) == []


@pytest.fixture(scope="module")
def warm() -> Iterator[SandboxPool]:
    config = sandbox_config(backend="bwrap", cpu_fraction=CPU_FRACTION, warm_workers=True, max_concurrency=1)
    with SandboxPool(config) as pool:
        names = cgroup_names(pool.sandbox)
        yield pool
    assert sandbox_processes(names) == []


def _assert_contained(attack: Attack, result: ExecutionResult, host: dict[str, object]) -> None:
    assert result.is_program_started and result.status != ExecutionStatus.SANDBOX_ERROR, result
    assert attack.is_defended(result), result
    assert not Path(f"{host['canary']}.escaped").exists()


@pytest.mark.parametrize("attack", ATTACKS, ids=lambda attack: attack.name)
def test_the_cold_sandbox_contains(
    attack: Attack, cold: Sandbox, host: dict[str, object], monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv(_SECRET, "hunter2")
    for step in attack.steps:
        result = cold.run_python(step, files=attack.files, stdin=json.dumps(host))
    _assert_contained(attack, result, host)


@pytest.mark.parametrize("attack", [a for a in ATTACKS if a.is_warm], ids=lambda attack: attack.name)
def test_a_warm_worker_contains(
    attack: Attack, warm: SandboxPool, host: dict[str, object], monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv(_SECRET, "hunter2")

    async def steps() -> ExecutionResult:  # one after another on the pool's one worker
        results = [await warm.run_python(step, files=attack.files, stdin=json.dumps(host)) for step in attack.steps]
        return results[-1]

    _assert_contained(attack, asyncio.run(steps()), host)


@pytest.mark.parametrize("attack", [a for a in ATTACKS if a.is_real is not None], ids=lambda attack: attack.name)
def test_the_attack_is_real_on_the_naive_path(
    attack: Attack, host: dict[str, object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv(_SECRET, "hunter2")
    assert attack.is_real is not None
    result = run_naive(attack.steps, stdin=json.dumps(host), base=tmp_path, sleep_token=str(host["sleep"]))
    Path(f"{host['canary']}.escaped").unlink(missing_ok=True)
    assert attack.is_real(result), result


def test_the_suite_is_large_and_mostly_shown_real():
    assert len(ATTACKS) >= 60 and len({attack.name for attack in ATTACKS}) == len(ATTACKS)
    assert sum(attack.is_real is not None for attack in ATTACKS) >= 0.9 * len(ATTACKS)
