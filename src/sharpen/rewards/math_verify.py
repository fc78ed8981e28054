"""Math answers judged by math-verify, in worker processes: a `RewardFn` and a `Verifier` adapter for the `Rubric`.

Owns, in that order, `judge_answers`: math-verify's symbolic equivalence of an answer and a reference (fractions,
sets, intervals, expressions, equations), after the strict extraction of `math_answers`, plus the checks for answers
that name several values without a hedge word ("3 \\sim 4", "3 = 4": math-verify would read one side).
`MathVerifyPool`: the worker processes it runs in, because math-verify's parser and sympy can hang and the only
reliable interrupt is ``SIGALRM``, which works in a process's main thread only (never in the trainer's threads).
Workers are spawned (the trainer holds torch threads, which must not be forked) lazily on the first call; a call that
runs past its timeout is a `VerifyTimeout` (a worker that ignores its alarm, stuck in C code, is killed) and a worker
that dies is a `WorkerCrashed`. `MathVerifyReward`: the verdict as a `RewardResult`. What the policy can cause
scores 0.0: a format failure, an answer too costly to evaluate (refused by `math_limits` before any worker sees
it), and a timeout on a reference that itself judges in time. What it cannot cause abstains: a crash (after one
retry on new workers, since a kill of another call's worker breaks the whole pool), an unreadable reference.

Deliberately does not pick which examples are math (the caller maps ``metadata["source"]`` to the
`MathVerifyVerifier`) and does not weigh components (that is the `Rubric`'s job when the adapter is used).
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import threading
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from sharpen.rewards.math_answers import (
    MAX_ANSWER_CHARS,
    SEPARATORS,
    as_plain_number,
    find_final_answers,
    is_hedged,
    normalize_math_text,
    split_values,
)
from sharpen.rewards.math_limits import find_costly_part
from sharpen.types import Example, RewardResult, RewardStatus

logger = logging.getLogger(__name__)

T = TypeVar("T")
Judge = Callable[[str, tuple[str, ...]], RewardStatus]
"""``judge(reference, answers) -> OK | WRONG | FORMAT_ERROR``, run in a worker; must be picklable (module-level)."""


class VerifyTimeout(Exception):
    """A call ran past its timeout (the worker was interrupted, or killed if it ignored the interrupt)."""


class WorkerCrashed(Exception):
    """A worker process died (or could not start) during a call; the pool is rebuilt on the next call."""


def judge_answers(reference: str, answers: tuple[str, ...]) -> RewardStatus:
    """OK if the final answer (``answers[0]``) equals ``reference``; FORMAT_ERROR if the answers disagree; WRONG if
    one of them hedges (a hedge word, a hidden part, several values where the reference is one value).

    Raises ValueError when math-verify cannot read the reference: a dataset problem, not the policy's.
    """
    from math_verify import verify

    parsed = [_parse(answer) for answer in answers]
    if any(not verify(parsed[0], other, timeout_seconds=None) for other in parsed[1:]):
        return RewardStatus.FORMAT_ERROR  # several different answers: a hedge must not collect the reward
    gold = _parse(reference)
    if not gold:
        raise ValueError(f"math-verify cannot read the reference answer {reference!r}")
    from sympy import FiniteSet

    is_solution_set = isinstance(gold[0], FiniteSet) and len(gold[0]) > 1
    if any(is_hedged(answer, reference, allow_or=is_solution_set) for answer in answers):
        return RewardStatus.WRONG
    kinds = _separator_kinds(gold[0], reference)
    if not all(_names_one_value(answer, kinds) for answer in answers):
        return RewardStatus.WRONG
    return RewardStatus.OK if verify(gold, parsed[0], timeout_seconds=None) else RewardStatus.WRONG


def check_reference(reference: str) -> bool:
    """True when math-verify reads ``reference`` (run in a worker: tells a policy's timeout from a dataset's)."""
    return bool(_parse(reference))


def _separator_kinds(gold: Any, reference: str) -> frozenset[str]:
    """The kinds of `math_answers.SEPARATORS` an answer may use: those of the reference's type and text."""
    from sympy import FiniteSet, Interval, Matrix, Tuple, Union
    from sympy.logic.boolalg import Boolean

    if isinstance(gold, FiniteSet) and len(gold) > 1:
        kinds = {"list", "union", "logic", "words"}  # "3, 4", "x = 3 \\text{ or } x = 4"
    elif isinstance(gold, Interval | Union | FiniteSet):
        kinds = {"list", "union"}
    elif isinstance(gold, Tuple | Matrix | tuple | list):
        kinds = {"list", "row"}
    elif isinstance(gold, Boolean):  # equations, inequalities and their conjunctions
        kinds = {"list", "relation", "logic", "words"}
    else:
        kinds = set()
    return frozenset(kinds | {kind for kind, pattern in SEPARATORS.items() if pattern.search(reference)})


