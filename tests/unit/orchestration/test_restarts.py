"""A run that lost a component restarts itself (`session.run_restarting`): the runtime's attempt again, resumed the
``--resume auto`` way, at most ``runtime.max_restarts`` times, one log line each; any other error, or no restarts
allowed, ends the run at once with the attempt's own error."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from sharpen.config import SharpenConfig, load_config
from sharpen.orchestration.manifest import write_manifest
from sharpen.orchestration.session import Resume, run_restarting


class Died(RuntimeError):
    pass


def lost(error: BaseException) -> str | None:
    return "trainer rank 1 died during step()" if isinstance(error, Died) else None


def config(tmp_path: Path, max_restarts: int) -> SharpenConfig:
    return load_config(
        None, [f"run.output_dir={json.dumps(str(tmp_path))}", "run.name='r'", f"runtime.max_restarts={max_restarts}"]
    )


def attempts_that_die(run_dir: Path, times: int) -> tuple[list[Resume], Callable[[Resume], Path]]:
    """An attempt that records 3 steps and a complete checkpoint of step 2, then dies ``times`` times."""
    calls: list[Resume] = []

    def attempt(resume: Resume) -> Path:
        calls.append(resume)
        folder = run_dir / "checkpoints" / "step_000002"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "state.json").write_text("{}")
        write_manifest(folder)
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(3)))
        if len(calls) <= times:
            raise Died("the actor's process ended")
        return run_dir

    return calls, attempt


def test_a_lost_component_restarts_the_run_from_its_checkpoint(tmp_path: Path, caplog) -> None:
    calls, attempt = attempts_that_die(tmp_path / "r", times=2)
    with caplog.at_level(logging.WARNING, logger="sharpen.orchestration.session"):
        assert run_restarting(config(tmp_path, 2), attempt, resume=False, lost=lost) == tmp_path / "r"
    assert calls == [False, "auto", "auto"]
    assert [r.getMessage() for r in caplog.records] == [
        f"trainer rank 1 died during step() with 3 step(s) done; restart {n} of 2 from the checkpoint step_000002"
        for n in (1, 2)
    ]


def test_past_max_restarts_the_last_error_ends_the_run(tmp_path: Path, caplog) -> None:
    calls, attempt = attempts_that_die(tmp_path / "r", times=3)
    with pytest.raises(Died, match="the actor's process ended"):
        run_restarting(config(tmp_path, 2), attempt, resume=True, lost=lost)
    assert calls == [True, "auto", "auto"]
    assert caplog.records[-1].getMessage().endswith("no restart left (runtime.max_restarts = 2)")


@pytest.mark.parametrize(("max_restarts", "error"), [(0, Died("dead")), (2, ValueError("a bug in a reward"))])
def test_other_errors_and_no_restarts_end_the_run_at_once(tmp_path: Path, max_restarts: int, error) -> None:
    calls: list[Resume] = []

    def attempt(resume: Resume) -> Path:
        calls.append(resume)
        raise error

    with pytest.raises(type(error)):
        run_restarting(config(tmp_path, max_restarts), attempt, resume="auto", lost=lost)
    assert calls == ["auto"]


def test_a_restart_before_any_checkpoint_says_it_starts_from_step_0(tmp_path: Path, caplog) -> None:
    calls: list[Resume] = []

    def attempt(resume: Resume) -> Path:
        calls.append(resume)
        if len(calls) == 1:
            raise Died("gone")
        return tmp_path

    with caplog.at_level(logging.WARNING, logger="sharpen.orchestration.session"):
        run_restarting(config(tmp_path, 1), attempt, resume=False, lost=lost)
    assert (
        caplog.records[0]
        .getMessage()
        .endswith("with 0 step(s) done; restart 1 of 1 from step 0 (no complete checkpoint)")
    )


def test_only_an_actor_death_restarts_a_run_wherever_it_was_raised_from() -> None:
    pytest.importorskip("ray")
    from sharpen.orchestration.ray.proxies import ActorCallError, ActorDeathError
    from sharpen.orchestration.ray.runtime import lost_actor

    death = ActorDeathError("ray actor 'trainer rank 1' died during step(): ...", actor="trainer rank 1", call="step")
    try:
        try:
            raise death
        except ActorDeathError as error:
            raise RuntimeError("the producer thread failed") from error  # async mode re-raises in the loop
    except RuntimeError as wrapped:
        assert lost_actor(wrapped) == "ray actor 'trainer rank 1' died during step()"
    assert lost_actor(ActorCallError("ray actor 'engine' did not answer generate() within 1 s")) is None
    assert lost_actor(ValueError("a bug")) is None
