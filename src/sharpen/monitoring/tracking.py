"""Experiment-tracker sinks: Weights & Biases (offline by default) and MLflow (a local SQLite store by default).

Owns how a run's metrics and resolved config reach these two trackers, quietly: no prompts, no console output from
the trackers, no telemetry, and no network unless the user asks for W&B ``online`` mode or a remote MLflow server.
Both packages are optional (``pip install 'sharpen[tracking]'``) and imported only when a sink is built. Does not
log artifacts, models or system metrics (sharpen's own ``time/*`` and ``memory/*`` metrics cover the run).

Each sink keeps its tracker's run id in ``run_dir`` (``wandb_run_id.txt``, ``mlflow_run_id.txt``) so that a resumed
run (``resume_from_step`` set) continues the same tracker run. Trackers keep history append-only, so unlike
`JsonlSink` and `TensorBoardSink` they cannot drop what an interrupted run logged after ``resume_from_step``:

- W&B offline: the resumed process writes a second ``run_dir/wandb/offline-run-*-<id>`` folder under the same run
  id, holding only the steps it logged (the first folder keeps the interrupted run's); ``wandb sync`` uploads both
  into that one run. W&B online: the resumed run continues after the last step the server has, and W&B drops rows
  for lower steps (with a warning), so the interrupted run's values for the repeated steps are the ones kept.
- MLflow: the same run is reopened and its status set back to RUNNING; a repeated step then has two values
  (the interrupted run's and the resumed run's, told apart by timestamp), and the tag
  ``sharpen.resumed_from_step`` records where the resume began.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

WANDB_DIR_NAME = "wandb"
MLFLOW_DIR_NAME = "mlflow"
WANDB_RUN_ID_FILE_NAME = "wandb_run_id.txt"
MLFLOW_RUN_ID_FILE_NAME = "mlflow_run_id.txt"
# MLflow's limits (mlflow/utils/validation.py: MAX_ENTITY_KEY_LENGTH, MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH,
# MAX_METRICS_PER_BATCH); a test checks they still match the installed mlflow
MLFLOW_MAX_KEY_LENGTH = 250
MLFLOW_MAX_PARAM_VALUE_LENGTH = 6000
_MLFLOW_MAX_PARAMS_PER_BATCH = 100
_MLFLOW_MAX_METRICS_PER_BATCH = 1000
# MLflow accepts alphanumerics, `_ - . /`, space, and `:` except on Windows; keep to the set valid everywhere
_MLFLOW_BAD_CHARACTERS = re.compile(r"[^A-Za-z0-9_\-. /]")


class TrackingSetupError(RuntimeError):
    """A tracker sink cannot start: its package is not installed, or W&B online mode has no credentials."""


def _import_tracker(module: str, *, flag: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise TrackingSetupError(
            f"monitoring.{flag} = true needs the `{module}` package, which cannot be imported ({error}): "
            "pip install 'sharpen[tracking]'"
        ) from error


def _stored_run_id(path: Path, *, is_resume: bool) -> str | None:
    """The tracker run id an earlier process of this run stored, when resuming; None means start a new run."""
    if is_resume and path.is_file():
        return path.read_text(encoding="utf-8").strip() or None
    return None


class WandbSink:
    """Logs each step's metrics as one W&B history row (``step`` = the trainer step), into ``run_dir/wandb``.

    ``mode="offline"`` (the default) needs no account and no network: upload later with
    ``wandb sync run_dir/wandb/offline-run-*``. ``mode="online"`` needs credentials already configured
    (``WANDB_API_KEY`` or ``wandb login``); sharpen never prompts for them. NaN and inf are logged as they are.
    Several calls for one step merge into one row, written when a later step arrives or at `close`; a crash loses
    that row and about the last second before it (``metrics.jsonl`` has them). Settings verified with wandb 0.31.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        project: str = "sharpen",
        name: str | None = None,
        mode: Literal["offline", "online"] = "offline",
        run_config: dict[str, Any] | None = None,
        resume_from_step: int | None = None,
    ) -> None:
        # read by wandb when it starts its service process: keep crash reports (Sentry) off unless the user opts in
        os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        wandb = _import_tracker("wandb", flag="wandb")
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        if mode == "online" and not wandb.login(prompt=False, verify=False):
            raise TrackingSetupError(
                "monitoring.wandb_mode = 'online' needs W&B credentials (WANDB_API_KEY or `wandb login`) and "
                "found none; sharpen never prompts. Use monitoring.wandb_mode = 'offline' and `wandb sync` later."
            )
        id_file = run_dir / WANDB_RUN_ID_FILE_NAME
        run_id = _stored_run_id(id_file, is_resume=resume_from_step is not None)
        is_continued = run_id is not None
        run_id = run_id or secrets.token_hex(4)
        settings = wandb.Settings(
            mode=mode,
            silent=True,  # no banner, no run summary at finish
            console="off",  # leave stdout alone: the progress display owns the terminal
            x_disable_stats=True,  # no background sampler of CPU/GPU/disk
            disable_git=True,  # the run directory is rarely a repo, and wandb warns when it is not
            disable_code=True,
            save_code=False,
            disable_job_creation=True,
            x_transaction_log_flush_interval=1.0,  # wandb's default (15 s) loses that much of a run that crashes
        )
        self.run = wandb.init(
            dir=str(run_dir),
            project=project,
            name=name or run_dir.name,
            id=run_id,
            resume="allow" if is_continued else None,
            config=run_config or {},
            settings=settings,
            reinit="create_new",  # an independent run object: never the process-global `wandb.run`
        )
        id_file.write_text(run_id + "\n", encoding="utf-8")
        self.run_id = run_id

    def log(self, metrics: dict[str, float], *, step: int) -> None:
        self.run.log({key: float(value) for key, value in metrics.items()}, step=step)

    def close(self) -> None:
        self.run.finish()


