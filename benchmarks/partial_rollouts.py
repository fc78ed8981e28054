"""Rollout throughput with and without partial rollouts (``rollout.partial``), side by side in one run.

The real batch makers (`GroupCollector` with the episode runner; `PartialCollector` around it) over an engine that
models a batched decoder: every call costs ``--call-ms`` plus ``--token-ms`` per decoding step, and a call's steps are
its longest request's tokens (the batch decodes in lockstep; a GPU's step time hardly depends on the batch size). Each
completion's length is drawn from a Pareto distribution (``--alpha``, from ``--min-tokens``, capped at
``max_new_tokens``) by the request's seed: a heavy tail. Without partial rollouts a step lasts as long as its longest
completion; with them ``extra_prompts`` more groups are in flight and the batch closes as soon as ``prompts_per_step``
are complete. It prints the trained tokens per second of both, their ratio (goal >= 1.2x), and the share of trained
tokens sampled by an older policy than the batch's.

    .venv/bin/python benchmarks/partial_rollouts.py [--steps 12] [--extra-prompts 8] [--chunk-tokens 32]
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

from sharpen.config import SharpenConfig, load_config
from sharpen.data import ExampleSampler
from sharpen.monitoring import PhaseTimer
from sharpen.orchestration.batches import GroupCollector, PartialCollector
from sharpen.orchestration.batches.producer import BatchMaker
from sharpen.rollout.episodes import EpisodeRunner, derive_seed
from sharpen.testing import ByteChatTokenizer
from sharpen.types import Completion, Example, Message, RewardResult, RewardStatus, SamplingParams

TOKENIZER = ByteChatTokenizer()
FILL = TOKENIZER.encode("x")[0]
DIGITS = 4
"""A completion opens with its length in 4 digits (so a resumed request knows it), then ``x`` up to that length."""


class HeavyTailEngine:
    """A completion's length is drawn once, by its first request's seed; later requests of it (resumed from its
    tokens) read it from the completion's first tokens. Sleeps like a batched decoder (module docstring)."""

    def __init__(self, *, alpha: float, min_tokens: int, call_s: float, token_s: float) -> None:
        self.alpha, self.min_tokens, self.call_s, self.token_s = alpha, min_tokens, call_s, token_s
        self.policy_version = 0
        self.num_tokens = 0

    def length(self, seed: int, limit: int) -> int:
        uniform = (derive_seed(seed, "length") + 1) / 2**63
        return min(limit, max(DIGITS + 1, math.ceil(self.min_tokens * uniform ** (-1 / self.alpha))))

    def complete(self, prompt: list[int], params: SamplingParams) -> Completion:
        start = len(prompt) - prompt[::-1].index(TOKENIZER.role_ids["assistant"])  # after the assistant header
        done = prompt[start:]
        if done:
            target = int(TOKENIZER.decode(done[:DIGITS]))
        else:
            assert params.seed is not None
            target = self.length(params.seed, params.max_new_tokens)
        full = TOKENIZER.encode(f"{target:0{DIGITS}d}") + [FILL] * (target - DIGITS)
        ids = full[len(done) : len(done) + params.max_new_tokens]
        is_stop = len(done) + len(ids) == target
        return Completion(
            token_ids=ids,
            logprobs=[-1.0] * len(ids),
            text=TOKENIZER.decode(ids),
            finish_reason="stop" if is_stop else "length",
        )

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        out = [self.complete(prompt, p) for prompt, p in zip(prompts, params, strict=True)]
        steps = max((len(c.token_ids) for c in out), default=0)
        self.num_tokens += sum(len(c.token_ids) for c in out)
        time.sleep(self.call_s + self.token_s * steps)
        return out

    def score(self, token_ids: list[int]) -> list[float]:
        return [-1.0] * (len(token_ids) - 1)

    def load_weights(self, weights: Any, *, version: int) -> dict[str, float]:
        self.policy_version = version
        return {}

    def close(self) -> None:
        pass


