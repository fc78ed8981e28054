"""Chunked logprobs and entropy (`trainer.logits_chunk_tokens`): the same values and parameter gradients as the
unchunked computation on a tiny random Llama, for chunk sizes that divide the targets, that do not, of one token
and larger than all; and peak memory that follows the chunk, not the targets, in the forward and the backward
(the unchunked path, run the same way, is shown to exceed the bound)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sharpen.config.schema import TrainerConfig
from sharpen.trainer import SingleDeviceBackend
from sharpen.trainer.backends.chunked_logits import score_hidden
from sharpen.trainer.backends.scoring import score_tokens

VOCAB, HIDDEN, NUM_LAYERS = 128, 32, 2  # the tiny model of conftest.model_dir
FLOAT32_UNIT_ROUNDOFF = 2.0**-24


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three rows, right-padded, 23 targets in all (a prime: no chunk size but 1 and 23 divides it)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [12, 12, 8]
    input_ids = torch.zeros((3, 12), dtype=torch.long)
    attention_mask = torch.zeros((3, 12), dtype=torch.long)
    target_mask = torch.zeros((3, 11), dtype=torch.bool)
    for row, length in enumerate(lengths):
        input_ids[row, :length] = torch.randint(1, VOCAB, (length,), generator=generator)
        attention_mask[row, :length] = 1
        target_mask[row, 2 : length - 1] = True  # prompts of 3 tokens
    assert int(target_mask.sum()) == 23
    return input_ids, attention_mask, target_mask


def _scores_and_gradients(
    backend: SingleDeviceBackend, chunk_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Logprobs, entropy (with gradient) and the parameter gradients of a loss that weighs both per token."""
    input_ids, attention_mask, target_mask = _batch()
    backend.model.zero_grad(set_to_none=True)
    scores = score_tokens(
        backend.model,
        input_ids,
        attention_mask,
        target_mask,
        temperature=0.7,
        with_entropy=True,
        entropy_requires_grad=True,
        logits_chunk_tokens=chunk_tokens,
    )
    assert scores.entropy is not None
    weights = torch.randn(target_mask.shape, generator=torch.Generator().manual_seed(1))  # [batch, seq - 1]
    (scores.logprobs * weights).sum().add(0.1 * scores.entropy.sum()).backward()
    gradients = {name: p.grad.detach().clone() for name, p in backend.model.named_parameters() if p.grad is not None}
    return scores.logprobs.detach(), scores.entropy.detach(), gradients


def _tolerance(reference: torch.Tensor, *, num_targets: int) -> float:
    """Chunked and unchunked runs do the same arithmetic per target; only the order of float32 sums can differ: the
    LM head's matmul may block a different number of rows differently (dot products over HIDDEN terms), the logits'
    reductions run over VOCAB terms, and the LM head's (tied embedding's) gradient sums num_targets per-target terms
    chunk by chunk. A sum of n terms in another order is off by at most about n u times the magnitude of its terms
    (u = 2^-24), and the backward chains one such reduction per layer on top; ``reference``'s largest magnitude
    stands for the terms', and a factor of 4 covers the chaining. Here that is ~2e-5 of the largest value, while a
    lost, doubled or misplaced chunk moves values by their own size."""
    num_terms = num_targets + VOCAB + HIDDEN
    return 4 * (NUM_LAYERS + 1) * num_terms * FLOAT32_UNIT_ROUNDOFF * float(reference.abs().max())


@pytest.fixture(scope="module")
def backend(model_dir: Path) -> SingleDeviceBackend:
    return SingleDeviceBackend(TrainerConfig(device="cpu", precision="float32"), model_path=model_dir, dtype="float32")


@pytest.fixture(scope="module")
def unchunked(backend: SingleDeviceBackend) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    return _scores_and_gradients(backend, chunk_tokens=0)


@pytest.mark.parametrize("chunk_tokens", [1, 5, 7, 22, 23, 64])
def test_chunked_scores_and_gradients_equal_the_unchunked_ones(backend, unchunked, chunk_tokens):
    logprobs, entropy, gradients = _scores_and_gradients(backend, chunk_tokens)
    expected_logprobs, expected_entropy, expected_gradients = unchunked
    _, _, target_mask = _batch()
    num_targets = int(target_mask.sum())
    assert (logprobs[~target_mask] == 0).all() and (entropy[~target_mask] == 0).all()
    torch.testing.assert_close(
        logprobs, expected_logprobs, rtol=0, atol=_tolerance(expected_logprobs, num_targets=num_targets)
    )
    torch.testing.assert_close(entropy, expected_entropy, rtol=0, atol=_tolerance(expected_entropy, num_targets=23))
    assert gradients.keys() == expected_gradients.keys() and len(gradients) > 5
    for name, expected in expected_gradients.items():
        assert expected.abs().max() > 0, name  # every parameter gets a real gradient
        tolerance = _tolerance(expected, num_targets=num_targets)
        torch.testing.assert_close(gradients[name], expected, rtol=0, atol=tolerance, msg=name)


