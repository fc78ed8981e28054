"""The engine router: least-in-flight balancing (also across concurrent callers), request order, weights to every
replica (snapshotted once), version agreement, and errors that name the replica."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import pytest

from sharpen.orchestration.weight_sync import WeightSync
from sharpen.rollout.engines.base import EngineError
from sharpen.rollout.engines.router import EngineRouter
from sharpen.rollout.weight_sync import WeightSyncError
from sharpen.types import Completion, ProbeScores, SamplingParams


class FakeEngine:
    """Echoes its name and the prompt's first token; optionally slow or broken."""

    def __init__(self, name: str, *, seconds: float = 0.0, fails: bool = False, logprob: float = -1.0) -> None:
        self.name = name
        self.seconds = seconds
        self.fails = fails
        self.logprob = logprob
        self.policy_version = 0
        self.requests: list[list[int]] = []
        self.loaded: list[tuple[int, list[str]]] = []

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        time.sleep(self.seconds)
        if self.fails:
            raise RuntimeError("CUDA error: an illegal memory access")
        self.requests.extend(prompts)
        return [Completion(token_ids=[p[0]], logprobs=[-1.0], text=self.name) for p in prompts]

    def score(self, token_ids: list[int]) -> list[float]:
        return [self.logprob] * (len(token_ids) - 1)

    def load_weights(self, weights: Iterable[tuple[str, Any]], *, version: int) -> dict[str, float]:
        self.loaded.append((version, [name for name, _ in weights]))
        if not self.fails:
            self.policy_version = version
        return {"sync/seconds": 0.01, "sync/num_tensors": 2.0}

    def close(self) -> None:
        pass


def params(n: int) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=1)] * n


def test_one_callers_requests_are_split_evenly_and_come_back_in_order() -> None:
    a, b, c = FakeEngine("a"), FakeEngine("b"), FakeEngine("c")
    router = EngineRouter([a, b, c])
    completions = router.generate([[i] for i in range(7)], params(7))
    assert [x.token_ids for x in completions] == [[i] for i in range(7)]
    assert router.num_routed == [3, 2, 2] and router.in_flight == [0, 0, 0]
    assert [x.text for x in completions] == ["a", "b", "c", "a", "b", "c", "a"]
    router.close()


def test_requests_go_to_the_replica_with_the_fewest_in_flight() -> None:
    slow, fast = FakeEngine("slow", seconds=0.5), FakeEngine("fast")
    router = EngineRouter([slow, fast])
    # a first caller keeps 3 requests in flight (2 on slow, 1 on fast, which finishes at once)
    first = threading.Thread(target=router.generate, args=([[0], [1], [2]], params(3)))
    first.start()
    time.sleep(0.1)
    assert router.in_flight == [2, 0]
    router.generate([[3], [4]], params(2))  # both go to the idle replica
    assert [p[0] for p in fast.requests] == [1, 3, 4]
    first.join()
    assert [p[0] for p in slow.requests] == [0, 2]
    router.close()


def test_weights_reach_every_replica_once_each_from_a_one_shot_iterator() -> None:
    a, b = FakeEngine("a"), FakeEngine("b")
    router = EngineRouter([a, b])

    def gather() -> Iterator[tuple[str, Any]]:  # like a sharded trainer's named_weights: iterable only once
        yield "w", 1.0
        yield "b", 2.0

    metrics = router.load_weights(gather(), version=3)
    assert a.loaded == b.loaded == [(3, ["w", "b"])]
    assert router.policy_version == 3
    assert metrics["sync/num_replicas"] == 2.0 and metrics["sync/replica_max_seconds"] == 0.01
    router.close()


def test_a_replica_that_does_not_take_the_version_fails_loudly() -> None:
    router = EngineRouter([FakeEngine("a"), FakeEngine("b", fails=True)], names=["engine 0", "engine 1"])
    with pytest.raises(
        EngineError, match=r"engine replicas hold different weight versions \(engine 0: 5, engine 1: 0\)"
    ):
        router.load_weights([("w", 1.0)], version=5)


def test_a_failing_replica_is_named() -> None:
    router = EngineRouter([FakeEngine("a"), FakeEngine("b", fails=True)], names=["engine 0", "engine 1"])
    with pytest.raises(EngineError, match="engine 1 failed in generate: CUDA error"):
        router.generate([[0], [1]], params(2))
    assert router.in_flight == [0, 0]  # released even on failure


class FakeTrainer:
    def probe(self, token_ids: list[int]) -> ProbeScores:
        return ProbeScores(logprobs=[-1.0] * (len(token_ids) - 1))

    def named_weights(self) -> Iterator[tuple[str, Any]]:
        yield "w", 1.0


def test_weight_sync_checks_the_probe_on_every_replica() -> None:
    good, drifted = FakeEngine("good"), FakeEngine("drifted", logprob=-3.0)
    sync = WeightSync(probe_ids=[1, 2, 3, 4], tolerance=1e-3, verify=True)
    metrics = sync(FakeTrainer(), EngineRouter([good, good]), version=1)  # pyright: ignore[reportArgumentType]
    assert metrics["sync/probe_mismatch_max"] == 0.0
    with pytest.raises(WeightSyncError, match="differ from the trainer's by 2"):
        sync(FakeTrainer(), EngineRouter([good, drifted]), version=2)  # pyright: ignore[reportArgumentType]
