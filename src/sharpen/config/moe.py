"""The ``[trainer.moe]`` section: what the trainer does with a Mixture-of-Experts model's expert routes.

Pydantic only (no torch): the start-up check against the model and the engine is `orchestration.build.check_moe`,
the routes themselves are `sharpen.expert_routes` (docs/moe.md).
"""

from __future__ import annotations

from typing import Literal

from sharpen.config.section import Section


class MoeConfig(Section):
    """Routing replay for a Mixture-of-Experts policy (docs/moe.md). A dense model takes only the defaults."""

    routing_replay: Literal["none", "r2", "r3"] = "none"
    """Which expert routes the trainer's forward passes use. ``none``: the trainer's routers choose (the engine and
    the trainer may send a token to different experts). ``r2``: the routes of the old-policy pass (the weights at the
    start of the step) are replayed in the step's training passes, so the ratio compares one set of experts; it acts
    only when a step has an old-policy pass (several mini-batches or epochs, or an off-policy correction). ``r3``:
    the inference engine's routes, returned with each rollout's tokens, are replayed in every trainer pass of the
    policy (old-policy and training); needs an engine that returns routes (``rollout.engine.type = "hf"`` here). The
    routers keep their gradient through the replayed experts' probabilities."""
