"""Driver-side stand-ins for the trainer and engine actors: objects with the methods the loop calls, each call
forwarded to the actor and awaited with a timeout.

Owns the one place where a Ray failure becomes a run error (`ActorCallError`, naming the actor and the call) and
the hand-off of weights between the two actors: `TrainerProxy.named_weights()` returns a `RemoteWeights` handle
instead of tensors, and `EngineProxy.load_weights` has the trainer actor put its tensors into the object store and
the engine actor take them from there, so the tensors never pass through the driver (with ``weight_sync.assemble =
"receiver"`` every rank puts its pieces and the engine actor assembles them: `WeightRefs`). It does not start or place
actors (`runtime.py`) and holds no component state: the actors own their trainer and engine.

Each call comes back with the spans the actor recorded (`actors.SpanRecordingActor.invoke`); the proxy adds them to
the run's `Timeline` once one is attached (`attach_timeline`), and keeps those of calls made before that.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from sharpen.monitoring import Span, Timeline
from sharpen.rollout.engines import InferenceEngine, pop_engine_metrics, replicas_of, sleepable
from sharpen.rollout.engines.base import generate_prompts, score_prompt
from sharpen.types import (
    Completion,
    ExpertRoutes,
    ImagePart,
    PolicyVersion,
    ProbeScores,
    Rollout,
    SamplingParams,
    TrainBatch,
)
from sharpen.weight_shards import assemble_ranks

if TYPE_CHECKING:
    import torch


class ActorCallError(RuntimeError):
    """A call to a Ray actor timed out or the actor died; the message names the actor and the call."""


class ActorDeathError(ActorCallError):
    """The actor's process ended during a call (a crash, a kill, a lost node): what ``runtime.max_restarts``
    restarts. ``actor`` names it, ``call`` the method it was running."""

    def __init__(self, message: str, *, actor: str, call: str) -> None:
        super().__init__(message)
        self.actor = actor
        self.call = call


DEATH_GRACE_S = 10.0
"""After one trainer rank's call failed, how long the others may take to show whether one of them died (a rank whose
collective lost its peer fails too, often first; the death is the cause)."""


def wait_for(ref: Any, *, actor: str, call: str, timeout_s: float) -> Any:
    """The result of one actor call, or one clear error: the run cannot go on without its trainer or engine."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except GetTimeoutError as error:
        raise ActorCallError(f"ray actor {actor!r} did not answer {call}() within {timeout_s:g} s") from error
    except RayActorError as error:
        raise ActorDeathError(f"ray actor {actor!r} died during {call}(): {error}", actor=actor, call=call) from error


def _failed(ref: Any) -> BaseException | None:
    """The error of a call that has answered, or None when it succeeded."""
    try:
        ray.get(ref, timeout=0)
    except Exception as error:
        return error
    return None


@dataclass(frozen=True, slots=True)
class WeightRefs:
    """Where one version's weights lie in the object store: one ref of ``{name: tensor}`` that the trainer assembled
    (``whole``; trainer rank 0 gathered them), or one ref of each trainer rank's pieces (``pieces``; with
    ``weight_sync.assemble = "receiver"``), which whoever loads them assembles and checks (`assemble_ranks`)."""

    whole: Any = None
    pieces: tuple[Any, ...] = ()

    def fetch(self, *, actor: str, timeout_s: float) -> Iterator[tuple[str, torch.Tensor]]:
        """The whole tensors, fetched into this process (and assembled here from the pieces)."""
        if self.whole is not None:
            return iter(wait_for(self.whole, actor=actor, call="named_weights", timeout_s=timeout_s).items())
        return assemble_ranks(wait_for(list(self.pieces), actor=actor, call="weight_shards", timeout_s=timeout_s))


class RemoteWeights:
    """The trainer actor's current weights, not yet fetched. An `EngineProxy` moves them actor to actor; any other
    consumer (an engine in the driver) iterates them like ``Trainer.named_weights()``, fetching them once."""

    def __init__(self, trainer: TrainerProxy) -> None:
        self.trainer = trainer

    def put(self) -> WeightRefs:
        """The weights put into the object store by the trainer's actors themselves: rank 0's whole tensors, or each
        rank's pieces (`TrainerProxy.assemble_at_receiver`)."""
        # each call's result is wrapped in a list so Ray hands back the ref, not the tensors
        if self.trainer.assemble_at_receiver:
            return WeightRefs(pieces=tuple(ref for (ref,) in self.trainer.call_all("put_shards")))
        (ref,) = self.trainer.call("put_weights")
        return WeightRefs(whole=ref)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.put().fetch(actor=self.trainer.name, timeout_s=self.trainer.timeout_s)

    def freeze(self) -> FrozenWeights:
        """A snapshot of these weights as they are now (async mode publishes one per version): the object-store
        copy the trainer actor puts, which later steps of the trainer do not change."""
        return FrozenWeights(self.put(), trainer=self.trainer)


