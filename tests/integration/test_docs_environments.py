"""docs/environments.md stays true: its example environment and recipe, copied out of the page, train and replay."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sharpen.cli.main import main
from sharpen.config import load_config
from sharpen.monitoring import read_jsonl
from sharpen.orchestration.embedded import run_embedded

DOC = Path(__file__).resolve().parents[2] / "docs" / "environments.md"


def _block(language: str, marker: str) -> str:
    blocks = re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), re.DOTALL)
    [block] = [b for b in blocks if marker in b]
    return block


def test_the_example_environment_is_under_30_lines():
    code = _block("python", "class ReverseWord")
    assert len([line for line in code.splitlines() if line.strip()]) < 30


@pytest.mark.slow
def test_the_documented_environment_trains_and_replays(
    tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    (tmp_path / "my_env.py").write_text(_block("python", "class ReverseWord"))
    (tmp_path / "reverse.toml").write_text(_block("toml", 'type = "custom"'))
    monkeypatch.chdir(tmp_path)  # the recipe's paths are relative to where sharpen runs
    overrides = {
        "run.name": json.dumps("reverse"),
        "run.num_steps": "2",
        "model.path": json.dumps(str(tiny_model_path)),
        "rollout.engine": '{type = "scripted", completions = ["elppa", "nope", "revir", "duolc", "enots"]}',
        "rollout.prompts_per_step": "2",
        "rollout.num_samples_per_prompt": "4",
        "trainer.micro_batch_size": "4",
        "weight_sync.verify": "false",
        "monitoring.progress": "false",
        "monitoring.num_recorded_rollouts": "8",
    }
    config = load_config("reverse.toml", [f"{k}={v}" for k, v in overrides.items()])
    run_dir = run_embedded(config)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert len(rows) == 2 and all(row["reward/num_abstained"] == 0 for row in rows)
    recorded = read_jsonl(run_dir / "rollouts.jsonl")
    assert {r["reward"]["verifier"] for r in recorded} == {"environment:reverse_word"}
    assert any(len(r["episode"]["turns"]) > 1 for r in recorded)  # wrong answers got feedback and retried
    assert main(["replay", str(run_dir), "--step", "1", "--index", "3"]) == 0
    assert "reproduced" in capsys.readouterr().out


@pytest.mark.slow
def test_the_documented_image_observation_example_runs(tmp_path: Path, smollm2_path: Path) -> None:
    import subprocess
    import sys

    (tmp_path / "images_example.py").write_text(_block("python", "class ShowTwoColours"))
    done = subprocess.run(
        [sys.executable, "images_example.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith("2 images; 4 image tokens in the 2nd observation\n"), done.stdout
