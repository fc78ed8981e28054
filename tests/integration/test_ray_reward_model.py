"""A reward model on a fleet of Ray actors (reward component backend = "ray"): the scores of a direct forward, batches
spread over the replicas, a hung, failing or dead replica turning into abstentions that name it, and a replica
restarted by Ray taking work again."""

from __future__ import annotations

import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sharpen.config.service import FleetConfig
from sharpen.types import Example, Message, RewardStatus

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.usefixtures("ray_instance")]


def _example(question: str, answer: str | None = None) -> Example:
    prompt = (Message(role="user", content=question),)
    return Example(task_key=question, prompt=prompt, answer=answer, metadata={"source": "jsonl"})


class FakeRewardModel:
    """Scores a completion by its length; "hang" never finishes, "boom" raises (like an input it cannot render)."""

    def score(self, pairs: list[tuple[list[dict[str, str]], str]]) -> tuple[list[float], int]:
        if any(completion == "hang" for _, completion in pairs):
            time.sleep(60)
        if any(completion == "boom" for _, completion in pairs):
            raise ValueError("an input renders to no tokens")
        return [float(len(completion)) for _, completion in pairs], 0


def wait_for_free_cpus(expected: float) -> float:
    """Ray frees a killed actor's CPUs asynchronously."""
    deadline = time.monotonic() + 10
    while (free := ray.available_resources().get("CPU", 0.0)) < expected and time.monotonic() < deadline:
        time.sleep(0.1)
    return free


def kill_and_wait(actor: object) -> None:
    """`ray.kill` only asks the GCS to kill the actor: a call sent right after may still reach the live worker.
    Wait until the actor answers as dead, so the next call the pool sends to it is sure to fail."""
    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=5)  # type: ignore[attr-defined]
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            pass
        time.sleep(0.1)
    raise AssertionError("a killed actor still answers after 30 s")


def test_a_ray_reward_model_scores_like_a_direct_forward_on_every_actor(tiny_reward_model_path: Path) -> None:
    from sharpen.config import SharpenConfig
    from sharpen.orchestration.build import build_reward_fn
    from sharpen.orchestration.ray.reward_actors import RewardModelPool, start_reward_model_pools
    from sharpen.rewards import RewardFn, Rubric
    from sharpen.rewards.rm_server import RewardModelScorer

    component = {
        "type": "reward_model",
        "backend": "ray",
        "model_path": str(tiny_reward_model_path),
        "max_length": 256,
        "fleet": {"num_replicas": 2, "num_cpus": 0.5},
        "batch_size": 2,
        "start_timeout_s": 120,
    }
    config = SharpenConfig.model_validate({"reward": {"components": [component]}})
    pairs = [(_example("What is 2 + 2?"), "4"), (_example("Name a colour."), "Blue " * 20), (_example("Hi"), "Hello")]
    pairs.append((_example("12+7?", answer="19"), "<answer>19</answer>"))
    local = RewardModelScorer.from_pretrained(tiny_reward_model_path, max_length=256, device="cpu")
    expected = [
        local.score_pairs([([{"role": m.role, "content": m.content} for m in e.prompt], c)])[0][0] for e, c in pairs
    ]
    with contextlib.ExitStack() as stack:
        rubric = build_reward_fn(config, stack, served=start_reward_model_pools(config, stack=stack))
        assert isinstance(rubric, Rubric)
        pool = rubric.components[0].reward_fn
        assert isinstance(pool, RewardModelPool) and isinstance(pool, RewardFn) and pool.num_alive == 2
        results = pool.score_many(pairs)
        assert pool.num_calls == [1, 1], "two batches of two, one on each actor"
        assert [r.status for r in results] == [RewardStatus.OK] * 4
        assert [r.score for r in results] == pytest.approx(expected, abs=1e-4)
        verdict = rubric(*pairs[3])
        assert verdict.components["reward_model"] == pytest.approx(expected[3], abs=1e-4)
        assert verdict.score == pytest.approx(1.0 + expected[3], abs=1e-4), "correct (1.0) plus the reward model"
    assert wait_for_free_cpus(2.0) == 2.0, "closing the run's stack stops the actors"