class FrozenWeights:
    """Weights of one version in the object store; an `EngineProxy` loads them actor to actor, anything else
    iterates them (fetching them into this process). Iterable any number of times."""

    def __init__(self, refs: WeightRefs, *, trainer: TrainerProxy) -> None:
        self.refs = refs
        self.trainer = trainer

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.refs.fetch(actor=self.trainer.name, timeout_s=self.trainer.timeout_s)

    def freeze(self) -> FrozenWeights:
        return self  # already a snapshot


class ActorProxy:
    """Forwarding of method calls to one actor, each awaited for at most ``timeout_s``. The actor's constructor
    (which loads a model) has its own, longer limit ``start_timeout_s``; the proxy is ready when it returns."""

    def __init__(self, actor: Any, *, name: str, timeout_s: float, start_timeout_s: float) -> None:
        self.actor = actor
        self.name = name
        self.timeout_s = timeout_s
        self.timeline: Timeline | None = None
        self._early_spans: list[Span] | None = []
        """Spans received before `attach_timeline` (the actor's start); None once it was called."""
        # `__ray_ready__` is the no-op method Ray adds to every actor: it answers once the constructor is done.
        wait_for(actor.__ray_ready__.remote(), actor=name, call="__init__", timeout_s=start_timeout_s)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.receive(self.submit(method, *args, **kwargs), method)

    def submit(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Start a call without waiting (`receive` waits for it): for calls that must run at the same time on
        several actors, like the two sides of a broadcast."""
        return self.actor.invoke.remote(method, *args, **kwargs)

    def receive(self, ref: Any, method: str, *, timeout_s: float | None = None) -> Any:
        result, spans = wait_for(ref, actor=self.name, call=method, timeout_s=timeout_s or self.timeout_s)
        self.record_spans(spans)
        return result

    def record_spans(self, spans: list[Span]) -> None:
        if self._early_spans is not None:
            self._early_spans.extend(spans)
        elif self.timeline is not None:
            self.timeline.add_spans(spans)

    def attach_timeline(self, timeline: Timeline | None) -> None:
        """Add the actor's spans to ``timeline`` from now on, those of earlier calls first; None drops them (the
        timeline is off, or about to be closed)."""
        if timeline is not None and self._early_spans:
            timeline.add_spans(self._early_spans)
        self._early_spans = None
        self.timeline = timeline

    def kill(self) -> None:
        """Stop the actor at once (a hung call included); safe to repeat."""
        ray.kill(self.actor, no_restart=True)

    def close(self) -> None:
        """Let the component release what it holds (engine worker processes), then stop the actor."""
        try:
            self.call("close")
        finally:
            self.kill()


class TrainerProxy(ActorProxy):
    """A `TrainerHandle` whose trainer lives in an actor: each method of the protocol is one call. Paths must be
    visible to the actor (one node, or a shared filesystem)."""

    assemble_at_receiver = False
    """Whether a sync's weights leave the ranks as pieces that the receiver assembles (``weight_sync.assemble =
    "receiver"``, several ranks) rather than as rank 0's gathered tensors."""

    def call_all(self, method: str, *args: Any) -> list[Any]:
        """Every rank's result (one actor: its own)."""
        return [self.call(method, *args)]

    def step(self, batch: TrainBatch) -> dict[str, float]:
        return self.call("step", batch)

    def compute_logprobs(self, token_ids: list[int], images: tuple[ImagePart, ...] = ()) -> list[float]:
        return self.call("compute_logprobs", token_ids, images)

    def probe(self, token_ids: list[int]) -> ProbeScores:
        return self.call("probe", token_ids)

    def kl_penalties(self, rollouts: list[Rollout]) -> list[list[float]]:
        return self.call("kl_penalties", rollouts)

    def named_weights(self) -> RemoteWeights:
        return RemoteWeights(self)

    def snapshot_weights(self) -> FrozenWeights:
        """This version's weights, put into the object store by the trainer actor (later steps do not change it)."""
        return RemoteWeights(self).freeze()

    def save_checkpoint(self, folder: Path) -> None:
        self.call("save_checkpoint", folder)

    def load_checkpoint(self, folder: Path) -> None:
        self.call("load_checkpoint", folder)

    def export(self, folder: Path) -> None:
        self.call("export", folder)


