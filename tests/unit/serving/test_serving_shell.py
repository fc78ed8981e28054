"""The service shell and the replica client, with trivial routes: the token, the limits, the bounded queue, the
probes, idempotency, and the client's spreading and retries (nothing of a sandbox or an environment here)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from sharpen.config.service import RemoteConfig, ServiceConfig
from sharpen.serving import (
    ReplicaClient,
    ReplicaLost,
    Request,
    Route,
    ServiceError,
    ServiceRequestError,
    ServiceShell,
    ServiceUnavailable,
    read_token,
)

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Work:
    """Routes that count how often each request ran; ``gate`` holds the work until the test opens it."""

    def __init__(self) -> None:
        self.runs: Counter[str] = Counter()
        self.gate = threading.Event()
        self.gate.set()
        self.lock = threading.Lock()

    def work(self, request: Request) -> dict[str, Any]:
        self.gate.wait(10)
        with self.lock:
            self.runs[request.body["id"]] += 1
        return {"id": request.body["id"], "n": self.runs[request.body["id"]]}

    def item(self, request: Request) -> dict[str, Any]:
        if request.params[0] != "known":
            raise ServiceError(404, "no such item")
        return {"item": request.params[0]}


def _shell(work: Work, **config: Any) -> ServiceShell:
    routes = [
        Route(method="POST", pattern="/v1/work", handler=work.work, is_queued=True, is_idempotent=True),
        Route(method="GET", pattern="/v1/items/{}", handler=work.item),
    ]
    return ServiceShell(ServiceConfig(**config), routes=routes, token=TOKEN, max_running=1).start()


@pytest.fixture
def work() -> Work:
    return Work()


@pytest.fixture
def shell(work: Work) -> Iterator[ServiceShell]:
    server = _shell(work, max_queue_size=1, max_body_mb=0.001)
    yield server
    work.gate.set()
    server.close()


@pytest.fixture
def token_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARPEN_SERVICE_TOKEN", TOKEN)


def test_probes_need_no_token_and_every_other_route_needs_the_right_one(shell: ServiceShell) -> None:
    assert httpx.get(shell.url + "/healthz").status_code == 200
    assert httpx.get(shell.url + "/readyz").json() == {"ready": True}
    assert "sharpen_queue_depth 0" in httpx.get(shell.url + "/metrics").text
    assert httpx.post(shell.url + "/v1/work", json={"id": "a"}).status_code == 401
    wrong = httpx.post(shell.url + "/v1/work", json={"id": "a"}, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    assert httpx.get(shell.url + "/v1/items/known", headers={"Authorization": TOKEN}).status_code == 401
    assert httpx.post(shell.url + "/v1/work", json={"id": "a"}, headers=AUTH).json() == {"id": "a", "n": 1}
    assert httpx.get(shell.url + "/v1/items/known", headers=AUTH).json() == {"item": "known"}
    assert httpx.get(shell.url + "/v1/items/other", headers=AUTH).status_code == 404
    assert httpx.get(shell.url + "/v1/nothing", headers=AUTH).status_code == 404


def test_an_oversize_or_malformed_body_is_refused(token_env: None, shell: ServiceShell) -> None:
    big = httpx.post(shell.url + "/v1/work", json={"id": "x" * 2000}, headers=AUTH)
    assert big.status_code == 413
    assert "over the limit" in big.json()["error"]
    bad = httpx.post(shell.url + "/v1/work", content=b"{not json", headers=AUTH)
    assert bad.status_code == 400
    client = ReplicaClient(RemoteConfig(urls=[shell.url], max_retries=0), what="test")
    try:
        for size in (3000, 300_000):  # the client learns why (413), not a dropped call, while it still sends
            with pytest.raises(ServiceRequestError, match="413"):
                client.call("POST", "/v1/work", {"id": "x" * size})
    finally:
        client.close()


def test_a_full_queue_answers_503_and_readiness_follows(shell: ServiceShell, work: Work) -> None:
    work.gate.clear()
    with ExitStack() as stack:
        pool = stack.enter_context(httpx.Client(headers=AUTH, timeout=10))
        held = [
            threading.Thread(target=pool.post, args=(shell.url + "/v1/work",), kwargs={"json": {"id": i}}) for i in "ab"
        ]
        for thread in held:  # one runs, one waits in the queue of one
            thread.start()
        _wait_for(lambda: shell.queue_depth == 1)
        refused = pool.post(shell.url + "/v1/work", json={"id": "c"})
        assert refused.status_code == 503
        assert refused.headers["Retry-After"] == "1"
        assert httpx.get(shell.url + "/readyz").status_code == 503
        assert "sharpen_queue_depth 1" in httpx.get(shell.url + "/metrics").text
        work.gate.set()
        for thread in held:
            thread.join()
    assert httpx.get(shell.url + "/readyz").status_code == 200
    assert work.runs == Counter({"a": 1, "b": 1})


def test_a_repeated_idempotency_key_gets_the_first_answer_even_while_it_runs(shell: ServiceShell, work: Work) -> None:
    work.gate.clear()
    headers = {**AUTH, "Idempotency-Key": "k1"}
    answers: list[httpx.Response] = []
    first = threading.Thread(
        target=lambda: answers.append(httpx.post(shell.url + "/v1/work", json={"id": "a"}, headers=headers))
    )
    first.start()
    _wait_for(
        lambda: (
            shell.max_running == 1
            and work.runs["a"] == 0
            and "sharpen_requests_running 1" in httpx.get(shell.url + "/metrics").text
        )
    )
    second = threading.Thread(
        target=lambda: answers.append(httpx.post(shell.url + "/v1/work", json={"id": "a"}, headers=headers))
    )
    second.start()
    time.sleep(0.2)
    work.gate.set()
    first.join()
    second.join()
    assert [a.json() for a in answers] == [{"id": "a", "n": 1}] * 2
    again = httpx.post(shell.url + "/v1/work", json={"id": "a"}, headers=headers)
    assert again.json() == {"id": "a", "n": 1}
    assert work.runs["a"] == 1
    conflict = httpx.post(shell.url + "/v1/work", json={"id": "b"}, headers=headers)
    assert conflict.status_code == 409


def test_the_token_is_required(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SHARPEN_SERVICE_TOKEN", raising=False)
    with pytest.raises(ValueError, match="SHARPEN_SERVICE_TOKEN"):
        read_token("SHARPEN_SERVICE_TOKEN")
    with pytest.raises(ValueError, match="token"):
        ServiceShell(ServiceConfig(), routes=[], token="", max_running=1)
    with pytest.raises(ValueError, match="SHARPEN_SERVICE_TOKEN"):
        ReplicaClient(RemoteConfig(urls=["http://127.0.0.1:1"]), what="test")


def test_the_client_spreads_calls_and_moves_off_dead_and_full_replicas(token_env: None) -> None:
    works = [Work(), Work()]
    shells = [_shell(w, max_queue_size=0) for w in works]
    dead = "http://127.0.0.1:9"  # discard port: refused
    config = RemoteConfig(urls=[dead, *(s.url for s in shells)], backoff_s=0.05, max_retries=8)
    client = ReplicaClient(config, what="test")
    try:
        for i in range(10):
            url, answer = client.call("POST", "/v1/work", {"id": str(i)})
            assert url != dead and answer == {"id": str(i), "n": 1}
        assert all(sum(w.runs.values()) >= 3 for w in works), "calls are spread over the live replicas"
        works[0].gate.clear()  # replica 0 busy with one call, its queue of 0 full: the next goes to replica 1
        busy = threading.Thread(target=client.call, args=("POST", "/v1/work", {"id": "slow"}))
        busy.start()
        _wait_for(
            lambda: (
                works[0].runs["slow"] == 0
                and "sharpen_requests_running 1" in httpx.get(shells[0].url + "/metrics").text
            )
        )
        for i in range(4):
            url, _ = client.call("POST", "/v1/work", {"id": f"b{i}"}, key=f"b{i}")
            assert url == shells[1].url
        works[0].gate.set()
        busy.join()
        assert sum(works[0].runs[f"b{i}"] + works[1].runs[f"b{i}"] for i in range(4)) == 4
    finally:
        client.close()
        for s, w in zip(shells, works, strict=True):
            w.gate.set()
            s.close()


def test_the_client_names_what_is_not_load(
    token_env: None, shell: ServiceShell, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = ReplicaClient(RemoteConfig(urls=[shell.url], max_retries=1, backoff_s=0.0), what="test")
    try:
        with pytest.raises(ReplicaLost, match="404"):
            client.call("GET", "/v1/items/gone", pin=shell.url)
        with pytest.raises(ServiceRequestError, match="409"):
            client.call("POST", "/v1/work", {"id": "x"}, key="same")
            client.call("POST", "/v1/work", {"id": "y"}, key="same")
    finally:
        client.close()
    monkeypatch.setenv("SHARPEN_SERVICE_TOKEN", "wrong")
    client = ReplicaClient(RemoteConfig(urls=[shell.url]), what="test")
    try:
        with pytest.raises(ServiceRequestError, match="SHARPEN_SERVICE_TOKEN"):
            client.call("GET", "/v1/items/known")
    finally:
        client.close()
    unreachable = ReplicaClient(RemoteConfig(urls=["http://127.0.0.1:9"], max_retries=2, backoff_s=0.0), what="test")
    with pytest.raises(ServiceUnavailable, match="after 3 attempts"):
        unreachable.call("GET", "/v1/items/known")
    unreachable.close()


class Script:
    """A route that answers the scripted statuses in turn (then 200), counting its runs."""

    def __init__(self, *statuses: int) -> None:
        self.statuses = list(statuses)
        self.num_runs = 0

    def handle(self, request: Request) -> dict[str, Any]:
        self.num_runs += 1
        if self.statuses:
            status = self.statuses.pop(0)
            raise ServiceError(status, f"scripted {status}", retry_after=0 if status in (429, 503) else None)
        return {"ok": True}


def test_the_client_retries_transient_answers_and_gives_up_on_a_4xx_with_one_error(token_env: None) -> None:
    script = Script()
    route = Route(method="POST", pattern="/v1/script", handler=script.handle)
    shell = ServiceShell(ServiceConfig(), routes=[route], token=TOKEN, max_running=1).start()
    client = ReplicaClient(RemoteConfig(urls=[shell.url], max_retries=6, backoff_s=0.0), what="test")
    try:
        script.statuses = [408, 429, 503, 500, 502, 504]  # with a key, each may be asked again
        assert client.call("POST", "/v1/script", {}, key="k1") == (shell.url, {"ok": True})
        assert script.num_runs == 7
        script.statuses, script.num_runs = [503, 500], 0  # without a key, a call that may have run is not repeated
        with pytest.raises(ServiceUnavailable, match="HTTP 500: scripted 500") as failed:
            client.call("POST", "/v1/script", {})
        assert script.num_runs == 2 and not failed.value.is_timeout
        script.statuses, script.num_runs = [504] * 7, 0
        with pytest.raises(ServiceUnavailable, match=r"after 7 attempts: .*HTTP 504") as failed:
            client.call("POST", "/v1/script", {}, key="k2")
        assert script.num_runs == 7 and failed.value.is_timeout
        script.statuses, script.num_runs = [422], 0
        with pytest.raises(ServiceRequestError) as refused:
            client.call("POST", "/v1/script", {}, key="k3")
        assert script.num_runs == 1 and str(refused.value) == f"test replica {shell.url}: HTTP 422: scripted 422"
    finally:
        client.close()
        shell.close()


def test_a_slow_replica_is_asked_again_with_the_same_key_and_runs_once(
    token_env: None, shell: ServiceShell, work: Work
) -> None:
    work.gate.clear()
    threading.Timer(1.0, work.gate.set).start()
    client = ReplicaClient(RemoteConfig(urls=[shell.url], timeout_s=0.3, max_retries=10), what="test")
    try:
        _, answer = client.call("POST", "/v1/work", {"id": "slow"}, key="slow-key")
    finally:
        client.close()
    assert answer == {"id": "slow", "n": 1}
    assert work.runs["slow"] == 1


def _wait_for(condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_a_kept_alive_call_does_not_wait_for_a_delayed_ack(token_env: None, shell: ServiceShell) -> None:
    """With Nagle's algorithm on, every answer's body waited ~40 ms for the client's delayed ACK of its headers (a
    relayed session makes dozens of calls); without it a loopback call takes well under a millisecond."""
    client = ReplicaClient(RemoteConfig(urls=[shell.url]), what="test")
    try:
        durations = []
        for _ in range(20):
            started = time.perf_counter()
            client.call("GET", "/v1/items/known", pin=shell.url)
            durations.append(time.perf_counter() - started)
    finally:
        client.close()
    assert sorted(durations)[10] < 0.02