def _names_one_value(answer: str, kinds: frozenset[str]) -> bool:
    """False when the constant parts of ``answer`` between separators the reference does not use differ: "3 \\sim 4",
    "3 = 4", "x=3 \\\\ x=4" name two values, of which math-verify would keep one; "2+1=3" and "x = 3" name one."""
    from math_verify import verify

    parts, is_approximate = split_values(answer, allowed=kinds)
    if len(parts) < 2:
        return True
    first = _parse(parts[0])
    return all(
        verify(first, other := _parse(part), timeout_seconds=None) or (is_approximate and _is_close(first, other))
        for part in parts[1:]
    )


def _is_close(first: list[Any], second: list[Any]) -> bool:
    """Numerically equal to 1% (``\\approx`` joins a value to its rounding: "\\frac{\\sqrt2}{2} \\approx 0.71")."""
    try:
        a, b = complex(first[0].evalf()), complex(second[0].evalf())
    except (AttributeError, IndexError, TypeError, ValueError):
        return False
    return abs(a - b) <= 0.01 * max(abs(a), abs(b))


def _parse(answer: str) -> list[Any]:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    # The answer is already extracted: box it so math-verify reads all of it as one LaTeX answer. Its own timeout
    # is off (0): its alarm(0) on exit would cancel the worker's timer, which covers the whole call.
    config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    return parse(f"\\boxed{{{answer}}}", extraction_config=config, parsing_timeout=0)


class _AlarmRang(BaseException):
    """Raised by the worker's SIGALRM handler; a BaseException so sympy's and math-verify's
    ``except Exception`` cannot swallow it and report a timeout as "not equal"."""


def _raise_alarm(signum: int, frame: object) -> None:
    raise _AlarmRang