class TrainerGroupProxy(TrainerProxy):
    """The `Trainer` of several data-parallel rank actors (FSDP2): every call goes to all ranks at once (their
    collectives must run in step), each gets the same arguments (put into the object store once), and the result
    is rank 0's. One deadline for the whole call; the error names the rank that hung or died."""

    def __init__(self, ranks: list[ActorProxy], *, name: str, timeout_s: float) -> None:  # pyright: ignore
        # no super().__init__: the rank proxies already waited for their actors
        self.ranks = ranks
        self.name = name
        self.timeout_s = timeout_s

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.call_all(method, *args, **kwargs)[0]

    def call_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Every rank's result, in rank order."""
        if args or kwargs:
            args = tuple(ray.put(arg) for arg in args)  # a top-level ObjectRef reaches the actor as its value
            kwargs = {key: ray.put(value) for key, value in kwargs.items()}
        refs = [rank.actor.invoke.remote(method, *args, **kwargs) for rank in self.ranks]
        deadline = time.monotonic() + self.timeout_s
        self._raise_a_death(refs, method, deadline)
        results = []
        for rank, ref in zip(self.ranks, refs, strict=True):
            remaining = max(deadline - time.monotonic(), 0.0)
            result, spans = wait_for(ref, actor=rank.name, call=method, timeout_s=remaining)
            rank.record_spans(spans)
            results.append(result)
        return results

    def _raise_a_death(self, refs: list[Any], method: str, deadline: float) -> None:
        """Wait for the ranks' answers in the order they come; once one failed, raise `ActorDeathError` for the
        first rank that died, giving the others up to `DEATH_GRACE_S` to show it. Returns when all answered, the
        deadline passed, or no rank died: the caller then reports in rank order."""
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(deadline - time.monotonic(), 0.0))
            if not ready:
                return
            if _failed(ready[0]) is not None:
                break
        else:
            return
        grace_end = min(time.monotonic() + DEATH_GRACE_S, deadline)
        while True:
            for rank, ref in zip(self.ranks, refs, strict=True):
                if ref not in pending and isinstance(error := _failed(ref), RayActorError):
                    raise ActorDeathError(
                        f"ray actor {rank.name!r} died during {method}(): {error}", actor=rank.name, call=method
                    ) from error
            if not pending or time.monotonic() >= grace_end:
                return
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(grace_end - time.monotonic(), 0.0))

    def attach_timeline(self, timeline: Timeline | None) -> None:
        for rank in self.ranks:
            rank.attach_timeline(timeline)

    def kill(self) -> None:
        for rank in self.ranks:
            rank.kill()

    def close(self) -> None:
        try:
            self.call("close")
        finally:
            self.kill()


class EngineProxy(ActorProxy):
    """An `InferenceEngine` whose engine lives in an actor. ``policy_version`` mirrors the actor's: it is read
    once at start and changes only through `load_weights`."""

    def __init__(self, actor: Any, *, name: str, timeout_s: float, start_timeout_s: float) -> None:
        super().__init__(actor, name=name, timeout_s=timeout_s, start_timeout_s=start_timeout_s)
        self.policy_version: PolicyVersion = self.call("get_policy_version")

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        return self.call("generate", prompts, params)

    def generate_with_images(
        self, prompts: list[list[int]], images: Sequence[tuple[ImagePart, ...]], params: list[SamplingParams]
    ) -> list[Completion]:
        """Image prompts go to the actor with their images (bytes; its engine makes the pixels)."""
        return self.call("generate_with_images", prompts, list(images), params)

    def score(self, token_ids: list[int], images: tuple[ImagePart, ...] = ()) -> list[float]:
        return self.call("score", token_ids, images)

    def probe(self, token_ids: list[int], routes: ExpertRoutes | None) -> tuple[list[float], bool]:
        """The weight-sync probe, run by the actor on its engine (`ProbedElsewhere`): it replays ``routes`` where the
        engine can."""
        return self.call("probe", token_ids, routes)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: PolicyVersion) -> dict[str, float]:
        started = time.perf_counter()
        # Weights of a trainer actor go actor to actor; tensors already in the driver are put from here.
        if isinstance(weights, RemoteWeights):
            refs = weights.put()
        elif isinstance(weights, FrozenWeights):
            refs = weights.refs
        else:
            refs = WeightRefs(whole=ray.put(dict(weights)))
        put_seconds = time.perf_counter() - started
        if refs.whole is not None:  # a top-level ObjectRef argument reaches the actor as the dict it refers to
            metrics: dict[str, float] = self.call("load_weights", refs.whole, version=version)
        else:  # refs inside a list stay refs: the engine actor fetches and assembles the ranks' pieces
            metrics = self.call("load_shards", list(refs.pieces), version=version)
        self.policy_version = version
        return {**metrics, "sync/put_seconds": put_seconds}

    def sleep(self) -> dict[str, float]:
        return self.call("sleep")

    def wake_up(self) -> dict[str, float]:
        return self.call("wake_up")


