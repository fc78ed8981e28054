"""Splitting one step's rollouts across data-parallel ranks so that each rank does about the same work.

Owns only the assignment of rollouts to ranks: a pure function of the rollouts' token counts, identical on every
rank, so each rank can compute its own share from the same batch without talking to the others. It does not
compute losses, normalisers or metrics, and it does not keep ranks in lockstep; that is the trainer's part:

* The loss normaliser stays global. `aggregation_normalizer` is computed from the mask of the *whole* mini-batch
  (every rank sees the whole batch and takes its share after computing it), each rank's loss is its rollouts'
  masked sum divided by that global denominator, and the data-parallel gradient reduction *sums* (the FSDP2
  backend sets a gradient divide factor of 1). The summed gradient is then exactly the single-process gradient.
  A trainer that only ever sees its own share must instead all-reduce (sum) the denominator's count first.
* Every rank must run the same number of forward/backward passes (each one all-gathers parameters), so a rank
  with fewer micro-batches than the others runs zero-weighted extra passes; the metric sums are all-reduced.
"""

from __future__ import annotations

import heapq

from sharpen.types import Rollout


def split_rollouts_by_tokens(rollouts: list[Rollout], num_ranks: int) -> list[list[Rollout]]:
    """``num_ranks`` lists of rollouts whose total token counts (`Rollout.num_tokens`) are close to equal.

    Greedy longest-first: the rollouts, longest first (ties by position), each go to the rank with the fewest tokens
    so far (ties: fewer rollouts, then the lower rank). The largest rank exceeds the mean by at most one rollout's
    length. Deterministic, so every rank computes the same split. With at least ``num_ranks`` rollouts no rank is
    empty (an empty rank wins every tie); with fewer, the last ranks are empty. Within a rank the rollouts keep
    their order in ``rollouts``.
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be at least 1, got {num_ranks}")
    order = sorted(range(len(rollouts)), key=lambda index: (-rollouts[index].num_tokens, index))
    loads = [(0, 0, rank) for rank in range(num_ranks)]  # (tokens, rollouts, rank): a heap, smallest first
    assigned: list[list[int]] = [[] for _ in range(num_ranks)]
    for index in order:
        tokens, count, rank = heapq.heappop(loads)
        assigned[rank].append(index)
        heapq.heappush(loads, (tokens + rollouts[index].num_tokens, count + 1, rank))
    return [[rollouts[index] for index in sorted(indices)] for indices in assigned]
