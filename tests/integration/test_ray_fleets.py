"""Sandbox fleets on Ray (sharpen.orchestration.ray.fleets): replicas of the sandbox service as Ray actors whose URLs
the remote sandbox client calls. A replica killed mid-run loses no execution and Ray restarts it at its URL, where
the client sends work again; the fleet scales 2 -> 3 -> 1 with its clients following and reports queue depths from
/metrics; a run's config gets the fleet's URLs, and a run (Ray or embedded runtime) executes its tool calls on its
own fleet."""

from __future__ import annotations

import contextlib
import functools
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from test_ray_runtime import RAY_RUNTIME
from test_tiny_loop import run_in_this_process, tiny_config, vowel_reward

from sharpen.config import ConfigError, SharpenConfig, load_config
from sharpen.config.engines import ScriptedEngineConfig
from sharpen.config.environments import PythonEnvironmentConfig
from sharpen.config.sandbox import SandboxConfig
from sharpen.config.service import RemoteConfig, ServiceFleetConfig
from sharpen.environments.sandbox import ExecutionStatus
from sharpen.environments.sandbox.remote import RemoteSandbox, RemoteSandboxPool
from sharpen.monitoring import read_jsonl
from sharpen.orchestration.build import load_tokenizer
from sharpen.orchestration.runtime import run

ray = pytest.importorskip("ray")

from sharpen.orchestration.ray.fleets import ServiceFleet, gauge, serve_sandbox, start_sandbox_fleet  # noqa: E402

TOKEN = "ray-fleet-test-token"
pytestmark = [
    pytest.mark.ray,
    pytest.mark.slow,
    pytest.mark.usefixtures("ray_instance"),
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed"),
]
REPLICA = {"backend": "bwrap", "wall_seconds": 10.0, "memory_mb": 128, "prepare_ahead": False}


@pytest.fixture(autouse=True)
def token_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARPEN_SERVICE_TOKEN", TOKEN)


@contextlib.contextmanager
def _fleet(num_replicas: int, **replica: object) -> Iterator[ServiceFleet]:
    config = ServiceFleetConfig(num_replicas=num_replicas, num_cpus=0.25, max_restarts=2)
    served = SandboxConfig.model_validate({**REPLICA, **replica})
    fleet = ServiceFleet(
        functools.partial(serve_sandbox, served), config, token=TOKEN, what="sandbox", start_timeout_s=60
    )
    try:
        yield fleet
    finally:
        fleet.close()


def _client(urls: list[str]) -> RemoteSandbox:
    remote = RemoteConfig(urls=urls, backoff_s=0.05, replica_cooldown_s=0.5)
    return RemoteSandbox(SandboxConfig(backend="remote", remote=remote))


def _free_cpus(expected: float) -> float:
    """Ray's free CPUs once they reach ``expected`` (it frees an ended actor's CPUs asynchronously), or after 10 s."""
    deadline = time.monotonic() + 10
    while (free := ray.available_resources().get("CPU", 0.0)) != pytest.approx(
        expected
    ) and time.monotonic() < deadline:
        time.sleep(0.1)
    return free


def _executions(url: str) -> float:
    return gauge(httpx.get(f"{url}/metrics", timeout=5).text, "sharpen_executions")


def test_killed_replica_loses_no_execution_and_comes_back_at_its_url() -> None:
    with _fleet(2) as fleet:
        assert len(set(fleet.urls)) == 2 and all(url.startswith("http://") for url in fleet.urls)
        with _client(fleet.urls) as box, ThreadPoolExecutor(max_workers=4) as pool:
            run = functools.partial(box.run_python, "import sys; print(int(sys.stdin.read()) * 2)")
            before = list(pool.map(lambda i: run(stdin=str(i)), range(4)))
            killed_url, kept_url = fleet.urls
            jobs = [pool.submit(run, stdin=str(i)) for i in range(12)]
            ray.kill(fleet.actors[0], no_restart=False)  # Ray restarts it (max_restarts)
            during = [job.result(timeout=60) for job in jobs]
            for results in (before, during):
                assert [r.status for r in results] == [ExecutionStatus.OK] * len(results)
                assert [r.stdout for r in results] == [f"{2 * i}\n" for i in range(len(results))]
            # Restarted (a replica dead for good would leave the fleet), on this node and at its own port again:
            assert fleet.refresh() == [killed_url, kept_url]
            time.sleep(0.5)  # the client's rest of a replica that refused it
            assert [run(stdin="1").stdout for _ in range(8)] == ["2\n"] * 8
            assert _executions(killed_url) > 0  # the client, told nothing, uses the restarted replica again


