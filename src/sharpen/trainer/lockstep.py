"""`RankLockstep`: how the ranks of a sharded trainer stay in step through one trainer step.

With a sharded backend every forward and backward is collective: each rank takes its share of a mini-batch
(balanced by tokens), and a rank with fewer micro-batches than another runs filler passes (one short rollout, its
loss times 0) so that every rank calls the collectives the same number of times. Per-rank statistics that are
maxima travel through the backend's sum under per-rank names. On one device all of this is the identity. The
objective (`objective.py`) and the step schedule (`trainer.py`) never see a rank.
"""

from __future__ import annotations

from collections.abc import Callable

from sharpen.trainer.backends.base import TrainerBackend
from sharpen.trainer.sharding import split_rollouts_by_tokens
from sharpen.types import Rollout


class RankLockstep:
    """The rank mechanics of ``backend`` (its rank, number of ranks and collectives)."""

    def __init__(self, backend: TrainerBackend) -> None:
        self.backend = backend

    def local_share(self, rollouts: list[Rollout]) -> list[Rollout]:
        """This rank's share of a mini-batch (all of it on one device)."""
        if self.backend.num_ranks == 1:
            return rollouts
        return split_rollouts_by_tokens(rollouts, self.backend.num_ranks)[self.backend.rank]

    def chunks(
        self,
        rollouts: list[Rollout],
        *,
        filler: list[Rollout],
        split: Callable[[list[Rollout]], list[list[Rollout]]],
    ) -> list[tuple[list[Rollout], bool]]:
        """``rollouts``' micro-batches (``split``), then ``filler`` passes up to the most micro-batches any rank has.
        Pairs of (micro-batch, is_filler). The ranks' shares are balanced by tokens (`local_share`), so with packing
        their micro-batch counts differ by one at most (beyond rollouts longer than the budget) and a filler pass is
        one short rollout."""
        chunks = split(rollouts)
        num_passes = self.backend.all_reduce_max(len(chunks))
        return [(chunk, False) for chunk in chunks] + [(filler, True)] * (num_passes - len(chunks))

    def max_over_ranks(self, maxima: dict[str, float]) -> dict[str, float]:
        """Each name's maximum over the ranks (values >= 0; a name a rank lacks counts 0 there); collective on more
        than one rank. Each rank's values travel under their own names through the sum."""
        if self.backend.num_ranks == 1:
            return maxima
        spread = self.backend.all_reduce_sum({f"{name}@{self.backend.rank}": v for name, v in maxima.items()})
        result: dict[str, float] = {}
        for key, value in spread.items():
            name = key.rpartition("@")[0]
            result[name] = max(result.get(name, 0.0), value)
        return result

    def sum_over_ranks(self, sums: dict[str, float]) -> dict[str, float]:
        """Every rank's share of the step added up; the identity on one device."""
        return self.backend.all_reduce_sum(sums)
