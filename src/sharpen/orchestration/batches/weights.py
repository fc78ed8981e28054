"""Weights as the async producer sees them: the versions the trainer published (`WeightStore`) and the engine
seen through them (`VersionedEngine`, which loads the version each call must use, whole batches or chunk by chunk).

Owns the hand-over of weight versions between the trainer's thread and the producer's; the admission of batches is
`producer.py`'s, and moving weights into an engine and proving they arrived is `WeightSync`'s.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from sharpen.rollout.engines import request_level
from sharpen.rollout.episodes import derive_seed
from sharpen.types import Completion, PolicyVersion, ProbeScores, SamplingParams

if TYPE_CHECKING:
    import torch

    from sharpen.orchestration.handles import WeightSnapshot
    from sharpen.rollout.engines import InferenceEngine

WeightUpdates = Literal["between_batches", "in_flight", "abort"]


@dataclass(kw_only=True, slots=True)
class PublishedWeights:
    version: PolicyVersion
    weights: WeightSnapshot
    """The trainer's snapshot of this version (`TrainerHandle.snapshot_weights`)."""
    probe: ProbeScores | None
    """The trainer's probe logprobs at this version, with its routes when it records them (None: verification
    off)."""


class ProducerStopped(Exception):
    """The producer was told to stop while it waited."""


