"""The one HTTP client of sharpen's services: calls spread over N replica URLs (one for a single server), retried where
that is safe. The sandbox and environment clients, the reward-model client and the LLM judge's client use it.

Owns choosing a replica (the one with the fewest calls in flight from here; a replica that refused a connection
rests for ``replica_cooldown_s``), the token, Idempotency-Key and caller headers (the servers share their queues
fairly between callers: one process is one), timeouts, backoff (``backoff_s`` doubled per round over all replicas,
at most 2 s, or the server's Retry-After) and what each failure means:

- not reached (connection refused, connect timeout), or not taken (503 full, 429 rate-limited, 408): another
  replica, same key; safe, nothing ran.
- the connection dropped mid-call (the replica died): another replica, same key. Only for calls whose work dies
  with the replica (a sandbox execution: its processes end with the replica); a call pinned to one replica (a
  session's or an episode's) raises `ReplicaLost` instead, and its caller decides (the environment client replays).
- no answer in ``timeout_s`` (the replica lives but is slow), or 500, 502, 504 (it or a gateway failed; the call
  may have run): retried only when the call carries an Idempotency-Key, which makes a repeat safe: a server that
  keeps answers by key (`ServiceShell`) answers it with the first attempt's answer instead of running it twice; a
  pure call (a score, a chat completion) may simply run again. A timeout asks the same replica again.
- any other answer: final. 4xx is `ServiceRequestError` (a bug or a wrong token, not load), 5xx
  `ServiceUnavailable`. When attempts run out, `ServiceUnavailable` (``is_timeout`` when the last attempt got no
  answer in time or a 504): an infrastructure fault, never the policy's.

Stateful replicas are addressed one by one: the answer that opens a session or an episode may carry the replica's own
address (``"replica_url"``, from the server's ``service.advertise_url_env``), and `pin` pins what it opened there. So
a URL that stands for many replicas (a Kubernetes Service, any load balancer without session affinity) opens
sessions and episodes, and their later calls go to the pod that holds them, never through the balancer again. An
advertised address is called only for pinned calls; calls that are not pinned are spread over ``config.urls`` alone.

Synchronous (httpx, thread-safe); ``in_thread`` runs calls in the client's own threads for asyncio callers, so one
client serves any number of event loops. Does not know what the routes mean.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

from sharpen.config.service import RemoteConfig
from sharpen.serving.shell import CALLER_HEADER, read_token

T = TypeVar("T")
_MAX_BACKOFF_S = 2.0
_NOT_TAKEN = frozenset({408, 429, 503})
"""Answers that say the call did not run (timed out arriving, rate-limited, full): always retried."""
_FAILED = frozenset({500, 502, 504})
_CALLER = uuid.uuid4().hex[:16]
"""This process's name for the servers' fair admission (``X-Sharpen-Caller``): opaque, so that it tells a third-party
server (a judge's API) nothing about the host."""
"""Answers of a call that may have run and failed (or whose gateway gave up): retried only with an Idempotency-Key."""


class ServiceUnavailable(RuntimeError):
    """No replica answered the call (all dead, full or failing): an infrastructure fault. ``is_timeout``: the last
    attempt got no answer in time (or a 504), rather than no connection or an error."""

    def __init__(self, message: str, *, is_timeout: bool = False) -> None:
        super().__init__(message)
        self.is_timeout = is_timeout


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
        self.is_timeout = False

    def next(self) -> tuple[Replica, float]:
        """The replica to call and how long to wait first; `ServiceUnavailable` when attempts ran out."""
        if self.num_left <= 0:
            raise ServiceUnavailable(
                f"no replica answered after {self.client.config.max_retries + 1} attempts: {self.last_error}",
                is_timeout=self.is_timeout,
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

    def failed(self, replica: Replica, error: str, *, retry_after: float = 0.0, is_timeout: bool = False) -> None:
        self.tried.add(replica.url)
        self.retry_after = max(self.retry_after, retry_after)
        self.last_error = f"{replica.url}: {error}"
        self.is_timeout = is_timeout


class ReplicaClient:
    """``call(method, path, payload, key=..., pin=...)`` -> the JSON answer of one replica (see the module doc). The
    token is read from ``config.token_env`` now (a missing one fails here); with ``token_env`` None none is sent."""

    def __init__(self, config: RemoteConfig, *, what: str) -> None:
        if not config.urls:
            raise ValueError(f"{what}: give the replicas' URLs (remote.urls)")
        self.config = config
        self.what = what
        self.replicas = [Replica(url=url) for url in config.urls]
        self._by_url = {r.url: r for r in self.replicas}
        self._advertised: dict[str, Replica] = {}
        """Replicas known only by the address they advertised (one per replica that opened something here)."""
        headers = {} if config.token_env is None else {"Authorization": f"Bearer {read_token(config.token_env)}"}
        headers[CALLER_HEADER] = _CALLER
        max_in_flight = config.max_in_flight
        self._http = httpx.Client(
            headers=headers,
            limits=httpx.Limits(max_connections=max_in_flight * 2, max_keepalive_connections=max_in_flight),
        )
        self._lock = threading.Lock()
        self._turn = 0
        self._executor = ThreadPoolExecutor(max_workers=max_in_flight, thread_name_prefix=f"{what}-client")

    def replica(self, url: str) -> Replica:
        replica = self._by_url.get(url) or self._advertised.get(url)
        if replica is None:  # a pinned call to a replica that `set_urls` dropped
            raise ReplicaLost(f"{self.what} replica {url} is no longer one of this client's replicas")
        return replica

    def pin(self, url: str, answer: dict[str, Any]) -> str:
        """The address to pin what ``answer`` opened (a session, an episode): the replica's own when the answer
        advertises one (``replica_url``), else ``url``, the one that was called."""
        advertised = answer.get("replica_url")
        if advertised is None:
            return url
        if not (isinstance(advertised, str) and advertised.startswith(("http://", "https://"))):
            raise ServiceRequestError(
                f"{self.what} replica {url} advertises {advertised!r} as its address, not an http(s) URL "
                "(fix its service.advertise_url_env variable)"
            )
        advertised = advertised.rstrip("/")
        with self._lock:
            if advertised not in self._by_url:
                self._advertised.setdefault(advertised, Replica(url=advertised))
        return advertised

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
                    message = f"{self.what} replica {replica.url}: no answer in {timeout}"
                    raise ServiceUnavailable(message, is_timeout=True) from None
                attempts.failed(replica, "no answer in time", is_timeout=True)
                attempts.stick = replica  # the same key there waits for the first attempt instead of rerunning
                continue
            finally:
                with self._lock:
                    replica.num_in_flight -= 1
            status = response.status_code
            if status in _NOT_TAKEN or (key and status in _FAILED):
                retry_after = _retry_after(response)
                attempts.failed(replica, _describe(response), retry_after=retry_after, is_timeout=status == 504)
                continue
            return replica.url, self._answer(replica, response, pin=pin)

    def _answer(self, replica: Replica, response: httpx.Response, *, pin: str | None) -> dict[str, Any]:
        if response.status_code == 200:
            with contextlib.suppress(ValueError):
                body = response.json()
                if isinstance(body, dict):
                    return body  # pyright: ignore[reportUnknownVariableType]
        where = f"{self.what} replica {replica.url}: {_describe(response)}"
        if response.status_code == 404 and pin is not None:
            raise ReplicaLost(where)
        if response.status_code == 401:
            if self.config.token_env is None:
                raise ServiceRequestError(f"{where} (this client sends no token)")
            raise ServiceRequestError(f"{where} (set {self.config.token_env} to the servers' token)")
        if response.status_code < 500:
            raise ServiceRequestError(where)
        raise ServiceUnavailable(where, is_timeout=response.status_code == 504)

    async def in_thread(self, job: Callable[[], T]) -> T:
        """Run ``job`` (blocking calls of this client) in the client's threads, for asyncio callers."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, job)

    def _rest(self, replica: Replica) -> None:
        replica.resting_until = time.monotonic() + self.config.replica_cooldown_s

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self._http.close()


def _describe(response: httpx.Response) -> str:
    """``HTTP <status>: <the answer's error>``, for messages."""
    try:
        body = response.json()
    except ValueError:
        body = {"error": response.text[:200]}
    error = body.get("error", body) if isinstance(body, dict) else body  # pyright: ignore[reportUnknownMemberType]
    return f"HTTP {response.status_code}: {str(error)[:500]}"  # pyright: ignore[reportUnknownArgumentType]


def _retry_after(response: httpx.Response) -> float:
    try:
        return min(_MAX_BACKOFF_S, float(response.headers.get("Retry-After", 0)))
    except ValueError:
        return 0.0
