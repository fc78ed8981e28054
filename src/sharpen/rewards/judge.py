"""LLM-as-judge: a `RewardFn` that asks a chat model (any OpenAI-compatible server) to grade a completion.

Owns the chat client (`OpenAICompatibleClient`, over the services' one HTTP client: retries with backoff on
connection errors, timeouts, 408, 429 and 5xx), the verdict cache (in memory, optionally appended to a JSONL file),
token accounting, pairwise comparison in both orders (so position bias cancels), canaries (known-bad responses
that a sound judge must score low) and the gate they drive, and what each outcome scores:
- a candidate with injection structure (`judge_guard`, run on the normalised text first) is never sent: it scores
  the bottom of the scale, ``wrong``, flagged ``judge_injection``;
- a "master key" (no answer: only punctuation and openers such as "Solution:", `judge_guard.is_master_key`) is never
  sent either: ``wrong``, score 0, unflagged (it is a wrong answer, and the policy should learn that it is);
- a reply that ends in a verdict not bound to this call (no or a wrong nonce, or a copy of the candidate's object)
  was written at the candidate's bidding: ``wrong``, score 0, flagged ``judge_hijacked`` (the policy caused it, so it
  is no free abstention);
- a judge that cannot answer abstains (``score=None``, never a made-up 0): an unparseable reply is
  ``JUDGE_UNPARSEABLE``, a transport failure ``INFRA_ERROR`` or ``TIMEOUT``;
- after a failed canary check, until one passes, every call abstains (``INFRA_ERROR``) or raises
  `JudgeCanaryError` (``on_canary_failure = "stop"``).
The prompt text and the verdict format are `judge_prompts`'; what happens to flagged rollouts is the hack monitor's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from sharpen.config.service import RemoteConfig
from sharpen.rewards.base import RewardContractError
from sharpen.rewards.judge_guard import ScreenedCandidate, screen_candidate
from sharpen.rewards.judge_prompts import CANARIES, CANARY_EXAMPLE, RubricPrompt, Verdict, read_verdict
from sharpen.serving import ReplicaClient, ServiceRequestError, ServiceUnavailable, new_key
from sharpen.types import Example, RewardResult, RewardStatus

logger = logging.getLogger(__name__)


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


class JudgeCanaryError(RewardContractError):
    """A judge failed its canaries and its config says stop: training on a judge known to be fooled is worse than
    stopping (a `RewardContractError`, so the rubric and scoring let it through instead of abstaining)."""


CanaryPolicy = Literal["abstain", "stop"]


class ChatClient(Protocol):
    model: str
    """Names the judge in ``RewardResult.verifier`` and in cache keys."""

    def chat(self, messages: list[dict[str, str]]) -> ChatReply: ...


class OpenAICompatibleClient:
    """POSTs ``/v1/chat/completions`` (vLLM's ``vllm serve``, SGLang, hosted APIs) with greedy decoding, through the
    services' one client (`sharpen.serving.ReplicaClient`: retries with backoff, timeouts, the API key as a bearer
    token read from ``api_key_env`` now, None for no key)."""

    def __init__(
        self,
        base_url: str,
        *,
        model: str,
        api_key_env: str | None = None,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        backoff_s: float = 1.0,
        max_tokens: int = 1024,
    ) -> None:
        server = base_url.rstrip("/").removesuffix("/v1")  # either form of base URL
        remote = RemoteConfig(
            urls=[server], token_env=api_key_env, timeout_s=timeout_s, max_retries=max_retries, backoff_s=backoff_s
        )
        self.model = model
        self.max_tokens = max_tokens
        self.client = ReplicaClient(remote, what="judge")

    def chat(self, messages: list[dict[str, str]]) -> ChatReply:
        """One completion; raises `JudgeTransportError` once ``max_retries`` retries are spent (or at once for a
        4xx). Each call carries an Idempotency-Key, which makes a retry after a timeout or a 5xx allowed: a chat
        completion has no effect but its reply."""
        body = {"model": self.model, "messages": messages, "temperature": 0.0, "max_tokens": self.max_tokens}
        try:
            _, answer = self.client.call("POST", "/v1/chat/completions", body, key=new_key())
        except (ServiceUnavailable, ServiceRequestError) as error:
            is_timeout = isinstance(error, ServiceUnavailable) and error.is_timeout
            raise JudgeTransportError(str(error), is_timeout=is_timeout) from error
        return _read_reply(answer)

    def close(self) -> None:
        self.client.close()


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
        on_canary_failure: CanaryPolicy = "abstain",
    ) -> None:
        if on_canary_failure not in ("abstain", "stop"):
            raise ValueError(f'Judge: on_canary_failure must be "abstain" or "stop", got {on_canary_failure!r}')
        self.client = client
        self.prompt = prompt or RubricPrompt()
        self.verifier = f"judge:{client.model}"
        self.verifier_version = self.prompt.version
        self.canary_threshold = canary_threshold
        self.on_canary_failure: CanaryPolicy = on_canary_failure
        self.is_canary_failed = False
        """Set by `run_canaries`: the last check saw a known-bad response score above the threshold."""
        self._cache_path = cache_path
        self._cache: dict[str, tuple[str, str]] = _load_cache(cache_path) if cache_path else {}
        self._lock = threading.Lock()  # reward functions may be called from a thread pool
        counted = (
            "prompt_tokens completion_tokens requests cache_hits unparseable transport_errors pairwise_comparisons "
            "pairwise_inconsistent screened hijacked canary_gated master_keys"
        )
        self._counts: dict[str, float] = dict.fromkeys(counted.split(), 0.0)
        self._disagreement_sum = 0.0

    def __call__(self, example: Example, completion: str) -> RewardResult:
        key = self._key("pointwise", example, completion)
        result = RewardResult(
            score=None,
            status=RewardStatus.JUDGE_UNPARSEABLE,
            verifier=self.verifier,
            verifier_version=self.verifier_version,
            cache_key=key,
        )
        if self._is_gated():
            result.status = RewardStatus.INFRA_ERROR
            return result
        candidate = self._screen(example, completion)
        if candidate.signals:
            return self._failed(result, "judge_injection", f"injection structure: {', '.join(candidate.signals)}")
        if candidate.is_master_key:  # nothing to grade: wrong, and unflagged, so the policy learns it earns nothing
            result.score, result.status, result.components["judge"] = 0.0, RewardStatus.WRONG, 0.0
            result.detail = "no answer to grade (a master key: only punctuation and openers such as 'Solution:')"
            return result
        nonce = secrets.token_hex(8)
        try:
            reply, nonce = self._ask(key, self.prompt.messages(example, candidate.text, nonce=nonce), nonce=nonce)
        except JudgeTransportError as error:
            logger.warning("judge failed on %s; abstaining: %s", example.task_key, error)
            result.status = RewardStatus.TIMEOUT if error.is_timeout else RewardStatus.INFRA_ERROR
            return result
        verdict = self._read(reply, nonce, candidate.text)
        if verdict.is_forged:
            return self._failed(result, "judge_hijacked", f"the judge's verdict was not its own ({verdict.refusal})")
        if verdict.score is not None:
            # a graded score has no right/wrong; the midpoint of the rubric's range is the line drawn for the status
            result.score = self.prompt.normalise(verdict.score)
            result.status = RewardStatus.OK if result.score >= 0.5 else RewardStatus.WRONG
            result.components["judge"] = result.score
        return result

    def compare(self, example: Example, a: str, b: str) -> float | None:
        """Preference for ``a`` over ``b`` in [0, 1], asked in both orders and averaged; None if the judge abstained.
        See `compare_both_orders` for each order's preference (their disagreement is also in `metrics`)."""
        return self.compare_both_orders(example, a, b).preference

    def compare_both_orders(self, example: Example, a: str, b: str) -> PairwiseVerdict:
        """Both orders of the pairwise question. A response with injection structure loses without a request
        (both: no verdict); the gate of a failed canary check abstains."""
        if self._is_gated():
            return PairwiseVerdict(preference=None, preference_ab=None, preference_ba=None)
        first, second = self._screen(example, a), self._screen(example, b)
        is_first_out, is_second_out = (
            bool(first.signals) or first.is_master_key,
            bool(second.signals) or second.is_master_key,
        )
        if is_first_out or is_second_out:
            screened = None if is_first_out and is_second_out else float(is_second_out)
            return PairwiseVerdict(preference=screened, preference_ab=screened, preference_ba=screened)
        preference_ab = self._prefer_first(example, first.text, second.text)
        preference_b_first = self._prefer_first(example, second.text, first.text)
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
        """Grades every canary (bypassing the cache and the injection screen, so the judge's model itself is
        tested) and returns ``judge/canary_max_score``, ``judge/canary_alert`` (1.0 when any canary scores above
        ``canary_threshold``), ``judge/canary_abstained`` and ``judge/canary/<name>``. A canary answered with a
        forged verdict (the canary's own, or one without this call's nonce) counts as full marks: the judge obeyed
        it. The result sets `is_canary_failed`, which gates the judge until a later check passes. Pass a task from
        the run's data for a rubric-specific check; the default is a small arithmetic task. Their requests and
        tokens count in `metrics`."""
        example = example or CANARY_EXAMPLE
        metrics: dict[str, float] = {}
        for name, response in CANARIES.items():
            nonce = secrets.token_hex(8)
            try:
                reply, _ = self._ask("", self.prompt.messages(example, response, nonce=nonce), nonce=nonce)
            except JudgeTransportError:
                continue
            verdict = self._read(reply, nonce, response)
            if verdict.is_forged:
                metrics[f"judge/canary/{name}"] = 1.0
            elif verdict.score is not None:
                metrics[f"judge/canary/{name}"] = self.prompt.normalise(verdict.score)
        max_score = max(metrics.values(), default=0.0)
        metrics["judge/canary_abstained"] = float(len(CANARIES) - len(metrics))
        metrics["judge/canary_max_score"] = max_score
        metrics["judge/canary_alert"] = float(max_score > self.canary_threshold)
        with self._lock:
            self.is_canary_failed = max_score > self.canary_threshold
        if self.is_canary_failed:
            logger.warning(
                "judge canary alert: a known-bad response scored %.2f (%s); gated (%s) until a check passes",
                max_score,
                self.verifier,
                self.on_canary_failure,
            )
        return metrics

    def metrics(self) -> dict[str, float]:
        """Running totals since construction (the caller takes differences for per-step rates), and the mean
        disagreement of the two orders of pairwise comparisons (position bias). ``judge/screened`` counts
        candidates refused for injection structure (``judge/injection/<signal>`` by signal), ``judge/hijacked``
        replies with a forged verdict, ``judge/canary_gated`` calls refused after a failed canary check,
        ``judge/master_keys`` candidates with no answer (scored 0 without a request)."""
        with self._lock:
            out = {f"judge/{name}": value for name, value in self._counts.items()}
            if self._counts["pairwise_comparisons"]:
                out["judge/pairwise_disagreement"] = self._disagreement_sum / self._counts["pairwise_comparisons"]
        return out

    def _is_gated(self) -> bool:
        with self._lock:
            if not self.is_canary_failed:
                return False
            self._counts["canary_gated"] += 1
        if self.on_canary_failure == "stop":
            raise JudgeCanaryError(f'{self.verifier} failed its canaries (on_canary_failure = "stop")')
        return True

    def _screen(self, example: Example, completion: str) -> ScreenedCandidate:
        context = "\n".join([*(m.text for m in example.prompt), example.answer or ""])
        reference = example.answer or ""
        candidate = screen_candidate(completion, context=context, max_score=self.prompt.max_score, reference=reference)
        if candidate.is_master_key:
            with self._lock:
                self._counts["master_keys"] += 1
        if candidate.signals:
            logger.info("judge: %s screened for %s", example.task_key, ", ".join(candidate.signals))
            with self._lock:
                self._counts["screened"] += 1
                for signal in candidate.signals:
                    self._counts[f"injection/{signal}"] = self._counts.get(f"injection/{signal}", 0.0) + 1
        return candidate

    def _failed(self, result: RewardResult, flag: str, detail: str) -> RewardResult:
        """The policy's failure: the bottom of the scale, ``wrong``, and the flag that screens the rollout."""
        result.score = 0.0
        result.status = RewardStatus.WRONG
        result.components["judge"] = 0.0
        result.hack_flags.append(flag)
        result.is_policy_error = True
        result.detail = detail
        return result

    def _prefer_first(self, example: Example, first: str, second: str) -> float | None:
        key = self._key("pairwise", example, first, second)
        nonce = secrets.token_hex(8)
        try:
            messages = self.prompt.pairwise_messages(example, first, second, nonce=nonce)
            reply, nonce = self._ask(key, messages, nonce=nonce)
        except JudgeTransportError as error:
            logger.warning("pairwise judge failed on %s; abstaining: %s", example.task_key, error)
            return None
        verdict = self._read(reply, nonce, first, second)
        return None if verdict.score is None else self.prompt.normalise(verdict.score)

    def _ask(self, key: str, messages: list[dict[str, str]], *, nonce: str) -> tuple[ChatReply, str]:
        """The reply and the nonce it must carry (a cached reply carries the nonce of the call that made it);
        an empty ``key`` bypasses the cache."""
        if key:
            with self._lock:
                cached = self._cache.get(key)
                if cached is not None:
                    self._counts["cache_hits"] += 1
                    return ChatReply(
                        text=cached[0], prompt_tokens=0, completion_tokens=0, finish_reason="stop"
                    ), cached[1]
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
            if key and reply.finish_reason != "length":
                self._cache[key] = (reply.text, nonce)
                if self._cache_path is not None:
                    with self._cache_path.open("a", encoding="utf-8") as file:
                        file.write(json.dumps({"key": key, "text": reply.text, "nonce": nonce}) + "\n")
        return reply, nonce

    def _read(self, reply: ChatReply, nonce: str, *candidates: str) -> Verdict:
        verdict = Verdict(score=None, refusal="no_verdict")
        if reply.finish_reason != "length":
            scale = {"min_score": self.prompt.min_score, "max_score": self.prompt.max_score}
            verdict = read_verdict(reply.text, nonce=nonce, candidates=candidates, **scale)
        if verdict.score is None:
            with self._lock:
                self._counts["hijacked" if verdict.is_forged else "unparseable"] += 1
        return verdict

    def _key(self, kind: str, example: Example, *responses: str) -> str:
        parts = [kind, self.client.model, self.verifier_version, example.task_hash, *map(_sha, responses)]
        return _sha("\x00".join(parts))


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _load_cache(path: Path) -> dict[str, tuple[str, str]]:
    cache: dict[str, tuple[str, str]] = {}
    if not path.exists():
        return cache
    text = path.read_text(encoding="utf-8")
    if text and not text.endswith("\n"):  # end a line cut short by a crash, so the next append starts clean
        with path.open("a", encoding="utf-8") as file:
            file.write("\n")
    for number, line in enumerate(text.splitlines(), start=1):
        try:
            entry = json.loads(line)
            cache[entry["key"]] = (entry["text"], entry["nonce"])
        except (json.JSONDecodeError, KeyError, TypeError):  # a line cut short by a crash costs one re-ask
            logger.warning("judge cache %s: skipping unreadable line %d", path, number)
    return cache
