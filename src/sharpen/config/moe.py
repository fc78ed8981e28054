"""The ``[trainer.moe]`` section: what the trainer does with a Mixture-of-Experts model's expert routes.

Pydantic only (no torch): the start-up check against the model and the engine is `orchestration.build.check_moe`,
the routes themselves are `sharpen.expert_routes` (docs/moe.md).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from sharpen.config.section import Section


class MoeConfig(Section):
    """Routing replay and load balancing for a Mixture-of-Experts policy (docs/moe.md). A dense model takes only the
    defaults."""

    routing_replay: Literal["none", "r2", "r3"] = "none"
    """Which expert routes the trainer's forward passes use. ``none``: the trainer's routers choose (the engine and
    the trainer may send a token to different experts). ``r2``: the routes of the old-policy pass (the weights at the
    start of the step) are replayed in the step's training passes, so the ratio compares one set of experts; it acts
    only when a step has an old-policy pass (several mini-batches or epochs, or an off-policy correction). ``r3``:
    the inference engine's routes, returned with each rollout's tokens, are replayed in every trainer pass of the
    policy (old-policy and training); needs an engine that returns routes (``rollout.engine.type = "hf"`` here). The
    routers keep their gradient through the replayed experts' probabilities."""

    router_float32: bool = True
    """The trainer's routers compute their logits, probabilities and top-k in float32 whatever the trainer's precision
    (bf16 autocast or bf16 weights), as Megatron's ``moe_router_dtype = "fp32"`` does: a route that rounding would
    flip in bf16 stays put, and the replayed experts' weights and the balancing loss's probabilities are exact. False:
    the compute dtype, as transformers runs them. DeepSeek-V3's routers are float32 either way; a float32 run is the
    same either way. The engine's routers run as the engine runs them."""
    aux_loss_coef: float = Field(default=0.0, ge=0.0)
    """The weight of the load-balancing loss added to the policy's loss. The loss is Switch Transformer's, as
    transformers computes it for Mixtral (``router_aux_loss_coef`` weighs the same quantity): per MoE layer, the number
    of experts times the sum over experts of the share of top-k assignments and the mean router probability (``top_k``
    at perfect balance); averaged over layers, computed per micro-batch over its real tokens, the micro-batches
    weighted by their tokens. 0 (the default): no balancing loss during RL, as the routing-replay work trains; its value
    is logged either way (``moe/train_aux_loss``). Not with tensor or pipeline parallelism yet, as routing replay."""
    expert_bias_update_rate: float = Field(default=0.0, ge=0.0)
    """DeepSeek-V3's balancing without an auxiliary loss: after each step, every router's expert bias
    (``e_score_correction_bias``, which only chooses experts) moves by this rate toward balance, up for an expert the
    step's training routes loaded below the mean and down above it (the same on every rank: the loads are summed over
    them). 0 (the default): the bias stays frozen during RL. Needs routers with such a bias (``deepseek_v3``)."""
