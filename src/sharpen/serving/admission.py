"""Fair admission of the work a served component does: ``max_running`` slots, a bounded queue, and turns shared
between callers so that one caller flooding a replica cannot starve another.

Owns who runs next and who is refused. A caller is a name (the shell uses the ``X-Sharpen-Caller`` header, else the
peer's address). A freed slot goes to the caller served least recently (round robin over the callers that wait;
first come, first served within one caller). When the queue is full, a newcomer takes the place of the newest
waiter of the caller with the most waiters, provided that caller keeps at least as many as the newcomer then has
(the one pushed out is refused, as a newcomer would be: nothing of it ran); otherwise the newcomer is refused. So
with two callers each keeps about half of the queue, whoever came first. Does not know HTTP (the shell answers
a refusal 503 with Retry-After).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

_MAX_REMEMBERED = 4096
"""Callers whose last turn is remembered; beyond it, those not waiting are forgotten (they count as new again)."""


@dataclass(kw_only=True, slots=True, eq=False)
class _Ticket:
    caller: str
    is_admitted: bool = False
    decided: threading.Event = field(default_factory=threading.Event)


class FairQueue:
    """``admit(caller)`` takes a slot (waiting in the queue when there is room) or says False; ``release()`` frees
    one. Thread-safe."""

    def __init__(self, *, max_running: int, max_queue_size: int) -> None:
        if max_running < 1 or max_queue_size < 0:
            raise ValueError(f"max_running must be >= 1 and max_queue_size >= 0, got {max_running}, {max_queue_size}")
        self.max_running = max_running
        self.max_queue_size = max_queue_size
        self.num_running = self.num_waiting = 0
        self._waiting: dict[str, deque[_Ticket]] = {}
        self._last_turn: dict[str, int] = {}
        self._turn = 0
        self._lock = threading.Lock()

    @property
    def is_full(self) -> bool:
        """A newcomer from a caller already waiting would be refused now."""
        return self.num_running >= self.max_running and self.num_waiting >= self.max_queue_size

    def admit(self, caller: str) -> bool:
        """Take a running slot, waiting for it when the queue has room for ``caller``; False when refused (at once,
        or later when a newcomer of a caller with fewer waiters takes its place)."""
        with self._lock:
            if self.num_running < self.max_running and not self._waiting:
                self._grant(caller)
                return True
            if self.num_waiting >= self.max_queue_size and not self._push_out_for(caller):
                return False
            ticket = _Ticket(caller=caller)
            self._waiting.setdefault(caller, deque()).append(ticket)
            self.num_waiting += 1
            self._grant_waiting()
        ticket.decided.wait()
        return ticket.is_admitted

    def release(self) -> None:
        with self._lock:
            self.num_running -= 1
            self._grant_waiting()

    def _grant(self, caller: str) -> None:
        self.num_running += 1
        self._turn += 1
        self._last_turn[caller] = self._turn
        if len(self._last_turn) > _MAX_REMEMBERED:
            self._last_turn = {c: t for c, t in self._last_turn.items() if c in self._waiting or c == caller}

    def _grant_waiting(self) -> None:
        """Hand free slots to the waiting callers served least recently (never served: first)."""
        while self.num_running < self.max_running and self._waiting:
            caller = min(self._waiting, key=lambda c: self._last_turn.get(c, 0))
            ticket = self._pop(caller, newest=False)
            ticket.is_admitted = True
            self._grant(caller)
            ticket.decided.set()

    def _push_out_for(self, caller: str) -> bool:
        """Refuse the newest waiter of the caller with the most waiters, if it keeps at least as many as ``caller``
        will have; True when a place was freed."""
        if not self._waiting:
            return False
        heaviest = max(self._waiting, key=lambda c: len(self._waiting[c]))
        if len(self._waiting[heaviest]) < len(self._waiting.get(caller, ())) + 2:
            return False
        self._pop(heaviest, newest=True).decided.set()
        return True

    def _pop(self, caller: str, *, newest: bool) -> _Ticket:
        tickets = self._waiting[caller]
        ticket = tickets.pop() if newest else tickets.popleft()
        if not tickets:
            del self._waiting[caller]
        self.num_waiting -= 1
        return ticket