class WeightStore:
    """Published weight versions, shared by the trainer's thread (publishes) and the producer's (waits, loads).
    Keeps only versions someone may still load: the newest, and those at or above the producer's floor."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._versions: dict[PolicyVersion, PublishedWeights] = {}
        self._stopped = False

    def publish(self, published: PublishedWeights) -> None:
        with self._cond:
            self._versions[published.version] = published
            self._cond.notify_all()

    @property
    def latest(self) -> PolicyVersion:
        with self._cond:
            return max(self._versions, default=-1)

    def get(self, version: PolicyVersion) -> PublishedWeights:
        with self._cond:
            if version not in self._versions:
                raise KeyError(f"weight version {version} is not held (held: {sorted(self._versions)})")
            return self._versions[version]

    def wait_for(self, version: PolicyVersion) -> float:
        """Block until a version >= ``version`` is published; returns the seconds waited."""
        started = time.perf_counter()
        with self._cond:
            while not self._stopped and max(self._versions, default=-1) < version:
                self._cond.wait()
            if self._stopped:
                raise ProducerStopped
        return time.perf_counter() - started

    def release_below(self, version: PolicyVersion) -> None:
        with self._cond:
            newest = max(self._versions, default=-1)
            for held in [v for v in self._versions if v < version and v != newest]:
                del self._versions[held]

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._versions)


class VersionedEngine:
    """The engine as the producer sees it: before each call it loads the version it is told to use.

    ``between_batches``: every call uses version ``target`` (set per batch). ``in_flight`` and ``abort``: each
    call is cut into chunks of ``chunk_tokens``; before every chunk the newest published version is loaded, so a
    completion may span versions (reported in `Completion.versions`); under ``abort`` a completion that is still
    running when the version changes starts over with the new weights."""

    def __init__(
        self,
        engine: InferenceEngine,
        store: WeightStore,
        *,
        load: Callable[[PublishedWeights, InferenceEngine], dict[str, float]],
        updates: WeightUpdates = "between_batches",
        chunk_tokens: int = 32,
        decode: Callable[[list[int]], str] | None = None,
    ) -> None:
        self.engine = engine
        self.store = store
        self.updates = updates
        self.chunk_tokens = chunk_tokens
        self.target: PolicyVersion = engine.policy_version
        self._load = load
        self._decode = decode
        self._metrics: dict[str, float] = {}

    @property
    def policy_version(self) -> PolicyVersion:
        return self.engine.policy_version

    def ensure(self, version: PolicyVersion) -> None:
        if self.engine.policy_version == version:
            return
        metrics = self._load(self.store.get(version), self.engine)
        self._metrics["async/num_weight_loads"] = self._metrics.get("async/num_weight_loads", 0.0) + 1
        for name, value in metrics.items():
            self._metrics[name] = value  # the last load's numbers (probe mismatch, seconds)

    def pop_metrics(self) -> dict[str, float]:
        metrics = dict(self._metrics)
        self._metrics.clear()
        return metrics

    def wanted(self) -> PolicyVersion:
        """The version the next engine call must use."""
        return self.target if self.updates == "between_batches" else max(self.store.latest, self.target)

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        self.ensure(self.wanted())
        if self.updates == "between_batches":
            return self.engine.generate(prompts, params)
        return self._generate_in_chunks(prompts, params)

    def score(self, token_ids: list[int]) -> list[float]:
        self.ensure(self.wanted())
        return self.engine.score(token_ids)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: PolicyVersion) -> dict[str, float]:
        raise RuntimeError("the producer's engine takes weights from the weight store, not from load_weights")

    def close(self) -> None:
        pass  # the engine belongs to the run

    def _generate_in_chunks(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        parts = [PartialCompletion() for _ in prompts]
        while live := [i for i, part in enumerate(parts) if not part.is_done]:
            self.ensure(self.wanted())
            version = self.engine.policy_version
            if self.updates == "abort":
                for i in live:
                    if parts[i].versions and parts[i].versions[0] != version:
                        aborted = self._metrics.get("async/num_aborted_tokens", 0.0) + len(parts[i].token_ids)
                        self._metrics["async/num_aborted_tokens"] = aborted
                        parts[i] = PartialCompletion()
            requests = [chunk_request(prompts[i], params[i], parts[i], self.chunk_tokens) for i in live]
            outputs = self.engine.generate([ids for ids, _ in requests], [p for _, p in requests])
            for i, output in zip(live, outputs, strict=True):
                parts[i].extend(output, version=version, limit=params[i].max_new_tokens)
        return [part.completion(self._decode) for part in parts]


class RequestLevelVersionedEngine(VersionedEngine):
    """`VersionedEngine` over an engine that takes requests one at a time (`AsyncEngine`: an engine server), which
    episodes then await one by one. ``between_batches`` and ``in_flight``: the version to use is loaded between
    requests, one load at a time; under ``in_flight`` requests already running are frozen by the engine for the load
    and go on with the new weights, and the engine reports which version sampled each token (no chunks, no
    re-prefill). (``abort`` keeps `VersionedEngine`'s chunked batch calls: see `versioned_engine`.)"""

    def __init__(self, engine: InferenceEngine, store: WeightStore, **kwargs: Any) -> None:
        super().__init__(engine, store, **kwargs)
        requests = request_level(engine)
        if requests is None or self.updates == "abort":
            raise TypeError(f"{type(engine).__name__} with {self.updates} updates does not take requests one at a time")
        self._requests = requests
        self._loading: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None

    def _load_lock(self) -> asyncio.Lock:
        """One lock per event loop (each batch of the producer runs its own loop)."""
        loop = asyncio.get_running_loop()
        if self._loading is None or self._loading[0] is not loop:
            self._loading = (loop, asyncio.Lock())
        return self._loading[1]

    async def generate_async(self, prompt: list[int], params: SamplingParams) -> Completion:
        wanted = self.wanted()
        if self.engine.policy_version != wanted:
            async with self._load_lock():  # one load at a time; the others wait, then find it loaded
                await asyncio.to_thread(self.ensure, wanted)
        return await self._requests.generate_async(prompt, params)


def versioned_engine(
    engine: InferenceEngine, store: WeightStore, *, updates: WeightUpdates = "between_batches", **kwargs: Any
) -> VersionedEngine:
    """The producer's view of ``engine``: request by request where the engine takes requests one at a time (and
    updates do not abort, which restarts completions chunk by chunk)."""
    if request_level(engine) is not None and updates != "abort":
        return RequestLevelVersionedEngine(engine, store, updates=updates, **kwargs)
    return VersionedEngine(engine, store, updates=updates, **kwargs)


@dataclass(kw_only=True)
class PartialCompletion:
    """A completion generated chunk by chunk (in-flight updates, partial rollouts): its tokens so far, each with the
    version that sampled it."""

    token_ids: list[int] = field(default_factory=list[int])
    logprobs: list[float] = field(default_factory=list[float])
    versions: list[int] = field(default_factory=list[int])
    texts: list[str] = field(default_factory=list[str])
    finish_reason: Literal["stop", "length"] = "length"
    is_done: bool = False

    def extend(self, output: Completion, *, version: PolicyVersion, limit: int) -> None:
        self.token_ids.extend(output.token_ids)
        self.logprobs.extend(output.logprobs)
        self.versions.extend([version] * len(output.token_ids))
        self.texts.append(output.text)
        if output.finish_reason == "stop":
            self.finish_reason, self.is_done = "stop", True
        elif len(self.token_ids) >= limit or not output.token_ids:
            self.finish_reason, self.is_done = "length", True

    def completion(self, decode: Callable[[list[int]], str] | None) -> Completion:
        text = "".join(self.texts) if decode is None or len(self.texts) == 1 else decode(self.token_ids)
        return Completion(
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            text=text,
            finish_reason=self.finish_reason,
            versions=self.versions,
        )


def chunk_request(
    prompt: list[int], params: SamplingParams, part: PartialCompletion, chunk_tokens: int
) -> tuple[list[int], SamplingParams]:
    """The request that goes on with ``part``: the prompt and its tokens so far, at most ``chunk_tokens`` more, and a
    seed of its own per position (so the continuation does not depend on where earlier chunks ended)."""
    done = len(part.token_ids)
    seed = params.seed if done == 0 or params.seed is None else derive_seed(params.seed, "chunk", done)
    budget = min(chunk_tokens, params.max_new_tokens - done)
    return prompt + part.token_ids, replace(params, max_new_tokens=budget, seed=seed)
