"""Agent endpoint overhead: the same multi-turn episodes driven by an agent through the OpenAI-compatible endpoint
(the real `openai` client, HTTP on loopback, JSON, message rendering) vs by the episode loop calling the engine
directly, side by side in one run.

Both make exactly the same requests: TURNS turns per episode, each answered with the same user message, the same
per-turn seeds, so the tokens must come out identical (checked and printed). The engine is vLLM (CPU build) on
SmolLM2-135M in this process (``--engine vllm``, its batch API fed by the request batcher), a vLLM server
(``vllm_server``), or the transformers engine on a tiny random Llama (``hf``). Prints generated tokens per second of
each, the endpoint's overhead (goal <= 10%), and whether the tokens matched.

    .venv/bin/python benchmarks/agent_endpoint.py [--engine vllm|vllm_server|hf] [--episodes 32] [--turns 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from sharpen.config.models import resolve_model_path
from sharpen.environments import AgentClient, AgentResult, EpisodeContext, EpisodeLimits, StepResult
from sharpen.rollout.episodes import EpisodeRunner
from sharpen.testing import save_tiny_llama
from sharpen.types import Example, Message, SamplingParams


def follow_up(turn: int) -> str:
    return f"Good. Now say more about point {turn}."


class FollowUpEnvironment:
    """The episode loop's way: each turn answered with the next follow-up question."""

    name, version = "follow_up", "1"

    def __init__(self, turns: int) -> None:
        self.turns = turns

    async def reset(self, example: Example, context: EpisodeContext) -> list[Message]:
        self.turn = 0
        return list(example.prompt)

    async def step(self, action: str) -> StepResult:
        self.turn += 1
        if self.turn >= self.turns:
            return StepResult(terminated=True)
        return StepResult(observation=[Message(role="user", content=follow_up(self.turn))])


class FollowUpAgent:
    """The agent's way: the same conversation, through the OpenAI client."""

    name, version = "follow_up_agent", "1"

    def __init__(self, turns: int) -> None:
        self.turns = turns

    async def run_agent(self, example: Example, ctx: EpisodeContext, client: AgentClient) -> AgentResult:
        if True:
            api = client.openai_client()
            messages = [{"role": m.role, "content": m.content} for m in example.prompt]
            for turn in range(1, self.turns + 1):
                response = await api.chat.completions.create(model=client.model, messages=messages)  # type: ignore[arg-type]
                messages.append(response.choices[0].message.model_dump(exclude_none=True))
                if response.choices[0].finish_reason == "length":
                    break  # as the episode loop ends an episode whose turn hit its token limit
                if turn < self.turns:
                    messages.append({"role": "user", "content": follow_up(turn)})
        return AgentResult()


def measure(engine, tokenizer, args: argparse.Namespace, *, agent: bool) -> tuple[float, list]:
    turns = args.turns
    runner = EpisodeRunner(
        tokenizer=tokenizer,
        make_environment=(lambda: FollowUpAgent(turns)) if agent else (lambda: FollowUpEnvironment(turns)),
        limits=EpisodeLimits(max_turns=turns, max_tokens=turns * args.max_new_tokens * 4),
    )
    examples = [
        Example(task_key=f"task/{i}", prompt=(Message(role="user", content=f"Tell me about topic number {i}."),))
        for i in range(args.episodes)
    ]
    started = time.perf_counter()
    groups = runner.generate_groups(
        engine, examples, sampling=SamplingParams(max_new_tokens=args.max_new_tokens), num_samples=1, seed=0
    )
    seconds = time.perf_counter() - started
    rollouts = [r for g in groups for r in g.rollouts]
    generated = sum(r.num_loss_tokens for r in rollouts)
    return generated / seconds, [(r.prompt_ids, r.completion_ids, r.loss_mask) for r in rollouts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["vllm", "vllm_server", "hf"], default="vllm")
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(2)
    smollm2 = resolve_model_path("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    if args.engine == "hf":
        from sharpen.rollout.engines.hf import HfEngine

        engine = HfEngine(save_tiny_llama(Path(tempfile.mkdtemp()) / "tiny", tokenizer_from=smollm2, hidden_size=64))
    else:
        from sharpen.config.engines import VllmEngineConfig, VllmServerEngineConfig
        from sharpen.rollout.engines import build_engine

        config = VllmServerEngineConfig() if args.engine == "vllm_server" else VllmEngineConfig()
        engine = build_engine(config, model_path=smollm2, dtype="float32", seed=0)
    measure(engine, tokenizer, args, agent=True)  # warm-up: first-call costs out of the comparison
    rates: dict[bool, list[float]] = {False: [], True: []}
    made: dict[bool, list] = {}
    for _ in range(args.repeats):
        for agent in (False, True):  # interleaved: machine noise hits both alike
            rate, made[agent] = measure(engine, tokenizer, args, agent=agent)
            rates[agent].append(rate)
    direct, endpoint = statistics.median(rates[False]), statistics.median(rates[True])
    print(f"engine {args.engine}, {args.episodes} episodes x {args.turns} turns; median of {args.repeats} runs each")
    print(f"episode loop -> engine:          {direct:8.1f} generated tokens/s")
    print(f"agent -> openai -> endpoint:     {endpoint:8.1f} generated tokens/s")
    print(f"endpoint overhead (goal <= 10%): {100 * (1 - endpoint / direct):8.1f}%")
    print(f"same tokens both ways:           {made[False] == made[True]}")
    engine.close()


if __name__ == "__main__":
    main()
