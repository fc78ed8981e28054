"""W&B (offline) and MLflow (local store) sinks, read back by their own libraries, next to TensorBoard.

No test touches the network: W&B runs offline with error reporting off, MLflow uses a SQLite file with telemetry off.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from wandb_records import wandb_config, wandb_history, wandb_run_files

from sharpen.config.schema import MonitoringConfig
from sharpen.monitoring import (
    JsonlSink,
    MlflowSink,
    MultiSink,
    ProgressDisplay,
    TensorBoardSink,
    TrackingSetupError,
    WandbSink,
    build_sinks,
    flatten_params,
    mlflow_metric_name,
)
from sharpen.monitoring.tracking import MLFLOW_MAX_KEY_LENGTH, MLFLOW_MAX_PARAM_VALUE_LENGTH

RUN_CONFIG = {"run": {"name": "demo", "seed": 3}, "trainer": {"learning_rate": 1e-6, "betas": [0.9, 0.99]}}


@pytest.fixture(autouse=True)
def offline_trackers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """Every tracker offline and silent, with its user-level files in the test's folder, and nothing sent anywhere."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("DO_NOT_TRACK", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    yield
    if "wandb" in sys.modules and sys.modules["wandb"] is not None:
        sys.modules["wandb"].teardown()  # drop wandb's process-wide settings: the next test's environment may differ