def _prepare_worker() -> None:
    signal.signal(signal.SIGALRM, _raise_alarm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the trainer, which then shuts the pool down
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns once that its own timeout is off
    judge_answers("1", ("1 = 1",))  # import sympy and build the LaTeX parser now, not inside the first timed call


def _ping() -> None:
    return None


def _call_with_alarm(timeout_s: float, fn: Callable[..., T], *args: Any) -> T:
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
            return fn(*args)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _AlarmRang:  # also when it rang in the finally, after fn returned: the answer came too late
        raise VerifyTimeout(f"a math-verify call ran past its {timeout_s:g} s timeout") from None


class MathVerifyPool:
    """A few spawned worker processes that run functions under a ``SIGALRM`` timeout; thread-safe.

    At most ``num_workers`` calls are in flight (others wait for a free worker), so a call's timeout measures its
    own run, not a queue. A worker that ignores its alarm (stuck in C code) is killed ``kill_grace_s`` after its
    timeout; killing it, or a worker dying, breaks the whole pool: the calls in flight then fail with
    `WorkerCrashed` and the next call starts new workers. As with any spawned process, the program's entry script
    must be safe to import (``if __name__ == "__main__":``).
    """

    def __init__(self, *, num_workers: int = 2, kill_grace_s: float = 2.0, start_timeout_s: float = 120.0) -> None:
        if num_workers < 1 or kill_grace_s <= 0 or start_timeout_s <= 0:
            raise ValueError(
                f"MathVerifyPool: num_workers must be >= 1 and the timeouts > 0 (got num_workers={num_workers}, "
                f"kill_grace_s={kill_grace_s}, start_timeout_s={start_timeout_s})"
            )
        self.num_workers = num_workers
        self.kill_grace_s = kill_grace_s
        self.start_timeout_s = start_timeout_s
        self._executor: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()
        self._free_workers = threading.BoundedSemaphore(num_workers)

    def run(self, fn: Callable[..., T], *args: Any, timeout_s: float) -> T:
        """``fn(*args)`` in a worker; raises `VerifyTimeout`, `WorkerCrashed`, or what ``fn`` raised."""
        if timeout_s <= 0:
            raise ValueError(f"MathVerifyPool.run: timeout_s must be > 0, got {timeout_s}")
        with self._free_workers:
            executor = self._started_executor()
            try:
                future = executor.submit(_call_with_alarm, timeout_s, fn, *args)
                done, _ = wait([future], timeout=timeout_s + self.kill_grace_s)
                if not done:
                    self._discard(executor, kill=True)
                    raise VerifyTimeout(f"a worker ignored its {timeout_s:g} s timeout and was killed")
                return future.result()
            except BrokenProcessPool as error:
                self._discard(executor, kill=False)
                raise WorkerCrashed(f"a math-verify worker died: {error}") from error

    def close(self) -> None:
        """Stop the workers (waiting for calls in flight); a later `run` starts new ones."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> MathVerifyPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _started_executor(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._executor is None:
                executor = ProcessPoolExecutor(
                    self.num_workers, mp_context=multiprocessing.get_context("spawn"), initializer=_prepare_worker
                )
                # One ping per worker starts them all now, so no call's timeout pays for a start (~1-2 s each).
                pings = [executor.submit(_ping) for _ in range(self.num_workers)]
                done, _ = wait(pings, timeout=self.start_timeout_s)
                if len(done) < len(pings) or any(ping.exception() is not None for ping in done):
                    _stop(executor, kill=True)
                    raise WorkerCrashed(f"math-verify workers did not start within {self.start_timeout_s:g} s")
                self._executor = executor
            return self._executor

    def _discard(self, executor: ProcessPoolExecutor, *, kill: bool) -> None:
        with self._lock:
            if self._executor is executor:  # another thread may already have replaced it
                self._executor = None
        _stop(executor, kill=kill)


def _stop(executor: ProcessPoolExecutor, *, kill: bool) -> None:
    if kill:
        # Python 3.11 has no public way to stop a busy worker (3.14 adds kill_workers()): use the private map.
        for process in list((executor._processes or {}).values()):
            process.kill()
    executor.shutdown(wait=True, cancel_futures=True)


class MathVerifyReward:
    """The math verdict on a completion against ``example.answer``; a `RewardFn` (``verifier="math_verify"``).

    Scores 1.0 (OK) or 0.0 (WRONG, FORMAT_ERROR, and TIMEOUT on a reference that judges in time: the policy's
    answer was too slow); abstains (``score=None``) on INFRA_ERROR: a worker that crashed twice, an unreadable or
    slow reference. Without a ``pool`` it owns one (started on the first call; `close` stops it). ``judge`` runs
    in the worker (a test hook and a seam for other equivalence rules).
    """

    name = "math_verify"

    def __init__(
        self,
        *,
        pool: MathVerifyPool | None = None,
        timeout_s: float = 5.0,
        max_answer_chars: int = MAX_ANSWER_CHARS,
        judge: Judge = judge_answers,
    ) -> None:
        self.timeout_s = timeout_s
        self.max_answer_chars = max_answer_chars
        self._judge = judge
        self._owns_pool = pool is None
        self._pool = MathVerifyPool() if pool is None else pool
        self._readable_references: dict[str, bool] = {}  # reference -> judged in time alone (bounded, see below)

    def __call__(self, example: Example, completion: str) -> RewardResult:
        if example.answer is None:
            raise ValueError(f"MathVerifyReward: example {example.task_key} has no reference answer")
        return self.score(completion, example.answer)

    def score(
        self, completion: str, reference: str, *, accept_bare: bool = False, extracted: str | None = None
    ) -> RewardResult:
        """The verdict on ``completion``; ``accept_bare`` takes an unmarked completion as the answer itself, and
        ``extracted`` is one more final answer another extractor read from it (see `find_final_answers`)."""
        answers = find_final_answers(
            completion, max_answer_chars=self.max_answer_chars, accept_bare=accept_bare, extracted=extracted
        )
        if answers is None:
            return _verdict(RewardStatus.FORMAT_ERROR)
        costly = next((reason for answer in answers if (reason := find_costly_part(answer))), None)
        if costly is not None:  # refused before any worker parses it: the policy's failure
            return _verdict(RewardStatus.WRONG, is_policy_error=True, detail=f"answer refused: {costly}")
        reference = as_plain_number(normalize_math_text(reference))  # the same forms as the answers'
        try:
            status = self._run_judge(reference, answers)
        except VerifyTimeout:
            if not self._is_readable(reference):
                logger.warning("math-verify cannot judge reference %r in time; abstaining", reference)
                return _verdict(RewardStatus.INFRA_ERROR)
            # The reference alone judges in time: the answer was too slow, the policy's failure.
            return _verdict(RewardStatus.TIMEOUT, is_policy_error=True, detail=f"judging ran past {self.timeout_s:g} s")
        except Exception:  # a worker crash or a judge error (e.g. an unreadable reference): abstain, never score 0
            logger.warning("math-verify failed on reference %r; abstaining", reference, exc_info=True)
            return _verdict(RewardStatus.INFRA_ERROR)
        return _verdict(status)

    def close(self) -> None:
        """Stop the worker processes if this reward started its own pool."""
        if self._owns_pool:
            self._pool.close()

    def _run_judge(self, reference: str, answers: tuple[str, ...]) -> RewardStatus:
        try:
            return self._pool.run(self._judge, reference, answers, timeout_s=self.timeout_s)
        except WorkerCrashed:  # also when another call's stuck worker was killed: the whole pool broke
            logger.warning("a math-verify worker crashed; retrying once on new workers")
            return self._pool.run(self._judge, reference, answers, timeout_s=self.timeout_s)

    def _is_readable(self, reference: str) -> bool:
        if reference not in self._readable_references:
            try:
                is_readable = self._pool.run(check_reference, reference, timeout_s=self.timeout_s)
            except Exception:  # slow, crashing or unreadable: the dataset's problem, not the policy's
                is_readable = False
            if len(self._readable_references) >= 10_000:
                self._readable_references.clear()
            self._readable_references[reference] = is_readable
        return self._readable_references[reference]


def _verdict(status: RewardStatus, *, is_policy_error: bool = False, detail: str = "") -> RewardResult:
    if status is RewardStatus.INFRA_ERROR:
        return RewardResult(score=None, status=status, components={"format": 1.0}, verifier="math_verify")
    correct = 1.0 if status is RewardStatus.OK else 0.0
    is_formatted = status is not RewardStatus.FORMAT_ERROR
    return RewardResult(
        score=correct,
        status=status,
        components={"correct": correct, "format": 1.0 if is_formatted else 0.0},
        verifier="math_verify",
        is_policy_error=is_policy_error,
        detail=detail,
    )


class MathVerifyVerifier:
    """`MathVerifyReward` as a `Verifier` for the `Rubric`; a `CompletionVerifier`, so every final answer in the
    completion counts, not only the one the `Rubric`'s answer format extracted.

    Returns 1.0 or 0.0; a format error (different final answers) is 0.0 since a `Verifier` has no format channel.
    Raises RuntimeError when the reward abstains (a crash, an unreadable reference), so the `Rubric` abstains.
    """

    name = "math_verify"

    def __init__(self, reward: MathVerifyReward | None = None) -> None:
        self.reward = MathVerifyReward() if reward is None else reward

    def __call__(self, example: Example, answer: str) -> float:
        """The score of an answer alone (already extracted: an unmarked answer is taken whole)."""
        return self._score(example, answer, accept_bare=True, extracted=None)

    def score_completion(self, example: Example, completion: str, answer: str) -> float:
        """The score of ``completion``, whose answer in the `Rubric`'s format is ``answer``."""
        return self._score(example, completion, accept_bare=False, extracted=answer)

    def _score(self, example: Example, text: str, *, accept_bare: bool, extracted: str | None) -> float:
        if example.answer is None:
            raise ValueError(f"MathVerifyVerifier: example {example.task_key} has no reference answer")
        result = self.reward.score(text, example.answer, accept_bare=accept_bare, extracted=extracted)
        if result.score is None:
            raise RuntimeError(f"math-verify could not judge example {example.task_key}: {result.status}")
        return result.score
