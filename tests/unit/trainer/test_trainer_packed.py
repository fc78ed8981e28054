"""Packing without padding (`trainer.packing`): the packed row's layout, the token-budget split, attention that
never crosses rollouts (a packed row scores each rollout as it scores alone; three naive packings are shown to
leak across rollouts), the balance of ranks' micro-batches, and a trainer step whose loss, metrics and gradient do
not change with packing on or off."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from sharpen.config.algorithm import AlgorithmConfig
from sharpen.config.schema import TrainerConfig
from sharpen.trainer import SingleDeviceBackend, Trainer
from sharpen.trainer.backends.scoring import score_tokens
from sharpen.trainer.packing import pack_micro_batch, split_micro_batches_by_tokens, unpack_scores
from sharpen.trainer.sharding import split_rollouts_by_tokens
from sharpen.types import Example, Message, Rollout, TrainBatch

VOCAB, HIDDEN, NUM_LAYERS, PAD = 128, 32, 2, 0  # the tiny model of conftest.model_dir
FLOAT32_UNIT_ROUNDOFF = 2.0**-24
CPU = torch.device("cpu")
_EXAMPLE = Example(task_key="t/0", prompt=(Message(role="user", content="q"),), answer="a")


def _rollout(prompt: list[int], completion: list[int], *, advantage: float = 1.0, index: int = 0) -> Rollout:
    return Rollout(
        example=_EXAMPLE,
        prompt_ids=prompt,
        completion_ids=completion,
        completion_logprobs=[math.log(1 / VOCAB) + 0.05 * (i % 5 - 2) for i in range(len(completion))],
        versions=[0] * len(completion),
        sample_index=index,
        advantage=advantage,
    )


def _long_tailed(seed: int, num: int = 12) -> list[Rollout]:
    """Mostly short completions and a few long ones (the padding a length spread costs); one with environment
    tokens (inputs only) in its completion."""
    rng = random.Random(seed)
    out = []
    for index in range(num):
        num_completion = rng.choice([1, 2, 3, 4, 5, 6, 20, 30]) if index % 4 else rng.randint(1, 4)
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 6))]
        completion = [rng.randrange(1, VOCAB) for _ in range(num_completion)]
        out.append(_rollout(prompt, completion, advantage=rng.uniform(-1.5, 1.5), index=index))
    tool = out[1]
    tool.completion_ids = [*tool.completion_ids, 7, 8, 9, 10]
    tool.completion_logprobs = [*tool.completion_logprobs, 0.0, 0.0, 0.0, -4.0]
    tool.versions = [0] * len(tool.completion_ids)
    tool.loss_mask = [True] * (len(tool.completion_ids) - 4) + [False, False, False, True]
    return out


def test_the_packed_row_concatenates_with_restarting_positions_and_aligns_targets_with_the_loss_mask():
    short = _rollout([1, 2, 3], [4, 5])
    tool = _rollout([7], [8, 9, 10, 11])
    tool.loss_mask = [True, False, False, True]  # 9 and 10 came from the environment
    micro = pack_micro_batch([short, tool], pad_token_id=PAD, device=CPU, is_packed=True)
    packed = micro.packed
    assert packed is not None and packed.num_tokens == 10
    assert packed.input_ids.tolist() == [[1, 2, 3, 4, 5, 7, 8, 9, 10, 11]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4]]
    # targets 4, 5 (positions 2, 3) and 8, 11 (positions 5, 8); position 4 -> 7 crosses the boundary: never
    assert packed.target_mask.tolist() == [[False, False, True, True, False, True, False, False, True]]
    assert packed.input_ids[0, 1:][packed.target_mask[0]].tolist() == [4, 5, 8, 11]
    assert micro.input_ids[:, 1:][micro.loss_mask].tolist() == [4, 5, 8, 11]  # the same targets, the same order
    values = torch.arange(9, dtype=torch.float32)[None]  # [1, num_tokens - 1]
    rows = unpack_scores(values, micro)
    assert rows.tolist() == [[0.0, 0.0, 2.0, 3.0], [5.0, 0.0, 0.0, 8.0]]  # [batch, seq - 1], seq = 5
    assert pack_micro_batch([short], pad_token_id=PAD, device=CPU).packed is None


def test_token_budget_split_keeps_every_rollout_once_under_the_budget():
    rollouts = _long_tailed(seed=0, num=24)
    rollouts.append(_rollout(list(range(1, 41)), [5] * 30, index=99))  # 70 tokens: over the budget, alone
    chunks = split_micro_batches_by_tokens(rollouts, 48)
    assert sorted(id(r) for c in chunks for r in c) == sorted(id(r) for r in rollouts)
    for chunk in chunks:
        assert sum(r.num_tokens for r in chunk) <= 48 or len(chunk) == 1
    assert [r.num_tokens for r in chunks[0]] == [70]
    assert chunks == split_micro_batches_by_tokens(list(rollouts), 48)  # deterministic
    total = sum(r.num_tokens for r in rollouts)
    assert len(chunks) <= math.ceil((total - 70) / 48) + 2  # first-fit decreasing: nearly full micro-batches
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        split_micro_batches_by_tokens(rollouts, 0)


def test_ranks_get_token_balanced_shares_and_micro_batch_counts_within_one():
    """The trainer's plan on 2 and 4 ranks: `split_rollouts_by_tokens`, then each rank's token-budget split; the
    lockstep adds filler passes up to the largest count, so the counts must be close and the loads balanced."""
    rollouts = _long_tailed(seed=1, num=64)
    for num_ranks in (2, 4):
        shares = split_rollouts_by_tokens(rollouts, num_ranks)
        counts = [len(split_micro_batches_by_tokens(share, 64)) for share in shares]
        loads = [sum(r.num_tokens for r in share) for share in shares]
        assert max(counts) - min(counts) <= 1, counts
        assert max(loads) - min(loads) <= max(r.num_tokens for r in rollouts), loads


@pytest.fixture(scope="module")
def backend(model_dir: Path) -> SingleDeviceBackend:
    return SingleDeviceBackend(TrainerConfig(device="cpu", precision="float32"), model_path=model_dir, dtype="float32")


def _attention_tolerance(values: torch.Tensor, *, seq_len: int) -> float:
    """A packed row and a rollout alone do the same arithmetic per token except the attention's softmax and value
    sums, which run over the packed row's keys (masked ones add exact zeros) and may be blocked differently: sums
    of up to seq_len terms in another order, off by ~seq_len u of their magnitude (u = 2^-24) in each of the
    layers, and the LM head's VOCAB and HIDDEN-term reductions after them; a factor of 4 covers the chaining. A
    leak across rollouts changes logprobs by ~0.1-1 nats."""
    return 4 * (NUM_LAYERS + 1) * (seq_len + VOCAB + HIDDEN) * FLOAT32_UNIT_ROUNDOFF * float(values.abs().max())


def _alone(backend: SingleDeviceBackend, rollouts: list[Rollout], attn: str) -> torch.Tensor:
    """Each rollout's target logprobs scored alone, concatenated: [num_targets]."""
    backend.model.config._attn_implementation = attn
    parts = []
    with torch.no_grad():
        for rollout in rollouts:
            micro = pack_micro_batch([rollout], pad_token_id=PAD, device=CPU)
            scores = score_tokens(
                backend.model, micro.input_ids, micro.attention_mask, micro.loss_mask, temperature=1.0
            )
            parts.append(scores.logprobs[micro.loss_mask])
    return torch.cat(parts)


