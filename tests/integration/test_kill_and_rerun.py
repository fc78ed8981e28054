"""Runs outlive their processes: ``sharpen train ... --resume auto`` killed with SIGKILL mid-run and run again
finishes with the metrics of a run never interrupted (the run is reproducible, so equal means equal), in the
embedded and the Ray runtime; and in the Ray runtime a trainer rank that dies mid-run is restarted from the newest
checkpoint by the run itself (``runtime.max_restarts``), which says so in its log.

Every run here is 4 steps of the tiny model with a checkpoint after steps 2 and 4; a kill lands after step 3's
metrics were written (past the checkpoint of step 2), so the rerun must drop them and repeat step 3."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from test_tiny_loop import stable

from sharpen.monitoring import DIGEST_FILE_NAME, read_jsonl
from sharpen.monitoring.run_log import LOG_FILE_NAME

pytestmark = pytest.mark.slow

PLUGIN = '''
def vowels(example, completion):
    """The fraction of vowels: random tokens give varied scores, so the weights really move."""
    return sum(ch in "aeiou" for ch in completion) / max(len(completion), 1)
'''

RAY = {
    "runtime.type": '"ray"',
    "runtime.ray_cpus": "2",
    "runtime.trainer_cpus": "0.5",
    "runtime.engine_cpus": "0.5",
    "runtime.call_timeout_s": "120",
}


def train_command(model: Path, out: Path, *, name: str, **extra: str) -> list[str]:
    """``sharpen train`` of the tiny run (`tiny_overrides`) with ``--resume auto``."""
    sharpen = str(Path(sys.executable).with_name("sharpen"))
    return [sharpen, "train", *tiny_overrides(model, out, name=name, **extra), "--resume", "auto"]


def tiny_overrides(model: Path, out: Path, *, name: str, **extra: str) -> list[str]:
    """The tiny run: 4 steps, checkpoints after steps 2 and 4, one torch thread (the Ray actors' count: the runtimes
    then agree bit for bit), the vowel reward from a file (a child process cannot be handed a test's callable)."""
    plugin = out / "plugin.py"
    plugin.write_text(PLUGIN)
    values = {
        "run.name": json.dumps(name),
        "run.output_dir": json.dumps(str(out)),
        "run.num_steps": "4",
        "run.checkpoint_every": "2",
        "run.export_model": "false",
        "model.path": json.dumps(str(model)),
        "data.task_config": "{min_terms = 2, max_terms = 2, min_digits = 1, max_digits = 1, operators = ['+']}",
        "data.size": "64",
        "reward.correct_weight": "0.0",
        "reward.components": f'[{{type = "custom", function = {json.dumps(f"{plugin}:vowels")}}}]',
        "rollout.engine.type": '"hf"',
        "rollout.prompts_per_step": "2",
        "rollout.num_samples_per_prompt": "4",
        "rollout.max_new_tokens": "12",
        "trainer.micro_batch_size": "4",
        "trainer.learning_rate": "1e-3",
        "trainer.num_threads": "1",
        "trainer.precision": '"float32"',
        "monitoring.progress": "false",
        **extra,
    }
    return [f"{key}={value}" for key, value in values.items()]


def child_env() -> dict[str, str]:
    return {**os.environ, "RAY_AUTH_MODE": "disabled"}


def run_to_the_end(command: list[str]) -> Path:
    """The command's run directory, after it finished (its output in the failure message otherwise)."""
    done = subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{command[1]} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("run directory: ")]
    return Path(line.removeprefix("run directory: "))


