"""load_examples: reasoning-gym determinism and metadata, JSONL parsing, and one-line DataErrors for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sharpen.config.schema import JsonlDataConfig, ReasoningGymDataConfig
from sharpen.data import DEFAULT_SYSTEM_PROMPT, DataError, load_examples, to_json_safe
from sharpen.types import Message


def _gym(**kwargs) -> ReasoningGymDataConfig:
    return ReasoningGymDataConfig(**{"task": "basic_arithmetic", "size": 20, **kwargs})


def test_reasoning_gym_same_seed_same_examples_different_seed_different():
    first, again, other = (load_examples(_gym(), seed=s) for s in (3, 3, 4))
    assert first == again
    assert [e.prompt for e in first] != [e.prompt for e in other]


def test_reasoning_gym_example_shape():
    examples = load_examples(_gym(size=3, task_config={"min_terms": 2, "max_terms": 2}), seed=0)
    assert [e.task_key for e in examples] == ["basic_arithmetic/0", "basic_arithmetic/1", "basic_arithmetic/2"]
    example = examples[0]
    entry = example.metadata["entry"]
    assert example.prompt == (
        Message(role="system", content=DEFAULT_SYSTEM_PROMPT),
        Message(role="user", content=entry["question"]),
    )
    assert example.answer == entry["answer"]
    assert example.metadata["source"] == "reasoning_gym"
    assert example.metadata["task"] == "basic_arithmetic"
    assert example.metadata["dataset_kwargs"] == {"min_terms": 2, "max_terms": 2, "seed": 0, "size": 3}
    assert json.loads(json.dumps(example.metadata)) == example.metadata


def test_system_prompt_custom_and_empty():
    custom = load_examples(_gym(size=1, system_prompt="Be terse."), seed=0)[0]
    assert custom.prompt[0] == Message(role="system", content="Be terse.")
    bare = load_examples(_gym(size=1, system_prompt=""), seed=0)[0]
    assert [m.role for m in bare.prompt] == ["user"]


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (_gym(task="basic_arithmetc"), "unknown reasoning-gym task 'basic_arithmetc' (did you mean basic_arithmetic"),
        (_gym(task="no_such_task_at_all"), "unknown reasoning-gym task 'no_such_task_at_all' ("),
        (_gym(task_config={"bogus": 1}), "has no option 'bogus' (options: min_terms"),
        (_gym(task_config={"seed": 1}), "'seed' is set by run.seed"),
        (_gym(task_config={"min_terms": 3, "max_terms": 2}), "max_terms must be >= min_terms"),
        (_gym(task="arc_agi", size=2), "cannot be scored from a JSON copy"),
    ],
)
def test_reasoning_gym_bad_config_is_one_line_data_error(config, expected):
    with pytest.raises(DataError) as info:
        load_examples(config, seed=0)
    message = str(info.value)
    assert expected in message
    assert message.startswith("data.task")
    assert "\n" not in message


def test_to_json_safe_survives_json_round_trip():
    import numpy as np

    value = {1: (1, 2), "s": {3, 1}, "n": np.int64(4), "a": np.arange(2), "o": object, "f": [np.float32(0.5)]}
    safe = to_json_safe(value)
    assert safe["1"] == [1, 2] and safe["s"] == [1, 3] and safe["n"] == 4 and safe["a"] == [0, 1]
    assert safe["f"] == [0.5] and isinstance(safe["o"], str)
    assert json.loads(json.dumps(safe)) == safe


# --- JSONL ---------------------------------------------------------------------------------------------------


def _write(tmp_path: Path, text: str, name: str = "tasks.jsonl") -> JsonlDataConfig:
    path = tmp_path / name
    path.write_text(text)
    return JsonlDataConfig(path=str(path))


def test_jsonl_string_and_message_prompts(tmp_path):
    lines = [
        {"prompt": "What is 2+2?", "answer": 4, "difficulty": "easy"},
        {"prompt": [{"role": "user", "content": "Say hi"}], "answer": "hi"},
        {"prompt": [{"role": "system", "content": "Own."}, {"role": "user", "content": "x"}], "answer": "y"},
    ]
    examples = load_examples(_write(tmp_path, "\n".join(map(json.dumps, lines)) + "\n\n"), seed=0)
    assert [e.task_key for e in examples] == ["tasks/0", "tasks/1", "tasks/2"]
    assert examples[0].prompt == (
        Message(role="system", content=DEFAULT_SYSTEM_PROMPT),
        Message(role="user", content="What is 2+2?"),
    )
    assert examples[0].answer == "4"
    assert examples[0].metadata == {"difficulty": "easy", "source": "jsonl", "verifier": "exact_match"}
    assert examples[1].prompt[1] == Message(role="user", content="Say hi")
    assert [m.content for m in examples[2].prompt] == ["Own.", "x"]  # the file's system message is kept


def test_jsonl_custom_fields(tmp_path):
    config = _write(tmp_path, json.dumps({"q": "x?", "a": "y"}))
    config = JsonlDataConfig(path=config.path, prompt_field="q", answer_field="a", system_prompt="")
    (example,) = load_examples(config, seed=0)
    assert example.prompt == (Message(role="user", content="x?"),) and example.answer == "y"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "tasks.jsonl: empty file (no examples)"),
        ("\n  \n", "tasks.jsonl: empty file (no examples)"),
        ('{"prompt": "a", "answer": "b"}\n{"prompt": "a"', "tasks.jsonl:2: not valid JSON"),
        ('{"answer": "b"}', "tasks.jsonl:1: missing field 'prompt' (data.prompt_field); the object has: answer"),
        ('{"prompt": "a", "answer": "b"}\n\n{"prompt": "a"}', "tasks.jsonl:3: missing field 'answer' (data.answer_f"),
        ("[1, 2]", "tasks.jsonl:1: expected a JSON object, got list"),
        ('{"prompt": 3, "answer": "b"}', "tasks.jsonl:1: field 'prompt': must be a string or a non-empty list"),
        ('{"prompt": "  ", "answer": "b"}', "tasks.jsonl:1: field 'prompt': empty prompt"),
        ('{"prompt": [{"role": "bot", "content": "x"}], "answer": "b"}', "field 'prompt': message 0 must be"),
        ('{"prompt": "a", "answer": null}', "tasks.jsonl:1: field 'answer' must be a string or a number"),
    ],
)
def test_jsonl_bad_input_is_one_line_data_error(tmp_path, text, expected):
    with pytest.raises(DataError) as info:
        load_examples(_write(tmp_path, text), seed=0)
    assert expected in str(info.value)
    assert "\n" not in str(info.value)


def test_jsonl_missing_file_and_directory(tmp_path):
    with pytest.raises(DataError, match=r"^data\.path: file not found: .*nope\.jsonl$"):
        load_examples(JsonlDataConfig(path=str(tmp_path / "nope.jsonl")), seed=0)
    with pytest.raises(DataError, match=r"^data\.path: not a file"):
        load_examples(JsonlDataConfig(path=str(tmp_path)), seed=0)


def test_jsonl_not_utf8(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"prompt": "a", "answer": "b"}\n\xff\xfe\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: not UTF-8 text"):
        load_examples(JsonlDataConfig(path=str(path)), seed=0)
