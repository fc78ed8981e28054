"""What the code graders' red-team tests share: one bubblewrap sandbox per test module, with pytest's files
readable (a module that needs other limits defines its own ``sandbox``)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from sharpen.config.sandbox import SandboxConfig
from sharpen.environments.sandbox import Sandbox
from sharpen.rewards import code_tests  # not its pytest_ro_binds by name: a conftest name pytest_* is a hook


@pytest.fixture(scope="module")
def sandbox() -> Iterator[Sandbox]:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (make system-deps)")
    config = SandboxConfig(
        backend="bwrap", wall_seconds=3.0, cpu_seconds=3, memory_mb=256, extra_ro_binds=code_tests.pytest_ro_binds()
    )
    with Sandbox(config) as box:
        yield box
