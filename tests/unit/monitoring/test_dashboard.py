"""`sharpen dashboard`: the JSON API over a folder of runs, names and files that would leave it are rejected, a page
reached by another DNS name is refused (DNS rebinding), a run that cannot be read does not blank the page, a
tokenizer that is still loading never holds up the rollouts, and the page renders curves (identical ones told
apart) and coloured tokens in a real (headless) browser."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from sharpen.cli.main import EXIT_USER_ERROR, main
from sharpen.monitoring.dashboard import DashboardServer

CHROMIUM = Path("/usr/bin/chromium")


def _rollout(step: int, sample_index: int, advantage: float) -> dict:
    return {
        "step": step,
        "task_key": "t0",
        "task_hash": "h0",
        "sample_index": sample_index,
        "prompt": [{"role": "user", "content": "1 + 1?"}],
        "prompt_ids": [1, 2, 3],
        "completion_text": "2 ok",
        "completion_ids": [10, 11, 12],
        "completion_logprobs": [-0.1, -2.5, float("-inf")],
        "versions": [step, step, step],
        "reward": {"score": 1.0, "status": "ok", "components": {}, "verifier": "exact"},
        "advantage": advantage,
        "is_truncated": False,
        "loss_mask": [1, 0, 1],
        "episode": None,
    }


@pytest.fixture
def runs_dir(tmp_path: Path) -> Path:
    runs = tmp_path / "runs"
    for name, slope in [("alpha", 0.1), ("beta", 0.05)]:
        run = runs / name
        run.mkdir(parents=True)
        rows = [{"step": s, "reward/mean": slope * s, "loss": 1.0 / (s + 1)} for s in range(5)]
        rows[2]["loss"] = float("nan")  # a non-finite metric must still be valid JSON for the browser
        (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (runs / "alpha" / "rollouts.jsonl").write_text(
        "".join(
            json.dumps(record) + "\n" for record in [_rollout(3, 0, 0.5), _rollout(4, 0, 0.7), _rollout(4, 1, -0.7)]
        )
        + '{"step": 5, "torn'  # a live run mid-write
    )
    report = {"num_tasks": 2, "num_samples": 4, "ks": [1], "pass_at_k": {"1": 0.5}, "maj_at_k": {"1": 0.5}}
    (runs / "alpha" / "eval.json").write_text(json.dumps({**report, "mean_at_k": {"1": 0.5}, "status_counts": {}}))
    (runs / "not-a-run").mkdir()
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "metrics.jsonl").write_text('{"step": 0}\n')
    return runs


@pytest.fixture
def server(runs_dir: Path):
    decoded = {10: "Two", 11: "\n", 12: "!"}
    server = DashboardServer(runs_dir, port=0, load_decoder=lambda run_dir: lambda ids: [decoded[i] for i in ids])
    server.start()
    yield server
    server.close()


def _get(server: DashboardServer, path: str) -> tuple[int, Any]:
    """Status and JSON of one request; the timeout also fails a request that waits on a loading tokenizer."""
    try:
        with urllib.request.urlopen(server.url.rstrip("/") + path, timeout=20) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _rollouts_once_loaded(server: DashboardServer, path: str = "/api/runs/alpha/rollouts") -> dict:
    """The rollouts once the run's tokenizer load has ended: it runs on a background thread, started by start()."""
    deadline = time.monotonic() + 30
    while True:
        status, payload = _get(server, path)
        assert status == 200, payload
        if not payload["tokens_pending"] or time.monotonic() > deadline:
            return payload
        time.sleep(0.02)


def test_the_api_lists_runs_and_serves_their_files(server):
    assert _get(server, "/api/runs") == (
        200,
        [
            {"name": "alpha", "has_rollouts": True, "has_eval": True},
            {"name": "beta", "has_rollouts": False, "has_eval": False},
        ],
    )
    status, rows = _get(server, "/api/runs/beta/metrics")
    assert status == 200 and [row["step"] for row in rows] == [0, 1, 2, 3, 4]
    assert rows[2]["loss"] is None and rows[4]["reward/mean"] == pytest.approx(0.2)

    last = _rollouts_once_loaded(server)
    assert last["step"] == 4 and last["steps"] == [3, 4] and last["tokens_pending"] is False
    assert [r["sample_index"] for r in last["records"]] == [0, 1]
    assert last["records"][0]["completion_tokens"] == ["Two", "\n", "!"]
    assert last["records"][0]["completion_logprobs"][2] is None
    assert [r["advantage"] for r in _get(server, "/api/runs/alpha/rollouts?step=3")[1]["records"]] == [0.5]
    no_rollouts = {"step": None, "steps": [], "records": [], "tokens_pending": False}
    assert _get(server, "/api/runs/beta/rollouts")[1] == no_rollouts

    assert _get(server, "/api/runs/alpha/eval")[1]["pass_at_k"] == {"1": 0.5}
    assert _get(server, "/api/runs/beta/eval")[0] == 404
    assert _get(server, "/api/runs/not-a-run/metrics")[0] == 404
    assert _get(server, "/api/runs/alpha/rollouts?step=x")[0] == 400


