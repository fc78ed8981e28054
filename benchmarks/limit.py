"""The train phase against the hardware limit: FLOPs of one `Trainer.step` over the demo's step shape, divided by
its time and by this machine's measured matmul peak, per precision.

- **The limit**: the best matmul rate in each precision's compute dtype (float32; bfloat16 for bf16 autocast), on
  the trainer's device at the trainer's torch thread count: square matmuls (``--matmul-sizes``) and one at the
  model's own MLP shape ([micro-batch tokens, hidden] x [hidden, intermediate], also printed on its own), measured
  in every round beside the train steps; the peak is the best rate seen in the run. bf16 is measured where the
  device runs it natively (a CPU with AVX512-BF16 or AMX, a CUDA device with bf16); elsewhere it is emulated and
  slower than float32.
- **The work**: 6 x params x tokens (forward 2, backward 4 FLOPs per parameter and token) over real tokens only,
  never padding. The decoder's linear weights (attention and MLP projections) run on every real token; the LM head
  (tied to the embedding in SmolLM2) runs only on completion tokens, because `score_tokens` applies it only to the
  positions it scores, so it is counted on those. Not counted: the embedding lookup (a gather), norms, attention
  scores (QK^T and AV: 1-2% more at these ~80-token sequences) and the optimizer (elementwise AdamW; its
  time is in the step and shown on its own). Tokens are counted two ways: per sequence (each sample's prompt and
  completion, what a trainer computes without prefix sharing) and unique (each group's shared prompt once: the
  least work any train phase must do).
- **The batch**: the recipe's prompts (reasoning-gym addition with its system prompt, rendered by the real
  tokenizer's chat template) x samples per prompt; completions are real text tokens of seeded lengths (half cut at
  max_new_tokens, half ending earlier with the end-of-turn token, like the demo's early steps: mean ~24 of 32),
  behaviour logprobs from one no-grad pass of the policy, GRPO advantages +-1 (half of each group right). No
  engine runs. The trainer is the recipe's, built by `build_trainer` (micro-batches, loss, off-policy correction,
  AdamW, prompt sharing and packing as the recipe sets them) with ``trainer.precision`` set per row
  (float32 master weights and optimizer in both).

Prints the numbers; the issue's goal is >= 50% of the limit. Smoke run:
``--steps 1 --set rollout.prompts_per_step=2 --set trainer.micro_batch_size=4``.

    .venv/bin/python benchmarks/limit.py [--steps 5] [--precisions float32,bf16] [--recipe recipes/demo.toml]
        [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

AUTOCAST_DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16}
# A rambling answer: the demo's model talks around the sum before (or instead of) giving it.
RAMBLE = (
    "To add these two numbers, I start from the first one and count up by the second one, a step at a time, "
    "and the number I reach at the end is the sum. Writing each step down helps to keep track of the count. "
)


@dataclass(kw_only=True, slots=True)
class TrainWork:
    """Token counts of a batch and its train-step FLOPs (6 x params x tokens)."""

    num_real_tokens: int  # every sequence's prompt + completion, no padding
    num_unique_tokens: int  # each group's prompt once + every completion
    num_completion_tokens: int
    num_padded_tokens: int  # right-padded micro-batches of micro_batch_size, sorted by length (no packing, no sharing)
    num_decoder_params: int  # linear weights of the decoder layers
    num_head_params: int

    def flops(self, num_tokens: int) -> float:
        return 6.0 * (self.num_decoder_params * num_tokens + self.num_head_params * self.num_completion_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per precision (after one warm-up)")
    parser.add_argument("--precisions", help="comma-separated float32,bf16 (default: float32, and bf16 if native)")
    parser.add_argument("--matmul-sizes", default="1024,2048,4096")
    parser.add_argument("--recipe", type=Path, default=Path("recipes/demo.toml"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe override")
    args = parser.parse_args()
    from sharpen.config.models import resolve_model_path
    from sharpen.orchestration.build import build_trainer, load_tokenizer, run_precision
    from sharpen.trainer.backends.single_device import resolve_device

    config = load_recipe(args.recipe, args.set)
    device = resolve_device(config.trainer.device)
    precisions = args.precisions.split(",") if args.precisions else ["float32", *(["bf16"] * has_native_bf16(device))]
    if unknown := set(precisions) - set(AUTOCAST_DTYPES):
        parser.error(f"unknown precisions {sorted(unknown)}; choose from float32, bf16")
    sizes = [int(size) for size in args.matmul_sizes.split(",")]
    try:
        model_path = resolve_model_path(config.model.path)
    except ValueError as exc:  # not pulled yet: `sharpen models pull NAME`
        raise SystemExit(f"benchmarks/limit.py: {exc}") from None
    tokenizer = load_tokenizer(model_path)
    trainers = {  # float32 master weights and optimizer in every row; the precision is the passes' arithmetic
        p: build_trainer(load_recipe(args.recipe, [*args.set, f'trainer.precision="{p}"']), model_path=model_path,
                         tokenizer=tokenizer)
        for p in precisions
    }  # fmt: skip
    for precision, trainer in trainers.items():  # the backend's own record of what it runs
        assert trainer.backend.precision.precision == precision  # pyright: ignore[reportAttributeAccessIssue]
    first = trainers[precisions[0]]
    rollouts = with_behaviour_logprobs(first, demo_rollouts(config, tokenizer))
    model = first.backend.model  # pyright: ignore[reportAttributeAccessIssue]
    work = count_work(model, rollouts, micro_batch_size=config.trainer.micro_batch_size)
    num_micro_batches = -(-len(rollouts) // config.trainer.micro_batch_size)
    tokens_per_micro_batch = work.num_padded_tokens // num_micro_batches
    mlp_shape = (tokens_per_micro_batch, model.config.hidden_size, model.config.intermediate_size)
    describe(config, device, work, rollouts, model)
    in_use = run_precision(config)
    print(f"the recipe's trainer.precision = {config.trainer.precision!r} runs {in_use.precision} here")

    peaks, mlp_rates, step_seconds, optimizer_seconds = time_rounds(
        trainers, rollouts, num_steps=args.steps, sizes=sizes, mlp_shape=mlp_shape, device=device
    )
    report(work, precisions, peaks, mlp_rates, step_seconds, optimizer_seconds, mlp_shape)


def time_rounds(
    trainers: dict[str, Any],
    rollouts: list[Any],
    *,
    num_steps: int,
    sizes: list[int],
    mlp_shape: tuple[int, int, int],
    device: torch.device,
) -> tuple[dict[str, list[float]], ...]:
    """After one warm-up step each, ``num_steps`` rounds of (matmul peak, MLP-shaped matmul, train step) per
    precision, interleaved so that the precisions and their peaks see the same load. Returns the peaks, MLP rates
    (GFLOP/s), step seconds and optimizer seconds, each by precision."""
    from sharpen.types import TrainBatch

    batch = TrainBatch(rollouts=rollouts, step=0)
    optimizer_seconds: dict[str, list[float]] = {p: [] for p in trainers}
    for precision, trainer in trainers.items():
        time_optimizer(trainer, optimizer_seconds[precision], device)
        trainer.step(batch)  # warm-up: AdamW's state, allocator
        optimizer_seconds[precision].clear()
    peaks: dict[str, list[float]] = {p: [] for p in trainers}
    mlp_rates: dict[str, list[float]] = {p: [] for p in trainers}
    step_seconds: dict[str, list[float]] = {p: [] for p in trainers}
    for _ in range(num_steps):  # interleaved: the precisions and the peak see the same load
        for precision, trainer in trainers.items():
            dtype = AUTOCAST_DTYPES[precision]
            peaks[precision].append(max(matmul_rate((n, n, n), dtype, device) for n in sizes))
            mlp_rates[precision].append(matmul_rate(mlp_shape, dtype, device))
            synchronize(device)
            started = time.perf_counter()
            trainer.step(batch)
            synchronize(device)
            step_seconds[precision].append(time.perf_counter() - started)
            print(
                f"  {precision:<8} step {step_seconds[precision][-1]:7.2f} s, matmul peak {peaks[precision][-1]:7.1f}"
            )
    return peaks, mlp_rates, step_seconds, optimizer_seconds


def load_recipe(recipe: Path, overrides: list[str]) -> Any:
    """The recipe with ``overrides``, float32 master weights; bad input stops with one line."""
    from sharpen.config.loader import ConfigError, load_config

    try:
        return load_config(recipe, [*overrides, 'model.dtype="float32"'])
    except (ConfigError, FileNotFoundError) as exc:
        raise SystemExit(f"benchmarks/limit.py: {exc}") from None


def has_native_bf16(device: torch.device) -> bool:
    """Whether ``device`` runs bfloat16 matmuls in hardware: CUDA's bf16 support, or a CPU's AVX512-BF16 / AMX flags
    (Linux /proc/cpuinfo; other systems: no)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    flags = cpu_info("flags").split()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_info(field: str) -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        return ""
    for line in cpuinfo.read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == field:
            return value.strip()
    return ""


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_rate(shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device) -> float:
    """Best GFLOP/s of an [m, k] x [k, n] matmul over repeats of about half a second (after one warm-up)."""
    m, k, n = shape
    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    torch.matmul(a, b)
    best, spent = 0.0, 0.0
    for _ in range(20):
        synchronize(device)
        started = time.perf_counter()
        torch.matmul(a, b)
        synchronize(device)
        seconds = time.perf_counter() - started
        best, spent = max(best, 2.0 * m * k * n / seconds / 1e9), spent + seconds
        if spent > 0.5:
            break
    return best


