"""What the parallel-trainer tests share: the batch, the trainer run and the comparisons of a layout against one
process (float32, tiny models with a vocabulary of 128 and pad id 0)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sharpen.config.schema import TrainerConfig
from sharpen.types import TrainBatch
from support.tiny_trainer import uneven_rollouts

VOCAB, PAD = 128, 0
NUM_STEPS = 2
TOLERANCE = 1e-5  # the bound on logprobs, entropy, loss and gradients
WEIGHT_TOLERANCE = 5e-5  # relative, after the AdamW steps (`relative_difference`)


def trainer_config(**overrides) -> TrainerConfig:
    """Two mini-batches x two epochs of micro-batches of 2, an entropy bonus, a chunked LM head (chunks of 8 targets)
    and active clipping (a small max_grad_norm), in float32 on the CPU."""
    config = {"device": "cpu", "precision": "float32", "learning_rate": 1e-2, "max_grad_norm": 0.05}
    config |= {"logits_chunk_tokens": 8, "micro_batch_size": 2}
    config |= {"algorithm": {"num_mini_batches": 2, "num_epochs": 2, "entropy_coef": 0.01}}
    return TrainerConfig(**{**config, **overrides})


def save_tiny_llama4(folder: Path) -> Path:
    """A 4-layer random Llama (tied LM head) whose heads (4), key/value heads (2), hidden (32), intermediate (64) and
    vocabulary (128) sizes divide by 2."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        pad_token_id=PAD,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder / "llama4")
    return folder / "llama4"


def parity_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three right-padded rows: ids, attention mask, target mask (the last row shorter), token advantages."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (3, 12), generator=generator)
    attention = torch.ones_like(ids)
    attention[2, 9:] = 0
    targets = torch.zeros(3, 11, dtype=torch.bool)
    targets[:, 4:] = True
    targets[2, 8:] = False
    advantages = torch.randn(3, 11, generator=generator)
    return ids, attention, targets, advantages


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A (possibly sharded) tensor as one whole host copy."""
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu().clone()


def trainer_steps(backend, *, reference=None) -> tuple[list[dict[str, float]], dict[str, torch.Tensor]]:
    """`NUM_STEPS` steps of the real `Trainer` on `tiny_trainer.uneven_rollouts`: each step's metrics, then the
    whole HF-named weights. ``reference``: the reference policy of a KL term."""
    from sharpen.trainer import Trainer

    trainer = Trainer(backend.config, backend=backend, pad_token_id=PAD, max_new_tokens=12, reference=reference)
    metrics = [trainer.step(TrainBatch(rollouts=uneven_rollouts()[: 7 - step], step=step)) for step in range(NUM_STEPS)]
    return metrics, {name: tensor.detach().cpu().clone() for name, tensor in backend.named_weights()}


def max_difference(got: torch.Tensor, expected: torch.Tensor) -> float:
    assert got.shape == expected.shape
    return (got - expected).abs().max().item()


def relative_difference(got: torch.Tensor, expected: torch.Tensor) -> float:
    """||got - expected|| / ||expected||: how weights are compared after AdamW steps, whose update of a near-zero
    gradient element is about lr x its sign, so that a 1e-7 difference in the gradient can move one weight by 1e-5."""
    assert got.shape == expected.shape
    return ((got - expected).norm() / expected.norm()).item()


def assert_trainer_matches(got: tuple, expected: tuple) -> None:
    """`trainer_steps` of a layout against one device's: every metric (but the per-micro-batch statistics and
    times), and the final weights by `relative_difference`."""
    got_metrics, got_weights = got
    metrics, weights = expected
    per_micro_batch = ("offpolicy/ess", "offpolicy/ratio_p")  # statistics of each micro-batch: change with the split
    for got_step, step in zip(got_metrics, metrics, strict=True):
        assert set(got_step) == set(step)
        for name, value in step.items():
            if name == "train/loss":  # a cancelling sum (test_fsdp2's _loss_tolerance): absolute
                assert got_step[name] == pytest.approx(value, abs=TOLERANCE), name
            elif not name.startswith(per_micro_batch) and not name.startswith("time/"):
                assert got_step[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
    assert got_weights.keys() == weights.keys()  # HF names, a tied LM head left out as on one device
    for name, tensor in weights.items():
        assert relative_difference(got_weights[name], tensor) < WEIGHT_TOLERANCE, name
