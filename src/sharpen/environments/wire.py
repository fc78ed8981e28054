"""The environment service's wire format: `Example`, `EpisodeContext`'s numbers, `Message` and `StepResult` as
JSON, shared by the server (service.py) and its client (remote.py). Does no I/O."""

from __future__ import annotations

import base64
import dataclasses
from typing import Any

from sharpen.environments.base import EpisodeContext, StepResult
from sharpen.types import Example, ImagePart, Message, TextPart


def _encode_part(part: TextPart | ImagePart) -> dict[str, str]:
    if isinstance(part, TextPart):
        return {"type": "text", "text": part.text}
    if part.path:
        return {"type": "image", "path": part.path}
    return {"type": "image", "base64": base64.b64encode(part.data).decode()}


def _decode_part(value: dict[str, str]) -> TextPart | ImagePart:
    if value["type"] == "text":
        return TextPart(text=value["text"])
    if "path" in value:
        return ImagePart(path=value["path"])
    return ImagePart(data=base64.b64decode(value["base64"]))


def encode_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Messages as JSON; image parts carry their bytes (base64), so the other side gets the same message."""
    return [
        {
            "role": m.role,
            "content": m.content if isinstance(m.content, str) else [_encode_part(part) for part in m.content],
        }
        for m in messages
    ]


def decode_messages(value: Any) -> list[Message]:
    if not isinstance(value, list):
        raise ValueError("messages must be a list")
    messages: list[Message] = []
    for item in value:  # pyright: ignore[reportUnknownVariableType]
        content = item["content"]  # pyright: ignore[reportUnknownVariableType]
        if not isinstance(content, str):
            content = tuple(_decode_part(part) for part in content)  # pyright: ignore[reportUnknownArgumentType, reportUnknownVariableType]
        messages.append(Message(role=item["role"], content=content))  # pyright: ignore[reportUnknownArgumentType]
    return messages


def encode_example(example: Example) -> dict[str, Any]:
    prompt = encode_messages(list(example.prompt))
    return {"task_key": example.task_key, "prompt": prompt, "answer": example.answer, "metadata": example.metadata}


def decode_example(value: dict[str, Any]) -> Example:
    return Example(
        task_key=str(value["task_key"]),
        prompt=tuple(decode_messages(value["prompt"])),
        answer=value.get("answer"),
        metadata=dict(value.get("metadata") or {}),
    )


def encode_context(ctx: EpisodeContext) -> dict[str, Any]:
    names = ("seed", "sample_index", "max_turns", "max_tokens", "wall_seconds")
    return {name: getattr(ctx, name) for name in names}


def encode_step(result: StepResult) -> dict[str, Any]:
    return {**dataclasses.asdict(result), "observation": encode_messages(result.observation)}


def decode_step(value: dict[str, Any]) -> StepResult:
    return StepResult(
        observation=decode_messages(value["observation"]),
        reward=value.get("reward"),
        terminated=bool(value.get("terminated")),
        truncated=bool(value.get("truncated")),
        info=dict(value.get("info") or {}),
    )
