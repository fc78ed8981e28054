"""The client side of a served component: calls spread over N replica URLs, retried where that is safe.

Owns choosing a replica (the one with the fewest calls in flight from here; a replica that refused a connection
rests for ``replica_cooldown_s``), the retry rules, the token and Idempotency-Key headers, and timeouts:

- not reached (connection refused, connect timeout), or full (503): another replica, same key; safe, nothing ran.
- the connection dropped mid-call (the replica died): another replica, same key. Only for calls whose work dies
  with the replica (a sandbox execution: its processes end with the replica); a call pinned to one replica (a
  session's or an episode's) raises `ReplicaLost` instead, and its caller decides (the environment client replays).
- no answer in ``timeout_s`` (the replica lives but is slow): the same replica again with the same key, which
  waits for the first attempt's answer instead of running it twice.
- any other answer: final. 4xx is `ServiceRequestError` (a bug or a wrong token, not load), 5xx
  `ServiceUnavailable`. When attempts run out, `ServiceUnavailable`: an infrastructure fault, never the policy's.

Synchronous (httpx, thread-safe); ``in_thread`` runs calls in the client's own threads for asyncio callers, so one
client serves any number of event loops. Does not know what the routes mean.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

from sharpen.config.service import RemoteConfig
from sharpen.serving.shell import read_token

T = TypeVar("T")
_MAX_BACKOFF_S = 2.0


class ServiceUnavailable(RuntimeError):
    """No replica answered the call (all dead, full or failing): an infrastructure fault."""


class ReplicaLost(ServiceUnavailable):
    """The replica that holds a session or an episode died or forgot it (404 after expiry)."""


class ServiceRequestError(RuntimeError):
    """A replica refused the call as wrong (4xx): a wrong token, a malformed or conflicting request."""


def new_key() -> str:
    """A fresh Idempotency-Key."""
    return uuid.uuid4().hex


@dataclass(kw_only=True, slots=True)
class Replica:
    url: str
    num_in_flight: int = 0
    resting_until: float = 0.0


class _Attempts:
    """The replicas one call tries, in order, and the waits between rounds."""

    def __init__(self, client: ReplicaClient, pin: str | None) -> None:
        self.client, self.pin = client, pin
        self.num_left = client.config.max_retries + 1
        self.tried: set[str] = set()
        self.stick: Replica | None = None
        self.round = 0
        self.retry_after = 0.0
        self.last_error = "no replica configured"

    def next(self) -> tuple[Replica, float]:
        """The replica to call and how long to wait first; `ServiceUnavailable` when attempts ran out."""
        if self.num_left <= 0:
            raise ServiceUnavailable(
                f"no replica answered after {self.client.config.max_retries + 1} attempts: {self.last_error}"
            )
        self.num_left -= 1
        if self.pin is not None:
            wait, self.retry_after = self.retry_after, 0.0
            return self.client.replica(self.pin), wait
        if self.stick is not None:
            replica, self.stick = self.stick, None
            return replica, 0.0
        replica = self.client.pick(avoid=self.tried)
        if replica is not None:
            return replica, 0.0
        wait = max(self.retry_after, min(_MAX_BACKOFF_S, self.client.config.backoff_s * 2**self.round))
        self.round, self.tried, self.retry_after = self.round + 1, set(), 0.0
        soonest = min(self.client.replicas, key=lambda r: r.resting_until)  # all rest: the first back
        return self.client.pick(avoid=self.tried) or soonest, wait

    def failed(self, replica: Replica, error: str, *, retry_after: float = 0.0) -> None:
        self.tried.add(replica.url)
        self.retry_after = max(self.retry_after, retry_after)
        self.last_error = f"{replica.url}: {error}"


class ReplicaClient:
    """``call(method, path, payload, key=..., pin=...)`` -> the JSON answer of one replica (see the module doc)."""

    def __init__(self, config: RemoteConfig, *, what: str) -> None:
        if not config.urls:
            raise ValueError(f"{what}: give the replicas' URLs (remote.urls)")
        self.config = config
        self.what = what
        self.replicas = [Replica(url=url) for url in config.urls]
        self._by_url = {r.url: r for r in self.replicas}
        token = read_token(config.token_env)
        max_in_flight = config.max_in_flight
        self._http = httpx.Client(
            headers={"Authorization": f"Bearer {token}"},
            limits=httpx.Limits(max_connections=max_in_flight * 2, max_keepalive_connections=max_in_flight),
        )
        self._lock = threading.Lock()
        self._turn = 0
        self._executor = ThreadPoolExecutor(max_workers=max_in_flight, thread_name_prefix=f"{what}-client")

    def replica(self, url: str) -> Replica:
        replica = self._by_url.get(url)
        if replica is None:  # a pinned call to a replica that `set_urls` dropped
            raise ReplicaLost(f"{self.what} replica {url} is no longer one of this client's replicas")
        return replica

    def set_urls(self, urls: list[str]) -> None:
        """Call these replicas from now on (a fleet that grew, shrank or restarted one); a replica kept keeps its
        count of calls in flight and its rest. Calls already in flight finish where they are."""
        if not urls:
            raise ValueError(f"{self.what}: set_urls needs at least one replica URL")
        with self._lock:
            self.replicas = [self._by_url.get(url) or Replica(url=url) for url in dict.fromkeys(urls)]
            self._by_url = {r.url: r for r in self.replicas}

    def pick(self, *, avoid: set[str]) -> Replica | None:
        """The least busy replica not in ``avoid`` and not resting; None when there is none."""
        now = time.monotonic()
        with self._lock:
            self._turn += 1
            n = len(self.replicas)
            order = [self.replicas[(self._turn + i) % n] for i in range(n)]  # ties go round the replicas
            live = [r for r in order if r.url not in avoid and r.resting_until <= now]
            return min(live, key=lambda r: r.num_in_flight) if live else None

    def call(
        self,
        method: str,
        path: str,
        payload: dict[str, Any] | None = None,
        *,
        key: str | None = None,
        pin: str | None = None,
        timeout_s: float | None = None,
    ) -> tuple[str, dict[str, Any]]:
        """(the replica's URL, its JSON answer). ``key``: the Idempotency-Key (retries reuse it); ``pin``: call only
        this replica (its session or episode lives there)."""
        attempts = _Attempts(self, pin)
        timeout = httpx.Timeout(timeout_s or self.config.timeout_s, connect=self.config.connect_timeout_s)
        headers = {"Idempotency-Key": key} if key else {}
        while True:
            replica, wait = attempts.next()
            if wait:
                time.sleep(wait)
            with self._lock:
                replica.num_in_flight += 1
            try:
                response = self._http.request(
                    method, replica.url + path, json=payload, headers=headers, timeout=timeout
                )
            except (
                httpx.ConnectError,
                httpx.ConnectTimeout,
                httpx.ReadError,
                httpx.RemoteProtocolError,
                httpx.WriteError,
            ) as error:
                self._rest(replica)
                if pin is not None:  # what it held (a session, an episode) is gone with it
                    raise ReplicaLost(f"{self.what} replica {replica.url} is lost: {error!r}") from None
                is_sent = not isinstance(error, httpx.ConnectError | httpx.ConnectTimeout)
                attempts.failed(replica, "dropped the call" if is_sent else f"unreachable ({type(error).__name__})")
                continue
            except httpx.TimeoutException:
                if not key:
                    raise ServiceUnavailable(f"{self.what} replica {replica.url}: no answer in {timeout}") from None
                attempts.failed(replica, "no answer in time")
                attempts.stick = replica  # the same key there waits for the first attempt instead of rerunning
                continue
            finally:
                with self._lock:
                    replica.num_in_flight -= 1
            if response.status_code == 503:
                attempts.failed(replica, "full (503)", retry_after=_retry_after(response))
                continue
            return replica.url, self._answer(replica, response, pin=pin)

    def _answer(self, replica: Replica, response: httpx.Response, *, pin: str | None) -> dict[str, Any]:
        try:
            body = response.json()
        except ValueError:
            body = {"error": response.text[:200]}
        if response.status_code == 200 and isinstance(body, dict):
            return body  # pyright: ignore[reportUnknownVariableType]
        error = body.get("error", body) if isinstance(body, dict) else body  # pyright: ignore[reportUnknownMemberType]
        where = f"{self.what} replica {replica.url}: HTTP {response.status_code}: {error}"
        if response.status_code == 404 and pin is not None:
            raise ReplicaLost(where)
        if response.status_code == 401:
            raise ServiceRequestError(f"{where} (set {self.config.token_env} to the servers' token)")
        if response.status_code < 500:
            raise ServiceRequestError(where)
        raise ServiceUnavailable(where)

    async def in_thread(self, job: Callable[[], T]) -> T:
        """Run ``job`` (blocking calls of this client) in the client's threads, for asyncio callers."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, job)

    def _rest(self, replica: Replica) -> None:
        replica.resting_until = time.monotonic() + self.config.replica_cooldown_s

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self._http.close()


def _retry_after(response: httpx.Response) -> float:
    try:
        return min(_MAX_BACKOFF_S, float(response.headers.get("Retry-After", 0)))
    except ValueError:
        return 0.0
