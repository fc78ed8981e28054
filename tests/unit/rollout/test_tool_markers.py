"""Tool calls whose markers are special tokens (gpt-oss harmony's ``<|channel|>``/``<|message|>``, Mistral's
``[TOOL_CALLS]``/``[ARGS]``, Llama 3's ``<|python_tag|>``) reach the parser from the engines' decode
(`completion_text`): a completion whose ids hold each marker as one special token is read as its call by the tool
environment (through the vLLM engine's completion path) and by the agent endpoint (the session decodes the ids
itself), the content shown has no control token, and the recorded tokens are the engine's.

Tokenizers are SmolLM2's with the family's markers added as special tokens and the family's vendored chat template
(tests/fixtures/chat_templates), as `support.chat_families` builds its families. A decode that skips special tokens
(``skip_special_tokens=True``, what the engines did) loses these calls: each test checks that too.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from sharpen.environments.tool_formats import ToolCall, parser_for_template
from sharpen.environments.tool_formats.decode import completion_text
from sharpen.environments.tool_use import ToolEnvironment
from sharpen.rollout.agent_session import AgentSession, ChatRequest
from sharpen.types import Completion, SamplingParams

TEMPLATES = Path(__file__).parents[2] / "fixtures" / "chat_templates"
HARMONY = ["<|start|>", "<|channel|>", "<|constrain|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>"]
MISTRAL = ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"]
LLAMA3 = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|python_tag|>", "<|eom_id|>"]

# what each family's model writes for add(a=2, b=3) after some reasoning or text (the formats' own documentation)
HARMONY_CALL = (
    "<|channel|>analysis<|message|>I should add them.<|end|><|start|>assistant<|channel|>commentary "
    'to=functions.add <|constrain|>json<|message|>{"a": 2, "b": 3}<|call|>'
)
MISTRAL_CALL = 'Adding.[TOOL_CALLS]add[ARGS]{"a": 2, "b": 3}</s>'
LLAMA3_CALL = 'Let me add.<|python_tag|>{"name": "add", "parameters": {"a": 2, "b": 3}}<|eom_id|>'
ADD = ToolCall(name="add", arguments={"a": 2, "b": 3})
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def _with_markers(smollm2_path: Path, markers: list[str], template: str, *, eos: str) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    tokenizer.add_special_tokens({"additional_special_tokens": [*markers, eos]})
    tokenizer.eos_token = eos
    tokenizer.bos_token = markers[0] if markers[0] == "<|begin_of_text|>" else None
    tokenizer.chat_template = (TEMPLATES / template).read_text()
    return tokenizer


@pytest.fixture(scope="module")
def families(smollm2_path: Path) -> dict[str, tuple[Any, str, list[str]]]:
    """family -> (tokenizer, a completion calling add(2, 3), the markers it holds)."""
    llama3 = _with_markers(smollm2_path, LLAMA3, "llama3_1.jinja", eos="<|eot_id|>")
    return {
        "harmony": (_with_markers(smollm2_path, HARMONY, "gpt_oss.jinja", eos="<|return|>"), HARMONY_CALL, HARMONY),
        "mistral": (_with_markers(smollm2_path, MISTRAL, "ministral_3.jinja", eos="</s>"), MISTRAL_CALL, MISTRAL),
        "llama3_json": (llama3, LLAMA3_CALL, ["<|python_tag|>"]),
    }


def _session(tokenizer: Any, generate: Any, *, max_calls: int, max_new_tokens: int) -> AgentSession:
    """An agent session on ``tokenizer`` whose engine is ``generate``, episode 0-0, 64 tokens an episode."""
    return AgentSession(
        episode_id="0-0",
        tokenizer=tokenizer,
        generate=generate,
        sampling=SamplingParams(max_new_tokens=max_new_tokens),
        seed_of=lambda call: call,
        max_calls=max_calls,
        max_tokens=64,
    )


def _ids(tokenizer: Any, text: str, markers: list[str]) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    for marker in markers:  # each marker the text writes is one special token id
        if marker in text:
            marker_id = tokenizer.convert_tokens_to_ids(marker)
            assert marker_id in tokenizer.all_special_ids and ids.count(marker_id) == text.count(marker)
    return ids


@pytest.mark.parametrize("family", ["harmony", "mistral", "llama3_json"])
def test_the_tool_environment_reads_calls_from_the_vllm_completion_path(families, family: str) -> None:
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput

    from sharpen.rollout.engines.vllm import vllm_completion

    tokenizer, text, markers = families[family]
    assert parser_for_template(tokenizer.chat_template) == family
    ids = _ids(tokenizer, text, markers)
    skipped = tokenizer.decode(ids, skip_special_tokens=True)  # vLLM's own text (its default), and the old decode
    sample = CompletionOutput(
        index=0,
        text=skipped,
        token_ids=ids,
        cumulative_logprob=None,
        logprobs=[{i: Logprob(logprob=-0.5)} for i in ids],
        finish_reason="stop",
    )
    completion = vllm_completion(sample, decode=lambda got: completion_text(tokenizer, got))
    assert completion.token_ids == ids

    def step(action: str) -> Any:
        environment = ToolEnvironment([add], parser=family)
        return asyncio.run(environment.step(action)).info

    assert step(skipped) == {"num_tool_calls": 0}  # the markers are gone: the call is lost, the episode ends
    assert step(completion.text) == {"tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]}


def test_completion_text_keeps_only_tool_call_markers(families) -> None:
    tokenizer, _, _ = families["harmony"]
    ids = tokenizer.encode("<|start|>assistant<|channel|>final<|message|>5<|return|>", add_special_tokens=False)
    assert completion_text(tokenizer, ids) == "<|start|>assistant<|channel|>final<|message|>5"  # the stop token goes
    llama3, _, _ = families["llama3_json"]
    ids = llama3.encode("<|begin_of_text|>Hi<|python_tag|>x<|eot_id|>", add_special_tokens=False)
    assert completion_text(llama3, ids) == "Hi<|python_tag|>x"


@pytest.mark.parametrize(
    ("family", "content"), [("harmony", None), ("mistral", "Adding."), ("llama3_json", "Let me add.")]
)
def test_the_agent_endpoint_returns_the_calls_of_special_token_markers(families, family: str, content: Any) -> None:
    tokenizer, text, markers = families[family]
    ids = _ids(tokenizer, text, markers)
    prompts: list[list[int]] = []

    async def generate(prompt: list[int], params: SamplingParams) -> tuple[Completion, int]:
        prompts.append(prompt)  # the engine's text is vLLM's default (no special token): the session decodes the ids
        skipped = tokenizer.decode(ids, skip_special_tokens=True)
        return Completion(token_ids=ids, logprobs=[-0.5] * len(ids), text=skipped, versions=[0] * len(ids)), 0

    session = _session(tokenizer, generate, max_calls=2, max_new_tokens=64)
    answer = asyncio.run(session.chat({"messages": [{"role": "user", "content": "2 + 3?"}], "tools": TOOLS}))
    assert session.tool_parser == family
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]]
    assert calls == [("add", '{"a": 2, "b": 3}')]
    assert choice["message"]["content"] == content  # no marker and no other reasoning channel in the content
    assert choice["token_ids"] == ids
    (segment,) = session.segments()
    assert segment.token_ids == prompts[0] + ids and segment.loss_mask == [True] * len(ids)


def test_agent_content_without_calls_has_no_control_tokens(families) -> None:
    """A malformed call stays in the content (the agent sees it), as text without special tokens."""
    tokenizer, _, markers = families["mistral"]
    ids = _ids(tokenizer, "Sure.[TOOL_CALLS]add[ARGS]{not json</s>", markers)

    async def generate(prompt: list[int], params: SamplingParams) -> tuple[Completion, int]:
        return Completion(token_ids=ids, logprobs=[-0.5] * len(ids), versions=[0] * len(ids)), 0

    session = _session(tokenizer, generate, max_calls=1, max_new_tokens=64)
    turn = asyncio.run(session.chat_turn(ChatRequest(messages=[{"role": "user", "content": "2 + 3?"}], tools=TOOLS)))
    assert (turn.tool_calls, turn.content, turn.finish_reason) == ([], "Sure.add{not json", "stop")


def test_a_template_in_an_unknown_tool_format_refuses_only_requests_with_tools(smollm2_path: Path) -> None:
    """A chat template that renders tool calls in a format sharpen cannot read: a request with tools gets one line
    (400) before any generation, a request without tools is served as before."""
    from transformers import AutoTokenizer

    from sharpen.rollout.agent_session import RequestError

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m.role }}: {{ m.content }}{% if m.tool_calls %}<<CALL {{ m.tool_calls }}>>"
        "{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    )
    ids = tokenizer.encode("Four.", add_special_tokens=False)
    calls: list[list[int]] = []

    async def generate(prompt: list[int], params: SamplingParams) -> tuple[Completion, int]:
        calls.append(prompt)
        return Completion(token_ids=ids, logprobs=[-0.5] * len(ids), versions=[0] * len(ids)), 0

    session = _session(tokenizer, generate, max_calls=2, max_new_tokens=8)
    with pytest.raises(RequestError, match=r"^tools cannot be read back from this model's replies: ") as refused:
        asyncio.run(session.chat({"messages": [{"role": "user", "content": "2 + 2?"}], "tools": TOOLS}))
    assert refused.value.status == 400 and calls == []
    answer = asyncio.run(session.chat({"messages": [{"role": "user", "content": "2 + 2?"}]}))
    assert answer["choices"][0]["message"]["content"] == "Four."


def test_server_engines_decode_the_ids_with_the_local_tokenizer(families, tmp_path: Path) -> None:
    """vLLM's and SGLang's servers send text without any special token: with the model's folder here the server
    engines decode the ids themselves (`local_decoder`), keeping the markers; without one, the server's text."""
    from sharpen.environments.tool_formats.decode import local_decoder

    tokenizer, text, markers = families["harmony"]
    tokenizer.save_pretrained(tmp_path)
    ids = _ids(tokenizer, text, markers)
    decode = local_decoder(tmp_path)
    assert decode is not None and decode(ids) == completion_text(tokenizer, ids)
    skipped = tokenizer.decode(ids, skip_special_tokens=True)  # the servers' text
    environment = ToolEnvironment([add], parser="harmony")
    assert asyncio.run(environment.step(skipped)).info == {"num_tool_calls": 0}
    assert asyncio.run(environment.step(decode(ids))).info == {
        "tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]
    }
    assert local_decoder(tmp_path / "absent") is None
