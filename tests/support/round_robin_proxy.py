"""A Kubernetes ClusterIP Service in miniature, for tests: one loopback address in front of N HTTP servers, every
request sent to the next server in turn (per request, not per connection: a client's kept-alive connection gets no
affinity either, the worst case of a Service without session affinity).

Owns forwarding (method, path, the headers that matter, body; the answer back as it came) and counting which server
got which request. Does not retry, buffer beyond one request, or speak anything but HTTP/1.1 with Content-Length.
"""

from __future__ import annotations

import http.client
import itertools
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self
from urllib.parse import urlsplit

_FORWARDED = ("Authorization", "Content-Type", "Idempotency-Key")


class RoundRobinProxy:
    """``url`` fronts ``backends`` (base URLs); ``num_requests[(backend, path)]`` counts what each one got."""

    def __init__(self, backends: list[str]) -> None:
        if not backends:
            raise ValueError("a proxy needs at least one backend URL")
        self.backends = list(backends)
        self.num_requests: Counter[tuple[str, str]] = Counter()
        self._turns = itertools.cycle(self.backends)
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
        self._server.daemon_threads = True
        self.url = "http://{}:{}".format(*self._server.server_address[:2])
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True, name="proxy")

    def next_backend(self, path: str) -> str:
        with self._lock:
            backend = next(self._turns)
            self.num_requests[(backend, path)] += 1
            return backend

    def paths_served(self, prefix: str) -> int:
        """Requests forwarded whose path starts with ``prefix``."""
        return sum(n for (_, path), n in self.num_requests.items() if path.startswith(prefix))

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._thread.join(timeout=5)
        self._server.server_close()


def _make_handler(proxy: RoundRobinProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self._forward("GET")

        def do_POST(self) -> None:
            self._forward("POST")

        def _forward(self, method: str) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            backend = urlsplit(proxy.next_backend(self.path))
            headers = {name: value for name in _FORWARDED if (value := self.headers.get(name)) is not None}
            connection = http.client.HTTPConnection(backend.hostname or "", backend.port, timeout=60)
            try:
                connection.request(method, self.path, body=body, headers=headers)
                answer = connection.getresponse()
                status, payload, kept = answer.status, answer.read(), answer.getheaders()
            finally:
                connection.close()
            self.send_response(status)
            for name, value in kept:
                if name.lower() in ("content-type", "retry-after"):
                    self.send_header(name, value)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler
