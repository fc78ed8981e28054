"""Data sources: turn a data config into a list of `Example`s (reasoning-gym tasks, a JSONL file, or a Hugging Face
dataset from local files).

This module owns reading and validating task data and building each example's prompt (with the system prompt).
It does not order or batch examples (`sampler.py`), tokenize them (`chat.py`) or score answers (`sharpen.rewards`);
it only puts into `Example.metadata` what a reward function needs to score from the example alone.
Every problem with the user's data is a `DataError` with one line naming where the problem is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import glob
import io
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from sharpen.config.schema import HfDataConfig, JsonlDataConfig, ReasoningGymDataConfig
from sharpen.types import Example, ImagePart, Message, TextPart

DEFAULT_SYSTEM_PROMPT = (
    "Think briefly, then give the final answer inside <answer></answer> tags, for example <answer>42</answer>."
)
"""System prompt used when the data config leaves ``system_prompt`` unset: the ``answer_tag`` answer format."""

_ROLES = ("system", "user", "assistant", "tool")


class DataError(ValueError):
    """A problem with the user's data or data config; the message is one line that says where and what."""


def load_examples(config: ReasoningGymDataConfig | JsonlDataConfig | HfDataConfig, *, seed: int) -> list[Example]:
    """All examples of a data source, in source order (the sampler shuffles). The same seed gives the same list."""
    match config:
        case ReasoningGymDataConfig():
            return _load_reasoning_gym(config, seed=seed)
        case JsonlDataConfig():
            return _load_jsonl(config)
        case HfDataConfig():
            return _load_hf(config)


def _with_system_prompt(system_prompt: str | None, messages: list[Message]) -> tuple[Message, ...]:
    """Prepend the system prompt (None: the default; "": none), unless the messages bring their own."""
    text = DEFAULT_SYSTEM_PROMPT if system_prompt is None else system_prompt
    if not text or (messages and messages[0].role == "system"):
        return tuple(messages)
    return (Message(role="system", content=text), *messages)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# --- reasoning-gym -------------------------------------------------------------------------------------------


def _load_reasoning_gym(config: ReasoningGymDataConfig, *, seed: int) -> list[Example]:
    import reasoning_gym
    from reasoning_gym.factory import DATASETS  # the registry; reasoning_gym exports no function that lists it

    task = config.task
    if task not in DATASETS:
        close = difflib.get_close_matches(task, DATASETS, n=3, cutoff=0.6)
        hint = (
            f"did you mean {', '.join(close)}?"
            if close
            else f"{len(DATASETS)} known, e.g. {', '.join(sorted(DATASETS)[:6])}"
        )
        raise DataError(f"data.task: unknown reasoning-gym task {task!r} ({hint})")
    accepted = [f.name for f in dataclasses.fields(DATASETS[task][1]) if f.name not in ("seed", "size")]
    for key in config.task_config:
        if key in ("seed", "size"):
            raise DataError(f"data.task_config: {key!r} is set by {'run.seed' if key == 'seed' else 'data.size'}")
        if key not in accepted:
            raise DataError(
                f"data.task_config: reasoning-gym task {task!r} has no option {key!r} (options: {', '.join(accepted)})"
            )

    dataset_kwargs = {**config.task_config, "seed": seed, "size": config.size}
    try:
        dataset = reasoning_gym.create_dataset(task, **dataset_kwargs)
        entries = [dataset[index] for index in range(config.size)]
    except Exception as exc:  # reasoning-gym validates with asserts and fails inside generation: report it as config
        raise DataError(
            f"data.task_config: reasoning-gym task {task!r} failed with {config.task_config}: {_one_line(exc)}"
        ) from exc
    safe_entries = [to_json_safe(entry) for entry in entries]
    _check_scorable_from_json(dataset, entries, safe_entries, task=task)

    examples = []
    for index, (entry, safe_entry) in enumerate(zip(entries, safe_entries, strict=True)):
        metadata = {
            "source": "reasoning_gym",
            "task": task,
            "dataset_kwargs": to_json_safe(dataset_kwargs),
            "entry": safe_entry,
        }
        question = Message(role="user", content=str(entry["question"]))
        examples.append(
            Example(
                task_key=f"{task}/{index}",
                prompt=_with_system_prompt(config.system_prompt, [question]),
                # Some tasks (e.g. graph_color) have no single oracle answer; their scorer checks the metadata.
                answer=None if entry["answer"] is None else str(entry["answer"]),
                metadata=metadata,
            )
        )
    return examples


