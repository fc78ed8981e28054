"""The agent endpoint: an HTTP server on loopback, in front of the run's engine, for agents that call the model
themselves (`AgentEnvironment`), speaking the APIs agents are written against.

Owns HTTP: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/messages`` (Anthropic's Messages API,
`sharpen.rollout.agent_messages`), ``POST /v1/responses`` (OpenAI's Responses API, `sharpen.rollout.agent_responses`)
and ``GET /v1/models``, routed by the API key (``Authorization: Bearer <key>``, or ``x-api-key`` as Anthropic's
clients send it) to the episode that owns it (`AgentSession`, which does the tokens: every chat-shaped API is served
by its one chat path). It runs in the episode loop's event loop (asyncio streams and h11, no web framework), so an
agent's call costs a loopback round trip and JSON, and its request joins the other episodes' requests to the engine.
Errors are in the route's API's own shape (OpenAI's ``{"error": {"message", "type", "code"}}``, Anthropic's
``{"type": "error", "error": {"type", "message"}}``) naming the cause: no or an unknown key (401), an episode that
has ended (410), a malformed request (400), the episode's limits (400, code ``episode_limit``), the engine failing
(503). Each carries ``x-should-retry: false``, which both the ``openai`` and the ``anthropic`` client obey, so neither
resends a call the endpoint has refused. A ``stream = true`` request gets its whole answer as the API's server-sent
events once it is generated: agent frameworks that always stream work, though nothing arrives token by token.

A request's head is checked before its body is used (`AgentEndpoint._admit`): one body framing (Transfer-Encoding
beside Content-Length is refused and the connection closed), and the episode's key, so the body of a call without a
valid key is read and dropped, never kept. A connection that starts no request for ``idle_timeout_s``, or whose
request has not all arrived ``read_timeout_s`` after its first bytes, is closed; past ``max_connections`` a new one
gets 503 (tests/unit/rollout/test_agent_endpoint_redteam.py attacks each from raw sockets).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import secrets
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import h11
import httpx

from sharpen.rollout.agent_messages import answer_message, message_error, message_events
from sharpen.rollout.agent_responses import answer_response, response_events
from sharpen.rollout.agent_session import AgentSession, RequestError

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 << 20
"""Largest request body served (a long conversation is a few MB)."""
IDLE_TIMEOUT_S = 300.0
"""A connection that starts no request for this long is closed (an agent's client opens a new one when it needs
it); long enough for a slow tool call between two model calls."""
READ_TIMEOUT_S = 60.0
"""A request whose head and body have not all arrived this long after its first bytes is dropped with its connection:
a half-sent request does not hold a connection forever."""
MAX_CONNECTIONS = 4096
"""Connections open at once; one more is answered 503 and closed (each episode's agent holds one or two)."""


class AgentEndpoint:
    """The agent server of one episode-loop run. Start it with ``async with``; `open` registers an episode's session
    under a fresh key, `close` ends it (later calls with its key get 410)."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        model_name: str = "sharpen-policy",
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        read_timeout_s: float = READ_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.host = host
        self.port = port
        self.model_name = model_name
        self.idle_timeout_s = idle_timeout_s
        self.read_timeout_s = read_timeout_s
        self.max_connections = max_connections
        self._sessions: dict[str, AgentSession] = {}
        self._ended: set[str] = set()
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task[None], asyncio.StreamWriter] = {}

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    async def __aenter__(self) -> AgentEndpoint:
        try:
            self._server = await asyncio.start_server(self._serve_connection, self.host, self.port)
        except OSError as error:
            raise RuntimeError(f"agent endpoint: cannot listen on {self.host}:{self.port} ({error.strerror})") from None
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def http_client(self) -> httpx.AsyncClient:
        """An HTTP client for one episode's agent (`AgentClient.openai_client`): its own small connection pool (a
        pool shared by every episode costs each request a scan of all connections), set up in microseconds (with
        a TLS context of its own it takes tens of ms). No timeout: the episode's limits bound a call."""
        return httpx.AsyncClient(verify=_tls_context(), timeout=None)

    async def __aexit__(self, *exc_info: object) -> None:
        if self._server is not None:
            self._server.close()
            # agents' clients keep idle connections open: closing them ends each connection's read with EOF
            for writer in list(self._connections.values()):
                writer.close()
            if self._connections:
                await asyncio.wait(list(self._connections), timeout=5.0)
            for task in list(self._connections):
                task.cancel()
            self._server = None

    def open(self, session: AgentSession) -> str:
        """Register ``session``; returns its API key."""
        key = f"sk-sharpen-{secrets.token_urlsafe(18)}"
        self._sessions[key] = session
        return key

    def close(self, key: str) -> None:
        session = self._sessions.pop(key, None)
        if session is not None:
            session.is_closed = True
            self._ended.add(key)

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self._connections) >= self.max_connections:
            with contextlib.suppress(Exception):
                writer.write(_FULL)
                writer.close()
            return
        self._connections[task] = writer
        connection = h11.Connection(h11.SERVER)
        try:
            while True:
                try:
                    request, body = await _read_request(
                        connection, reader, self._admit, idle_s=self.idle_timeout_s, read_s=self.read_timeout_s
                    )
                except _Refused as refused:  # its body was dropped unread: answered, and the connection closed
                    await _send(connection, writer, refused.error.status, refused.refuse(refused.error))
                    break
                if request is None:
                    break
                status, payload = await self._dispatch(request, body)
                await _send(connection, writer, status, payload)
                if connection.our_state is h11.MUST_CLOSE or connection.their_state is h11.MUST_CLOSE:
                    break
                connection.start_next_cycle()
        except (h11.RemoteProtocolError, _BodyTooLarge) as error:
            status = 413 if isinstance(error, _BodyTooLarge) else 400
            with contextlib.suppress(Exception):
                bad = RequestError(f"bad HTTP request: {error}", status=status)
                await _send(connection, writer, status, _error(bad))
        except (ConnectionError, asyncio.IncompleteReadError, h11.LocalProtocolError, TimeoutError):
            pass  # the client left, or took longer than the timeouts allow: its connection is closed
        finally:
            self._connections.pop(task, None)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _dispatch(self, request: h11.Request, body: bytes) -> tuple[int, dict[str, Any] | bytes]:
        method, path = request.method.decode(), request.target.decode().split("?", 1)[0].rstrip("/")
        route = _ROUTES.get(path)
        refuse = route.refuse if route is not None else _error
        try:
            if path == "/v1/models" and method == "GET":
                return 200, {
                    "object": "list",
                    "data": [{"id": self.model_name, "object": "model", "owned_by": "sharpen"}],
                }
            if route is None:
                raise RequestError(
                    f"no route {method} {path} (served: POST {', POST '.join(_ROUTES)}, GET /v1/models)",
                    status=404,
                    code="not_found",
                )
            if method != "POST":
                raise RequestError(f"{path} takes POST, not {method}", status=405, code="method_not_allowed")
            session = self._session(request)
            try:
                payload = json.loads(body)
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                raise RequestError(f"the request body is not JSON ({error})") from None
            if not isinstance(payload, dict):
                raise RequestError("the request body must be a JSON object")
            response = await route.answer(session, payload)
            if payload.get("stream"):
                return 200, route.stream(response, payload)
            return 200, response
        except RequestError as error:
            return error.status, refuse(error)
        except Exception as error:  # a bug must not hang the agent: it gets a 500 naming it, the log the traceback
            logger.exception("agent endpoint: %s %s failed", method, path)
            return 500, refuse(
                RequestError(f"internal error of the agent endpoint: {error!r}", status=500, code="internal_error")
            )

    def _admit(self, request: h11.Request) -> None:
        """Checks a request's head before its body is read: one body framing (not Transfer-Encoding beside
        Content-Length, which h11 would take, and a proxy in front might read the other way), and, on the routes that
        need one, an episode's key; else `_Refused` in the route's own error shape."""
        path = request.target.decode(errors="replace").split("?", 1)[0].rstrip("/")
        route = _ROUTES.get(path)
        refuse = route.refuse if route is not None else _error
        names = {name.lower() for name, _ in request.headers}
        if b"transfer-encoding" in names and b"content-length" in names:
            error = RequestError("both Transfer-Encoding and Content-Length: the body's framing is ambiguous")
            raise _Refused(error, refuse)
        if route is not None and request.method == b"POST":
            try:
                self._session(request)
            except RequestError as error:
                raise _Refused(error, refuse) from None

    def _session(self, request: h11.Request) -> AgentSession:
        headers = dict(request.headers)
        header = headers.get(b"authorization", b"").decode(errors="replace")
        if header.lower().startswith("bearer ") and header[7:].strip():
            key = header[7:].strip()
        else:  # Anthropic's clients send the key as x-api-key
            key = headers.get(b"x-api-key", b"").decode(errors="replace").strip()
        if not key:
            raise RequestError(
                "no API key: send the episode's key (AgentClient.api_key) as a Bearer token or x-api-key",
                status=401,
                code="missing_api_key",
            )
        session = self._sessions.get(key)
        if session is not None:
            return session
        if key in self._ended:
            raise RequestError("this episode has ended: its key takes no more calls", status=410, code="episode_ended")
        raise RequestError("unknown API key: not an episode of this run", status=401, code="invalid_api_key")


