"""A `RewardFn` that asks a reward-model server (`sharpen serve-rm`, see `rm_server`) for scores over HTTP.

Owns: the request format, batching pairs into requests of ``batch_size``, and fault tolerance: connection errors,
timeouts and 5xx answers (503 = the server's queue is full) are retried with exponential backoff, and when retries
run out the rollouts abstain (``score=None``, status INFRA_ERROR or TIMEOUT), never a made-up 0.
Does not: start or manage the server, or normalise scores. Standard library only (`urllib.request`).
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

from sharpen.types import Example, RewardResult, RewardStatus

logger = logging.getLogger(__name__)

VERIFIER = "reward_model"


class _Failure(Exception):
    """A request that failed for good (or for this attempt); ``status`` is what the rollouts abstain with."""

    def __init__(self, message: str, *, status: RewardStatus, is_retryable: bool, retry_after_s: float = 0.0):
        super().__init__(message)
        self.status = status
        self.is_retryable = is_retryable
        self.retry_after_s = retry_after_s


class RewardModelClient:
    """Scores completions with a remote reward model. ``num_truncated`` counts inputs the server cut to its
    ``max_length`` (their scores judge only the kept end of the conversation)."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        batch_size: int = 32,
    ) -> None:
        if timeout_s <= 0 or max_retries < 0 or backoff_s < 0 or batch_size < 1:
            raise ValueError(
                "RewardModelClient: timeout_s must be > 0, max_retries and backoff_s >= 0, batch_size >= 1"
            )
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.batch_size = batch_size
        self.num_truncated = 0

    def __call__(self, example: Example, completion: str) -> RewardResult:
        return self.score_many([(example, completion)])[0]

    def score_many(self, pairs: Sequence[tuple[Example, str]]) -> list[RewardResult]:
        """One result per pair, in order; sent ``batch_size`` pairs per request (a failed request abstains only
        its own pairs)."""
        results: list[RewardResult] = []
        for start in range(0, len(pairs), self.batch_size):
            chunk = pairs[start : start + self.batch_size]
            inputs = [
                {"prompt": [{"role": m.role, "content": m.text} for m in example.prompt], "completion": completion}
                for example, completion in chunk
            ]
            try:
                scores = self._post_with_retries(inputs)
            except _Failure as failure:
                logger.warning("reward model at %s: %s; %d rollouts abstain", self.url, failure, len(chunk))
                results += [RewardResult(score=None, status=failure.status, verifier=VERIFIER) for _ in chunk]
                continue
            results += [RewardResult(score=score, status=RewardStatus.OK, verifier=VERIFIER) for score in scores]
        return results

    def _post_with_retries(self, inputs: list[dict[str, object]]) -> list[float]:
        for attempt in range(self.max_retries + 1):
            try:
                return self._post(inputs)
            except _Failure as failure:
                if not failure.is_retryable or attempt == self.max_retries:
                    raise
                # Honour the server's Retry-After when it asks for longer than our own backoff.
                time.sleep(max(self.backoff_s * 2**attempt, failure.retry_after_s))
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _post(self, inputs: list[dict[str, object]]) -> list[float]:
        request = urllib.request.Request(
            f"{self.url}/score",
            data=json.dumps({"inputs": inputs}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                payload = json.loads(response.read())
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:500]
            retry_after = _seconds(error.headers.get("Retry-After")) if error.headers else 0.0
            raise _Failure(
                f"HTTP {error.code}: {detail}",
                status=RewardStatus.TIMEOUT if error.code == 504 else RewardStatus.INFRA_ERROR,
                is_retryable=error.code >= 500,
                retry_after_s=retry_after,
            ) from None
        except TimeoutError:
            raise _Failure(
                f"no answer within {self.timeout_s}s", status=RewardStatus.TIMEOUT, is_retryable=True
            ) from None
        except urllib.error.URLError as error:
            is_timeout = isinstance(error.reason, TimeoutError)
            status = RewardStatus.TIMEOUT if is_timeout else RewardStatus.INFRA_ERROR
            raise _Failure(f"cannot reach the server: {error.reason}", status=status, is_retryable=True) from None
        except (ConnectionError, http.client.HTTPException, json.JSONDecodeError) as error:  # cut off or garbled
            failure = f"{type(error).__name__}: {error}"
            raise _Failure(failure, status=RewardStatus.INFRA_ERROR, is_retryable=True) from None
        return self._check_scores(payload, num_inputs=len(inputs))

    def _check_scores(self, payload: object, *, num_inputs: int) -> list[float]:
        scores = payload.get("scores") if isinstance(payload, dict) else None
        if not isinstance(scores, list) or len(scores) != num_inputs:
            raise _Failure(
                f"expected {num_inputs} scores, got {str(payload)[:200]}",
                status=RewardStatus.INFRA_ERROR,
                is_retryable=False,
            )
        if not all(isinstance(s, int | float) and math.isfinite(s) for s in scores):
            raise _Failure(f"non-finite scores: {scores[:8]}", status=RewardStatus.INFRA_ERROR, is_retryable=False)
        assert isinstance(payload, dict)
        self.num_truncated += int(payload.get("num_truncated", 0))
        return [float(s) for s in scores]


def _seconds(retry_after: str | None) -> float:
    """Retry-After as seconds (the HTTP-date form is not used by `rm_server`, so it reads as 0)."""
    try:
        return max(0.0, float(retry_after)) if retry_after else 0.0
    except ValueError:
        return 0.0
