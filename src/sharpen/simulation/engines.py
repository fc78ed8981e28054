"""One inference engine replica as a fluid model of continuous batching: every running sequence gains one token
per decode round, and a round's duration depends on how many sequences run and how long their contexts are.

It owns a replica's state between events (running sequences, decode rounds done, busy and down time) and answers
"when does the next sequence finish". Rounds are continuous between events: the cluster advances a replica to the
current time before changing what runs on it. It does not route requests or decide admission (cluster.py).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

RoundSeconds = Callable[[int, float], float]  # (running sequences, summed context tokens) -> seconds per round


@dataclass(kw_only=True, slots=True)
class EngineReplica:
    index: int
    capacity: int
    slowdown: float = 1.0
    rounds: float = 0.0
    clock: float = 0.0  # the time up to which `rounds` is accounted for (may lie ahead: prefill, restart)
    epoch: int = 0  # bumped on every change, so events scheduled before it are ignored
    busy_seconds: float = 0.0
    occupancy_seconds: float = 0.0  # running sequences / capacity, integrated over time
    _finish: list[tuple[float, int]] = field(default_factory=list)  # (round at which it finishes, sequence id)
    _context_offset: float = 0.0  # sum over running sequences of (context at admission - rounds at admission)
    _contexts: dict[int, float] = field(default_factory=dict)  # sequence id -> its term of _context_offset

    @property
    def num_running(self) -> int:
        return len(self._contexts)

    def _context(self, extra_rounds: float = 0.0) -> float:
        return self._context_offset + self.num_running * (self.rounds + extra_rounds)

    def _segment_seconds(self, num_rounds: float, round_seconds: RoundSeconds) -> float:
        """Seconds for `num_rounds` more rounds; the context grows linearly, so the mean round is the middle one."""
        middle = self._context(num_rounds / 2.0)
        return num_rounds * round_seconds(self.num_running, middle) * self.slowdown

    def advance(self, now: float, round_seconds: RoundSeconds) -> None:
        if now <= self.clock:
            return
        elapsed = now - self.clock
        if self.num_running:
            guess = elapsed / (round_seconds(self.num_running, self._context()) * self.slowdown)
            per_round = self._segment_seconds(guess, round_seconds) / guess if guess > 0 else 1.0
            self.rounds += elapsed / per_round
            self.busy_seconds += elapsed
            self.occupancy_seconds += elapsed * self.num_running / self.capacity
        self.clock = now

    def advance_to_next_finish(self, now: float) -> None:
        """The replica's finish event came due: account the time and land exactly on the head's finishing round
        (no rounding drift between the scheduled time and the rounds)."""
        elapsed = max(0.0, now - self.clock)
        self.busy_seconds += elapsed
        self.occupancy_seconds += elapsed * self.num_running / self.capacity
        self.clock = max(self.clock, now)
        if self._finish:
            self.rounds = max(self.rounds, self._finish[0][0])

    def admit(self, sequence_id: int, *, context: float, num_tokens: int, now: float, stall: float) -> None:
        """Start a sequence with `context` tokens already in its KV cache that will decode `num_tokens` more;
        `stall` (its prefill) holds every running sequence."""
        self.clock = max(self.clock, now) + stall
        self.busy_seconds += stall
        term = context - self.rounds
        self._contexts[sequence_id] = term
        self._context_offset += term
        heapq.heappush(self._finish, (self.rounds + num_tokens, sequence_id))
        self.epoch += 1

    def pop_finished(self) -> list[int]:
        done: list[int] = []
        while self._finish and self._finish[0][0] <= self.rounds + 1e-6:
            _, sequence_id = heapq.heappop(self._finish)
            if sequence_id in self._contexts:
                self._context_offset -= self._contexts.pop(sequence_id)
                done.append(sequence_id)
        if done:
            self.epoch += 1
        return done

    def next_finish_time(self, round_seconds: RoundSeconds) -> float | None:
        while self._finish and self._finish[0][1] not in self._contexts:
            heapq.heappop(self._finish)
        if not self._finish:
            return None
        remaining = max(0.0, self._finish[0][0] - self.rounds)
        return self.clock + self._segment_seconds(remaining, round_seconds)

    def fail(self, *, now: float, restart_seconds: float) -> list[tuple[int, float]]:
        """Drop every running sequence (returned with its context length now) and go down for a while."""
        lost = [(sequence_id, self.rounds + term) for sequence_id, term in self._contexts.items()]
        self._contexts.clear()
        self._finish.clear()
        self._context_offset = 0.0
        self.clock = max(self.clock, now) + restart_seconds
        self.epoch += 1
        return lost