@pytest.mark.parametrize(
    "name", ["..", "%2E%2E", "..%2Fsecret", "%2Fetc", "%2Ftmp%2Fsecret", "..%5Csecret", "%00", "."]
)
def test_a_run_name_cannot_leave_the_runs_directory(server, name):
    status, payload = _get(server, f"/api/runs/{name}/metrics")
    assert status == 400, payload
    assert "runs directory" in payload["error"]


def test_a_symlink_out_of_the_runs_directory_is_rejected(server, runs_dir):
    (runs_dir / "link").symlink_to(runs_dir.parent / "secret")
    assert _get(server, "/api/runs/link/metrics")[0] == 400


def _get_as(server: DashboardServer, path: str, host: str) -> tuple[int, Any]:
    """`_get` with the Host header a browser at ``host`` sends (a page whose name resolved to this server)."""
    request = urllib.request.Request(server.url.rstrip("/") + path, headers={"Host": host})
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_a_page_reached_by_another_dns_name_is_refused(runs_dir):
    """DNS rebinding: attacker.example re-resolves to 127.0.0.1, and its page asks this server for the runs. The
    request carries ``Host: attacker.example``: refused. IP addresses and localhost are served, and a name the user
    allows."""
    server = DashboardServer(runs_dir, port=0, allowed_hosts=["dash.lab.internal"]).start()
    port = server.url.rstrip("/").rsplit(":", 1)[1]
    try:
        status, payload = _get_as(server, "/api/runs", f"attacker.example:{port}")
        assert status == 403 and "attacker.example" in payload["error"]
        assert _get_as(server, "/", "attacker.example")[0] == 403  # the page too
        for host in [f"127.0.0.1:{port}", f"localhost:{port}", "[::1]", f"DASH.lab.internal:{port}", "10.1.2.3"]:
            assert _get_as(server, "/api/runs", host)[0] == 200, host
    finally:
        server.close()


def test_a_run_s_file_symlinked_out_of_its_run_is_not_served(server, runs_dir):
    secret = runs_dir.parent / "secret" / "eval.json"
    secret.write_text('{"token": "s3cr3t"}')
    (runs_dir / "beta" / "eval.json").symlink_to(secret)
    status, payload = _get(server, "/api/runs/beta/eval")
    assert status == 400 and "resolves outside its run's folder" in payload["error"]
    assert "s3cr3t" not in json.dumps(payload)
    (runs_dir / "beta" / "rollouts.jsonl").symlink_to(runs_dir.parent / "secret" / "metrics.jsonl")
    assert _get(server, "/api/runs/beta/rollouts")[0] == 400


def _with_a_broken_run(runs_dir: Path) -> None:
    broken = runs_dir / "broken"
    broken.mkdir()
    (broken / "metrics.jsonl").write_text('{"step": 0}\nnot json\n')
    (broken / "eval.json").write_text("{not json")


def test_a_run_that_cannot_be_read_gets_its_own_error(server, runs_dir):
    _with_a_broken_run(runs_dir)
    assert [run["name"] for run in _get(server, "/api/runs")[1]] == ["alpha", "beta", "broken"]
    status, payload = _get(server, "/api/runs/broken/metrics")
    assert status == 422 and "not readable as JSON" in payload["error"]
    assert _get(server, "/api/runs/broken/eval")[0] == 422
    assert _get(server, "/api/runs/alpha/metrics")[0] == 200


def test_without_a_tokenizer_tokens_are_ids(runs_dir):
    server = DashboardServer(runs_dir, port=0).start()  # the fake runs have no config.toml
    try:
        rollouts = _rollouts_once_loaded(server)
        assert rollouts["tokens_pending"] is False and rollouts["records"][0]["completion_tokens"] is None
    finally:
        server.close()


def test_a_loading_tokenizer_does_not_hold_up_the_rollouts(runs_dir):
    started, released, loads = threading.Event(), threading.Event(), []

    def slow_load(run_dir: Path):
        loads.append(run_dir.name)
        started.set()
        released.wait(timeout=120)
        return lambda ids: [f"<{i}>" for i in ids]

    server = DashboardServer(runs_dir, port=0, load_decoder=slow_load).start()
    try:
        assert started.wait(timeout=30), "start() warms the tokenizer of a run with rollouts"
        for _ in range(2):  # answered at once (_get times out long before the load is released), ids only
            status, rollouts = _get(server, "/api/runs/alpha/rollouts")
            assert status == 200 and rollouts["tokens_pending"] is True
            assert [r["completion_tokens"] for r in rollouts["records"]] == [None, None]
            assert rollouts["records"][0]["completion_ids"] == [10, 11, 12]
        released.set()
        rollouts = _rollouts_once_loaded(server)
        assert rollouts["tokens_pending"] is False
        assert rollouts["records"][0]["completion_tokens"] == ["<10>", "<11>", "<12>"]
        assert loads == ["alpha"]  # once per run, and not for beta, which has no rollouts
    finally:
        released.set()
        server.close()


