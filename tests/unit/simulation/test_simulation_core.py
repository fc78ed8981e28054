"""The event core, the alpha-beta collectives against their closed forms, and scenario errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from simulation_scenarios import base_scenario

from sharpen.cli.main import main
from sharpen.simulation import ScenarioError, load_scenario, parse_scenario, simulate
from sharpen.simulation.collectives import (
    ring_allgather_seconds,
    ring_allreduce_seconds,
    ring_broadcast_seconds,
    tree_broadcast_seconds,
)
from sharpen.simulation.events import EventQueue
from sharpen.simulation.report import STATED_ERROR


def test_events_come_out_in_time_order_and_ties_in_push_order() -> None:
    events = EventQueue()
    events.push(2.0, "c")
    events.push(1.0, "a", 1)
    events.push(1.0, "b", 2)
    popped = [events.pop() for _ in range(3)]
    assert [(e.time, e.kind, e.payload) for e in popped] == [(1.0, "a", (1,)), (1.0, "b", (2,)), (2.0, "c", ())]
    assert events.now == 2.0
    with pytest.raises(ValueError, match="in the past"):
        events.push(1.5, "late")


def test_a_seed_fixes_the_run_and_another_seed_changes_it() -> None:
    data = base_scenario(response={"kind": "lognormal", "median": 200, "sigma": 1.0})
    first, again = simulate(parse_scenario(data)), simulate(parse_scenario(data))
    assert first.step_times == again.step_times
    data["simulation"]["seed"] = 1
    assert simulate(parse_scenario(data)).step_times != first.step_times


def test_collectives_match_their_closed_forms() -> None:
    alpha, beta, size = 1e-5, 1e10, 8e9
    assert ring_allgather_seconds(size, 8, alpha=alpha, beta=beta) == pytest.approx(7 * (alpha + size / 8 / beta))
    assert ring_allreduce_seconds(size, 8, alpha=alpha, beta=beta) == pytest.approx(14 * (alpha + size / 8 / beta))
    assert tree_broadcast_seconds(size, 9, alpha=alpha, beta=beta) == pytest.approx(4 * (alpha + size / beta))
    chunked = ring_broadcast_seconds(size, 5, alpha=alpha, beta=beta, num_chunks=64)
    assert chunked == pytest.approx((4 + 63) * (alpha + size / 64 / beta))
    # pipelining: with many chunks a chain costs about one transfer whatever its length; a tree pays log2(p)
    assert chunked < 1.1 * size / beta < tree_broadcast_seconds(size, 5, alpha=alpha, beta=beta)
    assert ring_allgather_seconds(size, 1, alpha=alpha, beta=beta) == 0.0
    assert math.isclose(ring_broadcast_seconds(size, 2, alpha=0.0, beta=beta), size / beta)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"cluster": {"gpus": 4}}, "cluster.gpus: unknown key"),
        ({"cluster": {"gpu": "Z9"}}, "gpu 'Z9' is not known"),
        ({"rollout": {"mode": "async"}, "cluster": {"placement": "colocated"}}, "async mode needs disaggregated"),
        ({"cluster": {"placement": "colocated", "num_trainer_gpus": 3}}, "num_trainer_gpus must equal"),
        ({"workload": {"prompts_per_step": 0}}, "workload.prompts_per_step"),
        ({"workload": {"response_tokens": {"kind": "lognormal", "median": 0}}}, "needs median > 0"),
    ],
)
def test_a_bad_scenario_gets_one_clear_error(change: dict[str, dict[str, object]], message: str) -> None:
    data = base_scenario()
    for section, values in change.items():
        data[section].update(values)
    with pytest.raises(ScenarioError, match=message) as caught:
        parse_scenario(data)
    assert "\n" not in str(caught.value)


def test_the_cli_reports_a_bad_scenario_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[cluster]\ngpu = "H100"\n')
    assert main(["simulate", str(path)]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("sharpen: ") and "model: Field required" in error and "\n" not in error
    assert main(["simulate", str(tmp_path / "missing.toml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_every_shipped_scenario_loads_and_the_cli_prints_a_report(capsys: pytest.CaptureFixture[str]) -> None:
    folder = Path(__file__).parents[3] / "scenarios"
    paths = sorted(folder.glob("*.toml"))
    assert paths
    for path in paths:
        load_scenario(path)
    assert main(["simulate", str(folder / "this_machine_scripted.toml"), "--json"]) == 0
    assert '"async_speedup"' in capsys.readouterr().out


def test_a_model_too_big_for_one_replica_is_a_scenario_error() -> None:
    data = base_scenario(model={"num_params": 1e11, "kv_bytes_per_token": 1e5}, cluster={"gpu": "A100-40GB"})
    with pytest.raises(ScenarioError, match="do not fit one engine replica"):
        simulate(parse_scenario(data))


def test_the_cli_shows_progress_on_stderr_and_the_stated_error_beside_predictions(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A split search prints a line per candidate on stderr as it goes (stdout keeps the report, or the JSON);
    the report carries the validated error range beside the step time, the generation time and the speedup."""
    path = Path(__file__).parents[3] / "scenarios" / "this_machine_scripted.toml"
    assert main(["simulate", str(path), "--search-split", "3"]) == 0
    captured = capsys.readouterr()
    progress = captured.err.splitlines()
    assert all(line.startswith("sharpen simulate: ") for line in progress)
    assert " s  split 1/2: 1 + 2 GPUs, " in progress[-2] and " s  split 2/2: 2 + 1 GPUs, " in progress[-1]
    lines = {line.split()[0]: line for line in captured.out.splitlines() if line.startswith("  ")}
    for name, kind in (("step", "step_seconds"), ("generation", "generation_seconds"), ("async", "async_speedup")):
        assert STATED_ERROR[kind].tag() in lines[name]
    assert main(["simulate", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    stated = STATED_ERROR["async_speedup"]
    assert report["stated_error"]["async_speedup"] == {"low": stated.low, "high": stated.high}