@dataclass(frozen=True, slots=True)
class _Route:
    """One API: its answer, that answer as server-sent events, and a refusal in the API's own error shape."""

    answer: Callable[[AgentSession, dict[str, Any]], Awaitable[dict[str, Any]]]
    stream: Callable[[dict[str, Any], dict[str, Any]], bytes]
    refuse: Callable[[RequestError], dict[str, Any]]


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """Unused on loopback, but an HTTP client builds one (~30 ms) unless it is given one."""
    return ssl.create_default_context()


class _BodyTooLarge(Exception):
    pass


class _Refused(Exception):
    """A request refused on its head alone (`AgentEndpoint._admit`): its body is never read."""

    def __init__(self, error: RequestError, refuse: Callable[[RequestError], dict[str, Any]]) -> None:
        super().__init__(str(error))
        self.error = error
        self.refuse = refuse


_FULL = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nx-should-retry: false\r\n"
    b"Connection: close\r\nContent-Length: 62\r\n\r\n"
    b'{"error": {"message": "too many connections", "code": "busy"}}'
)


async def _read_request(
    connection: h11.Connection,
    reader: asyncio.StreamReader,
    admit: Callable[[h11.Request], None],
    *,
    idle_s: float,
    read_s: float,
) -> tuple[h11.Request | None, bytes]:
    """The next request and its body (None at the end of the stream). Waits ``idle_s`` for its first bytes, then
    ``read_s`` in all for the rest; ``admit`` sees the head before any byte of the body is read. A request it
    refuses has its body read and dropped, never kept (so the client reads the answer, not a reset), then raises
    its `_Refused`."""
    request: h11.Request | None = None
    refused: _Refused | None = None
    chunks: list[bytes] = []
    size = 0
    deadline: float | None = None
    loop = asyncio.get_running_loop()
    while True:
        event = connection.next_event()
        if event is h11.NEED_DATA:
            timeout = idle_s if deadline is None else max(deadline - loop.time(), 0.0)
            data = await asyncio.wait_for(reader.read(1 << 16), timeout=timeout)
            if deadline is None:
                deadline = loop.time() + read_s
            connection.receive_data(data)  # b"" marks the end of the stream
            continue
        if isinstance(event, h11.Request):
            try:
                admit(event)
            except _Refused as error:
                refused = error
            request = event
        elif isinstance(event, h11.Data):
            size += len(event.data)
            if size > MAX_BODY_BYTES:
                raise _BodyTooLarge(f"the body is over {MAX_BODY_BYTES >> 20} MiB")
            if refused is None:
                chunks.append(bytes(event.data))
        elif isinstance(event, h11.EndOfMessage):
            if refused is not None:
                raise refused
            return request, b"".join(chunks)
        elif isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
            return None, b""


