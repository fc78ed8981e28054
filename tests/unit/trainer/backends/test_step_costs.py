"""What the train step does to go faster, each shown to keep its arithmetic: one float32 log-softmax for the targets'
logprobs and the entropy (against cross_entropy and the entropy of the logits, values and gradients, at temperature 1
and not), AdamW in torch's fused kernel (against the per-tensor loop), and freed memory kept in the process (no page
is faulted in again when a freed block of the same size is allocated; beyond the budget it goes back)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from sharpen.trainer.algorithms.kl import entropy_from_log_probs, entropy_from_logits
from sharpen.trainer.backends.chunked_logits import score_hidden
from sharpen.trainer.optim import build_adamw


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_requires_grad", [False, True])
def test_one_log_softmax_gives_cross_entropys_logprobs_and_the_entropy(temperature, entropy_requires_grad):
    generator = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(9, 16, generator=generator, requires_grad=True)
    targets = torch.randint(0, 50, (9,), generator=generator)
    logprobs, entropy = score_hidden(
        head,
        hidden,
        targets,
        temperature=temperature,
        with_entropy=True,
        entropy_requires_grad=entropy_requires_grad,
        chunk_tokens=0,
    )
    assert entropy is not None and logprobs.dtype == entropy.dtype == torch.float32
    logits = head(hidden) / temperature
    expected_logprobs = -torch.nn.functional.cross_entropy(logits, targets, reduction="none")
    expected_entropy = entropy_from_logits(logits if entropy_requires_grad else logits.detach())
    # the same float32 operations (log-softmax, gather) in both: equal up to a rounding or two of values ~4
    torch.testing.assert_close(logprobs, expected_logprobs, rtol=0, atol=4 * 2**-21)
    torch.testing.assert_close(entropy, expected_entropy, rtol=0, atol=4 * 2**-21)
    weights = torch.randn(9, generator=generator)
    loss = (logprobs * weights).sum() + (entropy.sum() if entropy_requires_grad else 0)
    expected = (expected_logprobs * weights).sum() + (expected_entropy.sum() if entropy_requires_grad else 0)
    got = torch.autograd.grad(loss, [hidden, head.weight])
    want = torch.autograd.grad(expected, [hidden, head.weight])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert entropy.requires_grad == entropy_requires_grad


def test_entropy_of_a_distribution_with_impossible_tokens_has_no_nan():
    logits = torch.tensor([[0.0, 1.0, float("-inf")], [2.0, float("-inf"), float("-inf")]], requires_grad=True)
    log_probs = torch.log_softmax(logits, dim=-1)
    entropy = entropy_from_log_probs(log_probs)
    p = torch.softmax(torch.tensor([0.0, 1.0]), dim=0)
    torch.testing.assert_close(entropy, torch.stack([-(p * p.log()).sum(), torch.tensor(0.0)]))
    entropy.sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    assert logits.grad[0, 2] == 0 and logits.grad[1].abs().max() == 0


def test_fused_adamw_takes_the_loops_steps():
    generator = torch.Generator().manual_seed(1)
    start = [torch.randn(shape, generator=generator) for shape in ((64, 32), (32,), (7, 3, 5))]
    fused = [torch.nn.Parameter(t.clone()) for t in start]
    loop = [torch.nn.Parameter(t.clone()) for t in start]
    fused_opt = build_adamw(fused, learning_rate=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    loop_opt = torch.optim.AdamW(loop, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, foreach=False)
    assert fused_opt.param_groups[0]["fused"]
    for _ in range(5):
        grads = [torch.randn(t.shape, generator=generator) for t in start]
        for params, opt in ((fused, fused_opt), (loop, loop_opt)):
            for param, grad in zip(params, grads, strict=True):
                param.grad = grad.clone()
            opt.step()
    for a, b in zip(fused, loop, strict=True):
        # the same float32 update in another operation order: a few roundings per step, on values of ~1
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        assert not torch.equal(a, torch.zeros_like(a))


_FAULTS = textwrap.dedent(
    """
    import resource, sys
    import torch
    from sharpen.trainer.backends.cpu_memory import FreedMemory

    if sys.argv[1] == "keep":
        assert FreedMemory.keep(budget_mb=64) is not None

    def faults_of_one_block():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = torch.empty(64 * 2**20, dtype=torch.uint8)  # 64 MiB: above glibc's largest mmap threshold
        block.fill_(1)  # touches every page
        del block
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    faults_of_one_block()  # the first one faults its pages in either way
    print(min(faults_of_one_block() for _ in range(3)))
    """
)

_BOUND = textwrap.dedent(
    """
    import torch
    from sharpen.trainer.backends.cpu_memory import WARM_UP_STEPS, FreedMemory, resident_bytes

    memory = FreedMemory.keep(budget_mb=64)
    for _ in range(WARM_UP_STEPS):
        assert not memory.bound()  # the warm-up steps measure the working set
    blocks = [torch.ones(32 * 2**20, dtype=torch.uint8) for _ in range(12)]  # 384 MiB from the heap, touched
    pin = torch.ones(1024, dtype=torch.uint8)  # a live block beside them
    del blocks  # freed into the heap, which keeps their pages (no munmap, no trim)
    grown = resident_bytes() - memory.working_set
    assert memory.bound() and memory.num_trims == 1
    print(grown, resident_bytes() - memory.working_set)
    """
)


def _run(script: str, *args: str) -> list[int]:
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return [int(word) for word in done.stdout.split()]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_memory_is_reused_without_faulting_pages_in_again():
    pages = 64 * 2**20 // 4096
    assert _run(_FAULTS, "default")[-1] > pages // 2  # each allocation a fresh mmap, zero-filled by the kernel
    assert _run(_FAULTS, "keep")[-1] < pages // 20  # the freed block is the next allocation's


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_kept_memory_beyond_the_budget_goes_back_after_a_step():
    grown, after = _run(_BOUND)
    assert grown > 300 * 2**20  # the heap kept the freed blocks' pages: far more than the 64 MiB budget
    assert after < 64 * 2**20  # the trim gave it back
