"""Tool-call formats: each parser reads back what its family's real chat template renders (1 and 2 calls, nested,
unicode and quoted arguments), reports malformed calls as errors, and the format is chosen from a chat template.

The templates are vendored in tests/fixtures/chat_templates (sources and licenses in its SOURCES.md) and rendered by
transformers' ``apply_chat_template`` with SmolLM2's tokenizer: what matters here is the template's text, not the
family's vocabulary.
"""

from __future__ import annotations

import json
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jinja2
import pytest

from sharpen.config import ConfigError
from sharpen.config.environments import CalculatorEnvironmentConfig, ToolSection
from sharpen.config.episodes import ToolParserName
from sharpen.environments.registry import build_environment_factory
from sharpen.environments.tool_formats import (
    TOOL_CALL_PARSERS,
    HermesToolCallParser,
    Qwen3CoderToolCallParser,
    ToolCall,
    ToolCallError,
    UnknownToolCallFormatError,
    parser_for_template,
    read_chat_template,
)
from sharpen.environments.tool_use import ToolEnvironment
from sharpen.types import Example, Message
from support.chat_families import LLAMA3_TEMPLATE, QWEN25_TEMPLATE

TEMPLATES = Path(__file__).parents[2] / "fixtures" / "chat_templates"

SEARCH = ToolCall(
    name="search",
    arguments={
        "query": 'café "quoted" <b>x</b> 🙂 back\\slash\nsecond line',
        "filters": {"year": [2020, 2021], "exact": True, "note": None, "tags": ["ünï", "a,b"]},
        "limit": 3,
        "strict": False,
    },
)
ADD = ToolCall(name="add", arguments={"a": 1.5, "b": -2, "label": "007"})
SPECS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "filters": {"type": "object"},
                    "limit": {"type": "integer"},
                    "strict": {"type": "boolean"},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "integer"}, "label": {"type": "string"}},
            },
        },
    },
]


class Family(typing.NamedTuple):
    template: str
    parser: str
    end_of_turn: str
    """What the template writes after the turn that the engine stops at (not part of the policy's text)."""
    calls_per_message: int
    """Calls one assistant message renders (2: both; 1: one message per call)."""


FAMILIES = {
    "qwen3_coder": Family("qwen3_coder.jinja", "qwen3_coder", "<|im_end|>\n", 2),
    "llama3_1": Family("llama3_1.jinja", "llama3_json", "<|eot_id|>", 1),
    "mistral_nemo": Family("mistral_nemo.jinja", "mistral", "<|im_end|>", 2),  # eos: SmolLM2's
    "mistral_small_3_2": Family("mistral_small_3_2.jinja", "mistral", "<|im_end|>", 2),
    "ministral_3": Family("ministral_3.jinja", "mistral", "<|im_end|>", 2),
    "gpt_oss": Family("gpt_oss.jinja", "harmony", "", 1),
    "qwen3": Family("qwen3.jinja", "hermes", "<|im_end|>\n", 2),
}


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


def _message(calls: list[ToolCall], first_id: int) -> dict[str, Any]:
    tool_calls = [
        {"id": f"call{first_id + i:05d}", "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for i, c in enumerate(calls)
    ]
    return {"role": "assistant", "content": "", "tool_calls": tool_calls}


def render_turn(tokenizer: Any, family: Family, calls: list[ToolCall]) -> str:
    """The policy's turn as the template renders it: the whole chat minus the prompt, minus the end-of-turn marker."""
    tokenizer.chat_template = (TEMPLATES / family.template).read_text()
    prompt = [{"role": "user", "content": "Find it, then add."}]
    step = family.calls_per_message
    turn = [_message(calls[i : i + step], first_id=i) for i in range(0, len(calls), step)]
    before = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    whole = tokenizer.apply_chat_template([*prompt, *turn], tokenize=False)
    assert whole.startswith(before)
    return whole[len(before) :].removesuffix(family.end_of_turn)


@pytest.mark.parametrize("calls", [[SEARCH], [SEARCH, ADD]], ids=["one_call", "two_calls"])
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "llama3_1"])
def test_each_parser_reads_back_what_its_template_renders(tokenizer: Any, family: str, calls: list[ToolCall]):
    text = render_turn(tokenizer, FAMILIES[family], calls)
    parser = TOOL_CALL_PARSERS[FAMILIES[family].parser](tools=SPECS)
    assert parser.parse(text) == calls, text
    assert parser.strip(text) == ("<think>\n\n</think>" if family == "qwen3" else "")


