"""Every `sharpen` command that README.md and docs/ show is checked against the code, so an example cannot drift
from its CLI, its recipe or its scenario:

- every one parses with the real argument parser (a renamed flag, a model name that is not known, a missing
  argument fail here), and the recipe it names exists (in the repository, or as a TOML block on the same page that
  the reader saves under that name);
- a recipe's command resolves its config with the command's overrides, as `sharpen train` would at start;
- the commands that finish in seconds here run: `sharpen config ...` and `sharpen simulate ...` (exit code 0), and a
  split search must search the GPUs of its own scenario (the search itself, a minute per scenario here, is left
  out: tests/unit/simulation/ test it on small scenarios).

What runs elsewhere: every recipe trains with the tiny models in tests/integration/test_recipes.py and `make demo`
trains recipes/demo.toml; `inspect`, `replay`, `eval`, `dashboard` and the `serve-*` commands run against test runs
and servers in tests/unit/cli/, tests/unit/monitoring/ and tests/integration/.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from sharpen.cli.main import build_parser, main
from sharpen.config import load_config
from sharpen.simulation import load_scenario

ROOT = Path(__file__).resolve().parents[3]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Placeholders the pages write for the reader's own values, and what stands in for each here.
PLACEHOLDERS = {
    "runs/<run>": "runs/example",
    "RUN_DIR": "runs/example",
    "recipes/<recipe>.toml": "recipes/demo.toml",
    "RECIPE.toml": "recipes/demo.toml",
    "RECIPE": "recipes/demo.toml",
    "recipe.toml": "recipes/demo.toml",
    "SCENARIO": "scenarios/areal_1p5b_async.toml",
    "--host H": "--host 127.0.0.1",
    "--port P": "--port 8100",
    "/models/my-reward-model": "/models/my-reward-model",
}
RECIPE_COMMANDS = {"train", "eval", "config", "serve-env", "serve-sandbox"}


def documented_commands() -> list[tuple[str, str]]:
    """(page:line, command) for each `sharpen ...` line of a fenced code block, and each inline `sharpen ...` span
    that names a .toml file (the others are a subcommand's name in a sentence)."""
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for match in re.finditer(r"```[^\n]*\n(.*?)```", text, re.DOTALL):
            first_line = text.count("\n", 0, match.start(1)) + 1
            for offset, line in enumerate(match.group(1).splitlines()):
                command = line.split(" #", 1)[0].strip()
                if re.match(r"(\.venv/bin/)?sharpen [a-z]", command):
                    found.append((f"{page.relative_to(ROOT)}:{first_line + offset}", command))
        prose = re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.DOTALL)
        for match in re.finditer(r"`((?:\.venv/bin/)?sharpen [a-z][^`]*)`", prose):
            if ".toml" in match.group(1) or "RECIPE" in match.group(1):
                found.append((f"{page.relative_to(ROOT)}:{prose.count(chr(10), 0, match.start()) + 1}", match.group(1)))
    return found


COMMANDS = documented_commands()


def argv_of(command: str) -> list[str]:
    """The command's arguments as a shell would pass them, placeholders filled and optional parts left out."""
    command = re.sub(r"\s*\[[^\]]*\]", "", command)  # [--step N] [overrides]: optional
    for placeholder, value in PLACEHOLDERS.items():
        command = re.sub(rf"(?<![\w/.-]){re.escape(placeholder)}(?![\w.-])", value, command)
    words = shlex.split(command)
    assert words[0] in {"sharpen", ".venv/bin/sharpen"}, command
    return words[1:]


def test_the_pages_show_commands_of_every_kind_checked_here() -> None:
    """A guard on the extraction itself: the README's block and the scaling page's examples are found."""
    subcommands = {argv_of(command)[0] for _, command in COMMANDS}
    assert {"train", "config", "simulate", "models", "inspect", "eval", "replay", "dashboard"} <= subcommands
    assert len(COMMANDS) >= 30


@pytest.mark.parametrize(("where", "command"), COMMANDS, ids=[where for where, _ in COMMANDS])
def test_a_documented_command_parses_and_names_files_that_exist(
    where: str, command: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(ROOT)
    argv = argv_of(command)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: `{command}` does not parse (argparse printed why above)")
    recipe = getattr(args, "recipe", None)
    if recipe is None or args.command not in RECIPE_COMMANDS:
        return
    path = ROOT / recipe
    if not path.is_file():  # a recipe the page shows for the reader to save: its TOML block after its name
        text = (ROOT / where.rpartition(":")[0]).read_text(encoding="utf-8")
        named = text.find(f"`{recipe}`")
        block = re.search(r"```toml\n(.*?)```", text[named:], re.DOTALL) if named >= 0 else None
        assert block is not None, f"{where}: `{command}` names {recipe}: not in the repository, not shown on the page"
        path = tmp_path / recipe
        path.write_text(block.group(1), encoding="utf-8")
    overrides = [word for word in argv[1:] if "=" in word and not word.startswith("-")]
    load_config(path, overrides)  # a ConfigError here is the line `sharpen train` would print


def first_of_each(kind: str) -> list[tuple[str, str]]:
    """The commands of one subcommand, each command once (pages repeat some)."""
    seen: set[tuple[str, ...]] = set()
    chosen = []
    for where, command in COMMANDS:
        argv = tuple(argv_of(command))
        if argv[0] == kind and argv not in seen:
            seen.add(argv)
            chosen.append((where, command))
    return chosen


SIMULATE = first_of_each("simulate")
CONFIG = first_of_each("config")


@pytest.mark.parametrize(("where", "command"), SIMULATE, ids=[where for where, _ in SIMULATE])
def test_a_documented_simulation_runs_and_searches_its_own_scenario(
    where: str, command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(ROOT)
    argv = argv_of(command)
    if "--search-split" in argv:
        at = argv.index("--search-split")
        budget, argv = int(argv[at + 1]), argv[:at] + argv[at + 2 :]
        cluster = load_scenario(ROOT / argv[1]).cluster
        assert budget == cluster.num_engine_gpus + cluster.num_trainer_gpus, (
            f"{where}: `{command}` searches {budget} GPUs; its scenario has "
            f"{cluster.num_engine_gpus} + {cluster.num_trainer_gpus}"
        )
    assert main(argv) == 0, f"{where}: `{command}` failed: {capsys.readouterr().err}"
    output = capsys.readouterr().out
    assert "[validated " in output or "--json" in argv


@pytest.mark.parametrize(("where", "command"), CONFIG, ids=[where for where, _ in CONFIG])
def test_a_documented_config_command_runs(
    where: str, command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(ROOT)
    assert main(argv_of(command)) == 0, f"{where}: `{command}` failed: {capsys.readouterr().err}"
    assert capsys.readouterr().out.strip()
