"""Engine replicas behind one `InferenceEngine`: requests go to the replica with the fewest requests in flight,
weights go to every replica.

Owns the balancing and the fan-out, nothing about any one engine. A `generate` call's requests are assigned one by
one to the least-loaded replica (ties to the lowest index), counting requests still running from other callers
(the async producer, an evaluation), then each replica's share runs concurrently in a thread and the completions
come back in request order. Assignment depends only on the in-flight counts, so one caller always splits the same
batch the same way (per-request seeds then make sampling independent of the split on engines that honour them,
like vLLM). Replicas that take requests one at a time (`AsyncEngine`: engine servers) get them one at a time:
`generate_async` sends each to the least-loaded replica. `load_weights` gives every replica the same weights
(snapshotted once when they would otherwise be produced again per replica) concurrently, and checks that all
replicas then hold the same version; `WeightSync` verifies each replica's probe through `replicas`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from sharpen.rollout.engines.base import EngineError, FreezableWeights, InferenceEngine, request_level, sleepable
from sharpen.types import Completion, PolicyVersion, SamplingParams

if TYPE_CHECKING:
    import torch


class EngineRouter:
    def __init__(self, replicas: Sequence[InferenceEngine], *, names: Sequence[str] | None = None) -> None:
        if not replicas:
            raise ValueError("EngineRouter needs at least one engine replica")
        self.replicas = list(replicas)
        self.names = list(names) if names is not None else [f"engine replica {i}" for i in range(len(replicas))]
        if len(self.names) != len(self.replicas):
            raise ValueError(f"{len(self.names)} names for {len(self.replicas)} engine replicas")
        self.in_flight = [0] * len(self.replicas)
        self.num_routed = [0] * len(self.replicas)
        """Requests sent to each replica so far (for metrics and tests)."""
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=len(self.replicas), thread_name_prefix="sharpen-router")

    @property
    def policy_version(self) -> PolicyVersion:
        versions = {replica.policy_version for replica in self.replicas}
        if len(versions) > 1:
            held = ", ".join(f"{n}: {r.policy_version}" for n, r in zip(self.names, self.replicas, strict=True))
            raise EngineError(f"engine replicas hold different weight versions ({held})")
        return versions.pop()

    def _assign(self, num_requests: int) -> list[int]:
        with self._lock:
            assignment = []
            for _ in range(num_requests):
                replica = min(range(len(self.replicas)), key=lambda i: self.in_flight[i])
                self.in_flight[replica] += 1
                self.num_routed[replica] += 1
                assignment.append(replica)
            return assignment

    def _release(self, replica: int, num_requests: int) -> None:
        with self._lock:
            self.in_flight[replica] -= num_requests

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        assignment = self._assign(len(prompts))
        shares: dict[int, list[int]] = {}
        for index, replica in enumerate(assignment):
            shares.setdefault(replica, []).append(index)

        def run(replica: int, indices: list[int]) -> list[Completion]:
            try:
                return self.replicas[replica].generate([prompts[i] for i in indices], [params[i] for i in indices])
            except Exception as error:
                raise EngineError(f"{self.names[replica]} failed in generate: {error}") from error
            finally:
                self._release(replica, len(indices))

        futures = {replica: self._pool.submit(run, replica, indices) for replica, indices in shares.items()}
        out: list[Completion | None] = [None] * len(prompts)
        for replica, future in futures.items():
            for index, completion in zip(shares[replica], future.result(), strict=True):
                out[index] = completion
        return [completion for completion in out if completion is not None]

    async def generate_async(self, prompt: list[int], params: SamplingParams) -> Completion:
        """One request to the least-loaded replica (replicas that take requests one by one only)."""
        (replica,) = self._assign(1)
        try:
            engine = request_level(self.replicas[replica])
            if engine is None:
                raise EngineError(f"{self.names[replica]} takes batches only, not single requests")
            return await engine.generate_async(prompt, params)
        except EngineError as error:
            raise EngineError(f"{self.names[replica]} failed in generate: {error}") from error
        finally:
            self._release(replica, 1)

    def score(self, token_ids: list[int]) -> list[float]:
        (replica,) = self._assign(1)
        try:
            return self.replicas[replica].score(token_ids)
        finally:
            self._release(replica, 1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: PolicyVersion) -> dict[str, float]:
        weights = _reusable(weights)

        def load(replica: int) -> dict[str, float]:
            try:
                return self.replicas[replica].load_weights(weights, version=version)
            except Exception as error:
                raise EngineError(f"{self.names[replica]} failed to load weights version {version}: {error}") from error

        results = list(self._pool.map(load, range(len(self.replicas))))
        if self.policy_version != version:
            raise EngineError(f"engine replicas report version {self.policy_version} after loading version {version}")
        metrics = dict(results[0])
        seconds = [r["sync/seconds"] for r in results if "sync/seconds" in r]
        if seconds:
            metrics["sync/replica_max_seconds"] = max(seconds)
        metrics["sync/num_replicas"] = float(len(self.replicas))
        return metrics

    def sleep(self) -> dict[str, float]:
        """Every replica sleeps (concurrently); ``colocate/freed_bytes`` adds up."""
        return _sum_metrics(self._on_every_replica("sleep"))

    def wake_up(self) -> dict[str, float]:
        return _sum_metrics(self._on_every_replica("wake_up"))

    def _on_every_replica(self, method: str) -> list[dict[str, float]]:
        def call(replica: int) -> dict[str, float]:
            engine = sleepable(self.replicas[replica], name=self.names[replica])
            try:
                return getattr(engine, method)()
            except Exception as error:
                raise EngineError(f"{self.names[replica]} failed in {method}: {error}") from error

        return list(self._pool.map(call, range(len(self.replicas))))

    def close(self) -> None:
        try:
            for replica in self.replicas:
                replica.close()
        finally:
            self._pool.shutdown(wait=False)


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
