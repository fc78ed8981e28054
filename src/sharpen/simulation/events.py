"""The discrete-event core: a clock and a heap of future events, popped in time order.

It owns ordering only: events at the same time come out in the order they were pushed (a sequence number breaks
ties), so a run is deterministic given its seed. It does not know what an event means (cluster.py handles them).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field


@dataclass(order=True, slots=True)
class Event:
    time: float
    order: int
    kind: str = field(compare=False)
    payload: tuple[int, ...] = field(compare=False, default=())


@dataclass(kw_only=True, slots=True)
class EventQueue:
    now: float = 0.0
    _heap: list[Event] = field(default_factory=list)
    _count: int = 0

    def push(self, time: float, kind: str, *payload: int) -> None:
        if time < self.now:
            raise ValueError(f"event {kind!r} at {time} is in the past (now {self.now})")
        heapq.heappush(self._heap, Event(time, self._count, kind, payload))
        self._count += 1

    def pop(self) -> Event:
        event = heapq.heappop(self._heap)
        self.now = event.time
        return event

    def __len__(self) -> int:
        return len(self._heap)
