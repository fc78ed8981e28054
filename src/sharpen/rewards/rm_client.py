"""A `RewardFn` that asks a reward-model service (`sharpen serve-rm`, see `rm_server`) for scores over HTTP.

Owns: the request format, batching pairs into requests of ``batch_size``, checking the answer, and turning a failed
request into abstentions of its rollouts (``score=None``, status TIMEOUT when the server was too slow, INFRA_ERROR
otherwise), never a made-up 0. The transport is the services' one client (`sharpen.serving.ReplicaClient`): the
token, timeouts, retries with backoff (a full queue's 503, a failed forward, no answer in time; each request carries
an Idempotency-Key, so a retry never scores twice), and a 4xx refused at once as the caller's bug.
Does not: start or manage the server, or normalise scores.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from sharpen.config.service import TOKEN_ENV, RemoteConfig
from sharpen.serving import ReplicaClient, ServiceRequestError, ServiceUnavailable, new_key
from sharpen.types import Example, RewardResult, RewardStatus

logger = logging.getLogger(__name__)

VERIFIER = "reward_model"


class RewardModelClient:
    """Scores completions with a remote reward model. The token is read from ``token_env`` now (a missing one is an
    error here, not abstentions later). ``num_truncated`` counts inputs the server cut to its ``max_length`` (their
    scores judge only the kept end of the conversation)."""

    def __init__(
        self,
        url: str,
        *,
        token_env: str = TOKEN_ENV,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        batch_size: int = 32,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"RewardModelClient: batch_size must be >= 1, got {batch_size}")
        remote = RemoteConfig(
            urls=[url], token_env=token_env, timeout_s=timeout_s, max_retries=max_retries, backoff_s=backoff_s
        )
        self.url = remote.urls[0]
        self.batch_size = batch_size
        self.num_truncated = 0
        self.client = ReplicaClient(remote, what="reward model")

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
                scores = self._score(inputs)
            except (ServiceUnavailable, ServiceRequestError, ValueError) as error:
                is_timeout = isinstance(error, ServiceUnavailable) and error.is_timeout
                logger.warning("%s; %d rollouts abstain", error, len(chunk))
                status = RewardStatus.TIMEOUT if is_timeout else RewardStatus.INFRA_ERROR
                results += [RewardResult(score=None, status=status, verifier=VERIFIER) for _ in chunk]
                continue
            results += [RewardResult(score=score, status=RewardStatus.OK, verifier=VERIFIER) for score in scores]
        return results

    def _score(self, inputs: list[dict[str, object]]) -> list[float]:
        """The scores of one request; `ValueError` for an answer that is not one finite score per input."""
        _, answer = self.client.call("POST", "/score", {"inputs": inputs}, key=new_key())
        scores = answer.get("scores")
        if not isinstance(scores, list) or len(scores) != len(inputs):
            raise ValueError(f"reward model at {self.url}: expected {len(inputs)} scores, got {str(answer)[:200]}")
        if not all(isinstance(s, int | float) and math.isfinite(s) for s in scores):
            raise ValueError(f"reward model at {self.url}: non-finite scores: {scores[:8]}")
        self.num_truncated += int(answer.get("num_truncated", 0))
        return [float(s) for s in scores]

    def close(self) -> None:
        self.client.close()
