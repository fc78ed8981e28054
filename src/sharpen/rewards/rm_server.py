"""The reward-model service (`sharpen serve-rm`): a sequence-classification reward model on the service shell.

Owns: rendering (prompt, completion) pairs as a chat and truncating them to ``max_length`` tokens (`RewardModelScorer`,
also what the Ray reward-model actors load; through `sharpen.control_tokens`, so a completion that types the reward
model's template markers, e.g. a forged turn after its answer, scores as the text it is), one batcher thread that
gathers the requests arriving within ``max_wait_ms`` (up to ``max_batch_size`` inputs) into one padded forward, and the
route ``POST /score`` ``{"inputs": [{"prompt": [{"role", "content"}...], "completion": "..."}]}`` -> ``{"scores":
[...], "truncated": [...], "num_truncated": n}``. The shell (`sharpen.serving.shell`) gives what every served component
has: the bearer token (required: the service does not start without one, and a call without it is answered 401
before its body is read), the body limit, the framing and connection limits, at most
``service.max_items_per_request`` inputs per request (413), fair admission (``2 * max_batch_size`` requests with the
batcher, ``service.max_queue_size`` waiting for a place, shared between callers, then 503 with Retry-After), answers
kept by Idempotency-Key, ``GET /healthz``, ``/readyz`` and ``/metrics``. A failed forward is answered 503: nothing
was scored, so the client may ask again. Does not load the model (`sharpen serve-rm` does) nor retry (the client,
`rm_client`, does).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sharpen.config.service import ServiceConfig
from sharpen.control_tokens import encode_text, template_ids
from sharpen.serving.shell import Request, Route, ServedComponent, ServiceError, ServiceShell

logger = logging.getLogger(__name__)


class RewardModelScorer:
    """Messages -> token ids -> one scalar per sequence, for an HF ``*ForSequenceClassification`` with one label."""

    def __init__(self, *, model: Any, tokenizer: Any, max_length: int) -> None:
        if model.config.num_labels != 1:
            raise ValueError(f"reward model: expected num_labels=1 (one scalar score), got {model.config.num_labels}")
        if max_length < 1:
            raise ValueError(f"reward model: max_length must be >= 1, got {max_length}")
        if model.config.pad_token_id is None:  # HF refuses batches without one: it finds last tokens by skipping pads
            model.config.pad_token_id = (
                tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id
            )
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_length = max_length
        # HTTP handler threads encode concurrently; HF fast tokenizers are not documented as thread-safe.
        self._encode_lock = threading.Lock()

    @classmethod
    def from_pretrained(
        cls, model_path: str | Path, *, max_length: int, device: str | None = None
    ) -> RewardModelScorer:
        """Load a local folder's model (in its own dtype) and tokenizer; ``device`` None means CUDA when there is
        one. Used by `sharpen serve-rm` and by the Ray reward-model actors."""
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        model = AutoModelForSequenceClassification.from_pretrained(model_path, dtype="auto").to(device)
        return cls(model=model, tokenizer=AutoTokenizer.from_pretrained(model_path), max_length=max_length)

    def score_pairs(self, pairs: Sequence[tuple[Sequence[dict[str, str]], str]]) -> tuple[list[float], list[bool]]:
        """Encode and score (prompt messages, completion) pairs in one forward: the scores, and which inputs were
        truncated. Every pair must render to at least one token."""
        encoded = [self.encode(prompt, completion) for prompt, completion in pairs]
        if any(not ids for ids, _ in encoded):
            raise ValueError("reward model: an input renders to no tokens")
        return self.score([ids for ids, _ in encoded]), [is_truncated for _, is_truncated in encoded]

    def encode(self, prompt: Sequence[dict[str, str]], completion: str) -> tuple[list[int], bool]:
        """Token ids of the conversation ending in ``completion``, and whether they were truncated. Truncation keeps
        the end: the score is read at the last token, so the completion's end must survive."""
        with self._encode_lock:
            if self.tokenizer.chat_template:
                messages = [*(dict(m) for m in prompt), {"role": "assistant", "content": completion}]
                ids = template_ids(self.tokenizer, messages, add_generation_prompt=False)
            else:
                text = "\n\n".join([*(m["content"] for m in prompt), completion])
                ids = encode_text(self.tokenizer, text, add_special_tokens=True)
        is_truncated = len(ids) > self.max_length
        return list(ids[-self.max_length :]), is_truncated

    def score(self, batch: Sequence[list[int]]) -> list[float]:
        """One forward over right-padded ``batch`` (right padding keeps position ids equal to an unpadded run)."""
        import torch

        device = next(self.model.parameters()).device
        longest = max(len(ids) for ids in batch)
        input_ids = torch.full((len(batch), longest), self.model.config.pad_token_id, dtype=torch.long)  # [batch, seq]
        attention_mask = torch.zeros((len(batch), longest), dtype=torch.long)  # [batch, seq]
        for row, ids in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, : len(ids)] = 1
        with torch.no_grad():
            logits = self.model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)).logits
        return [float(x) for x in logits[:, 0].float().cpu()]  # logits: [batch, 1]


