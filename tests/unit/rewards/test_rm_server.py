"""The reward-model service and client: scores equal a direct forward, requests are batched, the shell's token is
checked before a body is read, a full queue answers 503 and the client's retry gets through, a failed forward is
retried, a dead or slow server makes the client abstain, bad requests get one clear 400 and no retry."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from sharpen.config.service import ServiceConfig
from sharpen.rewards import RewardFn
from sharpen.rewards.rm_client import RewardModelClient
from sharpen.rewards.rm_server import RewardModelScorer, RewardModelService
from sharpen.types import Example, Message, RewardStatus

TOKEN = "rm-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(autouse=True)
def token_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARPEN_SERVICE_TOKEN", TOKEN)


@pytest.fixture(scope="module")
def scorer(tiny_reward_model_path: Path) -> RewardModelScorer:
    return RewardModelScorer.from_pretrained(tiny_reward_model_path, max_length=256, device="cpu")


class GatedScorer:
    """Wraps a scorer so a test can hold the batcher inside a forward (``entered`` set, waits for ``gate``)."""

    def __init__(self, inner: RewardModelScorer) -> None:
        self.inner = inner
        self.entered = threading.Event()
        self.gate = threading.Event()

    def encode(self, prompt, completion):
        return self.inner.encode(prompt, completion)

    def score(self, batch):
        self.entered.set()
        assert self.gate.wait(10), "test never opened the gate"
        return self.inner.score(batch)


def _example(question: str) -> Example:
    return Example(task_key=question, prompt=(Message(role="user", content=question),))


def _service(scorer: Any, **options: Any) -> RewardModelService:
    """A service on a free loopback port; ``options`` are its own keywords or `ServiceConfig` fields."""
    config = {k: options.pop(k) for k in list(options) if k in ServiceConfig.model_fields}
    return RewardModelService(scorer, service=ServiceConfig(**config), token=TOKEN, **options)


def _post(url: str, body: bytes, **headers: str) -> tuple[int, dict, httpx.Headers]:
    response = httpx.post(f"{url}/score", content=body, headers={**AUTH, **headers}, timeout=10)
    return response.status_code, response.json(), response.headers


def _score_body(*completions: str) -> bytes:
    inputs = [{"prompt": [{"role": "user", "content": "q"}], "completion": c} for c in completions]
    return json.dumps({"inputs": inputs}).encode()


def _wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def _read_answer(connection: socket.socket) -> str:
    """One HTTP answer read off a raw socket: the head, then as many body bytes as its Content-Length says."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += connection.recv(4096)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))[15:])
    while len(body) < length:
        body += connection.recv(4096)
    return (head + b"\r\n\r\n" + body).decode()


def _direct_score(scorer: RewardModelScorer, ids: list[int]) -> float:
    with torch.no_grad():
        return float(scorer.model(input_ids=torch.tensor([ids])).logits[0, 0])


class FlakyScorer:
    """A scorer whose first ``num_failures`` forwards raise (an out-of-memory, say)."""

    def __init__(self, inner: RewardModelScorer, *, num_failures: int) -> None:
        self.inner = inner
        self.num_failures = num_failures

    def encode(self, prompt, completion):
        return self.inner.encode(prompt, completion)

    def score(self, batch):
        if self.num_failures > 0:
            self.num_failures -= 1
            raise RuntimeError("CUDA out of memory")
        return self.inner.score(batch)


