"""pack_micro_batch / split_micro_batches: where the loss mask and engine logprobs land, padding, chunking."""

from __future__ import annotations

import pytest
import torch

from sharpen.trainer.packing import pack_micro_batch, split_micro_batches
from sharpen.types import Example, Message, Rollout

_EXAMPLE = Example(task_key="t/0", prompt=(Message(role="user", content="q"),), answer="a")
PAD = 99


def _rollout(prompt: list[int], completion: list[int], *, advantage: float | None = 1.0, key: str = "t/0") -> Rollout:
    return Rollout(
        example=Example(task_key=key, prompt=_EXAMPLE.prompt),
        prompt_ids=prompt,
        completion_ids=completion,
        completion_logprobs=[-0.1 * (i + 1) for i in range(len(completion))],
        versions=[0] * len(completion),
        advantage=advantage,
    )


def test_loss_mask_sits_exactly_on_completion_targets():
    # prompt [1, 2, 3], completion [4, 5]: targets at positions 2 (predicts 4) and 3 (predicts 5)
    short = _rollout([1, 2, 3], [4, 5], advantage=0.5)
    long = _rollout([7], [8, 9, 10, 11, 12], advantage=-2.0)
    micro = pack_micro_batch([short, long], pad_token_id=PAD, device=torch.device("cpu"))

    assert micro.input_ids.tolist() == [[1, 2, 3, 4, 5, PAD], [7, 8, 9, 10, 11, 12]]
    assert micro.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]
    assert micro.loss_mask.tolist() == [
        [False, False, True, True, False],
        [True, True, True, True, True],
    ]
    # every masked position t scores input_ids[t + 1], which is the completion, in order
    for row, rollout in enumerate([short, long]):
        targets = micro.input_ids[row, 1:][micro.loss_mask[row]].tolist()
        assert targets == rollout.completion_ids
        engine = micro.engine_logprobs[row][micro.loss_mask[row]]
        torch.testing.assert_close(engine, torch.tensor(rollout.completion_logprobs))
    assert micro.engine_logprobs[~micro.loss_mask].abs().sum().item() == 0.0
    assert micro.advantages.tolist() == [[0.5], [-2.0]]
    assert micro.num_loss_tokens == 7
    assert micro.loss_mask.dtype == torch.bool and micro.input_ids.dtype == torch.long


@pytest.mark.parametrize("prompt_len, completion_len", [(1, 1), (4, 3), (2, 6)])
def test_loss_mask_positions_formula(prompt_len, completion_len):
    rollout = _rollout(list(range(1, prompt_len + 1)), list(range(50, 50 + completion_len)))
    micro = pack_micro_batch([rollout], pad_token_id=PAD, device=torch.device("cpu"))
    positions = micro.loss_mask[0].nonzero().flatten().tolist()
    assert positions == list(range(prompt_len - 1, prompt_len + completion_len - 1))


def test_rollout_without_advantage_is_an_error_naming_it():
    with pytest.raises(ValueError, match="rollout t/7 has no advantage"):
        pack_micro_batch(
            [_rollout([1], [2]), _rollout([1], [2], advantage=None, key="t/7")],
            pad_token_id=0,
            device=torch.device("cpu"),
        )
    with pytest.raises(ValueError, match="empty"):
        pack_micro_batch([], pad_token_id=0, device=torch.device("cpu"))


def test_split_micro_batches_sorts_by_length_and_chunks():
    lengths = [5, 2, 9, 3, 7]
    rollouts = [_rollout([1] * n, [2], key=f"t/{n}") for n in lengths]
    chunks = split_micro_batches(rollouts, 2)
    assert [[r.num_tokens for r in chunk] for chunk in chunks] == [[3, 4], [6, 8], [10]]
    assert sorted(r.example.task_key for chunk in chunks for r in chunk) == sorted(r.example.task_key for r in rollouts)
    assert [len(chunk) for chunk in split_micro_batches(rollouts, 5)] == [5]
    assert [len(chunk) for chunk in split_micro_batches(rollouts, 1)] == [1] * 5


def test_environment_tokens_are_inputs_only_and_per_token_values_land_on_generated_tokens():
    # completion [4, 5 | 6, 7 | 8]: 6 and 7 were appended by the environment (tool output)
    rollout = _rollout([1, 2], [4, 5, 6, 7, 8])
    rollout.loss_mask = [True, True, False, False, True]
    assert rollout.num_loss_tokens == 3
    micro = pack_micro_batch([rollout], pad_token_id=PAD, device=torch.device("cpu"), old_logprobs=[[-1.0, -2.0, -3.0]])
    assert micro.input_ids.tolist() == [[1, 2, 4, 5, 6, 7, 8]]
    assert micro.loss_mask.tolist() == [[False, True, True, False, False, True]]
    assert micro.input_ids[0, 1:][micro.loss_mask[0]].tolist() == [4, 5, 8]
    assert micro.engine_logprobs[0].tolist() == pytest.approx([0.0, -0.1, -0.2, 0.0, 0.0, -0.5])
    assert micro.old_logprobs is not None
    assert micro.old_logprobs[0].tolist() == [0.0, -1.0, -2.0, 0.0, 0.0, -3.0]
    with pytest.raises(ValueError, match="loss mask"):
        Rollout(
            example=_EXAMPLE, prompt_ids=[1], completion_ids=[4], completion_logprobs=[0.0], versions=[0], loss_mask=[]
        )
