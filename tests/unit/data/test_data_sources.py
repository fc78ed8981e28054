"""load_examples: reasoning-gym determinism and metadata, JSONL and Hugging Face dataset parsing, and one-line
DataErrors for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sharpen.config.loader import load_config
from sharpen.config.schema import HfDataConfig, JsonlDataConfig, ReasoningGymDataConfig
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


# --- Hugging Face datasets -----------------------------------------------------------------------------------

_ROWS = {"prompt": ["What is 2+2?", "Say hi"], "answer": ["4", "hi"], "level": [1, 2]}
_CHATS = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Say hi"}],
]


def _dataset(columns: dict[str, list]):
    import datasets

    return datasets.Dataset.from_dict(columns)


def _hf(path: Path | str, **kwargs) -> HfDataConfig:
    return HfDataConfig(path=str(path), **kwargs)


@pytest.mark.parametrize("suffix", [".parquet", ".json", ".jsonl", ".csv"])
def test_hf_data_files_of_every_format_give_the_same_examples(tmp_path, suffix):
    path = tmp_path / f"tasks{suffix}"
    dataset = _dataset(_ROWS)
    if suffix == ".parquet":
        dataset.to_parquet(path)
    elif suffix == ".csv":
        dataset.to_csv(path, index=False)
    else:
        dataset.to_json(path, lines=suffix == ".jsonl")
    examples = load_examples(_hf(path), seed=0)
    assert [e.task_key for e in examples] == ["tasks/0", "tasks/1"]
    assert examples[0].prompt == (
        Message(role="system", content=DEFAULT_SYSTEM_PROMPT),
        Message(role="user", content="What is 2+2?"),
    )
    assert [e.answer for e in examples] == ["4", "hi"]
    assert examples[1].metadata == {"level": 2, "source": "hf", "verifier": "exact_match"}


def test_hf_column_mapping_message_prompts_limit_and_a_glob(tmp_path):
    columns = {"question": [_CHATS[1][1:], _CHATS[1], [{"role": "user", "content": "x"}]], "solution": [1, 2, 3]}
    _dataset(columns).to_parquet(tmp_path / "train-0.parquet")
    _dataset({"question": [[{"role": "user", "content": "later"}]], "solution": [4]}).to_parquet(
        tmp_path / "train-1.parquet"
    )
    config = _hf(
        tmp_path / "train-*.parquet", prompt_field="question", answer_field="solution", limit=3, verifier="math"
    )
    examples = load_examples(config, seed=0)
    assert [e.answer for e in examples] == ["1", "2", "3"]
    assert examples[0].prompt[1:] == (Message(role="user", content="Say hi"),)
    assert [m.content for m in examples[1].prompt] == ["Be terse.", "Say hi"]  # the row's own system message is kept
    assert examples[0].metadata == {"source": "hf", "verifier": "math"}
    assert (
        len(load_examples(_hf(tmp_path / "train-*.parquet", prompt_field="question", answer_field="solution"), seed=0))
        == 4
    )


def test_hf_messages_column_cuts_the_final_assistant_message_into_the_answer(tmp_path):
    _dataset({"messages": [_CHATS[0]]}).to_parquet(tmp_path / "chat.parquet")
    (example,) = load_examples(_hf(tmp_path / "chat.parquet", messages_field="messages", system_prompt=""), seed=0)
    assert example.prompt == (Message(role="user", content="What is 2+2?"),)  # the policy never sees the answer
    assert example.answer == "4"

    _dataset({"messages": _CHATS, "answer": ["four", "hi"]}).to_parquet(tmp_path / "both.parquet")
    examples = load_examples(_hf(tmp_path / "both.parquet", messages_field="messages"), seed=0)
    assert [e.answer for e in examples] == ["four", "hi"]  # an answer column wins over the assistant message
    assert examples[0].prompt[-1] == Message(role="user", content="What is 2+2?")

    _dataset({"messages": _CHATS}).to_parquet(tmp_path / "open.parquet")
    with pytest.raises(DataError) as info:
        load_examples(_hf(tmp_path / "open.parquet", messages_field="messages"), seed=0)
    assert str(info.value) == (
        f"{tmp_path / 'open.parquet'} row 1: column 'messages': the conversation does not end with an assistant "
        "message and the dataset has no column 'answer' (data.answer_field) to take the answer from"
    )


def test_hf_saved_dataset_folders_and_their_splits(tmp_path):
    import datasets

    _dataset(_ROWS).save_to_disk(tmp_path / "saved")
    assert [e.task_key for e in load_examples(_hf(tmp_path / "saved"), seed=0)] == ["saved/0", "saved/1"]

    test = _dataset({"prompt": ["held out"], "answer": ["x"], "level": [3]})
    datasets.DatasetDict(train=_dataset(_ROWS), test=test).save_to_disk(tmp_path / "splits")
    assert len(load_examples(_hf(tmp_path / "splits"), seed=0)) == 2
    (held_out,) = load_examples(_hf(tmp_path / "splits", split="test"), seed=0)
    assert held_out.task_key == "splits/test/0" and held_out.answer == "x"
    with pytest.raises(DataError, match=r"^data\.split = 'dev': .*splits has splits train, test$"):
        load_examples(_hf(tmp_path / "splits", split="dev"), seed=0)

    folder = tmp_path / "repo" / "data"  # a downloaded Hub dataset repository: split names from the file names
    folder.mkdir(parents=True)
    _dataset(_ROWS).to_parquet(folder / "train-00000-of-00001.parquet")
    test.to_parquet(folder / "test-00000-of-00001.parquet")
    assert [e.answer for e in load_examples(_hf(folder, split="test"), seed=0)] == ["x"]


@pytest.mark.parametrize(
    ("columns", "kwargs", "expected"),
    [
        (
            {"question": ["a"], "answer": ["b"]},
            {},
            "no column 'prompt' (data.prompt_field); the dataset has: question, answer",
        ),
        ({"prompt": ["a"]}, {}, "no column 'answer' (data.answer_field); the dataset has: prompt"),
        ({"prompt": ["a"]}, {"messages_column": "chat"}, "no column 'chat' (data.messages_field)"),
        ({"prompt": ["a", "b"], "answer": ["x", None]}, {}, "row 1: column 'answer' must be a string or a number"),
        ({"prompt": ["a", " "], "answer": ["x", "y"]}, {}, "row 1: column 'prompt': empty prompt"),
        ({"prompt": [[{"role": "bot", "content": "x"}]], "answer": ["y"]}, {}, "row 0: column 'prompt': message 0"),
        ({"chat": [[{"role": "assistant", "content": "x"}]]}, {"messages_column": "chat"}, "only an assistant message"),
        ({"chat": ["a"], "answer": ["b"]}, {"messages_column": "chat"}, "row 0: column 'chat': must be a list of"),
    ],
)
def test_hf_bad_data_is_one_line_naming_file_row_and_column(tmp_path, columns, kwargs, expected):
    path = tmp_path / "tasks.parquet"
    _dataset(columns).to_parquet(path)
    with pytest.raises(DataError) as info:
        load_examples(_hf(path, **kwargs), seed=0)
    assert str(info.value).startswith(str(path)) and expected in str(info.value)
    assert "\n" not in str(info.value)


def test_hf_bad_paths(tmp_path):
    (tmp_path / "tasks.txt").write_text("hello\n")
    (tmp_path / "broken.parquet").write_text("not parquet\n")
    (tmp_path / "empty.csv").write_text("prompt,answer\n")
    for path, message in [
        (tmp_path / "nope.parquet", r"^data\.path: not found: .*nope\.parquet$"),
        (tmp_path / "*.arrow", r"^data\.path: no file matches .*\*\.arrow$"),
        (
            tmp_path / "tasks.txt",
            r"^data\.path: cannot tell the format of .*tasks\.txt from its suffix \(known: .parquet",
        ),
        (tmp_path / "broken.parquet", r"^data\.path: cannot read .*broken\.parquet as a dataset: "),
        (tmp_path / "empty.csv", r"^data\.path: cannot read .*empty\.csv as a dataset: .*no data"),
    ]:
        with pytest.raises(DataError, match=message):
            load_examples(_hf(path), seed=0)


def test_hf_data_section_from_a_recipe(tmp_path):
    config = load_config(None, ['data.type="hf"', "data.path=x.parquet", "data.messages_field=messages"])
    assert config.data == HfDataConfig(path="x.parquet", messages_field="messages")