@dataclass(kw_only=True, slots=True)
class _Job:
    """One request's inputs, waiting for the batcher to fill ``scores`` (or ``error``) and set ``done``."""

    ids: list[list[int]]
    scores: list[float] = field(default_factory=list[float])
    error: str = ""
    done: threading.Event = field(default_factory=threading.Event)


def parse_inputs(body: Mapping[str, Any]) -> list[tuple[list[dict[str, str]], str]]:
    """The (prompt messages, completion) pairs of a ``/score`` body; a `ServiceError` (400) names what is wrong."""
    inputs = body.get("inputs")
    if not isinstance(inputs, list):
        raise ServiceError(400, 'expected an object {"inputs": [{"prompt": [...], "completion": "..."}, ...]}')
    pairs = []
    for index, item in enumerate(inputs):
        where = f"inputs[{index}]"
        if not isinstance(item, dict) or not isinstance(item.get("completion"), str):
            raise ServiceError(400, f"{where}: expected an object with a string 'completion'")
        prompt = item.get("prompt")
        if not isinstance(prompt, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt
        ):
            raise ServiceError(400, f"{where}.prompt: expected a list of {{'role': str, 'content': str}} messages")
        pairs.append(([{"role": m["role"], "content": m["content"]} for m in prompt], item["completion"]))
    return pairs


