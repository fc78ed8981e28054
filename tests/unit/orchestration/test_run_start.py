"""Where a run starts: fresh, from the newest complete checkpoint, or (``--resume auto``) whichever the run directory
allows; an earlier attempt without a checkpoint is moved aside, never deleted."""

from __future__ import annotations

from pathlib import Path

import pytest

from sharpen.config import ConfigError, load_config
from sharpen.orchestration.checkpoint import CheckpointScan
from sharpen.orchestration.session import RunStart, choose_start, prepare_run_dir

RUN = Path("/runs/r")
FOUND = CheckpointScan(latest=RUN / "checkpoints" / "step_000004", skipped=["step_000006: manifest.json is missing"])
NONE = CheckpointScan(skipped=["step_000002: manifest.json is missing"])


@pytest.mark.parametrize(
    ("resume", "holds_steps", "scan", "start"),
    [
        (False, False, CheckpointScan(), RunStart()),
        (True, True, FOUND, RunStart(checkpoint=FOUND.latest)),
        (True, False, FOUND, RunStart(checkpoint=FOUND.latest)),
        ("auto", True, FOUND, RunStart(checkpoint=FOUND.latest)),
        ("auto", False, CheckpointScan(), RunStart()),  # a new run directory
        ("auto", False, NONE, RunStart()),  # nothing recorded yet: nothing to keep
        ("auto", True, NONE, RunStart(set_aside=True)),  # steps but no checkpoint: kept aside, then step 0
    ],
)
def test_where_a_run_starts(resume, holds_steps: bool, scan: CheckpointScan, start: RunStart) -> None:
    assert choose_start(resume, run_dir=RUN, holds_steps=holds_steps, scan=scan) == start


@pytest.mark.parametrize(
    ("resume", "holds_steps", "scan", "message"),
    [
        (False, True, FOUND, "run directory /runs/r already holds a run; pass --resume (or --resume auto) or choose"),
        (
            True,
            True,
            NONE,
            "--resume: /runs/r has no complete checkpoint to resume from "
            "(incomplete: step_000002: manifest.json is missing)",
        ),
        (True, False, CheckpointScan(), "--resume: /runs/r has no complete checkpoint to resume from"),
    ],
)
def test_starts_that_are_refused(resume, holds_steps: bool, scan: CheckpointScan, message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        choose_start(resume, run_dir=RUN, holds_steps=holds_steps, scan=scan)
    assert str(refused.value).startswith(message)


def test_auto_moves_an_attempt_without_a_checkpoint_aside_and_keeps_the_run_log(tmp_path: Path) -> None:
    config = load_config(None, [f"run.output_dir={str(tmp_path)!r}", "run.name='r'"])
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "sharpen.log").write_text("the command's log, appended to\n")
    for attempt in (1, 2):  # each attempt dies after a step, before its first checkpoint is complete
        (run_dir / "checkpoints" / "step_000002").mkdir(parents=True)
        (run_dir / "metrics.jsonl").write_text(f'{{"attempt": {attempt}}}\n')
        assert prepare_run_dir(config, resume="auto") == (run_dir, None)
        kept = run_dir / "attempts" / str(attempt)
        assert (kept / "metrics.jsonl").read_text() == f'{{"attempt": {attempt}}}\n'
        assert (kept / "checkpoints" / "step_000002").is_dir()
        assert sorted(p.name for p in run_dir.iterdir()) == ["attempts", "sharpen.log"]
