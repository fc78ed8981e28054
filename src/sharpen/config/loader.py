"""Load a recipe: TOML file + dotted command-line overrides -> validated `SharpenConfig`.

Errors are raised as `ConfigError` with one line per problem, each naming the dotted key, so the CLI can print
them without a traceback.
"""

from __future__ import annotations

import difflib
import json
import tomllib
from pathlib import Path
from typing import Any, cast, get_args

from pydantic import BaseModel, ValidationError

from sharpen.config.advantages import AdvantageConfig
from sharpen.config.corrections import CorrectionConfig
from sharpen.config.engines import EngineConfig
from sharpen.config.environments import EnvironmentConfig
from sharpen.config.kl import KLConfig
from sharpen.config.legacy_keys import MOVED_ALGORITHM_KEYS, TYPED_SECTIONS
from sharpen.config.policy_losses import PolicyLossConfig
from sharpen.config.rewards import RewardComponentConfig
from sharpen.config.schema import DataConfig, SharpenConfig


class ConfigError(ValueError):
    """A recipe or override that cannot become a valid config; the message is meant for the user."""


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"trainer.learning_rate=1e-5"`` -> (["trainer", "learning_rate"], 1e-5). Values are read as TOML, else str."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r}: expected KEY=VALUE, e.g. trainer.learning_rate=1e-5")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip().split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for depth, part in enumerate(path[:-1]):
            child: Any = node.setdefault(part, {})
            if isinstance(child, str) and tuple(path[:depth]) == ("trainer", "algorithm") and part in TYPED_SECTIONS:
                child = node[part] = {"type": child}  # a section given by its name alone, tuned by the override
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {part!r} is a value, not a section")
            node = cast(dict[str, Any], child)
        node[path[-1]] = value
    return data


def _known_keys(model: type[BaseModel], loc: tuple[str | int, ...]) -> tuple[list[str], dict[str, list[str]]]:
    """Field names of the section at ``loc`` (pydantic's location, union tags included), and when that section is
    a member of a discriminated union, the fields of every member by tag (best effort, for 'did you mean' hints)."""
    current: Any = model
    members: dict[str, Any] = {}
    parts = list(loc[:-1])
    while parts:
        part = parts.pop(0)
        fields = getattr(current, "model_fields", None)
        if fields is None or part not in fields:
            return [], {}
        annotation = fields[part].annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            current, members = annotation, {}
            continue
        members = {tag: member for member in get_args(annotation) if (tag := _tag(member)) is not None}
        tag = parts.pop(0) if parts else None
        if not isinstance(tag, str) or tag not in members:
            return [], {}
        current = members[tag]
    return list(getattr(current, "model_fields", {})), {tag: list(m.model_fields) for tag, m in members.items()}


def _tag(member: object) -> str | None:
    """The ``type`` value of a discriminated union's member; None for anything else."""
    fields = getattr(member, "model_fields", None)
    if not isinstance(fields, dict) or "type" not in fields:
        return None
    tags = get_args(cast(Any, fields["type"]).annotation)
    return str(tags[0]) if len(tags) == 1 else None


def _suggest(loc: tuple[str | int, ...]) -> str:
    """' (did you mean ...?)' for an unknown key at ``loc``, or ''. A key of another member of the same union
    names the types that have it; a flat key of an older ``[trainer.algorithm]`` is pointed to where it moved."""
    known, members = _known_keys(SharpenConfig, loc)
    key = str(loc[-1])
    owners = sorted(tag for tag, fields in members.items() if key in fields)
    if owners:
        return f" (it belongs to type = {' or '.join(repr(tag) for tag in owners)})"
    is_algorithm = tuple(loc[:-1]) == ("trainer", "algorithm")
    hint = difflib.get_close_matches(key, known + list(MOVED_ALGORITHM_KEYS) if is_algorithm else known, n=1)
    if not hint:
        return ""
    suggestion = MOVED_ALGORITHM_KEYS.get(hint[0], hint[0]) if is_algorithm else hint[0]
    return f" (did you mean {suggestion!r}?)"


_MOVED_KEYS = {"environment.sandbox": "sandbox", "reward.sandbox": "sandbox"}
"""Keys that moved, and where to: an older recipe's error then says what to change (the python environment and
the code-test rewards share one sandbox section)."""


def format_validation_error(error: ValidationError) -> str:
    lines: list[str] = []
    for item in error.errors():
        # a tag is dropped where pydantic inserts it, after a section's name; the first part is a section's name
        loc = tuple(
            part for i, part in enumerate(item["loc"]) if not (i and isinstance(part, str) and part in _UNION_TAGS)
        )
        key = ".".join(str(part) for part in loc) or "<config>"
        if item["type"] == "extra_forbidden":
            suggestion = _suggest(item["loc"])
            if key in _MOVED_KEYS:
                suggestion = f" (it moved to [{_MOVED_KEYS[key]}])"
            lines.append(f"{key}: unknown key{suggestion}")
        elif item["type"] == "union_tag_not_found":
            lines.append(f"{key}: missing key 'type' (it chooses the implementation)")
        elif item["type"] == "value_error":
            lines.append(f"{key}: {item['msg'].removeprefix('Value error, ')}" if loc else item["msg"][13:])
        else:
            lines.append(f"{key}: {item['msg']} (got {json.dumps(item.get('input'), default=str)})")
    return "\n".join(lines)


def _discriminator_tags(*unions: object) -> set[str]:
    """The ``type`` values of the discriminated unions' members: pydantic puts them into error locations."""
    tags: set[str] = set()
    for union in unions:
        for member in get_args(get_args(union)[0]):
            tags.update(get_args(member.model_fields["type"].annotation))
    return tags


_UNION_TAGS = _discriminator_tags(
    DataConfig,
    EngineConfig,
    EnvironmentConfig,
    RewardComponentConfig,
    AdvantageConfig,
    PolicyLossConfig,
    CorrectionConfig,
    KLConfig,
)


def fill_default_types(data: dict[str, Any], model: type[BaseModel] = SharpenConfig) -> dict[str, Any]:
    """A section chosen by a ``type`` discriminator that leaves ``type`` out means its default implementation
    (``data.task=chain_sum`` tunes the default reasoning-gym source); pydantic would reject it as 'unable to
    extract tag'."""
    for name, field in model.model_fields.items():
        if not isinstance(data.get(name), dict):
            continue
        section: dict[str, Any] = data[name]
        if field.discriminator == "type":
            section.setdefault("type", field.get_default(call_default_factory=True).type)
        elif isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            fill_default_types(section, field.annotation)
    return data


def build_config(data: dict[str, Any]) -> SharpenConfig:
    data = fill_default_types(data)
    try:
        return SharpenConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(format_validation_error(error)) from None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> SharpenConfig:
    """Read a TOML recipe (or start from the defaults when ``path`` is None) and apply dotted overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        recipe = Path(path)
        if not recipe.is_file():
            raise ConfigError(f"recipe {str(recipe)!r} does not exist")
        try:
            data = tomllib.loads(recipe.read_text())
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"recipe {str(recipe)!r} is not valid TOML: {error}") from None
    return build_config(apply_overrides(data, overrides or []))


def dump_config(config: SharpenConfig) -> str:
    """The resolved config as TOML (what a run directory keeps)."""
    import tomli_w

    return tomli_w.dumps(config.model_dump(mode="json", exclude_none=True))
