"""The set of config keys is frozen in config_keys.txt, as the CLI's flags are in test_cli_main.py: a new, renamed or
removed key is a decision that shows in review, not a side effect.

A key is the dotted path to a value: `SharpenConfig` is walked through every sub-section and every member of a union
of sections, the member named by its discriminator, e.g. ``rollout.engine[vllm].gpu_memory_utilization``. Keys of a
list of sections (``[[reward.components]]``) are written like a single section's. Internal fields count: they are
settable. Only names are pinned, not types or defaults.
"""

from __future__ import annotations

import os
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field
from pydantic.fields import FieldInfo

from sharpen.config.schema import SharpenConfig

KEYS_FILE = Path(__file__).with_name("config_keys.txt")
WRITE = "SHARPEN_WRITE_CONFIG_KEYS"


def _arms(annotation: Any) -> tuple[list[Any], str | None]:
    """The types an annotation allows (unions and Annotated, list[...] and dict[str, ...] unwrapped) and the
    discriminator an Annotated[..., Field(discriminator=...)] names."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        inner, *metadata = typing.get_args(annotation)
        arms, discriminator = _arms(inner)
        for item in metadata:
            if isinstance(item, FieldInfo) and isinstance(item.discriminator, str):
                discriminator = item.discriminator
        return arms, discriminator
    if origin in (typing.Union, types.UnionType):
        arms, discriminator = [], None
        for arg in typing.get_args(annotation):
            sub, sub_discriminator = _arms(arg)
            arms += sub
            discriminator = discriminator or sub_discriminator
        return arms, discriminator
    if origin in (list, tuple, set, frozenset, dict) and any(_is_section(a) for a in _flat(annotation)):
        return _arms(typing.get_args(annotation)[-1])
    return [annotation], None


def _flat(annotation: Any) -> list[Any]:
    args = typing.get_args(annotation)
    return [annotation] if not args else [leaf for arg in args for leaf in _flat(arg)]


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _tag(section: type[BaseModel], discriminator: str) -> str:
    field = section.model_fields.get(discriminator)
    if field is None:
        return section.__name__
    values = typing.get_args(field.annotation)
    return "|".join(str(v) for v in values) if values else str(field.default)


def config_keys(model: type[BaseModel] = SharpenConfig, prefix: str = "", seen: tuple[type, ...] = ()) -> set[str]:
    """Every dotted key under ``model``."""
    keys: set[str] = set()
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        arms, discriminator = _arms(field.annotation)
        discriminator = field.discriminator if isinstance(field.discriminator, str) else discriminator
        sections = [arm for arm in arms if _is_section(arm) and arm not in (*seen, model)]  # no endless recursion
        if len(sections) < len([arm for arm in arms if arm is not type(None)]):
            keys.add(key)  # a value (or a value or a section)
        for section in sections:
            tag = f"[{_tag(section, discriminator or 'type')}]" if len(sections) > 1 else ""
            keys |= config_keys(section, f"{key}{tag}.", (*seen, model))
    return keys


def test_config_keys_are_frozen():
    keys = sorted(config_keys())
    if os.environ.get(WRITE) == "1":
        KEYS_FILE.write_text("".join(f"{key}\n" for key in keys))
    frozen = KEYS_FILE.read_text().split()
    added, removed = sorted(set(keys) - set(frozen)), sorted(set(frozen) - set(keys))
    assert keys == frozen, (
        f"the config's keys changed (added: {added}, removed: {removed}). If that is deliberate, regenerate "
        f"{KEYS_FILE.name} with `{WRITE}=1 .venv/bin/python -m pytest tests/unit/test_config_keys.py` and commit it "
        "with the change."
    )


class _Leaf(BaseModel):
    x: int = 0


class _A(BaseModel):
    type: typing.Literal["a"] = "a"
    alpha: float = 0.0


class _B(BaseModel):
    type: typing.Literal["b"] = "b"
    inner: _Leaf = _Leaf()


class _Root(BaseModel):
    plain: int = 0
    section: _Leaf = _Leaf()
    optional: _Leaf | None = None
    choice: typing.Annotated[_A | _B, Field(discriminator="type")] = _A()
    many: list[typing.Annotated[_A | _B, Field(discriminator="type")]] = []
    names: list[str] = []


def test_the_walker_follows_sections_unions_and_lists():
    assert config_keys(_Root) == {
        "plain",
        "section.x",
        "optional.x",
        "choice[a].type",
        "choice[a].alpha",
        "choice[b].type",
        "choice[b].inner.x",
        "many[a].type",
        "many[a].alpha",
        "many[b].type",
        "many[b].inner.x",
        "names",
    }
    assert "rollout.engine[vllm].gpu_memory_utilization" in config_keys()
