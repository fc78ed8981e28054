"""Configuration of components served over HTTP (`sharpen serve-sandbox`, `sharpen serve-env`, `sharpen serve-rm`) and
of their clients.

Pydantic only. `ServiceConfig` is the server's side (queue, limits, expiry); `RemoteConfig` the client's (replica
URLs, timeouts, retries); `FleetConfig` replicas that the run starts itself as Ray actors, in one vocabulary for
every fleet (a reward model's with ``backend = "ray"`` too), and `ServiceFleetConfig` a fleet of a served component.
Both sides read one shared-secret token from an environment variable, never from a file of the recipe. The sections
are mounted by the sandbox, environment and reward-model sections; this module does not know them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from sharpen.config.section import Section

TOKEN_ENV = "SHARPEN_SERVICE_TOKEN"
ADVERTISE_URL_ENV = "SHARPEN_ADVERTISE_URL"


class ServiceConfig(Section):
    """How a served component admits and keeps work (read by the server only)."""

    max_queue_size: int = Field(default=64, ge=0)
    """Requests that may wait for a free slot beyond those running; one more is answered 503 with Retry-After (the
    client then tries another replica) and /readyz reports not ready while the queue is full."""
    max_body_mb: float = Field(default=16.0, gt=0.0)
    """Largest request body in MiB (code, files, stdin, an action); a bigger one is answered 413."""
    max_open: int = Field(default=256, ge=1)
    """Sandbox sessions or environment episodes open at once on one replica; one more is answered 503."""
    idle_seconds: float = Field(default=300.0, gt=0.0)
    """An open session or episode that no request touched for this long is closed and forgotten (its client then
    gets 404 and recovers or abstains)."""
    idempotency_ttl_s: float = Field(default=600.0, gt=0.0)
    """How long a finished request's answer is kept by its Idempotency-Key, so that a retried request is answered
    with it instead of running again."""
    max_idempotency_keys: int = Field(default=4096, ge=1)
    """Answers kept by Idempotency-Key at most (the oldest finished ones are forgotten first)."""
    retry_after_s: int = Field(default=1, ge=0)
    """The Retry-After of a 503 answer, in seconds."""
    max_items_per_request: int = Field(default=1024, ge=1)
    """Items one request may carry in a route's batch (a reward model's ``inputs``); more are answered 413 before
    the request waits for a slot, so one call cannot hold the server for a whole batch of batches."""
    max_connections: int = Field(default=512, ge=1)
    """Connections open at once. One more evicts the oldest connection that has not yet sent a whole request, or
    that waits idle between requests; when every one is working, it is answered 503 and closed (no thread)."""
    header_timeout_s: float = Field(default=10.0, gt=0.0)
    """Longest time a request's line and headers may take to arrive, in all (not per read: a client that trickles
    a byte at a time is cut off too); past it the connection is closed."""
    read_timeout_s: float = Field(default=30.0, gt=0.0)
    """Longest time an authorized request's body may take to arrive, in all; past it the connection is closed and
    the request never runs. Also bounds each read or write on the connection."""
    idle_timeout_s: float = Field(default=30.0, gt=0.0)
    """A kept-alive connection with no next request for this long is closed (clients close theirs sooner)."""
    token_env: str = TOKEN_ENV
    """The environment variable that holds the shared-secret token every call but /healthz, /readyz and /metrics
    must carry (``Authorization: Bearer <token>``); the server refuses to start without it."""
    advertise_url_env: str = ADVERTISE_URL_ENV
    """The environment variable that holds this replica's own base URL (``http://<pod-ip>:<port>``), which the
    answer that opens a session or an episode carries, so that a client that reached the replica through a shared
    address (a Kubernetes Service in front of several pods) sends the session's or episode's later calls to this
    replica and no other. Unset or empty: the client keeps calling the address it opened it through, which is right
    only when that address is this one replica. The Helm chart sets it from the pod's IP."""


