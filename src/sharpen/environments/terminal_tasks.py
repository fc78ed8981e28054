"""The terminal environment's in-house task set: small file, text and data chores with verifiable outcomes.

Owns the tasks: each is generated from a seed (`build_terminal_task`), so an `Example` carries only the task's name
and seed and the environment rebuilds it, checker included, at reset; no expected answer travels with the prompt.
A task is its instructions, its seed files (the episode's workspace starts as exactly these) and a checker over
the final workspace:

- a `FileCheck`: a Python function of the workspace's files (path -> bytes). It reads data and runs nothing the
  policy wrote, so it runs on the host.
- a `SandboxCheck`: a command run in a fresh sandbox execution, separate from the policy's shell, with the final
  workspace under ``workspace/`` and the checker's hidden files under ``checker/`` (they never enter the policy's
  sandbox); it passes when the command exits 0. For checks that run what the policy wrote (its scripts), as a
  repository task's hidden tests would.

Scoring is 1 when the checker passes, else 0 (no partial credit). It does not run episodes.
"""

from __future__ import annotations

import csv
import io
import json
import random
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

FileCheck = Callable[[Mapping[str, bytes]], bool]


@dataclass(kw_only=True, slots=True, frozen=True)
class SandboxCheck:
    """``argv`` run in a fresh sandbox whose work dir holds ``workspace/`` (the final workspace) and ``checker/``
    (``files``, hidden from the policy); the check passes when it exits 0."""

    argv: tuple[str, ...]
    files: Mapping[str, str]


@dataclass(kw_only=True, slots=True, frozen=True)
class TerminalTask:
    name: str
    instructions: str
    """What the policy is asked to do (its first user message)."""
    files: Mapping[str, str]
    """The workspace's seed files, by path relative to it."""
    check: FileCheck | SandboxCheck


_WORDS = (  # noqa: SIM905 - the words read as text, not as 26 lines of a list
    "apple banana cherry delta echo falcon garnet harbor island jasmine kettle lemon maple nectar orbit pepper "
    "quartz river saffron tiger umber violet willow xenon yellow zephyr"
).split()
_CITIES = ["Oslo", "Lima", "Cairo", "Quito", "Hanoi", "Dakar", "Perth", "Turin"]


def _text(files: Mapping[str, bytes], name: str) -> str | None:
    data = files.get(name)
    return None if data is None else data.decode(errors="replace")


def _answer_is(files: Mapping[str, bytes], expected: str, *, name: str = "answer.txt") -> bool:
    text = _text(files, name)
    return text is not None and text.strip() == expected


def _lines_are(files: Mapping[str, bytes], name: str, expected: list[str]) -> bool:
    text = _text(files, name)
    return text is not None and text.strip("\n").split("\n") == expected


def _create_file(rng: random.Random) -> TerminalTask:
    word, number = rng.choice(_WORDS), rng.randint(100, 999)
    line = f"{word}-{number}"
    return TerminalTask(
        name="create_file",
        instructions=f"Create a file named greeting.txt in the current directory containing exactly the line: {line}",
        files={"README": "An empty project.\n"},
        check=lambda files: _answer_is(files, line, name="greeting.txt"),
    )


def _count_errors(rng: random.Random) -> TerminalTask:
    levels = [rng.choice(["INFO", "INFO", "WARN", "ERROR"]) for _ in range(rng.randint(30, 60))]
    log = "".join(f"2026-01-{1 + i % 28:02d} {level} event {rng.randint(1, 9999)}\n" for i, level in enumerate(levels))
    count = str(levels.count("ERROR"))
    return TerminalTask(
        name="count_errors",
        instructions="Count the lines of app.log that contain ERROR and write the number (only the number) to "
        "answer.txt.",
        files={"app.log": log},
        check=lambda files: _answer_is(files, count),
    )


def _sort_unique(rng: random.Random) -> TerminalTask:
    names = [rng.choice(_WORDS) for _ in range(rng.randint(15, 30))]
    expected = sorted(set(names))
    return TerminalTask(
        name="sort_unique",
        instructions="names.txt has one name per line, with repeats. Write each distinct name once, sorted "
        "alphabetically, one per line, to unique.txt.",
        files={"names.txt": "\n".join(names) + "\n"},
        check=lambda files: _lines_are(files, "unique.txt", expected),
    )