def test_hung_failing_and_dead_actors_abstain_naming_the_actor(caplog: pytest.LogCaptureFixture) -> None:
    from sharpen.orchestration.ray.actor_fleet import ActorFleet
    from sharpen.orchestration.ray.reward_actors import RewardModelPool

    fleet_config = FleetConfig(num_replicas=2, num_cpus=0.5, max_restarts=0)
    fleet = ActorFleet(FakeRewardModel, fleet_config, what="rm", start_timeout_s=60)
    actors = list(fleet.actors)
    pool = RewardModelPool(fleet, timeout_s=2.0, batch_size=2)
    try:
        pairs = [(_example(str(i)), "x" * i) for i in range(1, 5)]
        assert [r.score for r in pool.score_many(pairs)] == [1.0, 2.0, 3.0, 4.0]
        assert pool.num_calls == [1, 1]
        with caplog.at_level(logging.WARNING, logger="sharpen.orchestration.ray.reward_actors"):
            failed = pool(_example("q"), "boom")  # rm/0: ties go round the pool
            assert failed.score is None and failed.status is RewardStatus.INFRA_ERROR
            assert "ray actor 'rm/0' failed in score(): ValueError" in caplog.text
            kill_and_wait(actors[1])
            dead = pool(_example("q"), "abc")  # rm/1, now dead
            assert dead.score is None and dead.status is RewardStatus.INFRA_ERROR
            assert "ray actor 'rm/1' died during score()" in caplog.text
            assert pool.num_alive == 1
            assert pool(_example("q"), "abcd").score == 4.0, "the live actor takes the next calls"
            started = time.monotonic()
            hung = pool(_example("q"), "hang")
            assert hung.score is None and hung.status is RewardStatus.TIMEOUT
            assert time.monotonic() - started < 10
            assert "ray actor 'rm/0' did not answer score() within 2 s; 1 rollouts abstain" in caplog.text
            kill_and_wait(actors[0])
            pool(_example("q"), "abc")
            gone = pool(_example("q"), "abc")
        assert gone.score is None and gone.status is RewardStatus.INFRA_ERROR
        assert "none of its 2 replicas is alive" in caplog.text
    finally:
        pool.close()
    assert wait_for_free_cpus(2.0) == 2.0


def test_a_replica_restarted_by_ray_takes_work_again(caplog: pytest.LogCaptureFixture) -> None:
    from sharpen.orchestration.ray.actor_fleet import ActorFleet
    from sharpen.orchestration.ray.reward_actors import RewardModelPool

    fleet = ActorFleet(
        FakeRewardModel, FleetConfig(num_replicas=2, num_cpus=0.5, max_restarts=1), what="rm", start_timeout_s=60
    )
    pool = RewardModelPool(fleet, timeout_s=30.0, batch_size=1)
    try:
        with ThreadPoolExecutor(max_workers=1) as threads:
            hung = threads.submit(pool, _example("q"), "hang")  # rm/0, killed mid-call
            time.sleep(1.0)
            ray.kill(fleet.actors[0], no_restart=False)  # Ray restarts it (max_restarts)
            died = hung.result(timeout=30)
        assert died.score is None and died.status is RewardStatus.INFRA_ERROR
        assert pool.num_alive == 1, "out of the rotation while Ray restarts it"
        deadline = time.monotonic() + 30
        with caplog.at_level(logging.INFO, logger="sharpen.orchestration.ray.reward_actors"):
            while pool.num_alive < 2 and time.monotonic() < deadline:
                assert pool(_example("q"), "ab").score == 2.0  # rm/1 meanwhile
                time.sleep(0.1)
        assert pool.num_alive == 2 and "replica rm/0 is back" in caplog.text
        calls_before = pool.num_calls[0]
        assert [r.score for r in pool.score_many([(_example("q"), "abc")] * 4)] == [3.0] * 4
        assert pool.num_calls[0] > calls_before, "the restarted replica takes work again"
    finally:
        pool.close()
    assert wait_for_free_cpus(2.0) == 2.0
