"""The forward pass every trainer-side model shares: token ids in, per-token logprobs (and entropy) out.

Owns `score_tokens` (the decoder, then the LM head on the target positions only), `score_top_k` (the top-k
distillation variant's full-vocabulary logprobs of k ids per target), `autocast_to` (the run's bf16 or fp16
autocast) and `rows_image_inputs` (a vision-language model's pixel inputs for rows that hold images). The policy
backends (`single_device`, `fsdp2`), the critic and the frozen scorers (`frozen`, `teacher`) all build on it; it
imports none of them (an import-linter contract keeps it below them). It owns no model, no device placement and no
optimizer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from sharpen.data.vision import text_only_error
from sharpen.trainer.algorithms.sampling_mask import SamplingMask
from sharpen.trainer.backends.base import TokenScores
from sharpen.trainer.backends.chunked_logits import score_on_grid
from sharpen.trainer.backends.context_parallel import ContextParallel
from sharpen.trainer.backends.vocab_parallel import VocabShard
from sharpen.types import ImagePart

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from sharpen.data.vision import VisionProcessor


def score_tokens(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    target_mask: torch.Tensor,
    *,
    temperature: float,
    with_entropy: bool = False,
    entropy_requires_grad: bool = False,
    position_ids: torch.Tensor | None = None,
    logits_chunk_tokens: int = 0,
    image_inputs: dict[str, torch.Tensor] | None = None,
    vocab: VocabShard | None = None,
    context: ContextParallel | None = None,
    sampling_mask: SamplingMask | None = None,
) -> TokenScores:
    """Logprob (and optionally entropy) of each next token, computed only where ``target_mask`` is set.
    The entropy carries a gradient only when asked (an entropy bonus); as a metric it costs no backward memory.

    ``input_ids``/``attention_mask``: [batch, seq]; ``target_mask``: [batch, seq - 1], True where
    ``input_ids[:, t + 1]`` is a token to score. The LM head runs only on the selected positions (most of a
    rollout is prompt), which saves its 49k-wide matmul elsewhere, and on ``logits_chunk_tokens`` of them at a time
    (`chunked_logits`; 0: all at once).

    Packed rows (`packing.PackedRow`): ``attention_mask`` None and ``position_ids`` [batch, seq] restarting at 0 at
    each sequence. transformers then masks attention block-diagonally, per sequence, which it does only without an
    attention mask and without a cache; the cache is turned off here so that no model config can turn it on.

    ``image_inputs`` (`VisionProcessor.model_inputs` of the rows' images; right-padded rows only): a vision-language
    model's base model embeds the images at their placeholders and derives its 3-D positions itself.

    ``vocab``: a tensor-parallel model's LM head returns this rank's vocabulary slice (`tensor_parallel`), scored
    without gathering the vocabulary (`vocab_parallel`).

    ``context``: context parallelism (`context_parallel`): this rank runs the decoder and the LM head on its slice of
    the sequence, and the scores of every rank's slice are gathered (collective over its group).

    ``sampling_mask``: the engine's top-k / top-p (`chunked_logits`); None: the full distribution at ``temperature``.
    """
    if position_ids is not None and attention_mask is not None:
        raise ValueError("packed rows (position_ids) take no attention_mask: their sequences are found from positions")
    if image_inputs is not None:
        assert position_ids is None, "rows with images are right-padded, never packed"
        assert context is None, "context parallelism splits text rows only"
        hidden = model.base_model(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **image_inputs
        ).last_hidden_state
    elif context is not None:  # this rank's slice of the rows (right-padded rows: causal alone)
        ids, positions = context.split(input_ids, position_ids)
        hidden = model.get_decoder()(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
    else:
        hidden = model.get_decoder()(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
    return score_hidden(
        cast(nn.Module, model.get_output_embeddings()),  # a causal LM always has one
        hidden,
        input_ids,
        target_mask,
        temperature=temperature,
        with_entropy=with_entropy,
        entropy_requires_grad=entropy_requires_grad,
        logits_chunk_tokens=logits_chunk_tokens,
        vocab=vocab,
        context=context,
        sampling_mask=sampling_mask,
    )


def score_hidden(
    lm_head: nn.Module,
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    target_mask: torch.Tensor,
    *,
    temperature: float,
    with_entropy: bool,
    entropy_requires_grad: bool,
    logits_chunk_tokens: int,
    vocab: VocabShard | None,
    context: ContextParallel | None = None,
    sampling_mask: SamplingMask | None = None,
) -> TokenScores:
    """The LM head's half of `score_tokens`: the scores of ``target_mask``'s tokens from the decoder's output
    ``hidden`` (after its final norm) of the rows ``input_ids``. With ``context``, ``hidden`` is this rank's slice of
    the sequence (`ContextParallel.split` ran before the decoder) and the scores of every rank's slice are gathered
    into the whole ``[batch, seq - 1]`` grid (collective). A pipeline's last stage calls this on the hidden states it
    computed."""
    if context is None:
        return score_on_grid(
            lm_head,
            hidden[:, :-1][target_mask],  # [num_targets, hidden]
            input_ids[:, 1:][target_mask],  # [num_targets]
            target_mask,
            temperature=temperature,
            with_entropy=with_entropy,
            entropy_requires_grad=entropy_requires_grad,
            chunk_tokens=logits_chunk_tokens,
            vocab=vocab,
            sampling_mask=sampling_mask,
        )
    if isinstance(hidden, DTensor):  # sequence parallelism: the final norm's output is split over the tp ranks
        hidden = hidden.full_tensor()
    length = input_ids.shape[1]
    local = context.local
    assert local is not None, "ContextParallel.split must run before the decoder"
    extra = context.padded_length - (length - 1)  # position t predicts token t + 1: the grid has length - 1 positions
    next_ids = F.pad(input_ids[:, 1:], (0, extra), value=0)[:, local]
    grid = F.pad(target_mask, (0, extra), value=False)[:, local]
    scores = score_on_grid(
        lm_head,
        hidden[grid],
        next_ids[grid],
        grid,
        temperature=temperature,
        with_entropy=with_entropy,
        entropy_requires_grad=entropy_requires_grad,
        chunk_tokens=logits_chunk_tokens,
        vocab=vocab,
        sampling_mask=sampling_mask,
    )
    # copies, not views: FSDP2 hooks the backward through its root's outputs, which an in-place op on a view would skip
    logprobs = context.gather(scores.logprobs)[:, : length - 1].clone()
    entropy = None if scores.entropy is None else context.gather(scores.entropy)[:, : length - 1].clone()
    return TokenScores(logprobs=logprobs, entropy=entropy)


def score_top_k(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    target_mask: torch.Tensor,
    *,
    temperature: float,
    k: int = 0,
    candidate_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-vocabulary logprobs (of ``logits / temperature``) of k token ids at every target position, in target
    order (row by row, then by position): ``(ids, logprobs)``, each [num_targets, k]. The ids are the model's own k
    most likely tokens (``k``) or the given ``candidate_ids`` [num_targets, k]. Differentiable when grad is on.

    ``input_ids``/``attention_mask`` [batch, seq] right-padded; ``target_mask`` [batch, seq - 1] as in
    `score_tokens`. The LM head runs on the target positions only, all at once: its [num_targets,
    vocab] logits are kept for the backward (the top-k variant's memory cost)."""
    if (candidate_ids is None) == (k <= 0):
        raise ValueError("score_top_k needs either k > 0 or candidate_ids")
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    lm_head = cast(nn.Module, model.get_output_embeddings())
    logits = lm_head(hidden[:, :-1][target_mask]).float() / temperature  # [num_targets, vocab]
    logprobs = torch.log_softmax(logits, dim=-1)
    ids = logprobs.detach().topk(k, dim=-1).indices if candidate_ids is None else candidate_ids
    return ids, logprobs.gather(1, ids)


def autocast_to(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager[object]:
    """Autocast on ``device`` to ``dtype`` (bfloat16 or float16: `PrecisionChoice.autocast_dtype`), or nothing for
    None (master weights keep their dtype either way)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def rows_image_inputs(
    vision: VisionProcessor | None, input_ids: torch.Tensor, images: Sequence[tuple[ImagePart, ...]], *, model: str
) -> dict[str, torch.Tensor] | None:
    """The pixel inputs of the rows' images (``images``: one tuple per row) for a forward pass over ``input_ids``, or
    None when the rows hold none; images for a text-only model (``vision`` None) are the one text-only error."""
    flat = [image for row in images for image in row]
    if vision is None:
        if flat:
            raise text_only_error("trainer", len(flat), model)
        return None
    return vision.model_inputs(input_ids, flat) or None  # checks that text rows hold no placeholders