def demo_rollouts(config: Any, tokenizer: Any) -> list[Any]:
    """prompts_per_step x num_samples_per_prompt rollouts on the recipe's first prompts (see the module doc)."""
    from sharpen.data import render_prompt
    from sharpen.orchestration.build import load_run_examples
    from sharpen.types import Rollout

    rollout = config.rollout
    examples = load_run_examples(config)[: rollout.prompts_per_step]
    text_ids = tokenizer.encode(RAMBLE * 4, add_special_tokens=False)
    if len(text_ids) < rollout.max_new_tokens:
        raise SystemExit(f"benchmarks/limit.py: max_new_tokens {rollout.max_new_tokens} exceeds the filler text")
    rng = random.Random(config.run.seed)
    rollouts = []
    for example in examples:
        prompt_ids = render_prompt(tokenizer, list(example.prompt))
        for sample in range(rollout.num_samples_per_prompt):
            is_truncated = rng.random() < 0.5
            if is_truncated:
                completion = text_ids[: rollout.max_new_tokens]
            else:
                completion = [*text_ids[: rng.randint(1, rollout.max_new_tokens - 1)], tokenizer.eos_token_id]
            rollouts.append(
                Rollout(
                    example=example,
                    prompt_ids=prompt_ids,
                    completion_ids=completion,
                    completion_logprobs=[0.0] * len(completion),  # replaced by `with_behaviour_logprobs`
                    versions=[0] * len(completion),
                    is_truncated=is_truncated,
                    sample_index=sample,
                    advantage=1.0 if sample % 2 == 0 else -1.0,
                )
            )
    return rollouts


