"""Engine replicas behind one `InferenceEngine`: requests go to the serving replica with the fewest requests in
flight, weights go to every serving replica, and a replica that fails is routed around and restarted.

Owns the balancing, the fan-out and the failover, nothing about any one engine. A `generate` call's requests are
assigned one by one to the least-loaded replica (ties to the lowest index), counting requests still running from
other callers (the async producer, an evaluation), then each replica's share runs concurrently in a thread and the
completions come back in request order. Assignment depends only on the in-flight counts, so one caller always splits
the same batch the same way (per-request seeds then make sampling independent of the split on engines that honour
them, like vLLM). Replicas that take requests one at a time (`AsyncEngine`: engine servers) get them one at a time:
`generate_async` sends each to the least-loaded replica. `load_weights` gives every replica the same weights
(snapshotted once when they would otherwise be produced again per replica) concurrently, and checks that all
replicas then hold the same version; `WeightSync` verifies each replica's probe through `replicas`.

Failover (``rollout.failover``; states and restarts are `failover.py`'s). A request whose replica fails
(`EngineUnavailable`: connection refused or reset, HTTP 5xx, the server process gone) or does not answer within
``replica_timeout_s`` is sent again, with the same prompt and parameters (so the same seed: the same tokens on
vLLM), to another serving replica, at most ``max_retries`` times; a batch's failed share goes to the others the same
way. The failed replica leaves the rotation, and every request still running on it is re-sent at once; it is
restarted in the background where it can be (`RestartableEngine`) and rejoins at the next `load_weights`. Every
other error (a bad request, an engine bug) stops the run as before, naming the replica. `load_weights`, `score`,
`sleep`/`wake_up`, `policy_version` and `replicas` involve serving replicas only (and `load_weights` the restarted
ones waiting for it); a replica that fails to load goes down and restarts while the others go on, and the load
fails only when no replica took it. Replicas of a broadcast weight group (`WeightGroupEngine` joined to it) cannot
be restarted into the group, whose size is fixed: their `restart` refuses and the replica stays out of the run.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from sharpen.config.engines import FailoverConfig
from sharpen.rollout.engines.base import (
    AsyncEngine,
    EngineError,
    EngineUnavailable,
    FreezableWeights,
    InferenceEngine,
    request_level,
    score_prompt,
    sleepable,
)
from sharpen.rollout.engines.failover import Lease, ReplicaSet, wake_threadsafe
from sharpen.rollout.engines.shares import in_thread, run_shares
from sharpen.types import Completion, ImagePart, PolicyVersion, SamplingParams

if TYPE_CHECKING:
    import torch


class _ReplicaFailed(Exception):
    """A request's replica failed (the message says how): send the request elsewhere."""


