"""Failover in the engine router, with fake replicas that die, hang or fail to load: no request is lost or
duplicated and the completions are those of a run without the failure (each is a function of its prompt and seed,
as on vLLM), the failed replica is restarted (counted) and rejoins only after a weight load (at once at version 0),
requests wait for a replica to come back and then fail with one clear error, and errors that are not the replica's
fault are not retried. The engines' own restarts are tested with their servers (test_sglang_engine.py, and
tests/integration/test_vllm_failover.py)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sharpen.config.engines import FailoverConfig
from sharpen.monitoring import PhaseTimer
from sharpen.monitoring.inspect import run_warnings
from sharpen.orchestration.batches import ProducedBatch, SyncBatches
from sharpen.orchestration.weight_sync import WeightSync
from sharpen.rollout.engines import EngineError, EngineUnavailable, RestartableEngine, replicas_of, request_level
from sharpen.rollout.engines.failover import Lease, ReplicaState
from sharpen.rollout.engines.router import EngineRouter
from sharpen.rollout.engines.server import RequestLevelEngine
from sharpen.rollout.episodes import EpisodeRunner
from sharpen.types import Completion, Example, Message, ProbeScores, SamplingParams


def answer(prompt: list[int], params: SamplingParams) -> Completion:
    """What every replica answers: a function of the prompt and the seed alone."""
    digest = hashlib.blake2b(f"{prompt}/{params.seed}".encode(), digest_size=8).digest()
    ids = [100 + b for b in digest[: 1 + digest[7] % 6]]
    return Completion(
        token_ids=ids, logprobs=[-0.01 * b for b in ids], text=f"t{digest.hex()}", versions=[0] * len(ids)
    )


class FakeServer(RequestLevelEngine):
    """An engine server that takes ``seconds`` per request and can die (every request in flight fails with a
    connection reset, later ones are refused) or hang (requests in flight and later never answer), either on
    command or when its ``fail_at``-th request arrives. `restart` waits for ``restartable`` and brings it back."""

    name = "fake server"

    def __init__(self, label: str, *, seconds: float = 0.02, fail_at: int | None = None, mode: str = "die") -> None:
        super().__init__()
        self.label, self.seconds, self.fail_at, self.mode = label, seconds, fail_at, mode
        self.policy_version = 0
        self.num_requests = 0
        self.served: list[tuple[list[int], int | None]] = []
        self.num_restarts = 0
        self.restartable = threading.Event()
        self.restartable.set()
        self.fails_load = False
        self.is_dead = self.is_hung = False
        self._changed = asyncio.Event()  # bound to the engine's loop on first use

    def fail(self, mode: str = "die") -> None:
        def change() -> None:
            self.is_dead, self.is_hung = mode == "die", mode == "hang"
            self._changed.set()

        self._loop.loop.call_soon_threadsafe(change)

    async def _generate_one(self, prompt: list[int], params: SamplingParams) -> Completion:
        self.num_requests += 1
        if self.num_requests == self.fail_at:
            self.fail(self.mode)
            await asyncio.sleep(0)
        if self.is_dead:
            raise EngineUnavailable(f"{self.label}: cannot connect to http://fake/{self.label} (connection refused)")
        with contextlib.suppress(TimeoutError):  # the request's time, unless the server fails meanwhile
            await asyncio.wait_for(self._changed.wait(), timeout=self.seconds)
        while self.is_hung:
            await asyncio.sleep(3600)
        if self.is_dead:
            raise EngineUnavailable(f"{self.label}: request to http://fake/{self.label} failed: connection reset")
        self.served.append((prompt, params.seed))
        return answer(prompt, params)

    def restart(self) -> None:
        assert self.restartable.wait(30)
        self.num_restarts += 1

        def revive() -> None:
            self.is_dead = self.is_hung = False
            self._changed.clear()

        self._loop.loop.call_soon_threadsafe(revive)  # before any request sent after the restart
        self.policy_version = 0

    def score(self, token_ids: list[int]) -> list[float]:
        if self.is_dead:
            raise EngineUnavailable(f"{self.label}: cannot connect")
        return [-1.0] * (len(token_ids) - 1)

    def load_weights(self, weights: Any, *, version: int) -> dict[str, float]:
        if self.fails_load:
            raise EngineError(f"{self.label} rejected weights version {version}: bucket 1 corrupted")
        self.policy_version = version
        return {"sync/seconds": 0.01}

    def close(self) -> None:
        self._loop.close()


PROMPTS = [[1, i, 2 * i] for i in range(16)]
PARAMS = [SamplingParams(max_new_tokens=8, seed=1000 + i) for i in range(16)]
EXPECTED = [answer(p, q).token_ids for p, q in zip(PROMPTS, PARAMS, strict=True)]


def fast(**fields: Any) -> FailoverConfig:
    return FailoverConfig(**{"replica_wait_s": 10.0, **fields})


def concurrently(router: EngineRouter, prompts=PROMPTS, params=PARAMS) -> list[Completion]:
    async def all_of() -> list[Completion]:
        return list(await asyncio.gather(*(router.generate_async(p, q) for p, q in zip(prompts, params, strict=True))))

    return asyncio.run(all_of())


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def closing(router: EngineRouter) -> None:
    for engine in router.engines:
        assert isinstance(engine, FakeServer)
        engine.restartable.set()
    router.close()


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


def run_episodes(router: EngineRouter, tokenizer) -> list[tuple[str, int, list[int]]]:
    examples = [Example(task_key=f"t/{i}", prompt=(Message(role="user", content=f"task {i}"),)) for i in range(8)]
    runner = EpisodeRunner(tokenizer=tokenizer, request_timeout_s=60)
    groups = runner.generate_groups(
        router, examples, sampling=SamplingParams(max_new_tokens=8), num_samples=3, seed="run/0"
    )
    return [(r.example.task_key, r.sample_index, r.completion_ids) for g in groups for r in g.rollouts]


def test_a_replica_killed_mid_run_costs_no_episode_and_no_duplicate(tokenizer) -> None:
    healthy = EngineRouter([FakeServer("a"), FakeServer("b")])
    reference = run_episodes(healthy, tokenizer)
    healthy.close()
    killed = FakeServer("b", fail_at=5)  # its fifth request kills it: four are in flight then
    router = EngineRouter([FakeServer("a"), killed, FakeServer("c")], failover=fast())
    assert isinstance(killed, RestartableEngine) and request_level(router) is router
    rollouts = run_episodes(router, tokenizer)
    assert rollouts == reference  # the same tokens: retried requests kept their seeds
    episodes = collections.Counter((key, sample) for key, sample, _ in rollouts)
    assert len(episodes) == 24 and set(episodes.values()) == {1}
    served = [request for engine in router.engines for request in engine.served]  # type: ignore[attr-defined]
    assert len(served) == 24 and len(set(map(str, served))) == 24  # each request answered exactly once
    metrics = router.pop_metrics()
    assert metrics["rollout/requests_retried"] >= 1 and metrics["engine/restarts"] == 1
    assert sum(metrics[f"engine/replica_{i}/requests"] for i in range(3)) == 24 + metrics["rollout/requests_retried"]
    # the step's metrics, as the run logs them: the run doctor (`sharpen inspect`, the end of `sharpen train`) names it
    [warning] = run_warnings([{"step": 0, **metrics}], probe_tolerance=1e-3)
    assert warning.startswith("engine replicas were lost or restarted at steps [0] (1 restarts, 0 failed weight loads")
    wait_for(lambda: router.health.states[1] is ReplicaState.SERVING)  # version 0: it rejoins at once
    assert killed.num_restarts == 1 and len(router.replicas) == 3
    assert [e.kind for e in router.health.events if e.kind != "served_retry"] == ["down", "restarted", "rejoined"]
    assert router.pop_metrics()["engine/restarts"] == 0  # counted once, in the step it happened
    closing(router)


def test_a_hung_replica_is_timed_out_and_its_requests_go_elsewhere() -> None:
    hung = FakeServer("a", fail_at=3, mode="hang", seconds=0.05)
    router = EngineRouter([hung, FakeServer("b", seconds=0.05)], failover=fast(replica_timeout_s=0.5))
    started = time.monotonic()
    assert [c.token_ids for c in concurrently(router)] == EXPECTED
    assert time.monotonic() - started < 5
    assert router.health.num_retried >= 2 and router.health.num_restarts == 1
    assert "did not answer within 0.5 s (rollout.failover.replica_timeout_s)" in router.health.causes[0]
    closing(router)


def test_requests_running_on_a_replica_that_went_down_are_sent_elsewhere_at_once() -> None:
    """No replica timeout: requests hanging on a replica that another caller found down are re-sent at once, not
    left to wait for ever."""
    a = FakeServer("a", fail_at=1, mode="hang")
    router = EngineRouter([a, FakeServer("b")], failover=fast())
    a.restartable.clear()

    async def run() -> list[Completion]:
        requests = [asyncio.ensure_future(router.generate_async(p, q)) for p, q in zip(PROMPTS, PARAMS, strict=True)]
        await asyncio.sleep(0.2)
        assert router.in_flight[0] == 8 and a.served == []  # every request to a hangs
        # a batch call of another thread, say, finds a down
        router.health.fail(Lease(replica=0, epoch=router.health.epochs[0]), "a: connection reset")
        return list(await asyncio.wait_for(asyncio.gather(*requests), timeout=5))

    assert [c.token_ids for c in asyncio.run(run())] == EXPECTED
    assert router.health.states[0] is ReplicaState.RESTARTING and router.health.num_retried == 8
    closing(router)


def test_a_restarted_replica_rejoins_only_after_a_weight_load() -> None:
    a, b = FakeServer("a"), FakeServer("b", fail_at=3)
    router = EngineRouter([a, b], failover=fast())
    sync = WeightSync(probe_ids=[1, 2, 3], tolerance=1e-3, verify=True)

    class Trainer:
        def named_weights(self):
            yield "w", 1.0

        def probe(self, token_ids: list[int]) -> ProbeScores:
            return ProbeScores(logprobs=[-1.0] * (len(token_ids) - 1))

    sync(Trainer(), router, version=1)  # pyright: ignore[reportArgumentType]
    assert [c.token_ids for c in concurrently(router)] == EXPECTED
    wait_for(lambda: router.health.states[1] is ReplicaState.STANDBY)  # back, with the base weights (version 0)
    assert router.replicas == [a] and replicas_of(router) == [a] and router.policy_version == 1
    routed = router.num_routed[1]
    assert [c.token_ids for c in concurrently(router)] == EXPECTED
    assert router.num_routed[1] == routed  # nothing went to it
    assert "restarted, waits for the next weight sync (the run is at version 1)" in router.health.describe()
    metrics = sync(Trainer(), router, version=2)  # pyright: ignore[reportArgumentType]
    assert metrics["sync/num_replicas"] == 2.0 and b.policy_version == 2
    assert router.replicas == [a, b] and router.policy_version == 2
    concurrently(router)
    assert router.num_routed[1] > routed
    closing(router)


def test_with_no_replica_serving_requests_wait_for_one_then_fail_naming_each_state() -> None:
    a, b = FakeServer("a"), FakeServer("b")
    router = EngineRouter([a, b], failover=fast(replica_wait_s=0.5))
    for engine in (a, b):
        engine.restartable.clear()  # their restarts take for ever
        engine.fail("die")
    started = time.monotonic()
    with pytest.raises(
        EngineError,
        match=r"no engine replica served for 0.5 s \(rollout.failover.replica_wait_s\): engine replica 0: restarting "
        r"after a failure \(a: cannot connect .*\); engine replica 1: restarting after a failure \(b: cannot",
    ):
        concurrently(router)
    assert 0.5 <= time.monotonic() - started < 5
    with pytest.raises(EngineError, match=r"no engine replica served for 0.5 s"):
        router.generate(PROMPTS[:2], PARAMS[:2])  # the batch path waits the same way
    a.restartable.set()  # a comes back (version 0, the run's): the requests go to it
    wait_for(lambda: router.health.states[0] is ReplicaState.SERVING)
    assert [c.token_ids for c in concurrently(router)] == EXPECTED
    closing(router)


def test_replicas_that_cannot_be_restarted_stay_out_and_without_any_requests_fail_at_once() -> None:
    a, b = FakeServer("a", fail_at=1), FakeServer("b", fail_at=2)
    router = EngineRouter([a, b], failover=fast(restart=False))
    with pytest.raises(
        EngineError, match=r"no engine replica can serve: engine replica 0: out of the run \(a: cannot connect"
    ):
        concurrently(router)
    assert router.health.states == [ReplicaState.LOST] * 2 and a.num_restarts == b.num_restarts == 0
    closing(router)


def test_a_request_that_fails_everywhere_gives_up_after_max_retries() -> None:
    a, b = FakeServer("a", fail_at=1), FakeServer("b", fail_at=1)
    a.restart = b.restart = lambda: None  # back at once, as broken as before  # type: ignore[method-assign]
    router = EngineRouter([a, b], failover=fast(max_retries=2))
    with pytest.raises(
        EngineError, match=r"a request failed on engine replicas 3 times \(rollout.failover.max_retries = 2\)"
    ):
        concurrently(router, PROMPTS[:1], PARAMS[:1])
    closing(router)


def test_errors_that_are_not_the_replicas_fault_are_not_retried() -> None:
    class Refusing(FakeServer):
        async def _generate_one(self, prompt: list[int], params: SamplingParams) -> Completion:
            raise EngineError("fake server: POST http://fake/generate returned HTTP 400: prompt too long")

    router = EngineRouter([Refusing("a"), FakeServer("b")], failover=fast())
    with pytest.raises(EngineError, match=r"engine replica 0 failed in generate: .*HTTP 400: prompt too long"):
        concurrently(router, PROMPTS[:1], PARAMS[:1])
    assert router.health.num_retried == 0 and router.health.states == [ReplicaState.SERVING] * 2
    assert router.in_flight == [0, 0]
    closing(router)


class BatchReplica:
    """A batch engine (no `generate_async`) that fails its ``fail_at``-th call, or hangs in it."""

    def __init__(self, *, fail_at: int | None = None, hangs: bool = False) -> None:
        self.policy_version = 0
        self.fail_at, self.hangs, self.num_calls = fail_at, hangs, 0
        self.num_restarts = 0
        self.restartable = threading.Event()

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        self.num_calls += 1
        if self.num_calls == self.fail_at:
            if self.hangs:
                time.sleep(3600)
            raise EngineUnavailable("batch replica: its process is gone")
        return [answer(p, q) for p, q in zip(prompts, params, strict=True)]

    def restart(self) -> None:
        assert self.restartable.wait(30)
        self.num_restarts += 1

    def score(self, token_ids: list[int]) -> list[float]:
        return [-1.0] * (len(token_ids) - 1)

    def load_weights(self, weights: Any, *, version: int) -> dict[str, float]:
        self.policy_version = version
        return {}

    def close(self) -> None:
        pass


@pytest.mark.parametrize("hangs", [False, True])
def test_a_batch_share_of_a_failed_replica_goes_to_the_others(hangs: bool) -> None:
    broken = BatchReplica(fail_at=1, hangs=hangs)
    router = EngineRouter([BatchReplica(), broken, BatchReplica()], failover=fast(replica_timeout_s=0.5))
    assert request_level(router) is None
    completions = router.generate(PROMPTS, PARAMS)
    assert [c.token_ids for c in completions] == EXPECTED
    metrics = router.pop_metrics()
    assert metrics["rollout/requests_retried"] == 5  # its share of 16 (every third request from the second)
    assert metrics["engine/replica_1/requests"] == 5 and metrics["engine/restarts"] == 1
    broken.restartable.set()
    wait_for(lambda: broken.num_restarts == 1 and router.health.states[1] is ReplicaState.SERVING)
    assert router.in_flight == [0, 0, 0]
    router.close()


def test_a_replica_that_fails_to_load_weights_restarts_while_the_others_go_on() -> None:
    a, b = FakeServer("a"), FakeServer("b")
    b.fails_load = True
    router = EngineRouter([a, b], failover=fast())
    metrics = router.load_weights([("w", 1.0)], version=1)
    assert metrics["sync/num_replicas"] == 1.0 and metrics["sync/num_failed_replicas"] == 1.0
    assert router.policy_version == 1 and router.replicas == [a]
    wait_for(lambda: router.health.states[1] is ReplicaState.STANDBY)
    b.fails_load = False
    router.load_weights([("w", 1.0)], version=2)
    assert router.replicas == [a, b] and b.policy_version == 2
    a.fails_load = b.fails_load = True
    with pytest.raises(
        EngineError,
        match=r"no engine replica took the weights: engine replica 0 failed to load .*"
        r"corrupted; engine replica 1 failed",
    ):
        router.load_weights([("w", 1.0)], version=3)
    closing(router)


def test_the_step_metrics_carry_the_routers_counts() -> None:
    broken = BatchReplica(fail_at=1)
    router = EngineRouter([BatchReplica(), broken], failover=fast())

    class Collector:
        def collect(self, engine, *, step: int, timer: PhaseTimer) -> ProducedBatch:
            engine.generate(PROMPTS[:4], PARAMS[:4])
            return ProducedBatch(step=step, groups=[], metrics={"reward/mean": 0.5})

    source = SyncBatches(Collector(), engine=router, weight_sync=None, timer=PhaseTimer())  # type: ignore[arg-type]
    metrics = source.scored_batch(0).metrics
    assert metrics["reward/mean"] == 0.5 and metrics["rollout/requests_retried"] == 2
    assert metrics["engine/restarts"] == 1 and metrics["engine/replica_0/requests"] == 4
    assert metrics["engine/replica_1/requests"] == 2
    broken.restartable.set()
    wait_for(lambda: router.health.states[1] is ReplicaState.SERVING)
    metrics = source.scored_batch(1).metrics
    assert metrics["rollout/requests_retried"] == 0 and metrics["engine/restarts"] == 0
    assert metrics["engine/replica_0/requests"] == metrics["engine/replica_1/requests"] == 2
    router.close()
