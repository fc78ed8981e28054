"""The reward-function contract: what every scorer of a finished completion implements.

Owns the protocol and the error for breaking it. Implementations (the `Rubric`, reward-model clients, judges) live
beside it; callers depend on `RewardFn` alone, so any of them (or a user's own) can be dropped in.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from sharpen.types import Example, RewardResult


@runtime_checkable
class RewardFn(Protocol):
    """Scores one completion of one example. Returns ``score=None`` (abstain) when it cannot judge, never a
    made-up 0: abstained rollouts are left out of the advantages."""

    def __call__(self, example: Example, completion: str) -> RewardResult: ...


class RewardContractError(TypeError):
    """A reward function returned something that is not a verdict. It is a bug in that function, not a fault to
    tolerate: the `Rubric` and `score_rollout`, which abstain for a reward function that raises, let it through."""