@pytest.fixture(scope="session")
def mlflow_schema(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty MLflow SQLite store, kept in pytest's cache per MLflow version: creating its schema takes 2-9 s
    (MLflow runs every migration). Tests copy it and never write to it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
        import mlflow
        from mlflow.tracking import MlflowClient

        cache = getattr(request.config, "cache", None)  # None under `-p no:cacheprovider`
        folder = cache.mkdir(f"mlflow-schema-{mlflow.__version__}") if cache is not None else None
        path = (folder or tmp_path_factory.mktemp("mlflow-schema")) / "mlflow.db"
        if not path.exists():
            building = tmp_path_factory.mktemp("mlflow-schema-build") / "mlflow.db"
            MlflowClient(tracking_uri=f"sqlite:///{building.as_posix()}")
            os.replace(building, path)  # whole or absent, even with two test runs building it at once
    return path


@pytest.fixture
def run_dir(tmp_path: Path, mlflow_schema: Path) -> Path:
    """A run directory whose default MLflow store (``mlflow/mlflow.db``) already has its schema."""
    (tmp_path / "mlflow").mkdir()
    shutil.copy(mlflow_schema, tmp_path / "mlflow" / "mlflow.db")
    return tmp_path


def _mlflow_history(sink: MlflowSink, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=sink.tracking_uri)  # a fresh client: what a reader in another process sees
    return [(metric.step, metric.value) for metric in client.get_metric_history(sink.run_id, key)]


def _tensorboard_scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


# --- the tests -----------------------------------------------------------------------------------------------------


def test_build_sinks_writes_what_each_library_reads_back(run_dir: Path) -> None:
    config = MonitoringConfig(wandb=True, mlflow=True, progress=False)
    sink = build_sinks(config, run_dir, num_steps=4, resume_from_step=None, run_config=RUN_CONFIG)
    assert isinstance(sink, MultiSink)
    assert [type(s) for s in sink.sinks] == [JsonlSink, TensorBoardSink, WandbSink, MlflowSink, ProgressDisplay]
    steps = [(step, {"reward/mean": 0.25 * step, "loss": 2.0 - step, "pass@4": step / 8}) for step in range(4)]
    for step, metrics in steps:
        sink.log(metrics, step=step)
    sink.close()
    wandb_sink, mlflow_sink = sink.sinks[2], sink.sinks[3]
    assert isinstance(wandb_sink, WandbSink) and isinstance(mlflow_sink, MlflowSink)

    assert _tensorboard_scalars(run_dir / "tensorboard", "reward/mean") == [(0, 0.0), (1, 0.25), (2, 0.5), (3, 0.75)]
    assert _tensorboard_scalars(run_dir / "tensorboard", "pass@4") == [(s, s / 8) for s in range(4)]

    (run_file,) = wandb_run_files(run_dir, wandb_sink.run_id)
    assert wandb_history(run_file) == [{"_step": step, **metrics} for step, metrics in steps]
    assert wandb_config(run_file)["trainer"] == RUN_CONFIG["trainer"]

    assert mlflow_sink.tracking_uri == f"sqlite:///{(run_dir / 'mlflow' / 'mlflow.db').resolve().as_posix()}"
    assert _mlflow_history(mlflow_sink, "reward/mean") == [(0, 0.0), (1, 0.25), (2, 0.5), (3, 0.75)]
    assert _mlflow_history(mlflow_sink, "loss") == [(0, 2.0), (1, 1.0), (2, 0.0), (3, -1.0)]
    assert _mlflow_history(mlflow_sink, "pass_4") == [(s, s / 8) for s in range(4)]  # `@` is not a MLflow character
    run = mlflow_sink.client.get_run(mlflow_sink.run_id)
    assert (run.info.status, run.info.run_name) == ("FINISHED", run_dir.name)
    assert run.data.params == {
        "run.name": "demo",
        "run.seed": "3",
        "trainer.learning_rate": "1e-06",
        "trainer.betas": "[0.9, 0.99]",
    }
    experiment = mlflow_sink.client.get_experiment_by_name("sharpen")
    assert experiment is not None
    assert experiment.artifact_location == (run_dir / "mlflow" / "artifacts").resolve().as_uri()


def test_nan_and_inf_do_not_crash_either_tracker(run_dir: Path) -> None:
    metrics = {"loss": math.nan, "grad/norm": math.inf, "kl": -math.inf, "reward/mean": 0.5}
    wandb_sink = WandbSink(run_dir)
    mlflow_sink = MlflowSink(run_dir)
    for sink in (wandb_sink, mlflow_sink):
        sink.log(metrics, step=0)
        sink.close()
    (row,) = wandb_history(wandb_run_files(run_dir, wandb_sink.run_id)[0])
    assert math.isnan(row["loss"]) and row["grad/norm"] == math.inf and row["kl"] == -math.inf
    assert math.isnan(_mlflow_history(mlflow_sink, "loss")[0][1])
    assert _mlflow_history(mlflow_sink, "grad/norm")[0][1] > 1e308  # SQLite keeps inf as the largest float
    assert _mlflow_history(mlflow_sink, "reward/mean") == [(0, 0.5)]


def test_resume_continues_the_same_tracker_runs(run_dir: Path) -> None:
    first_w, first_m = WandbSink(run_dir), MlflowSink(run_dir)
    for step in range(3):
        first_w.log({"x": float(step)}, step=step)
        first_m.log({"x": float(step)}, step=step)
    # the first process ends after step 2 without closing MLflow (its run stays RUNNING, as after a crash); W&B is
    # finished because one process cannot hold two live runs with one id, and a crash would lose W&B's last row
    first_w.close()
    resumed_w = WandbSink(run_dir, resume_from_step=1)
    resumed_m = MlflowSink(run_dir, resume_from_step=1)
    assert (resumed_w.run_id, resumed_m.run_id) == (first_w.run_id, first_m.run_id)
    assert resumed_m.client.get_run(resumed_m.run_id).data.tags["sharpen.resumed_from_step"] == "1"
    for sink in (resumed_w, resumed_m):
        sink.log({"x": 20.0}, step=2)
        sink.close()
    files = wandb_run_files(run_dir, first_w.run_id)
    assert len(files) == 2  # one offline folder per process, one run id: `wandb sync` makes them one run
    assert [[row["x"] for row in wandb_history(path)] for path in files] == [[0.0, 1.0, 2.0], [20.0]]
    # MLflow keeps both values of the repeated step (see the module docstring)
    assert sorted(_mlflow_history(resumed_m, "x")) == [(0, 0.0), (1, 1.0), (2, 2.0), (2, 20.0)]
    assert resumed_m.client.get_run(resumed_m.run_id).info.status == "FINISHED"


def test_a_fresh_run_starts_a_new_tracker_run(run_dir: Path) -> None:
    first = MlflowSink(run_dir)
    first.close()
    second = MlflowSink(run_dir)  # no resume_from_step: a new run, even with an id on disk
    second.close()
    assert second.run_id != first.run_id
    assert (run_dir / "mlflow_run_id.txt").read_text().strip() == second.run_id


def test_mlflow_tracking_uri_is_configurable(tmp_path: Path, mlflow_schema: Path) -> None:
    shutil.copy(mlflow_schema, tmp_path / "shared.db")
    uri = f"sqlite:///{(tmp_path / 'shared.db').as_posix()}"
    config = MonitoringConfig(tensorboard=False, progress=False, mlflow=True, mlflow_tracking_uri=uri)
    sink = build_sinks(config, tmp_path / "run", num_steps=1, resume_from_step=None)
    sink.log({"x": 1.0}, step=0)
    sink.close()
    (mlflow_sink,) = [s for s in sink.sinks if isinstance(s, MlflowSink)]  # type: ignore[attr-defined]
    assert mlflow_sink.tracking_uri == uri
    assert _mlflow_history(mlflow_sink, "x") == [(0, 1.0)]
    assert not (tmp_path / "run" / "mlflow").exists()


@pytest.mark.parametrize(("package", "flag"), [("wandb", "wandb"), ("mlflow", "mlflow")])
def test_missing_package_is_one_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, package: str, flag: str
) -> None:
    monkeypatch.setitem(sys.modules, package, None)  # what `import` sees when the package is not installed
    config = MonitoringConfig.model_validate({"tensorboard": False, "progress": False, flag: True})
    with pytest.raises(TrackingSetupError, match=rf"monitoring\.{flag} = true .* pip install 'sharpen\[tracking\]'"):
        build_sinks(config, tmp_path, num_steps=1, resume_from_step=None)


