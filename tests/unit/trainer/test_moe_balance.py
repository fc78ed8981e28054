"""Load balancing of a Mixture-of-Experts policy during RL (``trainer.moe.aux_loss_coef``,
``trainer.moe.expert_bias_update_rate``): the balancing loss against hand-computed values and against transformers'
own function; its gradient in the trainer's step equals the coefficient times the gradient of transformers' loss on
the same tokens; off, it changes nothing but is logged; DeepSeek-V3's expert bias moves by the rate toward balance
from the loads of the step's training routes (counted here by hooks on the routers), stays frozen at 0, and reaches
the weights the engine receives."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from sharpen.config.algorithm import AlgorithmConfig
from sharpen.config.schema import TrainerConfig
from sharpen.expert_routes import Routes
from sharpen.trainer import SingleDeviceBackend, Trainer
from sharpen.trainer.routes import balance_loss
from sharpen.types import Example, Message, Rollout, TrainBatch
from support.tiny_moe import decisive_routers, tiny_moe

PAD, EXPERTS, TOP_K = 0, 4, 2
_EXAMPLE = Example(task_key="t/0", prompt=(Message(role="user", content="q"),), answer="a")
_SHAPES = [([3, 4, 5], [6, 7, 8, 9]), ([10, 11], [12, 13, 14]), ([15, 16, 17, 18], [19, 20]), ([21], [22, 23])]


def test_the_balancing_loss_by_hand():
    # 2 experts, 1 a token; tokens 0 and 1 both go to expert 0; probabilities (0.75, 0.25) and (0.5, 0.5):
    # f = (1, 0), P = (0.625, 0.375), loss = 2 * (1 * 0.625) = 1.25; without token 1: P = (0.75, 0.25) -> 1.5
    layer = Routes(layers=[torch.tensor([[0], [0]])], probs=[torch.tensor([[0.75, 0.25], [0.5, 0.5]])])
    assert float(balance_loss(layer, torch.tensor([True, True]))) == pytest.approx(1.25)  # pyright: ignore[reportArgumentType]
    assert float(balance_loss(layer, torch.tensor([True, False]))) == pytest.approx(1.5)  # pyright: ignore[reportArgumentType]
    # a second layer, perfectly balanced (f = (0.5, 0.5), P = (0.5, 0.5): 2 * 0.5 = 1): the mean of 1.25 and 1
    balanced = (torch.tensor([[0], [1]]), torch.tensor([[0.5, 0.5], [0.5, 0.5]]))
    two = Routes(layers=[layer.layers[0], balanced[0]], probs=[layer.probs[0], balanced[1]])  # pyright: ignore[reportOptionalSubscript]
    assert float(balance_loss(two, torch.tensor([True, True]))) == pytest.approx(1.125)  # pyright: ignore[reportArgumentType]
    assert balance_loss(Routes(layers=layer.layers), torch.tensor([True, True])) is None  # no probabilities kept


def test_the_balancing_loss_is_transformers_loss_for_one_layer():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2 * 5, EXPERTS, generator=generator)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
    probs = torch.softmax(logits, dim=-1)
    routes = Routes(layers=[probs.topk(TOP_K, dim=-1).indices], probs=[probs])
    expected = load_balancing_loss_func((logits,), EXPERTS, TOP_K, mask)
    assert float(balance_loss(routes, mask.reshape(-1).bool())) == pytest.approx(float(expected), rel=1e-6)  # pyright: ignore[reportArgumentType]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folders = {}
    for family in ("mixtral", "deepseek_v3"):
        model = tiny_moe(family, pad_token_id=PAD)
        decisive_routers(model)
        folders[family] = tmp_path_factory.mktemp(family)
        model.save_pretrained(folders[family])
    return folders


def _rollouts() -> list[Rollout]:
    return [
        Rollout(
            example=_EXAMPLE,
            prompt_ids=prompt,
            completion_ids=completion,
            completion_logprobs=[math.log(1 / 64)] * len(completion),
            versions=[0] * len(completion),
            sample_index=index,
            advantage=[1.0, -1.0, 0.5, -0.5][index],
        )
        for index, (prompt, completion) in enumerate(_SHAPES)
    ]


def _trainer(model_dir: Path, **moe: float) -> Trainer:
    config = TrainerConfig.model_validate(
        {
            "algorithm": AlgorithmConfig(num_mini_batches=1),
            "learning_rate": 0.05,
            "micro_batch_size": 8,  # one pass over the four rollouts
            "precision": "float32",
            "moe": moe,
            "device": "cpu",
        }
    )
    backend = SingleDeviceBackend(config, model_path=model_dir, dtype="float32")
    return Trainer(config, backend=backend, pad_token_id=PAD, max_new_tokens=8)


def _step_gradients(trainer: Trainer) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """One step's metrics and its gradients (before clipping), by parameter name."""
    backend = trainer.backend
    step = backend.clip_and_step
    grads: dict[str, torch.Tensor] = {}

    def recording(**options: float) -> float:
        for name, param in backend.model.named_parameters():  # pyright: ignore[reportAttributeAccessIssue]
            if param.grad is not None:
                grads[name] = param.grad.detach().clone()
        return step(**options)

    backend.clip_and_step = recording  # pyright: ignore[reportAttributeAccessIssue]
    metrics = trainer.step(TrainBatch(rollouts=_rollouts(), step=0))
    return metrics, grads