def _check_scorable_from_json(dataset: Any, entries: list[dict], safe_entries: list[dict], *, task: str) -> None:
    """Rewards score from the JSON copy of an entry (it crosses processes and run files); refuse tasks whose
    scorer needs the original Python objects (e.g. arc_agi compares tuples of tuples, which JSON makes lists)."""
    for entry, safe_entry in zip(entries, safe_entries, strict=True):
        if isinstance(entry["answer"], str):
            if dataset.score_answer(entry["answer"], safe_entry) != dataset.score_answer(entry["answer"], entry):
                raise DataError(
                    f"data.task: reasoning-gym task {task!r} cannot be scored from a JSON copy of its entries"
                )
            return


def to_json_safe(value: Any) -> Any:
    """A copy of ``value`` made of dict/list/str/int/float/bool/None that survives a JSON round trip unchanged:
    tuples become lists, sets sorted lists, dict keys strings, numpy scalars Python numbers, anything else str."""
    if value is None or isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, dict):
        return {str(key): to_json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [to_json_safe(item) for item in value]
    if isinstance(value, set | frozenset):
        return [to_json_safe(item) for item in sorted(value, key=repr)]
    if isinstance(value, np.generic | np.ndarray):
        return to_json_safe(value.tolist())
    return str(value)


# --- JSONL ---------------------------------------------------------------------------------------------------


def _load_jsonl(config: JsonlDataConfig) -> list[Example]:
    path = Path(config.path)
    if not path.exists():
        raise DataError(f"data.path: file not found: {path}")
    if not path.is_file():
        raise DataError(f"data.path: not a file: {path}")

    examples = []
    for line_index, raw_line in enumerate(path.read_bytes().splitlines()):
        where = f"{path}:{line_index + 1}"
        try:
            line = raw_line.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(f"{where}: not UTF-8 text ({_one_line(exc)})") from exc
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from exc
        if not isinstance(record, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
        task_key = f"{path.stem}/{line_index}"
        examples.append(_example_from_record(record, config, task_key=task_key, where=where, folder=path.parent))
    if not examples:
        raise DataError(f"{path}: empty file (no examples)")
    return examples


IMAGES_FIELD = "images"
"""The JSONL field that lists a row's image files (paths relative to the JSONL file's folder)."""


def _example_from_record(
    record: dict[str, Any], config: JsonlDataConfig, *, task_key: str, where: str, folder: Path
) -> Example:
    for field, config_key in ((config.prompt_field, "prompt_field"), (config.answer_field, "answer_field")):
        if field not in record:
            raise DataError(
                f"{where}: missing field {field!r} (data.{config_key}); the object has: {', '.join(record) or 'none'}"
            )
    messages = _parse_prompt(record[config.prompt_field], where=f"{where}: field {config.prompt_field!r}")
    if IMAGES_FIELD in record:
        images = _read_images(record[IMAGES_FIELD], folder, where=f"{where}: field {IMAGES_FIELD!r}")
        messages = _with_images(messages, images, where=f"{where}: field {IMAGES_FIELD!r}")
    answer = _checked_answer(record[config.answer_field], where=f"{where}: field {config.answer_field!r}")
    used = (config.prompt_field, config.answer_field, IMAGES_FIELD)
    metadata = {key: value for key, value in record.items() if key not in used}
    return _file_example(config, task_key=task_key, messages=messages, answer=answer, metadata=metadata)


def _read_images(paths: Any, folder: Path, *, where: str) -> tuple[ImagePart, ...]:
    """The image files a row lists, read into memory (recordings and task hashes then hold their digests, and a
    missing file fails at load, not mid-run); each must be one PIL can decode."""
    from PIL import Image, UnidentifiedImageError

    if not isinstance(paths, list) or not all(isinstance(p, str) and p.strip() for p in paths):
        raise DataError(f"{where}: must be a list of image file paths, got {json.dumps(paths)[:60]}")
    images = []
    for index, relative in enumerate(paths):
        path = folder / relative  # an absolute path stays as it is
        try:
            data = path.read_bytes()
            with Image.open(io.BytesIO(data)) as image:
                image.verify()  # decodes the headers and checks the file's structure, without keeping pixels
        except FileNotFoundError:
            raise DataError(f"{where}: image {index} not found: {path}") from None
        except UnidentifiedImageError:  # its message names the in-memory buffer, not the file
            raise DataError(f"{where}: image {index} ({path}) is not an image file PIL can decode") from None
        except (OSError, SyntaxError) as exc:  # unreadable file, or a broken image (PIL's verify raises either)
            raise DataError(f"{where}: image {index} ({path}) cannot be read as an image: {_one_line(exc)}") from exc
        images.append(ImagePart(data=data))
    return tuple(images)


def _with_images(messages: list[Message], images: tuple[ImagePart, ...], *, where: str) -> list[Message]:
    """``messages`` with ``images`` put before the text of the first user message (Qwen2-VL's usual order)."""
    if not images:
        return messages
    first_user = next((index for index, message in enumerate(messages) if message.role == "user"), None)
    if first_user is None:
        raise DataError(f"{where}: the prompt has no user message to put the images in")
    message = messages[first_user]
    content = (*images, TextPart(text=message.text))
    return [*messages[:first_user], Message(role="user", content=content), *messages[first_user + 1 :]]


def _file_example(
    config: JsonlDataConfig | HfDataConfig, *, task_key: str, messages: list[Message], answer: str, metadata: dict
) -> Example:
    """An example of a file source: the remaining fields as metadata, with the source and the configured verifier."""
    return Example(
        task_key=task_key,
        prompt=_with_system_prompt(config.system_prompt, messages),
        answer=answer,
        metadata={**metadata, "source": config.type, "verifier": config.verifier},
    )


def _checked_answer(answer: Any, *, where: str) -> str:
    if not isinstance(answer, str | int | float):
        raise DataError(f"{where} must be a string or a number, got {answer!r:.40}")
    return str(answer)


def _parse_prompt(prompt: Any, *, where: str) -> list[Message]:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"{where}: empty prompt")
        return [Message(role="user", content=prompt)]
    if not isinstance(prompt, list) or not prompt:
        raise DataError(f"{where}: must be a string or a non-empty list of {{role, content}} messages")
    messages = []
    for number, message in enumerate(prompt):
        if (
            not isinstance(message, dict)
            or set(message) != {"role", "content"}
            or message["role"] not in _ROLES
            or not isinstance(message["content"], str)
        ):
            raise DataError(
                f"{where}: message {number} must be {{role, content}} with role one of {', '.join(_ROLES)} "
                f"and string content, got {json.dumps(message)[:60]}"
            )
        messages.append(Message(role=message["role"], content=message["content"]))
    return messages


# --- Hugging Face datasets (local files and saved folders) ---------------------------------------------------

_HF_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".json": "json", ".jsonl": "json", ".csv": "csv"}
"""The `datasets` builder for each data-file suffix."""


