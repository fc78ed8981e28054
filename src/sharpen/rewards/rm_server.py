"""A batched HTTP server for a sequence-classification reward model (`sharpen serve-rm`).

Owns: rendering (prompt, completion) pairs as a chat, truncating to ``max_length`` tokens, one batcher thread that
gathers requests arriving within ``max_wait_ms`` (up to ``max_batch_size`` inputs) into one padded forward, and
the wire format: ``POST /score`` ``{"inputs": [{"prompt": [{"role", "content"}...], "completion": "..."}]}`` ->
``{"scores": [...], "truncated": [...], "num_truncated": n}``; ``GET /health``. A full queue answers 503 with
Retry-After (the client backs off); nothing is dropped silently. Does not load the model (`sharpen serve-rm`
does), retry or time out a wedged forward (the client does). Standard library HTTP only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024 * 1024


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
                messages = [*prompt, {"role": "assistant", "content": completion}]
                text = self.tokenizer.apply_chat_template(messages, tokenize=False)
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            else:
                text = "\n\n".join([*(m["content"] for m in prompt), completion])
                ids = self.tokenizer(text)["input_ids"]
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
class _Request:
    """One HTTP request's inputs, waiting for the batcher to fill ``scores`` (or ``error``) and set ``done``."""

    ids: list[list[int]]
    scores: list[float] = field(default_factory=list[float])
    error: str = ""
    done: threading.Event = field(default_factory=threading.Event)


class _BadRequest(ValueError):
    """The client sent something the server cannot score: answered 400 with this message."""


def parse_inputs(body: bytes) -> list[tuple[list[dict[str, str]], str]]:
    """The (prompt messages, completion) pairs of a ``/score`` body; raises `_BadRequest` naming what is wrong."""
    try:
        payload = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise _BadRequest(f"body is not valid JSON: {error}") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("inputs"), list):
        raise _BadRequest('expected an object {"inputs": [{"prompt": [...], "completion": "..."}, ...]}')
    pairs = []
    for index, item in enumerate(payload["inputs"]):
        where = f"inputs[{index}]"
        if not isinstance(item, dict) or not isinstance(item.get("completion"), str):
            raise _BadRequest(f"{where}: expected an object with a string 'completion'")
        prompt = item.get("prompt")
        if not isinstance(prompt, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt
        ):
            raise _BadRequest(f"{where}.prompt: expected a list of {{'role': str, 'content': str}} messages")
        pairs.append(([{"role": m["role"], "content": m["content"]} for m in prompt], item["completion"]))
    return pairs


