"""Evaluation: `evaluate(engine, examples, ...) -> EvalReport` with pass@k, maj@k and mean@k.

Uses the training machinery (the episode loop of `sharpen.rollout`, environments, the shared rollout scoring of
`sharpen.rewards`) so that an evaluated sample is made and judged exactly like a trained one; never imports the
trainer. Building the components from a recipe is orchestration's (`sharpen.orchestration.evaluate`).
"""

from sharpen.evaluation.evaluator import eval_sampling, evaluate
from sharpen.evaluation.metrics import (
    AggregateMetrics,
    SampleOutcome,
    TaskMetrics,
    aggregate_tasks,
    compute_task_metrics,
    maj_at_k,
    mean_at_k,
    pass_at_k,
    vote_key,
)
from sharpen.evaluation.report import EvalReport

__all__ = [
    "AggregateMetrics",
    "EvalReport",
    "SampleOutcome",
    "TaskMetrics",
    "aggregate_tasks",
    "compute_task_metrics",
    "eval_sampling",
    "evaluate",
    "maj_at_k",
    "mean_at_k",
    "pass_at_k",
    "vote_key",
]