def test_scores_equal_a_direct_forward_of_the_model(scorer):
    pairs = [(_example("What is 2 + 2?"), "4"), (_example("Name a colour."), "Blue, or perhaps a long answer " * 5)]
    pairs.append((_example("Hi"), ""))
    with _service(scorer, max_wait_ms=50) as server:
        client = RewardModelClient(server.url, batch_size=8)
        assert isinstance(client, RewardFn)
        results = client.score_many(pairs)
        single = client(*pairs[0])
        client.close()
    assert server.num_forwards == 2, "three pairs in one request are one padded forward (plus the single call)"
    for (example, completion), result in zip(pairs, results, strict=True):
        prompt = [{"role": m.role, "content": m.content} for m in example.prompt]
        ids, is_truncated = scorer.encode(prompt, completion)
        assert not is_truncated
        assert result.status == RewardStatus.OK and result.verifier == "reward_model"
        assert result.score == pytest.approx(_direct_score(scorer, ids), abs=1e-5)
    assert single.score == pytest.approx(results[0].score, abs=1e-5)


def test_renders_the_chat_template_and_truncates_from_the_left(scorer):
    prompt = [{"role": "user", "content": "What is 2 + 2?"}]
    ids, is_truncated = scorer.encode(prompt, "4")
    expected = scorer.tokenizer.apply_chat_template([*prompt, {"role": "assistant", "content": "4"}], tokenize=False)
    assert scorer.tokenizer.decode(ids) == expected and not is_truncated
    short = RewardModelScorer(model=scorer.model, tokenizer=scorer.tokenizer, max_length=8)
    with _service(short) as server:
        status, payload, _ = _post(server.url, _score_body("a long completion " * 20, "4"))
    assert status == 200 and payload["truncated"] == [True, True] and payload["num_truncated"] == 2  # a system turn
    kept, _ = short.encode([{"role": "user", "content": "q"}], "a long completion " * 20)
    assert len(kept) == 8 and scorer.tokenizer.decode(kept).endswith("<|im_end|>\n"), "the completion's end is kept"
    assert payload["scores"][0] == pytest.approx(_direct_score(scorer, kept), abs=1e-5)


def test_the_service_has_the_shells_token_probes_metrics_and_idempotency(scorer):
    with _service(scorer) as server:
        assert httpx.get(server.url + "/healthz").json() == {"status": "alive"}
        assert httpx.get(server.url + "/readyz").json() == {"ready": True}
        assert httpx.post(server.url + "/score", content=_score_body("a")).status_code == 401
        wrong = httpx.post(server.url + "/score", content=_score_body("a"), headers={"Authorization": "Bearer no"})
        assert wrong.status_code == 401
        first = _post(server.url, _score_body("a", "b"), **{"Idempotency-Key": "k1"})
        again = _post(server.url, _score_body("a", "b"), **{"Idempotency-Key": "k1"})
        metrics = httpx.get(server.url + "/metrics").text
    assert first[0] == again[0] == 200 and again[1] == first[1]
    assert (server.num_forwards, server.num_scored) == (1, 2), "the repeated key got the first answer, not a forward"
    for line in ("sharpen_rm_forwards 1", "sharpen_rm_inputs_scored 2", "sharpen_requests_unauthorized_total 2"):
        assert line in metrics.splitlines()


def test_a_request_without_the_token_is_refused_before_its_body_is_read(scorer):
    """The headers promise a megabyte that never comes: a server that read the body first would never answer."""
    with _service(scorer) as server:
        host, port = server.url.removeprefix("http://").split(":")
        for authorization in ("", "Authorization: Bearer wrong\r\n"):
            with socket.create_connection((host, int(port)), timeout=5) as connection:
                head = f"POST /score HTTP/1.1\r\nHost: x\r\n{authorization}Content-Length: 1000000\r\n\r\n"
                connection.sendall(head.encode())
                answer = _read_answer(connection)
            assert answer.startswith("HTTP/1.1 401 "), answer
            assert answer.endswith('{"error": "missing or wrong bearer token"}')
        assert server.shell.counts["unauthorized"] == 2 and server.num_scored == 0


def test_the_service_requires_a_token_and_caps_the_inputs_of_a_request(scorer):
    with pytest.raises(ValueError, match="non-empty shared-secret token"):
        RewardModelService(scorer, service=ServiceConfig(), token="")
    with _service(scorer, max_items_per_request=2) as server:
        status, payload, _ = _post(server.url, _score_body("a", "b", "c"))
        fits = _post(server.url, _score_body("a", "b"))
    assert (status, payload) == (413, {"error": "3 inputs are over the limit of 2 per request"})
    assert fits[0] == 200 and server.num_scored == 2, "the refused batch never reached the model"


