"""The candidate's side of a code grading: runs INSIDE the candidate's sandbox, as ``main.py``, beside the
candidate program (``solution.py``) and the value encoding (``_sharpen_values.py``).

It holds nothing worth stealing: no test, no expected value, no verdict, no secret. It imports the candidate,
says which names it defines, then answers calls the host sends, one line each way: a call
``{"id", "call", "args", "kwargs"}`` is answered ``{"id", "value"}``, ``{"id", "raised": {"type", "message"}}``
or ``{"id", "unencodable": type name}``. The candidate shares this process and may rewrite all of it; it then only
chooses what it answers, which is what it could do anyway by computing it. The host checks every answer it reads.

The protocol uses private copies of stdin and stdout; the candidate's own fds 0 and 1 are /dev/null and stderr, so
its prints cannot garble an answer by accident. Standard library only (it runs under /usr/bin/python3); sharpen
reads this file as text and never imports it.
"""

import contextlib
import importlib
import json
import os
import sys

import _sharpen_values as values  # pyright: ignore[reportMissingImports]  # shipped beside us by the grader

_MESSAGE_CHARS = 300


def _channel() -> tuple[object, int]:
    """Private copies of stdin and stdout for the protocol; fds 0 and 1 become /dev/null and stderr."""
    reader = os.fdopen(os.dup(0), "rb")
    writer = os.dup(1)
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    return reader, writer


def _send(fd: int, message: dict) -> None:
    data = (json.dumps(message, separators=(",", ":")) + "\n").encode()
    while data:
        data = data[os.write(fd, data) :]


def _describe(error: BaseException) -> dict:
    try:
        text = str(error)[:_MESSAGE_CHARS]
    except Exception:  # a __str__ of the candidate's that raises
        text = ""
    return {"type": type(error).__name__[:100], "message": text}


def _names(module: object) -> dict:
    """The module's callables and plain values, as the checker's stand-in module will show them."""
    callables, plain = [], {}
    for name, value in list(vars(module).items()):
        if name.startswith("__"):
            continue
        if callable(value):
            callables.append(name)
            continue
        with contextlib.suppress(values.Unencodable):  # imported modules and the like: nothing a test compares
            plain[name] = values.encode(value)
    return {"callables": callables, "values": plain}


def _answer(module: object, request: dict) -> dict:
    reply: dict = {"id": request.get("id")}
    try:
        function = vars(module)[request["call"]]
        args = values.decode(request["args"])
        kwargs = {key: values.decode(tree) for key, tree in request["kwargs"].items()}
    except Exception as error:
        return reply | {"raised": _describe(error)}
    try:
        result = function(*args, **kwargs)
    except Exception as error:
        return reply | {"raised": _describe(error)}
    try:
        return reply | {"value": values.encode(result), "overrides_eq": values.overrides_eq(result)}
    except values.Unencodable as error:
        return reply | {"unencodable": error.type_name[:100]}


def main() -> None:
    reader, writer = _channel()
    sys.argv = ["solution.py"]
    try:
        module = importlib.import_module("solution")
    except Exception as error:
        _send(writer, {"ready": True, "import_error": _describe(error), "callables": [], "values": {}})
        return
    _send(writer, {"ready": True, "import_error": None, **_names(module)})
    for line in reader:  # type: ignore[attr-defined]
        _send(writer, _answer(module, json.loads(line)))


if __name__ == "__main__":
    main()
