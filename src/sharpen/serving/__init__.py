"""Serving components over HTTP: the service shell (shell.py: token, limits, probes, idempotency; admission.py: a
bounded queue shared fairly between callers; http_guard.py: one body framing, bounded connections, deadlines) and
the one HTTP client (replicas.py: load spread over N URLs, retries with backoff, timeouts, the token, what each
failure means), which every client of a served component uses (sandbox, environment, reward model, LLM judge).
Components' own service modules (`sharpen.environments.sandbox.service`, `sharpen.environments.service`,
`sharpen.rewards.rm_server`) give the routes; this package knows none of them. Standard library HTTP on the
server, httpx on the client.
"""

from sharpen.serving.replicas import ReplicaClient, ReplicaLost, ServiceRequestError, ServiceUnavailable, new_key
from sharpen.serving.shell import Request, Route, ServiceError, ServiceShell, read_token

__all__ = [
    "ReplicaClient",
    "ReplicaLost",
    "Request",
    "Route",
    "ServiceError",
    "ServiceRequestError",
    "ServiceShell",
    "ServiceUnavailable",
    "new_key",
    "read_token",
]
