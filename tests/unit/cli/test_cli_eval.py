"""`sharpen eval` with a tiny random model and the transformers engine on reasoning-gym tasks: what it prints, the
JSON report it writes, and its user errors (one line, exit 2, before anything heavy loads)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sharpen.cli.main import EXIT_USER_ERROR, main

TASKS = "data.task_config={min_terms = 2, max_terms = 2, min_digits = 1, max_digits = 1, operators = ['+']}"


def _args(model: Path, tmp_path: Path, *extra: str) -> list[str]:
    return [
        "eval",
        f"model.path={json.dumps(str(model))}",
        f"run.output_dir={json.dumps(str(tmp_path / 'runs'))}",
        "run.name=tiny",
        "data.size=8",
        TASKS,
        'rollout.engine.type="hf"',
        "rollout.max_new_tokens=8",
        *extra,
    ]


def test_eval_prints_the_table_and_writes_the_report(tiny_model_path, tmp_path, capsys):
    output = tmp_path / "report.json"
    args = _args(tiny_model_path, tmp_path, "--num-samples", "3", "--ks", "1,3", "--num-tasks", "3")
    assert main([*args, "--output", str(output)]) == 0
    out = capsys.readouterr().out
    assert "pass@k" in out and "basic_arithmetic/0" in out
    assert "pass@1 = " in out and "over 9 samples (3 tasks x 3" in out
    assert f"report: {output}" in out

    report = json.loads(output.read_text())
    assert (report["num_tasks"], report["num_samples"], report["num_samples_per_task"]) == (3, 9, 3)
    assert report["ks"] == [1, 3]
    assert [task["task_key"] for task in report["tasks"]] == [f"basic_arithmetic/{i}" for i in range(3)]
    assert sum(report["status_counts"].values()) == 9
    assert report["num_abstained"] == 0  # a random model is wrong or unformatted, never unjudged
    for name in ("pass_at_k", "maj_at_k", "mean_at_k"):
        assert set(report[name]) == {"1", "3"} and all(0.0 <= v <= 1.0 for v in report[name].values())
    assert report["pass_at_k"]["1"] <= report["pass_at_k"]["3"]
    assert report["settings"]["max_new_tokens"] == 8 and report["settings"]["temperature"] == 1.0
    assert 0 < report["num_generated_tokens"] <= 9 * 8 and report["tokens_per_second"] > 0

    # without --output the report goes into the recipe's run directory
    assert main([*_args(tiny_model_path, tmp_path, "--num-samples", "1", "--ks", "1", "--num-tasks", "1")]) == 0
    assert json.loads((tmp_path / "runs" / "tiny" / "eval.json").read_text())["num_samples"] == 1


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--num-samples", "2"], "sharpen: ks = [1, 4]: every k must be between 1 and num_samples = 2"),
        (["--ks", "1,x"], "sharpen: --ks '1,x': expected comma-separated integers, e.g. --ks 1,5"),
        (["--num-tasks", "9"], "sharpen: num_tasks = 9, but the recipe's data has 8 tasks"),
    ],
)
def test_eval_user_errors_are_one_line(tiny_model_path, tmp_path, capsys, monkeypatch, flags, message):
    import sharpen.orchestration.build as build

    def forbidden(*args, **kwargs):
        raise AssertionError("a user error must be reported before the engine is built")

    monkeypatch.setattr(build, "build_engine", forbidden)
    assert main([*_args(tiny_model_path, tmp_path), *flags]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(message), err


def test_eval_of_a_training_checkpoint_says_what_to_evaluate(tmp_path, capsys):
    checkpoint = tmp_path / "runs" / "r" / "checkpoints" / "step_000002"
    checkpoint.mkdir(parents=True)
    (checkpoint / "state.json").write_text("{}")
    assert main(["eval", f"model.path={json.dumps(str(checkpoint))}"]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert "is a training checkpoint" in err and "run_dir/model" in err


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (make system-deps)")
def test_eval_on_humaneval_runs_each_problems_tests_in_the_sandbox(tiny_model_path, tmp_path, capsys):
    output = tmp_path / "humaneval.json"
    args = [
        "eval",
        str(Path(__file__).parents[3] / "recipes" / "eval" / "humaneval.toml"),
        f"model.path={json.dumps(str(tiny_model_path))}",
        f"run.output_dir={json.dumps(str(tmp_path / 'runs'))}",
        'rollout.engine.type="hf"',
        "rollout.max_new_tokens=8",
        "data.limit=2",
    ]
    assert main([*args, "--num-samples", "2", "--ks", "1,2", "--output", str(output)]) == 0
    assert "pass@1 = 0.000 over 4 samples (2 tasks x 2" in capsys.readouterr().out  # random tokens never pass
    report = json.loads(output.read_text())
    assert [task["task_key"] for task in report["tasks"]] == ["HumanEval/0", "HumanEval/1"]
    assert report["num_abstained"] == 0 and sum(report["status_counts"].values()) == 4
