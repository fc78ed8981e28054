"""ExampleSampler: seeded epoch permutations, batches across epoch boundaries, exact resume from state_dict."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sharpen.data import ExampleSampler
from sharpen.types import Example, Message


def _examples(num: int) -> list[Example]:
    return [Example(task_key=f"t/{i}", prompt=(Message(role="user", content=str(i)),)) for i in range(num)]


def _keys(batch: list[Example]) -> list[str]:
    return [e.task_key for e in batch]


def test_same_seed_same_order_different_seed_different():
    examples = _examples(50)
    first = [_keys(ExampleSampler(examples, seed=1).next_batch(120)) for _ in range(2)]
    other = _keys(ExampleSampler(examples, seed=2).next_batch(120))
    assert first[0] == first[1]
    assert first[0] != other


def test_each_epoch_is_a_new_permutation():
    sampler = ExampleSampler(_examples(30), seed=0)
    epoch0, epoch1 = _keys(sampler.next_batch(30)), _keys(sampler.next_batch(30))
    assert sorted(epoch0) == sorted(epoch1) and epoch0 != epoch1
    assert sampler.epoch == 1


@settings(max_examples=60, deadline=None)
@given(
    num_examples=st.integers(1, 40),
    seed=st.integers(0, 2**32),
    batch_sizes=st.lists(st.integers(0, 17), min_size=1, max_size=12),
)
def test_every_example_exactly_once_per_epoch(num_examples, seed, batch_sizes):
    sampler = ExampleSampler(_examples(num_examples), seed=seed)
    stream = [key for num in batch_sizes for key in _keys(sampler.next_batch(num))]
    assert len(stream) == sum(batch_sizes)
    for start in range(0, len(stream) - num_examples + 1, num_examples):
        assert sorted(stream[start : start + num_examples]) == sorted(_keys(_examples(num_examples)))
    tail = stream[len(stream) - len(stream) % num_examples :]
    assert len(set(tail)) == len(tail)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 1000), num_before=st.lists(st.integers(1, 9), max_size=6), num_after=st.integers(1, 30))
def test_resume_reproduces_the_next_batches(seed, num_before, num_after):
    examples = _examples(7)
    original = ExampleSampler(examples, seed=seed)
    for num in num_before:
        original.next_batch(num)
    state = json.loads(json.dumps(original.state_dict()))
    resumed = ExampleSampler(examples, seed=seed)
    resumed.load_state_dict(state)
    for num in (num_after, 3, 11):
        assert _keys(resumed.next_batch(num)) == _keys(original.next_batch(num))


def test_state_dict_is_plain_ints():
    sampler = ExampleSampler(_examples(4), seed=0)
    sampler.next_batch(6)
    assert sampler.state_dict() == {"epoch": 1, "position": 2, "num_examples": 4}


def test_rejects_empty_examples_bad_num_and_mismatched_state():
    with pytest.raises(ValueError, match="no examples"):
        ExampleSampler([], seed=0)
    sampler = ExampleSampler(_examples(4), seed=0)
    with pytest.raises(ValueError, match="num must be >= 0"):
        sampler.next_batch(-1)
    with pytest.raises(ValueError, match="saved state is for 5 examples"):
        sampler.load_state_dict({"epoch": 0, "position": 0, "num_examples": 5})
    with pytest.raises(ValueError, match="invalid state"):
        sampler.load_state_dict({"epoch": 0, "position": 9})
    assert sampler.next_batch(0) == []
