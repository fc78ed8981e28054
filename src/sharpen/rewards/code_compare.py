"""How a function case's result is compared with its expected value: in JSON's data model, with JSON's types.

A case's ``expected`` is almost always JSON that a reference solution's output was written to, so the candidate's
result is compared as its own JSON would be compared with that JSON, never with Python's ``==`` on the raw values:
- **a boolean is never a number**: ``True`` is not ``1`` and ``False`` is not ``0`` (JSON has its own ``true`` and
  ``false``; Python's ``True == 1`` would let a predicate stand in for a count, and ``0 == False`` the reverse);
- **numbers compare by value**: ``3 == 3.0`` (JSON has one number type; writers differ on ``3`` vs ``3.0``);
- **a sequence is an array**: a tuple equals the list with the same items (JSON has no tuples);
- **object keys are strings**: ``{1: "a"}`` equals ``{"1": "a"}``, on both sides alike (``json.dumps`` writes the
  key ``1`` as ``"1"``, ``True`` as ``"true"``, ``None`` as ``"null"``); a dict whose keys collide so (``{1: .., "1":
  ..}``) has no JSON form and equals nothing.
What JSON cannot hold (sets, bytes, complex, Fraction, Decimal, tuple keys) came from metadata written in Python
and keeps Python's comparison, except that a boolean still never equals a number at any depth of a list or dict.

Owns only this comparison; reading the result from the candidate is `code_grading`'s, and the tests of HumanEval
problems and pytest files keep their own ``==`` (they are Python, written against Python values).
"""

from __future__ import annotations

from typing import Any

_NO_KEY = object()


def matches_expected(value: Any, expected: Any) -> bool:
    """True when ``value`` (a candidate's result, rebuilt from plain values) equals ``expected`` under the rules of
    this module's docstring."""
    if isinstance(value, bool) or isinstance(expected, bool):
        return isinstance(value, bool) and isinstance(expected, bool) and value == expected
    if isinstance(value, list | tuple) or isinstance(expected, list | tuple):
        return (
            isinstance(value, list | tuple)
            and isinstance(expected, list | tuple)
            and len(value) == len(expected)
            and all(matches_expected(item, wanted) for item, wanted in zip(value, expected, strict=True))
        )
    if isinstance(value, dict) or isinstance(expected, dict):
        if not (isinstance(value, dict) and isinstance(expected, dict)):
            return False
        got, wanted = _json_object(value), _json_object(expected)
        if got is None or wanted is None or got.keys() != wanted.keys():
            return False
        return all(matches_expected(got[key], wanted[key]) for key in wanted)
    return bool(value == expected)  # builtin values only: code_values rebuilt them, no candidate __eq__ runs


def _json_object(mapping: dict[Any, Any]) -> dict[Any, Any] | None:
    """``mapping`` with its keys as JSON writes them; None when two keys become one."""
    out: dict[Any, Any] = {}
    for key, item in mapping.items():
        json_key = _json_key(key)
        if json_key in out:
            return None
        out[json_key] = item
    return out


def _json_key(key: Any) -> Any:
    """The object key ``json.dumps`` writes for ``key``; a key JSON cannot write is kept, tagged by its type so that
    no two kinds meet."""
    if key is None:
        return "null"
    if isinstance(key, bool):
        return "true" if key else "false"
    if isinstance(key, str):
        return key
    if isinstance(key, int):
        return str(int(key))
    if isinstance(key, float):
        return float.__repr__(key) if key == key and abs(key) != float("inf") else _nonfinite(key)
    return (_NO_KEY, type(key).__name__, key)


def _nonfinite(key: float) -> str:
    return "NaN" if key != key else ("Infinity" if key > 0 else "-Infinity")
