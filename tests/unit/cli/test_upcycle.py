"""``smollm2-135m-moe``, SmolLM2 sparsely upcycled (`sharpen.cli.upcycle`): a Mixtral-architecture model whose
experts are SmolLM2's MLP, so it scores text as SmolLM2 does (to float32 rounding), with seeded routers that send
tokens to different experts, saved in the per-expert checkpoint format vLLM loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sharpen.cli.upcycle import NUM_EXPERTS, ROUTER_STD, SEED, TOP_K, save_smollm2_moe
from sharpen.config.models import KNOWN_MODELS, BuiltModel

pytestmark = pytest.mark.slow  # writes the 1.5 GB model


@pytest.fixture(scope="module")
def upcycled(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    return save_smollm2_moe(tmp_path_factory.mktemp("smollm2-moe"), tokenizer_from=smollm2_path)


def _logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(ids).logits[0, :-1], -1).gather(1, ids[0, 1:, None])[:, 0]


def test_the_upcycled_model_scores_as_smollm2_and_routes_tokens_apart(upcycled: Path, smollm2_path: Path) -> None:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from sharpen.expert_routes import RouterReplay

    assert KNOWN_MODELS["smollm2-135m-moe"] == BuiltModel(
        name="smollm2-135m-moe", base="smollm2-135m-instruct", builder="sharpen.cli.upcycle:save_smollm2_moe"
    )
    ids = torch.tensor([[1, 504, 3458, 282, 4193, 314, 260, 2451, 30, 216, 33, 32, 1232, 33]])
    dense = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    moe = AutoModelForCausalLM.from_pretrained(upcycled, dtype=torch.float32).eval()
    assert type(moe).__name__ == "MixtralForCausalLM"
    assert (moe.config.num_local_experts, moe.config.num_experts_per_tok) == (NUM_EXPERTS, TOP_K)
    assert (_logprobs(moe, ids) - _logprobs(dense, ids)).abs().max() < 1e-4  # measured 1.3e-5
    expected_router = torch.randn(NUM_EXPERTS, 576, generator=torch.Generator().manual_seed(SEED)) * ROUTER_STD
    assert torch.equal(moe.model.layers[0].mlp.gate.weight, expected_router)  # seeded: the same every build
    with torch.no_grad(), RouterReplay(moe).capture() as routes:
        moe(ids)
    assert len(routes.layers) == 30
    pairs = {tuple(sorted(row.tolist())) for layer in routes.layers for row in layer}
    assert len(pairs) >= 4  # tokens go to different pairs of experts
    with safe_open(str(upcycled / "model.safetensors"), "pt") as saved:  # vLLM's per-expert names
        assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in set(saved.keys())