def test_entropy_without_gradient_and_no_grad_scoring_match_too(backend, unchunked):
    """The entropy as a metric (no gradient) and a no-grad pass (old logprobs) take the chunked path without
    recomputation; they give the same values."""
    input_ids, attention_mask, target_mask = _batch()
    expected_logprobs, expected_entropy, _ = unchunked
    with torch.no_grad():
        scores = score_tokens(
            backend.model,
            input_ids,
            attention_mask,
            target_mask,
            temperature=0.7,
            with_entropy=True,
            logits_chunk_tokens=4,
        )
    assert scores.entropy is not None
    torch.testing.assert_close(
        scores.logprobs, expected_logprobs, rtol=0, atol=_tolerance(expected_logprobs, num_targets=23)
    )
    torch.testing.assert_close(
        scores.entropy, expected_entropy, rtol=0, atol=_tolerance(expected_entropy, num_targets=23)
    )
    hidden = torch.randn(9, HIDDEN, requires_grad=True)
    _, entropy = score_hidden(
        backend.model.lm_head,
        hidden,
        torch.zeros(9, dtype=torch.long),
        temperature=1.0,
        with_entropy=True,
        entropy_requires_grad=False,
        chunk_tokens=4,
    )
    assert entropy is not None and not entropy.requires_grad


def test_a_negative_chunk_size_is_refused(backend):
    with pytest.raises(ValueError, match="chunk_tokens must be >= 0"):
        score_hidden(
            backend.model.lm_head,
            torch.zeros(2, HIDDEN),
            torch.zeros(2, dtype=torch.long),
            temperature=1.0,
            with_entropy=False,
            entropy_requires_grad=False,
            chunk_tokens=-1,
        )
    with pytest.raises(ValueError):
        TrainerConfig(logits_chunk_tokens=-1)


# --- peak memory: a subprocess per run, its peak resident set (VmHWM) against its resident set before the pass ---

MEMORY_TARGETS, MEMORY_VOCAB, MEMORY_CHUNK = 2048, 16384, 128
_TENSOR_MIB = MEMORY_TARGETS * MEMORY_VOCAB * 4 / 2**20  # one [targets, vocab] float32 tensor: 128 MiB

_MEMORY_SCRIPT = """
import json, resource, sys
import torch
from sharpen.trainer.backends.chunked_logits import score_hidden
targets, vocab, chunk = (int(a) for a in sys.argv[1:4])
torch.set_num_threads(1)
torch.manual_seed(0)
lm_head = torch.nn.Linear(16, vocab, bias=False)
hidden = torch.randn(targets, 16, requires_grad=True)
ids = torch.randint(0, vocab, (targets,))
def rss_mib():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / 2**20
def run(num, chunk):
    return score_hidden(
        lm_head, hidden[:num], ids[:num], temperature=1.0, with_entropy=True, entropy_requires_grad=True,
        chunk_tokens=chunk,
    )
for warm_chunk in (0, 2):  # the kernels' code pages and the allocator's first arenas, on 5 targets
    sum(part.sum() for part in run(5, warm_chunk)).backward()
hidden.grad = lm_head.weight.grad = None
before = rss_mib()
logprobs, entropy = score_hidden(
    lm_head, hidden, ids, temperature=1.0, with_entropy=True, entropy_requires_grad=True, chunk_tokens=chunk
)
after_forward = rss_mib()
(logprobs.sum() + entropy.sum()).backward()
with open("/proc/self/status") as status:  # VmHWM: this process's peak; ru_maxrss starts at its parent's size
    peak = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024
print(json.dumps({"peak": peak - before, "kept_by_forward": after_forward - before}))
"""


def _memory_of(chunk_tokens: int) -> dict[str, float]:
    # A fixed mmap threshold: glibc's default raises it to the size of the last freed block, after which the
    # chunks' mid-sized temporaries come from the heap, whose free holes stay resident; the high-water mark then
    # grows with the number of chunks although no tensor outlives its chunk (seen: 0.66 GB at 1k targets, 0.93 GB
    # at 4k, chunk 256, 49k vocab; 0.47 GB for both with the fixed threshold). Blocks above 1 MiB are mmapped and
    # returned on free, so the resident set is the live tensors.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", _MEMORY_SCRIPT, str(MEMORY_TARGETS), str(MEMORY_VOCAB), str(chunk_tokens)]
    output = subprocess.run(command, env=env, check=True, capture_output=True, text=True, timeout=120).stdout
    return json.loads(output.strip().splitlines()[-1])


# (name, chunk size, whether the pass must stay under the bound): the unchunked pass is the naive path
_MEMORY_CASES = [("chunked", MEMORY_CHUNK, True), ("unchunked", 0, False)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self (Linux)")
@pytest.mark.parametrize(("name", "chunk_tokens", "is_bounded"), _MEMORY_CASES, ids=[c[0] for c in _MEMORY_CASES])
def test_peak_memory_follows_the_chunk_not_the_targets(name, chunk_tokens, is_bounded):
    """A chunk's tensors are [128, vocab] float32, 8 MiB each: logits, log-softmax, the entropy's terms and their
    gradients, ~6 alive at once (measured: a 51 MiB peak), so the bound is 10 of them (80 MiB), and after the
    forward less than one may remain. The unchunked pass holds several full [targets, vocab] tensors (128 MiB
    each; measured: 800 MiB, 544 MiB still held after the forward), far over the bound; so would a chunked pass
    that kept its chunks' logits for the backward (at least one full tensor after the forward)."""
    memory = _memory_of(chunk_tokens)
    chunk_tensor_mib = MEMORY_CHUNK * MEMORY_VOCAB * 4 / 2**20
    if is_bounded:
        assert memory["peak"] < 10 * chunk_tensor_mib, memory
        assert memory["kept_by_forward"] < chunk_tensor_mib, memory
    else:
        assert memory["peak"] > 3 * _TENSOR_MIB, memory
        assert memory["kept_by_forward"] > _TENSOR_MIB, memory
