"""pass@k against exact combinatorics, maj@k by hand, mean@k, abstentions and the average over tasks."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest

from sharpen.evaluation.metrics import (
    SampleOutcome,
    aggregate_tasks,
    check_ks,
    compute_task_metrics,
    maj_at_k,
    mean_at_k,
    pass_at_k,
    vote_key,
)


def _brute_force_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """The share of all k-subsets of n samples (the first c correct) that hold at least one correct sample."""
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(i < c for i in subset) for subset in subsets), len(subsets))


def test_pass_at_k_is_exactly_the_share_of_k_subsets_with_a_correct_sample():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = _brute_force_pass_at_k(n, c, k)
                assert pass_at_k(n, c, k) == float(exact), (n, c, k)  # exact: the correctly rounded value


def test_pass_at_k_edge_cases():
    assert pass_at_k(5, 0, 1) == 0.0 and pass_at_k(5, 0, 5) == 0.0  # nothing correct
    assert pass_at_k(5, 5, 1) == 1.0 and pass_at_k(5, 5, 5) == 1.0  # everything correct
    assert pass_at_k(5, 1, 5) == 1.0  # k = n: the draw is every sample
    assert pass_at_k(5, 2, 4) == 1.0  # fewer wrong samples than k
    assert pass_at_k(4, 1, 1) == 0.25  # pass@1 = c / n
    assert pass_at_k(10, 3, 2) == float(1 - Fraction(math.comb(7, 2), math.comb(10, 2)))


def test_pass_at_k_rejects_bad_input_with_a_clear_error():
    with pytest.raises(ValueError, match=r"pass@5 needs at least 5 answered samples of the task, got 3"):
        pass_at_k(3, 1, 5)
    with pytest.raises(ValueError, match="k must be at least 1"):
        pass_at_k(3, 1, 0)
    with pytest.raises(ValueError, match="num_correct = 4 must be between 0 and num_samples = 3"):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError, match="num_correct = -1"):
        pass_at_k(3, -1, 1)


def test_pass_at_k_for_large_n_uses_the_stable_product_and_agrees_with_exact():
    for n, c, k in [(2000, 1, 1), (2000, 37, 10), (5000, 4000, 100), (1025, 3, 1000), (3000, 0, 7)]:
        exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
        assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12, abs=1e-15), (n, c, k)


def _s(answer: str | None, correct: bool, score: float | None = None) -> SampleOutcome:
    return SampleOutcome(score=(1.0 if correct else 0.0) if score is None else score, is_correct=correct, answer=answer)


ABSTAINED = SampleOutcome(score=None, is_correct=False, answer="19")


def test_maj_at_k_majority_wins():
    samples = [_s("19", True), _s("20", False), _s("19", True), _s("21", False)]
    assert maj_at_k(samples, 4) == 1.0
    assert maj_at_k(samples, 2) == 0.5  # blocks [19, 20] and [19, 21]: two ties
    wrong_majority = [_s("20", False), _s("19", True), _s("20", False)]
    assert maj_at_k(wrong_majority, 3) == 0.0
    assert maj_at_k(wrong_majority, 1) == pytest.approx(1 / 3)  # one vote per block: maj@1 is pass@1


def test_maj_and_mean_at_k_average_disjoint_blocks_of_k_samples():
    samples = [_s("a", True), _s("a", True), _s("b", False), _s("b", False), _s("a", True)]
    assert maj_at_k(samples, 2) == 0.5  # [a, a] right, [b, b] wrong; the fifth sample is left over
    assert mean_at_k(samples, 2) == 0.5
    assert maj_at_k(samples, 1) == mean_at_k(samples, 1) == 0.6
    assert maj_at_k(samples, 5) == 1.0 and maj_at_k(samples, 4) == 0.5  # [a, a, b, b]: a tie


def test_maj_at_k_ties_are_worth_their_expected_value_whatever_the_order():
    two_way = [_s("19", True), _s("20", False)]
    assert maj_at_k(two_way, 2) == 0.5
    assert maj_at_k(two_way[::-1], 2) == 0.5
    three_way = [_s("a", False), _s("b", True), _s("c", False), _s("b", True), _s("a", False), _s("c", False)]
    assert maj_at_k(three_way, 6) == pytest.approx(1 / 3)
    assert maj_at_k(three_way, 3) == pytest.approx(1 / 3)  # a, b, c: one vote each


def test_maj_at_k_answers_without_a_vote_and_equivalent_answers():
    # format errors take a place among the k but cast no vote: one vote for the right answer wins
    no_answer = [_s(None, False), _s(None, False), _s("19", True)]
    assert maj_at_k(no_answer, 3) == 1.0
    assert maj_at_k(no_answer, 2) == 0.0  # the one block holds no vote at all
    # "19", "19.0" and " 19 " are one answer; "Paris" and "paris" too
    numbers = [_s("19", True), _s("19.0", True), _s("18", False), _s("17", False), _s(" 19 ", True)]
    assert maj_at_k(numbers, 5) == 1.0
    assert vote_key("Paris  France") == vote_key("paris france")
    assert vote_key("-0") == vote_key("0.0") and vote_key("1e1") == vote_key("10")
    assert vote_key("1_000") != vote_key("1000") and vote_key("nan") == "nan"


def test_abstentions_are_left_out_not_failed():
    samples = [ABSTAINED, _s("19", True), ABSTAINED, _s("20", False), _s("19", True)]
    # maj@k and mean@k read blocks of answered samples; abstentions neither vote nor take a place
    assert maj_at_k(samples, 1) == pytest.approx(2 / 3)
    assert maj_at_k(samples, 2) == 0.5  # [19, 20]: a tie; the last 19 is left over
    assert mean_at_k(samples, 2) == 0.5
    assert mean_at_k(samples, 3) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="@4 needs at least 4 answered samples of the task, got 3"):
        maj_at_k(samples, 4)

    task = compute_task_metrics("t/0", samples, [1, 2, 3, 4, 5])
    assert (task.num_samples, task.num_abstained, task.num_answered, task.num_correct) == (5, 2, 3, 2)
    assert task.pass_at_k == {1: pass_at_k(3, 2, 1), 2: 1.0, 3: 1.0, 4: None, 5: None}  # n = 3, not 5
    assert task.maj_at_k[3] == 1.0 and task.maj_at_k[4] is None
    assert task.mean_at_k == {1: pytest.approx(2 / 3), 2: 0.5, 3: pytest.approx(2 / 3), 4: None, 5: None}


def test_mean_at_k_uses_the_scores_not_the_statuses():
    samples = [_s("1", False, score=0.5), _s("2", True, score=1.0), _s("3", False, score=0.0)]
    assert mean_at_k(samples, 1) == 0.5
    assert mean_at_k(samples, 2) == 0.75  # one block: the first two; the third is left over
    assert mean_at_k(samples, 3) == 0.5


def test_aggregate_is_the_unweighted_mean_over_tasks_that_have_a_value():
    ks = [1, 2]
    full = compute_task_metrics("a", [_s("1", True), _s("2", False)], ks)  # pass@1 1/2, pass@2 1
    wrong = compute_task_metrics("b", [_s("1", False), _s("1", False), _s("1", False)], ks)  # 0, 0
    short = compute_task_metrics("c", [_s("1", True), ABSTAINED], ks)  # n = 1: pass@1 1, pass@2 None
    empty = compute_task_metrics("d", [ABSTAINED, ABSTAINED], ks)  # nothing answered
    overall = aggregate_tasks([full, wrong, short, empty], ks)
    assert (overall.num_tasks, overall.num_samples, overall.num_abstained, overall.num_correct) == (4, 9, 3, 2)
    assert overall.num_tasks_at_k == {1: 3, 2: 2}
    assert overall.pass_at_k == {1: pytest.approx((0.5 + 0 + 1) / 3), 2: pytest.approx((1 + 0) / 2)}
    assert overall.maj_at_k == {1: pytest.approx((0.5 + 0 + 1) / 3), 2: pytest.approx((0.5 + 0) / 2)}
    assert overall.mean_at_k == {1: pytest.approx((0.5 + 0 + 1) / 3), 2: pytest.approx((0.5 + 0) / 2)}
    nothing = aggregate_tasks([empty], ks)
    assert nothing.pass_at_k == {1: None, 2: None} and nothing.num_tasks_at_k == {1: 0, 2: 0}


def test_check_ks_sorts_adds_one_and_rejects_k_above_the_samples():
    assert check_ks([5, 2, 5], 8) == [1, 2, 5]
    assert check_ks([], 1) == [1]
    with pytest.raises(ValueError, match=r"every k must be between 1 and num_samples = 4, got \[5, 8\]"):
        check_ks([2, 5, 8], 4)
    with pytest.raises(ValueError, match="at least one sample per task"):
        check_ks([1], 0)
