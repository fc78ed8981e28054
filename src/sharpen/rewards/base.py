"""The reward-function contract: what every scorer of a finished completion implements.

Owns only the protocol. Implementations (the `Rubric`, reward-model clients, judges) live beside it; callers
depend on `RewardFn` alone, so any of them (or a user's own) can be dropped in.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from sharpen.types import Example, RewardResult


@runtime_checkable
class RewardFn(Protocol):
    """Scores one completion of one example. Returns ``score=None`` (abstain) when it cannot judge, never a
    made-up 0: abstained rollouts are left out of the advantages."""

    def __call__(self, example: Example, completion: str) -> RewardResult: ...