@torch.no_grad()
def with_behaviour_logprobs(trainer: Any, rollouts: list[Any]) -> list[Any]:
    """The rollouts with the policy's own logprobs as the engine's (a fresh policy's, as after a weight sync)."""
    from sharpen.trainer.packing import pack_micro_batch

    micro = pack_micro_batch(rollouts, pad_token_id=trainer.pad_token_id, device=trainer.backend.device)
    logprobs = trainer.backend.token_logprobs(
        micro.input_ids, micro.attention_mask, micro.loss_mask, temperature=trainer.temperature
    )
    return [
        replace(rollout, completion_logprobs=logprobs[row][micro.loss_mask[row]].tolist())
        for row, rollout in enumerate(rollouts)
    ]


def count_work(model: nn.Module, rollouts: list[Any], *, micro_batch_size: int) -> TrainWork:
    decoder = model.get_decoder()  # pyright: ignore[reportCallIssue]
    head = model.get_output_embeddings()  # pyright: ignore[reportCallIssue]
    prompts = {r.example.task_key: len(r.prompt_ids) for r in rollouts}
    lengths = sorted(r.num_tokens for r in rollouts)
    chunks = [lengths[i : i + micro_batch_size] for i in range(0, len(lengths), micro_batch_size)]
    num_completion = sum(len(r.completion_ids) for r in rollouts)
    return TrainWork(
        num_real_tokens=sum(lengths),
        num_unique_tokens=sum(prompts.values()) + num_completion,
        num_completion_tokens=num_completion,
        num_padded_tokens=sum(len(chunk) * max(chunk) for chunk in chunks),
        num_decoder_params=sum(m.weight.numel() for m in decoder.modules() if isinstance(m, nn.Linear)),
        num_head_params=head.weight.numel(),
    )


