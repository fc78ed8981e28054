"""The async machinery without a model: weight store, the producer's versioned engine (chunks, in-flight and abort
updates), admission control, order, errors, kept batches, and the staleness metrics."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import pytest

from sharpen.config.schema import RolloutConfig
from sharpen.monitoring import PhaseTimer
from sharpen.orchestration.batches import AsyncBatches, ProducedBatch, load_pending, save_pending, staleness_metrics
from sharpen.orchestration.batches.weights import (
    ProducerStopped,
    PublishedWeights,
    RequestLevelVersionedEngine,
    VersionedEngine,
    WeightStore,
    versioned_engine,
)
from sharpen.orchestration.weight_sync import WeightSync
from sharpen.rollout.engines import request_level
from sharpen.rollout.engines.server import RequestLevelEngine
from sharpen.types import Completion, Example, Message, Rollout, RolloutGroup, SamplingParams

EXAMPLE = Example(task_key="t/0", prompt=(Message(role="user", content="hi"),))


class CountingEngine:
    """Generates tokens 1, 2, 3, ... per request (a token's value is its position), stopping at ``stop_at``."""

    def __init__(self, *, stop_at: int | None = None, on_generate: Any = None) -> None:
        self.policy_version = 0
        self.stop_at = stop_at
        self.on_generate = on_generate
        self.calls: list[tuple[list[list[int]], list[SamplingParams]]] = []
        self.loads: list[int] = []

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        self.calls.append((prompts, params))
        if self.on_generate is not None:
            self.on_generate(self)
        out = []
        for prompt, param in zip(prompts, params, strict=True):
            done = len(prompt) - 1  # prompts are [0] + tokens so far
            ids, reason = [], "length"
            for position in range(done + 1, done + param.max_new_tokens + 1):
                ids.append(position)
                if position == self.stop_at:
                    reason = "stop"
                    break
            text = f"[{len(ids)}]"
            out.append(Completion(token_ids=ids, logprobs=[-0.5] * len(ids), text=text, finish_reason=reason))
        return out

    def score(self, token_ids: list[int]) -> list[float]:
        return [-1.0] * (len(token_ids) - 1)

    def load_weights(self, weights: Iterable[Any], *, version: int) -> dict[str, float]:
        list(weights)
        self.loads.append(version)
        self.policy_version = version
        return {"sync/seconds": 0.0}

    def close(self) -> None:
        pass


def load(published: PublishedWeights, engine: Any) -> dict[str, float]:
    return engine.load_weights(published.weights, version=published.version)


def publish(store: WeightStore, version: int) -> None:
    store.publish(PublishedWeights(version=version, weights=[], probe=None))


def test_store_waits_for_a_version_and_keeps_only_what_may_be_loaded() -> None:
    store = WeightStore()
    publish(store, 0)
    assert store.wait_for(0) < 0.1
    threading.Timer(0.05, publish, args=(store, 2)).start()
    assert store.wait_for(1) >= 0.04  # blocked until version 2 (>= 1) arrived
    publish(store, 1)
    store.release_below(2)
    assert len(store) == 1 and store.latest == 2
    with pytest.raises(KeyError, match="version 1 is not held"):
        store.get(1)
    store.release_below(5)  # the newest is always kept
    assert store.latest == 2
    threading.Timer(0.05, store.stop).start()
    with pytest.raises(ProducerStopped):
        store.wait_for(9)


def test_versioned_engine_between_batches_loads_its_target_once() -> None:
    engine, store = CountingEngine(), WeightStore()
    for version in (0, 1, 2):
        publish(store, version)
    view = VersionedEngine(engine, store, load=load)
    view.target = 1
    view.generate([[0]], [SamplingParams(max_new_tokens=4)])
    view.generate([[0]], [SamplingParams(max_new_tokens=4)])
    assert engine.loads == [1]  # not the newest (2): the batch's pinned version
    assert view.pop_metrics()["async/num_weight_loads"] == 1


def test_in_flight_updates_load_newer_weights_between_chunks_and_stamp_each_token() -> None:
    store = WeightStore()
    publish(store, 0)
    published = iter([1, None, None])

    def trainer_steps(engine: CountingEngine) -> None:  # a new version lands while the first chunk runs
        version = next(published, None)
        if version is not None:
            publish(store, version)

    engine = CountingEngine(stop_at=7, on_generate=trainer_steps)
    view = VersionedEngine(engine, store, load=load, updates="in_flight", chunk_tokens=3, decode=lambda ids: "d")
    params = [SamplingParams(max_new_tokens=10, seed=5), SamplingParams(max_new_tokens=2, seed=6)]
    first, second = view.generate([[0], [0]], params)
    assert first.token_ids == [1, 2, 3, 4, 5, 6, 7] and first.finish_reason == "stop"
    assert first.versions == [0, 0, 0, 1, 1, 1, 1]  # chunk 1 under version 0, the rest under version 1
    assert first.text == "d"  # several chunks: decoded whole, not the chunks' texts glued
    assert second.token_ids == [1, 2] and second.finish_reason == "length" and second.versions == [0, 0]
    assert second.text == "[2]"
    # chunk requests continue from the tokens so far, with their own derived seeds and remaining budgets
    (_, p0), (prompts1, p1), (prompts2, _) = engine.calls
    assert [p.max_new_tokens for p in p0] == [3, 2] and [p.seed for p in p0] == [5, 6]
    assert prompts1 == [[0, 1, 2, 3]] and p1[0].max_new_tokens == 3 and p1[0].seed not in (None, 5)
    assert prompts2 == [[0, 1, 2, 3, 4, 5, 6]]
    assert engine.loads == [1]


def test_abort_updates_regenerate_a_running_completion_with_the_new_weights() -> None:
    store = WeightStore()
    publish(store, 0)
    published = iter([1])

    def trainer_steps(engine: CountingEngine) -> None:
        version = next(published, None)
        if version is not None:
            publish(store, version)

    engine = CountingEngine(on_generate=trainer_steps)
    view = VersionedEngine(engine, store, load=load, updates="abort", chunk_tokens=2)
    (completion,) = view.generate([[0]], [SamplingParams(max_new_tokens=4)])
    assert completion.token_ids == [1, 2, 3, 4] and completion.versions == [1, 1, 1, 1]
    assert view.pop_metrics()["async/num_aborted_tokens"] == 2
    assert engine.calls[1][0] == [[0]]  # started over from the prompt


class RequestCountingEngine(RequestLevelEngine):
    """`CountingEngine` taking requests one by one on its own loop, a load taking a while (as a server's does)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = CountingEngine()

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    async def _generate_one(self, prompt: list[int], params: SamplingParams) -> Completion:
        (completion,) = self.inner.generate([prompt], [params])
        return replace(completion, versions=[self.policy_version] * len(completion.token_ids))

    def score(self, token_ids: list[int]) -> list[float]:
        return self.inner.score(token_ids)

    def load_weights(self, weights: Iterable[Any], *, version: int) -> dict[str, float]:
        time.sleep(0.05)
        return self.inner.load_weights(weights, version=version)

    def close(self) -> None:
        self._loop.close()


def test_request_level_engines_load_newer_weights_between_requests_once_per_version() -> None:
    """In flight: concurrent requests that find a newer version wait for one load of it, in every batch's own
    event loop (the producer runs one per batch); abort updates keep the chunked batch path."""
    engine, store = RequestCountingEngine(), WeightStore()
    publish(store, 0)
    view = versioned_engine(engine, store, load=load, updates="in_flight")
    assert isinstance(view, RequestLevelVersionedEngine) and request_level(view) is view

    async def batch() -> list[Completion]:
        return list(
            await asyncio.gather(*(view.generate_async([0], SamplingParams(max_new_tokens=3)) for _ in range(8)))
        )

    for version in (1, 2):  # two batches, two event loops, a contended load in each
        publish(store, version)
        completions = asyncio.run(batch())
        assert all(c.versions == [version] * 3 for c in completions)
    assert engine.inner.loads == [1, 2]
    assert not isinstance(versioned_engine(engine, store, load=load, updates="abort"), RequestLevelVersionedEngine)
    engine.close()


def group(step: int, versions: list[int], *, mask: list[bool] | None = None) -> RolloutGroup:
    rollout = Rollout(
        example=EXAMPLE,
        prompt_ids=[0],
        completion_ids=list(range(len(versions))),
        completion_logprobs=[-1.0] * len(versions),
        versions=versions,
        loss_mask=mask,
    )
    return RolloutGroup(example=EXAMPLE, rollouts=[rollout])


def test_staleness_metrics_count_trained_tokens_only() -> None:
    rollouts = [group(0, [3, 3, 4, 5], mask=[True, True, False, True]).rollouts[0], group(0, [5]).rollouts[0]]
    metrics = staleness_metrics(rollouts, step=5, max_staleness=2)
    # trained tokens: versions 3, 3, 5, 5 -> staleness 2, 2, 0, 0 (the masked version-4 token is not counted)
    assert metrics["async/staleness_mean"] == 1.0
    assert metrics["async/staleness_max"] == 2.0
    assert (metrics["async/staleness_0"], metrics["async/staleness_1"], metrics["async/staleness_2"]) == (0.5, 0, 0.5)


class FakeTrainer:
    """The trainer side of a `TrainerHandle` the producer uses: weight snapshots (probes are off here)."""

    def snapshot_weights(self) -> list[tuple[str, Any]]:
        return []


def no_probe() -> WeightSync:
    return WeightSync(probe_ids=[1, 2], tolerance=1e-3, verify=False)


class Maker:
    """A batch maker that records (step, engine version) of every batch it makes."""

    def __init__(self, *, produce_seconds: float = 0.0, fail_at: int | None = None) -> None:
        self.produced: list[tuple[int, int]] = []
        self.produce_seconds = produce_seconds
        self.fail_at = fail_at

    def collect(self, engine: Any, *, step: int, timer: PhaseTimer) -> ProducedBatch:
        if step == self.fail_at:
            raise RuntimeError(f"reward worker crashed in step {step}")
        with timer.phase("generate"):
            time.sleep(self.produce_seconds)
            engine.generate([[0]], [SamplingParams(max_new_tokens=1)])
        self.produced.append((step, engine.policy_version))
        return ProducedBatch(
            step=step,
            groups=[group(step, [engine.policy_version])],
            metrics={"sampling/step": float(step)},
            sampler_state={"drawn": len(self.produced)},
        )


def make_batches(
    *, max_staleness: int, num_steps: int = 6, produce_seconds: float = 0.0, fail_at: int | None = None
) -> tuple[AsyncBatches, list[tuple[int, int]], CountingEngine]:
    engine = CountingEngine()
    maker = Maker(produce_seconds=produce_seconds, fail_at=fail_at)
    batches = AsyncBatches(
        maker,
        engine=engine,
        weight_sync=no_probe(),
        rollout=RolloutConfig(mode="async", max_staleness=max_staleness),
        start_step=0,
        num_steps=num_steps,
    )
    return batches, maker.produced, engine


def test_producer_runs_ahead_only_as_far_as_the_bound() -> None:
    batches, produced, engine = make_batches(max_staleness=2)
    trainer = FakeTrainer()
    try:
        batches.publish(trainer, version=0)
        time.sleep(0.3)  # a trainer that has not finished step 0: batches 0, 1, 2 may be made (versions >= 0)
        assert [step for step, _ in produced] == [0, 1, 2]
        for step in range(6):
            batch = batches.scored_batch(step)
            assert batch.groups[0].rollouts[0].versions == [max(step - 2, 0)]  # pinned: exactly step - bound
            assert batch.metrics["sampling/step"] == step and batch.metrics["time/generate"] >= 0
            assert batch.sampler_state == {"drawn": step + 1}
            batches.publish(trainer, version=step + 1)
    finally:
        batches.close()
    assert engine.loads == [1, 2, 3]


def test_zero_staleness_alternates_with_the_trainer() -> None:
    batches, produced, _ = make_batches(max_staleness=0, num_steps=3)
    trainer = FakeTrainer()
    try:
        batches.publish(trainer, version=0)
        for step in range(3):
            batch = batches.scored_batch(step)
            time.sleep(0.05)
            assert len(produced) == step + 1  # nothing is generated while the trainer holds an older version
            assert batch.groups[0].rollouts[0].versions == [step]
            batches.publish(trainer, version=step + 1)
    finally:
        batches.close()


def test_a_producer_failure_is_raised_in_the_trainer_thread() -> None:
    batches, _, _ = make_batches(max_staleness=1, fail_at=1)
    try:
        batches.publish(FakeTrainer(), version=0)
        batches.scored_batch(0)
        with pytest.raises(RuntimeError, match="reward worker crashed in step 1"):
            batches.scored_batch(1)
    finally:
        batches.close()


def test_pending_waits_for_the_batches_made_by_older_weights_and_they_round_trip(tmp_path: Any) -> None:
    batches, _, _ = make_batches(max_staleness=2, produce_seconds=0.02)
    trainer = FakeTrainer()
    try:
        batches.publish(trainer, version=0)
        batches.scored_batch(0)
        batches.publish(trainer, version=1)
        kept = batches.pending(1)  # batches 1 and 2 were made by version 0 < 1; batch 3 will be made by 1
        assert [b.step for b in kept] == [1, 2]
        assert kept[-1].sampler_state == {"drawn": 3}
        with batches.exclusive(1) as engine:
            assert engine.policy_version == 1
    finally:
        batches.close()
    save_pending(tmp_path, kept)
    restored = load_pending(tmp_path)
    assert [b.step for b in restored] == [1, 2]
    assert restored[0].groups[0].rollouts[0].versions == [0]
    assert load_pending(tmp_path / "missing") == []


def test_a_run_resumed_with_kept_batches_trains_on_them_first() -> None:
    engine = CountingEngine()
    kept = [ProducedBatch(step=3, groups=[group(3, [1])]), ProducedBatch(step=4, groups=[group(4, [2])])]
    maker = Maker()
    engine.policy_version = 3
    batches = AsyncBatches(
        maker,
        engine=engine,
        weight_sync=no_probe(),
        rollout=RolloutConfig(mode="async", max_staleness=2),
        start_step=3,
        num_steps=6,
        pending=kept,
    )
    try:
        batches.publish(FakeTrainer(), version=3)
        assert batches.scored_batch(3).groups[0].rollouts[0].versions == [1]
        assert batches.scored_batch(4).groups[0].rollouts[0].versions == [2]
        assert batches.scored_batch(5).groups[0].rollouts[0].versions == [3]  # step 5 - bound 2 = version 3
    finally:
        batches.close()
    assert [step for step, _ in maker.produced] == [5]


def test_overlap_measures_generation_inside_a_window() -> None:
    batches, _, _ = make_batches(max_staleness=3, num_steps=2, produce_seconds=0.1)
    try:
        started = time.perf_counter()
        batches.publish(FakeTrainer(), version=0)
        batches.scored_batch(1)
        ended = time.perf_counter()
        assert 0.15 <= batches.overlap(started, ended) <= ended - started + 1e-6
        assert batches.overlap(ended + 1, ended + 2) == 0.0
    finally:
        batches.close()
