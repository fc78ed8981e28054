"""Ranks of the broadcast weight group: an engine whose workers join the group themselves (vLLM) takes one rank
per worker and receives through them; any other engine's actor joins as one rank and loads what it receives."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("ray")


class WorkersEngine:
    """Stands in for vLLM with two workers."""

    num_weight_group_members = 2

    def __init__(self) -> None:
        self.joined: dict[str, Any] = {}
        self.received: list[int] = []

    def join_weight_group(self, **kwargs: Any) -> None:
        self.joined = kwargs

    def receive_broadcast(self, *, version: int) -> dict[str, float]:
        self.received.append(version)
        return {"sync/num_workers": 2.0}


class FakeEngineProxy:
    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self.name = "engine"

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.actor, method)(*args)

    def submit(self, method: str, *args: Any) -> Any:
        return lambda: getattr(self.actor, method)(*args)

    def receive(self, ref: Any, call: str, timeout_s: float) -> Any:
        return ref()


class FakeTrainerProxy:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def call(self, method: str, *args: Any) -> Any:
        self.calls.append((method, *args))
        return ("10.0.0.1", 29500) if method == "rendezvous_address" else None


def engine_actor(engine: Any) -> Any:
    from sharpen.orchestration.ray.actors import EngineActor

    actor = object.__new__(EngineActor)  # the body only, without building an engine
    actor.engine = engine
    return actor


def test_vllm_like_engines_bring_a_rank_per_worker_and_receive_through_them(monkeypatch: pytest.MonkeyPatch) -> None:
    from sharpen.orchestration.ray import actors
    from sharpen.orchestration.ray.proxies import join_weight_group

    opened: list[dict[str, Any]] = []
    monkeypatch.setattr(actors, "open_weight_group", lambda **kwargs: opened.append(kwargs) or "group")
    workers_a, workers_b = WorkersEngine(), WorkersEngine()
    plain = engine_actor(object())  # an hf engine: its actor is the member
    engines = [FakeEngineProxy(engine_actor(e)) for e in (workers_a,)] + [FakeEngineProxy(plain)]
    engines.append(FakeEngineProxy(engine_actor(workers_b)))
    trainer = FakeTrainerProxy()
    join_weight_group(trainer, engines, timeout_s=5, backend="gloo")  # type: ignore[arg-type]

    assert trainer.calls[-1] == ("join_weight_group", "10.0.0.1", 29500, 6, "gloo")  # 1 + 2 + 1 + 2 ranks
    assert workers_a.joined == {
        "master_addr": "10.0.0.1",
        "master_port": 29500,
        "first_rank": 1,
        "world_size": 6,
        "backend": "gloo",
    }
    assert opened == [{"rank": 3, "world_size": 6, "master_addr": "10.0.0.1", "master_port": 29500, "backend": "gloo"}]
    assert workers_b.joined["first_rank"] == 4
    assert engines[0].actor.receive_weights(7) == {"sync/num_workers": 2.0} and workers_a.received == [7]
