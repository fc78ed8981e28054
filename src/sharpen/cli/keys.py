"""`sharpen config --keys`: every config key a user sets, with its type, default and help, generated from the schema.

The schema's field docstrings are the only help text, so this listing can never drift from the code. Fields and
sections marked `sharpen.config.section.internal` (test fakes, knobs the runtime derives) are left out; they stay
settable.
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from sharpen.config.schema import SharpenConfig
from sharpen.config.section import is_internal


def _sections(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models inside an annotation (a model, or a discriminated union of models), internal ones left
    out."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [] if is_internal(annotation) else [annotation]
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _sections(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _sections(arg)]
    return []


def _type_name(annotation: Any) -> str:
    return annotation.__name__ if isinstance(annotation, type) else str(annotation).replace("typing.", "")


def _walk(model: type[BaseModel], prefix: str, lines: list[str]) -> None:
    for name, field in model.model_fields.items():
        if is_internal(field):
            continue
        key = f"{prefix}{name}"
        is_list = typing.get_origin(field.annotation) is list  # an array of tables, e.g. [[reward.components]]
        sections = _sections(typing.get_args(field.annotation)[0] if is_list else field.annotation)
        if sections:
            if is_list and field.description:
                lines.append(f"  {key}: list = []")
                lines.append(f"      {' '.join(field.description.split())}")
            for section in sections:
                tag = section.model_fields.get("type")
                variant = f" (type = {tag.default!r})" if tag is not None and len(sections) > 1 else ""
                lines.append(f"[[{key}]]{variant}" if is_list else f"[{key}]{variant}")
                _walk(section, f"{key}.", lines)
            continue
        if field.default is not PydanticUndefined:
            default = repr(field.default)
        elif field.default_factory is not None:
            default = repr(field.default_factory())  # type: ignore[call-arg]
        else:
            default = "required"
        lines.append(f"  {key}: {_type_name(field.annotation)} = {default}")
        if field.description:
            lines.append(f"      {' '.join(field.description.split())}")


def describe_keys() -> str:
    lines: list[str] = []
    _walk(SharpenConfig, "", lines)
    return "\n".join(lines)