class BroadcastEngines:
    """The run's engine (one `EngineProxy`, or an `EngineRouter` of them) with weight sync by torch.distributed
    broadcast (``weight_sync.transport = "broadcast"``): the trainer's current weights (`RemoteWeights`) go from
    trainer rank 0 to every engine actor of the weight group at once, in checksummed buckets. Other weights (an
    async run's frozen snapshots, tensors in the driver) go the object-store way of the wrapped engine."""

    def __init__(self, inner: InferenceEngine, *, trainer: TrainerProxy, engines: list[EngineProxy]) -> None:
        self.inner = inner
        self.trainer = trainer
        self.engines = engines

    @property
    def replicas(self) -> list[InferenceEngine]:
        """The serving replicas: the probe check after a sync scores each of them."""
        return replicas_of(self.inner)

    @property
    def policy_version(self) -> PolicyVersion:
        return self.inner.policy_version

    def pop_metrics(self) -> dict[str, float]:
        """The router's counts (retries, restarts, load per replica), as without broadcast."""
        return pop_engine_metrics(self.inner)

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        return self.inner.generate(prompts, params)

    def generate_with_images(
        self, prompts: list[list[int]], images: Sequence[tuple[ImagePart, ...]], params: list[SamplingParams]
    ) -> list[Completion]:
        return generate_prompts(self.inner, prompts, images, params)

    def score(self, token_ids: list[int], images: tuple[ImagePart, ...] = ()) -> list[float]:
        return score_prompt(self.inner, token_ids, images)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: PolicyVersion) -> dict[str, float]:
        if not isinstance(weights, RemoteWeights):
            return self.inner.load_weights(weights, version=version)
        receiving = [engine.submit("receive_weights", version) for engine in self.engines]  # they wait for the sender
        metrics: dict[str, float] = self.trainer.call("broadcast_weights", version)
        for engine, ref in zip(self.engines, receiving, strict=True):
            engine.receive(ref, "receive_weights")
            engine.policy_version = version
        return {**metrics, "sync/num_receivers": float(len(self.engines))}

    def sleep(self) -> dict[str, float]:
        return sleepable(self.inner).sleep()

    def wake_up(self) -> dict[str, float]:
        return sleepable(self.inner).wake_up()

    def close(self) -> None:
        self.inner.close()


def weight_group_ranks(members: list[int]) -> tuple[int, list[int]]:
    """The weight group's size and each engine's first rank, for engines taking ``members[i]`` ranks each (vLLM:
    one per worker, any other engine one); rank 0 is the trainer's sender."""
    first_ranks = [1 + sum(members[:index]) for index in range(len(members))]
    return 1 + sum(members), first_ranks


def join_weight_group(
    trainer: TrainerProxy, engines: list[EngineProxy], *, timeout_s: float, backend: str = "gloo"
) -> None:
    """Trainer rank 0 (the sender, hosting the group's store) and every engine actor join one weight group; an
    engine whose workers receive the broadcast themselves (vLLM) brings one rank per worker."""
    first = trainer.ranks[0] if isinstance(trainer, TrainerGroupProxy) else trainer
    master_addr, master_port = first.call("rendezvous_address")
    world_size, first_ranks = weight_group_ranks([int(engine.call("num_weight_group_members")) for engine in engines])
    joining = [
        (engine, engine.submit("join_weight_group", master_addr, master_port, rank, world_size, backend))
        for rank, engine in zip(first_ranks, engines, strict=True)
    ]
    trainer.call("join_weight_group", master_addr, master_port, world_size, backend)
    for engine, ref in joining:
        engine.receive(ref, "join_weight_group", timeout_s=timeout_s)
