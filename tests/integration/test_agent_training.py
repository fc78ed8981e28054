"""Agents written against the real `openai` client train through the agent endpoint: a multi-turn tool agent and a
history-rewriting agent, loaded from the user's file like any custom environment, each train two steps (scripted
policy, tiny random model, real trainer), and what the trainer stepped on is the engine's tokens."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from sharpen.config import load_config
from sharpen.monitoring import read_jsonl

AGENTS = """
import json

import openai

from sharpen.environments import AgentResult

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


class ToolAgent:
    name = "tool_agent"
    version = "1"

    async def run_agent(self, example, ctx, client):
        api = openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0)
        messages = [{"role": m.role, "content": m.content} for m in example.prompt]
        for _ in range(3):
            response = await api.chat.completions.create(model=client.model, messages=messages, tools=TOOLS)
            message = response.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return AgentResult(reward=float(len(message.content or "") % 3) / 2)
            for call in message.tool_calls:
                arguments = json.loads(call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": str(sum(arguments.values()))})
        return AgentResult(reward=0.0, is_truncated=True, stop_reason="agent_steps")


class RewritingAgent:
    name = "rewriting_agent"
    version = "1"

    async def run_agent(self, example, ctx, client):
        api = openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0)
        plan = await api.chat.completions.create(
            model=client.model, messages=[{"role": m.role, "content": m.content} for m in example.prompt]
        )
        summary = f"Your plan was: {plan.choices[0].message.content}. Answer now."
        answer = await api.chat.completions.create(model=client.model, messages=[{"role": "user", "content": summary}])
        return AgentResult(reward=float(len(answer.choices[0].message.content or "") % 2))
"""
TOOL_CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


def _train(tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, agent: str) -> Path:
    import torch

    from sharpen.orchestration.runtime import run

    (tmp_path / "agents.py").write_text(AGENTS)
    monkeypatch.chdir(tmp_path)
    completions = json.dumps([TOOL_CALL, "five", "it is 5", TOOL_CALL, "5!"])
    overrides = {
        "run.name": json.dumps(agent),
        "run.num_steps": "2",
        "model.path": json.dumps(str(tiny_model_path)),
        "environment": f'{{type = "custom", factory = "agents.py:{agent}"}}',
        "environment.max_turns": "4",
        "rollout.engine": f"{{type = 'scripted', completions = {completions}}}",
        "rollout.prompts_per_step": "2",
        "rollout.num_samples_per_prompt": "4",
        "rollout.max_new_tokens": "32",
        "trainer.micro_batch_size": "4",
        "weight_sync.verify": "false",
        "monitoring.progress": "false",
        "monitoring.num_recorded_rollouts": "8",
    }
    config = load_config(None, [f"{k}={v}" for k, v in overrides.items()])
    previous_threads = torch.get_num_threads()
    try:
        return run(config)
    finally:
        torch.set_num_threads(previous_threads)


@pytest.mark.slow
def test_a_multi_turn_tool_agent_trains_on_the_engines_tokens(
    tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = _train(tiny_model_path, tmp_path, monkeypatch, "ToolAgent")
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert len(rows) == 2 and all(math.isfinite(row["train/loss"]) for row in rows)
    assert all(row["train/num_sequences"] == 8 for row in rows)  # one per episode: the tool loop is one sequence
    recorded = read_jsonl(run_dir / "rollouts.jsonl")
    tool_turns = [r for r in recorded if r["loss_mask"] is not None]
    assert tool_turns, "no episode called the tool"
    for record in tool_turns:
        mask, ids = record["loss_mask"], record["completion_ids"]
        turns = record["episode"]["turns"]
        # generated tokens (mask 1) are the turns' tokens, the tool results between them are inputs (mask 0)
        assert sum(mask) == sum(t["num_action_tokens"] for t in turns)
        assert sum(1 - m for m in mask) == sum(len(t["observation_ids"]) for t in turns)
        start = turns[0]["num_action_tokens"]
        assert ids[start : start + len(turns[0]["observation_ids"])] == turns[0]["observation_ids"]
        assert record["segments"] == []


@pytest.mark.slow
def test_a_history_rewriting_agent_trains_each_segment(
    tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = _train(tiny_model_path, tmp_path, monkeypatch, "RewritingAgent")
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert len(rows) == 2 and all(math.isfinite(row["train/loss"]) for row in rows)
    # 8 episodes, each two segments (the agent replaced its history), each segment trained: 16 sequences
    assert all(row["train/num_sequences"] == 16 for row in rows)
    recorded = read_jsonl(run_dir / "rollouts.jsonl")
    assert all(len(r["segments"]) == 1 for r in recorded)
    for record in recorded:
        [earlier] = record["segments"]
        assert earlier["prompt_ids"] != record["prompt_ids"][: len(earlier["prompt_ids"])]  # a fresh conversation
        assert len(earlier["completion_ids"]) == record["episode"]["turns"][0]["num_action_tokens"]
