"""Anthropic's Messages API (``POST /v1/messages``) on the agent endpoint, so agents written for Claude's API train
unchanged: a request is translated into the chat route's `ChatRequest` and served by `AgentSession.chat_turn` (the
same continuity, control-token-safe rendering, limits and recorded tokens as ``/v1/chat/completions``), and the turn
is translated back into a message, or the server-sent events of one.

Owns the mapping: ``system`` -> a system message; ``text`` blocks -> text; an assistant's ``tool_use`` blocks ->
its tool calls (ids are not part of the tokens); a user's ``tool_result`` blocks -> tool messages, in block order
with the user's text; ``tools`` (``name``, ``description``, ``input_schema``) -> function tools; ``max_tokens``
(required, as Anthropic requires it) -> the call's cap. ``tool_choice`` ``auto`` is served and ``none`` keeps the
model's tool calls as text; ``any`` and ``tool`` are refused (the run's sampling cannot force a tool call), as are
``stop_sequences`` (the run's stop tokens end a turn), extended thinking, server tools and non-text blocks (images,
documents). ``temperature``, ``top_p`` and ``top_k`` are ignored: sampling is the run's. A tool result's
``is_error`` has no place in a chat template: the model reads the result's text. It does not speak HTTP.
"""

from __future__ import annotations

import json
from typing import Any

from sharpen.rollout.agent_session import (
    AgentSession,
    ChatRequest,
    ChatTurn,
    RequestError,
    function_tools,
    parses_tool_calls,
    requested_max_tokens,
    required_list,
)

_STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn"}
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "api_error",
}


async def answer_message(session: AgentSession, body: dict[str, Any]) -> dict[str, Any]:
    """A ``/v1/messages`` request -> its message (with the exact tokens: ``prompt_token_ids``, ``token_ids``)."""
    turn = await session.chat_turn(chat_request(body))
    return _message(session, body, turn)


def chat_request(body: dict[str, Any]) -> ChatRequest:
    """The chat route's request for an Anthropic Messages request."""
    if "max_tokens" not in body:
        raise RequestError("'max_tokens' is required")
    max_tokens = requested_max_tokens(body["max_tokens"], "max_tokens")
    if body.get("stop_sequences"):
        raise RequestError("'stop_sequences' are not supported: the run's stop tokens end a turn")
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") not in (None, "disabled"):
        raise RequestError("extended thinking is not served: the policy's own text is its answer")
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system:
        messages.append({"role": "system", "content": _text(system, "system")})
    for index, message in enumerate(required_list(body, "messages")):
        messages.extend(_chat_messages(message, index))
    return ChatRequest(
        messages=messages,
        tools=function_tools(body.get("tools"), _function),
        max_tokens=max_tokens,
        parse_tool_calls=parses_tool_calls(_choice_kind(body.get("tool_choice"))),
    )


def _chat_messages(message: Any, index: int) -> list[dict[str, Any]]:
    where = f"messages[{index}]"
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise RequestError(f"{where} must be an object with a role of user or assistant")
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or a list of content blocks")
    if role == "assistant":
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for block in content:
            kind = _block_type(block, where)
            if kind == "text":
                texts.append(str(block.get("text", "")))
            elif kind == "tool_use":
                if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                    raise RequestError(f"{where}: a tool_use block needs a string 'name' and an object 'input'")
                arguments = block.get("input", {})
                calls.append({"type": "function", "function": {"name": block["name"], "arguments": arguments}})
            else:
                raise RequestError(f"{where}: an assistant's {kind!r} blocks are not supported (text, tool_use are)")
        return [{"role": "assistant", "content": "".join(texts), **({"tool_calls": calls} if calls else {})}]
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []  # the user's text between tool results
    for block in content:
        kind = _block_type(block, where)
        if kind == "text":
            parts.append({"type": "text", "text": str(block.get("text", ""))})
        elif kind == "tool_result":
            if parts:
                out.append({"role": "user", "content": parts})
                parts = []
            result = _text(block.get("content") or "", f"{where}: the tool_result's content")
            out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": result})
        else:
            raise RequestError(f"{where}: {kind!r} blocks are not supported (text, tool_result are)")
    if parts or not out:
        out.append({"role": "user", "content": parts})
    return out


def _block_type(block: Any, where: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise RequestError(f"{where}: a content block must be an object with a 'type'")
    return block["type"]


def _text(value: Any, where: str) -> str:
    """A string, or text blocks joined (``system``, a tool result's content)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in value):
        return "".join(str(b.get("text", "")) for b in value)
    raise RequestError(f"{where} must be a string or a list of text blocks")


def _function(index: int, tool: Any) -> dict[str, Any]:
    """One Anthropic tool definition as a function (`function_tools`)."""
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
        raise RequestError(f"tools[{index}] must be an object with a string 'name'")
    if tool.get("type", "custom") != "custom":
        raise RequestError(f"tools[{index}]: server tools ({tool['type']}) are not served; define the tool yourself")
    schema = tool.get("input_schema", {})
    return {"name": tool["name"], "description": tool.get("description", ""), "parameters": schema}


def _message(session: AgentSession, body: dict[str, Any], turn: ChatTurn) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": turn.content}] if turn.content else []
    for i, call in enumerate(turn.tool_calls):
        call_id = f"toolu_{session.episode_id}_{turn.index}_{i}"
        content.append({"type": "tool_use", "id": call_id, "name": call.name, "input": call.arguments})
    return {
        "id": f"msg_{session.episode_id}_{turn.index}",
        "type": "message",
        "role": "assistant",
        "model": str(body.get("model", "")),
        "content": content,
        "stop_reason": _STOP_REASONS[turn.finish_reason],
        "stop_sequence": None,
        "usage": {"input_tokens": len(turn.call.prompt_ids), "output_tokens": len(turn.call.completion.token_ids)},
        "prompt_token_ids": turn.call.prompt_ids,
        "token_ids": turn.call.completion.token_ids,
    }


def message_events(message: dict[str, Any], body: dict[str, Any]) -> bytes:
    """A finished message as the server-sent events of an Anthropic stream (each block whole in one delta)."""
    del body  # the stream's shape does not depend on the request
    start = {**message, "content": [], "stop_reason": None, "stop_sequence": None}
    start["usage"] = {**message["usage"], "output_tokens": 0}
    events: list[dict[str, Any]] = [{"type": "message_start", "message": start}]
    for index, block in enumerate(message["content"]):
        if block["type"] == "text":
            opened, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
        else:
            opened = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        events += [
            {"type": "content_block_start", "index": index, "content_block": opened},
            {"type": "content_block_delta", "index": index, "delta": delta},
            {"type": "content_block_stop", "index": index},
        ]
    events += [
        {
            "type": "message_delta",
            "delta": {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]},
            "usage": {"output_tokens": message["usage"]["output_tokens"]},
        },
        {"type": "message_stop"},
    ]
    return "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events).encode()


def message_error(error: RequestError) -> dict[str, Any]:
    """A refusal in Anthropic's shape (its ``type`` from the status, as Anthropic's API names them)."""
    return {
        "type": "error",
        "error": {"type": _ERROR_TYPES.get(error.status, "invalid_request_error"), "message": str(error)},
    }


def _choice_kind(tool_choice: Any) -> Any:
    """An Anthropic ``tool_choice`` (``{"type": ...}``) as its kind."""
    return tool_choice.get("type") if isinstance(tool_choice, dict) else tool_choice