def _csv_sum(rng: random.Random) -> TerminalTask:
    rows = [(rng.choice(_WORDS), rng.randint(1, 500)) for _ in range(rng.randint(8, 20))]
    body = "".join(f"{item},{amount}\n" for item, amount in rows)
    total = str(sum(amount for _, amount in rows))
    return TerminalTask(
        name="csv_sum",
        instructions="sales.csv has a header row and the columns item,amount. Write the sum of the amount column "
        "(only the number) to answer.txt.",
        files={"sales.csv": "item,amount\n" + body},
        check=lambda files: _answer_is(files, total),
    )


def _csv_cities(rng: random.Random) -> TerminalTask:
    rows = [(f"p{i}", rng.choice(_CITIES)) for i in range(rng.randint(10, 25))]
    expected = sorted({city for _, city in rows})
    body = "".join(f"{person},{city},{rng.randint(18, 90)}\n" for person, city in rows)
    return TerminalTask(
        name="csv_cities",
        instructions="people.csv has a header row and the columns name,city,age. Write the distinct cities, sorted "
        "alphabetically, one per line, to cities.txt.",
        files={"people.csv": "name,city,age\n" + body},
        check=lambda files: _lines_are(files, "cities.txt", expected),
    )


def _rename_extension(rng: random.Random) -> TerminalTask:
    notes = {f"notes/{word}.txt": f"note about {word}\n" for word in rng.sample(_WORDS, rng.randint(3, 6))}

    def check(files: Mapping[str, bytes]) -> bool:
        renamed = {name.removesuffix(".txt") + ".md": text.encode() for name, text in notes.items()}
        in_notes = {name: data for name, data in files.items() if name.startswith("notes/")}
        return in_notes == renamed

    return TerminalTask(
        name="rename_extension",
        instructions="Rename every .txt file in the notes directory to the same name with the extension .md "
        "(keep their contents; no .txt file may remain there).",
        files=notes,
        check=check,
    )


def _fix_json(rng: random.Random) -> TerminalTask:
    expected = {"name": rng.choice(_WORDS), "port": rng.randint(1024, 9999), "debug": rng.random() < 0.5}
    broken = json.dumps(expected, indent=2).replace("\n}", ",\n}")  # a trailing comma

    def check(files: Mapping[str, bytes]) -> bool:
        try:
            return json.loads(files.get("config.json", b"")) == expected
        except ValueError:
            return False

    return TerminalTask(
        name="fix_json",
        instructions="config.json is not valid JSON. Fix its syntax in place without changing any key or value.",
        files={"config.json": broken + "\n"},
        check=check,
    )


def _top_word(rng: random.Random) -> TerminalTask:
    counts = dict.fromkeys(rng.sample(_WORDS, 6), 0)
    winner = next(iter(counts))
    words = [winner] * rng.randint(9, 12)
    for word in list(counts)[1:]:
        words += [word] * rng.randint(1, 8)
    rng.shuffle(words)
    lines = [" ".join(words[i : i + 7]) for i in range(0, len(words), 7)]
    return TerminalTask(
        name="top_word",
        instructions="Find the word that occurs most often in text.txt (words are separated by spaces and lines) and "
        "write it to answer.txt.",
        files={"text.txt": "\n".join(lines) + "\n"},
        check=lambda files: _answer_is(files, winner),
    )


def _replace_text(rng: random.Random) -> TerminalTask:
    old, new = rng.sample(_WORDS, 2)
    lines = [" ".join(rng.choice([old, *rng.sample(_WORDS, 3)]) for _ in range(5)) for _ in range(8)]
    original = "\n".join(lines) + "\n"
    expected = re.sub(rf"\b{old}\b", new, original)
    return TerminalTask(
        name="replace_text",
        instructions=f"In story.txt, replace every occurrence of the word {old} with {new}, editing the file in place.",
        files={"story.txt": original},
        check=lambda files: _text(files, "story.txt") == expected,
    )


def _sort_by_prefix(rng: random.Random) -> TerminalTask:
    kinds = {"img": "images", "doc": "docs"}
    made = {f"{kind}_{i}.dat": f"{kind} {rng.randint(0, 99999)}\n" for kind in kinds for i in range(rng.randint(2, 4))}
    expected = {f"{kinds[name.split('_')[0]]}/{name}": text.encode() for name, text in made.items()}
    return TerminalTask(
        name="sort_by_prefix",
        instructions="Move every file whose name starts with img_ into a directory images, and every file whose name "
        "starts with doc_ into a directory docs (create them; keep the file names).",
        files=made,
        check=lambda files: {n: d for n, d in files.items() if n.endswith(".dat")} == expected,
    )


