"""Engine servers given bad input: one clear `EngineError` naming the engine, the URL and the cause, never a hang.
No inference engine runs here: the servers are tiny stand-ins (nothing listening, the wrong kind of server, one that
accepts and never answers, one that exits while starting)."""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from sharpen.config.engines import VllmServerEngineConfig
from sharpen.rollout.engines import EngineError, EngineUnavailable
from sharpen.rollout.engines.server import EventLoopThread, JsonClient, ServerProcess, free_port
from sharpen.rollout.engines.vllm_server import VllmServerEngine


def _engine(url: str | None = None, **fields) -> VllmServerEngine:
    config = VllmServerEngineConfig(url=url, **fields)
    return VllmServerEngine(config, model_path=Path("/models/m"), dtype="float32", seed=0, request_timeout_s=1.0)


class _NotVllm(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"<html>hello</html>" if self.path == "/" else b"<html>not found</html>"
        self.send_response({"/": 200, "/crash": 500}.get(self.path, 404))
        self.send_header("content-type", "text/html")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:
        pass


@pytest.fixture
def web_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NotVllm)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture
def mute_server() -> Iterator[str]:
    """Accepts connections and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join()
    for connection in held:
        connection.close()
    listener.close()


def test_an_unreachable_url_is_one_clear_error() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EngineError, match=rf"vllm_server engine at {url}: cannot connect .*is the server running"):
        _engine(url)


def test_a_server_of_another_kind_is_named_as_such(web_server: str) -> None:
    with pytest.raises(EngineError, match=rf"{web_server} is not a vLLM server .*HTTP 404"):
        _engine(web_server)


def test_a_server_that_stops_answering_times_out_with_a_message(mute_server: str) -> None:
    started = time.monotonic()
    with pytest.raises(EngineError, match=r"did not answer within 1 s"):
        _engine(mute_server)
    assert time.monotonic() - started < 10


def test_a_port_in_use_is_refused_before_anything_starts(web_server: str) -> None:
    port = int(web_server.rsplit(":", 1)[1])
    with pytest.raises(EngineError, match=rf"port {port} on 127.0.0.1 is already in use"):
        _engine(None, port=port)


def test_a_server_that_exits_while_starting_shows_its_log(tmp_path: Path) -> None:
    script = "import sys; print('boom: no such model'); sys.exit(3)"
    process = ServerProcess(
        [sys.executable, "-c", script], name="test server", port=free_port(), log_path=tmp_path / "server.log"
    )
    with pytest.raises(EngineError, match=r"(?s)exited with code 3 while starting .*boom: no such model"):
        process.wait_ready("http://127.0.0.1:9/health", startup_timeout_s=30, poll_s=0.05)
    process.close()


def test_a_server_that_never_becomes_ready_is_stopped(tmp_path: Path) -> None:
    process = ServerProcess(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        name="test server",
        port=free_port(),
        log_path=tmp_path / "server.log",
    )
    with pytest.raises(EngineError, match=r"did not become ready .* within 0.5 s"):
        process.wait_ready(f"http://127.0.0.1:{free_port()}/health", startup_timeout_s=0.5, poll_s=0.05)
    assert not process.is_running


def test_a_reply_that_is_not_json_is_named(web_server: str) -> None:
    loop = EventLoopThread()
    client = JsonClient(web_server, name="test engine", timeout_s=5)
    with pytest.raises(EngineError, match=r"test engine: .* did not return JSON .*hello"):
        loop.run(client.get("/"))
    loop.run(client.aclose())
    loop.close()


def test_a_failing_server_is_told_apart_from_a_refused_request(web_server: str, mute_server: str) -> None:
    """The router sends a request elsewhere when its server is down, stuck or failing (`EngineUnavailable`: no
    connection, no answer in time, HTTP 5xx), never when the server refused the request itself (HTTP 4xx)."""
    loop = EventLoopThread()
    clients = [JsonClient(url, name="test engine", timeout_s=0.5) for url in (web_server, mute_server)]
    unreachable = JsonClient(f"http://127.0.0.1:{free_port()}", name="test engine", timeout_s=0.5)
    try:
        with pytest.raises(EngineError, match="HTTP 404") as refused:
            loop.run(clients[0].get("/missing"))
        assert not isinstance(refused.value, EngineUnavailable)
        with pytest.raises(EngineUnavailable, match="HTTP 500"):
            loop.run(clients[0].get("/crash"))
        with pytest.raises(EngineUnavailable, match=r"did not answer within 0\.5 s"):
            loop.run(clients[1].get("/"))
        with pytest.raises(EngineUnavailable, match="cannot connect"):
            loop.run(unreachable.get("/"))
    finally:
        for client in (*clients, unreachable):
            loop.run(client.aclose())
        loop.close()
