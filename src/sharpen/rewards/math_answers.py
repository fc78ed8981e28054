"""Strict answer extraction for math: every final answer a completion gives, or a format error.

Owns, in order: `normalize_math_text` (Unicode digits, spaces, zero-width and format characters, super- and
subscripts, math symbols folded to ASCII LaTeX, so odd digits still match and invisible characters cannot hide a
box); `find_final_answers`, which collects every final answer outside reasoning blocks (``\\boxed{..}`` /
``\\fbox{..}``, ``<answer>`` tags, ``Answer:`` / ``Final answer:`` lines, ``#### 42`` lines, "the answer is ..."
phrases, markdown bold around any of them): several *different* ones, an unclosed box, an overlong answer or none
at all is a format error, never "the last one wins", and so is a final box or tag left empty (`is_blank`: prose
after it does not fill it); `as_plain_number`, which reads a whole answer that is one number in ``\\text{..}`` or in
E-notation (``1.5e3``) as that number; `is_hedged`, the textual checks for answers that offer a
choice ("3 or 4", a number in ``\\text{}``) or hide part of themselves (``\\cancel``, ``\\phantom``, ``\\color``);
and `split_values`, the parts of an answer between separators that name separate values ("3 \\sim 4", "3 = 4",
"x=3 \\\\ x=4"), which math-verify would silently reduce to one of them.

Deliberately does not judge whether answers are mathematically equal (that is `math_verify.judge_answers`, in a
worker process); two textually different answers are returned as two, and the judge decides whether they agree.
"""

from __future__ import annotations

import re
import unicodedata

from sharpen.rewards.answers import strip_reasoning

MAX_ANSWER_CHARS = 1_000
"""Longest answer judged: longer ones are format errors, so sympy never parses an unbounded expression."""
MAX_DISTINCT_ANSWERS = 4
"""More textually different answers than this is a format error without asking the judge (nobody hedges
legitimately with five boxes, and each one costs a sympy parse)."""

