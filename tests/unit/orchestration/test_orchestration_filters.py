"""Dynamic sampling, overlong reward shaping and overlong filtering on hand-built groups."""

from __future__ import annotations

import pytest

from sharpen.orchestration.filters import (
    DynamicSamplingBuffer,
    is_informative,
    overlong_filter,
    shape_overlong_reward,
)
from sharpen.types import Example, Message, RewardResult, RewardStatus, Rollout, RolloutGroup


def _example(index: int) -> Example:
    return Example(task_key=f"t/{index}", prompt=(Message(role="user", content=f"q{index}"),), answer="1")


def _rollout(example: Example, score: float | None, *, scored: bool = True, truncated: bool = False) -> Rollout:
    status = RewardStatus.INFRA_ERROR if score is None else RewardStatus.OK
    return Rollout(
        example=example,
        prompt_ids=[1, 2],
        completion_ids=[5, 6],
        completion_logprobs=[-1.0, -0.5],
        versions=[0, 0],
        is_truncated=truncated,
        reward=RewardResult(score=score, status=status) if scored else None,
    )


def _group(index: int, scores: list[float | None]) -> RolloutGroup:
    example = _example(index)
    return RolloutGroup(example=example, rollouts=[_rollout(example, s) for s in scores])


def _informative(index: int) -> RolloutGroup:
    return _group(index, [1.0, 0.0])


def _flat(index: int) -> RolloutGroup:
    return _group(index, [1.0, 1.0])


def _keys(groups: list[RolloutGroup]) -> list[str]:
    return [g.example.task_key for g in groups]


# --- is_informative ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("scores", "expected"),
    [
        ([1.0, 0.0, 0.0, 1.0], True),
        ([0.5, 0.5, 0.5], False),
        ([0.0, 0.0, 0.0, 0.0], False),
        ([1.0, None, 0.0], True),  # the abstained one is left out; 1 and 0 remain
        ([1.0, None, 1.0, None], False),  # valid rewards all equal: abstentions do not make a difference
        ([0.3, None], False),  # one valid reward: nothing to compare it with
        ([None, None], False),
        ([], False),
        ([0.1, 0.1 + 1e-12], True),  # exact comparison, as in the advantages
    ],
)
def test_is_informative(scores: list[float | None], expected: bool):
    assert is_informative(_group(0, scores)) is expected


def test_is_informative_ignores_unscored_rollouts():
    example = _example(0)
    group = RolloutGroup(
        example=example, rollouts=[_rollout(example, 1.0), _rollout(example, 0.0, scored=False), _rollout(example, 1.0)]
    )
    assert not is_informative(group)


# --- DynamicSamplingBuffer -----------------------------------------------------------------------------------------


def test_buffer_collects_informative_groups_until_full_and_takes_exactly_the_target_in_order():
    buffer = DynamicSamplingBuffer(target_num_groups=3, max_num_batches=5)
    buffer.add([_informative(0), _flat(1), _informative(2)])
    assert not buffer.is_full and not buffer.exhausted
    assert buffer.num_groups == 2 and buffer.num_batches_drawn == 1
    buffer.add([_flat(3), _informative(4), _informative(5)])
    assert buffer.is_full and not buffer.exhausted
    assert buffer.metrics() == {
        "dynamic_sampling/num_batches_drawn": 2.0,
        "dynamic_sampling/num_groups_dropped": 2.0,
        "dynamic_sampling/num_groups_held": 4.0,
        "dynamic_sampling/exhausted": 0.0,
    }
    assert _keys(buffer.take()) == ["t/0", "t/2", "t/4"]


def test_buffer_leftovers_carry_over_to_the_next_step_first():
    buffer = DynamicSamplingBuffer(target_num_groups=2, max_num_batches=3)
    buffer.add([_informative(0), _informative(1), _informative(2)])
    assert _keys(buffer.take()) == ["t/0", "t/1"]
    # the next step starts with one group held and a fresh batch count
    assert buffer.num_groups == 1 and buffer.num_batches_drawn == 0 and buffer.num_groups_dropped == 0
    assert not buffer.is_full and not buffer.exhausted
    buffer.add([_informative(3), _informative(4)])
    assert _keys(buffer.take()) == ["t/2", "t/3"]
    assert buffer.num_groups == 1  # t/4 waits for the step after


def test_buffer_may_be_full_from_leftovers_alone():
    buffer = DynamicSamplingBuffer(target_num_groups=1, max_num_batches=1)
    buffer.add([_informative(0), _informative(1)])
    assert _keys(buffer.take()) == ["t/0"]
    assert buffer.is_full  # no generation needed this step
    assert _keys(buffer.take()) == ["t/1"]
    assert buffer.num_groups == 0


def test_buffer_exhausted_after_the_cap_returns_what_it_has():
    buffer = DynamicSamplingBuffer(target_num_groups=4, max_num_batches=2)
    buffer.add([_flat(0), _informative(1)])
    assert not buffer.exhausted
    buffer.add([_flat(2), _flat(3)])
    assert buffer.exhausted and not buffer.is_full
    assert buffer.metrics()["dynamic_sampling/exhausted"] == 1.0
    assert buffer.metrics()["dynamic_sampling/num_groups_dropped"] == 3.0
    assert _keys(buffer.take()) == ["t/1"]
    assert not buffer.exhausted and buffer.num_batches_drawn == 0  # the next step gets a fresh budget