def _load_hf(config: HfDataConfig) -> list[Example]:
    rows, columns, name, where = _read_hf_rows(config)
    answer_from_messages = config.messages_field is not None and config.answer_field not in columns
    needed = [
        (config.messages_field, "messages_field")
        if config.messages_field is not None
        else (config.prompt_field, "prompt_field"),
        *([] if answer_from_messages else [(config.answer_field, "answer_field")]),
    ]
    for column, config_key in needed:
        if column not in columns:
            raise DataError(
                f"{where}: no column {column!r} (data.{config_key}); the dataset has: {', '.join(columns) or 'none'}"
            )
    return [
        _example_from_row(row, config, task_key=f"{name}/{index}", where=f"{where} row {index}")
        for index, row in enumerate(rows)
    ]


def _example_from_row(row: dict[str, Any], config: HfDataConfig, *, task_key: str, where: str) -> Example:
    """One example from one row. With messages_field, a conversation's last assistant message is cut from the
    prompt (the policy must not see it) and is the answer where the dataset has no answer_field column."""
    if config.messages_field is None:
        used = [config.prompt_field]
        messages = _parse_prompt(_without_nulls(row[config.prompt_field]), where=f"{where}: column {used[0]!r}")
        final = None
    else:
        used = [config.messages_field]
        where_messages = f"{where}: column {config.messages_field!r}"
        conversation = row[config.messages_field]
        if not isinstance(conversation, list):
            raise DataError(f"{where_messages}: must be a list of {{role, content}} messages")
        messages = _parse_prompt(_without_nulls(conversation), where=where_messages)
        final = messages.pop() if messages[-1].role == "assistant" else None
        if not messages:
            raise DataError(f"{where_messages}: only an assistant message, no prompt")
    if config.answer_field in row:
        used.append(config.answer_field)
        answer = _checked_answer(row[config.answer_field], where=f"{where}: column {config.answer_field!r}")
    elif final is not None:
        answer = final.text
    else:
        raise DataError(
            f"{where}: column {config.messages_field!r}: the conversation does not end with an assistant message "
            f"and the dataset has no column {config.answer_field!r} (data.answer_field) to take the answer from"
        )
    metadata = {key: to_json_safe(value) for key, value in row.items() if key not in used}
    return _file_example(config, task_key=task_key, messages=messages, answer=answer, metadata=metadata)


