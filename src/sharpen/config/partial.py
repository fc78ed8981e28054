"""Partial rollouts (``rollout.partial``): over-sample groups, close a step's batch once enough groups are complete,
and carry the unfinished ones into the next steps (docs/async.md, "Partial rollouts")."""

from __future__ import annotations

from pydantic import Field

from sharpen.config.section import Section


class PartialRolloutConfig(Section):
    enabled: bool = False
    """Generate more groups than a step trains on, end the step's generation as soon as ``prompts_per_step`` groups
    are complete, and carry the unfinished episodes into the next step: their requests go on from their exact tokens
    with the new weights, and each token keeps the policy version that sampled it (the off-policy correction sees
    it). Single-turn environments, ``weight_updates = "between_batches"``, no dynamic sampling."""
    extra_prompts: int = Field(default=2, ge=1)
    """Groups in flight beyond ``prompts_per_step`` (the over-sampling); at most ``prompts_per_step``, so the groups at
    their last allowed step always fit into the batch."""
    max_steps_spanned: int = Field(default=2, ge=1)
    """Steps one group may span, from the step that drew it to the step that trains on it: a group at its last step
    must be complete before the batch closes, so no trained token is more than ``max_steps_spanned - 1`` policy
    versions older than its batch's generation (1: nothing is carried)."""
    chunk_tokens: int = Field(default=32, ge=1)
    """Tokens generated per request between two checks whether the batch is full (each check ends one engine call;
    the next call resumes each request from its tokens so far)."""