_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])\s*\{")
_ANSWER_LINE = re.compile(r"^[*#>\-\s]*(?:final\s+)?answer[*_\s]*:(?P<answer>.*)$", re.IGNORECASE)
_HASH_LINE = re.compile(r"^\s*####(?!#)(?P<answer>.*)$")
_ANSWER_PHRASE = re.compile(r"\banswer\s+is\b[*_\s]*:?", re.IGNORECASE)
_PHRASE_PREFIX = re.compile(r"^(?:the\s+)?(?:final\s+)?answer\s+is\b[*_\s]*:?", re.IGNORECASE)
_MATH_DELIMITERS = (("$$", "$$"), ("\\[", "\\]"), ("\\(", "\\)"), ("$", "$"))
_SENTENCE_END = re.compile(r"[.;!?](?=\s|$)|\s(?:because|since|as|so|which|but|if|when|where|for)\b", re.IGNORECASE)
_FULL_STOP = re.compile(r"[.;!?](?=\s|$)")
_MATH_TOKEN = re.compile(r"[\d\\$^_{}()\[\]+\-*/=<>|%]")
# Words that offer a choice of values. math-verify keeps only the first number of "5 \text{ or maybe 6}" (it
# reads the text as a unit), so a policy could hedge inside one box unless this check says wrong first.
_HEDGE = re.compile(
    r"\b(?:or|either|maybe|possibly|perhaps|probably|otherwise|unless)\b|\\(?:lor|vee)(?![A-Za-z])", re.I
)
# Text with a number in it ("5 \text{ (other candidate: 6)}"): math-verify drops it as a unit, number and all.
_TEXT_WITH_DIGIT = re.compile(r"\\(?:text|textbf|textit|textrm|mbox|mathrm)\s*\{[^{}]*\d")
# Commands that strike out, hide, recolour or label part of an answer (math-verify drops their argument, the
# reader sees it or not), and empty scripts ("3^{} 4" reads as 4).
_HIDING = re.compile(
    r"\\(?:b?cancel|xcancel|sout|st|phantom|hphantom|vphantom|color|textcolor|colorbox|tag|label|eqref|ref|not"
    r"|smash|llap|rlap|clap|mathllap|mathrlap|mathclap|require|hbox|vbox|raisebox)(?![A-Za-z])|[\^_]\s*\{\s*\}"
)
# What separates values, by kind; a kind the reference itself uses (a set's commas, an equation's "=") is allowed.
SEPARATORS = {
    "list": re.compile(r"(?<!\\)(?:(?<!\d),|,(?!\d{3}(?!\d))|;)"),  # not "1,000", not LaTeX's "\," or "\;"
    "union": re.compile(r"\\(?:cup|cap|setminus|backslash)(?![A-Za-z])"),
    "logic": re.compile(r"\\(?:lor|vee|land|wedge|mid|vert|lvert|rvert|Vert|parallel)(?![A-Za-z])|\|"),
    "relation": re.compile(
        r"\\(?:leqslant|geqslant|leq|geq|le|ge|lt|gt|neq|ne|equiv|cong|simeq|sim|doteq|ll|gg|propto|in|ni|notin"
        r"|subseteq|subset|supseteq|supset)(?![A-Za-z])|[<>]=?|="
    ),
    "approx": re.compile(r"\\approx(?![A-Za-z])"),
    "arrow": re.compile(
        r"\\(?:to|rightarrow|Rightarrow|longrightarrow|Longrightarrow|implies|impliedby|iff|Leftrightarrow"
        r"|leftrightarrow|Longleftrightarrow|longleftrightarrow|mapsto|gets|leftarrow|Leftarrow)(?![A-Za-z])"
    ),
    "row": re.compile(r"\\\\|\\?&|\\(?:newline|cr)(?![A-Za-z])"),
    "space": re.compile(r"\\(?:quad|qquad|enspace|hfill)(?![A-Za-z])|\\hspace\*?\{[^{}]*\}|\\[;:>]|~"),
    "words": re.compile(r"\\(?:text|textbf|textit|textrm|mbox|mathrm)\s*\{[^{}]*\}"),  # "3 \text{ (}4\text{)}"
    "other": re.compile(r"\\(?:slash|dots|ldots|cdots|vdots|ddots|dotsc|dotsb)(?![A-Za-z])|\?|--|\u2013|\u2014"),
}
_ANY_SEPARATOR = re.compile("|".join(f"(?:{pattern.pattern})" for pattern in SEPARATORS.values()))
_TEXT_GROUP = re.compile(r"\\(?:text|textbf|textit|textrm|mbox|mathrm|operatorname)\s*\{[^{}]*\}")
_COMMAND = re.compile(r"\\[A-Za-z]+")
_TEXT_COMMANDS = r"text|textbf|textit|textrm|textsf|texttt|textnormal|mbox|mathrm|mathbf|mathit|mathsf|boldsymbol"
_TEXT_WRAPPER = re.compile(rf"\\(?:{_TEXT_COMMANDS})\s*\{{(.*)\}}", re.DOTALL)
_PLAIN_NUMBER = re.compile(r"[+-]?(?:\d+(?:,\d{3})*(?:\.\d*)?|\.\d+)")
_E_NOTATION = re.compile(r"([+-]?(?:\d+(?:\.\d*)?|\.\d+))[eE]([+-]?\d{1,6})")
_BLANK_PART = re.compile(
    rf"\s+|\{{\}}|\$|\\[()\[\]]|~|\\[,;:! ]|\\(?:quad|qquad|enspace|thinspace|hfill)(?![A-Za-z])|"
    rf"\\(?:{_TEXT_COMMANDS}|hspace\*?)\s*\{{\}}"
)

# Unicode that a policy (or a tokenizer) may use for digits, spaces and symbols. Format characters (zero-width
# space, joiners, soft hyphen, bidi controls, BOM) are deleted, so "\boxed\u200b{4}" is a box like any other.
_FORMAT_CHARS = re.compile(
    "[\u00ad\u034f\u061c\u180e\u200b-\u200f\u202a-\u202e\u2060-\u2064\u2066-\u206f\ufe00-\ufe0f\ufeff]"
)
_GROUP_SPACE = re.compile(r"(?<=\d)(?:[\u00a0\u2007\u2008\u2009\u200a\u202f]|\\,)(?=\d{3}(?!\d))")
_SUPERSCRIPT = re.compile("[\u2070\u00b9\u00b2\u00b3\u2074-\u207e\u2071\u207f]+")
_SUBSCRIPT = re.compile("[\u2080-\u208e]+")
_SCRIPT_CHARS = str.maketrans(
    "\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079\u207a\u207b\u207c\u207d\u207e\u2071\u207f"
    "\u2080\u2081\u2082\u2083\u2084\u2085\u2086\u2087\u2088\u2089\u208a\u208b\u208c\u208d\u208e",
    "0123456789+-=()in0123456789+-=()",
)
_VULGAR_FRACTION = re.compile("(\\d?)([\u00bc-\u00be\u2150-\u215e\u2189])")
_SYMBOLS = str.maketrans(
    {
        "\u2212": "-",  # minus sign
        "\u2012": "-",  # figure dash
        "\ufe63": "-",
        "\u00d7": r"\times ",
        "\u00f7": r"\div ",
        "\u00b7": r"\cdot ",
        "\u22c5": r"\cdot ",
        "\u03c0": r"\pi ",
        "\u221e": r"\infty ",
        "\u2264": r"\le ",
        "\u2265": r"\ge ",
        "\u2260": r"\ne ",
        "\u00b1": r"\pm ",
        "\u2213": r"\mp ",
        "\u221a": r"\sqrt ",
        "\u2044": "/",  # fraction slash
    }
)


def normalize_math_text(text: str) -> str:
    """``text`` with Unicode digits as ASCII digits and odd spacing and symbols as plain LaTeX.

    Deletes format characters (zero-width, joiners, bidi controls); drops thin, narrow and no-break spaces (and
    LaTeX ``\\,``) between digit groups ("1 000" is 1000); writes super- and subscripts as ``^{..}``/``_{..}``
    ("3⁴" is 3^{4}, not 34) and vulgar fractions as ``\\frac``; folds the minus sign, ×, ÷, ·, π, ∞, ≤, ≥, ≠, ±, √ to
    LaTeX; applies NFKC (fullwidth and mathematical bold digits, fullwidth braces and backslashes); maps every
    other decimal digit (Arabic-Indic, Devanagari, ...) to ASCII. ASCII text only gets the digit-group rule.
    """
    text = _GROUP_SPACE.sub("", text)
    if text.isascii():
        return text
    text = _FORMAT_CHARS.sub("", text)
    text = _GROUP_SPACE.sub("", text)  # again: a zero-width character may have separated a group
    text = _SUPERSCRIPT.sub(lambda m: "^{" + m.group().translate(_SCRIPT_CHARS) + "}", text)
    text = _SUBSCRIPT.sub(lambda m: "_{" + m.group().translate(_SCRIPT_CHARS) + "}", text)
    text = _VULGAR_FRACTION.sub(_vulgar_fraction, text)
    text = unicodedata.normalize("NFKC", text.translate(_SYMBOLS))
    if not text.isascii():
        digits = {char: str(unicodedata.digit(char)) for char in set(text) if unicodedata.category(char) == "Nd"}
        text = text.translate(str.maketrans(digits)) if digits else text
    return text


def _vulgar_fraction(match: re.Match[str]) -> str:
    numerator, _, denominator = unicodedata.normalize("NFKC", match.group(2)).partition("\u2044")
    fraction = f"\\frac{{{numerator}}}{{{denominator}}}"
    return f"{match.group(1)}+{fraction}" if match.group(1) else fraction  # "3½" is 3 + 1/2


def find_final_answers(
    text: str,
    *,
    max_answer_chars: int = MAX_ANSWER_CHARS,
    accept_bare: bool = False,
    extracted: str | None = None,
) -> tuple[str, ...] | None:
    """The distinct final answers ``text`` gives outside reasoning blocks, normalised, the last one first; None for
    a format error.

    ``accept_bare``: when the text has no box, tag or declaration, take the whole text as the answer (for text that
    was already extracted, e.g. by the `Rubric`); boxes inside it are still found and checked. ``extracted``: an
    answer another extractor already read from ``text`` (the `Rubric`'s answer format), counted as one more final.
    """
    text = strip_reasoning(normalize_math_text(text))
    boxes = _boxed_answers(text, max_answer_chars)
    if boxes is None:
        return None  # an unclosed or overlong box
    containers = [*boxes, *((start, _clean(content)) for start, content in _answer_tags(text))]
    if containers and is_blank(max(containers, key=lambda item: item[0])[1]):
        return None  # the final box or tag was left empty: prose after it does not fill it
    found = [*boxes, *_declared_answers(_blank_boxes(text, boxes))]
    if extracted is not None:
        content = _declared_content(strip_reasoning(normalize_math_text(extracted)), is_whole=True)
        found += [(len(text), content)] if content else []
    if not found and accept_bare:
        found = [(0, _clean(text))]
    answers = [answer for _, answer in sorted(found, key=lambda item: item[0]) if answer]
    distinct = tuple(dict.fromkeys(reversed(answers)))  # the final answer first, repeats once
    if not distinct or len(distinct) > MAX_DISTINCT_ANSWERS or any(len(a) > max_answer_chars for a in distinct):
        return None
    return distinct


def is_hedged(answer: str, reference: str, *, allow_or: bool = False) -> bool:
    """True when ``answer`` offers a choice of values ("3 or 4", "5 \\text{ (or 6)}") or hides part of itself
    ("\\cancel{3} 4", "3^{} 4"), and ``reference`` does not.

    ``allow_or``: the reference is a set of several values, which "x = 3 or x = 4" lists rather than hedges (a number
    inside text is still a hedge: math-verify would drop it).
    """
    patterns = (_TEXT_WITH_DIGIT, _HIDING) if allow_or else (_HEDGE, _TEXT_WITH_DIGIT, _HIDING)
    return any(pattern.search(answer) and not pattern.search(reference) for pattern in patterns)


def split_values(answer: str, *, allowed: frozenset[str]) -> tuple[list[str], bool]:
    """The constant parts of ``answer`` between separators of kinds not in ``allowed`` (at any depth; lists only at
    the top level), and whether an ``\\approx`` separates any.

    A part is constant when it holds a digit and no letter outside LaTeX commands and text: in "x = 3" only "3" is,
    so an answer that names one value yields at most one part, or parts that the judge finds equal ("2+1 = 3").
    """
    kinds = [kind for kind in SEPARATORS if kind not in allowed]
    if not kinds or _ANY_SEPARATOR.search(answer) is None:
        return [answer] if _is_constant(answer) else [], False
    pattern = re.compile("|".join(f"(?:{SEPARATORS[kind].pattern})" for kind in kinds if kind != "list"))
    pieces = _split_top_level_lists(answer) if "list" in kinds else [answer]
    parts = [part for piece in pieces for part in (pattern.split(piece) if pattern.pattern else [piece])]
    is_approximate = "approx" in kinds and SEPARATORS["approx"].search(answer) is not None
    # A part that starts with a script belongs to what the separator followed ("5 \text{cm}^2"): not a value.
    values = [part for part in map(_strip_unbalanced, parts) if _is_constant(part) and part[0] not in "^_"]
    return values, is_approximate


def _split_top_level_lists(answer: str) -> list[str]:
    pieces: list[str] = []
    depth = start = 0
    list_separator = SEPARATORS["list"]
    for index, char in enumerate(answer):
        if char in "{([":
            depth += 1
        elif char in "})]":
            depth -= 1
        elif depth == 0 and char in ",;" and list_separator.match(answer, index):
            pieces.append(answer[start:index])
            start = index + 1
    return [*pieces, answer[start:]]


def _is_constant(part: str) -> bool:
    residue = _COMMAND.sub(" ", _TEXT_GROUP.sub(" ", part))
    return any(char.isdigit() for char in residue) and not any(char.isascii() and char.isalpha() for char in residue)


def _strip_unbalanced(part: str) -> str:
    part = part.strip()
    while part and part[0] in "{([" and part.count(part[0]) > part.count({"{": "}", "(": ")", "[": "]"}[part[0]]):
        part = part[1:].strip()
    while part and part[-1] in "})]" and part.count(part[-1]) > part.count({"}": "{", ")": "(", "]": "["}[part[-1]]):
        part = part[:-1].strip()
    return part


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


def _blank_boxes(text: str, boxes: list[tuple[int, str]]) -> str:
    """``text`` with each box replaced by a marker of the same length, so declarations inside boxes are not
    read twice and a declaration holding a box is seen to point at it."""
    if not boxes:
        return text
    pieces: list[str] = []
    position = 0
    for start, _ in boxes:
        if start < position:
            continue
        end = _closing_brace(text, _BOX_OPEN.match(text, start).end(), len(text))  # type: ignore[union-attr]
        assert end is not None  # the scan above found it closed
        pieces += [text[position:start], "\\boxed{" + " " * (end - start - len("\\boxed{")) + "}"]
        position = end + 1
    return "".join([*pieces, text[position:]])


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
    """(position, content) of each ``<answer>`` tag pair, ``Answer:`` or ``####`` line and "the answer is" phrase.

    The last line's declaration is read whole (as before: "Answer: New York"); earlier ones up to the end of their
    sentence and only as far as they read as math ("Answer: 4 apples" is 4), so prose is not taken for an answer.
    """
    found: list[tuple[int, str | None]] = [
        (start, _declared_content(content, is_whole=True)) for start, content in _answer_tags(text)
    ]
    lines = text.rstrip().split("\n")
    position = 0
    for number, line in enumerate(lines):
        is_last = number == len(lines) - 1
        if (match := _ANSWER_LINE.match(line) or _HASH_LINE.match(line)) is not None:
            found.append((position + match.start("answer"), _declared_content(match.group("answer"), is_whole=is_last)))
        else:
            for phrase in _ANSWER_PHRASE.finditer(line):
                found.append((position + phrase.end(), _declared_content(line[phrase.end() :], is_whole=False)))
        position += len(line) + 1
    return [(position, content) for position, content in found if content]


def _answer_tags(text: str) -> list[tuple[int, str]]:
    """(position, raw content) of each complete ``<answer>`` tag pair (the innermost opening tag counts)."""
    found: list[tuple[int, str]] = []
    # str.find rather than a regex: many unclosed tags must not make the search quadratic.
    start = text.find("<answer>")
    while start != -1:
        close = text.find("</answer>", start)
        if close == -1:
            break  # an unclosed tag (a truncated completion, or prose naming the tag) declares nothing
        found.append((start, text[start + len("<answer>") : close].rsplit("<answer>", 1)[-1]))
        start = text.find("<answer>", close)
    return found


def _declared_content(content: str, *, is_whole: bool) -> str | None:
    """The answer a declaration gives; None when it points at a box (already counted) or reads as prose."""
    content = _PHRASE_PREFIX.sub("", content.strip().lstrip("*_: ")).strip().lstrip("*_: ")
    for opening, closing in _MATH_DELIMITERS:
        if content.startswith(opening) and (end := content.find(closing, len(opening))) != -1:
            rest = content[end + len(closing) :]
            if _BOX_OPEN.search(content, 0, end) is not None:
                return None  # "$\boxed{3}$": the box is counted
            if re.search(r"[\d$\\]", _FULL_STOP.split(rest, maxsplit=1)[0]) is None:  # "$3$ or $4$" stays whole
                return _clean(content[len(opening) : end])
            break
    if (end := (_FULL_STOP if is_whole else _SENTENCE_END).search(content)) is not None:
        content = content[: end.start()]  # "4. Or, to be safe, \boxed{3}" declares 4
    if _BOX_OPEN.search(content) is not None:
        return None
    if is_whole:
        return _clean(content)
    tokens: list[str] = []
    for token in content.replace("**", " ").split():
        if _MATH_TOKEN.search(token) or (len(token.strip(".,;:!?")) == 1 and token[0].isalpha()):
            tokens.append(token)
        elif token.casefold() in ("or", "and") and tokens:
            tokens.append(token)  # "3 or 4" stays whole, for the hedge check
        else:
            break
    while tokens and tokens[-1].casefold() in ("or", "and"):
        tokens.pop()
    return _clean(" ".join(tokens).rstrip(",;:")) or None


def _clean(answer: str) -> str:
    """The answer without runs of space, markdown bold, a final full stop or enclosing math delimiters."""
    answer = " ".join(answer.split()).strip("*").strip().removesuffix(".").strip()
    for opening, closing in _MATH_DELIMITERS:
        if len(answer) > len(opening) + len(closing) and answer.startswith(opening) and answer.endswith(closing):
            answer = answer[len(opening) : -len(closing)].strip()
            break
    return as_plain_number(answer.removesuffix(".").strip())


def as_plain_number(answer: str) -> str:
    """``answer`` as plain LaTeX when the whole of it is one number in a text command (``\\text{3}``,
    ``\\textbf{3}``, ``\\mathrm{3}``, nested) or in E-notation (``1.5e3`` is ``1.5\\times 10^{3}``: digits, ``e``,
    digits are always scientific notation, never a product with Euler's e); otherwise unchanged, so a number beside
    other text (``3\\text{ (or 4)}``) is still a hedge. Applied to answers and the reference alike."""
    inner = answer.strip()
    while (match := _TEXT_WRAPPER.fullmatch(inner)) is not None and _is_balanced(match.group(1)):
        inner = match.group(1).strip()
    if _PLAIN_NUMBER.fullmatch(inner):
        return inner
    if (match := _E_NOTATION.fullmatch(inner)) is not None:
        return f"{match.group(1)}\\times 10^{{{int(match.group(2))}}}"
    return answer


def is_blank(answer: str) -> bool:
    """True when ``answer`` shows nothing: only spaces, LaTeX spacing, empty groups or empty text commands."""
    for _ in range(8):  # each round removes one level of nesting; more than 8 empty levels is not blank
        if not answer:
            return True
        answer, count = _BLANK_PART.subn("", answer)
        if count == 0:
            break
    return not answer


def _is_balanced(text: str) -> bool:
    depth = 0
    for char in text:
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth < 0:
            return False
    return depth == 0