def test_llama3_reads_its_template_and_several_calls_separated_by_semicolons(tokenizer: Any):
    parser = TOOL_CALL_PARSERS["llama3_json"]()
    text = render_turn(tokenizer, FAMILIES["llama3_1"], [SEARCH])
    assert parser.parse(text) == [SEARCH]
    assert parser.parse("<|python_tag|>" + text) == [SEARCH]  # the tag the model may write first
    # the official template renders one call per message; vLLM's llama3_json reads several separated by ";"
    with pytest.raises(jinja2.TemplateError, match="single tool-calls"):
        render_turn(tokenizer, FAMILIES["llama3_1"]._replace(calls_per_message=2), [SEARCH, ADD])
    second = render_turn(tokenizer, FAMILIES["llama3_1"], [ADD])
    assert parser.parse(f"<|python_tag|>{text}; {second}<|eom_id|>") == [SEARCH, ADD]


def test_harmony_reads_the_order_the_model_writes_and_keeps_only_the_final_channel_as_content():
    parser = TOOL_CALL_PARSERS["harmony"]()
    text = (
        "<|channel|>analysis<|message|>Need the sum. to=nothing<|end|>"
        '<|start|>assistant<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 1.5, "b": -2, '
        '"label": "007"}<|call|>'
    )
    assert parser.parse(text) == [ADD]
    assert parser.parse(text.removesuffix("<|call|>")) == [ADD]  # the engine cut the stop token
    assert parser.strip(text) == ""
    answer = "<|channel|>analysis<|message|>easy<|end|><|start|>assistant<|channel|>final<|message|>It is 42.<|return|>"
    assert parser.parse(answer) == []
    assert parser.strip(answer) == "It is 42."


def test_qwen3_coder_types_values_by_the_tool_spec_and_keeps_strings_without_one(tokenizer: Any):
    text = render_turn(tokenizer, FAMILIES["qwen3_coder"], [ADD])
    assert Qwen3CoderToolCallParser().parse(text) == [
        ToolCall(name="add", arguments={"a": "1.5", "b": "-2", "label": "007"})
    ]
    bare = "<function=add>\n<parameter=b>\n4\n</parameter>\n</function>"  # without <tool_call>, as vLLM reads it
    assert Qwen3CoderToolCallParser(tools=SPECS).parse(bare) == [ToolCall(name="add", arguments={"b": 4})]


def test_tool_environment_gives_its_specs_to_the_parser():
    def lookup(city: str, year: int = 2020) -> str:
        """Population of a city."""
        return city

    environment = ToolEnvironment([lookup], parser="qwen3_coder")
    text = (
        "<tool_call>\n<function=lookup>\n<parameter=city>\nParis\n</parameter>\n<parameter=year>\n1999\n</parameter>\n"
    )
    assert environment.parser.parse(text + "</function>\n</tool_call>") == [
        ToolCall(name="lookup", arguments={"city": "Paris", "year": 1999})
    ]


MALFORMED = [
    ("llama3_json", '{"name": "add", "parameters": {"a": 1', "not valid JSON"),
    ("llama3_json", '{"parameters": {"a": 1}}', 'string "name"'),
    ("llama3_json", '<|python_tag|>{"name": "add", "parameters": {}} and more', "unexpected text"),
    ("llama3_json", '{"name": "add", "parameters": [1, 2]}', "must be a JSON object"),
    ("qwen3_coder", "<tool_call>\n<function=add>\n<parameter=b>\n4\n</parameter>\n</function>", "not closed"),
    ("qwen3_coder", "<tool_call>\n<function=add>\n<parameter=b>\n4\n</function>\n</tool_call>", "not closed?"),
    ("qwen3_coder", '<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>', "<function=name>"),
    (
        "qwen3_coder",
        "<tool_call>\n<function=add>\n<parameter=b>\nfour\n</parameter>\n</function>\n</tool_call>",
        "integer",
    ),
    ("qwen3_coder", "<function=add>\n<parameter=b>\n4\n</parameter>\n", "<function=name>"),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}', "not valid JSON"),
    ("mistral", '[TOOL_CALLS]add[ARGS]{"a": 1', "not valid JSON"),
    ("mistral", "[TOOL_CALLS]add now please", "[ARGS]"),
    ("mistral", '[TOOL_CALLS]the add[ARGS]{"a": 1}', "not a tool name"),
    ("mistral", "[TOOL_CALLS][]", "empty list"),
    ("harmony", "<|channel|>commentary to=functions.add <|constrain|>json<|message|>{a: 1}<|call|>", "not valid JSON"),
    ("harmony", "<|channel|>commentary to=functions.add <|constrain|>json", "no <|message|>"),
    ("harmony", "<|channel|>commentary to=functions.add<|message|>[1]<|call|>", "must be a JSON object"),
]


