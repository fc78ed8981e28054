"""`sharpen dashboard`: a local web page over a folder of run directories.

Owns a read-only, standard-library HTTP server and its JSON API: ``GET /`` the page (``dashboard_static/``),
``GET /api/runs`` (the sub-folders of ``runs_dir`` that hold metrics.jsonl), ``GET /api/runs/<name>/metrics``,
``GET /api/runs/<name>/rollouts?step=N`` (the recorded rollouts of step N, default the last one, each with
``completion_tokens``: the text of every completion token when the run's tokenizer has loaded, else null; and
``tokens_pending``: true while that tokenizer is still loading, so the page shows token ids at once and asks again)
and ``GET /api/runs/<name>/eval`` (eval.json). A run name is one folder name: anything that could leave ``runs_dir``
(``..``, a slash, an absolute path) is answered 400, and so is a run folder or a run's file that is a symlink
resolving elsewhere. A request whose ``Host`` header names neither an IP address, ``localhost`` nor a name given
with ``allowed_hosts`` is answered 403: a web page whose DNS name re-resolves to this server (DNS rebinding) cannot
read it. A run that cannot be read (a file that is not JSON lines, no permission) is answered with its own error,
and the page shows the other runs. Does not write to a run, compute metrics or need a GPU; the
tokenizer is the only heavy import (seconds), so it is loaded once per run on a background thread, started for
every run with rollouts when the server starts, and no request ever waits for it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import math
import threading
import tomllib
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from sharpen.config.models import ModelNotFoundError, resolve_model_path

logger = logging.getLogger(__name__)

METRICS_FILE_NAME = "metrics.jsonl"  # as in monitoring.sinks; not imported so the page needs no tensorboard
ROLLOUTS_FILE_NAME = "rollouts.jsonl"
EVAL_FILE_NAME = "eval.json"

TokenDecoder = Callable[[list[int]], list[str]]
"""Token ids -> the text of each token, one string per id."""


class _BadRequest(ValueError):
    pass


class _NotFound(ValueError):
    pass


def host_allowed(header: str | None, allowed: frozenset[str] = frozenset()) -> bool:
    """Whether a request's ``Host`` header may be served: an IP address, ``localhost`` or a name in ``allowed``
    (any port). A DNS rebinding attack's page sends its own domain name, which is none of them."""
    if not header:
        return False
    host = header.strip().lower()
    if host.startswith("["):  # [::1]:8765
        host = host[1 : host.find("]")] if "]" in host else host
    elif host.count(":") == 1:
        host = host.rsplit(":", 1)[0]
    if host == "localhost" or host in allowed:
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def read_complete_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSONL file, without a torn last line: a live run may be mid-write while the page reads."""
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")[:-1]  # the piece after the last newline is empty or a torn write
    return [json.loads(line) for line in lines if line.strip()]


def _finite(value: Any) -> Any:
    """NaN and infinities as null: the browser's JSON.parse rejects Python's ``NaN``/``Infinity``."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value


def load_run_decoder(run_dir: Path) -> TokenDecoder | None:
    """The run's tokenizer (config.toml -> model.path) as a decoder, or None when there is none to load here.

    Falling back is intended: a dashboard often runs on a laptop without the run's model, and token ids still
    show everything the colouring needs.
    """
    config_path = run_dir / "config.toml"
    if not config_path.is_file() or config_path.resolve().parent != run_dir.resolve():
        return None
    model_path = tomllib.loads(config_path.read_text(encoding="utf-8")).get("model", {}).get("path")
    if not isinstance(model_path, str):
        return None
    try:
        folder = resolve_model_path(model_path)
    except ModelNotFoundError:
        return None
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as error:  # a model folder without tokenizer files
        logger.warning("dashboard: no tokenizer for %s (%s); showing token ids", run_dir.name, error)
        return None
    return lambda ids: [tokenizer.decode([token_id]) for token_id in ids]


