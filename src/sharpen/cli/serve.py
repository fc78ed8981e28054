"""`sharpen serve-sandbox`, `sharpen serve-env` and `sharpen serve-rm`: build the component (from the recipe, or the
reward model's folder), serve it until stopped.

Owns the checks a user can fix before anything starts (the token variable, the replica's advertised address, a
recipe that would serve a remote component, a missing model folder, a port that is taken), said in one line each.
The services themselves are `sharpen.environments.sandbox.service`, `sharpen.environments.service` and
`sharpen.rewards.rm_server`; heavy imports happen here, lazily.
"""

from __future__ import annotations

import os
from pathlib import Path

from sharpen.config import ConfigError, SharpenConfig
from sharpen.config.episodes import EpisodeLimitsSection
from sharpen.config.service import ServiceConfig


def _token(env_name: str) -> str:
    from sharpen.serving import read_token

    try:
        return read_token(env_name)
    except ValueError as error:
        raise ConfigError(f"the service refuses to start without a token: {error}") from None


def advertised_url(env_name: str) -> str | None:
    """This replica's own address from environment variable ``env_name`` (None when unset or empty), which it gives
    with every session or episode it opens (see `ServiceConfig.advertise_url_env`)."""
    url = os.environ.get(env_name, "").strip()
    if not url:
        return None
    if not url.startswith(("http://", "https://")) or "$(" in url:
        raise ConfigError(
            f"{env_name}={url!r}: the replica's own address must be an http(s) URL, e.g. http://10.0.0.7:8100"
        )
    return url.rstrip("/")


def serve_sandbox(config: SharpenConfig, *, host: str, port: int) -> int:
    """Serve the recipe's [sandbox] until interrupted."""
    sandbox = config.sandbox
    if sandbox.backend == "remote":
        raise ConfigError('serve-sandbox runs a local sandbox: sandbox.backend may not be "remote" here')
    token = _token(sandbox.service.token_env)
    advertise = advertised_url(sandbox.service.advertise_url_env)
    from sharpen.environments.registry import sandbox_for_run
    from sharpen.environments.sandbox import SandboxPool
    from sharpen.environments.sandbox.service import SandboxService

    sandbox = sandbox_for_run(config)  # pytest, for HumanEval's checker and the repository environment

    with SandboxPool(sandbox) as pool:
        try:
            service = SandboxService(sandbox, pool=pool, token=token, host=host, port=port, advertise_url=advertise)
        except OSError as error:
            raise ConfigError(f"serve-sandbox: cannot listen on {host}:{port}: {error.strerror}") from None
        where = service.url + (f" (advertised as {advertise})" if advertise else "")
        print(f"serving the sandbox ({pool.report.backend}, {pool.report.level}) at {where}", flush=True)
        service.serve_forever()
    return 0


def serve_environment(config: SharpenConfig, *, host: str, port: int) -> int:
    """Serve the recipe's [environment] (and its [sandbox], for environments that run code) until interrupted."""
    environment = config.environment
    if isinstance(environment, EpisodeLimitsSection) and environment.remote is not None:
        raise ConfigError("serve-env serves a local environment: remove environment.remote from its recipe")
    from sharpen.environments.service import EnvironmentService

    service_config = environment.service if isinstance(environment, EpisodeLimitsSection) else ServiceConfig()
    token = _token(service_config.token_env)
    advertise = advertised_url(service_config.advertise_url_env)

    try:
        service = EnvironmentService(
            environment, sandbox=config.sandbox, token=token, host=host, port=port, advertise_url=advertise
        )
    except OSError as error:
        raise ConfigError(f"serve-env: cannot listen on {host}:{port}: {error.strerror}") from None
    except ValueError as error:
        raise ConfigError(f"serve-env: {error}") from None
    where = service.url + (f" (advertised as {advertise})" if advertise else "")
    print(f"serving environment {environment.type!r} at {where}", flush=True)
    service.serve_forever()
    return 0


def serve_reward_model(
    model_path: Path, *, host: str, port: int, max_batch_size: int, max_wait_ms: float, max_length: int
) -> int:
    """Serve the sequence-classification reward model in ``model_path`` until interrupted."""
    if not model_path.is_dir():
        raise ConfigError(f"serve-rm: model path {str(model_path)!r} is not a folder")
    service_config = ServiceConfig()
    token = _token(service_config.token_env)
    from sharpen.rewards.rm_server import RewardModelScorer, RewardModelService

    scorer = RewardModelScorer.from_pretrained(model_path, max_length=max_length)
    try:
        service = RewardModelService(
            scorer,
            service=service_config,
            token=token,
            host=host,
            port=port,
            max_batch_size=max_batch_size,
            max_wait_ms=max_wait_ms,
        )
    except OSError as error:
        raise ConfigError(f"serve-rm: cannot listen on {host}:{port}: {error.strerror}") from None
    print(f"serving {model_path} at {service.url}", flush=True)
    service.serve_forever()
    return 0
