"""The sandbox service's wire format: files, stdin, session lines, `ExecutionResult` and `IsolationReport` as JSON.

Owns the encoding both sides share (service.py, remote.py): text travels as text, bytes as base64, so that what the
program gets and what the caller gets back are exactly what an in-process `Sandbox` would give. Does no I/O.
"""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Mapping
from typing import Any

from sharpen.environments.sandbox.result import ExecutionResult, ExecutionStatus, IsolationReport


class WireError(ValueError):
    """A request or answer that is not in the sandbox service's format."""


def encode_data(data: str | bytes) -> dict[str, str]:
    if isinstance(data, str):
        return {"text": data}
    return {"base64": base64.b64encode(data).decode()}


def decode_data(value: Any, *, where: str) -> str | bytes:
    if isinstance(value, dict):
        if isinstance(value.get("text"), str):
            return str(value["text"])  # pyright: ignore[reportUnknownArgumentType]
        if isinstance(value.get("base64"), str):
            try:
                return base64.b64decode(str(value["base64"]), validate=True)  # pyright: ignore[reportUnknownArgumentType]
            except ValueError:
                raise WireError(f"{where}: base64 that does not decode") from None
    raise WireError(f'{where}: expected {{"text": str}} or {{"base64": str}}')


def encode_files(files: Mapping[str, str | bytes]) -> dict[str, dict[str, str]]:
    return {name: encode_data(data) for name, data in files.items()}


def decode_files(value: Any) -> dict[str, str | bytes]:
    if not isinstance(value, dict):
        raise WireError("files: expected an object of name -> data")
    return {str(name): decode_data(data, where=f"files[{name!r}]") for name, data in value.items()}  # pyright: ignore[reportUnknownVariableType]


def encode_line(line: bytes | None) -> str | None:
    return None if line is None else base64.b64encode(line).decode()


def decode_line(value: Any) -> bytes | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise WireError("a session line must be base64 text or null")
    return base64.b64decode(value)


def encode_result(result: ExecutionResult) -> dict[str, Any]:
    return {**dataclasses.asdict(result), "status": result.status.value}


def decode_result(value: dict[str, Any]) -> ExecutionResult:
    try:
        return ExecutionResult(**{**value, "status": ExecutionStatus(value["status"])})
    except (KeyError, TypeError, ValueError) as error:
        raise WireError(f"not an execution result: {error}") from None


def encode_report(report: IsolationReport) -> dict[str, Any]:
    return {"backend": report.backend, "level": report.level, "missing": list(report.missing)}


def decode_report(value: dict[str, Any]) -> IsolationReport:
    return IsolationReport(backend=value["backend"], level=value["level"], missing=tuple(value["missing"]))
