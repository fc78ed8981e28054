"""Failover of real engine servers (issue 15): two `vllm serve` replicas of SmolLM2 behind the router, episodes
through `EpisodeRunner`, one server's process group killed with SIGKILL while it generates. Every episode (example,
sample) comes back exactly once and token for token equal to the same run without the kill (both servers boot with
the same weights and seed, and vLLM honours each request's seed, so a re-sent request gives the same tokens), and
the killed replica is restarted, waits out of rotation, and serves again after the next weight sync (verified by
the probe on both replicas)."""

from __future__ import annotations

import collections
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sharpen.config.engines import FailoverConfig, VllmServerEngineConfig
from sharpen.orchestration.weight_sync import WeightSync
from sharpen.rollout.engines.failover import ReplicaState
from sharpen.rollout.engines.router import EngineRouter
from sharpen.rollout.episodes import EpisodeRunner
from sharpen.types import Example, Message, RolloutGroup, SamplingParams

pytestmark = pytest.mark.slow

TOPICS = ["a lighthouse", "a market", "the sea", "a library", "a mountain", "a train"]


@pytest.fixture(scope="module")
def router(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineRouter]:
    from sharpen.rollout.engines.vllm_server import VllmServerEngine

    logs = tmp_path_factory.mktemp("engine-logs")

    def start(_: int) -> VllmServerEngine:
        config = VllmServerEngineConfig(start_timeout_s=600)
        return VllmServerEngine(
            config, model_path=smollm2_path, dtype="float32", seed=0, request_timeout_s=300, log_dir=logs
        )

    with ThreadPoolExecutor(2) as pool:
        starting = [pool.submit(start, i) for i in range(2)]
        engines = [future.result() for future in starting]
    router = EngineRouter(engines, failover=FailoverConfig(replica_wait_s=600))
    yield router
    router.close()


def episodes(groups: list[RolloutGroup]) -> list[tuple[str, int, list[int]]]:
    return [(r.example.task_key, r.sample_index, r.completion_ids) for g in groups for r in g.rollouts]


def test_a_killed_server_costs_no_episode_and_rejoins_after_a_weight_sync(router, trainer, tokenizer) -> None:
    sync = WeightSync(probe_ids=tokenizer.encode("The capital of France is Paris."), tolerance=1e-3, verify=True)
    sync(trainer, router, version=1)  # past the first sync: a restarted server must wait for the next one
    examples = [
        Example(task_key=f"story/{i}", prompt=(Message(role="user", content=f"Tell a story about {topic}."),))
        for i, topic in enumerate(TOPICS)
    ]
    runner = EpisodeRunner(tokenizer=tokenizer, request_timeout_s=600)

    def run() -> list[tuple[str, int, list[int]]]:
        sampling = SamplingParams(max_new_tokens=40, temperature=1.0)
        return episodes(runner.generate_groups(router, examples, sampling=sampling, num_samples=2, seed="kill/0"))

    reference = run()
    router.pop_metrics()
    victim = router.engines[1]
    assert victim.server is not None  # type: ignore[attr-defined]
    killed_at: list[float] = []

    def kill_mid_run() -> None:
        while router.in_flight[1] == 0:
            time.sleep(0.01)
        time.sleep(1.0)  # its requests are generating
        os.killpg(victim.server.process.pid, signal.SIGKILL)  # type: ignore[attr-defined]
        killed_at.append(time.monotonic())

    killer = threading.Thread(target=kill_mid_run, daemon=True)
    killer.start()
    rollouts = run()
    ended = time.monotonic()
    killer.join(timeout=5)
    assert killed_at and killed_at[0] < ended
    assert rollouts == reference  # token for token
    counts = collections.Counter((key, sample) for key, sample, _ in rollouts)
    assert len(counts) == len(TOPICS) * 2 and set(counts.values()) == {1}
    metrics = router.pop_metrics()
    assert metrics["rollout/requests_retried"] >= 1 and metrics["engine/restarts"] == 1

    deadline = time.monotonic() + 600
    while router.health.states[1] is ReplicaState.RESTARTING:
        assert time.monotonic() < deadline, "the killed server did not come back"
        time.sleep(0.5)
    assert router.health.states[1] is ReplicaState.STANDBY, router.health.describe()
    assert router.replicas == [router.engines[0]] and router.policy_version == 1
    metrics = sync(trainer, router, version=2)  # the probe is checked on both replicas
    assert metrics["sync/num_replicas"] == 2.0 and len(router.replicas) == 2
    prompt, params = [1, 504, 3458, 314], [SamplingParams(max_new_tokens=8, seed=5)]
    served = [engine.generate([prompt], params)[0] for engine in router.engines]
    assert served[0].token_ids == served[1].token_ids and set(served[1].versions or []) == {2}