class EngineRouter:
    def __init__(
        self,
        replicas: Sequence[InferenceEngine],
        *,
        names: Sequence[str] | None = None,
        failover: FailoverConfig | None = None,
    ) -> None:
        if not replicas:
            raise ValueError("EngineRouter needs at least one engine replica")
        self.engines = list(replicas)
        """Every replica, serving or not."""
        self.names = list(names) if names is not None else [f"engine replica {i}" for i in range(len(replicas))]
        if len(self.names) != len(self.engines):
            raise ValueError(f"{len(self.names)} names for {len(self.engines)} engine replicas")
        self.failover = failover if failover is not None else FailoverConfig()
        self.health = ReplicaSet(self.engines, self.names, config=self.failover)

    @property
    def replicas(self) -> list[InferenceEngine]:
        """The replicas serving now (what a weight sync verifies)."""
        return [self.engines[i] for i in self.health.serving()]

    @property
    def in_flight(self) -> list[int]:
        return list(self.health.in_flight)

    @property
    def num_routed(self) -> list[int]:
        """Requests sent to each replica so far, retries included (for metrics and tests)."""
        return list(self.health.num_routed)

    @property
    def policy_version(self) -> PolicyVersion:
        serving = self.health.serving()
        if not serving:
            return self.health.version
        versions = {self.engines[i].policy_version for i in serving}
        if len(versions) > 1:
            held = ", ".join(f"{self.names[i]}: {self.engines[i].policy_version}" for i in serving)
            raise EngineError(f"engine replicas hold different weight versions ({held})")
        return versions.pop()

    # generation

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        return self.generate_with_images(prompts, [()] * len(prompts), params)

    def generate_with_images(
        self, prompts: list[list[int]], images: Sequence[tuple[ImagePart, ...]], params: list[SamplingParams]
    ) -> list[Completion]:
        """`generate` of prompts with images (``images[i]``: prompt i's); each replica's share goes to it with its
        images (`generate_prompts`: a replica that takes no images is an `EngineError`)."""
        out: list[Completion | None] = [None] * len(prompts)
        pending, causes, num_rounds = list(range(len(prompts))), [], 0
        while pending:
            leases = self.health.acquire(len(pending))
            shares: dict[int, tuple[Lease, list[int]]] = {}
            for index, lease in zip(pending, leases, strict=True):
                shares.setdefault(lease.replica, (lease, []))[1].append(index)
            timeout = self.failover.replica_timeout_s
            pending, failures = run_shares(
                self.health, shares, prompts, params, out, timeout=timeout, is_retry=num_rounds > 0, images=images
            )
            if pending:  # the failed shares' requests go out again, to the replicas still serving
                causes += failures
                num_rounds += 1
                self._check_retries(causes, num_attempts=num_rounds)
                self.health.count_retries(len(pending))
        return [completion for completion in out if completion is not None]

    async def generate_async(self, prompt: list[int], params: SamplingParams) -> Completion:
        """One request to the least-loaded replica (replicas that take requests one by one only), sent again to
        another one if its replica fails."""
        causes: list[str] = []
        while True:
            lease = await self.health.acquire_async()
            try:
                engine = request_level(self.engines[lease.replica])
                if engine is None:
                    raise EngineError(f"{self.names[lease.replica]} takes batches only, not single requests")
                completion = await self._attempt(engine, lease, prompt, params)
            except _ReplicaFailed as failure:
                causes.append(str(failure))
                self._check_retries(causes, num_attempts=len(causes))
                self.health.count_retries(1)
                continue
            finally:
                self.health.release(lease.replica)
            if causes:
                self.health.record(lease.replica, "served_retry")
            return completion

    async def _attempt(
        self, engine: AsyncEngine, lease: Lease, prompt: list[int], params: SamplingParams
    ) -> Completion:
        name, timeout = self.names[lease.replica], self.failover.replica_timeout_s
        loop = asyncio.get_running_loop()
        went_down: asyncio.Future[None] = loop.create_future()
        unwatch = self.health.watch(lease, functools.partial(wake_threadsafe, loop, went_down))
        request = asyncio.ensure_future(engine.generate_async(prompt, params))
        try:
            done, _ = await asyncio.wait((request, went_down), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            unwatch()
            if not request.done():  # cancelled from outside (an episode's timeout), gone down, or hung
                request.cancel()
                request.add_done_callback(_retrieve)
        if request in done:
            try:
                return request.result()
            except EngineUnavailable as error:
                cause = f"{name}: {error}"
            except EngineError as error:
                raise EngineError(f"{name} failed in generate: {error}") from error
        elif went_down in done:
            raise _ReplicaFailed(f"{name} went down while the request ran ({self.health.causes[lease.replica]})")
        else:
            cause = f"{name} did not answer within {timeout:g} s (rollout.failover.replica_timeout_s)"
        self.health.fail(lease, cause)
        raise _ReplicaFailed(cause)

    def _check_retries(self, causes: list[str], *, num_attempts: int) -> None:
        if num_attempts > self.failover.max_retries:
            raise EngineError(
                f"a request failed on engine replicas {num_attempts} times (rollout.failover.max_retries = "
                f"{self.failover.max_retries}): " + "; ".join(causes)
            )

    def score(self, token_ids: list[int], images: tuple[ImagePart, ...] = ()) -> list[float]:
        """`InferenceEngine.score` on one serving replica; ``images``: those the ids hold placeholders for (an image
        probe's: the replica's ``score`` takes them)."""
        causes: list[str] = []
        while True:
            (lease,) = self.health.acquire(1)
            name = self.names[lease.replica]
            try:
                return score_prompt(self.engines[lease.replica], token_ids, images)
            except EngineUnavailable as error:
                causes.append(f"{name}: {error}")
                self.health.fail(lease, causes[-1])
                self._check_retries(causes, num_attempts=len(causes))
                self.health.count_retries(1)
            finally:
                self.health.release(lease.replica)

    # weights, sleep

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: PolicyVersion) -> dict[str, float]:
        weights = _reusable(weights)
        leases = self.health.begin_load()
        loaded: list[Lease] = []
        results: list[dict[str, float]] = []
        causes: list[str] = []
        try:
            calls = [in_thread(functools.partial(self._load, lease, weights, version)) for lease in leases]
            for lease, call in zip(leases, calls, strict=True):
                try:
                    results.append(call.result())
                    loaded.append(lease)
                except Exception as error:
                    causes.append(f"{self.names[lease.replica]} failed to load weights version {version}: {error}")
                    self.health.fail(lease, causes[-1])
        finally:
            self.health.end_load(version, loaded)
        if not loaded:
            raise EngineError("no engine replica took the weights: " + "; ".join(causes))
        if self.policy_version != version:
            raise EngineError(f"engine replicas report version {self.policy_version} after loading version {version}")
        metrics = dict(results[0])
        seconds = [r["sync/seconds"] for r in results if "sync/seconds" in r]
        if seconds:
            metrics["sync/replica_max_seconds"] = max(seconds)
        metrics["sync/num_replicas"] = float(len(loaded))
        if causes:
            metrics["sync/num_failed_replicas"] = float(len(causes))
        return metrics

    def _load(self, lease: Lease, weights: Iterable[tuple[str, Any]], version: PolicyVersion) -> dict[str, float]:
        return self.engines[lease.replica].load_weights(weights, version=version)

    def sleep(self) -> dict[str, float]:
        """Every serving replica sleeps (concurrently); ``colocate/freed_bytes`` adds up."""
        return _sum_metrics(self._on_serving_replicas("sleep"))

    def wake_up(self) -> dict[str, float]:
        return _sum_metrics(self._on_serving_replicas("wake_up"))

    def _on_serving_replicas(self, method: str) -> list[dict[str, float]]:
        leases = self.health.serving_leases()
        engines = [sleepable(self.engines[lease.replica], name=self.names[lease.replica]) for lease in leases]
        calls = [in_thread(getattr(engine, method)) for engine in engines]
        results = []
        for lease, call in zip(leases, calls, strict=True):
            name = self.names[lease.replica]
            try:
                results.append(call.result())
            except EngineUnavailable as error:
                self.health.fail(lease, f"{name} failed in {method}: {error}")
            except Exception as error:
                raise EngineError(f"{name} failed in {method}: {error}") from error
        return results

    # metrics, closing

    def pop_metrics(self) -> dict[str, float]:
        """The step's ``rollout/requests_retried``, ``engine/restarts``, ``engine/replica_<i>/requests`` and
        ``engine/num_serving`` (`MeteredEngine`)."""
        return self.health.pop_metrics()

    def close(self) -> None:
        self.health.close()
        errors = []
        for engine in self.engines:
            try:
                engine.close()
            except Exception as error:
                errors.append(error)
        if errors:
            raise errors[0]


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Take the outcome of a request that nobody awaits any more (so it is not reported as never retrieved)."""
    if not task.cancelled():
        task.exception()


def _sum_metrics(results: list[dict[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for result in results:
        for name, value in result.items():
            total[name] = total.get(name, 0.0) + value
    return total


def _reusable(weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
    """Weights every replica can read: a one-shot iterator (a trainer's gather) becomes a list of the same
    tensors (no copies); remote weights are frozen once (put into the object store once, not per replica)."""
    if isinstance(weights, FreezableWeights):
        return weights.freeze()
    if isinstance(weights, (list, tuple)):
        return weights
    return list(weights)
