"""``smollm2-135m-moe``: SmolLM2-135M-Instruct sparsely upcycled into a Mixture-of-Experts model, which
`sharpen models pull` builds on this machine (issue 31: RL on an MoE end to end on a laptop).

Sparse upcycling (Komatsuzaki et al., 2022, arXiv 2212.05055): every decoder layer's MLP becomes `NUM_EXPERTS`
copies of itself, and a router picks `TOP_K` of them per token, in the Mixtral architecture (Llama's, with the MLP
replaced by experts), so vLLM and transformers both serve it. The attention, norms and embeddings are SmolLM2's.
Mixtral renormalises the chosen experts' router probabilities to sum to 1, and the copies are equal, so the
upcycled model computes SmolLM2's function whatever the router says: its answers start where SmolLM2's are (to
float32 rounding). The routers start small and random (`ROUTER_STD`, seeded): the routes differ from token to token,
the experts diverge as each trains on its own tokens, and then the routers learn. Two of four experts a token: with
one, the renormalised weight is always 1 and a router would get no gradient.

About 0.37B parameters (SmolLM2's 0.135B, with 3 more copies of its 80M MLP parameters): 1.5 GB in float32.
Lives under cli as the other built models' builders; torch and transformers are imported only when it builds.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from sharpen.testing import TOKENIZER_FILES

NUM_EXPERTS = 4
TOP_K = 2
ROUTER_STD = 0.02
SEED = 0


def save_smollm2_moe(folder: Path, *, tokenizer_from: Path) -> Path:
    """The builder of ``smollm2-135m-moe`` from the dense model folder ``tokenizer_from`` (weights and tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(tokenizer_from, dtype=torch.float32)
    base = dense.config
    if base.model_type != "llama" or getattr(base, "mlp_bias", False):
        raise ValueError(f"sparse upcycling here takes a Llama without MLP biases, not {base.model_type}")
    config = MixtralConfig(
        vocab_size=base.vocab_size,
        hidden_size=base.hidden_size,
        intermediate_size=base.intermediate_size,
        num_hidden_layers=base.num_hidden_layers,
        num_attention_heads=base.num_attention_heads,
        num_key_value_heads=base.num_key_value_heads,
        head_dim=base.head_dim,
        hidden_act=base.hidden_act,
        max_position_embeddings=base.max_position_embeddings,
        rms_norm_eps=base.rms_norm_eps,
        rope_parameters=base.rope_parameters,
        tie_word_embeddings=base.tie_word_embeddings,
        bos_token_id=base.bos_token_id,
        eos_token_id=base.eos_token_id,
        pad_token_id=base.pad_token_id,
        num_local_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
        output_router_logits=False,  # no load-balancing loss unless a run asks for one
    )
    generator = torch.Generator().manual_seed(SEED)
    state = {name: tensor for name, tensor in dense.state_dict().items() if ".mlp." not in name}
    for index, layer in enumerate(dense.model.layers):
        mlp, prefix = layer.mlp, f"model.layers.{index}.mlp"
        gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])  # Mixtral's fused [gate; up] rows
        state[f"{prefix}.experts.gate_up_proj"] = gate_up.unsqueeze(0).repeat(NUM_EXPERTS, 1, 1)
        state[f"{prefix}.experts.down_proj"] = mlp.down_proj.weight.unsqueeze(0).repeat(NUM_EXPERTS, 1, 1)
        state[f"{prefix}.gate.weight"] = torch.randn(NUM_EXPERTS, base.hidden_size, generator=generator) * ROUTER_STD
    torch.manual_seed(SEED)  # nothing should be left to the random initialisation, but if it were: the same
    model = MixtralForCausalLM(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    left = [name for name in missing if not (config.tie_word_embeddings and name == "lm_head.weight")]
    if left or unexpected:
        raise RuntimeError(f"upcycling left weights unset {left} or unused {list(unexpected)}")
    if config.tie_word_embeddings:
        model.tie_weights()
    model.save_pretrained(folder)
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        if (tokenizer_from / name).is_file():
            shutil.copy2(tokenizer_from / name, Path(folder) / name)
    return Path(folder)
