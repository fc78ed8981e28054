"""Plain values as typed JSON: the only thing that crosses between a candidate program and the code grader.

Owns one encoding, used on all three sides of a grading (the candidate's runner and the checker inside their
sandboxes, the relay on the host): ``dumps(value)`` turns a value built of the types below into one line of JSON,
and ``loads(line)`` rebuilds a fresh value of exactly those types, or raises `ValueError`. Nothing else can be
rebuilt: no class of the candidate's, no object with a method of its own, so an ``==`` on the grader's side always
runs the builtin comparison of builtin values. Standard library only, and no sharpen import: the grader ships this
file's text into the sandbox, where it is imported as ``_sharpen_values``.

JSON null, booleans, strings, finite floats, small integers and arrays are themselves; every other value is an
object with one key naming its type: ``{"int": hex}`` (beyond 2**53), ``{"float": "nan" | "inf" | "-inf"}``,
``{"tuple": [...]}``, ``{"dict": [[k, v], ...]}``, ``{"set": [...]}``, ``{"frozenset": [...]}``, ``{"bytes": b64}``,
``{"complex": [re, im]}``, ``{"fraction": [hex, hex]}``, ``{"decimal": text}``, ``{"counter": [[k, n], ...]}``,
``{"ordereddict": [[k, v], ...]}``, ``{"deque": [...]}``.

Encoding reads a value through the builtin types' own methods (``dict.items(value)``, not ``value.items()``), so a
subclass of a builtin (an ``IntEnum``, a namedtuple, a ``str`` whose ``__eq__`` lies) becomes the plain value it
holds; ``overrides_eq`` tells whether such a subclass overrode ``==`` (a sign of an always-equal attempt).
"""

from __future__ import annotations

import base64
import collections
import decimal
import fractions
import json
import math
from typing import Any

MAX_DEPTH = 64
"""Nesting deeper than this is refused both ways (a recursion bomb in a result)."""
_SAFE_INT = 1 << 53
_Counter, _OrderedDict, _defaultdict, _deque = (
    collections.Counter,
    collections.OrderedDict,
    collections.defaultdict,
    collections.deque,
)
_Fraction, _Decimal = fractions.Fraction, decimal.Decimal


class Unencodable(TypeError):
    """The value holds something that is not a plain value (``type_name`` says what)."""

    def __init__(self, type_name: str) -> None:
        super().__init__(f"a {type_name} is not a plain value")
        self.type_name = type_name


def _float(value: float) -> Any:
    if math.isfinite(value):
        return value
    return {"float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}


def _int(value: int) -> Any:
    return value if -_SAFE_INT < value < _SAFE_INT else {"int": hex(value)}


def _pairs(items: Any, depth: int) -> list[list[Any]]:
    return [[encode(key, depth + 1), encode(item, depth + 1)] for key, item in items]


def encode(value: Any, depth: int = 0) -> Any:
    """The JSON tree of ``value``; raises `Unencodable` for anything that is not a plain value."""
    if depth > MAX_DEPTH:
        raise Unencodable("value nested deeper than 64")
    kind = type(value)
    if value is None or kind is bool or kind is str:
        return value
    if kind is int:
        return _int(value)
    if kind is float:
        return _float(value)
    if kind is _Counter:
        return {"counter": _pairs(dict.items(value), depth)}
    if kind is _OrderedDict:
        return {"ordereddict": _pairs(dict.items(value), depth)}
    if kind is _deque:
        return {"deque": [encode(item, depth + 1) for item in _deque.__iter__(value)]}
    if kind is _Fraction:
        return {"fraction": [hex(value.numerator), hex(value.denominator)]}
    if kind is _Decimal:
        return {"decimal": _Decimal.__str__(value)}
    # Subclasses of builtins, read as the builtin value they hold (their own methods never run).
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return _int(int.__int__(value))
    if isinstance(value, float):
        return _float(float.__float__(value))
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bytes | bytearray):
        return {"bytes": base64.b64encode(bytes(memoryview(value))).decode()}
    if isinstance(value, complex):
        return {"complex": [_float(complex.real.__get__(value)), _float(complex.imag.__get__(value))]}
    if isinstance(value, tuple):
        return {"tuple": [encode(item, depth + 1) for item in tuple.__iter__(value)]}
    if isinstance(value, list):
        return [encode(item, depth + 1) for item in list.__iter__(value)]
    if isinstance(value, dict):  # defaultdict and other dict subclasses compare as dicts
        return {"dict": _pairs(dict.items(value), depth)}
    if isinstance(value, frozenset):
        return {"frozenset": [encode(item, depth + 1) for item in frozenset.__iter__(value)]}
    if isinstance(value, set):
        return {"set": [encode(item, depth + 1) for item in set.__iter__(value)]}
    raise Unencodable(getattr(kind, "__qualname__", "object"))


