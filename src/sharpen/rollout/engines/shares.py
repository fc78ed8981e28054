"""A batch call of the router, split into one share per replica, each running in its own thread: the shares are
settled as they finish, as their replica is taken out (by anyone), or as they pass ``replica_timeout_s``; a failed
share's requests are handed back to the router to go out again.

Owns the threads and the settling of shares, nothing about which replica gets what (`failover.ReplicaSet` chooses)
or what happens next (the router's retry loop).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from sharpen.rollout.engines.base import EngineError, EngineUnavailable, generate_prompts
from sharpen.rollout.engines.failover import Lease, ReplicaSet
from sharpen.types import Completion, ImagePart, SamplingParams

T = TypeVar("T")


@dataclass(kw_only=True, slots=True)
class _Share:
    """One replica's share of a batch call, running in its own thread."""

    lease: Lease
    indices: list[int]
    result: Future[list[Completion]]
    went_down: Future[None]
    """Done when the replica is taken out while the share runs (by anyone)."""
    unwatch: Callable[[], None]
    deadline: float
    """``time.monotonic()`` by which it must be done (``replica_timeout_s``; inf: none)."""

    def is_settled(self) -> bool:
        return self.result.done() or self.went_down.done() or time.monotonic() >= self.deadline


def run_shares(
    health: ReplicaSet,
    assignment: dict[int, tuple[Lease, list[int]]],
    prompts: list[list[int]],
    params: list[SamplingParams],
    out: list[Completion | None],
    *,
    timeout: float | None,
    is_retry: bool,
    images: Sequence[tuple[ImagePart, ...]] | None = None,
) -> tuple[list[int], list[str]]:
    """Each replica's share (``assignment``: its lease and request indices) in a thread; the completions go into
    ``out``. ``images``: each prompt's (`generate_prompts`; None: text prompts). Returns the requests of the shares
    whose replica failed, and how each failed."""
    rows = images if images is not None else [()] * len(prompts)
    shares = [
        _start_share(health, lease, i, prompts, rows, params, timeout=timeout) for lease, i in assignment.values()
    ]
    failed: list[int] = []
    causes: list[str] = []
    try:
        while shares:
            deadline = min(share.deadline for share in shares)
            wait = None if deadline == float("inf") else max(deadline - time.monotonic(), 0.0)
            futures: list[Future[Any]] = [f for share in shares for f in (share.result, share.went_down)]
            concurrent.futures.wait(futures, timeout=wait, return_when=concurrent.futures.FIRST_COMPLETED)
            for share in [share for share in shares if share.is_settled()]:
                shares.remove(share)
                cause = _settle(health, share, out, timeout=timeout, is_retry=is_retry)
                if cause is not None:
                    failed += share.indices
                    causes.append(cause)
    finally:
        for share in shares:  # left behind by an error: the run stops
            share.unwatch()
            health.release(share.lease.replica, len(share.indices))
    return sorted(failed), causes


def _start_share(
    health: ReplicaSet,
    lease: Lease,
    indices: list[int],
    prompts: list[list[int]],
    images: Sequence[tuple[ImagePart, ...]],
    params: list[SamplingParams],
    *,
    timeout: float | None,
) -> _Share:
    engine = health.engines[lease.replica]
    went_down: Future[None] = Future()
    share = ([prompts[i] for i in indices], [images[i] for i in indices], [params[i] for i in indices])
    return _Share(
        lease=lease,
        indices=indices,
        result=in_thread(functools.partial(generate_prompts, engine, *share)),
        went_down=went_down,
        unwatch=health.watch(lease, functools.partial(_set_done, went_down)),
        deadline=time.monotonic() + timeout if timeout is not None else float("inf"),
    )


def _settle(
    health: ReplicaSet, share: _Share, out: list[Completion | None], *, timeout: float | None, is_retry: bool
) -> str | None:
    """A share that finished, or whose replica went down or let it time out: its completions go into ``out``
    (None), or the cause of its replica's failure is returned (the replica taken out)."""
    share.unwatch()
    replica, num_requests = share.lease.replica, len(share.indices)
    health.release(replica, num_requests)
    name = health.names[replica]
    if share.result.done():
        error = share.result.exception()
        if error is None:
            for index, completion in zip(share.indices, share.result.result(), strict=True):
                out[index] = completion
            if is_retry:
                health.record(replica, "served_retry", f"{num_requests} requests")
            return None
        if not isinstance(error, EngineUnavailable):
            raise EngineError(f"{name} failed in generate: {error}") from error
        cause = f"{name}: {error}"
    elif share.went_down.done():  # whoever saw it took the replica out
        return f"{name} went down while it ran {num_requests} requests ({health.causes[replica]})"
    else:
        assert timeout is not None  # only a deadline of replica_timeout_s passes
        cause = f"{name} did not answer within {timeout:g} s (rollout.failover.replica_timeout_s)"
    health.fail(share.lease, cause)
    return cause


def in_thread(call: Callable[[], T]) -> Future[T]:
    """``call()`` in a daemon thread of its own: a call that never returns (a hung engine) is left behind without
    keeping the process from exiting."""
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(call())
        except BaseException as error:  # handed to whoever waits for the call
            future.set_exception(error)

    threading.Thread(target=run, name="sharpen-router", daemon=True).start()
    return future


def _set_done(future: Future[None]) -> None:
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        future.set_result(None)