def test_concurrent_requests_share_forwards(scorer):
    gated = GatedScorer(scorer)
    num_clients = 8
    with _service(gated, max_batch_size=32, max_wait_ms=0) as server:
        client = RewardModelClient(server.url, max_retries=0)
        results: list = [None] * num_clients

        def score(index: int) -> None:
            results[index] = client(_example(f"question {index}"), f"answer {index}")

        threads = [threading.Thread(target=score, args=(i,)) for i in range(num_clients)]
        threads[0].start()
        assert gated.entered.wait(10)  # the first request alone holds the batcher in its forward
        for thread in threads[1:]:
            thread.start()
        _wait_until(lambda: server.num_waiting == num_clients - 1)
        gated.gate.set()
        for thread in threads:
            thread.join(10)
        client.close()
    assert all(r is not None and r.status == RewardStatus.OK for r in results)
    assert (server.num_forwards, server.num_scored) == (2, num_clients), "the 7 waiting requests are one forward"


def test_a_request_bigger_than_the_batch_is_split(scorer):
    with _service(scorer, max_batch_size=4) as server:
        status, payload, _ = _post(server.url, _score_body(*(f"answer {i}" for i in range(10))))
        _, alone, _ = _post(server.url, _score_body("answer 9"))
    assert status == 200 and len(payload["scores"]) == 10
    assert server.num_forwards == 3 + 1
    assert payload["scores"][9] == pytest.approx(alone["scores"][0], abs=1e-5)


def test_full_queue_answers_503_and_the_client_retry_gets_through(scorer):
    gated = GatedScorer(scorer)
    # max_batch_size 1: two requests with the batcher (one in the forward, one waiting), one in the shell's queue.
    with _service(gated, max_batch_size=1, max_queue_size=1, retry_after_s=0) as server:
        background = [threading.Thread(target=_post, args=(server.url, _score_body(f"a{i}"))) for i in range(3)]
        background[0].start()
        assert gated.entered.wait(10)
        background[1].start()
        _wait_until(lambda: server.num_waiting == 1)
        background[2].start()
        _wait_until(lambda: server.shell.queue_depth == 1)

        status, payload, headers = _post(server.url, _score_body("rejected"))
        assert status == 503 and headers["Retry-After"] == "0" and "the queue is full" in payload["error"]
        assert httpx.get(server.url + "/readyz").status_code == 503

        client = RewardModelClient(server.url, max_retries=20, backoff_s=0.01)
        retried: list = []
        thread = threading.Thread(target=lambda: retried.append(client(_example("q"), "retried")))
        thread.start()
        _wait_until(lambda: server.shell.counts["rejected"] >= 2)  # the client's first attempt was turned away too
        gated.gate.set()
        thread.join(10)
        for request in background:
            request.join(10)
        client.close()
    assert retried[0].status == RewardStatus.OK and retried[0].score is not None
    assert server.num_scored == 4


def test_a_failed_forward_answers_503_and_the_retry_scores(scorer):
    flaky = FlakyScorer(scorer, num_failures=1)
    with _service(flaky) as server:
        status, payload, _ = _post(server.url, _score_body("a"))
        client = RewardModelClient(server.url, max_retries=1, backoff_s=0.0)
        flaky.num_failures = 1
        result = client(_example("q"), "a")
        client.close()
    assert status == 503 and payload == {"error": "forward failed: RuntimeError: CUDA out of memory"}
    assert result.status == RewardStatus.OK and (server.num_forwards, server.num_scored) == (1, 1)


