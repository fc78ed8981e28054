"""`sharpen serve-sandbox` and `sharpen serve-env`: one clear line for what a user must fix (no token, a recipe that
would serve a remote component, no recipe), and a real serve-sandbox process answering its probes and runs."""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import sys

import httpx
import pytest

from sharpen.cli.main import EXIT_USER_ERROR, main
from sharpen.config.sandbox import SandboxConfig
from sharpen.config.service import RemoteConfig
from sharpen.environments.base import EpisodeContext
from sharpen.environments.remote import RemoteEnvironmentFactory
from sharpen.environments.sandbox import ExecutionStatus
from sharpen.environments.sandbox.remote import RemoteSandbox
from sharpen.types import Example, Message

TOKEN = "cli-serve-test-token"


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_a_service_refuses_to_start_without_a_token(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.delenv("SHARPEN_SERVICE_TOKEN", raising=False)
    assert main(["serve-sandbox", "--port", "0"]) == EXIT_USER_ERROR
    assert "SHARPEN_SERVICE_TOKEN" in _one_error_line(capsys)


def test_serve_sandbox_will_not_serve_a_remote_sandbox(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv("SHARPEN_SERVICE_TOKEN", TOKEN)
    overrides = ["sandbox.backend=remote", 'sandbox.remote.urls=["http://127.0.0.1:1"]']
    assert main(["serve-sandbox", "--port", "0", *overrides]) == EXIT_USER_ERROR
    assert 'may not be "remote"' in _one_error_line(capsys)


def test_serve_env_needs_a_recipe(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv("SHARPEN_SERVICE_TOKEN", TOKEN)
    assert main(["serve-env", "--port", "0"]) == EXIT_USER_ERROR
    assert "serve-env needs a recipe" in _one_error_line(capsys)


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_serve_sandbox_serves_probes_and_runs_until_sigterm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARPEN_SERVICE_TOKEN", TOKEN)
    command = [sys.executable, "-m", "sharpen.cli.main", "serve-sandbox", "--port", "0", "sandbox.backend=bwrap"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        assert " at http://" in line, line
        url = line.rsplit(" at ", 1)[1].strip()
        assert httpx.get(url + "/healthz").status_code == 200
        assert httpx.get(url + "/readyz").status_code == 200
        assert "# TYPE sharpen_queue_depth gauge" in httpx.get(url + "/metrics").text
        assert httpx.post(url + "/v1/run", json={"code": "print(1)"}).status_code == 401
        with RemoteSandbox(SandboxConfig(backend="remote", remote={"urls": [url]})) as remote:
            result = remote.run_python("print(6 * 7)")
        assert (result.status, result.stdout) == (ExecutionStatus.OK, "42\n")
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=20)
    assert server.returncode == 128 + signal.SIGTERM


def test_serve_env_serves_the_recipes_environment(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARPEN_SERVICE_TOKEN", TOKEN)
    recipe = tmp_path / "game.toml"
    recipe.write_text('[environment]\ntype = "guess_number"\nhigh = 8\n')
    command = [sys.executable, "-m", "sharpen.cli.main", "serve-env", "--port", "0", str(recipe)]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        assert "serving environment 'guess_number' at http://" in line, line
        url = line.rsplit(" at ", 1)[1].strip()
        assert httpx.get(url + "/readyz").status_code == 200
        factory = RemoteEnvironmentFactory(RemoteConfig(urls=[url]))
        environment = factory()
        example = Example(task_key="g", prompt=(Message(role="user", content="guess"),), answer="5")
        ctx = EpisodeContext(seed=0, sample_index=0, max_turns=3, max_tokens=100)
        first = asyncio.run(environment.reset(example, ctx))
        result = asyncio.run(environment.step("5"))
        factory.close()
        assert first == list(example.prompt)
        assert (result.reward, result.terminated) == (1.0, True)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=20)


def test_a_client_that_cannot_reach_its_replicas_is_one_line_for_the_user(monkeypatch: pytest.MonkeyPatch) -> None:
    from sharpen.cli.errors import user_error_message
    from sharpen.serving import ServiceUnavailable

    monkeypatch.setenv("SHARPEN_SERVICE_TOKEN", TOKEN)
    config = SandboxConfig(backend="remote", remote={"urls": ["http://127.0.0.1:9"], "max_retries": 1, "backoff_s": 0})
    with pytest.raises(ServiceUnavailable) as raised:
        RemoteSandbox(config)
    message = user_error_message(raised.value)
    assert message is not None and "remote.urls" in message and "127.0.0.1:9" in message
