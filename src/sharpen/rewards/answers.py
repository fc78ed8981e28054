"""Answer extraction: find the final answer in a completion's text, in the format the prompt asked for.

Owns only locating the answer; whether it is right is the verifiers' job. ``None`` means the completion did not
give an answer in the requested format (a format error), which is different from a wrong answer.
"""

from __future__ import annotations

import re
from typing import Literal

AnswerFormat = Literal["answer_tag", "last_line", "last_number"]

# The content of a complete tag pair that holds no other opening tag, so "<answer>a<answer>b</answer>" gives "b".
_ANSWER_TAG = re.compile(r"<answer>((?:(?!<answer>).)*?)</answer>", re.DOTALL)
# A signed integer or decimal, with optional thousands separators ("1,234.5"); a trailing full stop is not a decimal.
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


def extract_answer(text: str, answer_format: AnswerFormat) -> str | None:
    """The final answer in ``text``, stripped, or None if there is none.

    ``answer_tag``: the content of the last complete ``<answer>...</answer>`` pair; an empty tag is no answer (else
    a format reward would pay for ``<answer></answer>``). ``last_line``: the last line that is not blank.
    ``last_number``: the last number anywhere in the text, thousands separators removed (lm-eval's "flexible
    extract"; lenient, for numeric tasks and models too small to follow a format instruction).
    """
    if answer_format == "answer_tag":
        matches = _ANSWER_TAG.findall(text)
        answer = matches[-1].strip() if matches else ""
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
