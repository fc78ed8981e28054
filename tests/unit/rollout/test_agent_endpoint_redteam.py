"""The agent endpoint under attack from raw sockets, each attack beside its naive path: a half-sent request, an
idle connection, a flood of connections, an unauthenticated body, and ambiguous framing."""

from __future__ import annotations

import asyncio
import tracemalloc
from collections.abc import Awaitable, Callable
from typing import Any

import h11

from sharpen.rollout.agent_endpoint import AgentEndpoint

BODY_BYTES = 8 << 20


def _serve(check: Callable[[AgentEndpoint], Awaitable[Any]], **options: Any) -> Any:
    async def main() -> Any:
        async with AgentEndpoint(**options) as endpoint:
            return await check(endpoint)

    return asyncio.run(main())


async def _is_closed(endpoint: AgentEndpoint, sent: bytes, *, after_s: float) -> bool:
    """Sends ``sent`` and reports whether the endpoint closed the connection within ``after_s`` seconds."""
    reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port)
    writer.write(sent)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), timeout=after_s) == b""
    except TimeoutError:
        return False
    finally:
        writer.close()


HALF_SENT = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Le"


def test_a_half_sent_request_is_cut_at_the_read_timeout_not_held_forever() -> None:
    assert _serve(lambda e: _is_closed(e, HALF_SENT, after_s=2.0), read_timeout_s=0.3)
    # the naive path: a server that waits as long as the client does keeps the connection open
    assert not _serve(lambda e: _is_closed(e, HALF_SENT, after_s=1.0), read_timeout_s=1e9)


def test_an_idle_connection_is_closed_at_the_idle_timeout() -> None:
    assert _serve(lambda e: _is_closed(e, b"", after_s=2.0), idle_timeout_s=0.3)
    assert not _serve(lambda e: _is_closed(e, b"", after_s=1.0), idle_timeout_s=1e9)


def test_a_connection_past_the_bound_gets_503_and_the_others_keep_theirs() -> None:
    async def check(endpoint: AgentEndpoint) -> tuple[bytes, bytes]:
        held = [await asyncio.open_connection(endpoint.host, endpoint.port) for _ in range(2)]
        await asyncio.sleep(0.1)
        reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port)
        refused = await asyncio.wait_for(reader.read(), timeout=2.0)
        writer.close()
        # a held connection still serves a request
        held_reader, held_writer = held[0]
        held_writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = await asyncio.wait_for(held_reader.readuntil(b"\r\n\r\n"), timeout=2.0)
        for _, w in held:
            w.close()
        return refused, answer

    refused, answer = _serve(check, max_connections=2)
    assert refused.startswith(b"HTTP/1.1 503") and b'"too many connections"' in refused
    assert answer.startswith(b"HTTP/1.1 200")


async def _post_peak_bytes(endpoint: AgentEndpoint, key: str) -> tuple[bytes, int]:
    """POSTs an 8 MiB body (not JSON) with ``key``; the answer's status line and the peak traced memory."""
    reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Length: {BODY_BYTES}\r\n\r\n"
    ).encode()
    chunk = b"x" * (1 << 16)
    tracemalloc.start()
    try:
        writer.write(head)
        for _ in range(BODY_BYTES // len(chunk)):
            writer.write(chunk)
            await writer.drain()
        status = await asyncio.wait_for(reader.readline(), timeout=10.0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        writer.close()
    return status, peak


def test_an_unauthenticated_body_is_dropped_unread_and_memory_stays_flat() -> None:
    async def check(endpoint: AgentEndpoint) -> tuple[tuple[bytes, int], tuple[bytes, int]]:
        endpoint._sessions["known"] = object()  # type: ignore[assignment]  # a key the endpoint accepts
        return await _post_peak_bytes(endpoint, "forged"), await _post_peak_bytes(endpoint, "known")

    (refused, refused_peak), (read, read_peak) = _serve(check)
    assert refused.startswith(b"HTTP/1.1 401")
    assert refused_peak < 2 << 20, refused_peak  # the 8 MiB body was never kept
    # the naive path, a body read before its key is checked: an authorized caller's body is buffered whole
    assert read.startswith(b"HTTP/1.1 400") and read_peak > BODY_BYTES


def test_transfer_encoding_beside_content_length_is_refused_and_the_connection_closed() -> None:
    smuggled = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 44\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"0\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    )
    # the naive path: h11 alone takes the request (chunked wins) and then a second, smuggled one
    naive = h11.Connection(h11.SERVER)
    naive.receive_data(smuggled)
    events = [naive.next_event(), naive.next_event()]
    naive.send(h11.Response(status_code=200, headers=[("content-length", "0")]))
    naive.send(h11.EndOfMessage())
    naive.start_next_cycle()
    assert isinstance(events[0], h11.Request) and isinstance(naive.next_event(), h11.Request)

    async def check(endpoint: AgentEndpoint) -> bytes:
        reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port)
        writer.write(smuggled)
        answer = await asyncio.wait_for(reader.read(), timeout=5.0)  # read to the close
        writer.close()
        return answer

    answer = _serve(check)
    assert answer.startswith(b"HTTP/1.1 400") and b"ambiguous" in answer
    assert answer.count(b"HTTP/1.1") == 1  # the smuggled GET was never answered
