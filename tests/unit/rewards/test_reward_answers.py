"""extract_answer: the last complete <answer> tag, or the last non-blank line; None when there is no answer."""

from __future__ import annotations

import pytest

from sharpen.rewards import extract_answer


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("think... <answer>19</answer>", "19"),
        ("<answer> 19 \n</answer>", "19"),
        ("<answer>1</answer> no wait <answer>2</answer>", None),  # two different answers: a hedge, not the last
        ("<answer>2</answer> so <answer> 2 </answer>", "2"),  # the same answer twice
        ("<think><answer>1</answer></think><answer>2</answer>", "2"),  # a reasoning block's answer is not final
        ("<answer>2</answer><think>maybe <answer>1</answer>", "2"),  # an unclosed block runs to the end
        ("<answer>1</answer> then <answer>2", "1"),  # the last *complete* tag
        ("<answer>a<answer>b</answer>", "b"),
        ("<answer>multi\nline</answer>", "multi\nline"),
        ("no tags at all", None),
        ("<answer>19", None),
        ("19</answer>", None),
        ("<answer>  </answer>", None),  # an empty tag is no answer
        ("<answer>1</answer><answer></answer>", None),  # the last tag is the answer, even when empty
        ("<ANSWER>19</ANSWER>", None),  # tags are exact
        ("", None),
    ],
)
def test_answer_tag(text, expected):
    assert extract_answer(text, "answer_tag") == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("reasoning\n  42  \n\n   \n", "42"),
        ("single", "single"),
        ("a\r\nb\r\n", "b"),
        ("", None),
        (" \n\t\n", None),
    ],
)
def test_last_line(text, expected):
    assert extract_answer(text, "last_line") == expected


def test_unknown_format():
    with pytest.raises(ValueError, match="unknown answer format 'xml'"):
        extract_answer("x", "xml")  # type: ignore[arg-type]
