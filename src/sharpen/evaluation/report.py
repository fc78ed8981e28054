"""The evaluation report: overall metrics, per-task rows and throughput, as JSON, a rich table or plain text.

Owns the report's shape and its renderings; the numbers come from `sharpen.evaluation.metrics` (whose docstring
defines them) and are not recomputed here. Plain text is for logs and pipes (stable, grep-friendly); the rich
rendering is for terminals.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sharpen.evaluation.metrics import AggregateMetrics, TaskMetrics

if TYPE_CHECKING:
    from rich.console import Group

_METRICS = ("pass", "maj", "mean")


@dataclass(kw_only=True, slots=True)
class EvalReport:
    overall: AggregateMetrics
    tasks: list[TaskMetrics]
    ks: list[int]
    num_samples_per_task: int
    status_counts: dict[str, int]
    """Samples per reward status (ok, wrong, format_error, timeout, infra_error)."""
    num_generated_tokens: int
    """Tokens the engine generated (environment-appended tokens of multi-turn episodes are not counted)."""
    generate_seconds: float
    """Time spent in the episode loop (engine and environments)."""
    wall_seconds: float
    """Time of the whole evaluation (generation and scoring)."""
    settings: dict[str, Any] = field(default_factory=dict[str, Any])
    """How the samples were made (temperature, max_new_tokens, seed, ...), recorded with the numbers."""

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second of generation."""
        return self.num_generated_tokens / self.generate_seconds if self.generate_seconds > 0 else 0.0

    def metric(self, name: str, k: int) -> float | None:
        """An overall value by name (``pass``, ``maj`` or ``mean``) and k, e.g. ``metric("pass", 1)``."""
        return _at_k(self.overall, name)[k]

    def to_dict(self) -> dict[str, Any]:
        overall = self.overall
        return {
            "num_tasks": overall.num_tasks,
            "num_samples": overall.num_samples,
            "num_samples_per_task": self.num_samples_per_task,
            "num_abstained": overall.num_abstained,
            "num_correct": overall.num_correct,
            "ks": self.ks,
            **{f"{name}_at_k": _keyed(_at_k(overall, name)) for name in _METRICS},
            "num_tasks_at_k": _keyed(overall.num_tasks_at_k),
            "status_counts": self.status_counts,
            "num_generated_tokens": self.num_generated_tokens,
            "generate_seconds": self.generate_seconds,
            "wall_seconds": self.wall_seconds,
            "tokens_per_second": self.tokens_per_second,
            "settings": self.settings,
            "tasks": [
                {
                    "task_key": task.task_key,
                    "num_samples": task.num_samples,
                    "num_abstained": task.num_abstained,
                    "num_correct": task.num_correct,
                    **{f"{name}_at_k": _keyed(_at_k(task, name)) for name in _METRICS},
                }
                for task in self.tasks
            ],
        }

    def to_metrics(self, prefix: str = "eval") -> dict[str, float]:
        """Flat scalars for a metric sink (``eval/pass@1``, ...), e.g. for periodic evaluation during training;
        a value no task has is left out."""
        values = {
            f"{prefix}/{name}@{k}": value
            for name in _METRICS
            for k, value in _at_k(self.overall, name).items()
            if value is not None
        }
        values[f"{prefix}/num_abstained"] = float(self.overall.num_abstained)
        values[f"{prefix}/tokens_per_second"] = self.tokens_per_second
        return values

    def to_json(self) -> str:
        """The report as JSON; k-keyed maps have string keys ("1"), a value with no task behind it is null."""
        return json.dumps(self.to_dict(), indent=2)

    def summary_line(self) -> str:
        overall = self.overall
        return (
            f"pass@1 = {_format(self.metric('pass', 1))} over {overall.num_samples} samples "
            f"({overall.num_tasks} tasks x {self.num_samples_per_task}, {overall.num_abstained} abstained)"
        )

    def to_text(self, *, max_task_rows: int = 20) -> str:
        """Plain-text tables: the overall metrics, then up to ``max_task_rows`` task rows."""
        overall_rows = [_overall_row(self, k) for k in self.ks]
        task_rows = [_task_row(task, self.ks) for task in self.tasks[:max_task_rows]]
        lines = [*_aligned([_OVERALL_HEADER, *overall_rows]), ""]
        lines += _aligned([_task_header(self.ks), *task_rows])
        if len(self.tasks) > max_task_rows:
            lines.append(f"... {len(self.tasks) - max_task_rows} more tasks in the JSON report")
        lines += ["", self._footer()]
        return "\n".join(lines)

    def to_rich(self, *, max_task_rows: int = 20) -> Group:
        """The same tables as `to_text`, for a rich console."""
        from rich.console import Group
        from rich.table import Table

        overall = Table(title="evaluation")
        for column in _OVERALL_HEADER:
            overall.add_column(column, justify="right")
        for k in self.ks:
            overall.add_row(*_overall_row(self, k))
        tasks = Table(title=f"tasks (first {min(max_task_rows, len(self.tasks))} of {len(self.tasks)})")
        header = _task_header(self.ks)
        for index, column in enumerate(header):
            tasks.add_column(column, justify="left" if index == 0 else "right")
        for task in self.tasks[:max_task_rows]:
            tasks.add_row(*_task_row(task, self.ks))
        return Group(overall, tasks, self._footer())

    def _footer(self) -> str:
        statuses = ", ".join(f"{name} {count}" for name, count in sorted(self.status_counts.items()))
        return (
            f"statuses: {statuses or 'none'}\n"
            f"{self.num_generated_tokens} tokens generated in {self.generate_seconds:.1f} s "
            f"({self.tokens_per_second:.1f} tokens/s); wall time {self.wall_seconds:.1f} s"
        )


_OVERALL_HEADER = ["k", "pass@k", "maj@k", "mean@k", "tasks"]


def _at_k(metrics: AggregateMetrics | TaskMetrics, name: str) -> dict[int, float | None]:
    return {"pass": metrics.pass_at_k, "maj": metrics.maj_at_k, "mean": metrics.mean_at_k}[name]


def _keyed(values: dict[int, Any]) -> dict[str, Any]:
    return {str(k): value for k, value in values.items()}


def _format(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _overall_row(report: EvalReport, k: int) -> list[str]:
    values = [_format(_at_k(report.overall, name)[k]) for name in _METRICS]
    return [str(k), *values, f"{report.overall.num_tasks_at_k[k]}/{report.overall.num_tasks}"]


def _task_header(ks: list[int]) -> list[str]:
    return ["task", "samples", "abstained", "correct", *(f"pass@{k}" for k in ks), f"maj@{ks[-1]}"]


def _task_row(task: TaskMetrics, ks: list[int]) -> list[str]:
    counts = [str(task.num_samples), str(task.num_abstained), str(task.num_correct)]
    return [task.task_key, *counts, *(_format(task.pass_at_k[k]) for k in ks), _format(task.maj_at_k[ks[-1]])]


def _aligned(rows: list[list[str]]) -> list[str]:
    """Columns padded to their widest cell: the first left-aligned, the rest right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [row[0].ljust(widths[0]), *(cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True))]
        lines.append("  ".join(cells).rstrip())
    return lines
