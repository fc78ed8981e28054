"""Service fleets: the replicas of a served component as Ray actors, for runs (and users) that already have a Ray
cluster.

A `ServiceFleet` is an `ActorFleet` (the replica mechanism every Ray-hosted fleet shares: placement, restarts,
scaling, autoscaler requests) of `ServiceReplica` actors, each running the very same service as
``sharpen serve-sandbox`` or ``sharpen serve-env`` (any `Serve` function: it builds and starts a service object that
has a ``url``) on its node's IP, with the driver's shared-secret token (an actor argument, so it is held by Ray like
any other). Its replicas are addressed by URL: the driver hands the URLs to the existing replica clients
(`sharpen.serving.ReplicaClient`), which pin a sandbox session or an environment episode to the replica that opened
it, so to the loop a Ray fleet is a set of replica URLs like any other.

Adds to the mechanism what URLs need: a restarted actor comes back on the same port when it can (then its clients
need not know); `refresh` re-reads the URLs (after a restart on another node or port, a replica dead for good, a
`scale`) and hands them to the clients that `follow` the fleet; `queue_depths` reads every replica's /metrics; a
replica's service is stopped before its actor ends. Does not decide when to scale, and does not retry calls (the
replica client does).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Any, Protocol

import httpx
import ray

from sharpen.config import ConfigError, SharpenConfig
from sharpen.config.environments import EnvironmentConfig
from sharpen.config.episodes import EpisodeLimitsSection
from sharpen.config.sandbox import SandboxConfig
from sharpen.config.service import RemoteConfig, ServiceFleetConfig
from sharpen.orchestration.ray.actor_fleet import ActorFleet
from sharpen.orchestration.ray.cluster import start_ray
from sharpen.serving import read_token

logger = logging.getLogger(__name__)

_PORT_BASE, _NUM_PORTS = 20000, 10000
"""A replica's preferred port lies in [20000, 30000): below Linux's ephemeral ports, above Ray's worker ports."""
_CLOSE_TIMEOUT_S = 10.0
"""How long replicas may take to stop their services before their actors are killed."""


class Served(Protocol):
    """What a `Serve` function returns: a started service (`SandboxService`, `EnvironmentService`)."""

    url: str


Serve = Callable[[contextlib.ExitStack, str, str, int], Served]
"""``serve(stack, host, token, port)``: build and start the service on ``host:port`` (0: a free port); ``stack``
closes it."""


class UrlFollower(Protocol):
    """A client that can be pointed at new replica URLs (`ReplicaClient`)."""

    def set_urls(self, urls: list[str]) -> None: ...


class ServiceReplica:
    """One replica: serves ``serve``'s service on this node's IP until the actor ends. Its port is derived from the
    actor's id, which a restart keeps (Ray runs the constructor again): restarted on the same node, the replica is
    back at its URL and clients find it without a refresh. Where that port is taken, any free port."""

    def __init__(self, serve: Serve, token: str) -> None:
        host = ray.util.get_node_ip_address()
        actor_id = ray.get_runtime_context().get_actor_id()
        assert actor_id is not None  # constructed as an actor
        self._stack = contextlib.ExitStack()
        try:
            self._service = serve(self._stack, host, token, _PORT_BASE + int(actor_id, 16) % _NUM_PORTS)
        except OSError:  # the port is taken: a free one (the fleet's refresh tells the clients)
            self._stack.close()
            self._service = serve(self._stack, host, token, 0)

    def url(self) -> str:
        return self._service.url

    def close(self) -> None:
        self._stack.close()


class ServiceFleet(ActorFleet):
    """``config.num_replicas`` `ServiceReplica` actors serving ``serve``; ``urls`` are the live replicas' URLs.
    ``what`` names the fleet in errors; every wait on an actor is bounded by ``start_timeout_s``."""

    ready_method = "url"

    def __init__(
        self, serve: Serve, config: ServiceFleetConfig, *, token: str, what: str, start_timeout_s: float
    ) -> None:
        if not token:
            raise ValueError(f"{what} fleet: the replicas need a non-empty shared-secret token")
        self.urls: list[str] = []
        self._followers: list[UrlFollower] = []
        super().__init__(ServiceReplica, config, what=what, start_timeout_s=start_timeout_s, args=(serve, token))

    def scale(self, num_replicas: int) -> list[str]:
        """Grow (new actors, waited for) or shrink (the newest actors end, after the followers left them) to
        ``num_replicas``; the new URLs."""
        return super().scale(num_replicas)

    def refresh(self) -> list[str]:
        """Ask every actor for its URL (waiting for one that Ray is restarting), drop those that died for good,
        and point the followers at the result."""
        self.urls = super().refresh()
        for follower in self._followers:
            follower.set_urls(self.urls)
        return self.urls

    def follow(self, client: UrlFollower) -> None:
        """Point ``client`` at the fleet's URLs now and after every `scale` or `refresh`."""
        client.set_urls(self.urls)
        self._followers.append(client)

    def queue_depths(self) -> dict[str, float]:
        """Each replica's queue depth (requests waiting for a slot), read from its /metrics; a replica that does not
        answer is left out."""
        depths: dict[str, float] = {}
        for url in self.urls:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                depths[url] = gauge(httpx.get(f"{url}/metrics", timeout=2.0).text, "sharpen_queue_depth")
        return depths

    def close(self) -> None:
        """End every replica; safe to repeat."""
        super().close()
        self.urls = []

    def _end(self, actors: list[Any]) -> None:
        """Stop the replicas' services (their sandboxes' sessions end, their ports close), then the actors; a replica
        that does not stop in time is killed anyway."""
        closing = [actor.close.remote() for actor in actors]
        ray.wait(closing, num_returns=len(closing), timeout=_CLOSE_TIMEOUT_S)
        super()._end(actors)


