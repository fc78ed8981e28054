"""The ``rollback`` policy of the stability guards (``monitoring.guards.on_bad_step = "rollback"``): a bad step
restores the newest complete checkpoint in the same run and the run goes on with the data after the bad batch.

The policy's rules on synthetic metrics (fast), then whole runs of a tiny random Llama with the transformers engine
whose batch holding a chosen "poisoned" example gets its advantages scaled by 1e4: a real gradient-norm spike, many
times the median of the steps before."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from test_tiny_loop import stable, tiny_config, vowel_reward

from sharpen.config import load_config
from sharpen.config.guards import GuardsConfig
from sharpen.config.loader import ConfigError
from sharpen.monitoring import RunHealth, RunStopped, read_alarms, read_jsonl
from sharpen.monitoring.health import record_rollback
from sharpen.monitoring.inspect import inspect_run
from sharpen.orchestration.embedded import run_embedded
from sharpen.trainer import Trainer
from sharpen.types import TrainBatch

ROLLBACK = {"monitoring.guards.on_bad_step": '"rollback"', "run.checkpoint_every": "3"}
NONFINITE = {"train/grad_norm": float("nan"), "train/num_nonfinite_updates": 1.0}


def test_a_rollback_needs_a_checkpoint_then_is_asked_once_and_stops_past_max_rollbacks(tmp_path: Path, caplog):
    guards = GuardsConfig(on_bad_step="rollback", max_rollbacks=1)
    health = RunHealth(tmp_path, spike_factor=5.0, spike_window=10, guards=guards)
    with caplog.at_level(logging.WARNING):
        health.check(1, [], NONFINITE)  # no checkpoint yet: one line, the run goes on
    assert health.rollback is None and health.stop_reason is None
    assert (
        "step 1: a non-finite gradient (train/num_nonfinite_updates = 1); no checkpoint to roll back to yet: the run "
        'goes on (monitoring.guards.on_bad_step = "rollback")'
    ) in caplog.text
    health.checkpointed(3)
    assert health.skip_above() is None  # 1 finite norm known: no spike bound yet (5 needed)
    health.check(3, [], {"train/grad_norm": 1.0})
    assert health.rollback is None
    health.check(4, [], NONFINITE)
    assert health.rollback is not None and health.stop_reason is None
    assert (health.rollback.step, health.rollback.signal, health.rollback.number) == (
        4,
        "train/num_nonfinite_updates",
        1,
    )
    line = record_rollback(tmp_path, health.rollback, checkpoint="step_000003", next_step=3, max_rollbacks=1)
    assert line == (
        "step 4: a non-finite gradient (train/num_nonfinite_updates = 1); rolled back to checkpoint step_000003 "
        "(rollback 1 of 1): steps 3-4 run again on the data after step 4's batch"
    )
    # the next loop's health, after the rollback: the record is kept and counted; the second bad step stops the run
    after = RunHealth(tmp_path, spike_factor=5.0, spike_window=10, guards=guards)
    after.resume(3, rolled_back=True)
    assert after.num_rollbacks == 1 and [r["alarm"] for r in read_alarms(tmp_path)] == ["rollback"]
    after.check(3, [], NONFINITE)
    assert after.rollback is None
    assert after.stop_reason == (
        "step 3: a non-finite gradient (train/num_nonfinite_updates = 1); no rollback left "
        "(monitoring.guards.max_rollbacks = 1 done)"
    )
    # a resume from the checkpoint rolled back to runs the rolled-back steps again: their records go
    RunHealth(tmp_path, spike_factor=5.0, spike_window=10, guards=guards).resume(3)
    assert read_alarms(tmp_path) == []


def test_an_alarm_rolls_back_too_and_a_stop_of_the_same_step_wins(tmp_path: Path):
    alarm_rollback = GuardsConfig(mismatch_ceiling=0.01, patience=1, on_alarm="rollback")
    health = RunHealth(tmp_path, spike_factor=5.0, spike_window=10, guards=alarm_rollback)
    health.checkpointed(2)
    health.check(2, [], {"offpolicy/kl_k3": 0.5})
    assert health.rollback is not None and (health.rollback.signal, health.rollback.value) == ("offpolicy/kl_k3", 0.5)
    both = GuardsConfig(mismatch_ceiling=0.01, patience=1, on_alarm="stop", on_bad_step="rollback")
    health = RunHealth(tmp_path, spike_factor=5.0, spike_window=10, guards=both)
    health.checkpointed(2)
    health.check(2, [], {"offpolicy/kl_k3": 0.5, **NONFINITE})
    assert health.rollback is None and health.stop_reason is not None


def test_a_rollback_without_periodic_checkpoints_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"set run.checkpoint_every > 0"):
        load_config(None, ['monitoring.guards.on_bad_step="rollback"'])
    with pytest.raises(ConfigError, match=r"set run.checkpoint_every > 0"):
        load_config(None, ['monitoring.guards.on_alarm="rollback"', "run.checkpoint_every=0"])
    load_config(None, ['monitoring.guards.on_bad_step="rollback"', "run.checkpoint_every=2"])


class Poisoner:
    """Wraps `Trainer.step`, `save_checkpoint` and `load_checkpoint`: a batch holding a poisoned example (those of
    the first batch at ``poison_step``, or with ``every_time`` any batch at that step) has its advantages x1e4; the
    task keys of each trained batch, the weights at each save and right after each load are kept."""

    def __init__(self, poison_step: int, *, every_time: bool = False) -> None:
        self.poison_step = poison_step
        self.every_time = every_time
        self.poison: set[str] | None = None
        self.trained: list[tuple[int, list[str]]] = []
        self.saved: dict[str, dict[str, torch.Tensor]] = {}
        self.loaded: list[tuple[str, dict[str, torch.Tensor]]] = []
        self.lines: list[str] = []
        """The warning lines of `sharpen.monitoring.health` during the run (the fixture's)."""

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        step, save, load = Trainer.step, Trainer.save_checkpoint, Trainer.load_checkpoint

        def poisoned_step(trainer: Trainer, batch: TrainBatch) -> dict[str, float]:
            keys = sorted({r.example.task_key for r in batch.rollouts})
            self.trained.append((batch.step, keys))
            if batch.step == self.poison_step and (self.every_time or self.poison is None):
                self.poison = set(keys)
            if self.poison is not None and self.poison & set(keys):
                rollouts = [
                    dataclasses.replace(r, advantage=r.advantage * 1e4) if r.advantage is not None else r
                    for r in batch.rollouts
                ]
                batch = dataclasses.replace(batch, rollouts=rollouts)
            return step(trainer, batch)

        def saving(trainer: Trainer, folder: Path) -> None:
            save(trainer, folder)
            self.saved[folder.name] = weights(trainer)

        def loading(trainer: Trainer, folder: Path) -> None:
            load(trainer, folder)
            self.loaded.append((folder.name, weights(trainer)))

        monkeypatch.setattr(Trainer, "step", poisoned_step)
        monkeypatch.setattr(Trainer, "save_checkpoint", saving)
        monkeypatch.setattr(Trainer, "load_checkpoint", loading)


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    state = {f"weight/{name}": tensor.detach().clone() for name, tensor in trainer.named_weights()}
    optimizer: Any = trainer.backend.optimizer  # type: ignore[attr-defined]
    for index, moments in optimizer.state_dict()["state"].items():
        state.update({f"optimizer/{index}/{key}": value.clone() for key, value in moments.items()})
    return state


@pytest.fixture(scope="module")
def rolled_back(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Poisoner]:
    """8 steps, checkpoints of steps 3 and 6, the batch of step 5 poisoned: a spike at 5, a rollback to 3."""
    poisoner = Poisoner(5)
    lines = logging.getLogger("sharpen.monitoring.health")
    handler = ListHandler()
    lines.addHandler(handler)
    with pytest.MonkeyPatch.context() as monkeypatch:  # undone before the tests that use the run
        poisoner.install(monkeypatch)
        config = tiny_config(tiny_model_path, tmp_path_factory.mktemp("rollback"), name="full", num_steps=8, **ROLLBACK)
        try:
            run_dir = run_embedded(config, reward_fn=vowel_reward)
        finally:
            lines.removeHandler(handler)
    poisoner.lines = handler.lines
    return run_dir, poisoner


class ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.slow
def test_a_spike_rolls_back_to_the_checkpoint_and_the_run_goes_on_past_the_poisoned_data(rolled_back) -> None:
    run_dir, poisoner = rolled_back
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7]  # the run finished after the rollback
    spike = rows[5]
    assert spike["health/grad_norm_spike"] == 1.0 and spike["train/num_skipped_updates"] > 0
    assert spike["train/grad_norm"] > 100 * rows[4]["train/grad_norm"]
    assert sum(r["health/grad_norm_spike"] for r in rows) == 1.0  # the poisoned data was not trained on again
    # right after the rollback the trainer held the checkpoint's weights and optimizer state, bit for bit
    [(name, loaded)] = poisoner.loaded
    assert name == "step_000003" and loaded.keys() == poisoner.saved[name].keys() and len(loaded) > 20
    assert all(torch.equal(loaded[key], poisoner.saved[name][key]) for key in loaded)
    assert rows[6]["policy/version"] == 4.0 and rows[6]["sync/probe_trainer_delta"] > 0  # the engine followed
    # the data went on after the poisoned batch: steps 3-5 again, on examples none of steps 0-5 had
    first, again = poisoner.trained[:6], poisoner.trained[6:9]
    assert [step for step, _ in again] == [3, 4, 5]
    assert not {k for _, keys in first for k in keys} & {k for _, keys in again for k in keys}
    # one line, one record, listed by inspect
    [record] = read_alarms(run_dir)
    message = (
        "step 5: a gradient-norm spike (train/grad_norm = {:.4g}); rolled back to checkpoint step_000003 (rollback 1 "
        "of 3): steps 3-5 run again on the data after step 5's batch"
    ).format(spike["train/grad_norm"])
    assert record["message"] == message and (record["step"], record["alarm"], record["checkpoint"]) == (
        5,
        "rollback",
        "step_000003",
    )
    assert message in poisoner.lines
    assert f"alarm: {message}" in inspect_run(run_dir).to_text()