def test_a_tokenizer_that_fails_to_load_ends_as_token_ids(runs_dir, caplog):
    def failing_load(run_dir: Path):
        raise RuntimeError("tokenizer.json is corrupt")

    caplog.set_level(logging.WARNING, logger="sharpen.monitoring.dashboard")
    server = DashboardServer(runs_dir, port=0, load_decoder=failing_load).start()
    try:
        rollouts = _rollouts_once_loaded(server)
        assert rollouts["tokens_pending"] is False and rollouts["records"][0]["completion_tokens"] is None
        assert "loading the tokenizer of alpha failed" in caplog.text and "tokenizer.json is corrupt" in caplog.text
    finally:
        server.close()


def _browser_flags(tmp_path: Path) -> list[str]:
    flags = ["--headless=new", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000"]
    return [*flags, f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,900"]


def _rendered_dom(url: str, tmp_path: Path) -> str:
    """The page's DOM once its scripts ran, as headless chromium dumps it."""
    dom = subprocess.run(
        [str(CHROMIUM), *_browser_flags(tmp_path), "--dump-dom", url],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert 'data-ready="1"' in dom, dom[-2000:]
    assert 'id="status"></div>' in dom, "the page reported an error"
    return dom


@pytest.mark.skipif(not CHROMIUM.exists(), reason="headless check needs Debian chromium at /usr/bin/chromium")
def test_the_page_renders_curves_and_coloured_tokens_in_a_browser(server, tmp_path):
    dom = _rendered_dom(server.url, tmp_path)
    for run in ["alpha", "beta"]:
        assert f'class="run-line" data-run="{run}" d="M' in dom
    assert dom.count('class="token') == 6  # two rollouts of step 4, three tokens each
    assert 'class="token env"' in dom  # the environment-appended token of the loss mask
    # coloured by logprob (the default): a likely token green, an unlikely one red (browsers report rgb())
    assert 'title="id 10 · logprob -0.100 · version 4" style="background: rgb(180, 242, 166);"' in dom
    assert 'style="background: rgb(242, 179, 166);"' in dom
    assert "<td>alpha</td>" in dom and "<th>pass@1</th>" in dom

    screenshot = tmp_path / "dashboard.png"
    subprocess.run(
        [str(CHROMIUM), *_browser_flags(tmp_path), f"--screenshot={screenshot}", server.url],
        capture_output=True,
        timeout=60,
        check=True,
    )
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and screenshot.stat().st_size > 10_000


@pytest.mark.skipif(not CHROMIUM.exists(), reason="headless check needs Debian chromium at /usr/bin/chromium")
def test_a_run_that_cannot_be_read_does_not_blank_the_page(runs_dir, tmp_path):
    _with_a_broken_run(runs_dir)
    server = DashboardServer(runs_dir, port=0).start()
    try:
        dom = subprocess.run(
            [str(CHROMIUM), *_browser_flags(tmp_path), "--dump-dom", server.url],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
    finally:
        server.close()
    assert 'data-ready="1"' in dom, dom[-2000:]
    for run in ["alpha", "beta"]:  # the readable runs' curves are drawn
        assert f'class="run-line" data-run="{run}" d="M' in dom
    assert "/api/runs/broken/metrics: 422" in dom  # and the broken run is named in the status line


@pytest.mark.skipif(not CHROMIUM.exists(), reason="headless check needs Debian chromium at /usr/bin/chromium")
def test_identical_curves_are_told_apart_in_a_browser(tmp_path):
    runs = tmp_path / "twins"
    rows = "".join(json.dumps({"step": s, "reward/mean": 0.1 * s}) + "\n" for s in range(5))
    for name in ["alpha", "beta"]:
        (runs / name).mkdir(parents=True)
        (runs / name / "metrics.jsonl").write_text(rows)
    server = DashboardServer(runs, port=0).start()
    try:
        dom = _rendered_dom(server.url, tmp_path)
    finally:
        server.close()
    line = r'<path class="run-line" data-run="(\w+)" d="M[^"]*" stroke="[^"]*" stroke-dasharray="([^"]*)"'
    paths = re.findall(line, dom)
    assert [run for run, _ in paths] == ["alpha", "beta"], dom[-3000:]
    assert paths[0][1] == "none" and paths[1][1] != "none"  # the first run solid, the second dashed over it
    assert "beta (same as alpha)" in dom and "alpha (same as" not in dom


def test_the_cli_reports_a_missing_runs_directory_in_one_line(tmp_path, capsys):
    assert main(["dashboard", str(tmp_path / "missing")]) == EXIT_USER_ERROR
    assert capsys.readouterr().err.startswith("sharpen: dashboard: runs directory ")


def test_the_cli_reports_a_taken_port_in_one_line(server, runs_dir, capsys):
    port = server.url.rstrip("/").rsplit(":", 1)[1]
    assert main(["dashboard", str(runs_dir), "--port", port]) == EXIT_USER_ERROR
    assert "cannot listen on 127.0.0.1:" in capsys.readouterr().err
