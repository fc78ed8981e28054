"""The base of every config section: unknown keys are errors, a field's docstring is its help text.

`internal` marks a field (or a whole section chosen by ``type``) that users do not set: a knob for tests, or one
the runtime derives. It stays settable (tests and the resolved config use it) but `sharpen config --keys` does not
list it, so the listing is the set of choices a user makes.
"""

from __future__ import annotations

from typing import Any, cast

from pydantic import BaseModel, ConfigDict
from pydantic.fields import FieldInfo

INTERNAL_KEY = "internal"


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


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