class RemoteConfig(Section):
    """Where the replicas of a served component are and how calls to them are retried (read by the client)."""

    urls: list[str] = Field(default_factory=list[str])
    """Base URLs of the replicas (``http://host:port``); calls are spread over them, least busy first. One URL may
    stand for many replicas (a Kubernetes Service): sessions and episodes then stay on the replica that opened them
    by the address it advertises (``service.advertise_url_env``)."""
    token_env: str | None = TOKEN_ENV
    """The environment variable that holds the servers' shared-secret token (None: send no token, for a server that
    takes none)."""
    connect_timeout_s: float = Field(default=2.0, gt=0.0)
    """How long to wait for a connection to a replica before trying another."""
    timeout_s: float = Field(default=120.0, gt=0.0)
    """How long one call may take on a replica (queueing and running included) before it is retried there."""
    max_retries: int = Field(default=6, ge=0)
    """Attempts after the first, on another replica when one is dead or full; when they run out the call fails as
    an infrastructure fault (the episode or the reward abstains)."""
    backoff_s: float = Field(default=0.1, ge=0.0)
    """Wait before retrying when every replica was full or dead, doubled per round (up to 2 s, or the server's
    Retry-After when it gives one)."""
    max_in_flight: int = Field(default=64, ge=1)
    """Calls from this process in flight at once, over all replicas (the client's threads)."""
    replica_cooldown_s: float = Field(default=5.0, ge=0.0)
    """A replica that refused a connection gets no calls for this long (then it is tried again)."""

    @field_validator("urls")
    @classmethod
    def _check_urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"replica URL {url!r} must start with http:// or https://")
        if len(set(urls)) != len(urls):
            raise ValueError("replica URLs must be distinct")
        return [url.rstrip("/") for url in urls]


class FleetConfig(Section):
    """A fleet: the replicas of a component started by the run itself, one Ray actor each, on the run's Ray cluster
    (``runtime.address``, or a local instance sized by ``runtime.ray_cpus``; in either runtime). Every Ray-hosted
    fleet (sandbox, environment, reward model) is set with these keys."""

    type: Literal["ray"] = "ray"
    """"ray": each replica is a Ray actor."""
    num_replicas: int = Field(default=1, ge=1)
    """Replicas started with the run."""
    num_cpus: float = Field(default=1.0, gt=0.0)
    """CPUs each replica reserves (fractions allowed). Ray's autoscaler sees the fleet as this demand."""
    num_gpus: float = Field(default=0.0, ge=0.0)
    """GPUs each replica reserves (fractions allowed; Ray sets its CUDA_VISIBLE_DEVICES). Not yet exercised on a
    GPU."""
    memory_mb: int | None = Field(default=None, ge=1)
    """Memory each replica reserves in Ray's scheduling, in MiB (None: no reservation)."""
    max_restarts: int = Field(default=3, ge=-1)
    """How often Ray restarts a dead replica (-1: always). A replica whose calls failed is sent no work until it
    answers again; one dead for good leaves the fleet."""


class ServiceFleetConfig(FleetConfig):
    """A fleet of a served component (``sandbox.fleet``, ``environment.fleet``): each replica serves the component
    over HTTP on its node's IP, and the run's client calls their URLs (the fleet fills ``remote.urls``). A sandbox
    session or an environment episode stays on the replica that opened it. Restarted on the same node, a replica
    comes back at its URL (its port is derived from its actor id) and the run's client sends it work again."""

    num_replicas: int = Field(default=2, ge=1)
    """Replicas started with the run."""
    num_cpus: float = Field(default=0.5, gt=0.0)
    """CPUs each replica reserves (fractions allowed). Ray's autoscaler sees the fleet as this demand."""
    backend: Literal["auto", "bwrap", "unshare", "process"] = "auto"
    """The isolation of the replicas' sandbox: a sandbox fleet's replicas serve the [sandbox] section with this
    backend, an environment fleet's replicas run their environment's code (python tools) in it."""