def test_a_dead_server_makes_the_client_abstain():
    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = RewardModelClient(f"http://127.0.0.1:{port}", max_retries=2, backoff_s=0.01)
    results = client.score_many([(_example("q"), "a"), (_example("r"), "b")])
    assert [(r.score, r.status, r.verifier) for r in results] == [(None, RewardStatus.INFRA_ERROR, "reward_model")] * 2


def test_a_slow_server_makes_the_client_abstain_with_timeout(scorer):
    gated = GatedScorer(scorer)
    with _service(gated) as server:
        result = RewardModelClient(server.url, timeout_s=0.2, max_retries=0)(_example("q"), "a")
        gated.gate.set()
    assert (result.score, result.status) == (None, RewardStatus.TIMEOUT)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "the body is not JSON"),
        (b'{"input": []}', 'expected an object {"inputs"'),
        (b'{"inputs": [{"prompt": [], "completion": 3}]}', "inputs[0]: expected an object with a string 'completion'"),
        (b'{"inputs": [{"prompt": [{"role": "user"}], "completion": ""}]}', "inputs[0].prompt: expected a list"),
    ],
)
def test_bad_requests_get_a_clear_400(scorer, body, message):
    with _service(scorer) as server:
        status, payload, _ = _post(server.url, body)
        metrics = httpx.get(server.url + "/metrics").text.splitlines()
    assert status == 400 and message in payload["error"]
    assert "sharpen_rm_forwards 0" in metrics


def test_a_client_error_is_one_clear_warning_and_no_retry(scorer, caplog):
    with _service(scorer) as server:
        client = RewardModelClient(server.url + "/nope", max_retries=5, backoff_s=5)
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="sharpen.rewards.rm_client"):
            result = client(_example("q"), "a")
        client.close()
    assert (result.score, result.status) == (None, RewardStatus.INFRA_ERROR)
    assert time.monotonic() - started < 2, "a 404 is a caller's bug: no backoff, no retries"
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning == (
        f"reward model replica {server.url}/nope: HTTP 404: no route POST /nope/score; 1 rollouts abstain"
    )


def test_the_client_needs_the_token_and_a_wrong_one_is_not_retried(scorer, monkeypatch):
    monkeypatch.delenv("SHARPEN_SERVICE_TOKEN")
    with pytest.raises(ValueError, match="SHARPEN_SERVICE_TOKEN"):
        RewardModelClient("http://127.0.0.1:1")
    monkeypatch.setenv("SHARPEN_SERVICE_TOKEN", "wrong")
    with _service(scorer) as server:
        client = RewardModelClient(server.url, max_retries=3)
        result = client(_example("q"), "a")
        client.close()
    assert (result.score, result.status) == (None, RewardStatus.INFRA_ERROR)
    assert server.shell.counts["unauthorized"] == 1


def test_the_reward_model_must_have_one_label(scorer):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    config = LlamaConfig(
        vocab_size=64, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, num_labels=2
    )
    with pytest.raises(ValueError, match="num_labels=1"):
        RewardModelScorer(model=LlamaForSequenceClassification(config), tokenizer=scorer.tokenizer, max_length=8)


def test_serve_rm_with_a_missing_model_is_a_user_error(capsys):
    from sharpen.cli.main import EXIT_USER_ERROR, main

    assert main(["serve-rm", "/nonexistent/reward-model", "--port", "0"]) == EXIT_USER_ERROR
    assert (
        capsys.readouterr().err.strip() == "sharpen: serve-rm: model path '/nonexistent/reward-model' is not a folder"
    )


def test_serve_rm_refuses_to_start_without_a_token(tiny_reward_model_path, monkeypatch, capsys):
    from sharpen.cli.main import EXIT_USER_ERROR, main

    monkeypatch.delenv("SHARPEN_SERVICE_TOKEN")
    assert main(["serve-rm", str(tiny_reward_model_path), "--port", "0"]) == EXIT_USER_ERROR
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("sharpen: the service refuses to start without a token") and "SHARPEN_SERVICE_TOKEN" in line
