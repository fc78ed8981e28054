"""The evaluation section of the config: how many samples per task, which k, how they are sampled, how often.

Pydantic only, like the rest of `sharpen.config`: a field's docstring is its help text. What the metrics mean is
`sharpen.evaluation.metrics`'; running an evaluation is `sharpen eval` (and the training loop, every_steps).
"""

from __future__ import annotations

from pydantic import Field, model_validator

from sharpen.config.section import Section


class EvalConfig(Section):
    num_samples: int = Field(default=4, ge=1)
    """Samples per task (n of pass@k)."""
    ks: list[int] = Field(default_factory=lambda: [1, 4])
    """The k of pass@k, maj@k and mean@k, each between 1 and num_samples (pass@1 is always reported)."""
    temperature: float = Field(default=1.0, ge=0.0)
    """Sampling temperature of the evaluation (0: greedy, where every sample of a task is the same)."""
    max_new_tokens: int | None = Field(default=None, ge=1)
    """Token limit of a completion (None: rollout.max_new_tokens)."""
    num_tasks: int | None = Field(default=None, ge=1)
    """Evaluate the first N tasks of the data (None: all of them)."""
    prompts_per_batch: int = Field(default=8, ge=1)
    """Tasks per call of the episode loop (each with num_samples samples): bounds the memory of an evaluation."""
    every_steps: int = Field(default=0, ge=0)
    """Evaluate during training every N trainer steps (0: off)."""

    @model_validator(mode="after")
    def _check_ks(self) -> EvalConfig:
        bad = [k for k in self.ks if not 1 <= k <= self.num_samples]
        if bad:
            raise ValueError(
                f"ks = {self.ks}: every k must be between 1 and num_samples = {self.num_samples} "
                f"(pass@k needs k samples per task), got {bad}"
            )
        return self