def gauge(metrics: str, name: str) -> float:
    """The value of gauge ``name`` in a /metrics text."""
    for line in metrics.splitlines():
        key, _, value = line.partition(" ")
        if key == name:
            return float(value)
    raise ValueError(f"/metrics has no {name}")


def serve_sandbox(config: SandboxConfig, stack: contextlib.ExitStack, host: str, token: str, port: int) -> Served:
    """A `Serve` of ``config`` (a local backend): a `SandboxPool` behind a `SandboxService`, as serve-sandbox runs."""
    from sharpen.environments.sandbox import SandboxPool
    from sharpen.environments.sandbox.service import SandboxService

    pool = stack.enter_context(SandboxPool(config))
    return stack.enter_context(SandboxService(config, pool=pool, token=token, host=host, port=port))


def serve_environment(
    config: EnvironmentConfig, sandbox: SandboxConfig, stack: contextlib.ExitStack, host: str, token: str, port: int
) -> Served:
    """A `Serve` of environment section ``config`` (its code, if any, run in ``sandbox``), as serve-env runs."""
    from sharpen.environments.service import EnvironmentService

    return stack.enter_context(EnvironmentService(config, sandbox=sandbox, token=token, host=host, port=port))


def start_fleets(config: SharpenConfig, *, stack: contextlib.ExitStack) -> SharpenConfig:
    """Start the run's fleets (``sandbox.fleet``, then ``environment.fleet``, whose replicas then use the sandbox
    fleet) and return ``config`` with the replicas' URLs in ``remote.urls``; ``config`` itself when it asks for
    none. The replicas end when ``stack`` closes."""
    return start_environment_fleet(start_sandbox_fleet(config, stack=stack), stack=stack)


def start_sandbox_fleet(config: SharpenConfig, *, stack: contextlib.ExitStack) -> SharpenConfig:
    """Start the run's sandbox fleet (``sandbox.fleet``) and return ``config`` with ``sandbox.remote.urls`` set to
    its replicas' URLs; ``config`` itself when it asks for none. The replicas end when ``stack`` closes."""
    sandbox = config.sandbox
    if sandbox.fleet is None:
        return config
    from sharpen.environments.registry import sandbox_for_run

    # pytest for HumanEval's checker and the repository environment, as serve-sandbox's replicas have it
    served = sandbox_for_run(config).model_copy(update={"backend": sandbox.fleet.backend, "fleet": None})
    serve = functools.partial(serve_sandbox, served)
    urls = _start_fleet(config, serve, sandbox.fleet, token_env=sandbox.service.token_env, what="sandbox", stack=stack)
    remote = sandbox.remote.model_copy(update={"urls": urls})
    return config.model_copy(update={"sandbox": sandbox.model_copy(update={"remote": remote})})


def start_environment_fleet(config: SharpenConfig, *, stack: contextlib.ExitStack) -> SharpenConfig:
    """Start the run's environment fleet (``environment.fleet``): replicas of the environment service, each
    serving the section without its fleet; ``config`` with ``environment.remote.urls`` set to their URLs."""
    environment = config.environment
    if not isinstance(environment, EpisodeLimitsSection) or environment.fleet is None:
        return config
    fleet = environment.fleet
    served = environment.model_copy(update={"remote": None, "fleet": None})
    sandbox = config.sandbox  # a remote one (a sandbox fleet's URLs) is used as it is
    if sandbox.backend != "remote":
        sandbox = sandbox.model_copy(update={"backend": fleet.backend})
    serve = functools.partial(serve_environment, served, sandbox)
    urls = _start_fleet(config, serve, fleet, token_env=environment.service.token_env, what="environment", stack=stack)
    remote = (environment.remote or RemoteConfig()).model_copy(update={"urls": urls})
    return config.model_copy(update={"environment": environment.model_copy(update={"remote": remote})})


def _start_fleet(
    config: SharpenConfig,
    serve: Serve,
    fleet: ServiceFleetConfig,
    *,
    token_env: str,
    what: str,
    stack: contextlib.ExitStack,
) -> list[str]:
    """Start one fleet on the run's Ray (starting Ray if the run must), closed with ``stack``; its URLs."""
    try:
        token = read_token(token_env)
    except ValueError as error:
        raise ConfigError(f"{what}.fleet: the replicas refuse to start without a token: {error}") from None
    if start_ray(config.runtime):
        stack.callback(ray.shutdown)
    started = ServiceFleet(serve, fleet, token=token, what=what, start_timeout_s=config.runtime.start_timeout_s)
    stack.callback(started.close)
    logger.info("%s fleet: %d Ray actor replicas at %s", what, len(started.urls), ", ".join(started.urls))
    return started.urls