def _without_nulls(prompt: Any) -> Any:
    """Arrow stores a list of messages as structs with every key any message has: drop the keys that are null."""
    if not isinstance(prompt, list):
        return prompt
    return [
        {key: value for key, value in message.items() if value is not None} if isinstance(message, dict) else message
        for message in prompt
    ]


def _read_hf_rows(config: HfDataConfig) -> tuple[list[dict[str, Any]], list[str], str, str]:
    """The rows of the configured split (the first ``limit``), its column names, the task-key prefix, and where
    the rows come from for error messages."""
    import datasets  # slow to import (~1 s): only for this source

    path = Path(config.path)
    is_glob = any(char in config.path for char in "*?[")
    if is_glob and not glob.glob(config.path):
        raise DataError(f"data.path: no file matches {config.path}")
    if not is_glob and not path.exists():
        raise DataError(f"data.path: not found: {path}")
    builder = None
    if is_glob or path.is_file():
        builder = _HF_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise DataError(
                f"data.path: cannot tell the format of {path} from its suffix (known: {', '.join(_HF_BUILDERS)})"
            )
    # Read into memory with a throw-away cache: the rows become Examples at once, so an Arrow copy of the user's
    # files under ~/.cache would only go stale.
    with tempfile.TemporaryDirectory(prefix="sharpen-hf-") as cache_dir, _quiet_progress_bars(datasets):
        try:
            if builder is not None:
                loaded = datasets.load_dataset(
                    builder, data_files=config.path, cache_dir=cache_dir, keep_in_memory=True
                )
            elif (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():  # save_to_disk
                loaded = datasets.load_from_disk(str(path), keep_in_memory=True)
            else:  # a folder of data files, split names read from the file names
                loaded = datasets.load_dataset(str(path), cache_dir=cache_dir, keep_in_memory=True)
        except Exception as exc:  # datasets raises many kinds of errors on unreadable input: report it as data
            raise DataError(f"data.path: cannot read {config.path} as a dataset: {_one_line(exc)}") from exc
        name, where = (path.name if path.is_dir() else path.stem), config.path
        if not isinstance(loaded, datasets.DatasetDict):  # a saved Dataset
            dataset = loaded
        elif len(loaded) == 1:  # files, or a folder or saved DatasetDict of one split: whatever its name
            [dataset] = loaded.values()
        elif config.split in loaded:
            dataset = loaded[config.split]
            name, where = f"{name}/{config.split}", f"{config.path} [{config.split}]"
        else:
            raise DataError(f"data.split = {config.split!r}: {config.path} has splits {', '.join(map(str, loaded))}")
        if config.limit is not None:
            dataset = dataset.select(range(min(config.limit, len(dataset))))
        return dataset.to_list(), list(dataset.column_names), name, where


@contextlib.contextmanager
def _quiet_progress_bars(datasets: Any) -> Iterator[None]:
    """No "Generating train split" bars on the terminal for a few local files; restored afterwards."""
    were_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not were_disabled:
            datasets.enable_progress_bars()
