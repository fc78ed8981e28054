"""The reward-model server and client: scores equal a direct forward, requests are batched, a full queue answers
503 and the client's retry gets through, a dead server makes the client abstain, bad requests get a clear 400."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from sharpen.rewards import RewardFn
from sharpen.rewards.rm_client import RewardModelClient
from sharpen.rewards.rm_server import RewardModelScorer, RewardModelServer
from sharpen.types import Example, Message, RewardStatus


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


def _post(url: str, body: bytes) -> tuple[int, dict, dict]:
    request = urllib.request.Request(f"{url}/score", data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read()), dict(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), dict(error.headers)


def _score_body(*completions: str) -> bytes:
    inputs = [{"prompt": [{"role": "user", "content": "q"}], "completion": c} for c in completions]
    return json.dumps({"inputs": inputs}).encode()


def _wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def _direct_score(scorer: RewardModelScorer, ids: list[int]) -> float:
    with torch.no_grad():
        return float(scorer.model(input_ids=torch.tensor([ids])).logits[0, 0])


def test_scores_equal_a_direct_forward_of_the_model(scorer):
    pairs = [(_example("What is 2 + 2?"), "4"), (_example("Name a colour."), "Blue, or perhaps a long answer " * 5)]
    pairs.append((_example("Hi"), ""))
    with RewardModelServer(scorer, port=0, max_wait_ms=50) as server:
        client = RewardModelClient(server.url, batch_size=8)
        assert isinstance(client, RewardFn)
        results = client.score_many(pairs)
        single = client(*pairs[0])
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
    with RewardModelServer(short, port=0) as server:
        status, payload, _ = _post(server.url, _score_body("a long completion " * 20, "4"))
    assert status == 200 and payload["truncated"][0] and payload["num_truncated"] >= 1
    kept, _ = short.encode([{"role": "user", "content": "q"}], "a long completion " * 20)
    assert len(kept) == 8 and scorer.tokenizer.decode(kept).endswith("<|im_end|>\n"), "the completion's end is kept"
    assert payload["scores"][0] == pytest.approx(_direct_score(scorer, kept), abs=1e-5)


def test_concurrent_requests_share_forwards(scorer):
    gated = GatedScorer(scorer)
    num_clients = 8
    with RewardModelServer(gated, port=0, max_batch_size=32, max_wait_ms=0) as server:  # type: ignore[arg-type]
        client = RewardModelClient(server.url, max_retries=0)
        results: list = [None] * num_clients

        def score(index: int) -> None:
            results[index] = client(_example(f"question {index}"), f"answer {index}")

        threads = [threading.Thread(target=score, args=(i,)) for i in range(num_clients)]
        threads[0].start()
        assert gated.entered.wait(10)  # the first request alone holds the batcher in its forward
        for thread in threads[1:]:
            thread.start()
        _wait_until(lambda: server.queue_depth == num_clients - 1)
        gated.gate.set()
        for thread in threads:
            thread.join(10)
    assert all(r is not None and r.status == RewardStatus.OK for r in results)
    assert (server.num_forwards, server.num_scored) == (2, num_clients), "the 7 waiting requests are one forward"


def test_a_request_bigger_than_the_batch_is_split(scorer):
    with RewardModelServer(scorer, port=0, max_batch_size=4) as server:
        status, payload, _ = _post(server.url, _score_body(*(f"answer {i}" for i in range(10))))
        _, alone, _ = _post(server.url, _score_body("answer 9"))
    assert status == 200 and len(payload["scores"]) == 10
    assert server.num_forwards == 3 + 1
    assert payload["scores"][9] == pytest.approx(alone["scores"][0], abs=1e-5)


def test_full_queue_answers_503_and_the_client_retry_gets_through(scorer):
    gated = GatedScorer(scorer)
    server = RewardModelServer(gated, port=0, max_queue_size=1, retry_after_s=0)  # type: ignore[arg-type]
    with server:
        background = [threading.Thread(target=_post, args=(server.url, _score_body(f"a{i}"))) for i in range(2)]
        background[0].start()
        assert gated.entered.wait(10)  # request 0 is in the forward, request 1 fills the queue
        background[1].start()
        _wait_until(lambda: server.queue_depth == 1)

        status, payload, headers = _post(server.url, _score_body("rejected"))
        assert status == 503 and headers["Retry-After"] == "0" and "queue full" in payload["error"]

        client = RewardModelClient(server.url, max_retries=20, backoff_s=0.01)
        retried: list = []
        thread = threading.Thread(target=lambda: retried.append(client(_example("q"), "retried")))
        thread.start()
        _wait_until(lambda: server.num_rejected >= 2)  # the client's first attempt was turned away too
        gated.gate.set()
        thread.join(10)
        for request in background:
            request.join(10)
    assert retried[0].status == RewardStatus.OK and retried[0].score is not None
    assert server.num_scored == 3


def test_a_dead_server_makes_the_client_abstain():
    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = RewardModelClient(f"http://127.0.0.1:{port}", max_retries=2, backoff_s=0.01)
    results = client.score_many([(_example("q"), "a"), (_example("r"), "b")])
    assert [(r.score, r.status, r.verifier) for r in results] == [(None, RewardStatus.INFRA_ERROR, "reward_model")] * 2


def test_a_slow_server_makes_the_client_abstain_with_timeout(scorer):
    gated = GatedScorer(scorer)
    with RewardModelServer(gated, port=0) as server:  # type: ignore[arg-type]
        result = RewardModelClient(server.url, timeout_s=0.2, max_retries=0)(_example("q"), "a")
        gated.gate.set()
    assert (result.score, result.status) == (None, RewardStatus.TIMEOUT)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "not valid JSON"),
        (b'{"input": []}', 'expected an object {"inputs"'),
        (b'{"inputs": [{"prompt": [], "completion": 3}]}', "inputs[0]: expected an object with a string 'completion'"),
        (b'{"inputs": [{"prompt": [{"role": "user"}], "completion": ""}]}', "inputs[0].prompt: expected a list"),
    ],
)
def test_bad_requests_get_a_clear_400(scorer, body, message):
    with RewardModelServer(scorer, port=0) as server:
        status, payload, _ = _post(server.url, body)
        with urllib.request.urlopen(f"{server.url}/health", timeout=10) as response:
            health = json.loads(response.read())
    assert status == 400 and message in payload["error"]
    assert health["status"] == "ok" and health["num_forwards"] == 0


def test_a_client_error_is_not_retried(scorer):
    with RewardModelServer(scorer, port=0) as server:
        client = RewardModelClient(server.url.replace("127.0.0.1", "localhost") + "/nope", max_retries=5, backoff_s=5)
        started = time.monotonic()
        result = client(_example("q"), "a")
    assert (result.score, result.status) == (None, RewardStatus.INFRA_ERROR)
    assert time.monotonic() - started < 2, "a 404 is a caller's bug: no backoff, no retries"


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