@pytest.mark.slow
def test_a_run_resumed_after_a_rollback_equals_the_uninterrupted_one(
    rolled_back, tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    full, full_poisoner = rolled_back
    poisoner = Poisoner(5)
    poisoner.poison = full_poisoner.poison  # the same data is poisoned in the split run
    poisoner.install(monkeypatch)
    # interrupted after the rollback (its last checkpoint: step 7), resumed for the last step
    run_embedded(tiny_config(tiny_model_path, tmp_path, name="split", num_steps=7, **ROLLBACK), reward_fn=vowel_reward)
    split = run_embedded(
        tiny_config(tiny_model_path, tmp_path, name="split", num_steps=8, **ROLLBACK),
        resume=True,
        reward_fn=vowel_reward,
    )
    assert [name for name, _ in poisoner.loaded] == ["step_000003", "step_000007"]
    full_rows, split_rows = stable(read_jsonl(full / "metrics.jsonl")), stable(read_jsonl(split / "metrics.jsonl"))
    assert [r["step"] for r in split_rows] == [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7]
    assert split_rows == full_rows
    assert read_alarms(split) == read_alarms(full)


@pytest.mark.slow
def test_past_max_rollbacks_the_run_stops_with_one_line(
    tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    Poisoner(5, every_time=True).install(monkeypatch)  # every batch of step 5 spikes, whatever its data
    config = tiny_config(
        tiny_model_path, tmp_path, name="stuck", num_steps=7, **ROLLBACK, **{"monitoring.guards.max_rollbacks": "1"}
    )
    with pytest.raises(RunStopped) as stopped:
        run_embedded(config, reward_fn=vowel_reward)
    assert str(stopped.value).startswith("step 5: a gradient-norm spike (train/grad_norm = ")
    assert str(stopped.value).endswith(
        "; no rollback left (monitoring.guards.max_rollbacks = 1 done): run stopped after a checkpoint of step 6 "
        "(--resume)"
    )
    assert "\n" not in str(stopped.value)
    rows = read_jsonl(tmp_path / "stuck" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5, 3, 4, 5]
    assert [r["alarm"] for r in read_alarms(tmp_path / "stuck")] == ["rollback"]