class RewardModelServer:
    """Serves a `RewardModelScorer` over HTTP. ``start()`` runs it in background threads (tests, benchmarks);
    ``serve_forever()`` blocks (the CLI). ``num_forwards`` and ``num_rejected`` count batches and 503s."""

    def __init__(
        self,
        scorer: RewardModelScorer,
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        max_batch_size: int = 32,
        max_wait_ms: float = 5.0,
        max_queue_size: int = 256,
        retry_after_s: int = 1,
    ) -> None:
        if max_batch_size < 1 or max_queue_size < 1 or max_wait_ms < 0:
            raise ValueError("reward model server: max_batch_size and max_queue_size must be >= 1, max_wait_ms >= 0")
        self.scorer = scorer
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000
        self.retry_after_s = retry_after_s
        self.num_forwards = 0
        self.num_scored = 0
        self.num_rejected = 0
        self._count_lock = threading.Lock()  # num_rejected is bumped from many handler threads
        self._queue: queue.Queue[_Request] = queue.Queue(maxsize=max_queue_size)
        self._carry: _Request | None = None  # taken from the queue but did not fit the last batch
        self._stopping = threading.Event()
        self._http = _HTTPServer((host, port), _make_handler(self))
        self.url = "http://{}:{}".format(*self._http.server_address[:2])  # the bound port when ``port`` is 0
        self._threads: list[threading.Thread] = []

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    def start(self) -> RewardModelServer:
        self._threads = [
            threading.Thread(target=self._run_batcher, daemon=True, name="rm-server-batcher"),
            # A short poll interval makes close() quick (shutdown waits for the serving loop's next poll).
            threading.Thread(target=self._http.serve_forever, args=(0.05,), daemon=True, name="rm-server-http"),
        ]
        for thread in self._threads:
            thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve until interrupted (Ctrl-C, SIGTERM raising SystemExit) or closed."""
        self.start()
        try:
            self._stopping.wait()
        finally:
            self.close()

    def close(self) -> None:
        self._stopping.set()
        if self._threads:
            self._http.shutdown()
        self._http.server_close()
        for thread in self._threads:
            thread.join(timeout=5)
        self._threads = []  # a second close() (serve_forever's, then the caller's) has nothing to stop
        # Whatever the batcher never took is answered, not left waiting forever.
        for request in [r for r in (self._carry, *self._queue.queue) if r is not None]:
            request.error = "server shut down before scoring"
            request.done.set()

    def __enter__(self) -> RewardModelServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(self, ids: list[list[int]]) -> _Request | None:
        """Queue one request's inputs for the batcher; None when the queue is full (the caller answers 503)."""
        request = _Request(ids=ids)
        if self._stopping.is_set():  # close() has answered what was queued; nothing would answer this one
            return None
        try:
            self._queue.put_nowait(request)
        except queue.Full:
            with self._count_lock:
                self.num_rejected += 1
            return None
        return request

    def _next_batch(self) -> list[_Request]:
        """The requests of the next forward: the first waiting one, then whatever arrives within ``max_wait_ms``
        while the inputs fit ``max_batch_size`` (a request bigger than that alone is split by `_run_batch`)."""
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
                request = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if num_inputs + len(request.ids) > self.max_batch_size:
                self._carry = request
                break
            batch.append(request)
            num_inputs += len(request.ids)
        return batch

    def _run_batcher(self) -> None:
        while not self._stopping.is_set():
            if batch := self._next_batch():
                self._run_batch(batch)

    def _run_batch(self, batch: list[_Request]) -> None:
        flat = [ids for request in batch for ids in request.ids]
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
        for request in batch:
            request.scores, request.error = scores[offset : offset + len(request.ids)], error
            offset += len(request.ids)
            request.done.set()


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    # The default listen backlog of 5 drops connections under a burst of clients; they then wait out a 1 s SYN
    # retransmit, which showed as a 1.3 s p99 in benchmarks/rm_server.py.
    request_queue_size = 1024


def _make_handler(server: RewardModelServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/health":
                return self._answer(404, {"error": f"unknown path {self.path!r}; use POST /score or GET /health"})
            counts = {name: getattr(server, name) for name in ("num_forwards", "num_scored", "num_rejected")}
            self._answer(200, {"status": "ok", "queue_depth": server.queue_depth, **counts})

        def do_POST(self) -> None:
            if self.path != "/score":
                return self._answer(404, {"error": f"unknown path {self.path!r}; use POST /score"})
            try:
                length = int(self.headers.get("Content-Length") or 0)
                if length > MAX_BODY_BYTES:
                    raise _BadRequest(f"a body of {length} bytes is over the limit of {MAX_BODY_BYTES}")
                encoded = [server.scorer.encode(*pair) for pair in parse_inputs(self.rfile.read(length))]
            except Exception as error:  # also a bad Content-Length, or a chat template that rejects the messages
                why = str(error) if isinstance(error, _BadRequest) else f"{type(error).__name__}: {error}"
                return self._answer(400, {"error": f"cannot read or render the inputs: {why}"})
            if any(not ids for ids, _ in encoded):
                return self._answer(400, {"error": "an input renders to no tokens"})
            truncated = [is_truncated for _, is_truncated in encoded]
            request = server.submit([ids for ids, _ in encoded])
            if request is None:
                return self._answer(503, {"error": "queue full, retry later"}, retry_after=server.retry_after_s)
            request.done.wait()  # always set: by the batcher (scores or error) or by close()
            if request.error:
                return self._answer(500, {"error": request.error})
            self._answer(200, {"scores": request.scores, "truncated": truncated, "num_truncated": sum(truncated)})

        def _answer(self, status: int, payload: dict[str, Any], *, retry_after: int | None = None) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            if retry_after is not None:
                self.send_header("Retry-After", str(retry_after))
            self.end_headers()
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the client gave up (its timeout)
                self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            # One line per request on stderr would swamp a training run's logs; keep it at debug.
            logger.debug("%s " + format, self.address_string(), *args)

    return Handler