def mlflow_metric_name(name: str) -> str:
    """``name`` as MLflow accepts it as a metric or param key; names that already are valid come back unchanged.

    Characters outside ``A-Z a-z 0-9 _ - . / space`` become ``_`` (``pass@4`` -> ``pass_4``); a path segment that
    is empty, ``.`` or ``..`` becomes ``_`` (MLflow rejects names that normalise to another path, like ``a//b``);
    names longer than MLflow's 250 characters are cut. Deterministic, so two different names can map to one.
    """
    segments = [_MLFLOW_BAD_CHARACTERS.sub("_", segment) for segment in name.split("/")]
    mapped = "/".join("_" if segment in {"", ".", ".."} else segment for segment in segments)
    if len(mapped) > MLFLOW_MAX_KEY_LENGTH:
        mapped = mapped[:MLFLOW_MAX_KEY_LENGTH].rstrip("/.") or "_"  # the cut must not leave a bad last segment
    return mapped


def flatten_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as MLflow params: dotted keys (mapped by `mlflow_metric_name`), values as text cut to
    MLflow's 6000 characters. Lists and other leaves are written as JSON; strings as they are."""
    params: dict[str, str] = {}
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            params.update(flatten_params(value, prefix=dotted + "."))
            continue
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        params[mlflow_metric_name(dotted)] = text[:MLFLOW_MAX_PARAM_VALUE_LENGTH]
    return params


@contextmanager
def _quiet_logger(name: str) -> Iterator[None]:
    """Raises a logger to WARNING for a block: MLflow logs its SQLite schema creation at INFO."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


class MlflowSink:
    """Logs metrics (keys mapped by `mlflow_metric_name`, ``step`` = the trainer step) and the run's config as
    params to an MLflow run; `close` marks the run FINISHED.

    ``tracking_uri=None`` stores everything in ``run_dir/mlflow``: a SQLite database (``mlflow.db``), the store
    MLflow recommends for local use (MLflow 3 refuses its plain-file store unless ``MLFLOW_ALLOW_FILE_STORE`` is
    set), and an ``artifacts`` folder. View it with ``mlflow ui --backend-store-uri sqlite:///run_dir/mlflow/mlflow.db``.
    NaN is stored as NaN; the SQLite store keeps inf as the largest float (about 1.8e308).
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        tracking_uri: str | None = None,
        experiment_name: str = "sharpen",
        run_name: str | None = None,
        run_config: dict[str, Any] | None = None,
        resume_from_step: int | None = None,
    ) -> None:
        # read when mlflow is first imported: MLflow otherwise starts a thread that sends usage telemetry
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        _import_tracker("mlflow", flag="mlflow")
        from mlflow.tracking import MlflowClient

        run_dir = Path(run_dir)
        store_dir = run_dir / MLFLOW_DIR_NAME
        # without an explicit location MLflow puts a local store's artifacts in ./mlartifacts, wherever the process
        # started; a configured server chooses its own
        artifacts: str | None = None
        if tracking_uri is None:
            store_dir.mkdir(parents=True, exist_ok=True)
            tracking_uri = f"sqlite:///{(store_dir / 'mlflow.db').resolve().as_posix()}"
            artifacts = (store_dir / "artifacts").resolve().as_uri()
        self.tracking_uri = tracking_uri
        with _quiet_logger("mlflow"):
            self.client = MlflowClient(tracking_uri=tracking_uri)
        id_file = run_dir / MLFLOW_RUN_ID_FILE_NAME
        run_id = _stored_run_id(id_file, is_resume=resume_from_step is not None)
        if run_id is not None and self._has_run(run_id):
            self.client.update_run(run_id, status="RUNNING")
            self.client.set_tag(run_id, "sharpen.resumed_from_step", str(resume_from_step))
        else:
            run_id = self._create_run(experiment_name, run_name or run_dir.name, run_config or {}, artifacts)
        id_file.write_text(run_id + "\n", encoding="utf-8")
        self.run_id = run_id

    def _has_run(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(run_id)
        except MlflowException:
            return False  # the store was moved or wiped: start a new run rather than fail the resume
        return True

    def _create_run(
        self, experiment_name: str, run_name: str, run_config: dict[str, Any], artifacts: str | None
    ) -> str:
        from mlflow.entities import Param

        experiment = self.client.get_experiment_by_name(experiment_name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            experiment_id = self.client.create_experiment(experiment_name, artifact_location=artifacts)
        run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        params = [Param(key, value) for key, value in flatten_params(run_config).items()]
        for start in range(0, len(params), _MLFLOW_MAX_PARAMS_PER_BATCH):
            self.client.log_batch(run_id, params=params[start : start + _MLFLOW_MAX_PARAMS_PER_BATCH])
        return run_id

    def log(self, metrics: dict[str, float], *, step: int) -> None:
        from mlflow.entities import Metric

        timestamp_ms = int(time.time() * 1000)
        batch = [Metric(mlflow_metric_name(key), float(value), timestamp_ms, step) for key, value in metrics.items()]
        for start in range(0, len(batch), _MLFLOW_MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=batch[start : start + _MLFLOW_MAX_METRICS_PER_BATCH])

    def close(self) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED")
