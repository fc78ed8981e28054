"""The code-test rewards' own tests (test_code_tests.py) again, every one that uses a sandbox given a remote one: a
`RemoteSandbox` over an in-process `sharpen serve-sandbox` service with the same limits. The candidate's session and
the checker's session live on the service and the relay between them runs here, over HTTP."""

from __future__ import annotations

import inspect
import shutil
from collections.abc import Iterator
from contextlib import ExitStack

import pytest
import test_code_tests

from sharpen.config.sandbox import SandboxConfig
from sharpen.environments.sandbox import SandboxPool
from sharpen.environments.sandbox.remote import RemoteSandbox
from sharpen.environments.sandbox.service import SandboxService
from sharpen.rewards.code_tests import pytest_ro_binds

TOKEN = "code-tests-remote-token"

for _name, _test in vars(test_code_tests).items():
    if _name.startswith("test_") and "sandbox" in inspect.signature(_test).parameters:
        globals()[_name] = _test


@pytest.fixture(scope="module")
def sandbox() -> Iterator[RemoteSandbox]:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (make system-deps)")
    config = SandboxConfig(
        backend="bwrap", wall_seconds=4.0, cpu_seconds=4, memory_mb=256, extra_ro_binds=pytest_ro_binds()
    )
    with ExitStack() as stack, pytest.MonkeyPatch.context() as patch:
        patch.setenv("SHARPEN_SERVICE_TOKEN", TOKEN)
        pool = stack.enter_context(SandboxPool(config))
        service = stack.enter_context(SandboxService(config, pool=pool, token=TOKEN))
        remote = SandboxConfig(backend="remote", wall_seconds=4.0, remote={"urls": [service.url]})
        yield stack.enter_context(RemoteSandbox(remote))