def _padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The four rollouts' tokens, right-padded, and their attention mask."""
    rows = [prompt + completion for prompt, completion in _SHAPES]
    width = max(map(len, rows))
    ids = torch.tensor([row + [PAD] * (width - len(row)) for row in rows])
    mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
    return ids, mask


def test_the_aux_loss_adds_the_coefficient_times_transformers_loss_gradient(model_dirs: dict[str, Path]):
    from transformers import AutoModelForCausalLM
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    coef = 0.5
    off_metrics, off = _step_gradients(_trainer(model_dirs["mixtral"]))
    on_metrics, on = _step_gradients(_trainer(model_dirs["mixtral"], aux_loss_coef=coef))
    # the reference: transformers' loss of each MoE layer on the same tokens (the weights before the step), averaged
    model = AutoModelForCausalLM.from_pretrained(model_dirs["mixtral"], dtype=torch.float32)
    ids, mask = _padded_batch()
    router_logits = model(input_ids=ids, attention_mask=mask, output_router_logits=True).router_logits
    layers = [load_balancing_loss_func((logits,), EXPERTS, TOP_K, mask) for logits in router_logits]
    reference = torch.stack(layers).mean()  # pyright: ignore[reportArgumentType]
    reference.backward()
    expected = {name: param.grad for name, param in model.named_parameters() if param.grad is not None}
    routers = [name for name in expected if name.endswith("gate.weight")]
    assert len(routers) == 2
    for name in routers:  # the loss reaches the routers, and only through the coefficient
        assert float(expected[name].abs().max()) > 1e-4
        torch.testing.assert_close(on[name] - off[name], coef * expected[name], rtol=1e-4, atol=1e-6, msg=name)
    # the policy loss is the same; the balance is logged either way, equal to transformers' value before the step
    assert on_metrics["train/loss"] == pytest.approx(off_metrics["train/loss"], rel=1e-6)
    assert off_metrics["moe/train_aux_loss"] == pytest.approx(float(reference.detach()), rel=1e-5)
    assert on_metrics["moe/train_aux_loss"] == pytest.approx(float(reference.detach()), rel=1e-5)
    assert TOP_K <= float(reference.detach()) <= EXPERTS  # top_k at perfect balance


def _router_loads(trainer: Trainer) -> list[torch.Tensor]:
    """Per MoE layer, the expert assignments of the real tokens of the training passes (with gradient), counted by
    hooks on the routers; the step has one pass over `_padded_batch`'s rows, shortest first."""
    routers = [m for m in trainer.backend.model.modules() if type(m).__name__ == "DeepseekV3TopkRouter"]  # pyright: ignore[reportAttributeAccessIssue]
    loads = [torch.zeros(EXPERTS) for _ in routers]
    lengths = sorted(len(prompt) + len(completion) for prompt, completion in _SHAPES)
    width = max(lengths)
    real = torch.tensor([[position < length for position in range(width)] for length in lengths]).reshape(-1)

    def count(layer: int):
        def hook(_module, _args, output) -> None:
            if torch.is_grad_enabled():
                loads[layer] += torch.bincount(output[2][real].reshape(-1), minlength=EXPERTS).float()

        return hook

    for layer, router in enumerate(routers):
        router.register_forward_hook(count(layer))
    return loads


@pytest.mark.parametrize("rate", [0.0, 0.01])
def test_the_expert_bias_moves_toward_balance_by_the_rate(model_dirs: dict[str, Path], rate: float):
    trainer = _trainer(model_dirs["deepseek_v3"], expert_bias_update_rate=rate)
    loads = _router_loads(trainer)
    trainer.step(TrainBatch(rollouts=_rollouts(), step=0))
    weights = dict(trainer.named_weights())
    biases = [name for name in weights if name.endswith("e_score_correction_bias")]
    assert len(biases) == len(loads) == 2
    for name, load in zip(biases, loads, strict=True):
        assert float(load.sum()) == TOP_K * sum(len(p) + len(c) for p, c in _SHAPES)
        assert not torch.all(load == load.mean())  # an uneven load, so the bias has somewhere to go
        expected = rate * torch.sign(load.mean() - load)  # +rate below the mean, -rate above, from 0
        torch.testing.assert_close(weights[name], expected, rtol=0, atol=1e-7, msg=name)  # what the engine receives