def _packed_scores(backend: SingleDeviceBackend, rollouts: list[Rollout], attn: str) -> torch.Tensor:
    backend.model.config._attn_implementation = attn
    micro = pack_micro_batch(rollouts, pad_token_id=PAD, device=CPU, is_packed=True)
    assert micro.packed is not None
    with torch.no_grad():
        scores = score_tokens(
            backend.model,
            micro.packed.input_ids,
            None,
            micro.packed.target_mask,
            temperature=1.0,
            position_ids=micro.packed.position_ids,
        )
    return unpack_scores(scores.logprobs, micro)[micro.loss_mask]


def _naive_packed_scores(backend: SingleDeviceBackend, rollouts: list[Rollout], attn: str, naive: str) -> torch.Tensor:
    """The packed row run the ways that leak: with an all-ones attention mask (transformers' packed detection needs
    none), with positions that do not restart (no sequence boundary to find), or with a cache (detection is off
    when there is one, and models' configs default to use_cache = True)."""
    backend.model.config._attn_implementation = attn
    micro = pack_micro_batch(rollouts, pad_token_id=PAD, device=CPU, is_packed=True)
    packed = micro.packed
    assert packed is not None
    kwargs: dict[str, object] = {"input_ids": packed.input_ids, "use_cache": False}
    if naive == "ones_mask":
        kwargs.update(attention_mask=torch.ones_like(packed.input_ids), position_ids=packed.position_ids)
    elif naive == "running_positions":
        kwargs.update(position_ids=torch.arange(packed.num_tokens)[None])
    else:
        kwargs.update(position_ids=packed.position_ids, use_cache=True)
    with torch.no_grad():
        hidden = backend.model.get_decoder()(**kwargs).last_hidden_state  # [1, num_tokens, hidden]
        logits = backend.model.lm_head(hidden[0, :-1][packed.target_mask[0]])  # [num_targets, vocab]
        targets = packed.input_ids[0, 1:][packed.target_mask[0]]
        return logits.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)