def test_fleet_scales_and_its_clients_follow() -> None:
    with _fleet(2) as fleet, _client(fleet.urls) as box:
        fleet.follow(box.client)
        total = ray.cluster_resources()["CPU"]
        assert _free_cpus(total - 0.5) == pytest.approx(total - 0.5)  # two replicas of 0.25 CPU
        urls = fleet.scale(3)
        assert len(set(urls)) == 3 and len(fleet.actors) == 3
        assert [r.url for r in box.client.replicas] == urls
        assert [box.run(["true"]).status for _ in range(6)] == [ExecutionStatus.OK] * 6
        assert all(_executions(url) > 0 for url in urls)  # the new replica gets work too
        assert ray.available_resources().get("CPU", 0.0) == pytest.approx(total - 0.75)
        assert fleet.scale(1) == urls[:1] == [r.url for r in box.client.replicas]
        assert box.run(["true"]).status is ExecutionStatus.OK
        assert _free_cpus(total - 0.25) == pytest.approx(total - 0.25)
        with pytest.raises(ValueError, match="num_replicas must be >= 1"):
            fleet.scale(0)
        fleet.request_resources(3)  # Ray accepts the bundles as a demand (this cluster does not autoscale)


def test_replica_that_cannot_start_fails_the_fleet_with_its_reason() -> None:
    with pytest.raises(RuntimeError, match=r"no replica is alive; .*no sandbox backend with at least strong isolation"):
        _fleet(1, backend="process").__enter__()  # weaker than sandbox.min_isolation: the replica refuses
    total = ray.cluster_resources()["CPU"]
    assert _free_cpus(total) == pytest.approx(total)  # nothing stays reserved


def test_queue_depths_show_waiting_work() -> None:
    with _fleet(1, max_concurrency=1) as fleet:
        (url,) = fleet.urls
        assert fleet.queue_depths() == {url: 0.0}
        assert fleet.bundle == {"CPU": 0.25}
        with _client(fleet.urls) as box, ThreadPoolExecutor(max_workers=3) as pool:
            jobs = [pool.submit(box.run_python, "import time; time.sleep(1.5)") for _ in range(3)]
            deepest = 0.0
            deadline = time.monotonic() + 10
            while not all(job.done() for job in jobs) and time.monotonic() < deadline:
                deepest = max(deepest, fleet.queue_depths().get(url, 0.0))
                time.sleep(0.05)
            assert all(job.result().status is ExecutionStatus.OK for job in jobs)
        assert deepest >= 1.0
        assert fleet.queue_depths() == {url: 0.0}


def test_run_config_gets_the_fleet_urls(monkeypatch: pytest.MonkeyPatch) -> None:
    sandbox = {**REPLICA, "backend": "remote", "fleet": {"num_replicas": 2, "num_cpus": 0.25, "backend": "bwrap"}}
    config = SharpenConfig.model_validate({"sandbox": sandbox})
    with monkeypatch.context() as unset, contextlib.ExitStack() as stack:
        unset.delenv("SHARPEN_SERVICE_TOKEN")
        with pytest.raises(ConfigError, match=r"sandbox\.fleet: the replicas refuse to start without a token"):
            start_sandbox_fleet(config, stack=stack)
    with contextlib.ExitStack() as stack:
        served = start_sandbox_fleet(config, stack=stack)
        urls = served.sandbox.remote.urls
        assert len(urls) == 2 and config.sandbox.remote.urls == []
        assert SharpenConfig.model_validate(served.model_dump()).sandbox.remote.urls == urls  # a valid resolved config
        with RemoteSandboxPool(served.sandbox) as pool:
            assert pool.report.backend == "bwrap"
            assert pool.sandbox.run(["true"]).status is ExecutionStatus.OK
    with pytest.raises(httpx.ConnectError):  # the replicas ended with the stack
        httpx.get(f"{urls[0]}/healthz", timeout=2)


