"""A stand-in OpenAI-compatible chat server for agent-environment tests: scripted replies instead of a model.

It speaks what sharpen's agent endpoint promises agents: ``POST /v1/chat/completions`` (plain JSON, or server-sent
events when ``stream`` is true, with a usage chunk when ``stream_options.include_usage`` is), ``GET /v1/models``,
per-episode keys (``Authorization: Bearer <key>``; an unknown key gets 401), and tool calls: a reply's Hermes
``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks come back as ``tool_calls`` with finish reason
``tool_calls``, as the endpoint parses them. Streams are sent as the OpenAI API sends them: a role chunk, content
and tool-call deltas, a finish chunk, the usage chunk, ``data: [DONE]``.

What it does not: tokens (usage counts words), logprobs, n > 1. ``requests`` keeps every request (key, body) in order.
Runs in the caller's event loop (aiohttp, a dependency of the agents extra): ``async with OpenAIStandin(reply)``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from aiohttp import web

from sharpen.environments.tools import HermesToolCallParser, ToolCall

Reply = Callable[[list[dict[str, Any]]], str]
"""The scripted model: the request's messages -> the assistant's text (Hermes tool-call blocks allowed)."""


class OpenAIStandin:
    def __init__(self, reply: Reply, *, model: str = "sharpen-policy") -> None:
        self.reply = reply
        self.model = model
        self.keys: set[str] = set()
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def open_key(self) -> str:
        key = f"sk-standin-{uuid.uuid4().hex[:12]}"
        self.keys.add(key)
        return key

    async def __aenter__(self) -> OpenAIStandin:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        key = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if key not in self.keys:
            return web.json_response({"error": {"message": "unknown key", "type": "invalid_request_error"}}, status=401)
        body = await request.json()
        self.requests.append((key, body))
        text = self.reply(body["messages"])
        calls = [c for c in HermesToolCallParser().parse(text) if isinstance(c, ToolCall)]
        content = HermesToolCallParser.strip(text) if calls else text
        message: dict[str, Any] = {"role": "assistant", "content": content or None}
        if calls:
            message["tool_calls"] = [
                {
                    "id": f"call_{index}",
                    "type": "function",
                    "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
                }
                for index, c in enumerate(calls)
            ]
        finish = "tool_calls" if calls else "stop"
        num_prompt = sum(len(str(m.get("content") or "").split()) for m in body["messages"])
        usage = {"prompt_tokens": num_prompt, "completion_tokens": len(text.split())}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        head = {"id": f"chatcmpl-{uuid.uuid4().hex[:8]}", "created": int(time.time()), "model": body.get("model")}
        if not body.get("stream"):
            choice = {"index": 0, "message": message, "finish_reason": finish}
            return web.json_response({**head, "object": "chat.completion", "choices": [choice], "usage": usage})
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request)
        chunk = {**head, "object": "chat.completion.chunk"}
        deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
        if content:
            deltas.append({"content": content})
        for index, call in enumerate(message.get("tool_calls", [])):
            deltas.append({"tool_calls": [{"index": index, **call}]})
        for delta in deltas:
            await _send(stream, {**chunk, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
        await _send(stream, {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
        if (body.get("stream_options") or {}).get("include_usage"):
            await _send(stream, {**chunk, "choices": [], "usage": usage})
        await stream.write(b"data: [DONE]\n\n")
        await stream.write_eof()
        return stream


async def _send(stream: web.StreamResponse, event: dict[str, Any]) -> None:
    await stream.write(f"data: {json.dumps(event)}\n\n".encode())
