"""What sharpen's generation path costs on top of the engine, side by side in one run: 32 episodes x up to 64
tokens through `EpisodeRunner` (episode tasks, completions with logprobs) against the bare `vllm.LLM.generate` call
with exactly the same token prompts and sampling parameters (the same per-request seeds, so the same tokens: the
same work). SmolLM2-135M on vLLM's CPU build. Engines measured (``--engines``, each through EpisodeRunner):

- ``vllm``: the batch engine (`RequestBatcher` groups the episodes' requests, the engine's worker thread);
- ``vllm_async``: vLLM's AsyncLLM in this process, every request on its own (continuous batching);
- ``vllm_server``: `vllm serve` started by the engine, every request its own HTTP call.

Prints the median seconds of each and its overhead over the bare call (goal <= 10%).

    .venv/bin/python benchmarks/engine_overhead.py [--batch 32] [--max-new-tokens 64] [--repeats 5]
        [--engines vllm,vllm_async,vllm_server]
"""

from __future__ import annotations

import argparse
import statistics
import time

from sharpen.config.engines import VllmEngineConfig, VllmServerEngineConfig
from sharpen.config.models import resolve_model_path
from sharpen.data import render_prompt
from sharpen.rollout.engines import build_engine
from sharpen.rollout.engines.vllm import vllm_sampling_params
from sharpen.rollout.episodes import EpisodeRunner, derive_seed
from sharpen.types import Example, Message, SamplingParams

TOPICS = ["a lighthouse", "a market", "the sea", "a library", "a mountain", "a train", "a garden", "a storm"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--engines", default="vllm,vllm_async,vllm_server")
    args = parser.parse_args()
    configs = {
        "vllm": VllmEngineConfig(),
        "vllm_async": VllmEngineConfig(async_engine=True),
        "vllm_server": VllmServerEngineConfig(),
    }
    names = args.engines.split(",")
    if unknown := set(names) - set(configs):
        parser.error(f"unknown engines {sorted(unknown)}; choose from {sorted(configs)}")

    from transformers import AutoTokenizer

    model_path = resolve_model_path("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    engine = build_engine(VllmEngineConfig(), model_path=model_path, dtype="float32", seed=0)  # the bare call's
    engines = {
        name: engine if name == "vllm" else build_engine(configs[name], model_path=model_path, dtype="float32", seed=0)
        for name in names
    }
    examples = [
        Example(
            task_key=f"story/{i}", prompt=(Message(role="user", content=f"Tell a long story about {TOPICS[i % 8]}."),)
        )
        for i in range(args.batch)
    ]
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0)
    runner = EpisodeRunner(tokenizer=tokenizer)
    llm = engine.llm  # type: ignore[attr-defined]

    def through_sharpen(name: str, seed: str) -> int:
        groups = runner.generate_groups(engines[name], examples, sampling=sampling, num_samples=1, seed=seed)
        return sum(len(r.completion_ids) for g in groups for r in g.rollouts)

    def bare(seed: str) -> int:
        requests = [{"prompt_token_ids": render_prompt(tokenizer, list(e.prompt))} for e in examples]
        params = [
            vllm_sampling_params(  # the engine's own translation of the settings
                SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=derive_seed(seed, i, 0))
            )
            for i in range(len(examples))
        ]
        outputs = llm.generate(requests, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    calls = {"bare": bare, **{name: lambda seed, name=name: through_sharpen(name, seed) for name in names}}
    for call in calls.values():
        call("warm-up")
    times: dict[str, list[float]] = {name: [] for name in calls}
    for repeat in range(args.repeats):  # interleaved, same seeds everywhere: the same tokens, so the same work
        seed = f"bench/{repeat}"
        for name, call in calls.items():
            started = time.perf_counter()
            num_tokens = call(seed)
            times[name].append(time.perf_counter() - started)
            print(f"repeat {repeat} {name:12s} {times[name][-1]:.3f} s  {num_tokens} tokens")
    bare_s = statistics.median(times["bare"])
    print(f"batch {args.batch} x <= {args.max_new_tokens} tokens, median of {args.repeats}")
    print(f"bare vllm.LLM.generate:        {bare_s:.3f} s")
    for name in names:
        ours_s = statistics.median(times[name])
        print(
            f"{name:12s} via EpisodeRunner: {ours_s:.3f} s  overhead {100 * (ours_s / bare_s - 1):+.1f}% (goal <= 10%)"
        )
    for live in {id(e): e for e in engines.values()}.values():
        live.close()
    if "vllm" not in engines:
        engine.close()


if __name__ == "__main__":
    main()
