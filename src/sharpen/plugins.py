"""Loading the user's own code named in a config: ``path/to/file.py:name`` or ``package.module:name``.

Owns finding the module (importing a file by path, or a module by name) and returning the named object, so a custom
environment, its task function and a custom reward component are all loaded the same way, with the same errors, and
checking at start that the object can be called as the caller will call it (`check_call`). It imports nothing from
sharpen and does not check what the object returns: the caller that uses it does.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


class PluginLoadError(ValueError):
    """A user's object named in the config cannot be loaded; the message is one line that says which and why."""


def load_object(spec: str, *, what: str) -> Any:
    """The object named by ``path/to/file.py:name`` (a path relative to the working directory, or absolute) or
    ``package.module:name``. ``what`` names the config key in error messages (e.g. ``environment.factory``).

    A file is imported once per process under a name derived from its resolved path, so two files with the same
    name in different folders do not shadow each other, and dataclasses and pickle find the module by that name."""
    location, _, name = spec.rpartition(":")
    if not location or not name:
        raise PluginLoadError(f"{what} = {spec!r}: expected 'path/to/file.py:Name' or 'package.module:Name'")
    try:
        module = _import_file(location, spec=spec, what=what) if location.endswith(".py") else _import(location)
    except (ImportError, SyntaxError) as error:
        raise PluginLoadError(f"{what} = {spec!r}: cannot import it ({type(error).__name__}: {error})") from error
    if not hasattr(module, name):
        raise PluginLoadError(f"{what} = {spec!r}: {location} has no attribute {name!r}")
    return getattr(module, name)


def check_call(target: object, args: tuple[str, ...], kwargs: dict[str, Any], *, what: str) -> Callable[..., Any]:
    """``target`` when it is callable and ``target(*args, **kwargs)`` would bind (``args`` are the names of the
    positional arguments the caller will pass); else a `PluginLoadError` now, naming the missing or misspelt
    argument, instead of a TypeError on the first call."""
    if not callable(target):
        raise PluginLoadError(f"{what} is not callable (type {type(target).__name__})")
    try:
        signature = inspect.signature(target)
    except ValueError:  # some callables (builtins, C extensions) have no signature to check against
        return target
    try:
        signature.bind(*args, **kwargs)
    except TypeError as error:
        call = ", ".join([*args, *(f"{key}=..." for key in kwargs)])
        raise PluginLoadError(f"{what} cannot be called ({call}): {error}") from error
    return target


def _import(module_name: str) -> Any:
    return importlib.import_module(module_name)


def _import_file(location: str, *, spec: str, what: str) -> Any:
    path = Path(location).resolve()
    if not path.is_file():
        raise PluginLoadError(f"{what} = {spec!r}: no file {path}")
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:8]
    module_name = f"sharpen_user_{path.stem}_{digest}"
    module = sys.modules.get(module_name)
    if module is not None:
        return module
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    assert module_spec is not None and module_spec.loader is not None  # a .py file always has a source loader
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # before executing it: dataclasses and pickling look modules up by name
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]  # a file that failed to run is not cached half-initialised
        raise
    return module
