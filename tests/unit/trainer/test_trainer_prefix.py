"""Shared-prompt scoring against the unshared computation (`score_tokens` on the right-padded full sequences):
logprobs, entropy, the trainer's loss and every parameter's gradient, with gradient checkpointing off and on;
broken variants of the shared pass that the same comparison must reject; the no-copy broadcast of one prompt's
keys/values; bad input; the ``trainer.share_prompt`` switch.

Tolerance, from the arithmetic: both computations run the model in float64 and differ there only in summation
order (~1e-16 relative). The head casts logits to float32 (as `score_tokens` does), so two float64 logits 1e-16
apart can round to neighbouring float32 values: a logprob or entropy moves by a few float32 ulps (2^-24 relative)
of its scale, and the float32 softmax gradient by a few ulps per entry, carried linearly into each parameter's
gradient. Every quantity must agree to 2^-18 (64 ulps) of its own scale: 1 + the largest |value| for logprobs,
entropy and loss, the largest |entry| of a parameter's gradient for that gradient. A real mistake (a prompt's
gradient lost, a position off by the prompt's length, a padded prompt slot attended to) is off by 1e-3 or more.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

from sharpen.config.loader import load_config
from sharpen.config.schema import TrainerConfig
from sharpen.trainer import Trainer, prefix
from sharpen.trainer.backends.base import TokenScores, TrainerBackend
from sharpen.trainer.backends.scoring import score_tokens
from sharpen.trainer.packing import MicroBatch, pack_micro_batch
from sharpen.trainer.prefix import build_layout, group_by_prompt, score_shared_prompts
from sharpen.types import Example, Message, Rollout

VOCAB, PAD = 128, 0
TOLERANCE = 2.0**-18
TEMPERATURE = 0.7
_EXAMPLE = Example(task_key="t/0", prompt=(Message(role="user", content="q"),), answer="a")


@dataclass(kw_only=True, frozen=True)
class Case:
    """A micro-batch: rows of (prompt key, completion length, loss mask or None); rows with the same key share
    their prompt's ids, ``prompt_lengths`` gives each key's length."""

    name: str
    prompt_lengths: dict[str, int]
    rows: tuple[tuple[str, int, tuple[bool, ...] | None], ...]


CASES = [
    Case(
        name="group of four, different completion lengths",
        prompt_lengths={"a": 7},
        rows=(("a", 5, None), ("a", 1, None), ("a", 3, None), ("a", 6, None)),
    ),
    Case(name="group of one", prompt_lengths={"a": 6}, rows=(("a", 4, None),)),
    Case(name="one-token prompt", prompt_lengths={"a": 1}, rows=(("a", 3, None), ("a", 5, None))),
    Case(
        name="multi-turn loss masks (environment tokens inside the completion)",
        prompt_lengths={"a": 5},
        rows=(
            ("a", 7, (True, True, False, False, False, True, True)),
            ("a", 4, (True, False, True, True)),
            ("a", 3, None),
        ),
    ),
    Case(
        name="two groups and a single, prompts of different lengths",
        prompt_lengths={"a": 6, "b": 3, "c": 9},
        rows=(
            ("a", 4, None),
            ("b", 2, None),
            ("a", 2, None),
            ("c", 3, None),
            ("b", 5, (True, True, False, True, True)),
        ),
    ),
    Case(name="one-token completions only", prompt_lengths={"a": 4, "b": 2}, rows=(("a", 1, None), ("b", 1, None))),
]


def _rollouts(case: Case, seed: int = 0) -> list[Rollout]:
    rng = random.Random(seed)
    prompts = {key: [rng.randrange(1, VOCAB) for _ in range(length)] for key, length in case.prompt_lengths.items()}
    out = []
    for index, (key, num_completion, loss_mask) in enumerate(case.rows):
        completion = [rng.randrange(1, VOCAB) for _ in range(num_completion)]
        out.append(
            Rollout(
                example=_EXAMPLE,
                prompt_ids=list(prompts[key]),
                completion_ids=completion,
                completion_logprobs=[math.log(1 / VOCAB) + rng.uniform(-0.4, 0.4) for _ in completion],
                versions=[0] * num_completion,
                loss_mask=None if loss_mask is None else list(loss_mask),
                sample_index=index,
                advantage=rng.uniform(-1.5, 1.5),
            )
        )
    return out


def _model(*, gradient_checkpointing: bool = False, use_reentrant: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=PAD,
    )
    model = LlamaForCausalLM(config).to(torch.float64)
    model.config.use_cache = False
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    return model.train()


def _trainer() -> Trainer:
    """A trainer for its loss code only: PPO-clip with an entropy bonus (so the entropy's gradient counts too)."""
    config = TrainerConfig(
        device="cpu", algorithm={"entropy_coef": 0.01, "policy_loss": {"type": "ppo_clip", "clip_eps_low": 0.1}}
    )
    backend = cast(TrainerBackend, SimpleNamespace(device=torch.device("cpu"), num_ranks=1, rank=0))
    return Trainer(config, backend=backend, pad_token_id=PAD)


Score = Callable[[Any, MicroBatch, list[int]], TokenScores]


def _unshared(model, micro: MicroBatch, prompt_lengths: list[int]) -> TokenScores:
    return score_tokens(
        model,
        micro.input_ids,
        micro.attention_mask,
        micro.loss_mask,
        temperature=TEMPERATURE,
        with_entropy=True,
        entropy_requires_grad=True,
    )


def _shared(model, micro: MicroBatch, prompt_lengths: list[int], *, logits_chunk_tokens: int = 0) -> TokenScores:
    return score_shared_prompts(
        model,
        micro.input_ids,
        micro.attention_mask,
        micro.loss_mask,
        prompt_lengths=prompt_lengths,
        temperature=TEMPERATURE,
        with_entropy=True,
        entropy_requires_grad=True,
        logits_chunk_tokens=logits_chunk_tokens,
    )


def _run(model, rollouts: list[Rollout], score: Score) -> dict[str, torch.Tensor]:
    """Logprobs, entropy, the trainer's micro-batch loss and every parameter's gradient of that loss."""
    micro = pack_micro_batch(rollouts, pad_token_id=PAD, device=torch.device("cpu"))
    model.zero_grad(set_to_none=True)
    scores = score(model, micro, [len(r.prompt_ids) for r in rollouts])
    assert scores.entropy is not None
    old = micro.engine_logprobs + 0.05  # some ratios clip, some do not
    loss = _trainer().objective.micro_batch_loss(micro, scores.logprobs, old, scores.entropy, 3.0, defaultdict(float))
    loss.backward()
    out = {"logprobs": scores.logprobs.detach(), "entropy": scores.entropy.detach(), "loss": loss.detach()}
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        out[f"grad {name}"] = param.grad.detach().clone()
    return out


def _mismatches(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> list[str]:
    """Names of the quantities that differ by more than the tolerance of the module docstring."""
    wrong = []
    for name, want in expected.items():
        got = actual[name]
        scale = want.abs().max().item() if name.startswith("grad ") else 1.0 + want.abs().max().item()
        if got.shape != want.shape or (got - want).abs().max().item() > TOLERANCE * scale:
            wrong.append(name)
    return wrong


@pytest.mark.parametrize("gradient_checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_shared_prompt_equals_the_unshared_computation(case, gradient_checkpointing):
    model = _model(gradient_checkpointing=gradient_checkpointing)
    rollouts = _rollouts(case)
    expected = _run(model, rollouts, _unshared)
    assert expected["loss"].abs().item() > 1e-3
    assert max(v.abs().max().item() for k, v in expected.items() if k.startswith("grad ")) > 1e-5  # a real gradient
    assert _mismatches(expected, _run(model, rollouts, _shared)) == []


def test_shared_prompt_with_the_head_in_chunks_equals_the_unshared_computation():
    model = _model()
    rollouts = _rollouts(CASES[4])
    chunked = _run(model, rollouts, lambda *args: _shared(*args, logits_chunk_tokens=3))
    assert _mismatches(_run(model, rollouts, _unshared), chunked) == []


def _positions_from_zero(layout):
    attention_mask, positions = _correct_attention(layout)
    return attention_mask, positions - layout.prompt_lengths[layout.row_prompt][:, None]


def _padded_prompt_slots_visible(layout):
    attention_mask, positions = _correct_attention(layout)
    attention_mask = attention_mask.clone()
    attention_mask[:, : layout.prompt_ids.shape[1]] = 1
    return attention_mask, positions


def _prompt_detached(recording, layout, model, prompt_hidden):
    for layer in _correct_prefix_layers(recording, layout, model, prompt_hidden):
        assert layer.keys is not None and layer.values is not None
        yield prefix._PrefixLayer(keys=layer.keys.detach(), values=layer.values.detach())


_correct_attention = prefix._completion_attention
_correct_prefix_layers = prefix._prefix_layers
# Each broken variant: (name, the function of `prefix` it replaces, the replacement, a quantity it must get wrong)
BROKEN = [
    ("completion positions restart at 0", "_completion_attention", _positions_from_zero, "logprobs"),
    ("padded prompt slots attended to", "_completion_attention", _padded_prompt_slots_visible, "logprobs"),
    # the logprobs stay right: only the gradient shows that the completions' share of the prompt's gradient is lost
    ("prompt keys/values cut from the graph", "_prefix_layers", _prompt_detached, "grad model.embed_tokens.weight"),
]


@pytest.mark.parametrize(("name", "target", "replacement", "wrong_quantity"), BROKEN, ids=[b[0] for b in BROKEN])
def test_the_comparison_rejects_a_broken_shared_pass(name, target, replacement, wrong_quantity, monkeypatch):
    """The same comparison fails each broken variant (so passing it means something); padding needs prompts of
    different lengths, hence the case with two groups."""
    model = _model()
    rollouts = _rollouts(CASES[4])
    expected = _run(model, rollouts, _unshared)
    monkeypatch.setattr(prefix, target, replacement)
    assert wrong_quantity in _mismatches(expected, _run(model, rollouts, _shared)), name


def test_one_prompt_is_broadcast_to_its_rows_without_a_copy(monkeypatch):
    model = _model()
    rollouts = _rollouts(CASES[0])
    micro = pack_micro_batch(rollouts, pad_token_id=PAD, device=torch.device("cpu"))
    seen = []

    def spy(recording, layout, model, prompt_hidden):
        layers = _correct_prefix_layers(recording, layout, model, prompt_hidden)
        for recorded, layer in zip(recording.layers, layers, strict=True):
            seen.append((recorded.keys, layer.keys))
            yield layer

    monkeypatch.setattr(prefix, "_prefix_layers", spy)
    _shared(model, micro, [7] * len(rollouts))
    assert len(seen) == model.config.num_hidden_layers
    for recorded, expanded in seen:
        assert expanded.shape[0] == len(rollouts) and recorded.shape[0] == 1
        assert expanded.stride(0) == 0 and expanded.data_ptr() == recorded.data_ptr()
    layout = build_layout(micro.input_ids, micro.attention_mask, micro.loss_mask, prompt_lengths=[7] * 4)
    # the prompt once (7) + completions but their last token (max 6 - 1 = 5 per row) vs 4 rows of 7 + 6 tokens
    assert (layout.num_prompts, layout.num_input_tokens, micro.input_ids.numel()) == (1, 7 + 4 * 5, 4 * 13)


def test_group_by_prompt_keeps_first_appearance_order():
    assert group_by_prompt([[1, 2], [3], [1, 2], [1], [3]]) == [[0, 2], [1, 4], [3]]
    assert group_by_prompt([]) == []


def _micro(case: Case) -> tuple[MicroBatch, list[int]]:
    rollouts = _rollouts(case)
    micro = pack_micro_batch(rollouts, pad_token_id=PAD, device=torch.device("cpu"))
    return micro, [len(r.prompt_ids) for r in rollouts]


def test_a_target_on_a_prompt_token_is_refused():
    micro, lengths = _micro(CASES[0])
    micro.loss_mask[1, 2] = True  # predicting prompt token 3
    with pytest.raises(ValueError, match="row 1: target index 2 is not a completion token"):
        build_layout(micro.input_ids, micro.attention_mask, micro.loss_mask, prompt_lengths=lengths)


@pytest.mark.parametrize(
    ("prompt_lengths", "message"),
    [([7, 7], "2 prompt lengths for a micro-batch of 4 rows"), ([7, 0, 7, 7], "row 1: prompt length 0 outside")],
)
def test_bad_prompt_lengths_are_refused(prompt_lengths, message):
    micro, _ = _micro(CASES[0])
    with pytest.raises(ValueError, match=message):
        build_layout(micro.input_ids, micro.attention_mask, micro.loss_mask, prompt_lengths=prompt_lengths)


def test_reentrant_checkpointing_is_refused_and_the_layers_are_left_as_they_were():
    """Reentrant checkpointing runs the prompt pass without grad: the completions' gradient would never reach the
    prompt. The layers' checkpointing flag is set for the two passes only, also when they fail."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    model = _model(gradient_checkpointing=True, use_reentrant=True)
    micro, lengths = _micro(CASES[0])
    with pytest.raises(RuntimeError, match="use_reentrant"):
        _shared(model, micro, lengths)
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    assert layers and all("_can_checkpoint_with_cache" not in vars(layer) for layer in layers)


def test_a_cache_dropped_by_checkpointed_layers_is_an_error_not_a_wrong_result(monkeypatch):
    """What transformers does without the flag the two passes set: its checkpointed layers drop any cache, so the
    prompt pass records nothing; that must stop the step rather than score completions without their prompt."""
    monkeypatch.setattr(prefix, "_cache_kept_under_checkpointing", lambda model: contextlib.nullcontext())
    micro, lengths = _micro(CASES[0])
    with pytest.raises(RuntimeError, match="recorded keys/values of 0 of 2 layers"):
        _shared(_model(gradient_checkpointing=True), micro, lengths)


def test_share_prompt_switch():
    assert TrainerConfig().share_prompt is True
    assert load_config(None, ["trainer.share_prompt=false"]).trainer.share_prompt is False