class RewardModelService(ServedComponent):
    """Serves ``scorer`` behind a `ServiceShell` (``start()`` in background threads, ``serve_forever()`` for the
    CLI). ``num_forwards`` and ``num_scored`` count forwards and inputs scored (also in /metrics)."""

    def __init__(
        self,
        scorer: RewardModelScorer,
        *,
        service: ServiceConfig,
        token: str,
        host: str = "127.0.0.1",
        port: int = 0,
        max_batch_size: int = 32,
        max_wait_ms: float = 5.0,
    ) -> None:
        if max_batch_size < 1 or max_wait_ms < 0:
            raise ValueError("reward model service: max_batch_size must be >= 1, max_wait_ms >= 0")
        self.scorer = scorer
        self.service = service
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000
        self.num_forwards = 0
        self.num_scored = 0
        self._queue: queue.Queue[_Job] = queue.Queue()  # bounded by the shell's admission
        self._carry: _Job | None = None  # taken from the queue but did not fit the last batch
        self._lock = threading.Lock()  # no job is queued after close() has answered the queued ones
        self._stopping = threading.Event()
        self._threads = [threading.Thread(target=self._run_batcher, daemon=True, name="rm-service-batcher")]
        route = Route(
            method="POST", pattern="/score", handler=self._score, is_queued=True, is_idempotent=True, items="inputs"
        )
        self.shell = ServiceShell(
            service,
            routes=[route],
            token=token,
            # One batch in a forward while the next one gathers (for requests of one input each).
            max_running=2 * max_batch_size,
            host=host,
            port=port,
            is_ready=self._threads[0].is_alive,
            gauges=lambda: {
                "sharpen_rm_forwards": self.num_forwards,
                "sharpen_rm_inputs_scored": self.num_scored,
                "sharpen_rm_waiting_for_forward": self.num_waiting,
            },
        )
        self.url = self.shell.url

    @property
    def num_waiting(self) -> int:
        """Requests with the batcher that no forward has taken yet."""
        return self._queue.qsize()

    def close(self) -> None:
        """Stop serving; what the batcher never took is answered 503 (another replica may score it)."""
        with self._lock:
            self._stopping.set()
        self.shell.close()
        for thread in self._threads:
            if thread.is_alive():
                thread.join(timeout=5)
        for job in [j for j in (self._carry, *self._queue.queue) if j is not None]:
            job.error = "the server shut down before scoring"
            job.done.set()

    def _score(self, request: Request) -> dict[str, Any]:
        pairs = parse_inputs(request.body)
        try:
            encoded = [self.scorer.encode(*pair) for pair in pairs]
        except Exception as error:  # a chat template that rejects the messages
            raise ServiceError(400, f"cannot render the inputs: {type(error).__name__}: {error}") from None
        if any(not ids for ids, _ in encoded):
            raise ServiceError(400, "an input renders to no tokens")
        truncated = [is_truncated for _, is_truncated in encoded]
        job = _Job(ids=[ids for ids, _ in encoded])
        with self._lock:
            if self._stopping.is_set():  # close() has answered what was queued; nothing would answer this one
                raise ServiceError(503, "the server is shutting down", retry_after=0)
            if job.ids:
                self._queue.put(job)
            else:
                job.done.set()
        job.done.wait()  # always set: by the batcher (scores or error) or by close()
        if job.error:
            raise ServiceError(503, job.error, retry_after=self.service.retry_after_s)
        return {"scores": job.scores, "truncated": truncated, "num_truncated": sum(truncated)}

    def _next_batch(self) -> list[_Job]:
        """The jobs of the next forward: the first waiting one, then whatever arrives within ``max_wait_ms`` while
        the inputs fit ``max_batch_size`` (a job bigger than that alone is split by `_run_batch`)."""
        first, self._carry = self._carry, None
        while first is None and not self._stopping.is_set():
            with contextlib.suppress(queue.Empty):  # wake up now and then to notice close()
                first = self._queue.get(timeout=0.1)
        if first is None:
            return []
        batch, num_inputs = [first], len(first.ids)
        deadline = time.monotonic() + self.max_wait_s
        while num_inputs < self.max_batch_size:
            try:
                job = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if num_inputs + len(job.ids) > self.max_batch_size:
                self._carry = job
                break
            batch.append(job)
            num_inputs += len(job.ids)
        return batch

    def _run_batcher(self) -> None:
        while not self._stopping.is_set():
            if batch := self._next_batch():
                self._run_batch(batch)

    def _run_batch(self, batch: list[_Job]) -> None:
        flat = [ids for job in batch for ids in job.ids]
        scores: list[float] = []
        error = ""
        try:
            for start in range(0, len(flat), self.max_batch_size):
                scores += self.scorer.score(flat[start : start + self.max_batch_size])
                self.num_forwards += 1
            self.num_scored += len(flat)
        except Exception as failure:  # a failed forward (OOM, bad weights) fails its requests, not the server
            logger.exception("reward model forward failed")
            error = f"forward failed: {type(failure).__name__}: {failure}"
        offset = 0
        for job in batch:
            job.scores, job.error = scores[offset : offset + len(job.ids)], error
            offset += len(job.ids)
            job.done.set()
