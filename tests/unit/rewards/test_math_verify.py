"""Math verification: strict extraction, math-verify's equivalence decisions, exploits, and worker faults.

The equivalence table records what math-verify 0.9 decides (``float_rounding=6``), including the lenient and the
surprising decisions, so an upgrade that changes one shows up here. Functions run in the workers are module-level
(spawned workers import this module to find them).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Iterator

import pytest

from sharpen.config.schema import RewardConfig
from sharpen.rewards import Rubric
from sharpen.rewards.math_answers import find_final_answers, is_hedged
from sharpen.rewards.math_verify import (
    MathVerifyPool,
    MathVerifyReward,
    MathVerifyVerifier,
    VerifyTimeout,
    WorkerCrashed,
)
from sharpen.types import Example, Message, RewardStatus

OK, WRONG, FORMAT_ERROR = RewardStatus.OK, RewardStatus.WRONG, RewardStatus.FORMAT_ERROR


@pytest.fixture(scope="module")
def pool() -> Iterator[MathVerifyPool]:
    with MathVerifyPool(num_workers=2, kill_grace_s=1.0) as shared:
        yield shared
    assert multiprocessing.active_children() == []  # no worker outlives the pool


@pytest.fixture(scope="module")
def reward(pool: MathVerifyPool) -> MathVerifyReward:
    return MathVerifyReward(pool=pool)


def _sleep_long(reference: str, answers: tuple[str, ...]) -> RewardStatus:
    time.sleep(30)
    return OK


def _ignore_the_alarm(reference: str, answers: tuple[str, ...]) -> RewardStatus:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})  # like a hang inside C code: the alarm cannot land
    time.sleep(30)
    return OK


def _crash(reference: str, answers: tuple[str, ...]) -> RewardStatus:
    os._exit(3)


def _raise_value_error() -> None:
    raise ValueError("from the worker")


# (reference, boxed answer, verdict): what math-verify decides, after the strict extraction and hedge check.
EQUIVALENCES = [
    # fractions and decimals
    (r"\frac{1}{2}", "0.5", OK),
    (r"\frac{1}{2}", "1/2", OK),
    (r"\frac{1}{2}", r"\dfrac{1}{2}", OK),
    (r"\frac{1}{2}", r"\tfrac12", OK),
    (r"\frac{1}{2}", ".5", OK),
    (r"\frac{1}{2}", "0,5", WRONG),  # a decimal comma reads as the set {0, 5}
    (r"\frac{1}{2}", r"\frac{1}{3}", WRONG),
    ("10", "10.0", OK),
    ("10", "10.000001", WRONG),  # equal to 6 decimals is not enough for an integer
    # LaTeX forms
    (r"\frac{\sqrt2}{2}", r"\sqrt{2}/2", OK),
    (r"\frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt{2}}", OK),
    (r"\frac{\sqrt{2}}{2}", "0.707107", OK),  # rounded to 6 decimals
    (r"\frac{\sqrt{2}}{2}", "0.7071", WRONG),
    (r"\sqrt{8}", r"2\sqrt{2}", OK),
    (r"2\pi", r"2 \pi", OK),
    (r"2\pi", "6.283185", OK),
    (r"2\pi", "6.28", WRONG),
    # units, currency, percent, degrees: math-verify drops them
    ("5", r"5 \text{ cm}", OK),
    ("5", r"5\ \text{cm}^2", OK),
    ("5", r"\$5", OK),
    ("5", r"5\%", OK),  # lenient: a percent matches the bare number ...
    (r"5\%", "0.05", OK),  # ... and its fraction
    ("90", r"90^\circ", OK),
    (r"\frac{\pi}{2}", r"90^\circ", WRONG),  # degrees are not converted to radians
    # sets, intervals, tuples
    (r"\{1,2\}", r"\{2,1\}", OK),
    (r"\{1,2\}", r"\{1,2,3\}", WRONG),
    ("1,2,3", "3,2,1", OK),  # a bare list is a set
    ("[0,1)", "[0,1]", WRONG),
    ("[0,1)", "[0,1)", OK),
    ("(0,1)", "(0,1]", WRONG),
    ("(1,2)", r"\left(1, 2\right)", OK),
    ("(1,2)", "(2,1)", WRONG),  # (1,2) is an open interval, (2,1) a tuple
    ("(1,2,3)", "(3,2,1)", WRONG),  # tuples are ordered
    (r"x \ge 3", r"[3, \infty)", OK),
    (r"\pm 2", "-2, 2", OK),
    (r"\pm 2", "2", WRONG),
    # negative numbers, separators, scientific notation
    ("-3", "- 3", OK),
    ("-3", "3", WRONG),
    ("1000000", "1,000,000", OK),
    ("1000000", "1{,}000{,}000", OK),
    ("1000", "1 000", WRONG),  # a space separator reads as 1*000
    ("1500", r"1.5 \times 10^3", OK),
    ("0.00015", r"1.5 \times 10^{-4}", OK),
    ("1500", "1.5e3", OK),  # digits, e, digits is scientific notation (issue 35), never 1.5*e*3 with Euler's e
    ("3e", "3e1", WRONG),  # ... which costs a reference written as a product with e: 3e1 is 30
    # expressions, equations, inequalities
    ("(x+1)^2", "x^2+2x+1", OK),
    ("x^2+2x+1", "x^2+2x+2", WRONG),
    ("x^2+2x+1", "y^2+2y+1", WRONG),  # variables matter (strict mode)
    ("3", "x = 3", OK),
    ("3", "2+1=3", OK),  # the last side of an equation chain
    ("y = 2x+1", "2x - y + 1 = 0", OK),
    ("x > 3", "3 < x", OK),
    ("x > 3", r"x \geq 3", WRONG),
    # words
    (r"\text{(A)}", "A", OK),
    (r"\text{Paris}", r"\text{Sirap}", WRONG),
    ("Paris", "Sirap", OK),  # unbraced words are products of one-letter symbols: anagrams are equal
    # several solutions: "or" lists them when the reference is a set
    (r"\{3,4\}", r"x = 3 \text{ or } x = 4", OK),
    ("3, 4", r"4 \text{ or } 3", OK),
    (r"\{3,4\}", r"3 \text{ or } 4 \text{ or } 5", WRONG),
]


@pytest.mark.parametrize(("reference", "answer", "status"), EQUIVALENCES)
def test_math_verify_equivalences(reward, reference, answer, status):
    result = reward.score(f"Working... so the answer is $\\boxed{{{answer}}}$.", reference)
    assert result.status is status, f"{answer!r} vs {reference!r}"
    assert result.score == (1.0 if status is OK else 0.0)
    assert result.verifier == "math_verify"


@pytest.mark.parametrize(
    ("completion", "reference", "status"),
    [
        # hedges inside one box: math-verify alone would accept the first three (it drops text as a unit)
        (r"\boxed{3 \text{ or } 4}", "3", WRONG),
        (r"\boxed{5 \text{ (or maybe 6)}}", "5", WRONG),
        (r"\boxed{5 \text{ (other candidate: 6)}}", "5", WRONG),
        (r"\boxed{5 (or 6)}", "6", WRONG),
        (r"\boxed{3 \vee 4}", "4", WRONG),
        (r"\boxed{\{3,4\} \text{ (or 5)}}", r"\{3,4\}", WRONG),
        # several answers: different ones are a format error, repeats (also in other forms) are judged
        (r"Either \boxed{3} or \boxed{4}.", "3", FORMAT_ERROR),
        (r"\boxed{4} ... on reflection \boxed{3}", "3", FORMAT_ERROR),
        (r"\boxed{3} and again \boxed{3}, \boxed{ 3 }", "3", OK),
        (r"\boxed{\frac12}, i.e. \boxed{0.5}", "1/2", OK),
        ("<answer>3</answer>\nAnswer: 4", "3", FORMAT_ERROR),
        (r"\boxed{3}" + "\nFinal answer: 4", "3", FORMAT_ERROR),
        (r"<answer>\boxed{3}</answer>" + "\nAnswer: $3$.", "3", OK),
        # no committed answer
        ("The answer is probably 3 or maybe 4.", "3", FORMAT_ERROR),
        ("So x = 3", "3", FORMAT_ERROR),
        (r"\boxed{3", "3", FORMAT_ERROR),
        (r"\boxed{" + "1+" * 600 + "1}", "601", FORMAT_ERROR),
        # declared answers
        ("<answer>\\frac{1}{2}</answer>", "0.5", OK),
        ("Let me think.\n**Final Answer:** $\\dfrac{1}{2}$", "0.5", OK),
        ("Answer: 7", "3", WRONG),
    ],
)
def test_exploits_and_declared_answers(reward, completion, reference, status):
    result = reward.score(completion, reference)
    assert result.status is status
    assert result.score == (1.0 if status is OK else 0.0)
    assert result.components == {"correct": result.score, "format": 0.0 if status is FORMAT_ERROR else 1.0}


@pytest.mark.parametrize(
    ("text", "answers"),
    [
        (r"so \boxed{4}", ("4",)),
        (r"\fbox{4}", ("4",)),
        (r"\boxed{\frac{1}{2}}", (r"\frac{1}{2}",)),
        (r"\boxed{\{1,2\}}", (r"\{1,2\}",)),  # escaped braces do not close the box
        (r"\boxed{\boxed{5}}", (r"\boxed{5}",)),  # the outermost box
        (r"\boxed{1} \boxed{2} \boxed{1}", ("1", "2")),  # the final answer first, each once
        (r"\boxed{1}\boxed{2}\boxed{3}\boxed{4}\boxed{5}", None),  # more than four different answers
        ("<answer> 7 </answer>", ("7",)),
        ("<answer></answer>", None),  # an empty tag is no answer
        ("I'll use <answer> tags.\n<answer>7</answer>", ("7",)),
        ("<answer>7", None),  # unclosed (truncated)
        ("Answer: $12$.", ("12",)),
        ("Answer: 12\nbut then more prose", ("12",)),  # every declaration counts, not only the last line's
        ("Answer: 12\nAnswer: 13", ("13", "12")),
        ("**Answer:** We expand first.\nSo \\boxed{3}", ("3",)),  # a declaration that reads as prose is none
        ("#### Step 1: expand\n#### 72", ("72",)),  # a markdown heading is not a GSM8K answer line
        ("The answer is $\\frac{1}{2}$, as computed.", (r"\frac{1}{2}",)),
        ("The answer is 4 apples.\nAnswer: 4", ("4",)),
        ("Final Answer: The final answer is $5$. I hope it is correct.", ("5",)),  # Minerva's format
        ("<think>\\boxed{4}</think>\\boxed{3}", ("3",)),  # a reasoning block's answers do not count
        ("\\boxed{3}<think>but maybe \\boxed{4}", ("3",)),  # nor an unclosed one's
        ("\\boxed\u200b{4} \\boxed{3}", ("3", "4")),  # a zero-width character does not hide a box
        ("Answer: so \\boxed{12}", ("12",)),  # the line points at its box
        ("The result is 12.", None),  # no last-number fallback
        (r"\boxed{}", None),
    ],
)
def test_find_final_answers(text, answers):
    assert find_final_answers(text) == answers


def test_find_final_answers_caps_length_and_accepts_bare_text_only_when_asked():
    assert find_final_answers(r"\boxed{" + "9" * 20 + "}", max_answer_chars=20) == ("9" * 20,)
    assert find_final_answers(r"\boxed{" + "9" * 21 + "}", max_answer_chars=20) is None
    assert find_final_answers("<answer>" + "9" * 21 + "</answer>", max_answer_chars=20) is None
    assert find_final_answers(r" \frac12 ", accept_bare=True) == (r"\frac12",)
    assert find_final_answers(r"1 \boxed{2}", accept_bare=True) == ("2",)
    # Many unclosed boxes stop at the first: the scan stays linear.
    started = time.perf_counter()
    assert find_final_answers(r"\boxed{" * 50_000) is None
    assert time.perf_counter() - started < 1.0


@pytest.mark.parametrize(
    ("answer", "reference", "allow_or", "hedged"),
    [
        (r"3 \text{ or } 4", "3", False, True),
        (r"3 \text{ or } 4", r"\text{3 or 4}", False, False),  # the reference itself says "or"
        (r"x=3 \text{ or } x=4", r"\{3,4\}", True, False),
        (r"5 \text{ (6)}", r"\{3,4\}", True, True),
        (r"3 \lor 4", "3", False, True),
        (r"5 \text{ cm}", "5", False, False),
        (r"\text{color}", "x", False, False),  # "or" inside a word
    ],
)
def test_is_hedged(answer, reference, allow_or, hedged):
    assert is_hedged(answer, reference, allow_or=allow_or) is hedged


def test_an_unreadable_reference_abstains(reward):
    result = reward.score(r"\boxed{3}", "")
    assert (result.status, result.score) == (RewardStatus.INFRA_ERROR, None)


def test_a_slow_judge_times_out_scores_0_and_the_worker_survives(pool, reward):
    # The reference alone judges in time, so the answer was too slow: the policy's failure, never an abstention.
    slow = MathVerifyReward(pool=pool, timeout_s=0.3, judge=_sleep_long)
    result = slow.score(r"\boxed{3}", "3")
    assert (result.status, result.score, result.components) == (
        RewardStatus.TIMEOUT,
        0.0,
        {"correct": 0.0, "format": 1.0},
    )
    started = time.perf_counter()
    assert reward.score(r"\boxed{3}", "3").status is OK
    assert time.perf_counter() - started < 1.0  # no restart was needed


def test_a_judge_that_ignores_the_alarm_is_killed_and_the_pool_restarts(pool, reward):
    stuck = MathVerifyReward(pool=pool, timeout_s=0.3, judge=_ignore_the_alarm)
    started = time.perf_counter()
    result = stuck.score(r"\boxed{3}", "3")
    assert (result.status, result.score) == (RewardStatus.TIMEOUT, 0.0)
    assert time.perf_counter() - started < 0.3 + pool.kill_grace_s + 10.0  # the kill, then the reference's check
    assert reward.score(r"\boxed{3}", "3").status is OK


def test_a_timeout_on_a_reference_too_slow_to_judge_alone_abstains(pool, monkeypatch):
    slow = MathVerifyReward(pool=pool, timeout_s=0.3, judge=_sleep_long)
    monkeypatch.setattr(slow, "_is_readable", lambda reference: False)  # as if the reference itself timed out
    result = slow.score(r"\boxed{3}", "3")
    assert (result.status, result.score) == (RewardStatus.INFRA_ERROR, None)


def test_a_crashing_worker_abstains_and_the_next_call_works(pool, reward):
    crashing = MathVerifyReward(pool=pool, judge=_crash)
    result = crashing.score(r"\boxed{3}", "3")
    assert (result.status, result.score, result.verifier) == (RewardStatus.INFRA_ERROR, None, "math_verify")
    assert reward.score(r"\boxed{4}", "3").status is WRONG


def test_pool_raises_typed_errors(pool):
    with pytest.raises(VerifyTimeout):
        pool.run(_sleep_long, "3", ("3",), timeout_s=0.2)
    with pytest.raises(WorkerCrashed):
        pool.run(_crash, "3", ("3",), timeout_s=5.0)
    with pytest.raises(ValueError, match="from the worker"):
        pool.run(_raise_value_error, timeout_s=5.0)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        pool.run(_raise_value_error, timeout_s=0.0)


def test_nothing_is_spawned_until_the_first_call():
    before = len(multiprocessing.active_children())
    reward = MathVerifyReward()
    MathVerifyVerifier(reward)
    assert reward.score("no answer here", "3").status is FORMAT_ERROR  # decided without a worker
    assert len(multiprocessing.active_children()) == before
    reward.close()


def test_verifier_adapter_in_the_rubric(reward):
    rubric = Rubric(RewardConfig(answer_format="answer_tag"), verifiers={"math": MathVerifyVerifier(reward)})
    example = Example(
        task_key="math/0", prompt=(Message(role="user", content="1/2?"),), answer="0.5", metadata={"source": "math"}
    )
    assert rubric(example, r"<answer>\frac{1}{2}</answer>").status is OK
    assert rubric(example, "<answer>1/3</answer>").status is WRONG
    assert rubric(example, r"<answer>\boxed{1} \boxed{2}</answer>").score == 0.0  # several boxes: 0, not abstain
    crashing = Rubric(
        RewardConfig(), verifiers={"math": MathVerifyVerifier(MathVerifyReward(pool=reward._pool, judge=_crash))}
    )
    result = crashing(example, "<answer>0.5</answer>")
    assert (result.status, result.score) == (RewardStatus.INFRA_ERROR, None)
