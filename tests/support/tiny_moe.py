"""Tiny random Mixture-of-Experts models of the three router families sharpen knows, built from a config in a
second: Mixtral and Qwen3-MoE (softmax routers) and DeepSeek-V3 (a sigmoid router with expert groups, a correction
bias and a shared expert). 2 layers, hidden 32, 4 experts, 2 a token, vocabulary 64; seeded."""

from __future__ import annotations

from typing import Any

import torch

FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3")
VOCAB = 64
COMMON = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
COMMON |= {"num_key_value_heads": 2, "max_position_embeddings": 64}


def tiny_moe(family: str, **overrides: Any):
    """The random model of ``family`` (``torch.manual_seed(0)`` first); ``overrides`` replace or add to its
    config's values."""
    import transformers

    torch.manual_seed(0)
    if family == "mixtral":
        config = transformers.MixtralConfig(
            **{**COMMON, "intermediate_size": 48, "num_local_experts": 4, "num_experts_per_tok": 2, **overrides}
        )
        return transformers.MixtralForCausalLM(config)
    if family == "qwen3_moe":
        shape = {"moe_intermediate_size": 24, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True}
        config = transformers.Qwen3MoeConfig(**{**COMMON, **shape, **overrides})
        return transformers.Qwen3MoeForCausalLM(config)
    assert family == "deepseek_v3", family
    shape = {
        "num_key_value_heads": 4,  # multi-head latent attention: as many as the heads
        "intermediate_size": 48,
        "moe_intermediate_size": 24,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "n_group": 2,
        "topk_group": 1,
        "first_k_dense_replace": 0,
        "q_lora_rank": 16,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 8,
    }
    config = transformers.DeepseekV3Config(**{**COMMON, **shape, **overrides})
    return transformers.DeepseekV3ForCausalLM(config)


def decisive_routers(model):
    """``model`` with its routers' weights drawn with std 1, so they choose decisively (not near ties): replayed
    routes then differ from the routers' own choices, and rounding does not flip routes. Returns the model."""
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith(("TopKRouter", "TopkRouter")):
                module.weight.normal_(0, 1.0)
    return model


def routed_rollouts(num_layers: int, step: int) -> list:
    """`tiny_trainer.uneven_rollouts` of a step (as `parity.trainer_steps` takes them) with random engine routes: two
    distinct experts of 4 per token and layer, the last token unknown (as an engine leaves it)."""
    from dataclasses import replace

    from sharpen.expert_routes import UNROUTED, expert_routes
    from support.tiny_trainer import uneven_rollouts

    generator = torch.Generator().manual_seed(step)
    rollouts = []
    for rollout in uneven_rollouts()[: 7 - step]:
        routes = torch.stack(
            [
                torch.stack([torch.randperm(4, generator=generator)[:2] for _ in range(num_layers)])
                for _ in range(rollout.num_tokens)
            ]
        )
        routes[-1] = UNROUTED
        rollouts.append(replace(rollout, routes=expert_routes(routes, num_experts=4)))
    return rollouts


def replayed_steps(backend, num_layers: int) -> tuple[list[dict[str, float]], dict[str, torch.Tensor]]:
    """`parity.trainer_steps` with the engine's routes replayed (R3, ``trainer.moe.routing_replay = "r3"``) on
    `routed_rollouts`: each step's metrics, then the whole HF-named weights."""
    from sharpen.trainer import Trainer
    from sharpen.types import TrainBatch
    from support.parity import NUM_STEPS, PAD

    trainer = Trainer(backend.config, backend=backend, pad_token_id=PAD, max_new_tokens=12)
    metrics = [
        trainer.step(TrainBatch(rollouts=routed_rollouts(num_layers, step), step=step)) for step in range(NUM_STEPS)
    ]
    return metrics, {name: tensor.detach().cpu().clone() for name, tensor in backend.named_weights()}