def kill_after_three_steps(command: list[str], run_dir: Path, *, whole_group: bool) -> None:
    """Start ``command`` in its own process group and SIGKILL it once step 3's metrics are written (the checkpoint
    of step 2 is complete, the one of step 4 not yet begun): the whole group, or (``whole_group=False``) the driver's
    process alone, whose local Ray instance must then die with it. Waits until every process it started is gone."""
    process = subprocess.Popen(
        command, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
        assert process.poll() is None, f"the run ended (exit {process.returncode}) before it could be killed"
        assert time.monotonic() < deadline, "no third step within 240 s"
        time.sleep(0.02)
    started = psutil.Process(process.pid).children(recursive=True)
    if whole_group:
        os.killpg(process.pid, signal.SIGKILL)
    else:
        process.kill()
    process.wait()
    assert (run_dir / "checkpoints" / "step_000002" / "manifest.json").is_file()
    assert not (run_dir / "checkpoints" / "step_000004" / "manifest.json").exists(), "killed too late"
    _, alive = psutil.wait_procs(started, timeout=30)
    # Ray's dashboard and runtime-env agents notice their raylet's death only after a minute or so, and then exit:
    # the only processes allowed to outlive the driver here; the test stops them instead of waiting.
    lingering = [(orphan.pid, name) for orphan in alive if (name := name_of(orphan)) and not name.endswith("Agent")]
    for orphan in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            orphan.kill()
    assert not lingering, f"processes outlived the killed driver: {lingering}"


def name_of(process: psutil.Process) -> str:
    """The process's name, or "" when it ended meanwhile."""
    try:
        return process.name()
    except psutil.NoSuchProcess:
        return ""


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same command, never interrupted (embedded; the Ray runtime gives the same metrics)."""
    out = tmp_path_factory.mktemp("uninterrupted")
    return run_to_the_end(train_command(tiny_model_path, out, name="full"))


def assert_same_run(rerun: Path, full: Path) -> None:
    rows, full_rows = read_jsonl(rerun / "metrics.jsonl"), read_jsonl(full / "metrics.jsonl")
    assert [row["step"] for row in rows] == [0, 1, 2, 3]  # step 3 once: the killed attempt's line was dropped
    assert stable(rows) == stable(full_rows)
    assert full_rows[3]["reward/mean"] != full_rows[2]["reward/mean"]  # the compared steps carry real signal
    assert read_jsonl(rerun / DIGEST_FILE_NAME) == read_jsonl(full / DIGEST_FILE_NAME)
    assert sorted({row["step"] for row in read_jsonl(rerun / "rollouts.jsonl")}) == [0, 1, 2, 3]


def test_a_killed_embedded_run_rerun_with_resume_auto_equals_the_uninterrupted_run(
    tiny_model_path: Path, tmp_path: Path, uninterrupted: Path
) -> None:
    command = train_command(tiny_model_path, tmp_path, name="killed")
    kill_after_three_steps(command, tmp_path / "killed", whole_group=True)
    rerun = run_to_the_end(command)
    assert_same_run(rerun, uninterrupted)
    assert "resuming" in (rerun / LOG_FILE_NAME).read_text()


@pytest.mark.ray
def test_a_killed_ray_driver_rerun_with_resume_auto_equals_the_uninterrupted_run(
    tiny_model_path: Path, tmp_path: Path, uninterrupted: Path
) -> None:
    """Only the driver's process is killed: the local Ray instance it started dies with it (Ray's fate sharing),
    and the rerun starts a new one."""
    command = train_command(tiny_model_path, tmp_path, name="killed", **RAY)
    kill_after_three_steps(command, tmp_path / "killed", whole_group=False)
    assert_same_run(run_to_the_end(command), uninterrupted)


@pytest.mark.ray
@pytest.mark.usefixtures("ray_instance")
def test_a_dead_trainer_rank_restarts_the_run_from_its_checkpoint(
    tiny_model_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """2 FSDP2 rank actors; one rank's process is killed after the checkpoint of step 2: the run stops its actors,
    starts new ones, resumes from that checkpoint (``runtime.max_restarts = 1``) and ends as if nothing happened."""
    import torch

    from sharpen.config import load_config
    from sharpen.config.runtime import RuntimeConfig
    from sharpen.orchestration.runtime import run

    two_ranks = RuntimeConfig(type="ray", trainer_ranks=2, trainer_cpus=0.5, engine_cpus=0.5, call_timeout_s=120)

    def run_two_ranks(name: str, max_restarts: int) -> Path:
        config = load_config(None, tiny_overrides(tiny_model_path, tmp_path, name=name))
        threads = torch.get_num_threads()
        try:
            return run(config, runtime=two_ranks.model_copy(update={"max_restarts": max_restarts}))
        finally:
            torch.set_num_threads(threads)

    full = run_two_ranks("full", 0)
    killer = threading.Thread(target=kill_a_rank_after, args=(tmp_path / "restarted" / "checkpoints" / "step_000002",))
    killer.start()
    with caplog.at_level(logging.WARNING, logger="sharpen.orchestration.session"):
        restarted = run_two_ranks("restarted", 1)
    killer.join()
    (line,) = [r.getMessage() for r in caplog.records if "restart" in r.getMessage()]
    assert re.fullmatch(
        r"ray actor 'trainer rank [01]' died during \w+\(\) with [23] step\(s\) done; "
        r"restart 1 of 1 from the checkpoint step_000002",
        line,
    ), line
    assert_same_run(restarted, full)


def kill_a_rank_after(checkpoint: Path) -> None:
    """SIGKILL one trainer rank actor's process (a descendant of this test's Ray instance) once ``checkpoint`` is
    complete."""
    deadline = time.monotonic() + 300
    while not (checkpoint / "manifest.json").exists():
        if time.monotonic() > deadline:
            return  # the test fails on the missing restart line
        time.sleep(0.02)
    ranks = [
        process
        for process in psutil.Process().children(recursive=True)
        if "TrainerActor" in " ".join(process.cmdline())
    ]
    assert len(ranks) == 2, [process.cmdline() for process in ranks]
    os.kill(ranks[-1].pid, signal.SIGKILL)
