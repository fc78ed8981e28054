"""Every file that the docs, the README and the code's docstrings and comments name exists in the repository, so a
renamed or deleted module cannot leave a stale pointer behind.

What counts as naming a file: a backticked name or path (`loop.py`, ``orchestration/loop.py``,
`recipes/{grpo,ppo}.toml`) ending in .py, .toml, .md, .sh, .yaml or .yml, in docs/*.md, README.md, and the
docstrings and comments of every module under src/sharpen, tests and benchmarks; also, backticked or not, a path
that starts at a top-level folder (docs/async.md, recipes/demo.toml) and an upper-case Markdown name (README.md).
A bare name exists when a file of that name is anywhere in the searched folders or at the root; a path, when it is
a repository path or the tail of one (`orchestration/loop.py`, `backends/critic.py` written from inside the
trainer's docs)."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SEARCHED = ("src", "tests", "benchmarks", "recipes", "deploy", "docs", "scenarios")
SCANNED_CODE = ("src/sharpen", "tests", "benchmarks")

_EXT = r"\.(?:py|toml|md|sh|yaml|yml)"
SPAN = re.compile(r"(`{1,2})([^`\n]+?)\1")
NAME = re.compile(rf"(?<![\w./-])((?:[\w.-]+/)*[\w-][\w.-]*{_EXT})(?![\w/-])")
ROOTED = re.compile(rf"(?<![\w./-])((?:(?:{'|'.join(SEARCHED)})/[\w.-]+(?:/[\w.-]+)*|[A-Z][A-Z_]+){_EXT})(?![\w/-])")
BRACES = re.compile(r"([\w./-]*)\{([\w.-]+(?:,[\w.-]+)+)\}([\w./-]*)")

ALLOWED = {
    # the user's own files in examples and help texts
    "file.py",
    "path/file.py",
    "path/to/file.py",
    "my_env.py",
    "agents.py",
    "recipe.toml",
    "RECIPE.toml",
    "reverse.toml",
    "colours.toml",
    "my-values.yaml",
    "a.py",  # a Markdown fence's title, in code_tests.py's examples
    # files sharpen writes at run time: a run directory's resolved config; the code grader's files in the sandbox
    "config.toml",
    "solution.py",
    "_sharpen_values.py",
    # other projects' files, cited where their behaviour is quoted (SGLang's sources, verl's docs and scripts)
    "srt/entrypoints/http_server.py",
    "srt/managers/io_struct.py",
    "srt/sampling/sampling_params.py",
    "api/v1/api_types.py",
    "verl/trainer/config/ppo_trainer.yaml",
    "docs/advance/one_step_off.md",
    "dapo_7b_math_megatron_4_12.sh",
    "h11/_connection.py",  # a module of h11's sdist, the default repository task set's package
}

# (file, name): stale names in files that are being rewritten now; fixed by the objective rewrite. Empty this list
# as they go: an entry whose name is no longer missing fails the test too.
PENDING: set[tuple[str, str]] = set()


def expand_braces(text: str) -> str:
    """`recipes/{grpo,ppo}.toml` -> `recipes/grpo.toml recipes/ppo.toml`."""
    return BRACES.sub(lambda m: " ".join(f"{m[1]}{part}{m[3]}" for part in m[2].split(",")), text)


def named_files(text: str) -> Iterator[tuple[int, str]]:
    """(offset, name) of every file name the text names."""
    for span in SPAN.finditer(text):
        for match in NAME.finditer(expand_braces(span[2])):
            yield span.start(2), match[1]
    for match in ROOTED.finditer(text):
        yield match.start(1), match[1]


def python_texts(source: str) -> Iterator[tuple[int, str]]:
    """(first line, text) of every docstring (module, class, function and attribute ones) and comment that may name
    a file (parsing and tokenizing are skipped where no line could: they are most of this test's time)."""
    if not re.search(_EXT, source):
        return
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            yield node.lineno, node.value.value
    if not re.search(rf"#.*{_EXT}", source):
        return
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


def scanned_texts() -> Iterator[tuple[str, int, str]]:
    for folder in SCANNED_CODE:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for line, text in python_texts(path.read_text()):
                yield path.relative_to(ROOT).as_posix(), line, text
    for path in [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]:
        yield path.relative_to(ROOT).as_posix(), 1, path.read_text()


def repository_files() -> list[str]:
    files = [p.name for p in ROOT.iterdir() if p.is_file()]
    for folder in SEARCHED:
        files += [p.relative_to(ROOT).as_posix() for p in (ROOT / folder).rglob("*") if p.is_file()]
    return [f for f in files if "__pycache__" not in f and ".egg-info/" not in f]


def exists(name: str, files: list[str]) -> bool:
    """A path is a repository path or its tail; a bare name is any file's name."""
    return any(f == name or f.endswith(f"/{name}") for f in files)


def missing_names() -> dict[tuple[str, str], int]:
    """(file, name) -> line of every named file that does not exist and is not allowed."""
    files = repository_files()
    missing: dict[tuple[str, str], int] = {}
    for where, first_line, text in scanned_texts():
        for offset, name in named_files(text):
            if name not in ALLOWED and not exists(name, files):
                missing.setdefault((where, name), first_line + text.count("\n", 0, offset))
    return missing


def test_every_named_file_exists():
    missing = missing_names()
    new = sorted(f"{where}:{missing[where, name]}: {name}" for where, name in missing if (where, name) not in PENDING)
    assert not new, (
        "these files are named but do not exist; fix the text (or, for a user's own file or another project's, add "
        "it to ALLOWED with why):\n" + "\n".join(new)
    )
    fixed = sorted(f"{where}: {name}" for where, name in PENDING - missing.keys())
    assert not fixed, "no longer missing, remove from PENDING:\n" + "\n".join(fixed)


def test_the_matcher_finds_names_and_flags_made_up_ones():
    text = (
        "The loop (`orchestration/loop.py`), ``weight_sync/streaming.py``, `recipes/{grpo,no_such_recipe}.toml`, "
        '`factory = "file.py:Name"`, docs/async.md and NOT_A_FILE.md; `sharpen.train` and `loop.pyx` name no file; '
        "``losses_that_never_were.py``."
    )
    names = [name for _, name in named_files(text)]
    assert sorted(names) == sorted(
        [
            "orchestration/loop.py",
            "weight_sync/streaming.py",
            "recipes/grpo.toml",
            "recipes/no_such_recipe.toml",
            "file.py",
            "docs/async.md",
            "NOT_A_FILE.md",
            "losses_that_never_were.py",
        ]
    )
    files = repository_files()
    assert [n for n in names if n not in ALLOWED and not exists(n, files)] == [
        "recipes/no_such_recipe.toml",
        "losses_that_never_were.py",
        "NOT_A_FILE.md",
    ]
    source = '"""Module, naming `made_up.py`."""\nx = 1\n"""An attribute docstring."""\n# a comment: see `b.toml`\n'
    assert [(line, name) for line, text in python_texts(source) for _, name in named_files(text)] == [
        (1, "made_up.py"),
        (4, "b.toml"),
    ]
