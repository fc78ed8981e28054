"""Monitoring: metric sinks (JSONL, TensorBoard, console progress), the rollout recorder, and phase timers.

Owns how a run reports itself. Imports only `sharpen.types` and `sharpen.config` from sharpen; never drives the run.
"""

from sharpen.monitoring.progress import DEFAULT_PROGRESS_KEYS, ProgressDisplay
from sharpen.monitoring.recorder import ROLLOUTS_FILE_NAME, RolloutRecorder, rollout_record
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
from sharpen.monitoring.timing import PhaseTimer, peak_memory_metrics

__all__ = [
    "DEFAULT_PROGRESS_KEYS",
    "METRICS_FILE_NAME",
    "ROLLOUTS_FILE_NAME",
    "TENSORBOARD_DIR_NAME",
    "JsonlSink",
    "MetricSink",
    "MultiSink",
    "PhaseTimer",
    "ProgressDisplay",
    "RolloutRecorder",
    "TensorBoardSink",
    "build_sinks",
    "peak_memory_metrics",
    "read_jsonl",
    "rollout_record",
    "truncate_jsonl_after",
]
