"""The base of every config section: unknown keys are errors, a field's docstring is its help text.

`internal` marks a field (or a whole section chosen by ``type``) that users do not set: a knob for tests, or one
the runtime derives. It stays settable (tests and the resolved config use it) but `sharpen config --keys` does not
list it, so the listing is the set of choices a user makes.
"""

from __future__ import annotations

import warnings
from typing import Any, cast

from pydantic import BaseModel, ConfigDict
from pydantic.fields import FieldInfo

INTERNAL_KEY = "internal"


class DeprecatedKeyWarning(FutureWarning):
    """A recipe uses a key or a value that was renamed or moved; the message says what to write instead (the CLI
    prints it as one ``sharpen:`` line)."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


def rename_keys(data: Any, renamed: dict[str, str], *, section: str) -> Any:
    """A ``mode="before"`` validator's body: ``data`` (a section's raw table) with each old key of ``renamed`` moved
    to its new name and one deprecation line per moved key; a table that gives both names is an error."""
    if not isinstance(data, dict):
        return data
    table = dict(cast(dict[str, Any], data))
    for old, new in renamed.items():
        if old not in table:
            continue
        if new in table:
            raise ValueError(f"{old} is the old name of {new}: give only {new}")
        table[new] = table.pop(old)
        warnings.warn(f"{section}.{old} is now called {new}: write {new}", DeprecatedKeyWarning, stacklevel=3)
    return table


def internal() -> dict[str, Any]:
    """``json_schema_extra`` of an internal field or section: ``Field(..., json_schema_extra=internal())``, or
    ``model_config = ConfigDict(..., json_schema_extra=internal())`` on a section."""
    return {INTERNAL_KEY: True}


def is_internal(item: FieldInfo | type[BaseModel]) -> bool:
    """Whether a field or a section is marked `internal`."""
    extra = item.json_schema_extra if isinstance(item, FieldInfo) else item.model_config.get("json_schema_extra")
    if not isinstance(extra, dict):  # unset, or a callable (not how `internal` marks)
        return False
    return cast("dict[str, object]", extra).get(INTERNAL_KEY) is True
