"""A service fleet (environment servers, reward workers) as a multi-server FIFO queue: `num_workers` workers,
each call taking a drawn service time.

It owns only the queue and its busy time; the cluster decides what a finished call leads to. A fleet of 0 workers
is not modelled: its calls finish at once.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

from sharpen.simulation.events import EventQueue
from sharpen.simulation.scenario import FleetSection


@dataclass(kw_only=True, slots=True)
class Fleet:
    name: str
    section: FleetSection
    rng: random.Random
    busy_seconds: float = 0.0
    _free: int = 0
    _waiting: deque[int] = field(default_factory=deque)

    def __post_init__(self) -> None:
        self._free = self.section.num_workers

    def submit(self, item: int, events: EventQueue) -> None:
        if self.section.num_workers == 0:
            events.push(events.now, self.name, item)
        elif self._free:
            self._start(item, events)
        else:
            self._waiting.append(item)

    def finish(self, events: EventQueue) -> None:
        """A worker is done (the cluster calls this when it handles the fleet's event)."""
        if self.section.num_workers == 0:
            return
        self._free += 1
        if self._waiting:
            self._start(self._waiting.popleft(), events)

    def _start(self, item: int, events: EventQueue) -> None:
        self._free -= 1
        seconds = self.section.service_seconds.sample(self.rng)
        self.busy_seconds += seconds
        events.push(events.now + seconds, self.name, item)
