"""The `sharpen` entry point: user errors are one stderr line and exit code 2, the CLI surface is frozen, and
start-up imports no heavy library."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import get_args

import pytest
from pydantic import BaseModel

from sharpen.cli.main import EXIT_USER_ERROR, build_parser, main
from sharpen.config import SharpenConfig, load_config
from sharpen.config.section import is_internal


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1, f"expected one stderr line, got: {err!r}"
    assert "Traceback" not in err
    assert lines[0].startswith("sharpen: ")
    return lines[0]


@pytest.fixture
def in_tmp(tmp_path, monkeypatch) -> Path:
    """Run in a scratch folder: `train` creates its run directory relative to the working directory."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def nothing_heavy(monkeypatch):
    """Fail the test if `train` gets as far as the tokenizer, the trainer's model or the engine."""
    import transformers

    import sharpen.orchestration.build as build

    def forbidden(*args, **kwargs):
        raise AssertionError("a user error must be reported before the heavy components are built")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", forbidden)
    monkeypatch.setattr(build, "SingleDeviceBackend", forbidden)
    monkeypatch.setattr(build, "build_engine", forbidden)


def test_train_with_an_unknown_key(in_tmp, capsys):
    assert main(["train", "trainer.learning_rat=1e-5"]) == EXIT_USER_ERROR
    assert _one_error_line(capsys) == "sharpen: trainer.learning_rat: unknown key (did you mean 'learning_rate'?)"
    assert not (in_tmp / "runs").exists(), "a config error leaves no run directory behind"


def test_train_with_a_missing_recipe(in_tmp, capsys):
    assert main(["train", "missing.toml", "run.num_steps=1"]) == EXIT_USER_ERROR
    assert _one_error_line(capsys) == "sharpen: recipe 'missing.toml' does not exist"


def test_train_with_a_missing_model_fails_before_loading_anything(in_tmp, capsys, nothing_heavy, monkeypatch):
    import sharpen.orchestration.build as build

    def forbidden(*args, **kwargs):
        raise AssertionError("the model path is resolved before the data is loaded")

    monkeypatch.setattr(build, "load_examples", forbidden)
    assert main(["train", "model.path=/nonexistent/model"]) == EXIT_USER_ERROR
    line = _one_error_line(capsys)
    assert line.startswith("sharpen: model.path: '/nonexistent/model' does not exist")


def test_train_with_a_bad_data_row_fails_before_loading_the_model(in_tmp, capsys, nothing_heavy):
    model = in_tmp / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")  # enough for path resolution; nothing may read the weights
    data = in_tmp / "tasks.jsonl"
    data.write_text(json.dumps({"prompt": "1 + 1?", "answer": "2"}) + "\n" + json.dumps({"prompt": "2 + 2?"}) + "\n")
    code = main(["train", f"model.path={model}", "data.type=jsonl", f"data.path={data}"])
    assert code == EXIT_USER_ERROR
    line = _one_error_line(capsys)
    assert line == f"sharpen: {data}:2: missing field 'answer' (data.answer_field); the object has: prompt"


@pytest.mark.parametrize(
    ("argv", "resume"),
    [
        (["train", "r.toml", "run.seed=1"], False),
        (["train", "r.toml", "run.seed=1", "--resume"], True),
        (["train", "--resume", "r.toml", "run.seed=1"], True),  # a bare --resume takes no value
        (["train", "r.toml", "--resume", "auto", "run.seed=1"], "auto"),
        (["train", "--resume=auto", "r.toml", "run.seed=1"], "auto"),
    ],
)
def test_train_resume_is_a_flag_or_auto(in_tmp, monkeypatch, argv, resume):
    import sharpen.orchestration.runtime as runtime

    (in_tmp / "r.toml").write_text("[run]\nnum_steps = 3\n")
    seen = []

    def run(config, *, resume):
        seen.append((config.run.seed, resume))
        return in_tmp

    monkeypatch.setattr(runtime, "run", run)
    assert main(argv) == 0
    assert seen == [(1, resume)]


def test_train_resume_refuses_other_values(in_tmp, capsys):
    with pytest.raises(SystemExit):
        main(["train", "--resume=last"])
    assert "argument --resume: expected nothing or 'auto', not 'last'" in capsys.readouterr().err


def test_train_resume_without_a_complete_checkpoint_is_one_line(in_tmp, capsys, nothing_heavy):
    model = in_tmp / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (in_tmp / "runs" / "run" / "checkpoints" / "step_000002").mkdir(parents=True)  # no manifest: never finished
    assert main(["train", f"model.path={model}", "--resume"]) == EXIT_USER_ERROR
    assert _one_error_line(capsys) == (
        "sharpen: --resume: runs/run has no complete checkpoint to resume from "
        "(incomplete: step_000002: manifest.json is missing (the save did not finish))"
    )