def _count_code_lines(rng: random.Random) -> TerminalTask:
    modules = {f"src/pkg{i % 2}/mod{i}.py": "x = 1\n" * rng.randint(3, 20) for i in range(rng.randint(3, 6))}
    modules["src/notes.txt"] = "not code\n" * 7
    total = str(sum(text.count("\n") for name, text in modules.items() if name.endswith(".py")))
    return TerminalTask(
        name="count_code_lines",
        instructions="Count the lines of all .py files under src (in every subdirectory) together and write the "
        "total (only the number) to answer.txt.",
        files=modules,
        check=lambda files: _answer_is(files, total),
    )


def _max_value(rng: random.Random) -> TerminalTask:
    numbers = [rng.randint(-1000, 1000) for _ in range(rng.randint(20, 40))]
    return TerminalTask(
        name="max_value",
        instructions="numbers.txt has one integer per line. Write the largest of them to answer.txt.",
        files={"numbers.txt": "\n".join(map(str, numbers)) + "\n"},
        check=lambda files: _answer_is(files, str(max(numbers))),
    )


def _extract_column(rng: random.Random) -> TerminalTask:
    rows = [(rng.choice(_WORDS), rng.choice(_CITIES), str(rng.randint(1, 99))) for _ in range(rng.randint(6, 12))]
    return TerminalTask(
        name="extract_column",
        instructions="table.tsv has tab-separated columns and no header. Write its second column, one value per "
        "line in the original order, to column.txt.",
        files={"table.tsv": "".join("\t".join(row) + "\n" for row in rows)},
        check=lambda files: _lines_are(files, "column.txt", [row[1] for row in rows]),
    )


def _json_to_csv(rng: random.Random) -> TerminalTask:
    records = [{"id": i, "city": rng.choice(_CITIES)} for i in range(1, rng.randint(4, 8))]

    def check(files: Mapping[str, bytes]) -> bool:
        text = _text(files, "records.csv")
        if text is None:
            return False
        rows = list(csv.reader(io.StringIO(text.strip())))
        return rows == [["id", "city"], *([str(r["id"]), str(r["city"])] for r in records)]

    return TerminalTask(
        name="json_to_csv",
        instructions="records.json is a JSON list of objects with the keys id and city. Write them to records.csv "
        "with the header line id,city and one line per object, in the same order.",
        files={"records.json": json.dumps(records) + "\n"},
        check=check,
    )


def _double_script(rng: random.Random) -> TerminalTask:
    """The script is run by a hidden test in a separate sandbox, on inputs the policy never sees (5 s a run: a
    script that never ends must not hold a checker for the sandbox's whole wall clock)."""
    inputs = [rng.randint(-500, 500) for _ in range(4)]
    test = "cd workspace || exit 1\n" + "".join(
        f'[ "$(timeout 5 bash double.sh {n} 2>/dev/null)" = "{2 * n}" ] || exit 1\n' for n in inputs
    )
    return TerminalTask(
        name="double_script",
        instructions="Write a bash script double.sh that prints twice the integer given as its first argument "
        "(bash double.sh 21 prints 42; negative numbers too). Try it before you finish.",
        files={"README": "Put double.sh here.\n"},
        check=SandboxCheck(argv=("bash", "checker/test_double.sh"), files={"test_double.sh": test}),
    )


TERMINAL_TASKS: dict[str, Callable[[random.Random], TerminalTask]] = {
    "create_file": _create_file,
    "count_errors": _count_errors,
    "sort_unique": _sort_unique,
    "csv_sum": _csv_sum,
    "csv_cities": _csv_cities,
    "rename_extension": _rename_extension,
    "fix_json": _fix_json,
    "top_word": _top_word,
    "replace_text": _replace_text,
    "sort_by_prefix": _sort_by_prefix,
    "count_code_lines": _count_code_lines,
    "max_value": _max_value,
    "extract_column": _extract_column,
    "json_to_csv": _json_to_csv,
    "double_script": _double_script,
}
"""Every task of the set by name; each builds its task from a seeded ``random.Random``."""


def build_terminal_task(name: str, seed: int) -> TerminalTask:
    if name not in TERMINAL_TASKS:
        raise ValueError(f"unknown terminal task {name!r} (known: {', '.join(TERMINAL_TASKS)})")
    return TERMINAL_TASKS[name](random.Random(seed))
