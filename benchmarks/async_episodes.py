"""Multi-turn rollout throughput: lockstep turns vs episodes as independent tasks, side by side in one run.

The same engine, tasks, seeds and environment latencies for both: NUM_EPISODES episodes of TURNS turns (tool calls)
each; every environment step waits a latency drawn per (task, sample, turn) from a heavy-tailed (Pareto) distribution
with median --env-median-ms (a sandboxed tool, a remote API). The engine is the transformers engine on a 2-layer
random Llama (real batched generation on the CPU), with --engine sleep a stand-in whose batch costs
--batch-ms + --request-ms per request (the shape of a continuous-batching server), or with --engine vllm_server /
vllm_async a real continuous-batching vLLM (CPU build) on SmolLM2-135M, served over HTTP or in this process, which
takes each episode's requests one by one. Prints episodes per second of each and the ratio (goal >= 1.5x), and
whether both made exactly the same tokens (every engine here seeds each request).

    .venv/bin/python benchmarks/async_episodes.py [--engine hf|sleep|vllm_server|vllm_async] [--episodes 64]
        [--turns 4]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import statistics
import tempfile
import time
from pathlib import Path

from sharpen.config.models import resolve_model_path
from sharpen.environments import EpisodeContext, EpisodeLimits, StepResult
from sharpen.rollout.episodes import EpisodeRunner
from sharpen.testing import save_tiny_llama
from sharpen.types import Completion, Example, Message, SamplingParams


class SleepingEngine:
    """Seeds each request (its completion is a function of prompt and seed); a batch takes batch + n * request ms."""

    def __init__(self, tokenizer, *, batch_ms: float, request_ms: float) -> None:
        self.tokenizer = tokenizer
        self.batch_s, self.request_s = batch_ms / 1000, request_ms / 1000
        self.policy_version = 0
        self.batch_sizes: list[int] = []

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        self.batch_sizes.append(len(prompts))
        time.sleep(self.batch_s + self.request_s * len(prompts))
        out = []
        for prompt, param in zip(prompts, params, strict=True):
            digest = hashlib.blake2b(f"{prompt}/{param.seed}".encode(), digest_size=8).digest()
            text = "".join(f" w{b}" for b in digest[:4])
            ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id]
            out.append(Completion(token_ids=ids, logprobs=[-1.0] * len(ids), text=text))
        return out

    def close(self) -> None:
        pass


class ToolEnvironment:
    """TURNS tool calls, each answered after a heavy-tailed latency that depends only on (task, sample, turn)."""

    name, version = "latency_tool", "1"

    def __init__(self, *, turns: int, median_s: float, alpha: float) -> None:
        self.turns, self.median_s, self.alpha = turns, median_s, alpha

    async def reset(self, example: Example, context: EpisodeContext) -> list[Message]:
        self.key, self.sample, self.turn = example.task_key, context.sample_index, 0
        return list(example.prompt)

    async def step(self, action: str) -> StepResult:
        self.turn += 1
        digest = hashlib.blake2b(f"{self.key}/{self.sample}/{self.turn}".encode(), digest_size=4).digest()
        u = (int.from_bytes(digest, "little") + 0.5) / 2**32
        # Pareto with shape alpha and this median: x_m * (1 - u) ** (-1 / alpha), x_m = median / 2 ** (1 / alpha)
        await asyncio.sleep(self.median_s / 2 ** (1 / self.alpha) * (1 - u) ** (-1 / self.alpha))
        if self.turn >= self.turns:
            return StepResult(terminated=True, reward=1.0)
        return StepResult(observation=[Message(role="user", content=f"tool result {self.turn}")])


def measure(engine, tokenizer, args: argparse.Namespace, scheduling: str) -> tuple[float, list]:
    runner = EpisodeRunner(
        tokenizer=tokenizer,
        make_environment=lambda: ToolEnvironment(
            turns=args.turns, median_s=args.env_median_ms / 1000, alpha=args.alpha
        ),
        limits=EpisodeLimits(max_turns=args.turns),
        scheduling=scheduling,  # type: ignore[arg-type]
    )
    examples = [
        Example(task_key=f"task/{i}", prompt=(Message(role="user", content=f"Use the tool for task {i}."),))
        for i in range(args.episodes // args.samples)
    ]
    started = time.perf_counter()
    groups = runner.generate_groups(
        engine, examples, sampling=SamplingParams(max_new_tokens=args.max_new_tokens), num_samples=args.samples, seed=0
    )
    seconds = time.perf_counter() - started
    tokens = [(r.example.task_key, r.sample_index, r.completion_ids) for g in groups for r in g.rollouts]
    return len(tokens) / seconds, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["hf", "sleep", "vllm_server", "vllm_async"], default="hf")
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4, help="episodes per task")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--env-median-ms", type=float, default=50.0)
    parser.add_argument("--alpha", type=float, default=1.2, help="Pareto shape: smaller is heavier-tailed")
    parser.add_argument("--batch-ms", type=float, default=40.0)
    parser.add_argument("--request-ms", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(2)
    smollm2 = resolve_model_path("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    if args.engine == "hf":
        from sharpen.rollout.engines.hf import HfEngine

        folder = save_tiny_llama(Path(tempfile.mkdtemp()) / "tiny", tokenizer_from=smollm2, hidden_size=64)
        engine = HfEngine(folder)
    elif args.engine == "sleep":
        engine = SleepingEngine(tokenizer, batch_ms=args.batch_ms, request_ms=args.request_ms)
    else:
        from sharpen.config.engines import VllmEngineConfig, VllmServerEngineConfig
        from sharpen.rollout.engines import build_engine

        config = VllmServerEngineConfig() if args.engine == "vllm_server" else VllmEngineConfig(async_engine=True)
        engine = build_engine(config, model_path=smollm2, dtype="float32", seed=0)
    measure(engine, tokenizer, args, "lockstep")  # warm-up: first-call costs out of the comparison
    rates: dict[str, list[float]] = {"lockstep": [], "async": []}
    made: dict[str, list] = {}
    for _ in range(args.repeats):
        for scheduling in ("lockstep", "async"):  # interleaved: machine noise hits both alike
            rate, made[scheduling] = measure(engine, tokenizer, args, scheduling)
            rates[scheduling].append(rate)
    lockstep, independent = statistics.median(rates["lockstep"]), statistics.median(rates["async"])
    print(
        f"engine {args.engine}, {args.episodes} episodes x {args.turns} turns, environment latency Pareto(alpha "
        f"{args.alpha}) with median {args.env_median_ms:g} ms; median of {args.repeats} runs each"
    )
    print(f"lockstep turns:        {lockstep:8.2f} episodes/s")
    print(f"independent episodes:  {independent:8.2f} episodes/s")
    print(f"ratio (goal >= 1.5):   {independent / lockstep:8.2f}x")
    print(f"same tokens both ways: {made['lockstep'] == made['async']}")
    engine.close()


if __name__ == "__main__":
    main()
