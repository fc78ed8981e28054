"""Per-request generation on top of a batched engine: `RequestBatcher.generate_one` is awaited by each episode
on its own, and the requests that are waiting together go to the engine as one batch.

Owns forming batches, nothing about any engine. A request joins the pending batch; the batch is sent once the event loop
has gone ``settle_ticks`` turns without a new request (every episode that could ask in the meantime has asked) and it is
worth sending: it holds at least half of the open episodes (those between `episode_started` and `episode_ended`; the
others are in their environments), or its oldest request has waited as long as the last batch took to generate, so a few
slow environments cost a batch at most that much latency instead of splitting every turn into small batches. It is sent
at once when it holds ``max_batch_size`` requests. Within a batch, requests are ordered by the key each brings (the
episode runner's (example, sample)), so the engine sees the same batch in the same order whatever order the coroutines
happened to run in: with instant environments every turn's batch is exactly the lockstep loop's. Requests that come
over HTTP (agents through the agent endpoint) arrive a few loop turns apart even when every agent answers at once;
``settle_seconds`` then also waits until none has arrived for that long (while some open episode has none pending),
so one slow arrival does not split a turn's batch in two.

One batch is in flight at a time (engines are not required to take concurrent calls). With an ``executor`` (one
worker thread) the batch generates there while the event loop goes on stepping environments, and the requests that
arrive meanwhile form the next batch, sent as soon as the engine is free; without one, the engine call blocks the
loop, as the lockstep loop did. Each completion is stamped with the engine's policy version read right after its
batch (unless the engine stamped it per token). A batch the engine refuses for one request's own input (a prompt past
its context) is asked again request by request (`generate_each`): only the refused request's episode gets the
`EngineInputError`; an engine failing as a whole fails every request of the batch.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field, replace
from typing import Any

from sharpen.rollout.engines.base import EngineInputError, InferenceEngine, generate_each
from sharpen.types import Completion, ImagePart, PolicyVersion, SamplingParams


class DaemonWorker(Executor):
    """One daemon thread that runs submitted calls in order. Unlike `ThreadPoolExecutor`'s threads, which the
    interpreter joins at exit, a call that never returns (a hung engine) cannot keep the process from exiting after
    the run has reported it."""

    def __init__(self, name: str = "sharpen-engine") -> None:
        self._calls: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        assert not kwargs, "DaemonWorker.submit takes positional arguments only"
        future: Future[Any] = Future()
        self._calls.put((future, fn, args))
        return future

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            future, fn, args = call
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as error:  # handed to whoever awaits the call
                future.set_exception(error)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if cancel_futures:
            while True:
                try:
                    call = self._calls.get_nowait()
                except queue.Empty:
                    break
                if call is not None:
                    call[0].cancel()
        self._calls.put(None)
        if wait:
            self._thread.join()


@dataclass(kw_only=True)
class _Request:
    key: Sequence[Any]
    prompt: list[int]
    params: SamplingParams
    arrived: float
    future: asyncio.Future[tuple[Completion, PolicyVersion]] = field(repr=False)
    images: tuple[ImagePart, ...] = ()


class RequestBatcher:
    """``await generate_one(prompt, params, key=...)`` for many coroutines, one ``engine.generate`` per batch."""

    def __init__(
        self,
        engine: InferenceEngine,
        *,
        executor: Executor | None = None,
        max_batch_size: int = 1 << 16,
        settle_ticks: int = 3,
        settle_seconds: float = 0.0,
    ) -> None:
        if max_batch_size < 1 or settle_ticks < 1:
            raise ValueError("RequestBatcher: max_batch_size and settle_ticks must be at least 1")
        self.engine = engine
        self.executor = executor
        self.max_batch_size = max_batch_size
        self.settle_ticks = settle_ticks
        self.settle_seconds = settle_seconds
        self.batch_sizes: list[int] = []
        """The size of every batch sent so far (for metrics and tests)."""
        self._pending: list[_Request] = []
        self._scheduled = False
        self._is_busy = False
        self._quiet_ticks = 0
        self._num_open = 0
        self._last_batch_seconds = 0.0
        self._timer: asyncio.TimerHandle | None = None

    def episode_started(self) -> None:
        """An episode starts asking (it counts towards "half of the open episodes")."""
        self._num_open += 1

    def episode_ended(self) -> None:
        """An episode is done asking: a pending batch may now be worth sending."""
        self._num_open -= 1
        self._next()

    async def generate_one(
        self, prompt: list[int], params: SamplingParams, *, key: Sequence[Any] = (), images: tuple[ImagePart, ...] = ()
    ) -> tuple[Completion, PolicyVersion]:
        """The completion of one request and the policy version the engine held when it was made. ``images``: the
        images the prompt holds placeholders for (`generate_prompts`)."""
        loop = asyncio.get_running_loop()
        request = _Request(
            key=key, prompt=prompt, params=params, arrived=loop.time(), future=loop.create_future(), images=images
        )
        self._pending.append(request)
        self._quiet_ticks = 0
        if self._is_busy:
            pass  # sent when the engine is free
        elif len(self._pending) >= self.max_batch_size:
            self._send()
        elif not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._tick)
        return await request.future

    def _tick(self) -> None:
        if not self._pending or self._is_busy:
            self._scheduled = False
            return
        self._quiet_ticks += 1
        if self._quiet_ticks < self.settle_ticks and len(self._pending) < self.max_batch_size:
            asyncio.get_running_loop().call_soon(self._tick)
            return
        loop = asyncio.get_running_loop()
        quiet = loop.time() - self._pending[-1].arrived
        if quiet < self.settle_seconds and len(self._pending) < self._num_open:
            loop.call_later(self.settle_seconds - quiet, self._tick)  # more may be on their way
            return
        self._scheduled = False
        waited = loop.time() - min(request.arrived for request in self._pending)
        if 2 * len(self._pending) >= self._num_open or waited >= self._last_batch_seconds:
            self._send()
        elif self._timer is None:  # sent when the oldest request has waited a batch's time, unless sooner
            self._timer = loop.call_later(self._last_batch_seconds - waited, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._next()

    def _send(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch = sorted(self._pending[: self.max_batch_size], key=lambda request: tuple(request.key))
        self._pending = self._pending[self.max_batch_size :]
        self._quiet_ticks = 0
        self.batch_sizes.append(len(batch))
        if self.executor is None:
            try:
                self._deliver(batch, self._generate(batch))
            except Exception as error:  # every waiting episode sees the engine's error
                self._fail(batch, error)
            self._next()
            return
        self._is_busy = True
        running = asyncio.get_running_loop().run_in_executor(self.executor, self._generate, batch)
        running.add_done_callback(lambda done: self._done(batch, done))

    def _generate(self, batch: list[_Request]) -> tuple[list[Completion | EngineInputError], PolicyVersion]:
        started = time.perf_counter()
        completions = generate_each(
            self.engine, [r.prompt for r in batch], [r.images for r in batch], [r.params for r in batch]
        )
        self._last_batch_seconds = time.perf_counter() - started
        return completions, self.engine.policy_version

    def _done(
        self, batch: list[_Request], done: asyncio.Future[tuple[list[Completion | EngineInputError], PolicyVersion]]
    ) -> None:
        self._is_busy = False
        error = done.exception()
        if error is not None:
            self._fail(batch, error)
        else:
            self._deliver(batch, done.result())
        self._next()

    def _next(self) -> None:
        """Start settling the next batch from what arrived meanwhile."""
        if self._pending and not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._tick)

    @staticmethod
    def _deliver(batch: list[_Request], result: tuple[list[Completion | EngineInputError], PolicyVersion]) -> None:
        completions, version = result
        for request, completion in zip(batch, completions, strict=True):
            if request.future.done():  # its episode may have been cancelled meanwhile
                continue
            if isinstance(completion, EngineInputError):  # refused for its own input: only its episode sees it
                request.future.set_exception(completion)
                continue
            if not completion.versions:
                completion = replace(completion, versions=[version] * len(completion.token_ids))
            request.future.set_result((completion, version))

    @staticmethod
    def _fail(batch: list[_Request], error: BaseException) -> None:
        for request in batch:
            if not request.future.done():
                request.future.set_exception(error)
