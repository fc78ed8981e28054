"""`RouterReplay` on tiny random MoE models of the three router families (Mixtral, Qwen3-MoE: softmax; DeepSeek-V3:
sigmoid with a correction bias and expert groups): replaying a forward's own routes changes nothing; a perturbed
router keeps the replayed routes (the experts receive them), while its gradient still flows; activation
checkpointing recomputes with the same routes; bad input is one clear error."""

from __future__ import annotations

import pytest
import torch

from sharpen.expert_routes import RouterReplay, RoutingError, is_moe_model
from support.tiny_moe import COMMON, FAMILIES, tiny_moe


def _model(family: str):
    if family != "deepseek_v3":
        return tiny_moe(family)
    model = tiny_moe(family, routed_scaling_factor=2.5)
    with torch.no_grad():  # transformers starts the routers at 0 (every token ties); give them routes to keep
        for router in _routers(model):
            router.weight.normal_(0, 0.5)
            router.e_score_correction_bias.normal_(0, 0.1)
    return model


def _routers(model) -> list:
    return [m for m in model.modules() if type(m).__name__.lower().endswith("topkrouter")]


def _ids() -> torch.Tensor:
    return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))


def _perturb(model) -> None:
    with torch.no_grad():
        for router in _routers(model):
            router.weight.add_(torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(2)))


def _experts_inputs(model) -> list[torch.Tensor]:
    """The expert indices each MoE layer's experts receive, recorded by hooks (appended per call)."""
    received: list[torch.Tensor] = []
    for module in model.modules():
        if type(module).__name__.endswith("Experts") and hasattr(module, "gate_up_proj"):
            module.register_forward_pre_hook(lambda _, args: received.append(args[1].clone()))
    return received


@pytest.mark.parametrize("family", FAMILIES)
def test_replaying_a_forward_own_routes_changes_nothing(family: str) -> None:
    model = _model(family).eval()
    replay = RouterReplay(model)
    assert replay.num_layers == 2 and is_moe_model(model)
    with torch.no_grad(), replay.capture() as routes:
        plain = model(_ids()).logits
    assert [tuple(r.shape) for r in routes.layers] == [(24, 2), (24, 2)]
    with torch.no_grad(), replay.replay(routes):
        replayed = model(_ids()).logits
    assert torch.allclose(replayed, plain, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_perturbed_router_keeps_the_replayed_routes_and_its_gradient(family: str) -> None:
    model = _model(family)
    replay = RouterReplay(model)
    with torch.no_grad(), replay.capture() as routes:
        model(_ids())
    _perturb(model)
    with torch.no_grad(), replay.capture() as moved:
        model(_ids())
    changed = sum(
        int((a.sort(-1).values != b.sort(-1).values).any(-1).sum())
        for a, b in zip(moved.layers, routes.layers, strict=True)
    )
    assert changed > 0  # the perturbation moves some tokens to other experts when not replayed
    received = _experts_inputs(model)
    with replay.replay(routes), replay.capture() as used:
        loss = model(_ids()).logits.logsumexp(-1).mean()
    loss.backward()
    for got, expected in zip(used.layers, routes.layers, strict=True):
        assert torch.equal(got, expected)
    for got, expected in zip(received, routes.layers, strict=True):  # what the experts ran
        assert torch.equal(got, expected)
    for router in _routers(model):  # the router learns through the replayed experts' probabilities
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_a_checkpointed_forward_is_recomputed_with_the_replayed_routes(family: str) -> None:
    gradients = []
    for checkpointing in (False, True):
        model = _model(family).train()
        replay = RouterReplay(model)
        with torch.no_grad(), replay.capture() as routes:
            model(_ids())
        _perturb(model)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        with replay.replay(routes):
            model(_ids()).logits.logsumexp(-1).mean().backward()
        gradients.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert gradients[0].keys() == gradients[1].keys()
    for name, gradient in gradients[0].items():
        assert torch.allclose(gradients[1][name], gradient, rtol=1e-5, atol=1e-7), name


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("setting", ["bf16 weights", "bf16 autocast"])
def test_float32_routers_route_in_float32_whatever_the_compute_dtype(family: str, setting: str) -> None:
    """``RouterReplay(float32=True)`` (``trainer.moe.router_float32``): the softmax routers' logits are the float32
    product of their inputs and weights, and their experts the top-k of its softmax (by hand here), with bf16
    weights or under bf16 autocast; without it they are bf16, as transformers computes them."""
    seen = {}
    for float32 in (True, False):
        model = _model(family)
        if setting == "bf16 weights":
            model = model.to(torch.bfloat16)
        RouterReplay(model, float32=float32)
        calls: list[tuple[torch.Tensor, tuple]] = []
        router = _routers(model)[0]
        router.register_forward_hook(lambda _, args, output, calls=calls: calls.append((args[0].detach(), output)))
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=setting == "bf16 autocast"):
            model(_ids())
        (hidden, (logits, weights, indices)) = calls[0]
        seen[float32] = logits.dtype
        if float32:
            expected = torch.nn.functional.linear(hidden.reshape(-1, 32).float(), router.weight.float())
            torch.testing.assert_close(logits, expected, rtol=0, atol=0)
            probs, chosen = torch.softmax(expected, dim=-1).topk(2, dim=-1)
            assert torch.equal(indices, chosen)
            torch.testing.assert_close(weights, probs / probs.sum(dim=-1, keepdim=True))
    assert seen == {True: torch.float32, False: torch.bfloat16}


def test_bad_input_is_one_clear_error() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    dense = LlamaForCausalLM(LlamaConfig(**COMMON, intermediate_size=48))
    assert not is_moe_model(dense)
    with pytest.raises(RoutingError, match="routing replay needs a Mixture-of-Experts model: tiny-llama has no"):
        RouterReplay(dense, name="tiny-llama")
    model = _model("mixtral")
    replay = RouterReplay(model)
    with pytest.raises(RoutingError, match="already wrapped"):
        RouterReplay(model)
    with torch.no_grad(), replay.capture() as routes:
        model(_ids())
    shape = r"routes for \(24, 2\) tokens x experts, the forward has 12 tokens"
    with pytest.raises(RoutingError, match=shape), torch.no_grad(), replay.replay(routes):
        model(_ids()[:1])
    with (
        pytest.raises(RoutingError, match="routes of 1 MoE layers for a model of 2"),
        replay.replay(type(routes)(layers=routes.layers[:1])),
    ):
        pass
