"""A reward model as a pool of Ray actors: ``backend = "ray"`` of a ``reward_model`` reward component.

Each `RewardModelActor` loads the model the way ``sharpen serve-rm`` does (`RewardModelScorer.from_pretrained`) and
scores batches of (prompt, completion) pairs. `RewardModelPool`, in the driver, is a `RewardFn`: it sends each batch
to the least busy live actor (ties in turn), waits at most ``timeout_s`` per call, and turns a failed call into an
abstention of that batch (``timeout``, or ``infra_error`` for an actor that died or raised), logged with the
`ActorCallError` naming the actor; a dead actor leaves the rotation. It does not retry (another step comes) and
does not normalise scores. `start_reward_model_pool` places the actors and ties their lifetime to the run's stack.
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
    """Scores completions with a pool of reward-model actors (`RewardModelActor`, or anything with the same
    ``score`` method). Waits up to ``start_timeout_s`` for every actor to start. ``num_calls`` counts the calls each
    actor was sent, ``num_truncated`` the inputs the actors cut."""

    def __init__(
        self,
        actors: Sequence[Any],
        *,
        names: Sequence[str],
        timeout_s: float,
        batch_size: int,
        start_timeout_s: float,
    ) -> None:
        if not actors or len(actors) != len(names):
            raise ValueError(f"RewardModelPool: need one name per actor, got {len(actors)} actors, {len(names)} names")
        if timeout_s <= 0 or batch_size < 1:
            raise ValueError("RewardModelPool: timeout_s must be > 0 and batch_size >= 1")
        self.actors = list(actors)
        self.names = list(names)
        self.timeout_s = timeout_s
        self.batch_size = batch_size
        self.num_calls = [0] * len(actors)
        self.num_truncated = 0
        self._is_alive = [True] * len(actors)
        self._pending: list[list[Any]] = [[] for _ in actors]  # refs sent and not yet known to be finished
        self._next = 0  # where the search for the least busy actor starts: ties go round the pool
        self._lock = threading.Lock()  # reward functions may be called from a thread pool
        for actor, name in zip(self.actors, self.names, strict=True):
            # `__ray_ready__` is the no-op method Ray adds to every actor: it answers once the constructor is done.
            wait_for(actor.__ray_ready__.remote(), actor=name, call="__init__", timeout_s=start_timeout_s)

    @property
    def num_alive(self) -> int:
        return sum(self._is_alive)

    def __call__(self, example: Example, completion: str) -> RewardResult:
        return self.score_many([(example, completion)])[0]

    def score_many(self, pairs: Sequence[tuple[Example, str]]) -> list[RewardResult]:
        """One result per pair, in order. Batches of ``batch_size`` are all sent before any is awaited, so they
        run on several actors at once; a failed batch abstains only its own pairs."""
        chunks = [pairs[start : start + self.batch_size] for start in range(0, len(pairs), self.batch_size)]
        calls = [self._send(chunk) for chunk in chunks]
        results: list[RewardResult] = []
        for chunk, call in zip(chunks, calls, strict=True):
            results += self._receive(chunk, call)
        return results

    def close(self) -> None:
        """Stop every actor at once; safe to repeat."""
        _kill_all(self.actors)

    def _send(self, chunk: Sequence[tuple[Example, str]]) -> tuple[int, Any] | None:
        """Send ``chunk`` to the least busy live actor: (its index, the call's ref); None when none is alive."""
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
        alive = [i for i in range(len(self.actors)) if self._is_alive[i]]
        for i in alive:  # drop calls that finished since, including ones a timeout gave up on
            if self._pending[i]:
                _, self._pending[i] = ray.wait(self._pending[i], num_returns=len(self._pending[i]), timeout=0)
        if not alive:
            return None
        order = sorted(alive, key=lambda i: (len(self._pending[i]), (i - self._next) % len(self.actors)))
        self._next = (order[0] + 1) % len(self.actors)
        return order[0]

    def _receive(self, chunk: Sequence[tuple[Example, str]], call: tuple[int, Any] | None) -> list[RewardResult]:
        if call is None:
            logger.warning("reward model: all %d actors are dead; %d rollouts abstain", len(self.actors), len(chunk))
            return _abstain(len(chunk), RewardStatus.INFRA_ERROR)
        index, ref = call
        name = self.names[index]
        try:
            scores, num_truncated = wait_for(ref, actor=name, call="score", timeout_s=self.timeout_s)
        except ActorCallError as error:
            is_timeout = isinstance(error.__cause__, GetTimeoutError)
            if isinstance(error.__cause__, RayActorError):
                with self._lock:
                    self._is_alive[index] = False
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


def _kill_all(actors: list[Any]) -> None:
    for actor in actors:
        ray.kill(actor, no_restart=True)


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
    """Start ``config.num_actors`` actors on the run's Ray cluster (a local instance, sized by ``runtime``, when
    this process is not connected yet; shut down with ``stack``) and wait for them to load the model. The actors
    are killed when ``stack`` closes."""
    assert config.backend == "ray" and config.model_path is not None  # the config checks both
    if start_ray(runtime):
        stack.callback(ray.shutdown)
    actor_class = ray.remote(RewardModelActor).options(
        num_cpus=config.cpus_per_actor, num_gpus=config.gpus_per_actor, max_restarts=0
    )
    device = "cuda" if config.gpus_per_actor > 0 else "cpu"
    actors = [
        actor_class.remote(config.model_path, max_length=config.max_length, device=device)
        for _ in range(config.num_actors)
    ]
    stack.callback(_kill_all, actors)  # registered before the wait: a start that times out leaves no actor behind
    return RewardModelPool(
        actors,
        names=[f"{config.name}/{index}" for index in range(config.num_actors)],
        timeout_s=config.timeout_s,
        batch_size=config.batch_size,
        start_timeout_s=config.start_timeout_s,
    )
