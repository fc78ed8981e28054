"""Strict answer extraction for math: the one final answer a completion commits to, or a format error.

Owns locating the answer and refusing completions that do not commit to one (a defense against reward hacking):
the answer is the content of a ``\\boxed{...}`` / ``\\fbox{...}`` (balanced braces), an ``<answer>...</answer>``
tag, or a last line starting with ``Answer:`` / ``Final answer:``. Several *different* such answers, an unclosed
box, an overlong answer, or none at all is a format error; there is no "last number in the prose" fallback. Also
owns `is_hedged`, the textual check for answers that name more than one value ("3 or 4").

Deliberately does not judge whether answers are mathematically equal (that is `math_verify.judge_answers`, in a
worker process); two textually different answers are returned as two, and the judge decides whether they agree.
"""

from __future__ import annotations

import re

MAX_ANSWER_CHARS = 1_000
"""Longest answer judged: longer ones are format errors, so sympy never parses an unbounded expression."""
MAX_DISTINCT_ANSWERS = 4
"""More textually different answers than this is a format error without asking the judge (nobody hedges
legitimately with five boxes, and each one costs a sympy parse)."""

_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])\s*\{")
_ANSWER_LINE = re.compile(r"^[*#>\s]*(?:final\s+)?answer[*\s]*:(?P<answer>.*)$", re.IGNORECASE)
_MATH_DELIMITERS = (("$$", "$$"), ("\\[", "\\]"), ("\\(", "\\)"), ("$", "$"))
# Words that offer a choice of values. math-verify keeps only the first number of "5 \text{ or maybe 6}" (it
# reads the text as a unit), so a policy could hedge inside one box unless this check says wrong first.
_HEDGE = re.compile(
    r"\b(?:or|either|maybe|possibly|perhaps|probably|otherwise|unless)\b|\\(?:lor|vee)(?![A-Za-z])", re.I
)
# Text with a number in it ("5 \text{ (other candidate: 6)}"): math-verify drops it as a unit, number and all.
_TEXT_WITH_DIGIT = re.compile(r"\\(?:text|textbf|textit|textrm|mbox|mathrm)\s*\{[^{}]*\d")


def find_final_answers(
    text: str, *, max_answer_chars: int = MAX_ANSWER_CHARS, accept_bare: bool = False
) -> tuple[str, ...] | None:
    """The distinct answers ``text`` gives, the final one first; None for a format error.

    ``accept_bare``: when the text has no box, tag or answer line, take the whole text as the answer (for text that
    was already extracted, e.g. by the `Rubric`); boxes inside it are still found and checked.
    """
    boxes = _boxed_answers(text, max_answer_chars)
    if boxes is None:
        return None  # an unclosed or overlong box
    found = [*boxes, *_declared_answers(text)]
    if not found and accept_bare:
        found = [(0, _clean(text))]
    answers = [answer for _, answer in sorted(found, key=lambda item: item[0]) if answer]
    distinct = tuple(dict.fromkeys(reversed(answers)))  # the final answer first, repeats once
    if not distinct or len(distinct) > MAX_DISTINCT_ANSWERS or any(len(a) > max_answer_chars for a in distinct):
        return None
    return distinct


def is_hedged(answer: str, reference: str, *, allow_or: bool = False) -> bool:
    """True when ``answer`` offers a choice of values ("3 or 4", "5 \\text{ (or 6)}") and ``reference`` does not.

    ``allow_or``: the reference is a set of several values, which "x = 3 or x = 4" lists rather than hedges (a number
    inside text is still a hedge: math-verify would drop it).
    """
    patterns = (_TEXT_WITH_DIGIT,) if allow_or else (_HEDGE, _TEXT_WITH_DIGIT)
    return any(pattern.search(answer) and not pattern.search(reference) for pattern in patterns)


def _boxed_answers(text: str, max_answer_chars: int) -> list[tuple[int, str]] | None:
    """(position, content) of each outermost box; None if one is unclosed or longer than the cap."""
    found: list[tuple[int, str]] = []
    position = 0
    while (match := _BOX_OPEN.search(text, position)) is not None:
        end = _closing_brace(text, match.end(), max_answer_chars)
        if end is None:
            return None
        found.append((match.start(), _clean(text[match.end() : end])))
        position = end + 1  # nested boxes are inside this one's content: the scan stays linear
    return found


def _closing_brace(text: str, start: int, max_chars: int) -> int | None:
    """Index of the brace closing the group opened just before ``start``, looking at most ``max_chars`` ahead."""
    depth = 0
    index = start
    stop = min(len(text), start + max_chars + 1)
    while index < stop:
        char = text[index]
        if char == "\\":
            index += 2  # an escaped character (\{ \} \\) never opens or closes a group
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            if depth == 0:
                return index
            depth -= 1
        index += 1
    return None


def _declared_answers(text: str) -> list[tuple[int, str]]:
    """(position, content) of each ``<answer>`` tag pair and of a final ``Answer:`` line that holds no box."""
    found: list[tuple[int, str]] = []
    # str.find rather than a regex: many unclosed tags must not make the search quadratic.
    start = text.find("<answer>")
    while start != -1:
        close = text.find("</answer>", start)
        if close == -1:
            break  # an unclosed tag (a truncated completion, or prose naming the tag) declares nothing
        found.append((start, text[start + len("<answer>") : close].rsplit("<answer>", 1)[-1]))
        start = text.find("<answer>", close)
    last_line = text.rstrip().rsplit("\n", 1)[-1]
    if (match := _ANSWER_LINE.match(last_line)) is not None:
        found.append((len(text), match.group("answer")))
    # A declaration holding a box ("Answer: so it is \boxed{5}") points at that box, already found.
    return [(position, _clean(content)) for position, content in found if _BOX_OPEN.search(content) is None]


def _clean(answer: str) -> str:
    """The answer without runs of space, markdown bold, a final full stop or enclosing math delimiters."""
    answer = " ".join(answer.split()).strip("*").strip().removesuffix(".").strip()
    for opening, closing in _MATH_DELIMITERS:
        if len(answer) > len(opening) + len(closing) and answer.startswith(opening) and answer.endswith(closing):
            answer = answer[len(opening) : -len(closing)].strip()
            break
    return answer.removesuffix(".").strip()
