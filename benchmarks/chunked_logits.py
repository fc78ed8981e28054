"""Peak memory and time of the LM-head logprobs + entropy, forward and backward, with and without chunking.

Run: .venv/bin/python benchmarks/chunked_logits.py [--targets 4096] [--vocab 49152] [--hidden 576]
     [--chunks 0,2048,1024,512,256] [--repeats 2]
The shape of SmolLM2-135M's head (hidden 576, vocab 49,152, tied) on ``--targets`` target positions: one pass is
`score_hidden` (logprobs and an entropy with gradient, the trainer's entropy bonus) and a backward through it.
Each chunk size runs in a fresh subprocess, and its peak is that process's peak resident set (``VmHWM``) minus its
resident set just before the first pass, after a warm-up on 5 targets (torch's CPU allocator has no statistics
and tracemalloc does not see it), so the figures are the pass's own memory. glibc's mmap threshold is fixed at
1 MiB there (``MALLOC_MMAP_THRESHOLD_``): by default it rises to the last freed block's size and the chunks'
mid-sized temporaries then leave resident heap holes, so the peak grows with the number of chunks although no
tensor outlives its chunk (``--plain-malloc`` shows that). Prints one line per chunk size with the
ratios to the unchunked pass (chunk 0), all measured in this run (the machine is shared and noisy).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time


def _rss_kib() -> int:
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * resource.getpagesize() // 1024


def _peak_kib() -> int:
    """This process's peak resident set; ``ru_maxrss`` would start at the forking parent's size."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))


def _child(args: argparse.Namespace) -> None:
    import torch

    from sharpen.trainer.backends.chunked_logits import score_hidden

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    lm_head = torch.nn.Linear(args.hidden, args.vocab, bias=False)
    hidden = torch.randn(args.targets, args.hidden, requires_grad=True)
    targets = torch.randint(0, args.vocab, (args.targets,))
    weights = torch.randn(args.targets)

    def run(num_targets: int, chunk: int) -> None:
        logprobs, entropy = score_hidden(
            lm_head,
            hidden[:num_targets],
            targets[:num_targets],
            temperature=1.0,
            with_entropy=True,
            entropy_requires_grad=True,
            chunk_tokens=chunk,
        )
        assert entropy is not None
        ((logprobs * weights[:num_targets]).sum() + 0.01 * entropy.sum()).backward()

    for warm_chunk in (0, 2):  # the kernels' code pages and the allocator's first arenas
        run(5, warm_chunk)
    lm_head.weight.grad = hidden.grad = None
    before = _rss_kib()
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        run(args.targets, args.chunk)
        times.append(time.perf_counter() - start)
        lm_head.weight.grad = hidden.grad = None
    peak = _peak_kib()
    print(json.dumps({"peak_mib": (peak - before) / 1024, "seconds": statistics.median(times)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--targets", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--chunks", default="0,2048,1024,512,256")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--plain-malloc", action="store_true", help="leave glibc's mmap threshold dynamic")
    parser.add_argument("--chunk", type=int, help=argparse.SUPPRESS)  # the child's one chunk size
    args = parser.parse_args()
    if args.chunk is not None:
        _child(args)
        return
    shape = f"--targets {args.targets} --vocab {args.vocab} --hidden {args.hidden}"
    print(f"{args.targets} targets x {args.vocab} vocab, hidden {args.hidden}; logprobs + entropy, fwd + bwd")
    print(f"one [targets, vocab] float32 tensor: {args.targets * args.vocab * 4 / 2**20:.0f} MiB")
    results = {}
    for chunk in [int(c) for c in args.chunks.split(",")]:
        command = [sys.executable, __file__, *shape.split(), f"--repeats={args.repeats}", f"--chunk={chunk}"]
        command.append(f"--threads={args.threads}")
        env = dict(os.environ) if args.plain_malloc else {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)}
        output = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
        results[chunk] = json.loads(output.strip().splitlines()[-1])
        base = results.get(0)
        ratios = ""
        if base is not None:
            ratios = (
                f"  peak x{results[chunk]['peak_mib'] / base['peak_mib']:.3f}"
                f"  time x{results[chunk]['seconds'] / base['seconds']:.2f}"
            )
        label = "off" if chunk == 0 else str(chunk)
        peak, seconds = results[chunk]["peak_mib"], results[chunk]["seconds"]
        print(f"chunk {label:>5}: peak {peak:8.0f} MiB  {seconds:6.2f} s{ratios}")


if __name__ == "__main__":
    main()