def test_online_mode_without_credentials_fails_instead_of_prompting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WANDB_MODE")
    with pytest.raises(TrackingSetupError, match="needs W&B credentials"):
        WandbSink(tmp_path, mode="online")
    assert not (tmp_path / "wandb").exists()


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("reward/mean", "reward/mean"),
        ("time/generate rollouts", "time/generate rollouts"),
        ("eval/pass@4", "eval/pass_4"),
        ("kl:ref", "kl_ref"),  # `:` is refused on Windows: keep runs portable
        ("a//b", "a/_/b"),
        ("/lead/", "_/lead/_"),
        ("x/../y", "x/_/y"),
        ("réward", "r_ward"),
        ("", "_"),
        ("m" * 300, "m" * MLFLOW_MAX_KEY_LENGTH),
        ("m" * 249 + "/x", "m" * 249),
    ],
)
def test_mlflow_metric_name(name: str, expected: str) -> None:
    from mlflow.utils.validation import _validate_metric_name

    assert mlflow_metric_name(name) == expected
    _validate_metric_name(expected)  # MLflow's own check accepts what we map to


def test_mlflow_limits_match_the_installed_mlflow() -> None:
    from mlflow.utils import validation

    assert MLFLOW_MAX_KEY_LENGTH == validation.MAX_ENTITY_KEY_LENGTH
    assert MLFLOW_MAX_PARAM_VALUE_LENGTH == validation.MAX_PARAM_VAL_LENGTH


def test_flatten_params() -> None:
    params = flatten_params({"a": {"b": {"c": 1}, "d": None, "e": {}}, "long": "x" * 7000, "odd key!": True})
    assert params == {"a.b.c": "1", "a.d": "null", "a.e": "{}", "long": "x" * 6000, "odd key_": "true"}