def _user_keys(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Every dotted leaf key a user sets, including those of each implementation of a typed (``type``-chosen)
    section; fields and sections marked internal are left out."""
    keys = set()
    for name, field in model.model_fields.items():
        if is_internal(field):
            continue
        members = get_args(field.annotation) if field.discriminator else (field.annotation,)
        sections = [m for m in members if isinstance(m, type) and issubclass(m, BaseModel) and not is_internal(m)]
        if sections:
            for section in sections:
                keys |= _user_keys(section, f"{prefix}{name}.")
        else:
            keys.add(f"{prefix}{name}")
    return keys


INTERNAL_KEYS = (
    "rollout.engine.completions",  # the scripted engine, a fake for tests
    "weight_sync.probe_text",
    "trainer.num_threads",  # derived from the machine
    "sandbox.python_executable",
    "sandbox.prepare_ahead",
    "sandbox.work_root",
)


def test_config_keys_lists_every_key_a_user_sets(capsys):
    keys = _user_keys(SharpenConfig)
    assert {"trainer.algorithm.policy_loss.clip_eps_high", "data.path", "data.task", "sandbox.memory_mb"} <= keys
    assert main(["config", "--keys"]) == 0
    out = capsys.readouterr().out
    missing = sorted(key for key in keys if key not in out)
    assert not missing, f"config --keys leaves out: {missing}"
    listed = {line.split(":")[0].strip() for line in out.splitlines() if line.startswith("  ") and ":" in line}
    assert not listed & set(INTERNAL_KEYS), "internal knobs are not a user's to set"
    assert "type = 'scripted'" not in out


def test_internal_keys_stay_settable():
    overrides = [
        'rollout.engine={type = "scripted", completions = ["4"]}',
        'weight_sync.probe_text="1 + 1 = 2"',
        "trainer.num_threads=1",
        "sandbox.prepare_ahead=false",
    ]
    config = load_config(None, overrides)
    assert config.rollout.engine.type == "scripted" and config.weight_sync.probe_text == "1 + 1 = 2"
    assert config.trainer.resolved_num_threads == 1 and not config.sandbox.prepare_ahead


def test_config_prints_the_resolved_config_as_loadable_toml(tmp_path, capsys):
    recipe = tmp_path / "r.toml"
    recipe.write_text("[run]\nnum_steps = 3\n")
    assert main(["config", str(recipe), "run.name=printed"]) == 0
    printed = tomllib.loads(capsys.readouterr().out)
    assert printed["run"]["name"] == "printed" and printed["run"]["num_steps"] == 3
    assert SharpenConfig.model_validate(printed) == load_config(recipe, ["run.name=printed"])
    # without a recipe the first KEY=VALUE is an override, not a recipe path
    assert main(["config", "run.name=a", "run.seed=5"]) == 0
    printed = tomllib.loads(capsys.readouterr().out)
    assert (printed["run"]["name"], printed["run"]["seed"]) == ("a", 5)


def _surface(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> set[str]:
    entries = set()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                entries.add(" ".join((*prefix, name)))
                entries |= _surface(sub, (*prefix, name))
        else:
            entries.add(" ".join((*prefix, *(action.option_strings or [action.dest]))))
    return entries


def test_cli_surface_is_frozen():
    """Growing the CLI is a decision: new subcommands and flags go through this list (settings belong in config)."""
    assert _surface(build_parser()) == {
        "train",
        "train recipe",
        "train overrides",
        "train --resume",
        "train --verbose",
        "eval",
        "eval recipe",
        "eval overrides",
        "eval --num-samples",
        "eval --ks",
        "eval --num-tasks",
        "eval --output",
        "eval --verbose",
        "inspect",
        "inspect run_dir",
        "replay",
        "replay run_dir",
        "replay --step",
        "replay --index",
        "config",
        "config recipe",
        "config overrides",
        "config --keys",
        "serve-rm",
        "serve-rm model_path",
        "serve-rm --host",
        "serve-rm --port",
        "serve-rm --max-batch-size",
        "serve-rm --max-wait-ms",
        "serve-rm --max-length",
        "serve-sandbox",
        "serve-sandbox recipe",
        "serve-sandbox overrides",
        "serve-sandbox --host",
        "serve-sandbox --port",
        "serve-env",
        "serve-env recipe",
        "serve-env overrides",
        "serve-env --host",
        "serve-env --port",
        "simulate",
        "simulate scenario",
        "simulate --json",
        "simulate --search-split",
        "simulate --search-layout",
        "dashboard",
        "dashboard runs_dir",
        "dashboard --host",
        "dashboard --port",
        "dashboard --allow-host",
        "models",
        "models list",
        "models pull",
        "models pull name",
        "models pull --force",
        "tasks",
        "tasks build",
        "tasks build --package",
        "tasks build --out",
        "tasks build --seed",
        "tasks build --max-tasks",
        "tasks build --max-tries",
        "tasks build --ignore",
        "tasks check",
        "tasks check task_set",
    }


def test_cli_start_up_imports_no_heavy_library():
    code = (
        "import contextlib, io, sys\n"
        "from sharpen.cli.main import build_parser, main\n"
        "build_parser().format_help()\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    rc = main(['config', 'run.num_steps=3'])\n"
        "with contextlib.redirect_stderr(io.StringIO()):\n"
        "    bad = main(['config', 'trainer.learning_rat=1'])\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'transformers', 'vllm', 'ray'})\n"
        "print(rc, bad, heavy)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert result.stdout.strip() == f"0 {EXIT_USER_ERROR} []", result.stdout + result.stderr