def describe(config: Any, device: torch.device, work: TrainWork, rollouts: list[Any], model: nn.Module) -> None:
    name = cpu_info("model name") if device.type == "cpu" else torch.cuda.get_device_name(device)
    print(
        f"device {device.type} ({name}), torch threads {torch.get_num_threads()}, native bf16 {has_native_bf16(device)}"
    )
    num_prompt = work.num_real_tokens - work.num_completion_tokens
    print(
        f"batch: {config.rollout.prompts_per_step} prompts x {config.rollout.num_samples_per_prompt} samples, "
        f"{work.num_real_tokens} real tokens ({num_prompt} prompt, {work.num_completion_tokens} completion; mean "
        f"completion {work.num_completion_tokens / len(rollouts):.1f}), {work.num_unique_tokens} unique (prompt once "
        f"per group); right-padded micro-batches of {config.trainer.micro_batch_size}: {work.num_padded_tokens} "
        f"({1 - work.num_real_tokens / work.num_padded_tokens:.0%} padding, not counted)"
    )
    total = sum(p.numel() for p in model.parameters())
    print(
        f"params {total / 1e6:.1f}M: decoder linear {work.num_decoder_params / 1e6:.1f}M on every real token, LM head "
        f"{work.num_head_params / 1e6:.1f}M on completion tokens only (as score_tokens runs it)"
    )
    print(
        f"FLOPs per train step (6 x params x tokens): {work.flops(work.num_real_tokens) / 1e12:.3f} T per sequence, "
        f"{work.flops(work.num_unique_tokens) / 1e12:.3f} T unique"
    )


def time_optimizer(trainer: Any, seconds: list[float], device: torch.device) -> None:
    """Record the seconds of every optimizer call (clip and AdamW step) of ``trainer`` into ``seconds``."""
    backend = trainer.backend
    clip_and_step = backend.clip_and_step

    def timed() -> float:
        synchronize(device)
        started = time.perf_counter()
        norm = clip_and_step()
        synchronize(device)
        seconds.append(time.perf_counter() - started)
        return norm

    backend.clip_and_step = timed


def report(
    work: TrainWork,
    precisions: list[str],
    peaks: dict[str, list[float]],
    mlp_rates: dict[str, list[float]],
    step_seconds: dict[str, list[float]],
    optimizer_seconds: dict[str, list[float]],
    mlp_shape: tuple[int, int, int],
) -> None:
    print(
        f"\n{'precision':<9} {'peak':>8} {'mlp-shape':>9} {'step s':>7} {'optim s':>7} {'GFLOP/s':>8}  "
        f"{'of peak (per seq)':>17} {'(unique)':>8}"
    )
    for precision in precisions:
        peak = max(*peaks[precision], *mlp_rates[precision])  # the best matmul rate seen in the run
        seconds = statistics.median(step_seconds[precision])
        optimizer = statistics.median(optimizer_seconds[precision])
        achieved = work.flops(work.num_real_tokens) / seconds / 1e9
        unique = work.flops(work.num_unique_tokens) / seconds / 1e9
        print(
            f"{precision:<9} {peak:8.1f} {statistics.median(mlp_rates[precision]):9.1f} {seconds:7.2f} "
            f"{optimizer:7.2f} {achieved:8.1f}  {achieved / peak:17.1%} {unique / peak:8.1%}"
        )
    print(
        f"peak: best matmul GFLOP/s seen in the run (square or MLP-shaped); mlp-shape: median GFLOP/s of a "
        f"{mlp_shape} matmul; step s: median train step (fwd+bwd and optimizer); goal >= 50% of peak"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
