"""Load test of the reward-model service on loopback: N concurrent clients x M requests each.

Run: .venv/bin/python benchmarks/rm_server.py [--clients 16] [--requests 25] [--model PATH]
Starts `sharpen serve-rm` in its own process (so client threads do not share its GIL) on a free loopback port,
with a tiny random Llama reward model and SmolLM2's tokenizer unless --model is given, and a random token in
SHARPEN_SERVICE_TOKEN for both sides. Each client thread sends
its requests back to back through `RewardModelClient` (one (prompt, completion) pair per request) and the table
shows requests/s, p50/p99 latency, the server's forwards from /metrics (requests per forward = how much batching
happened) and the requests that failed or were dropped, which must be 0.
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from sharpen.config.models import resolve_model_path
from sharpen.rewards.rm_client import RewardModelClient
from sharpen.testing import save_tiny_llama
from sharpen.types import Example, Message


def _build_tiny_model(folder: Path) -> None:
    save_tiny_llama(
        folder, tokenizer_from=resolve_model_path("smollm2-135m-instruct"), reward_model=True, hidden_size=64
    )


def _metrics(url: str) -> dict[str, float]:
    """The service's /metrics (Prometheus text) as name -> value."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:
        lines = response.read().decode().splitlines()
    return {name: float(value) for name, value in (line.split() for line in lines if not line.startswith("#"))}


def _start_server(model: str, args: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    command = [sys.executable, "-m", "sharpen.cli.main", "serve-rm", model, "--port", "0"]
    command += ["--max-batch-size", str(args.max_batch_size), "--max-wait-ms", str(args.max_wait_ms)]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert server.stdout is not None
    line = server.stdout.readline()  # "serving MODEL at http://127.0.0.1:PORT"
    if " at http://" not in line:
        server.kill()
        raise SystemExit(f"server did not start: {line!r}")
    return server, line.rsplit(" at ", 1)[1].strip()


def _run_load(url: str, *, num_clients: int, num_requests: int) -> tuple[list[float], int, float]:
    """Latencies (s) of all requests, the number that failed, and the wall time."""
    latencies: list[float] = []
    failures = [0]
    lock = threading.Lock()

    def client_loop(index: int) -> None:
        client = RewardModelClient(url, timeout_s=30, max_retries=5, backoff_s=0.05)
        example = Example(task_key=f"t{index}", prompt=(Message(role="user", content=f"What is {index} + 2?"),))
        for request in range(num_requests):
            started = time.perf_counter()
            result = client(example, f"The answer is {index + 2}. " * (1 + request % 8))
            elapsed = time.perf_counter() - started
            with lock:
                latencies.append(elapsed)
                failures[0] += result.score is None

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(num_clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return latencies, failures[0], time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=25, help="requests per client")
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--max-wait-ms", type=float, default=5.0)
    parser.add_argument("--model", default=None, help="a reward model folder (default: a tiny random one)")
    args = parser.parse_args()
    os.environ["SHARPEN_SERVICE_TOKEN"] = secrets.token_hex(16)  # the server's and the clients' shared secret

    with tempfile.TemporaryDirectory() as scratch:
        model = args.model
        if model is None:
            model = scratch
            _build_tiny_model(Path(scratch))
        server, url = _start_server(model, args)
        try:
            _run_load(url, num_clients=2, num_requests=2)  # warm-up: first forwards allocate
            before = _metrics(url)
            latencies, num_failed, wall_s = _run_load(url, num_clients=args.clients, num_requests=args.requests)
            after = _metrics(url)
        finally:
            server.terminate()
            server.wait(timeout=30)

    num_sent = args.clients * args.requests
    num_answered = len(latencies) - num_failed
    num_forwards = int(after["sharpen_rm_forwards"] - before["sharpen_rm_forwards"])
    num_scored = int(after["sharpen_rm_inputs_scored"] - before["sharpen_rm_inputs_scored"])
    quantiles = statistics.quantiles(latencies, n=100)
    print(f"model: {args.model or 'tiny random Llama (2 layers, hidden 64)'}; cpus: {os.cpu_count()}")
    print(f"clients x requests: {args.clients} x {args.requests} = {num_sent}")
    print(f"max_batch_size {args.max_batch_size}, max_wait_ms {args.max_wait_ms}")
    print(f"requests/s:        {num_answered / wall_s:.1f}")
    print(f"latency p50 / p99: {quantiles[49] * 1000:.1f} ms / {quantiles[98] * 1000:.1f} ms")
    print(f"forwards:          {num_forwards} ({num_scored / max(num_forwards, 1):.1f} inputs per forward)")
    rejected = "sharpen_requests_rejected_total"
    print(f"503s (retried):    {int(after[rejected] - before[rejected])}")
    print(f"failed/dropped:    {num_failed + (num_sent - len(latencies))}  (scored by server: {num_scored})")


if __name__ == "__main__":
    main()