class RunStore:
    """Reads run directories under ``runs_dir``; every name is checked to stay inside it."""

    def __init__(self, runs_dir: Path, *, load_decoder: Callable[[Path], TokenDecoder | None] = load_run_decoder):
        self.runs_dir = Path(runs_dir).resolve()
        self._load_decoder = load_decoder
        self._decoders: dict[str, TokenDecoder | None] = {}  # the runs whose load has ended (None: no tokenizer)
        self._loads_started: set[str] = set()
        self._lock = threading.Lock()  # requests and loads run on threads; load each tokenizer once

    def run_dir(self, name: str) -> Path:
        if not name or name in {".", ".."} or "/" in name or "\\" in name or "\0" in name or Path(name).is_absolute():
            raise _BadRequest(f"run name {name!r} must be one folder name inside the runs directory")
        path = (self.runs_dir / name).resolve()
        if path.parent != self.runs_dir:  # a symlink pointing elsewhere
            raise _BadRequest(f"run {name!r} resolves outside the runs directory")
        if not (path / METRICS_FILE_NAME).is_file():
            raise _NotFound(f"no run {name!r} (a folder with {METRICS_FILE_NAME}) in {self.runs_dir}")
        return path

    def file(self, run_dir: Path, name: str) -> Path:
        """A file of a run, which must not be a symlink out of the run's folder."""
        path = run_dir / name
        if path.resolve().parent != run_dir:
            raise _BadRequest(f"{run_dir.name}/{name} resolves outside its run's folder")
        return path

    def runs(self) -> list[dict[str, Any]]:
        found = sorted(path for path in self.runs_dir.iterdir() if _is_file(path / METRICS_FILE_NAME))
        return [
            {
                "name": path.name,
                "has_rollouts": _is_file(path / ROLLOUTS_FILE_NAME),
                "has_eval": _is_file(path / EVAL_FILE_NAME),
            }
            for path in found
        ]

    def metrics(self, name: str) -> list[dict[str, Any]]:
        run_dir = self.run_dir(name)
        return read_complete_jsonl(self.file(run_dir, METRICS_FILE_NAME))

    def rollouts(self, name: str, step: int | None) -> dict[str, Any]:
        run_dir = self.run_dir(name)
        path = self.file(run_dir, ROLLOUTS_FILE_NAME)
        records = read_complete_jsonl(path) if path.is_file() else []
        steps = sorted({record["step"] for record in records})
        if step is None and steps:
            step = steps[-1]
        chosen = [record for record in records if record["step"] == step]
        pending, decoder = self._decoder(name, run_dir) if chosen else (False, None)
        for record in chosen:
            record["completion_tokens"] = None if decoder is None else decoder(record["completion_ids"])
        return {"step": step, "steps": steps, "records": chosen, "tokens_pending": pending}

    def evaluation(self, name: str) -> dict[str, Any]:
        run_dir = self.run_dir(name)
        path = self.file(run_dir, EVAL_FILE_NAME)
        if not path.is_file():
            raise _NotFound(f"run {name!r} has no {EVAL_FILE_NAME} (write one with `sharpen eval`)")
        return json.loads(path.read_text(encoding="utf-8"))

    def warm_decoders(self) -> None:
        """Start loading the tokenizer of every run with rollouts, so its text is usually ready when the page asks."""
        for run in self.runs():
            if run["has_rollouts"]:
                with contextlib.suppress(_BadRequest, _NotFound):  # a symlink out of runs_dir is never loaded
                    self._decoder(run["name"], self.run_dir(run["name"]))

    def _decoder(self, name: str, run_dir: Path) -> tuple[bool, TokenDecoder | None]:
        """(still loading, the decoder) without waiting: the first call for a run starts its load on a thread."""
        with self._lock:
            if name in self._decoders:
                return False, self._decoders[name]
            if name not in self._loads_started:
                self._loads_started.add(name)
                threading.Thread(target=self._load, args=(name, run_dir), daemon=True, name=f"tokenizer-{name}").start()
            return True, None

    def _load(self, name: str, run_dir: Path) -> None:
        """Load one run's decoder; a load that fails ends as no tokenizer (token ids), never as a pending one."""
        decoder: TokenDecoder | None = None
        try:
            decoder = self._load_decoder(run_dir)
        except Exception as error:
            logger.warning("dashboard: loading the tokenizer of %s failed (%r); showing token ids", name, error)
        finally:
            with self._lock:
                self._decoders[name] = decoder


