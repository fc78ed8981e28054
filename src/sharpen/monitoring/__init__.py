"""Monitoring: metric sinks (JSONL, TensorBoard, W&B, MLflow, console progress), the rollout recorder, the episode
digest, phase timers, the run timeline, the engine/trainer parity probe, and the run's log (what reaches the
terminal, what its log file).

Owns how a run reports itself. Imports only `sharpen.types` and `sharpen.config` from sharpen; never drives the run.
"""

from sharpen.monitoring.digest import DIGEST_FILE_NAME, EpisodeDigest
from sharpen.monitoring.guards import Alarm, RunStopped, StabilityAlarms
from sharpen.monitoring.health import ALARMS_FILE_NAME, NONFINITE_DIR_NAME, RunHealth, read_alarms
from sharpen.monitoring.parity import (
    ParityProbe,
    ParityReference,
    ProbeEngine,
    ProbeTrainer,
    build_probe_set,
    parity_metrics,
)
from sharpen.monitoring.progress import DEFAULT_PROGRESS_KEYS, ProgressDisplay
from sharpen.monitoring.recorder import ROLLOUTS_FILE_NAME, RolloutRecorder, rollout_record
from sharpen.monitoring.run_log import LOG_FILE_NAME, Terminal, capture_run_output, terminal
from sharpen.monitoring.sinks import (
    METRICS_FILE_NAME,
    TENSORBOARD_DIR_NAME,
    JsonlSink,
    MetricSink,
    MultiSink,
    TensorBoardSink,
    build_sinks,
    read_jsonl,
    truncate_jsonl_after,
)
from sharpen.monitoring.timeline import (
    TIMELINE_FILE_NAME,
    Span,
    SpanBuffer,
    Timeline,
    build_timeline,
    read_timeline,
)
from sharpen.monitoring.timing import PhaseTimer, peak_memory_metrics
from sharpen.monitoring.tracking import (
    MLFLOW_DIR_NAME,
    WANDB_DIR_NAME,
    MlflowSink,
    TrackingSetupError,
    WandbSink,
    flatten_params,
    mlflow_metric_name,
)

__all__ = [
    "ALARMS_FILE_NAME",
    "DEFAULT_PROGRESS_KEYS",
    "DIGEST_FILE_NAME",
    "LOG_FILE_NAME",
    "METRICS_FILE_NAME",
    "MLFLOW_DIR_NAME",
    "NONFINITE_DIR_NAME",
    "ROLLOUTS_FILE_NAME",
    "TENSORBOARD_DIR_NAME",
    "TIMELINE_FILE_NAME",
    "WANDB_DIR_NAME",
    "Alarm",
    "EpisodeDigest",
    "JsonlSink",
    "MetricSink",
    "MlflowSink",
    "MultiSink",
    "ParityProbe",
    "ParityReference",
    "PhaseTimer",
    "ProbeEngine",
    "ProbeTrainer",
    "ProgressDisplay",
    "RolloutRecorder",
    "RunHealth",
    "RunStopped",
    "Span",
    "SpanBuffer",
    "StabilityAlarms",
    "TensorBoardSink",
    "Terminal",
    "Timeline",
    "TrackingSetupError",
    "WandbSink",
    "build_probe_set",
    "build_sinks",
    "build_timeline",
    "capture_run_output",
    "flatten_params",
    "mlflow_metric_name",
    "parity_metrics",
    "peak_memory_metrics",
    "read_alarms",
    "read_jsonl",
    "read_timeline",
    "rollout_record",
    "terminal",
    "truncate_jsonl_after",
]