_ROLLOUTS = [
    _rollout([5, 6, 7], [8, 9, 10]),
    _rollout([11], [12]),  # one prompt token: its position 0 follows the previous rollout's last position
    _rollout([13, 14], [15, 16, 17, 18, 19]),
    _rollout([20, 21, 22, 23], [24, 25]),
]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_packed_row_scores_every_rollout_as_it_scores_alone(backend, attn):
    try:
        alone = _alone(backend, _ROLLOUTS, attn)
        packed = _packed_scores(backend, _ROLLOUTS, attn)
    finally:
        backend.model.config._attn_implementation = "sdpa"
    seq_len = sum(r.num_tokens for r in _ROLLOUTS)
    torch.testing.assert_close(packed, alone, rtol=0, atol=_attention_tolerance(alone, seq_len=seq_len))


@pytest.mark.parametrize("naive", ["ones_mask", "running_positions", "cache_on"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_naive_packings_leak_across_rollouts(backend, attn, naive):
    """The same comparison fails for each naive packing: the parity test above can fail."""
    try:
        alone = _alone(backend, _ROLLOUTS, attn)
        leaky = _naive_packed_scores(backend, _ROLLOUTS, attn, naive)
    finally:
        backend.model.config._attn_implementation = "sdpa"
    seq_len = sum(r.num_tokens for r in _ROLLOUTS)
    first = _ROLLOUTS[0].num_loss_tokens  # the first rollout attends to nothing before it either way
    assert (leaky[first:] - alone[first:]).abs().max() > 100 * _attention_tolerance(alone, seq_len=seq_len)


def test_score_tokens_refuses_a_packed_row_with_an_attention_mask(backend):
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="packed rows"):
        score_tokens(
            backend.model,
            ids,
            torch.ones_like(ids),
            torch.ones((1, 2), dtype=torch.bool),
            temperature=1.0,
            position_ids=torch.arange(3)[None],
        )


# --- the trainer step, packing on vs off ---

_STEP_CASES = {
    "token_mean": {},
    "seq_mean_gspo_sequence_tis": {
        "loss_aggregation": "seq_mean_token_mean",
        "policy_loss": "gspo",
        "off_policy_correction": "sequence_tis",
    },
    "two_epochs_two_mini_batches": {"num_epochs": 2, "num_mini_batches": 2, "entropy_coef": 0.01},
}
# quantiles and the effective sample size of the ratio are statistics of each micro-batch: they change with the split
_PER_MICRO_BATCH = ("offpolicy/ess", "offpolicy/ratio_p")


def _step(
    model_dir: Path, backend: SingleDeviceBackend, monkeypatch, *, algorithm: dict, **config
) -> tuple[dict[str, float], dict[str, torch.Tensor], int]:
    """One trainer step from the same weights: (metrics, the gradient of each optimizer step summed, passes)."""
    trainer_config = TrainerConfig(
        device="cpu", precision="float32", learning_rate=1e-3, algorithm=AlgorithmConfig(**algorithm), **config
    )
    trainer = Trainer(trainer_config, backend=backend, pad_token_id=PAD, max_new_tokens=40)
    gradients: dict[str, torch.Tensor] = {}
    passes = []

    def capture(**_: float) -> float:
        for name, param in backend.model.named_parameters():
            assert param.grad is not None, name
            gradients[name] = gradients.get(name, 0) + param.grad.detach().clone()
        backend.optimizer.zero_grad(set_to_none=True)
        return 1.0

    original = backend.score_tokens

    def counted(*args, **kwargs):
        passes.append(kwargs.get("position_ids") is not None)
        return original(*args, **kwargs)

    monkeypatch.setattr(backend, "clip_and_step", capture)
    monkeypatch.setattr(backend, "score_tokens", counted)
    metrics = trainer.step(TrainBatch(rollouts=_long_tailed(seed=3), step=0))
    monkeypatch.undo()
    return metrics, gradients, len(passes) if all(passes) else -len(passes)


@pytest.mark.parametrize("case", list(_STEP_CASES))
def test_the_step_does_not_change_with_packing(model_dir, backend, monkeypatch, case):
    """The loss is normalised by the mini-batch's counts and computed per padded row in both layouts, so only the
    forward pass's float32 summation order differs (see `_attention_tolerance`; the step's loss and gradient sum
    over its tokens too). Several micro-batches of 48 tokens, one rollout of them with environment tokens."""
    algorithm = _STEP_CASES[case]
    plain, plain_gradients, plain_passes = _step(model_dir, backend, monkeypatch, algorithm=algorithm)
    packed, packed_gradients, packed_passes = _step(
        model_dir, backend, monkeypatch, algorithm=algorithm, packing=True, micro_batch_tokens=48
    )
    assert plain_passes < 0 < packed_passes  # padded passes without packing, packed passes (several) with it
    assert packed_passes > (2 if "epochs" in case else 1)
    assert set(plain) == set(packed)
    seq_len = 48
    num_tokens = int(plain["train/num_loss_tokens"])
    for name, value in plain.items():
        if name.startswith(_PER_MICRO_BATCH):
            continue
        scale = max(abs(value), 1.0)
        tolerance = 4 * (NUM_LAYERS + 1) * (seq_len + VOCAB + HIDDEN + num_tokens) * FLOAT32_UNIT_ROUNDOFF * scale
        assert packed[name] == pytest.approx(value, rel=0, abs=tolerance), name
    assert plain_gradients.keys() == packed_gradients.keys()
    for name, expected in plain_gradients.items():
        assert expected.abs().max() > 0, name
        tolerance = _attention_tolerance(expected, seq_len=seq_len + num_tokens)
        torch.testing.assert_close(packed_gradients[name], expected, rtol=0, atol=tolerance, msg=name)


def test_micro_batch_size_still_splits_without_packing(model_dir, backend, monkeypatch):
    _, _, passes = _step(model_dir, backend, monkeypatch, algorithm={}, micro_batch_size=5)
    assert passes == -3  # 12 rollouts in micro-batches of 5: 3 padded passes
