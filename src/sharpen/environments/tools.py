"""Tools: Python functions as JSON-schema tool specs, and calling a tool safely.

Tool-call parsing (`TOOL_CALL_PARSERS`, `ToolCall`, `ToolCallError`) lives in `sharpen.environments.tool_formats`,
one parser per model family's format, and is re-exported here, so environments never write their own regex. It
does not decide when an episode ends; `ToolEnvironment` does.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import inspect
import json
import re
import types
from collections.abc import Callable
from typing import Any, Union, get_args, get_origin, get_type_hints

from sharpen.environments.base import EnvironmentInfraError
from sharpen.environments.tool_formats import (
    TOOL_CALL_PARSERS,
    HermesToolCallParser,
    JsonToolCallParser,
    ToolCall,
    ToolCallError,
    ToolCallParser,
    parser_for_template,
)

__all__ = [
    "TOOL_CALL_PARSERS",
    "HermesToolCallParser",
    "JsonToolCallParser",
    "ToolCall",
    "ToolCallError",
    "ToolCallParser",
    "call_tool",
    "parser_for_template",
    "tool_spec",
]

_JSON_TYPES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array"}
_JSON_TYPES[dict] = "object"


def tool_spec(function: Callable[..., Any]) -> dict[str, Any]:
    """The OpenAI/JSON-schema spec of ``function``: its name, its docstring's first paragraph, and its parameters
    from the signature's type hints (``Args:`` lines of a Google-style docstring describe them)."""
    return copy.deepcopy(_cached_spec(function))


def _cached_spec(function: Callable[..., Any]) -> dict[str, Any]:
    """`tool_spec`, made once per function (~35 us: signature, type hints, docstring); read-only. A bound method's
    is its function's without ``self``, cached on the function: caching the method would keep its environment."""
    if inspect.ismethod(function):
        return _function_spec(function.__func__, is_method=True)
    return _function_spec(function, is_method=False)


@functools.lru_cache(maxsize=1024)
def _function_spec(function: Callable[..., Any], *, is_method: bool) -> dict[str, Any]:
    doc = inspect.getdoc(function) or ""
    hints = get_type_hints(function)
    described = _argument_docs(doc)
    properties: dict[str, Any] = {}
    required: list[str] = []
    parameters = list(inspect.signature(function).parameters.items())
    for name, parameter in parameters[1:] if is_method else parameters:
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise ValueError(f"tool {function.__name__}: *args/**kwargs cannot be described as JSON schema")
        schema = {"type": _json_type(hints.get(name, str), f"{function.__name__}({name})")}
        if name in described:
            schema["description"] = described[name]
        properties[name] = schema
        if parameter.default is parameter.empty:
            required.append(name)
    return {
        "type": "function",
        "function": {
            "name": function.__name__,
            "description": doc.split("\n\n")[0].replace("\n", " "),
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def _json_type(hint: Any, where: str) -> str:
    if get_origin(hint) in (Union, types.UnionType):
        options = [arg for arg in get_args(hint) if arg is not type(None)]
        if len(options) == 1:
            return _json_type(options[0], where)
    base = get_origin(hint) or hint
    if base not in _JSON_TYPES:
        raise ValueError(f"tool {where}: type {hint!r} has no JSON-schema equivalent")
    return _JSON_TYPES[base]


def _argument_docs(doc: str) -> dict[str, str]:
    section = re.search(r"^Args:\n((?:[ \t]+.*\n?)+)", doc, re.MULTILINE)
    if section is None:
        return {}
    return dict(re.findall(r"^[ \t]+(\w+)(?: \([^)]*\))?:[ \t]*(.+)$", section.group(1), re.MULTILINE))


async def call_tool(tools: dict[str, Callable[..., Any]], call: ToolCall, *, max_chars: int) -> str:
    """Run ``call`` against ``tools`` and return what the policy sees: the result as text, or an error message
    (unknown tool, bad arguments, the tool raised); an `EnvironmentInfraError` is not the policy's fault and
    propagates. Sync tools run in a thread, so a slow one does not block the other episodes. Output is capped at
    ``max_chars``."""
    function = tools.get(call.name)
    if function is None:
        return f"error: unknown tool {call.name!r} (available: {', '.join(sorted(tools))})"
    problem = _check_arguments(function, call.arguments)
    if problem:
        return f"error: {problem}"
    try:
        if inspect.iscoroutinefunction(function):
            result = await function(**call.arguments)
        else:
            result = await asyncio.to_thread(function, **call.arguments)
    except EnvironmentInfraError:
        raise  # not the policy's fault: the episode ends and abstains
    except Exception as error:  # a tool failing on the policy's input is feedback for the policy, not a crash
        return f"error: {type(error).__name__}: {error}"
    text = result if isinstance(result, str) else json.dumps(result)
    return text if len(text) <= max_chars else text[:max_chars] + f"\n[output truncated at {max_chars} characters]"


def _check_arguments(function: Callable[..., Any], arguments: dict[str, Any]) -> str:
    spec = _cached_spec(function)["function"]["parameters"]
    unknown = sorted(set(arguments) - set(spec["properties"]))
    missing = [name for name in spec["required"] if name not in arguments]
    if unknown or missing:
        return f"tool {function.__name__}: unknown arguments {unknown}, missing arguments {missing}"
    checks = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list, "object": dict}
    for name, value in arguments.items():
        expected = spec["properties"][name]["type"]
        is_bool_as_number = isinstance(value, bool) and expected in ("integer", "number")
        if not isinstance(value, checks[expected]) or is_bool_as_number:
            return f"tool {function.__name__}: argument {name!r} must be a JSON {expected}, got {json.dumps(value)}"
    return ""
