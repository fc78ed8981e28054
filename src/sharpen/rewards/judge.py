"""LLM-as-judge: a `RewardFn` that asks a chat model (any OpenAI-compatible server) to grade a completion.

Owns the HTTP client (`OpenAICompatibleClient`: stdlib ``urllib``, retries with backoff on connection errors, 429
and 5xx), the verdict cache (in memory, optionally appended to a JSONL file), token accounting, pairwise
comparison in both orders (so position bias cancels), and canaries (known-bad responses that a sound judge must
score low). A judge that cannot answer abstains: an unparseable reply is ``JUDGE_UNPARSEABLE``, a transport failure
``INFRA_ERROR`` or ``TIMEOUT``, both with ``score=None``, never a made-up 0. The prompt text and the verdict format
are `judge_prompts`'; what happens to flagged rollouts is the hack monitor's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from sharpen.rewards.judge_prompts import CANARIES, CANARY_EXAMPLE, RubricPrompt, looks_like_injection, parse_verdict
from sharpen.types import Example, RewardResult, RewardStatus

logger = logging.getLogger(__name__)

_RETRIED_HTTP = {408, 429, 500, 502, 503, 504}


@dataclass(kw_only=True, slots=True, frozen=True)
class ChatReply:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str


class JudgeTransportError(RuntimeError):
    """The judge server did not answer (after retries); ``is_timeout`` tells a slow server from a broken one."""

    def __init__(self, message: str, *, is_timeout: bool) -> None:
        super().__init__(message)
        self.is_timeout = is_timeout


class ChatClient(Protocol):
    model: str
    """Names the judge in ``RewardResult.verifier`` and in cache keys."""

    def chat(self, messages: list[dict[str, str]]) -> ChatReply: ...


class OpenAICompatibleClient:
    """POSTs ``/v1/chat/completions`` (vLLM's ``vllm serve``, SGLang, hosted APIs) with greedy decoding."""

    def __init__(
        self,
        base_url: str,
        *,
        model: str,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        backoff_s: float = 1.0,
        max_tokens: int = 1024,
    ) -> None:
        self.url = base_url.rstrip("/").removesuffix("/v1") + "/v1/chat/completions"  # either form of base URL
        self.model = model
        self._api_key = api_key
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_tokens = max_tokens

    def chat(self, messages: list[dict[str, str]]) -> ChatReply:
        """One completion; raises `JudgeTransportError` once ``max_retries`` retries are spent."""
        body = {"model": self.model, "messages": messages, "temperature": 0.0, "max_tokens": self.max_tokens}
        headers = {"Content-Type": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        payload = json.dumps(body).encode()
        for attempt in range(self.max_retries + 1):
            try:
                request = urllib.request.Request(self.url, data=payload, headers=headers, method="POST")
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    return _read_reply(json.loads(response.read()))
            except urllib.error.HTTPError as error:  # must precede URLError, its base class
                if error.code not in _RETRIED_HTTP or attempt == self.max_retries:
                    raise JudgeTransportError(f"judge HTTP {error.code} from {self.url}", is_timeout=False) from error
            except (urllib.error.URLError, ConnectionError, TimeoutError) as error:
                if attempt == self.max_retries:
                    reason = getattr(error, "reason", error)  # a connect timeout arrives wrapped, a read timeout bare
                    message = f"judge unreachable at {self.url}: {error}"
                    raise JudgeTransportError(message, is_timeout=isinstance(reason, TimeoutError)) from error
            time.sleep(self.backoff_s * 2**attempt)
        raise AssertionError("unreachable: the last attempt returns or raises")


def _read_reply(body: dict) -> ChatReply:
    try:
        choice = body["choices"][0]
        usage = body.get("usage") or {}
        return ChatReply(
            text=choice["message"]["content"] or "",
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            completion_tokens=int(usage.get("completion_tokens", 0)),
            finish_reason=str(choice.get("finish_reason") or "stop"),
        )
    except (KeyError, IndexError, TypeError, ValueError) as error:
        raise JudgeTransportError(f"malformed chat completion: {str(body)[:200]}", is_timeout=False) from error


@dataclass(kw_only=True, slots=True)
class PairwiseVerdict:
    """``preference`` for A in [0, 1] (0.5 = tie), averaged over both orders; None when either order abstained."""

    preference: float | None
    preference_ab: float | None
    """Preference for A when A was shown first."""
    preference_ba: float | None
    """Preference for A when A was shown second."""

    @property
    def disagreement(self) -> float | None:
        """How far the two orders disagree (0 = position made no difference); large values mean position bias."""
        if self.preference_ab is None or self.preference_ba is None:
            return None
        return abs(self.preference_ab - self.preference_ba)


class Judge:
    """Scores a completion in [0, 1] by asking ``client``'s model to grade it against ``prompt``'s rubric."""

    def __init__(
        self,
        client: ChatClient,
        *,
        prompt: RubricPrompt | None = None,
        cache_path: Path | None = None,
        canary_threshold: float = 0.3,
    ) -> None:
        self.client = client
        self.prompt = prompt or RubricPrompt()
        self.verifier = f"judge:{client.model}"
        self.verifier_version = self.prompt.version
        self.canary_threshold = canary_threshold
        self._cache_path = cache_path
        self._cache: dict[str, str] = _load_cache(cache_path) if cache_path else {}
        self._lock = threading.Lock()  # reward functions may be called from a thread pool
        counted = (
            "prompt_tokens completion_tokens requests cache_hits unparseable transport_errors pairwise_comparisons"
        )
        self._counts = dict.fromkeys([*counted.split(), "pairwise_inconsistent"], 0.0)
        self._disagreement_sum = 0.0

    def __call__(self, example: Example, completion: str) -> RewardResult:
        key = self._key("pointwise", example, completion)
        result = RewardResult(
            score=None,
            status=RewardStatus.JUDGE_UNPARSEABLE,
            verifier=self.verifier,
            verifier_version=self.verifier_version,
            hack_flags=["judge_injection"] if looks_like_injection(completion) else [],
            cache_key=key,
        )
        try:
            reply = self._ask(key, self.prompt.messages(example, completion), use_cache=True)
        except JudgeTransportError as error:
            logger.warning("judge failed on %s; abstaining: %s", example.task_key, error)
            result.status = RewardStatus.TIMEOUT if error.is_timeout else RewardStatus.INFRA_ERROR
            return result
        raw = self._parse(reply)
        if raw is not None:
            # a graded score has no right/wrong; the midpoint of the rubric's range is the line drawn for the status
            result.score = self.prompt.normalise(raw)
            result.status = RewardStatus.OK if result.score >= 0.5 else RewardStatus.WRONG
            result.components["judge"] = result.score
        return result

    def compare(self, example: Example, a: str, b: str) -> float | None:
        """Preference for ``a`` over ``b`` in [0, 1], asked in both orders and averaged; None if the judge abstained.
        See `compare_both_orders` for each order's preference (their disagreement is also in `metrics`)."""
        return self.compare_both_orders(example, a, b).preference

    def compare_both_orders(self, example: Example, a: str, b: str) -> PairwiseVerdict:
        preference_ab = self._prefer_first(example, a, b)
        preference_b_first = self._prefer_first(example, b, a)
        preference_ba = None if preference_b_first is None else 1.0 - preference_b_first
        verdict = PairwiseVerdict(preference=None, preference_ab=preference_ab, preference_ba=preference_ba)
        if preference_ab is None or preference_ba is None:
            return verdict
        verdict.preference = (preference_ab + preference_ba) / 2
        with self._lock:
            self._counts["pairwise_comparisons"] += 1
            self._disagreement_sum += verdict.disagreement or 0.0
            # the two orders pick different winners: the judge's choice was decided by position, not content
            self._counts["pairwise_inconsistent"] += float((preference_ab - 0.5) * (preference_ba - 0.5) < 0)
        return verdict

    def run_canaries(self, example: Example | None = None) -> dict[str, float]:
        """Grades every canary (bypassing the cache, so a judge that drifted is caught) and returns
        ``judge/canary_max_score``, ``judge/canary_alert`` (1.0 when any canary scores above ``canary_threshold``),
        ``judge/canary_abstained`` and ``judge/canary/<name>``. Pass a task from the run's data for a rubric-specific
        check; the default is a small arithmetic task. Their requests and tokens count in `metrics`."""
        example = example or CANARY_EXAMPLE
        metrics: dict[str, float] = {}
        for name, response in CANARIES.items():
            try:
                raw = self._parse(self._ask("", self.prompt.messages(example, response), use_cache=False))
            except JudgeTransportError:
                raw = None
            if raw is not None:
                metrics[f"judge/canary/{name}"] = self.prompt.normalise(raw)
        max_score = max(metrics.values(), default=0.0)
        metrics["judge/canary_abstained"] = float(len(CANARIES) - len(metrics))
        metrics["judge/canary_max_score"] = max_score
        metrics["judge/canary_alert"] = float(max_score > self.canary_threshold)
        if max_score > self.canary_threshold:
            logger.warning("judge canary alert: a known-bad response scored %.2f (%s)", max_score, self.verifier)
        return metrics

    def metrics(self) -> dict[str, float]:
        """Running totals since construction (the caller takes differences for per-step rates), and the mean
        disagreement of the two orders of pairwise comparisons (position bias)."""
        with self._lock:
            out = {f"judge/{name}": value for name, value in self._counts.items()}
            if self._counts["pairwise_comparisons"]:
                out["judge/pairwise_disagreement"] = self._disagreement_sum / self._counts["pairwise_comparisons"]
        return out

    def _prefer_first(self, example: Example, first: str, second: str) -> float | None:
        key = self._key("pairwise", example, first, second)
        try:
            reply = self._ask(key, self.prompt.pairwise_messages(example, first, second), use_cache=True)
        except JudgeTransportError as error:
            logger.warning("pairwise judge failed on %s; abstaining: %s", example.task_key, error)
            return None
        raw = self._parse(reply)
        return None if raw is None else self.prompt.normalise(raw)

    def _ask(self, key: str, messages: list[dict[str, str]], *, use_cache: bool) -> ChatReply:
        if use_cache:
            with self._lock:
                cached = self._cache.get(key)
                if cached is not None:
                    self._counts["cache_hits"] += 1
                    return ChatReply(text=cached, prompt_tokens=0, completion_tokens=0, finish_reason="stop")
        try:
            reply = self.client.chat(messages)
        except JudgeTransportError:
            with self._lock:
                self._counts["transport_errors"] += 1
            raise
        with self._lock:
            self._counts["requests"] += 1
            self._counts["prompt_tokens"] += reply.prompt_tokens
            self._counts["completion_tokens"] += reply.completion_tokens
            # a reply cut at max_tokens is not cached: its "final" object may be one the judge was only quoting
            if use_cache and reply.finish_reason != "length":
                self._cache[key] = reply.text
                if self._cache_path is not None:
                    with self._cache_path.open("a", encoding="utf-8") as file:
                        file.write(json.dumps({"key": key, "text": reply.text}) + "\n")
        return reply

    def _parse(self, reply: ChatReply) -> float | None:
        raw = None
        if reply.finish_reason != "length":
            raw = parse_verdict(reply.text, min_score=self.prompt.min_score, max_score=self.prompt.max_score)
        if raw is None:
            with self._lock:
                self._counts["unparseable"] += 1
        return raw

    def _key(self, kind: str, example: Example, *responses: str) -> str:
        parts = [kind, self.client.model, self.verifier_version, example.task_hash, *map(_sha, responses)]
        return _sha("\x00".join(parts))


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _load_cache(path: Path) -> dict[str, str]:
    cache: dict[str, str] = {}
    if not path.exists():
        return cache
    text = path.read_text(encoding="utf-8")
    if text and not text.endswith("\n"):  # end a line cut short by a crash, so the next append starts clean
        with path.open("a", encoding="utf-8") as file:
            file.write("\n")
    for number, line in enumerate(text.splitlines(), start=1):
        try:
            entry = json.loads(line)
            cache[entry["key"]] = entry["text"]
        except (json.JSONDecodeError, KeyError, TypeError):  # a line cut short by a crash costs one re-ask
            logger.warning("judge cache %s: skipping unreadable line %d", path, number)
    return cache