@pytest.mark.parametrize("runtime", ["ray", "local"])
def test_run_executes_its_tool_calls_on_its_fleet(runtime: str, tiny_model_path: Path, tmp_path: Path) -> None:
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(3 + 4)"}}</tool_call>'
    config = tiny_config(tiny_model_path, tmp_path, name=runtime, num_steps=1, **{"weight_sync.verify": "false"})
    config.rollout.engine = ScriptedEngineConfig(completions=[call, "<answer>7</answer>"])
    config.environment = PythonEnvironmentConfig(max_turns=3)
    config.sandbox = SandboxConfig.model_validate(
        {**REPLICA, "backend": "remote", "fleet": {"num_replicas": 2, "num_cpus": 0.25, "backend": "bwrap"}}
    )
    config.rollout.max_new_tokens = 40
    config.monitoring.num_recorded_rollouts = 8
    if runtime == "ray":
        run_dir = run(config, runtime=RAY_RUNTIME, reward_fn=vowel_reward)
    else:  # the embedded runtime starts the fleet on the Ray it finds, as it does reward-model actors
        run_dir = run_in_this_process(config)
    [row] = read_jsonl(run_dir / "metrics.jsonl")
    assert row["reward/num_abstained"] == 0
    recorded = read_jsonl(run_dir / "rollouts.jsonl")
    assert {r["episode"]["sandbox_backend"] for r in recorded} == {"bwrap"}  # the replicas' sandbox ran the tools
    # every tool call but one in an episode's last turn (max_turns: no observation follows) got the program's output
    tool_turns = [t for r in recorded for t in r["episode"]["turns"][:-1] if t["info"].get("tool_calls")]
    tokenizer = load_tokenizer(tiny_model_path)
    assert tool_turns and all("stdout:\n7" in tokenizer.decode(t["observation_ids"]) for t in tool_turns)
    resolved = load_config(run_dir / "config.toml", [])
    assert len(resolved.sandbox.remote.urls) == 2 and resolved.sandbox.fleet is not None
    total = ray.cluster_resources()["CPU"]
    assert _free_cpus(total) == pytest.approx(total)  # the fleet and the run's actors are gone


def test_environment_fleet_serves_episodes_and_moves_one_off_a_killed_replica() -> None:
    import asyncio

    from sharpen.config.environments import GuessNumberEnvironmentConfig
    from sharpen.environments.base import EpisodeContext
    from sharpen.environments.guess_number import GuessNumberEnvironment
    from sharpen.environments.registry import build_environment_factory
    from sharpen.orchestration.ray.fleets import serve_environment, start_environment_fleet

    fleet_settings = {"num_replicas": 2, "num_cpus": 0.25, "max_restarts": 0}
    config = SharpenConfig.model_validate({"environment": {"type": "guess_number", "high": 8, "fleet": fleet_settings}})
    with contextlib.ExitStack() as stack:  # the run's way: the config gets the fleet's URLs
        served = start_environment_fleet(config, stack=stack)
        assert isinstance(served.environment, GuessNumberEnvironmentConfig) and served.environment.remote is not None
        assert len(served.environment.remote.urls) == 2
        assert SharpenConfig.model_validate(served.model_dump()).environment == served.environment

    [example] = GuessNumberEnvironment.make_tasks(1, seed=3, low=1, high=8)
    section = GuessNumberEnvironmentConfig(high=8)

    async def play(environment, kill=None) -> list[object]:
        ctx = EpisodeContext(seed=5, sample_index=0, max_turns=6, max_tokens=1000)
        transcript: list[object] = [await environment.reset(example, ctx)]
        for turn, guess in enumerate(["1", "2", "3", "5", "4"]):  # the secret is 4: five turns
            if kill is not None and turn == 2:
                kill(environment.replica_url)
            result = await environment.step(guess)
            transcript.append((result.observation, result.reward, result.terminated))
            if result.terminated or result.truncated:
                break
        return transcript

    fleet = ServiceFleet(
        functools.partial(serve_environment, section, SandboxConfig()),
        ServiceFleetConfig(**fleet_settings),
        token=TOKEN,
        what="environment",
        start_timeout_s=60,
    )
    try:
        factory = build_environment_factory(
            section.model_copy(update={"remote": RemoteConfig(urls=fleet.urls, backoff_s=0.05)})
        )
        environment = factory()

        def kill(url: str) -> None:  # the replica that holds the episode dies for good
            ray.kill(fleet.actors[fleet.urls.index(url)], no_restart=True)
            deadline = time.monotonic() + 30  # ray.kill returns at once: wait until the replica is gone
            while time.monotonic() < deadline:
                try:
                    httpx.get(f"{url}/healthz", timeout=1)
                except httpx.HTTPError:
                    return
                time.sleep(0.05)
            raise AssertionError(f"the killed replica at {url} still answers after 30 s")

        moved = asyncio.run(play(environment, kill))
        assert moved == asyncio.run(play(build_environment_factory(section)()))  # replayed, then the same game
        assert environment.num_moves == 1
        assert len(fleet.refresh()) == 1  # the dead replica left the fleet
        factory.close()
    finally:
        fleet.close()