async def _send(
    connection: h11.Connection, writer: asyncio.StreamWriter, status: int, payload: dict[str, Any] | bytes
) -> None:
    is_stream = isinstance(payload, bytes)
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    content_type = "text/event-stream" if is_stream else "application/json"
    headers = [("content-type", content_type), ("content-length", str(len(body)))]
    if status >= 400:
        headers.append(("x-should-retry", "false"))
    writer.write(connection.send(h11.Response(status_code=status, headers=headers)) or b"")
    writer.write(connection.send(h11.Data(data=body)) or b"")
    writer.write(connection.send(h11.EndOfMessage()) or b"")
    await writer.drain()


def _include_usage(payload: dict[str, Any]) -> bool:
    options = payload.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


def _stream_events(response: dict[str, Any], *, include_usage: bool) -> bytes:
    """A finished response as the server-sent events of an OpenAI stream."""
    is_chat = response["object"] == "chat.completion"
    head = {k: response[k] for k in ("id", "created", "model")}
    head["object"] = "chat.completion.chunk" if is_chat else "text_completion"
    [choice] = response["choices"]
    chunks: list[dict[str, Any]] = []
    if is_chat:
        message = choice["message"]
        first: dict[str, Any] = {"index": 0, "delta": {"role": "assistant", "content": message["content"] or ""}}
        if "logprobs" in choice:
            first["logprobs"] = choice["logprobs"]
        chunks.append(first)
        if message.get("tool_calls"):
            calls = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
            chunks.append({"index": 0, "delta": {"tool_calls": calls}})
        last: dict[str, Any] = {"index": 0, "delta": {}}
    else:
        chunks.append(
            {"index": 0, "text": choice["text"], **({"logprobs": choice["logprobs"]} if "logprobs" in choice else {})}
        )
        last = {"index": 0, "text": ""}
    chunks.append({**last, "finish_reason": choice["finish_reason"], "token_ids": choice["token_ids"]})
    events = [{**head, "choices": [{"finish_reason": None, **c}]} for c in chunks]
    if include_usage:
        events.append({**head, "choices": [], "usage": response["usage"]})
    lines = [f"data: {json.dumps(event)}\n\n" for event in events]
    return ("".join(lines) + "data: [DONE]\n\n").encode()


def _openai_events(response: dict[str, Any], payload: dict[str, Any]) -> bytes:
    return _stream_events(response, include_usage=_include_usage(payload))


def _error(error: RequestError) -> dict[str, Any]:
    return {"error": {"message": str(error), "type": "invalid_request_error", "param": None, "code": error.code}}


_ROUTES: dict[str, _Route] = {
    "/v1/chat/completions": _Route(answer=AgentSession.chat, stream=_openai_events, refuse=_error),
    "/v1/completions": _Route(answer=AgentSession.complete, stream=_openai_events, refuse=_error),
    "/v1/messages": _Route(answer=answer_message, stream=message_events, refuse=message_error),
    "/v1/responses": _Route(answer=answer_response, stream=response_events, refuse=_error),
}
"""The POST routes, by path."""