def overrides_eq(value: Any, depth: int = 0) -> bool:
    """True when ``value`` holds an object of a non-builtin class that defines its own ``__eq__``."""
    if depth > MAX_DEPTH:
        return False
    kind = type(value)
    if kind.__module__ not in ("builtins", "collections", "fractions", "decimal") and "__eq__" in _own_attrs(kind):
        return True
    bases: tuple[Any, ...] = (list, tuple, set, frozenset, _deque)
    for base in bases:
        if isinstance(value, base):
            items: Any = base.__iter__(value)  # the builtin's own iterator, never a subclass's
            return any(overrides_eq(item, depth + 1) for item in items)
    if isinstance(value, dict):
        return any(overrides_eq(k, depth + 1) or overrides_eq(v, depth + 1) for k, v in dict.items(value))
    return False


def _own_attrs(kind: type) -> set[str]:
    names: set[str] = set()
    for klass in kind.__mro__:
        if klass.__module__ != "builtins":
            names.update(vars(klass))
    return names


def dumps(value: Any) -> str:
    """One line of JSON for ``value`` (`Unencodable` for what is not a plain value)."""
    return json.dumps(encode(value), allow_nan=False, separators=(",", ":"))


def _number(item: Any) -> float:
    if type(item) in (int, float):
        return float(item)
    return decode(item)  # a tagged float (nan, inf)


def _hex_int(text: Any) -> int:
    if type(text) is not str or len(text) > 1 << 16:
        raise ValueError("a big integer is a hex string")
    return int(text, 16)


def decode(tree: Any, depth: int = 0) -> Any:
    """The value of a JSON tree that `encode` made; ValueError for anything else."""
    if depth > MAX_DEPTH:
        raise ValueError("value nested deeper than 64")
    kind = type(tree)
    if tree is None or kind in (bool, str, int, float):
        if isinstance(tree, float) and not math.isfinite(tree):
            raise ValueError("a non-finite float must be tagged")
        return tree
    if kind is list:
        return [decode(item, depth + 1) for item in tree]
    if kind is not dict or len(tree) != 1:
        raise ValueError(f"not an encoded value: {kind.__name__}")
    ((tag, body),) = tree.items()
    items = body if type(body) is list else None
    if tag == "int":
        return _hex_int(body)
    if tag == "float" and body in ("nan", "inf", "-inf"):
        return float(body)
    if tag == "decimal" and type(body) is str and len(body) <= 1 << 12:
        return _Decimal(body)
    if tag == "bytes" and type(body) is str:
        return base64.b64decode(body, validate=True)
    if items is None:
        raise ValueError(f"not an encoded value: tag {tag!r}")
    if tag in ("dict", "counter", "ordereddict"):
        mapping = dict(_pair(item, depth) for item in items)
        return {"dict": dict, "counter": _Counter, "ordereddict": _OrderedDict}[tag](mapping)
    if tag == "complex" and len(items) == 2:
        return complex(_number(items[0]), _number(items[1]))
    if tag == "fraction" and len(items) == 2:
        return _Fraction(_hex_int(items[0]), _hex_int(items[1]))
    values = [decode(item, depth + 1) for item in items]
    if tag == "tuple":
        return tuple(values)
    if tag == "set":
        return set(values)
    if tag == "frozenset":
        return frozenset(values)
    if tag == "deque":
        return _deque(values)
    raise ValueError(f"not an encoded value: tag {tag!r}")


def _pair(item: Any, depth: int) -> tuple[Any, Any]:
    if type(item) is not list or len(item) != 2:
        raise ValueError("a mapping entry is a [key, value] pair")
    return decode(item[0], depth + 1), decode(item[1], depth + 1)


def loads(line: str | bytes) -> Any:
    """The value of one line that `dumps` made; ValueError (never anything else) when it is not one."""
    try:
        return decode(json.loads(line))
    except (ValueError, TypeError, RecursionError, ZeroDivisionError, decimal.DecimalException) as error:
        raise ValueError(f"not an encoded value: {error}") from None