def no_reward(example: Example, completion: str) -> RewardResult:
    return RewardResult(score=0.0, status=RewardStatus.OK, components={}, verifier="benchmark")


def make_config(args: argparse.Namespace, *, partial: bool) -> SharpenConfig:
    return load_config(
        None,
        [
            'rollout.engine.type="hf"',
            f"rollout.prompts_per_step={args.prompts}",
            f"rollout.num_samples_per_prompt={args.samples}",
            f"rollout.max_new_tokens={args.max_new_tokens}",
            f"trainer.micro_batch_size={args.samples}",
            f"rollout.partial.enabled={str(partial).lower()}",
            f"rollout.partial.extra_prompts={args.extra_prompts}",
            f"rollout.partial.chunk_tokens={args.chunk_tokens}",
            f"rollout.partial.max_steps_spanned={args.max_steps_spanned}",
        ],
    )


def measure(args: argparse.Namespace, *, partial: bool) -> dict[str, float]:
    """Trained tokens per second over the steps after the first (whose batch starts with nothing in flight)."""
    config = make_config(args, partial=partial)
    examples = [Example(task_key=f"q/{i}", prompt=(Message(role="user", content=f"q{i}"),)) for i in range(512)]
    collector = GroupCollector(
        config,
        runner=EpisodeRunner(tokenizer=TOKENIZER),
        rubric=no_reward,  # pyright: ignore[reportArgumentType]
        sampler=ExampleSampler(examples, seed=0),
    )
    maker: BatchMaker = PartialCollector(collector) if partial else collector
    engine = HeavyTailEngine(
        alpha=args.alpha, min_tokens=args.min_tokens, call_s=args.call_ms / 1e3, token_s=args.token_ms / 1e3
    )
    seconds = tokens = older = 0.0
    for step in range(args.steps):
        engine.load_weights([], version=step)  # sync mode: the weights of the step
        started = time.perf_counter()
        batch = maker.collect(engine, step=step, timer=PhaseTimer())  # pyright: ignore[reportArgumentType]
        elapsed = time.perf_counter() - started
        versions = [v for g in batch.groups for r in g.rollouts for v in r.versions]
        if step > 0:
            seconds += elapsed
            tokens += len(versions)
            older += sum(v < step for v in versions)
    return {
        "tokens_per_second": tokens / seconds,
        "seconds_per_step": seconds / (args.steps - 1),
        "older": older / tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--extra-prompts", type=int, default=8)
    parser.add_argument("--chunk-tokens", type=int, default=64)
    parser.add_argument("--max-steps-spanned", type=int, default=4)
    parser.add_argument("--alpha", type=float, default=1.5, help="Pareto tail index of the completion lengths")
    parser.add_argument("--min-tokens", type=int, default=32, help="Pareto scale: the shortest completion")
    parser.add_argument("--call-ms", type=float, default=2.0, help="cost of one engine call (prefill, scheduling)")
    parser.add_argument("--token-ms", type=float, default=0.5, help="cost of one decoding step of the batch")
    args = parser.parse_args()
    plain = measure(args, partial=False)
    partial = measure(args, partial=True)
    print(
        f"{args.steps - 1} steps, {args.prompts} prompts x {args.samples} samples, lengths Pareto(alpha={args.alpha}, "
        f"min={args.min_tokens}) capped at {args.max_new_tokens}; partial: +{args.extra_prompts} prompts, chunks of "
        f"{args.chunk_tokens}, at most {args.max_steps_spanned} steps"
    )
    print(f"{'':10} {'tokens/s':>10} {'s/step':>8} {'older-policy tokens':>20}")
    for name, row in (("plain", plain), ("partial", partial)):
        print(f"{name:10} {row['tokens_per_second']:10.0f} {row['seconds_per_step']:8.3f} {row['older']:20.1%}")
    ratio = partial["tokens_per_second"] / plain["tokens_per_second"]
    print(f"partial / plain rollout throughput: {ratio:.2f}x (goal >= 1.2x)")


if __name__ == "__main__":
    main()
