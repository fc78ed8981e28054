"""JSONL rows with images: the ``images`` field's files (relative to the JSONL file) become image parts before the
text of the first user message, read into memory; a missing or unreadable file is one DataError naming the row and
the path."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from sharpen.config.schema import JsonlDataConfig
from sharpen.data import DataError, load_examples
from sharpen.types import ImagePart, Message, TextPart


def save_png(path: Path, rgb: tuple[int, int, int] = (200, 40, 40)) -> bytes:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (30, 20), rgb).save(path)
    return path.read_bytes()


def write_rows(folder: Path, *rows: dict) -> JsonlDataConfig:
    path = folder / "tasks.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return JsonlDataConfig(path=str(path), system_prompt="")


def test_images_go_before_the_text_of_the_first_user_message(tmp_path: Path) -> None:
    red = save_png(tmp_path / "pics" / "red.png")
    blue = save_png(tmp_path / "elsewhere" / "blue.png", (40, 40, 200))
    conversation = [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Which colours?"},
        {"role": "assistant", "content": "Show me."},
        {"role": "user", "content": "These."},
    ]
    config = write_rows(
        tmp_path,
        {"prompt": "What colour?", "images": ["pics/red.png"], "answer": "red", "level": 1},
        {"prompt": conversation, "images": ["pics/red.png", str(tmp_path / "elsewhere" / "blue.png")], "answer": "x"},
        {"prompt": "No picture.", "images": [], "answer": "y"},
    )
    single, several, text_only = load_examples(config, seed=0)

    assert single.prompt == (Message(role="user", content=(ImagePart(data=red), TextPart(text="What colour?"))),)
    assert single.metadata == {"level": 1, "source": "jsonl", "verifier": "exact_match"}  # images are prompt
    assert [m.role for m in several.prompt] == ["system", "user", "assistant", "user"]
    assert several.prompt[1].content == (ImagePart(data=red), ImagePart(data=blue), TextPart(text="Which colours?"))
    assert several.prompt[3].content == "These."  # only the first user message shows the images
    assert text_only.prompt == (Message(role="user", content="No picture."),)
    # recordings and task hashes hold the image's digest, so another image is another task
    assert single.prompt[0].to_json()[0] == {  # type: ignore[index]
        "type": "image",
        "sha256": hashlib.sha256(red).hexdigest(),
        "num_bytes": len(red),
    }
    save_png(tmp_path / "pics" / "red.png", (0, 200, 0))
    [changed, *_] = load_examples(config, seed=0)
    assert changed.task_hash != single.task_hash


@pytest.mark.parametrize(
    ("images", "expected"),
    [
        (["pics/nope.png"], r"^.*tasks\.jsonl:2: field 'images': image 0 not found: .*pics/nope\.png$"),
        (
            ["pics/ok.png", "pics/fake.png"],
            r"^.*tasks\.jsonl:2: field 'images': image 1 \(.*pics/fake\.png\) is not an",
        ),
        (["pics/cut.png"], r"^.*tasks\.jsonl:2: field 'images': image 0 \(.*pics/cut\.png\) cannot be read as an ima"),
        (["pics"], r"^.*tasks\.jsonl:2: field 'images': image 0 \(.*pics\) cannot be read as an image: IsADirectoryE"),
        (
            "pics/ok.png",
            r"^.*tasks\.jsonl:2: field 'images': must be a list of image file paths, got \"pics/ok\.png\"$",
        ),
        ([""], r"^.*tasks\.jsonl:2: field 'images': must be a list of image file paths, got \[\"\"\]$"),
    ],
)
def test_a_bad_image_is_one_data_error_naming_the_row_and_the_path(tmp_path: Path, images, expected) -> None:
    ok = save_png(tmp_path / "pics" / "ok.png")
    (tmp_path / "pics" / "fake.png").write_text("not an image")
    (tmp_path / "pics" / "cut.png").write_bytes(ok[: len(ok) // 2])
    config = write_rows(
        tmp_path,
        {"prompt": "a", "images": ["pics/ok.png"], "answer": "b"},
        {"prompt": "a", "images": images, "answer": "b"},
    )
    with pytest.raises(DataError, match=expected) as caught:
        load_examples(config, seed=0)
    assert "\n" not in str(caught.value)


def test_images_need_a_user_message(tmp_path: Path) -> None:
    save_png(tmp_path / "ok.png")
    config = write_rows(tmp_path, {"prompt": [{"role": "system", "content": "s"}], "images": ["ok.png"], "answer": "b"})
    with pytest.raises(DataError, match=r"tasks\.jsonl:1: field 'images': the prompt has no user message to put"):
        load_examples(config, seed=0)
