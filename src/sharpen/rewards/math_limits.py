"""Refusing math answers too costly to evaluate, before they reach sympy: a textual estimate of their size.

Owns `find_costly_part`: a deliberately small recursive-descent reading of an answer's LaTeX (numbers, ``^``, ``!``,
``+ - * /``, ``\\frac``, ``\\binom``, ``\\sqrt``, ``\\sum``/``\\prod`` bounds, groups) that bounds the number of digits
of what sympy would compute, and the nesting depth that makes math-verify's parser backtrack exponentially (about
1.5x per level: 15 nested ``\\frac`` took 1 s, 20 ran past 5 s). An answer over a limit is the policy's failure
(scored wrong) and never starts a worker, so ``9^{9^{9^9}}`` cannot hold one in C code until it is killed.

Deliberately does not evaluate anything and does not understand all of LaTeX: a part it cannot read (a symbol, an
unknown command) has an unknown size and is let through; the worker's deadline (`math_verify.MathVerifyPool`) is
the hard bound for whatever these estimates miss.
"""

from __future__ import annotations

import math
import re

MAX_DIGITS = 100_000
"""Largest number of digits an answer may denote (10^(10^6) took 0.2 s in sympy; 10^(10^10) did not finish)."""
MAX_FACTORIAL = 10_000
"""Largest argument of ``n!``, of the smaller ``k`` of ``\\binom{n}{k}`` and of ``\\sum``/``\\prod`` bounds."""
MAX_NESTING = 12
"""Deepest nesting of ``{} () []`` groups (math-verify's parser time grows about 1.5x per level)."""

_TOKEN = re.compile(r"\d+(?:\.\d*)?|\.\d+|\\[A-Za-z]+|\\.|\S")
_CLOSING = {"{": "}", "(": ")", "[": "]"}
_CONSTANTS = {r"\pi": math.log10(math.pi), r"\e": math.log10(math.e), "e": math.log10(math.e)}
_IGNORED = {r"\left", r"\right", r"\displaystyle", r"\,", r"\!", r"\;", r"\ ", r"\dfrac", r"\tfrac", r"\cfrac"}
_TIMES = {"*", r"\cdot", r"\times"}
Magnitude = float | None
"""log10 of an upper bound of an absolute value; None: unknown (a symbol, or something this reading skips)."""


class _Costly(Exception):
    """Raised inside the reading as soon as a limit is exceeded."""


def find_costly_part(answer: str) -> str | None:
    """Why ``answer`` is too costly to evaluate ("nesting 13 > 12", "a number of ~3.7e8 digits"), or None."""
    depth = max_depth = 0
    for char in answer:
        if char in "{([":
            depth += 1
            max_depth = max(max_depth, depth)
        elif char in "})]":
            depth -= 1
    if max_depth > MAX_NESTING:
        return f"nesting {max_depth} > {MAX_NESTING}"
    tokens = [t for t in _TOKEN.findall(answer) if t not in _IGNORED]
    reader = _Reader(tokens)
    try:
        while reader.position < len(tokens):  # the whole answer, also after a part the reading cannot continue
            reader.expression()
            reader.position += 1
    except _Costly as error:
        return str(error)
    except RecursionError:
        return "too deeply nested to read"
    return None


