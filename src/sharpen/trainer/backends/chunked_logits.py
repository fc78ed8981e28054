"""Logprobs and entropy of target tokens from the decoder's hidden states, without all their logits at once.

The LM head turns ``[num_targets, hidden]`` into ``[num_targets, vocab]`` float32 logits: at 4k targets and a
49k vocabulary that is 0.8 GB per tensor, and the log-softmax, the entropy's temporaries and the logits' gradient
are as large again. `score_hidden` runs the head on ``chunk_tokens`` targets at a time. Under autograd each chunk
is a non-reentrant `torch.utils.checkpoint` region: the forward keeps only the chunk's inputs (hidden slice,
targets), and the backward recomputes that chunk's logits when its gradient is needed and frees them before the
next chunk's, so peak memory is one chunk's ``[chunk_tokens, vocab]`` tensors in both passes. The price is one
more LM-head matmul per chunk in the backward; a batch with at most ``chunk_tokens`` targets runs as one plain
chunk (no recomputation), and so does everything under ``torch.no_grad()``, chunked but never recomputed.

With a ``sampling_mask`` (the engine's ``rollout.top_k`` / ``rollout.top_p``) each chunk's tempered logits are
truncated before the log-softmax (`algorithms.sampling_mask.truncate_logits`), so the logprobs and the entropy are
those of the distribution the engine sampled from; vocabulary-sharded logits take none (the build refuses it).

This module owns only that reduction; it does not run the decoder or place the values on the token grid
(`scoring.score_tokens` does).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from sharpen.trainer.algorithms.kl import entropy_from_log_probs
from sharpen.trainer.algorithms.sampling_mask import SamplingMask, truncate_logits
from sharpen.trainer.backends.base import TokenScores
from sharpen.trainer.backends.vocab_parallel import VocabShard, vocab_parallel_scores


def score_hidden(
    lm_head: nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float,
    with_entropy: bool,
    entropy_requires_grad: bool,
    chunk_tokens: int,
    vocab: VocabShard | None = None,
    sampling_mask: SamplingMask | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of each target under ``lm_head(hidden) / temperature`` and, with ``with_entropy``, the entropy of
    that distribution: ``hidden`` [num_targets, hidden], ``targets`` [num_targets] -> ([num_targets] float32,
    [num_targets] float32 or None). The entropy carries a gradient only with ``entropy_requires_grad``.
    ``chunk_tokens``: targets per LM-head call (0: all at once). ``vocab``: with tensor parallelism, the slice of
    the vocabulary ``lm_head`` returns on this rank (`vocab_parallel`; collective over its group, every rank of
    which passes the same ``hidden`` and ``targets``). ``sampling_mask``: the engine's top-k / top-p, applied to
    the tempered logits (a target outside the kept set scores ``-inf``); None: the full distribution."""
    if chunk_tokens < 0:
        raise ValueError(f"chunk_tokens must be >= 0 (0: no chunking), got {chunk_tokens}")
    num_targets = hidden.shape[0]
    if chunk_tokens == 0 or num_targets <= chunk_tokens:
        return _score_chunk(
            lm_head, hidden, targets, temperature, with_entropy, entropy_requires_grad, vocab, sampling_mask
        )
    needs_backward = torch.is_grad_enabled() and (
        hidden.requires_grad or any(p.requires_grad for p in lm_head.parameters())
    )
    logprobs, entropies = [], []
    for start in range(0, num_targets, chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        args = (
            lm_head,
            hidden[rows],
            targets[rows],
            temperature,
            with_entropy,
            entropy_requires_grad,
            vocab,
            sampling_mask,
        )
        if needs_backward:
            chunk_logprobs, chunk_entropy = checkpoint(_score_chunk, *args, use_reentrant=False)
        else:
            chunk_logprobs, chunk_entropy = _score_chunk(*args)
        logprobs.append(chunk_logprobs)
        if chunk_entropy is not None:
            entropies.append(chunk_entropy)
    return torch.cat(logprobs), torch.cat(entropies) if with_entropy else None


def score_on_grid(
    lm_head: nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    target_mask: torch.Tensor,
    *,
    temperature: float,
    with_entropy: bool,
    entropy_requires_grad: bool,
    chunk_tokens: int,
    vocab: VocabShard | None = None,
    sampling_mask: SamplingMask | None = None,
) -> TokenScores:
    """`score_hidden` of the targets ``target_mask`` selects, placed on its ``[batch, seq - 1]`` grid (0 elsewhere):
    ``hidden`` [num_targets, hidden] and ``targets`` [num_targets] in the row-major order of ``target_mask``'s true
    entries. The one place both scoring passes (`scoring.score_tokens`, `prefix.score_shared_prompts`) put values
    back on the token grid."""
    target_logprobs, target_entropy = score_hidden(
        lm_head,
        hidden,
        targets,
        temperature=temperature,
        with_entropy=with_entropy,
        entropy_requires_grad=entropy_requires_grad,
        chunk_tokens=chunk_tokens,
        vocab=vocab,
        sampling_mask=sampling_mask,
    )
    logprobs = torch.zeros(target_mask.shape, dtype=torch.float32, device=hidden.device)
    logprobs[target_mask] = target_logprobs
    entropy = None
    if target_entropy is not None:
        entropy = torch.zeros(target_mask.shape, dtype=torch.float32, device=hidden.device)
        entropy[target_mask] = target_entropy
    return TokenScores(logprobs=logprobs, entropy=entropy)


def _score_chunk(
    lm_head: nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    entropy_requires_grad: bool,
    vocab: VocabShard | None = None,
    sampling_mask: SamplingMask | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    logits = lm_head(hidden)  # [chunk, vocab] (or this rank's [chunk, vocab / tp]), bfloat16 under autocast
    if temperature != 1.0:  # dividing by 1 would only cost a pass over the logits (and a copy of them)
        logits = logits.float() / temperature
    if sampling_mask is not None and not sampling_mask.is_off:
        assert vocab is None, "a sampling mask needs the whole vocabulary (tensor parallelism refuses it at build)"
        logits = truncate_logits(logits, sampling_mask.top_k, sampling_mask.top_p)  # [chunk, vocab], -inf outside
    if vocab is not None:
        return vocab_parallel_scores(
            logits,  # the tensor-parallel head's output: this rank's local slice
            targets,
            vocab_start=vocab.start,
            group=vocab.group,
            with_entropy=with_entropy,
            entropy_requires_grad=entropy_requires_grad,
        )
    # One float32 log-softmax (a bfloat16 input is cast inside, no float32 copy of the logits is kept) serves the
    # targets' logprobs and the entropy: the same values and gradient as cross_entropy (its log-softmax and gather).
    log_probs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)  # [chunk, vocab]
    logprobs = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [chunk]
    if not with_entropy:
        return logprobs, None
    return logprobs, entropy_from_log_probs(log_probs if entropy_requires_grad else log_probs.detach())
