"""OpenAI's Responses API (``POST /v1/responses``) on the agent endpoint: a request is translated into the chat
route's `ChatRequest` and served by `AgentSession.chat_turn` (the same continuity, control-token-safe rendering,
limits and recorded tokens as ``/v1/chat/completions``), and the turn is translated back into a response, or the
server-sent events of one.

Owns the mapping: ``instructions`` -> a system message; ``input`` (a string, or items: messages with
``input_text``/``output_text`` parts, ``developer`` read as ``system``; ``function_call`` items -> the preceding
assistant message's tool calls; ``function_call_output`` items -> tool messages); function ``tools`` (``name``,
``description``, ``parameters``); ``max_output_tokens`` -> the call's cap. ``previous_response_id`` is served within
an episode: the session keeps each response's conversation (its input and output, instructions aside, which OpenAI
does not carry over either), and a request naming one continues it; an id that is not this episode's is a 400.
``tool_choice`` ``auto`` is served and ``none`` keeps the model's tool calls as text; ``required`` and a named function
are refused (the run's sampling cannot force a tool call), as are built-in tools, non-text inputs, structured
output formats, ``conversation`` and ``background``. ``temperature``/``top_p`` are the run's. It does not speak HTTP.
"""

from __future__ import annotations

import json
import time
from typing import Any

from sharpen.rollout.agent_session import (
    AgentSession,
    ChatRequest,
    ChatTurn,
    RequestError,
    function_tools,
    parses_tool_calls,
    requested_max_tokens,
)

_TEXT_PARTS = ("input_text", "output_text", "text")


async def answer_response(session: AgentSession, body: dict[str, Any]) -> dict[str, Any]:
    """A ``/v1/responses`` request -> its response (with the exact tokens: ``prompt_token_ids``, ``token_ids``)."""
    request, num_instructions = chat_request(session, body)
    turn = await session.chat_turn(request)
    response = _response(session, body, turn)
    session.responses[response["id"]] = turn.messages[num_instructions:]
    return response


def chat_request(session: AgentSession, body: dict[str, Any]) -> tuple[ChatRequest, int]:
    """The chat route's request for a Responses request, and how many of its messages are the instructions."""
    for key in ("conversation", "background"):
        if body.get(key):
            raise RequestError(f"'{key}' is not served: an episode's conversation is its calls")
    text_format = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(text_format, dict) and text_format.get("type", "text") != "text":
        raise RequestError(f"text format {text_format.get('type')!r} is not served (structured outputs)")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise RequestError("'instructions' must be a string")
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    previous = body.get("previous_response_id")
    if previous is not None:
        if previous not in session.responses:
            raise RequestError(
                f"previous response {previous!r} is not one of this episode's (responses are kept per episode)",
                code="previous_response_not_found",
            )
        messages += session.responses[previous]
    messages += _chat_messages(body.get("input"))
    request = ChatRequest(
        messages=messages,
        tools=function_tools(body.get("tools"), _function),
        max_tokens=requested_max_tokens(body.get("max_output_tokens"), "max_output_tokens"),
        parse_tool_calls=parses_tool_calls(body.get("tool_choice")),
    )
    return request, 1 if instructions else 0


def _chat_messages(items: Any) -> list[dict[str, Any]]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise RequestError("'input' must be a non-empty string or list of input items")
    out: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where} must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = "system" if item.get("role") == "developer" else item.get("role")
            if role not in ("user", "system", "assistant"):
                raise RequestError(f"{where}: a message's role must be user, system, developer or assistant")
            out.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str):
                raise RequestError(f"{where}: a function_call needs a string 'name'")
            call = {"type": "function", "function": {"name": item["name"], "arguments": item.get("arguments", "{}")}}
            if not out or out[-1]["role"] != "assistant":  # calls follow the assistant's text in one chat message
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = _text(item.get("output", ""), f"{where}.output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
        else:
            raise RequestError(
                f"{where}: {kind!r} items are not supported (message, function_call, function_call_output)"
            )
    return out


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(f"{where}: {kind!r} content is not supported (text parts are)")
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise RequestError(f"{where}: content must be a string or a list of text parts")


def _function(index: int, tool: Any) -> dict[str, Any]:
    """One Responses tool definition as a function (`function_tools`)."""
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise RequestError(f"tools[{index}]: only function tools with a 'name' are served, not {kind!r}")
    return {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}


def _response(session: AgentSession, body: dict[str, Any], turn: ChatTurn) -> dict[str, Any]:
    episode, index = session.episode_id, turn.index
    is_complete = turn.finish_reason != "length"
    output: list[dict[str, Any]] = []
    if turn.content or not turn.tool_calls:
        text = {"type": "output_text", "text": turn.content, "annotations": [], "logprobs": []}
        output.append(
            {
                "id": f"msg_{episode}_{index}",
                "type": "message",
                "role": "assistant",
                "status": "completed" if is_complete else "incomplete",
                "content": [text],
            }
        )
    for i, call in enumerate(turn.tool_calls):
        output.append(
            {
                "id": f"fc_{episode}_{index}_{i}",
                "type": "function_call",
                "call_id": f"call_{episode}_{index}_{i}",
                "name": call.name,
                "arguments": json.dumps(call.arguments),
                "status": "completed",
            }
        )
    num_prompt, num_completion = len(turn.call.prompt_ids), len(turn.call.completion.token_ids)
    return {
        "id": f"resp_{episode}_{index}",
        "object": "response",
        "created_at": int(time.time()),
        "status": "completed" if is_complete else "incomplete",
        "error": None,
        "incomplete_details": None if is_complete else {"reason": "max_output_tokens"},
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "model": str(body.get("model", "")),
        "output": output,
        "parallel_tool_calls": True,
        "previous_response_id": body.get("previous_response_id"),
        "temperature": session.sampling.temperature,
        "text": {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "top_p": session.sampling.top_p,
        "usage": {
            "input_tokens": num_prompt,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": num_completion,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": num_prompt + num_completion,
        },
        "prompt_token_ids": turn.call.prompt_ids,
        "token_ids": turn.call.completion.token_ids,
    }


def response_events(response: dict[str, Any], body: dict[str, Any]) -> bytes:
    """A finished response as the server-sent events of a Responses stream (each item's text whole in one delta)."""
    del body  # the stream's shape does not depend on the request
    events: list[dict[str, Any]] = []

    def add(kind: str, **fields: Any) -> None:
        events.append({"type": kind, "sequence_number": len(events), **fields})

    started = {**response, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    add("response.created", response=started)
    add("response.in_progress", response=started)
    for position, item in enumerate(response["output"]):
        where = {"item_id": item["id"], "output_index": position}
        if item["type"] == "message":
            add(
                "response.output_item.added",
                output_index=position,
                item={**item, "status": "in_progress", "content": []},
            )
            [part] = item["content"]
            add("response.content_part.added", **where, content_index=0, part={**part, "text": ""})
            add("response.output_text.delta", **where, content_index=0, delta=part["text"], logprobs=[])
            add("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[])
            add("response.content_part.done", **where, content_index=0, part=part)
        else:
            add(
                "response.output_item.added",
                output_index=position,
                item={**item, "status": "in_progress", "arguments": ""},
            )
            add("response.function_call_arguments.delta", **where, delta=item["arguments"])
            add("response.function_call_arguments.done", **where, name=item["name"], arguments=item["arguments"])
        add("response.output_item.done", output_index=position, item=item)
    add("response.completed" if response["status"] == "completed" else "response.incomplete", response=response)
    return "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events).encode()