class _Reader:
    """Recursive descent over tokens; each rule returns a `Magnitude` and raises `_Costly` over a limit."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens = tokens
        self.position = 0

    def peek(self) -> str:
        return self.tokens[self.position] if self.position < len(self.tokens) else ""

    def take(self) -> str:
        token = self.peek()
        self.position += 1
        return token

    def expression(self) -> Magnitude:
        magnitude = self.term()
        while self.peek() in ("+", "-"):
            self.take()
            magnitude = _larger(magnitude, self.term(), extra=math.log10(2))
        return magnitude

    def term(self) -> Magnitude:
        magnitude = self.factor()
        while self.peek() and self.peek() not in ("+", "-", "}", ")", "]", "=", ",", "&"):
            operator = self.peek()
            if operator == "/" or operator == r"\div":
                self.take()
                self.factor()  # a quotient is no larger than its dividend (for divisors >= 1)
                continue
            if operator in _TIMES:
                self.take()
            position = self.position
            other = self.factor()
            if self.position == position:  # a token no rule reads: skip it
                self.take()
            magnitude = None if magnitude is None or other is None else magnitude + other
        return magnitude

    def factor(self) -> Magnitude:
        base = self.primary()
        while self.peek() in ("^", "!", "_"):
            operator = self.take()
            if operator == "_":
                self.primary()  # an index does not change the size
            elif operator == "^":
                base = _power(base, self.factor())  # right-associative: a^b^c is a^(b^c)
            elif self.peek() == "!":  # a double factorial n!! is at most n!
                self.take()
                base = _factorial(base)
            else:
                base = _factorial(base)
        return base

    def primary(self) -> Magnitude:
        token = self.take()
        if not token:
            return None
        if token[0].isdigit() or token[0] == ".":
            return math.log10(max(float(token), 1.0))
        if token == "-":
            return self.factor()
        if token in _CLOSING:
            magnitude = self.expression()
            if self.peek() == _CLOSING[token]:
                self.take()
            return magnitude
        if token in _CONSTANTS:
            return _CONSTANTS[token]
        if token == r"\frac":
            numerator = self.primary()
            self.primary()
            return numerator
        if token in (r"\binom", r"\dbinom", r"\tbinom"):
            return _binomial(self.primary(), self.primary())
        if token == r"\sqrt":
            if self.peek() == "[":
                self.primary()
            radicand = self.primary()
            return None if radicand is None else radicand / 2
        if token in (r"\sum", r"\prod"):
            self._bounds()
            return None
        return None  # a symbol or a command this reading does not know: size unknown

    def _bounds(self) -> None:
        """Reads ``_{k=1}^{N}`` (either order); a bound above the limit is costly."""
        for _ in range(2):
            if self.peek() not in ("_", "^"):
                return
            self.take()
            group = [self.take()]
            if group[0] in _CLOSING:
                depth = 1
                while depth and self.peek():
                    token = self.take()
                    depth += (token in _CLOSING) - (token in _CLOSING.values())
                    group.append(token)
                group = group[1:-1] if depth == 0 else group[1:]
            last_side = group[len(group) - group[::-1].index("=") :] if "=" in group else group
            bound = _Reader(last_side).expression()
            if bound is not None and bound > math.log10(MAX_FACTORIAL):
                raise _Costly(f"a sum or product bound above {MAX_FACTORIAL}")


def _larger(first: Magnitude, second: Magnitude, *, extra: float) -> Magnitude:
    if first is None or second is None:
        return None
    return max(first, second) + extra


def _value(magnitude: float) -> float:
    return math.inf if magnitude > 300 else 10.0**magnitude


def _power(base: Magnitude, exponent: Magnitude) -> Magnitude:
    if base is None or exponent is None:
        return None
    digits = _value(exponent) * base if base > 0 else 0.0
    if digits > MAX_DIGITS:
        raise _Costly(f"a number of ~{digits:.2g} digits (more than {MAX_DIGITS})")
    return digits


def _factorial(argument: Magnitude) -> Magnitude:
    if argument is None:
        return None
    if argument > math.log10(MAX_FACTORIAL):
        raise _Costly(f"a factorial of a number above {MAX_FACTORIAL}")
    value = _value(argument)
    return math.lgamma(value + 1) / math.log(10)


def _binomial(top: Magnitude, bottom: Magnitude) -> Magnitude:
    if top is None or bottom is None:
        return None
    if min(top, bottom) > math.log10(MAX_FACTORIAL):
        raise _Costly(f"a binomial coefficient with both arguments above {MAX_FACTORIAL}")
    return min(_value(top), _value(bottom)) * top
