"""`split_rollouts_by_tokens`: every rollout lands on exactly one rank, token loads are balanced within one
rollout's length, the split is deterministic and order-preserving, and no rank is empty while there are enough
rollouts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sharpen.trainer.sharding import split_rollouts_by_tokens
from sharpen.types import Example, Message, Rollout

_EXAMPLE = Example(task_key="t/0", prompt=(Message(role="user", content="q"),), answer="a")


def _rollout(num_prompt: int, num_completion: int) -> Rollout:
    return Rollout(
        example=_EXAMPLE,
        prompt_ids=[1] * num_prompt,
        completion_ids=[2] * num_completion,
        completion_logprobs=[-1.0] * num_completion,
        versions=[0] * num_completion,
        advantage=1.0,
    )


def _loads(shares: list[list[Rollout]]) -> list[int]:
    return [sum(r.num_tokens for r in share) for share in shares]


_lengths = st.lists(st.tuples(st.integers(1, 50), st.integers(0, 50)), max_size=40)


@settings(max_examples=200, deadline=None)
@given(lengths=_lengths, num_ranks=st.integers(1, 8))
def test_every_rollout_once_balanced_within_one_rollout(lengths, num_ranks):
    rollouts = [_rollout(p, c) for p, c in lengths]
    shares = split_rollouts_by_tokens(rollouts, num_ranks)
    assert len(shares) == num_ranks
    assert sorted(id(r) for share in shares for r in share) == sorted(id(r) for r in rollouts)
    loads = _loads(shares)
    if rollouts:
        # greedy longest-first: the fullest rank is at most one rollout above the mean, so any two ranks differ
        # by at most the longest rollout
        assert max(loads) - min(loads) <= max(r.num_tokens for r in rollouts)
        assert max(loads) <= sum(loads) / num_ranks + max(r.num_tokens for r in rollouts)
    if len(rollouts) >= num_ranks:
        assert all(shares)
    for share in shares:  # each rank keeps the batch order
        positions = [next(i for i, r in enumerate(rollouts) if r is x) for x in share]
        assert positions == sorted(positions)


def test_split_is_deterministic_and_balances_a_typical_batch():
    rollouts = [_rollout(p, c) for p, c in [(30, 200), (30, 10), (30, 180), (30, 20), (30, 60), (30, 90), (30, 5)]]
    first = split_rollouts_by_tokens(rollouts, 2)
    second = split_rollouts_by_tokens(list(rollouts), 2)
    assert [[id(r) for r in share] for share in first] == [[id(r) for r in share] for share in second]
    # tokens 230, 40, 210, 50, 90, 120, 35; longest first: 230 -> 0, 210 -> 1, 120 -> 1, 90 -> 0, 50 -> 0, 40 -> 1,
    # then 370 tokens and 3 rollouts each: the tie goes to the lower rank, so 35 -> 0
    assert [[rollouts.index(r) for r in share] for share in first] == [[0, 3, 4, 6], [1, 2, 5]]
    assert _loads(first) == [405, 370]


def test_equal_lengths_fill_the_ranks_round_robin():
    """Equal lengths: ranks fill round-robin, so counts differ by at most one."""
    shares = split_rollouts_by_tokens([_rollout(4, 4) for _ in range(7)], 3)
    assert [len(share) for share in shares] == [3, 2, 2]


def test_one_huge_rollout_sits_alone():
    rollouts = [_rollout(10, 500), *[_rollout(5, 5) for _ in range(5)]]
    shares = split_rollouts_by_tokens(rollouts, 2)
    assert shares[0] == [rollouts[0]]
    assert shares[1] == rollouts[1:]


def test_fewer_rollouts_than_ranks_leaves_the_last_ranks_empty():
    rollouts = [_rollout(3, 1), _rollout(3, 9)]
    shares = split_rollouts_by_tokens(rollouts, 4)
    assert shares == [[rollouts[1]], [rollouts[0]], [], []]
    assert split_rollouts_by_tokens([], 3) == [[], [], []]


def test_one_rank_gets_everything_in_order():
    rollouts = [_rollout(3, n) for n in (5, 1, 9)]
    assert split_rollouts_by_tokens(rollouts, 1) == [rollouts]


def test_num_ranks_must_be_positive():
    with pytest.raises(ValueError, match="num_ranks"):
        split_rollouts_by_tokens([_rollout(2, 2)], 0)
