"""Answer extraction: find the final answer in a completion's text, in the format the prompt asked for.

Owns only locating the answer; whether it is right is the verifiers' job. ``None`` means the completion did not
give an answer in the requested format (a format error), which is different from a wrong answer. Also owns
`strip_reasoning`: what a reasoning block (``<think>...</think>``) says is never a final answer, in any format.
"""

from __future__ import annotations

import re
from typing import Literal

AnswerFormat = Literal["answer_tag", "last_line", "last_number"]

# The content of a complete tag pair that holds no other opening tag, so "<answer>a<answer>b</answer>" gives "b".
_ANSWER_TAG = re.compile(r"<answer>((?:(?!<answer>).)*?)</answer>", re.DOTALL)
# A signed integer or decimal, with optional thousands separators ("1,234.5"); a trailing full stop is not a decimal.
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")
# An opening or closing tag of a reasoning block, in the spellings chat templates and prompts use.
_REASONING_TAG = re.compile(r"<\s*(/?)\s*(?:think|thinking|reasoning)\s*>", re.IGNORECASE)


def extract_answer(text: str, answer_format: AnswerFormat) -> str | None:
    """The final answer in ``text`` outside reasoning blocks, stripped, or None if there is none.

    ``answer_tag``: the content of the complete ``<answer>...</answer>`` pairs, which must agree (up to runs of
    space): two different tagged answers are no answer (else "the last one wins" pays for a hedge); an empty tag is
    no answer (else a format reward would pay for ``<answer></answer>``). ``last_line``: the last line that is not
    blank. ``last_number``: the last number anywhere in the text, thousands separators removed (lm-eval's
    "flexible extract"; lenient, for numeric tasks and models too small to follow a format instruction).
    """
    text = strip_reasoning(text)
    if answer_format == "answer_tag":
        tagged = _ANSWER_TAG.findall(text)
        is_consistent = len({" ".join(content.split()) for content in tagged}) == 1
        answer = tagged[-1].strip() if tagged and is_consistent else ""
    elif answer_format == "last_line":
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        answer = lines[-1] if lines else ""
    elif answer_format == "last_number":
        numbers = _NUMBER.findall(text)
        answer = numbers[-1].replace(",", "") if numbers else ""
    else:
        raise ValueError(
            f"extract_answer: unknown answer format {answer_format!r} (answer_tag, last_line or last_number)"
        )
    return answer or None


def strip_reasoning(text: str) -> str:
    """``text`` without its reasoning blocks (``<think>``, ``<thinking>``, ``<reasoning>``, any case).

    A block that is never closed runs to the end (a completion cut off while thinking has no final answer). A
    closing tag that comes before any opening one ends a block opened by the chat template in the prompt, so the
    text before it is reasoning too; later unmatched closing tags are left as text. Nested blocks count as one.
    """
    if _REASONING_TAG.search(text) is None:
        return text
    kept: list[str] = []
    depth = 0
    position = 0  # start of the text not yet kept or dropped
    for index, match in enumerate(_REASONING_TAG.finditer(text)):
        is_closing = match.group(1) == "/"
        if not is_closing:
            if depth == 0:
                kept.append(text[position : match.start()])
            depth += 1
        elif depth > 0:
            depth -= 1
            if depth == 0:
                position = match.end()
        elif index == 0:  # the template opened the block: everything so far was reasoning
            position = match.end()
        # an unmatched closing tag later on is ordinary text, kept with what surrounds it
    if depth == 0:
        kept.append(text[position:])
    return "".join(kept)
