"""Answers kept by Idempotency-Key, so that a retried request gets the first answer instead of a second execution.

Owns the bounded, expiring table of answers and the hand-off to a request that arrives while the first one with its
key still runs (it waits for that one's answer). Does not decide which routes are idempotent (the shell does) nor
survive a restart: a replica that dies takes its keys with it, which is why clients retry elsewhere only when the
work died with that replica.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(kw_only=True, slots=True)
class Answer:
    """A finished HTTP answer: status and JSON body bytes."""

    status: int
    body: bytes
    retry_after: int | None = None


@dataclass(kw_only=True, slots=True)
class _Entry:
    digest: str
    """The request's method, path and body hash: a key reused for another request is refused, not answered."""
    answer: Answer | None = None
    finished_at: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)


class KeyConflict(ValueError):
    """An Idempotency-Key reused for a different request."""


class IdempotencyTable:
    """``claim(key, digest)`` -> None (you run it, then ``finish``) or the `Answer` to give (a repeat)."""

    def __init__(self, *, ttl_s: float, max_keys: int) -> None:
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self.num_replayed = 0
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._lock = threading.Lock()

    def claim(self, key: str, digest: str, *, timeout: float) -> Answer | None:
        """None when this request is the first with ``key`` (run it and call `finish`); otherwise the first one's
        answer, waiting up to ``timeout`` seconds while it still runs (a 503 when it does not end in time)."""
        with self._lock:
            self._expire(time.monotonic())
            entry = self._entries.get(key)
            if entry is None:
                self._entries[key] = _Entry(digest=digest)
                return None
            if entry.digest != digest:
                raise KeyConflict(f"Idempotency-Key {key!r} was used for a different request")
            self.num_replayed += 1
        if not entry.done.wait(timeout):
            return Answer(status=503, body=b'{"error": "the first request with this key is still running"}')
        assert entry.answer is not None
        return entry.answer

    def finish(self, key: str, answer: Answer) -> None:
        """Keep ``answer`` for ``key``; an answer that says nothing ran (503) is dropped, so a retry runs it."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return
            entry.answer, entry.finished_at = answer, time.monotonic()
            if answer.status == 503:
                del self._entries[key]
            else:
                self._entries.move_to_end(key)
        entry.done.set()

    def _expire(self, now: float) -> None:
        finished = [k for k, e in self._entries.items() if e.done.is_set() and now - e.finished_at > self.ttl_s]
        for key in finished:
            del self._entries[key]
        while len(self._entries) >= self.max_keys:
            oldest = next((k for k, e in self._entries.items() if e.done.is_set()), None)
            if oldest is None:
                break  # every key is running: the queue bound keeps these few
            del self._entries[oldest]