@pytest.mark.parametrize(("parser", "text", "message"), MALFORMED)
def test_a_malformed_call_is_an_error_the_policy_is_told(parser: str, text: str, message: str):
    last = TOOL_CALL_PARSERS[parser](tools=SPECS).parse(text)[-1]
    assert isinstance(last, ToolCallError), last
    assert message in last.message


@pytest.mark.parametrize("parser", sorted(TOOL_CALL_PARSERS))
def test_a_turn_without_a_call_calls_no_tool(parser: str):
    text = "The answer is 42 (see <b>above</b>); done."
    assert TOOL_CALL_PARSERS[parser]().parse(text) == []
    assert TOOL_CALL_PARSERS[parser]().strip(text) == text


@pytest.mark.parametrize(
    ("template", "expected"),
    [(FAMILIES[name].template, FAMILIES[name].parser) for name in FAMILIES],
)
def test_the_format_is_chosen_from_the_chat_template(template: str, expected: str):
    assert parser_for_template((TEMPLATES / template).read_text()) == expected


def test_templates_without_tool_calls_fall_back_to_hermes_and_an_unknown_format_is_one_clear_error(
    smollm2_path: Path,
):
    assert parser_for_template(read_chat_template(smollm2_path)) == "hermes"
    assert parser_for_template(QWEN25_TEMPLATE) == "hermes"
    assert parser_for_template(LLAMA3_TEMPLATE) == "hermes"  # renders no tool calls at all
    assert parser_for_template(None) == "hermes"
    unknown = "{% for m in messages %}{% for c in m.tool_calls %}<<call {{ c.function.name }}>>{% endfor %}{% endfor %}"
    with pytest.raises(UnknownToolCallFormatError, match="no parser for"):
        parser_for_template(unknown)


def test_the_config_names_exactly_the_registered_parsers_and_keeps_hermes_the_default():
    assert set(typing.get_args(ToolParserName)) == {*TOOL_CALL_PARSERS, "auto"}
    assert ToolSection().tool_parser == "hermes"


def _parser(make_environment: Callable[[], object]) -> object:
    environment = make_environment()
    assert isinstance(environment, ToolEnvironment)
    return environment.parser


def test_auto_reads_the_models_chat_template(smollm2_path: Path, tmp_path: Path):
    QWEN3_CODER = (TEMPLATES / "qwen3_coder.jinja").read_text()
    auto = CalculatorEnvironmentConfig(tool_parser="auto")
    # SmolLM2's recipes: auto picks what the default always was
    assert isinstance(_parser(build_environment_factory(auto, model_path=smollm2_path)), HermesToolCallParser)
    named = [{"name": "default", "template": "x"}, {"name": "tool_use", "template": QWEN3_CODER}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert read_chat_template(tmp_path) == QWEN3_CODER
    assert isinstance(_parser(build_environment_factory(auto, model_path=tmp_path)), Qwen3CoderToolCallParser)
    with pytest.raises(ConfigError, match="needs the model's chat template"):
        build_environment_factory(auto)


@pytest.mark.parametrize("parser", sorted(TOOL_CALL_PARSERS))
def test_the_call_format_a_parser_teaches_is_one_it_reads(parser: str):
    filled = TOOL_CALL_PARSERS[parser]().call_format
    for placeholder, value in [
        ("<tool name>", "add"),
        ("{<arguments as JSON>}", '{"b": 4}'),
        ("<argument name>", "b"),
        ("<value>", "4"),
    ]:
        filled = filled.replace(placeholder, value)
    assert TOOL_CALL_PARSERS[parser](tools=SPECS).parse(filled) == [ToolCall(name="add", arguments={"b": 4})]


def test_the_hermes_tool_instructions_are_unchanged():
    prompt = ToolEnvironment([]).system_prompt(Example(task_key="t", prompt=(Message(role="user", content="hi"),)))
    assert prompt == (
        "You may call tools. To call one, write a block\n"
        '<tool_call>{"name": "<tool name>", "arguments": {<arguments as JSON>}}</tool_call>\n'
        "and stop; the result comes back in the next message. When you know the answer, reply without a tool call.\n"
        "Tools:\n"
    )
    assert "[TOOL_CALLS]<tool name>[ARGS]" in ToolEnvironment([], parser="mistral").system_prompt(
        Example(task_key="t", prompt=())
    )
