"""Metric sinks: where a run's scalar metrics go (a JSONL file, TensorBoard event files, the console).

Owns the `MetricSink` protocol, the file-backed sinks, fan-out, and `build_sinks`, which assembles the sinks a run
asks for in its `MonitoringConfig`. Does not compute metrics, decide when to log, or know about the training loop:
the orchestrator calls ``sink.log(metrics, step=step)`` once per step and ``sink.close()`` at the end.

A ``step`` is the 0-based trainer step the metrics belong to. On resume, ``resume_from_step`` is the last step whose
metrics are kept; anything logged after it by the interrupted run is dropped so a resumed run never repeats a step.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from sharpen.config.schema import MonitoringConfig
from sharpen.monitoring.progress import ProgressDisplay
from sharpen.monitoring.tracking import MlflowSink, WandbSink

METRICS_FILE_NAME = "metrics.jsonl"
TENSORBOARD_DIR_NAME = "tensorboard"


@runtime_checkable
class MetricSink(Protocol):
    """Receives one dict of scalar metrics per step."""

    def log(self, metrics: dict[str, float], *, step: int) -> None: ...

    def close(self) -> None: ...


def truncate_jsonl_after(path: Path, step: int | None) -> None:
    """Rewrite a JSONL file of ``{"step": ...}`` records in place, keeping lines with ``step <= step``.

    ``step=None`` keeps every complete line. Either way a torn last line (no trailing newline: the process died
    mid-write) is dropped, so appending afterwards starts on a fresh line. A missing file is left missing.
    """
    if not path.exists():
        return
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    complete = lines[:-1]  # the piece after the last newline is empty, or a torn write
    if step is None and lines[-1] == "":
        return  # nothing to drop: leave the file untouched
    kept = [line for line in complete if line.strip() and (step is None or json.loads(line)["step"] <= step)]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(tmp, path)  # atomic: a crash here leaves either the old or the new file, never half of one


class JsonlSink:
    """Appends ``{"step": step, **metrics}`` as one JSON line per call, flushed at once (a crash loses nothing).

    An existing file is continued, so a resumed run keeps one metrics file; with ``resume_from_step`` the lines the
    interrupted run wrote after that step are dropped first.
    """

    def __init__(self, path: Path, *, resume_from_step: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        truncate_jsonl_after(self.path, resume_from_step)
        self._file = self.path.open("a", encoding="utf-8")

    def log(self, metrics: dict[str, float], *, step: int) -> None:
        record = {"step": step, **{key: float(value) for key, value in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every record of a JSONL file written by a sink or the rollout recorder, in order."""
    with Path(path).open(encoding="utf-8") as file:
        return [json.loads(line) for line in file if line.strip()]


def _scalar_event(metrics: dict[str, float], *, step: int) -> Any:
    """A TensorBoard ``Event`` carrying one ``simple_value`` scalar per metric (what ``SummaryWriter`` writes)."""
    # protobuf-generated classes are created at import time, so the type checker cannot see them
    from tensorboard.compat.proto.event_pb2 import Event  # pyright: ignore[reportAttributeAccessIssue]
    from tensorboard.compat.proto.summary_pb2 import Summary  # pyright: ignore[reportAttributeAccessIssue]

    values = [Summary.Value(tag=key, simple_value=float(value)) for key, value in metrics.items()]
    return Event(wall_time=time.time(), step=step, summary=Summary(value=values))


def _session_start_event(*, step: int) -> Any:
    """A ``SessionLog.START`` event: TensorBoard discards previously written events at ``step`` and after."""
    from tensorboard.compat.proto.event_pb2 import Event, SessionLog  # pyright: ignore[reportAttributeAccessIssue]

    return Event(wall_time=time.time(), step=step, session_log=SessionLog(status=SessionLog.START))


class TensorBoardSink:
    """Writes each metric as a TensorBoard scalar (tag = metric name) into event files under ``log_dir``.

    Uses tensorboard's own event writer rather than torch's ``SummaryWriter``: the same files, without importing
    torch in processes that only log. With ``resume_from_step``, a ``SessionLog.START`` event at the next step tells
    TensorBoard to discard what the interrupted run logged after ``resume_from_step`` (torch's ``purge_step``).
    """

    def __init__(self, log_dir: Path, *, resume_from_step: int | None = None, flush_secs: int = 10) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._writer = EventFileWriter(str(self.log_dir), flush_secs=flush_secs)
        if resume_from_step is not None:
            self._writer.add_event(_session_start_event(step=resume_from_step + 1))

    def log(self, metrics: dict[str, float], *, step: int) -> None:
        self._writer.add_event(_scalar_event(metrics, step=step))

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()


class MultiSink:
    """Fans each call out to several sinks, in order."""

    def __init__(self, sinks: Sequence[MetricSink]) -> None:
        self.sinks = list(sinks)

    def log(self, metrics: dict[str, float], *, step: int) -> None:
        for sink in self.sinks:
            sink.log(metrics, step=step)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def build_sinks(
    config: MonitoringConfig,
    run_dir: Path,
    *,
    num_steps: int,
    resume_from_step: int | None,
    run_config: dict[str, Any] | None = None,
) -> MetricSink:
    """The sinks of one run: ``run_dir/metrics.jsonl`` always; TensorBoard, W&B, MLflow and the progress display
    as configured. ``run_config`` (the resolved config as a dict) becomes the W&B config and the MLflow params.

    The progress display is always there; ``config.progress = False`` turns it into one plain line per step. W&B and
    MLflow continue the interrupted run's tracker run on resume but cannot drop its later steps (see
    `sharpen.monitoring.tracking`).
    """
    run_dir = Path(run_dir)
    sinks: list[MetricSink] = [JsonlSink(run_dir / METRICS_FILE_NAME, resume_from_step=resume_from_step)]
    try:
        if config.tensorboard:
            sinks.append(TensorBoardSink(run_dir / TENSORBOARD_DIR_NAME, resume_from_step=resume_from_step))
        if config.wandb:
            sinks.append(
                WandbSink(
                    run_dir,
                    project=config.wandb_project,
                    mode=config.wandb_mode,
                    run_config=run_config,
                    resume_from_step=resume_from_step,
                )
            )
        if config.mlflow:
            sinks.append(
                MlflowSink(
                    run_dir,
                    tracking_uri=config.mlflow_tracking_uri,
                    run_config=run_config,
                    resume_from_step=resume_from_step,
                )
            )
    except BaseException:
        MultiSink(sinks).close()  # a tracker that failed to start must not leave the others' runs open
        raise
    sinks.append(ProgressDisplay(num_steps, enabled=config.progress, resume_from_step=resume_from_step))
    return MultiSink(sinks)