def test_buffer_exhausted_with_nothing_informative_returns_an_empty_step():
    buffer = DynamicSamplingBuffer(target_num_groups=2, max_num_batches=1)
    buffer.add([_flat(0), _flat(1)])
    assert buffer.exhausted
    assert buffer.take() == []


def test_buffer_full_on_the_last_allowed_batch_is_full_not_exhausted():
    buffer = DynamicSamplingBuffer(target_num_groups=2, max_num_batches=1)
    buffer.add([_informative(0), _informative(1)])
    assert buffer.is_full and not buffer.exhausted


def test_buffer_take_before_full_or_exhausted_is_an_error():
    buffer = DynamicSamplingBuffer(target_num_groups=2, max_num_batches=3)
    buffer.add([_informative(0)])
    with pytest.raises(RuntimeError, match="add more batches"):
        buffer.take()


@pytest.mark.parametrize(("target", "cap"), [(0, 1), (1, 0), (-1, 3)])
def test_buffer_rejects_non_positive_sizes(target: int, cap: int):
    with pytest.raises(ValueError, match=">= 1"):
        DynamicSamplingBuffer(target_num_groups=target, max_num_batches=cap)


def test_buffer_drives_a_loop_as_documented():
    # batches of 2 groups, every other group informative, target 3: three batches, one group left over
    buffer = DynamicSamplingBuffer(target_num_groups=3, max_num_batches=10)
    index = 0
    while not buffer.is_full and not buffer.exhausted:
        buffer.add(
            [_informative(index), _flat(index + 1)] if index % 4 == 0 else [_flat(index), _informative(index + 1)]
        )
        index += 2
    assert buffer.num_batches_drawn == 3
    assert _keys(buffer.take()) == ["t/0", "t/3", "t/4"]


# --- shape_overlong_reward -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_tokens", "expected"),
    [
        (0, 1.0),
        (60, 1.0),  # max - buffer: still free
        (70, 1.0 - 0.5 * 10 / 40),  # a quarter into the buffer
        (80, 1.0 - 0.5 * 20 / 40),  # halfway
        (100, 0.5),  # at the limit: the full penalty
        (150, 0.5),  # past it: still the full penalty
    ],
)
def test_shape_overlong_reward_is_zero_then_linear_then_full(num_tokens: int, expected: float):
    shaped = shape_overlong_reward(1.0, num_tokens, max_tokens=100, buffer_tokens=40, penalty=0.5)
    assert shaped == pytest.approx(expected, abs=1e-12)


def test_shape_overlong_reward_default_penalty_is_one_and_applies_to_any_score():
    assert shape_overlong_reward(0.0, 100, max_tokens=100, buffer_tokens=10) == -1.0
    assert shape_overlong_reward(-0.5, 95, max_tokens=100, buffer_tokens=10) == pytest.approx(-1.0)


def test_shape_overlong_reward_without_buffer_is_a_step_past_the_limit():
    assert shape_overlong_reward(1.0, 100, max_tokens=100, buffer_tokens=0) == 1.0
    assert shape_overlong_reward(1.0, 101, max_tokens=100, buffer_tokens=0) == 0.0


def test_shape_overlong_reward_buffer_as_long_as_the_limit_ramps_from_zero_tokens():
    assert shape_overlong_reward(1.0, 25, max_tokens=100, buffer_tokens=100) == pytest.approx(0.75)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 0, "buffer_tokens": 0},
        {"max_tokens": 10, "buffer_tokens": 11},
        {"max_tokens": 10, "buffer_tokens": -1},
        {"max_tokens": 10, "buffer_tokens": 2, "penalty": -1.0},
    ],
)
def test_shape_overlong_reward_rejects_bad_settings(kwargs: dict[str, float]):
    with pytest.raises(ValueError, match="overlong shaping"):
        shape_overlong_reward(1.0, 5, **kwargs)  # type: ignore[arg-type]


def test_shape_overlong_reward_rejects_negative_lengths():
    with pytest.raises(ValueError, match="num_completion_tokens"):
        shape_overlong_reward(1.0, -1, max_tokens=10, buffer_tokens=2)


# --- overlong_filter -----------------------------------------------------------------------------------------------


def test_overlong_filter_keeps_untruncated_rollouts_in_order_without_mutating():
    example = _example(0)
    rollouts = [
        _rollout(example, 1.0),
        _rollout(example, 0.0, truncated=True),
        _rollout(example, 0.0),
        _rollout(example, 1.0, truncated=True),
    ]
    for index, rollout in enumerate(rollouts):
        rollout.sample_index = index
    kept = overlong_filter(rollouts)
    assert [r.sample_index for r in kept] == [0, 2]
    assert all(k is rollouts[i] for k, i in zip(kept, [0, 2], strict=True))
    assert len(rollouts) == 4


def test_overlong_filter_edge_cases():
    example = _example(0)
    assert overlong_filter([]) == []
    assert overlong_filter([_rollout(example, 1.0, truncated=True)]) == []
