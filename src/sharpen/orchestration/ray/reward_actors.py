"""A reward model on a fleet of Ray actors: ``backend = "ray"`` of a ``reward_model`` reward component.

The replicas are an `ActorFleet` (the replica mechanism every Ray-hosted fleet shares: ``fleet.num_replicas``,
resources per replica, restarts), of `RewardModelActor`: each loads the model the way ``sharpen serve-rm`` does
(`RewardModelScorer.from_pretrained`) and scores batches of (prompt, completion) pairs. Scores are stateless, so
the replicas are load-balanced, not addressed one by one: `RewardModelPool`, in the driver, is a `RewardFn` that
sends each batch to the least busy replica in rotation (ties in turn), waits at most ``timeout_s`` per call, and
turns a failed call into an abstention of that batch (``timeout``, or ``infra_error`` for a replica that died or
raised), logged with the `ActorCallError` naming the replica. A replica that died leaves the rotation until a
`Probe` finds it restarted by Ray (then it takes work again) or dead for good. The pool does not retry (another
step comes) and does not normalise scores. `start_reward_model_pool` starts the fleet and ties its lifetime to the
run's stack.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from sharpen.config import SharpenConfig
from sharpen.config.rewards import RewardModelComponentConfig
from sharpen.config.runtime import RuntimeConfig
from sharpen.orchestration.ray.actor_fleet import ActorFleet, Probe
from sharpen.orchestration.ray.cluster import start_ray
from sharpen.orchestration.ray.proxies import ActorCallError, wait_for
from sharpen.rewards.rm_client import VERIFIER
from sharpen.rewards.rm_server import RewardModelScorer
from sharpen.types import Example, RewardResult, RewardStatus

logger = logging.getLogger(__name__)

Pair = tuple[list[dict[str, str]], str]
"""What an actor scores: the prompt as chat messages, and the completion."""


class RewardModelActor:
    """Holds one copy of the reward model."""

    def __init__(self, model_path: str, *, max_length: int, device: str) -> None:
        self.scorer = RewardModelScorer.from_pretrained(model_path, max_length=max_length, device=device)

    def score(self, pairs: list[Pair]) -> tuple[list[float], int]:
        """One forward over ``pairs``: a score each, and how many inputs were cut to ``max_length``."""
        scores, truncated = self.scorer.score_pairs(pairs)
        return scores, sum(truncated)


class RewardModelPool:
    """Scores completions on a fleet of reward models (`RewardModelActor`, or anything with the same ``score``
    method), started: its replicas are fixed for the pool's life. ``num_calls`` counts the calls each replica was
    sent, ``num_truncated`` the inputs the replicas cut."""

    def __init__(self, fleet: ActorFleet, *, timeout_s: float, batch_size: int) -> None:
        if timeout_s <= 0 or batch_size < 1:
            raise ValueError("RewardModelPool: timeout_s must be > 0 and batch_size >= 1")
        self.fleet = fleet
        self.actors = list(fleet.actors)
        self.names = list(fleet.names)
        self.timeout_s = timeout_s
        self.batch_size = batch_size
        self.num_calls = [0] * len(self.actors)
        self.num_truncated = 0
        self._probes: dict[int, Probe] = {}  # replicas out of the rotation since a call found them dead
        self._dead: set[int] = set()  # replicas dead for good
        self._pending: list[list[Any]] = [[] for _ in self.actors]  # refs sent and not yet known to be finished
        self._next = 0  # where the search for the least busy replica starts: ties go round the pool
        self._lock = threading.Lock()  # reward functions may be called from a thread pool

    @property
    def num_alive(self) -> int:
        """Replicas in the rotation."""
        return len(self.actors) - len(self._probes) - len(self._dead)

    def __call__(self, example: Example, completion: str) -> RewardResult:
        return self.score_many([(example, completion)])[0]

    def score_many(self, pairs: Sequence[tuple[Example, str]]) -> list[RewardResult]:
        """One result per pair, in order. Batches of ``batch_size`` are all sent before any is awaited, so they
        run on several replicas at once; a failed batch abstains only its own pairs."""
        chunks = [pairs[start : start + self.batch_size] for start in range(0, len(pairs), self.batch_size)]
        calls = [self._send(chunk) for chunk in chunks]
        results: list[RewardResult] = []
        for chunk, call in zip(chunks, calls, strict=True):
            results += self._receive(chunk, call)
        return results

    def close(self) -> None:
        """Stop every replica at once; safe to repeat."""
        self.fleet.close()

    def _send(self, chunk: Sequence[tuple[Example, str]]) -> tuple[int, Any] | None:
        """Send ``chunk`` to the least busy replica in rotation: (its index, the call's ref); None when none is."""
        pairs = [([{"role": m.role, "content": m.text} for m in e.prompt], completion) for e, completion in chunk]
        with self._lock:
            index = self._least_busy()
            if index is None:
                return None
            ref = self.actors[index].score.remote(pairs)
            self._pending[index].append(ref)
            self.num_calls[index] += 1
        return index, ref

    def _least_busy(self) -> int | None:
        self._check_probes()
        alive = [i for i in range(len(self.actors)) if i not in self._probes and i not in self._dead]
        for i in alive:  # drop calls that finished since, including ones a timeout gave up on
            if self._pending[i]:
                _, self._pending[i] = ray.wait(self._pending[i], num_returns=len(self._pending[i]), timeout=0)
        if not alive:
            return None
        order = sorted(alive, key=lambda i: (len(self._pending[i]), (i - self._next) % len(self.actors)))
        self._next = (order[0] + 1) % len(self.actors)
        return order[0]

    def _check_probes(self) -> None:
        """Without waiting: a replica out of the rotation that Ray restarted comes back; one dead for good stays out."""
        for index, probe in list(self._probes.items()):
            if not probe.wait(0.0):
                continue
            del self._probes[index]
            if probe.is_alive:
                logger.info("reward model: replica %s is back (restarted by Ray)", self.names[index])
            else:
                self._dead.add(index)
                logger.warning("reward model: replica %s died for good: %s", self.names[index], probe.last_error)

    def _receive(self, chunk: Sequence[tuple[Example, str]], call: tuple[int, Any] | None) -> list[RewardResult]:
        if call is None:
            logger.warning(
                "reward model: none of its %d replicas is alive; %d rollouts abstain", len(self.actors), len(chunk)
            )
            return _abstain(len(chunk), RewardStatus.INFRA_ERROR)
        index, ref = call
        name = self.names[index]
        try:
            scores, num_truncated = wait_for(ref, actor=name, call="score", timeout_s=self.timeout_s)
        except ActorCallError as error:
            is_timeout = isinstance(error.__cause__, GetTimeoutError)
            if isinstance(error.__cause__, RayActorError):
                with self._lock:  # out of the rotation until Ray has restarted it
                    if index not in self._probes and index not in self._dead:
                        self._probes[index] = Probe(self.actors[index], ActorFleet.ready_method)
            logger.warning("reward model: %s; %d rollouts abstain", error, len(chunk))
            return _abstain(len(chunk), RewardStatus.TIMEOUT if is_timeout else RewardStatus.INFRA_ERROR)
        except RayTaskError as error:  # the actor is fine but its forward raised (an input it cannot render)
            message = f"ray actor {name!r} failed in score(): {error.cause!r}"
            logger.warning("reward model: %s; %d rollouts abstain", ActorCallError(message), len(chunk))
            return _abstain(len(chunk), RewardStatus.INFRA_ERROR)
        with self._lock:
            self.num_truncated += num_truncated
            with contextlib.suppress(ValueError):  # already pruned by `_least_busy`
                self._pending[index].remove(ref)
        return [RewardResult(score=float(score), status=RewardStatus.OK, verifier=VERIFIER) for score in scores]


def _abstain(num: int, status: RewardStatus) -> list[RewardResult]:
    return [RewardResult(score=None, status=status, verifier=VERIFIER) for _ in range(num)]


def start_reward_model_pools(config: SharpenConfig, *, stack: contextlib.ExitStack) -> dict[str, RewardModelPool]:
    """A pool for every reward-model component of ``config`` served by Ray actors, by component name."""
    return {
        component.name: start_reward_model_pool(component, runtime=config.runtime, stack=stack)
        for component in config.reward.components
        if component.type == "reward_model" and component.backend == "ray"
    }


def start_reward_model_pool(
    config: RewardModelComponentConfig, *, runtime: RuntimeConfig, stack: contextlib.ExitStack
) -> RewardModelPool:
    """Start the fleet of ``config.fleet`` on the run's Ray cluster (a local instance, sized by ``runtime``, when
    this process is not connected yet; shut down with ``stack``) and wait for its replicas to load the model. The
    replicas end when ``stack`` closes."""
    assert config.backend == "ray" and config.model_path is not None  # the config checks both
    if start_ray(runtime):
        stack.callback(ray.shutdown)
    device = "cuda" if config.fleet.num_gpus > 0 else "cpu"
    fleet = ActorFleet(
        RewardModelActor,
        config.fleet,
        what=config.name,
        start_timeout_s=config.start_timeout_s,
        args=(config.model_path,),
        kwargs={"max_length": config.max_length, "device": device},
    )
    stack.callback(fleet.close)
    return RewardModelPool(fleet, timeout_s=config.timeout_s, batch_size=config.batch_size)
