"""One agent episode's side of the agent endpoint: requests -> exact prompt tokens -> engine -> responses, every call
recorded, and the calls joined into training segments. Every chat-shaped API (OpenAI chat completions here;
Anthropic's messages and OpenAI's responses translate theirs into a `ChatRequest`) is served by `chat_turn`, so
continuity, rendering, limits and the recorded tokens are one path.

Owns token continuity for agents. A chat request whose messages extend the previous call's conversation (the same
messages, then the assistant message this session returned, then new tool or user messages) is rendered as a
continuation of the previous call's tokens (`render_continuation`): the model's past tokens are reused as they came,
never re-tokenised from the text the agent sent back. A request that does not extend it (the agent dropped, edited or
summarised earlier messages, changed its tools, or branched) is rendered afresh. `segments` then joins the calls by
tokens alone: a call whose prompt starts with a segment's tokens so far extends that segment (its new tokens are
inputs, not trained), any other call starts a new segment, so a rewritten history becomes separately trained
segments instead of silent drift. Sampling is the run's (temperature, top-p, per-call seeds derived like the episode
loop's turn seeds); a request's own ``temperature``/``top_p`` are ignored, since the trainer's importance ratios are
computed at the run's temperature. It does not speak HTTP (`sharpen.rollout.agent_endpoint` does).

What the agent sends cannot forge control tokens: chat messages (user, system, tool, the agent's own assistant text)
are rendered through `sharpen.control_tokens.template_ids`, so ``<|im_end|>`` typed in a message is the tokens of
its characters and the template's markers are only where the template puts them. Two routes hand the agent the
token stream on purpose and are checked, not rewritten: ``/v1/completions`` with token ids (each must be an id of
the vocabulary, else 400 before the engine sees it) and ``/v1/completions`` with a text prompt (the raw-prompt
route: the agent renders its own template there, so special tokens in that text are parsed as the tokenizer does).
A prompt the engine refuses for its own content (`EngineInputError`: past the model's context) is a 400 for that
call, never the run's error.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from sharpen.control_tokens import TokenIdError, check_token_ids
from sharpen.data import render_continuation
from sharpen.data.chat import render_messages
from sharpen.environments.tool_formats import (
    TOOL_CALL_PARSERS,
    ToolCall,
    UnknownToolCallFormatError,
    parser_for_template,
)
from sharpen.environments.tool_formats.decode import completion_text, visible_text
from sharpen.rollout.engines.base import EngineError, EngineInputError
from sharpen.types import Completion, ExpertRoutes, Message, PolicyVersion, SamplingParams

Generate = Callable[[list[int], SamplingParams], Awaitable[tuple[Completion, PolicyVersion]]]
"""How a session asks the engine for one completion (the episode runner's request path)."""

_ROLES = ("system", "user", "assistant", "tool")


class RequestError(ValueError):
    """A request the endpoint refuses: ``status`` is the HTTP status, the message says why."""

    def __init__(self, message: str, *, status: int = 400, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass(kw_only=True, slots=True)
class ChatRequest:
    """A chat call as every chat-shaped API is served: OpenAI chat messages (``role``; ``content`` a string or text
    parts; an assistant's ``tool_calls``; ``tool`` results), tool definitions in OpenAI's function shape, the
    caller's cap on completion tokens (None: the run's), and whether tool calls in the answer are parsed (a tool
    choice of "none" keeps them as text)."""

    messages: list[Any]
    tools: list[Any] | None = None
    max_tokens: int | None = None
    parse_tool_calls: bool = True


@dataclass(kw_only=True, slots=True)
class AgentCall:
    """One model call of an agent episode, as the engine saw it."""

    prompt_ids: list[int]
    completion: Completion
    versions: list[PolicyVersion]
    text: str


@dataclass(kw_only=True, slots=True)
class ChatTurn:
    """A served chat call: the call, its number in the episode, the answer's text outside tool calls, its tool
    calls, the finish reason (``tool_calls``, ``stop``, ``length``) and the conversation with the answer appended
    (OpenAI chat messages, as a later request that continues it sends them)."""

    call: AgentCall
    index: int
    content: str
    tool_calls: list[ToolCall]
    finish_reason: str
    messages: list[dict[str, Any]]


@dataclass(kw_only=True, slots=True)
class Segment:
    """Calls joined by token continuity: the first call's prompt, then generated tokens (trained) and the tokens
    the agent added between calls (inputs only)."""

    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list[int])
    logprobs: list[float] = field(default_factory=list[float])
    versions: list[PolicyVersion] = field(default_factory=list[PolicyVersion])
    loss_mask: list[bool] = field(default_factory=list[bool])
    calls: list[AgentCall] = field(default_factory=list[AgentCall])

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    def routes(self) -> ExpertRoutes | None:
        """A Mixture-of-Experts engine's routes of the segment's tokens: each call returns its context's and its
        generated tokens' (its last one unknown), and a token keeps the route of the first call that ran it; the
        agent's tokens after the last call are unknown. None when a call returned none."""
        merged: ExpertRoutes | None = None
        for call in self.calls:
            routes = call.completion.routes
            if routes is None:
                return None
            merged = routes if merged is None else merged.extended_by(routes)
        return None if merged is None else merged.padded_to(len(self.prompt_ids) + len(self.completion_ids))

    def extend(self, call: AgentCall) -> None:
        added = call.prompt_ids[len(self.prompt_ids) + len(self.completion_ids) :]
        version = self.versions[-1] if self.versions else (call.versions[0] if call.versions else 0)
        self._append(added, [0.0] * len(added), [version] * len(added), is_generated=False)
        self._append(call.completion.token_ids, call.completion.logprobs, call.versions, is_generated=True)
        self.calls.append(call)

    def _append(self, ids: list[int], logprobs: list[float], versions: list[int], *, is_generated: bool) -> None:
        self.completion_ids.extend(ids)
        self.logprobs.extend(logprobs)
        self.versions.extend(versions)
        self.loss_mask.extend([is_generated] * len(ids))


@dataclass(kw_only=True)
class AgentSession:
    """The model calls of one agent episode. ``seed_of(k)`` is the sampling seed of call ``k``; ``max_calls`` and
    ``max_tokens`` are the episode's limits (policy turns, completion tokens of a segment)."""

    episode_id: str
    tokenizer: Any
    generate: Generate
    sampling: SamplingParams
    seed_of: Callable[[int], int]
    max_calls: int
    max_tokens: int
    calls: list[AgentCall] = field(default_factory=list[AgentCall])
    is_closed: bool = False
    limit_reached: str = ""
    """The limit a refused call hit (``max_turns``, ``max_tokens``), or empty."""
    engine_error: EngineError | None = None
    """The engine failure a call met: the run's error, raised by the episode loop once the agent returns."""
    model_seconds: float = 0.0
    """Time with a model call in flight, calls in flight now aside (the environment's wall clock does not count
    it)."""
    in_flight_since: float | None = None
    """``time.monotonic()`` since which a call has been in flight (None: none is)."""
    num_in_flight: int = 0
    _last_chat: tuple[list[dict[str, Any]], Any, list[int]] | None = None
    """(messages including the reply, tools, their tokens) of the latest chat call, for continuity."""
    _last_text: tuple[str, list[int]] | None = None
    """(prompt text + completion text, their tokens) of the latest completions call."""
    responses: dict[str, list[dict[str, Any]]] = field(default_factory=dict[str, list[dict[str, Any]]])
    """The Responses API's responses of this episode: id -> its conversation (input and output as chat messages,
    instructions aside), which a request naming it as ``previous_response_id`` continues."""
    _segments: list[Segment] = field(default_factory=list[Segment])
    """`segments`, extended as each call returns (one prefix match per call, not a rebuild of them all)."""
    tool_parser: str = ""
    """The `TOOL_CALL_PARSERS` entry that reads the tool calls of the chat template's format (a template that
    renders none: Hermes ``<tool_call>`` blocks); found at the first request with tools, so a template in a format
    sharpen cannot read refuses only the requests that would need it, in one line."""

    def _tool_parser(self) -> str:
        if not self.tool_parser:
            try:
                self.tool_parser = parser_for_template(self.tokenizer.chat_template)
            except UnknownToolCallFormatError as error:
                raise RequestError(f"tools cannot be read back from this model's replies: {error}") from error
        return self.tool_parser

    async def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """A ``/v1/chat/completions`` request -> its response."""
        _check_single_choice(body)
        tools = body.get("tools") or None
        if tools is not None and not isinstance(tools, list):
            raise RequestError("'tools' must be a list of tool definitions")
        request = ChatRequest(messages=required_list(body, "messages"), tools=tools, max_tokens=_max_tokens(body))
        turn = await self.chat_turn(request)
        reply: dict[str, Any] = {
            "role": "assistant",
            "content": turn.content if turn.content or not turn.tool_calls else None,
        }
        if turn.tool_calls:
            reply["tool_calls"] = [
                _tool_call_json(c, f"call_{self.episode_id}_{turn.index}_{i}") for i, c in enumerate(turn.tool_calls)
            ]
        choice: dict[str, Any] = {
            "index": 0,
            "message": reply,
            "finish_reason": turn.finish_reason,
            "token_ids": turn.call.completion.token_ids,
        }
        if body.get("logprobs"):
            choice["logprobs"] = {"content": self._token_logprobs(turn.call)}
        return self._response("chat.completion", body, turn.call, choice)

    async def chat_turn(self, request: ChatRequest) -> ChatTurn:
        """One chat call, whichever API it came through (chat completions, Anthropic's messages, OpenAI's
        responses translate theirs into a `ChatRequest`): continuity, control-token-safe rendering, limits, the
        engine, the tool calls in the answer."""
        messages = [_normalised(m, index=i) for i, m in enumerate(request.messages)]
        if not messages:
            raise RequestError("'messages' is empty")
        tools = request.tools or None
        is_parsed = tools is not None and request.parse_tool_calls
        parser = TOOL_CALL_PARSERS[self._tool_parser()](tools=tools or ()) if is_parsed else None
        prompt_ids = self._chat_prompt(messages, tools)
        call = await self._call(prompt_ids, request.max_tokens)
        index = len(self.calls) - 1
        tool_calls = [] if parser is None else [c for c in parser.parse(call.text) if isinstance(c, ToolCall)]
        # the text beside the calls, or without calls all of it (a malformed call stays, where the agent sees it);
        # either way without a special token: the markers `call.text` keeps for the parser are not content
        if parser is not None and tool_calls:
            content = parser.strip(call.text)
        else:
            content = visible_text(self.tokenizer, call.completion.token_ids)
        reply: dict[str, Any] = {"role": "assistant", "content": content.strip()}
        if tool_calls:
            reply["tool_calls"] = [(c.name, c.arguments) for c in tool_calls]
        conversation = [*messages, reply]
        self._last_chat = (conversation, tools, call.prompt_ids + call.completion.token_ids)
        finish = "tool_calls" if tool_calls else call.completion.finish_reason
        return ChatTurn(
            call=call,
            index=index,
            content=content,
            tool_calls=tool_calls,
            finish_reason=finish,
            messages=[_template_message(m) for m in conversation],
        )

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """A ``/v1/completions`` request (a text prompt or one list of token ids) -> its response."""
        _check_single_choice(body)
        if body.get("suffix") or body.get("echo"):
            raise RequestError("'suffix' and 'echo' are not supported")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and not any(isinstance(t, str | list) for t in prompt):
            try:  # ids outside the vocabulary never reach the engine
                prompt_ids, text = check_token_ids(prompt, vocab_size=len(self.tokenizer), where="'prompt'"), None
            except TokenIdError as error:
                raise RequestError(str(error), code="invalid_token_ids") from None
        elif isinstance(prompt, str) and prompt:
            text = prompt
            last = self._last_text
            if last is not None and prompt.startswith(last[0]):  # continues the previous call: keep its tokens
                rest = prompt[len(last[0]) :]
                prompt_ids = last[1] + (self.tokenizer.encode(rest, add_special_tokens=False) if rest else [])
            else:
                prompt_ids = self.tokenizer.encode(prompt)
        else:
            raise RequestError("'prompt' must be a non-empty string or one non-empty list of token ids")
        call = await self._call(prompt_ids, _max_tokens(body))
        if text is not None:
            self._last_text = (text + call.text, call.prompt_ids + call.completion.token_ids)
        choice: dict[str, Any] = {
            "index": 0,
            "text": call.text,
            "finish_reason": call.completion.finish_reason,
            "token_ids": call.completion.token_ids,
        }
        if body.get("logprobs") is not None:
            tokens = self._token_logprobs(call)
            choice["logprobs"] = {
                "tokens": [t["token"] for t in tokens],
                "token_logprobs": [t["logprob"] for t in tokens],
            }
        return self._response("text_completion", body, call, choice)

    def segments(self) -> list[Segment]:
        """The calls joined by token continuity, in the order their segments started: a call extends the latest
        segment whose tokens begin its prompt, or starts one."""
        return list(self._segments)

    def _segment_of(self, prompt_ids: list[int]) -> Segment | None:
        """The latest segment whose tokens begin ``prompt_ids`` (the one a call with this prompt extends)."""
        for segment in reversed(self._segments):
            num_prompt = len(segment.prompt_ids)
            num_tokens = num_prompt + len(segment.completion_ids)
            if (
                len(prompt_ids) >= num_tokens
                and prompt_ids[:num_prompt] == segment.prompt_ids
                and prompt_ids[num_prompt:num_tokens] == segment.completion_ids
            ):
                return segment
        return None

    def _chat_prompt(self, messages: list[dict[str, Any]], tools: Any) -> list[int]:
        last = self._last_chat
        if (
            last is not None
            and last[1] == tools
            and len(messages) > len(last[0])
            and messages[: len(last[0])] == last[0]
        ):
            tail = messages[len(last[0]) :]
            if tail[-1]["role"] != "assistant":
                end_of_turn_id = self.tokenizer.eos_token_id
                ids = list(last[2])
                if not ids or ids[-1] != end_of_turn_id:
                    ids.append(end_of_turn_id)  # the turn stopped on its token limit: close it as the template would
                plain = [Message(role=m["role"], content=m["content"]) for m in tail]
                return ids + render_continuation(self.tokenizer, plain, end_of_turn_id=end_of_turn_id)
        if messages[-1]["role"] == "assistant":
            raise RequestError("the last message is the assistant's: nothing to answer (prefilling is not supported)")
        return render_messages(self.tokenizer, [_template_message(m) for m in messages], tools=tools)

    async def _call(self, prompt_ids: list[int], max_tokens: int | None) -> AgentCall:
        if self.is_closed:
            raise RequestError(f"episode {self.episode_id} has ended", status=410, code="episode_ended")
        if self.engine_error is not None:
            raise RequestError(f"the engine failed: {self.engine_error}", status=503, code="engine_error")
        if len(self.calls) + self.num_in_flight >= self.max_calls:
            self.limit_reached = "max_turns"
            raise RequestError(f"the episode's limit of {self.max_calls} model calls is reached", code="episode_limit")
        segment = self._segment_of(prompt_ids)
        used = 0 if segment is None else len(prompt_ids) - len(segment.prompt_ids)  # what counts against max_tokens
        requested = self.sampling.max_new_tokens if max_tokens is None else max_tokens
        budget = min(self.sampling.max_new_tokens, self.max_tokens - used, requested)
        if budget <= 0:
            self.limit_reached = "max_tokens"
            raise RequestError(
                f"the episode's limit of {self.max_tokens} completion tokens is reached", code="episode_limit"
            )
        params = replace(self.sampling, max_new_tokens=budget, seed=self.seed_of(len(self.calls) + self.num_in_flight))
        if self.num_in_flight == 0:
            self.in_flight_since = time.monotonic()
        self.num_in_flight += 1
        try:
            completion, version = await self.generate(prompt_ids, params)
        except EngineInputError as error:  # the engine refused this prompt (past its context): the run goes on
            raise RequestError(f"the engine refused the prompt: {error}", code="invalid_prompt") from error
        except EngineError as error:
            self.engine_error = error
            raise RequestError(f"the engine failed: {error}", status=503, code="engine_error") from error
        finally:
            self.num_in_flight -= 1
            if self.num_in_flight == 0 and self.in_flight_since is not None:
                self.model_seconds += time.monotonic() - self.in_flight_since
                self.in_flight_since = None
        if self.is_closed:  # the episode ended while this call ran: its tokens are not the episode's
            raise RequestError(f"episode {self.episode_id} has ended", status=410, code="episode_ended")
        versions = list(completion.versions) if completion.versions else [version] * len(completion.token_ids)
        text = completion_text(self.tokenizer, completion.token_ids)  # the engines' decode: tool-call markers kept
        call = AgentCall(prompt_ids=list(prompt_ids), completion=completion, versions=versions, text=text)
        self.calls.append(call)
        # matched again: calls that returned while this one ran may have extended or started segments
        segment = self._segment_of(call.prompt_ids)
        if segment is None:
            segment = Segment(prompt_ids=call.prompt_ids)
            self._segments.append(segment)
        segment.extend(call)
        return call

    def _token_logprobs(self, call: AgentCall) -> list[dict[str, Any]]:
        tokens = self.tokenizer.convert_ids_to_tokens(call.completion.token_ids)
        return [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(tokens, call.completion.logprobs, strict=True)
        ]

    def _response(self, obj: str, body: dict[str, Any], call: AgentCall, choice: dict[str, Any]) -> dict[str, Any]:
        num_prompt, num_completion = len(call.prompt_ids), len(call.completion.token_ids)
        return {
            "id": f"{obj}-{self.episode_id}-{len(self.calls) - 1}",
            "object": obj,
            "created": int(time.time()),
            "model": str(body.get("model", "")),
            "choices": [choice],
            "usage": {
                "prompt_tokens": num_prompt,
                "completion_tokens": num_completion,
                "total_tokens": num_prompt + num_completion,
            },
            "prompt_token_ids": call.prompt_ids,
        }


def _max_tokens(body: dict[str, Any]) -> int | None:
    return requested_max_tokens(body.get("max_completion_tokens", body.get("max_tokens")), "max_tokens")


def requested_max_tokens(value: Any, name: str) -> int | None:
    """A request's cap on completion tokens (``name`` is its field, for the error); None: the run's."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise RequestError(f"'{name}' must be a positive integer, got {value!r}")
    return value


def function_tools(tools: Any, function_of: Callable[[int, Any], dict[str, Any]]) -> list[dict[str, Any]] | None:
    """An API's ``tools`` as the chat route's function tools (None for none); ``function_of(index, tool)`` gives
    each one's function (``name``, ``description``, ``parameters``) or raises `RequestError`."""
    if not tools:
        return None
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list of tool definitions")
    return [{"type": "function", "function": function_of(index, tool)} for index, tool in enumerate(tools)]


def parses_tool_calls(kind: Any) -> bool:
    """Whether the answer's tool calls are parsed under a ``tool_choice`` of ``kind``: ``auto`` (or none given)
    yes, ``none`` no; a choice that forces a call is refused (the run's sampling cannot force one)."""
    if kind in (None, "auto"):
        return True
    if kind == "none":
        return False
    raise RequestError(
        f"tool_choice {kind!r} is not served: the run's sampling cannot force a tool call (auto and none are)"
    )


def _check_single_choice(body: dict[str, Any]) -> None:
    if body.get("n", 1) != 1:
        raise RequestError("only n = 1 is served (an episode's samples are separate episodes)")
    if body.get("stop"):
        raise RequestError("'stop' strings are not supported: the run's stop tokens end a turn")


def required_list(body: dict[str, Any], key: str) -> list[Any]:
    value = body.get(key)
    if not isinstance(value, list):
        raise RequestError(f"'{key}' must be a list")
    return value


def _normalised(message: Any, *, index: int) -> dict[str, Any]:
    """A message as compared for continuity: role, text content, tool calls by name and parsed arguments."""
    if not isinstance(message, dict) or message.get("role") not in _ROLES:
        raise RequestError(f"messages[{index}] must be an object with a role in {', '.join(_ROLES)}")
    content = message.get("content")
    if isinstance(content, list):  # content parts: only text is served
        if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
            raise RequestError(f"messages[{index}]: only text content parts are supported")
        content = "".join(str(p.get("text", "")) for p in content)
    if content is not None and not isinstance(content, str):
        raise RequestError(f"messages[{index}].content must be a string, a list of text parts or null")
    out: dict[str, Any] = {"role": message["role"], "content": (content or "").strip()}
    calls = message.get("tool_calls")
    if calls:
        try:
            out["tool_calls"] = [(c["function"]["name"], _arguments(c["function"].get("arguments"))) for c in calls]
        except (KeyError, TypeError) as error:
            raise RequestError(f"messages[{index}].tool_calls is malformed ({error!r})") from None
    return out


def _arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A normalised message as the chat template takes it (tool calls in the OpenAI shape templates read)."""
    out: dict[str, Any] = {"role": message["role"], "content": message["content"]}
    if "tool_calls" in message:
        out["tool_calls"] = [
            {"type": "function", "function": {"name": n, "arguments": a}} for n, a in message["tool_calls"]
        ]
    return out


def _tool_call_json(call: ToolCall, call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