def _is_file(path: Path) -> bool:
    """``path.is_file()``, False where it cannot be told (no permission to the folder)."""
    try:
        return path.is_file()
    except OSError:
        return False


def page_html() -> bytes:
    return (resources.files("sharpen.monitoring") / "dashboard_static" / "dashboard.html").read_bytes()


def route(store: RunStore, raw_path: str) -> Any:
    """The JSON payload of one API request; raises _BadRequest / _NotFound."""
    url = urlsplit(raw_path)
    # split before unquoting, so an encoded slash (%2F) stays inside one segment and is rejected as a name
    parts = [unquote(part) for part in url.path.strip("/").split("/")]
    if parts == ["api", "runs"]:
        return store.runs()
    if len(parts) != 4 or parts[:2] != ["api", "runs"]:
        raise _NotFound(f"unknown path {url.path!r}")
    name, what = parts[2], parts[3]
    if what == "metrics":
        return store.metrics(name)
    if what == "eval":
        return store.evaluation(name)
    if what == "rollouts":
        step_text = parse_qs(url.query).get("step", [""])[0]
        if step_text and not step_text.isdigit():
            raise _BadRequest(f"step must be a non-negative integer, got {step_text!r}")
        return store.rollouts(name, int(step_text) if step_text else None)
    raise _NotFound(f"unknown path {url.path!r}; a run has metrics, rollouts and eval")


def _make_handler(store: RunStore, allowed_hosts: frozenset[str]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            host = self.headers.get("Host")
            if not host_allowed(host, allowed_hosts):
                message = (
                    f"Host {host!r} is not served here (an IP address, localhost, or sharpen dashboard --allow-host)"
                )
                return self._send(403, json.dumps({"error": message}).encode(), "application/json")
            if urlsplit(self.path).path in {"", "/", "/index.html"}:
                return self._send(200, page_html(), "text/html; charset=utf-8")
            try:
                payload, status = route(store, self.path), 200
            except _BadRequest as error:
                payload, status = {"error": str(error)}, 400
            except _NotFound as error:
                payload, status = {"error": str(error)}, 404
            except ValueError as error:  # a run's file that is not JSON (lines)
                payload, status = {"error": f"{urlsplit(self.path).path}: not readable as JSON ({error})"}, 422
            except OSError as error:  # no permission, a file gone mid-read
                payload, status = {"error": f"{urlsplit(self.path).path}: cannot be read ({error})"}, 500
            body = json.dumps(_finite(payload)).encode()
            self._send(status, body, "application/json")

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")  # a live run changes under the page
            self.end_headers()
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the browser navigated away
                self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug("%s " + format, self.address_string(), *args)

    return Handler


class DashboardServer:
    """Serves the page and API for ``runs_dir`` on ``host:port`` (port 0 picks a free one)."""

    def __init__(
        self,
        runs_dir: Path,
        *,
        host: str = "127.0.0.1",
        port: int = 8765,
        load_decoder: Callable[[Path], TokenDecoder | None] = load_run_decoder,
        allowed_hosts: Sequence[str] = (),
    ) -> None:
        """``allowed_hosts``: DNS names the page may be reached by, beside IP addresses and ``localhost``."""
        if not Path(runs_dir).is_dir():
            raise ValueError(f"dashboard: runs directory {str(runs_dir)!r} is not a folder")
        self.store = RunStore(Path(runs_dir), load_decoder=load_decoder)
        names = frozenset(name.strip().lower() for name in allowed_hosts)
        self._http = ThreadingHTTPServer((host, port), _make_handler(self.store, names))
        self._http.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._http.server_address[:2]
        return f"http://{host}:{port}/"

    def start(self) -> DashboardServer:
        """Serve on a background thread (tests, notebooks); the runs' tokenizers start loading too."""
        self.store.warm_decoders()
        self._thread = threading.Thread(target=self._http.serve_forever, args=(0.05,), daemon=True, name="dashboard")
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve on this thread until interrupted; the runs' tokenizers load on background threads meanwhile."""
        self.store.warm_decoders()
        self._http.serve_forever(0.2)

    def close(self) -> None:
        if self._thread is not None:
            self._http.shutdown()
            self._thread.join()
        self._http.server_close()
