"""The terminal environment in the real sandbox, driven by scripted turns: every task of the set is solved by shell
commands (its checker passes) and scores 0 before that; the shell keeps its working directory, files and exports
between turns, survives a command cut by its limit and an ``exit``, truncates a flood of output, and forgets
everything between episodes; the hidden checker is out of the shell's reach and the shell cannot write outside
its workspace."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sharpen.config import ConfigError, load_config
from sharpen.config.environments import TerminalEnvironmentConfig
from sharpen.config.sandbox import SandboxConfig
from sharpen.environments import EpisodeContext, StepResult
from sharpen.environments.registry import build_environment_factory, build_sandbox, environment_tasks
from sharpen.environments.sandbox import SandboxPool
from sharpen.environments.terminal import TerminalEnvironment
from sharpen.environments.terminal_tasks import TERMINAL_TASKS, SandboxCheck, build_terminal_task
from sharpen.types import Example

RECIPE = Path(__file__).parents[3] / "recipes" / "terminal.toml"
pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (make system-deps)")

SOLUTIONS: dict[str, str] = {
    "create_file": "echo {line} > greeting.txt",
    "count_errors": "grep -c ERROR app.log > answer.txt",
    "sort_unique": "sort -u names.txt > unique.txt",
    "csv_sum": "awk -F, 'NR > 1 {s += $2} END {print s}' sales.csv > answer.txt",
    "csv_cities": "tail -n +2 people.csv | cut -d, -f2 | sort -u > cities.txt",
    "rename_extension": 'cd notes && for f in *.txt; do mv "$f" "${f%.txt}.md"; done',
    "fix_json": "python3 - <<'EOF'\nimport re\nt = open('config.json').read()\n"
    "open('config.json', 'w').write(re.sub(r',\\s*}', '}', t))\nEOF",
    "top_word": "tr ' ' '\\n' < text.txt | grep . | sort | uniq -c | sort -rn | head -1 "
    "| awk '{print $2}' > answer.txt",
    "replace_text": "sed -i 's/\\b{old}\\b/{new}/g' story.txt",
    "sort_by_prefix": "mkdir -p images docs && mv img_* images/ && mv doc_* docs/",
    "count_code_lines": "find src -name '*.py' -exec cat {} + | wc -l > answer.txt",
    "max_value": "sort -n numbers.txt | tail -n 1 > answer.txt",
    "extract_column": "cut -f2 table.tsv > column.txt",
    "json_to_csv": "python3 - <<'EOF'\nimport json\nrows = json.load(open('records.json'))\n"
    "lines = ['id,city'] + [f\"{r['id']},{r['city']}\" for r in rows]\n"
    "open('records.csv', 'w').write('\\n'.join(lines) + '\\n')\nEOF",
    "double_script": "cat > double.sh <<'EOF'\necho $(( $1 * 2 ))\nEOF\nbash double.sh 21",
}


def _call(command: str) -> str:
    return f"<tool_call>{json.dumps({'name': 'run_command', 'arguments': {'command': command}})}</tool_call>"


def _solution(example: Example) -> str:
    text, solution = example.prompt[0].text, SOLUTIONS[example.metadata["task"]]
    if match := re.search(r"exactly the line: (\S+)", text):
        solution = solution.replace("{line}", match.group(1))
    if match := re.search(r"the word (\w+) with (\w+)", text):
        solution = solution.replace("{old}", match.group(1)).replace("{new}", match.group(2))
    return solution


@pytest.fixture(scope="module")
def pool() -> Iterator[SandboxPool]:
    sandbox = build_sandbox(TerminalEnvironmentConfig(), SandboxConfig(backend="bwrap", wall_seconds=60))
    assert isinstance(sandbox, SandboxPool) and sandbox.report.backend == "bwrap"
    with sandbox:
        yield sandbox


def _episode(
    pool: SandboxPool, example: Example, actions: list[str], *, max_turns: int = 8, **options: Any
) -> tuple[TerminalEnvironment, list[StepResult]]:
    async def play() -> tuple[TerminalEnvironment, list[StepResult]]:
        environment = TerminalEnvironment(**options)
        ctx = EpisodeContext(seed=0, sample_index=0, max_turns=max_turns, max_tokens=9999, sandbox=pool)
        await environment.reset(example, ctx)
        results = []
        for action in actions[:max_turns]:  # the episode loop stops at max_turns
            results.append(await environment.step(action))
            if results[-1].terminated or results[-1].truncated:
                break
        return environment, results

    return asyncio.run(play())


def _task(name: str, index: int = 0) -> Example:
    return TerminalEnvironment.make_tasks(index + 1, seed=7, tasks=[name])[index]


def _outputs(results: list[StepResult]) -> list[str]:
    return [message.text for result in results for message in result.observation]


def test_the_set_has_enough_deterministic_tasks_with_a_solution_each() -> None:
    assert len(TERMINAL_TASKS) >= 10 and set(SOLUTIONS) == set(TERMINAL_TASKS)
    first, again = (TerminalEnvironment.make_tasks(30, seed=3, tasks=[]) for _ in range(2))
    assert first == again and {e.metadata["task"] for e in first} == set(TERMINAL_TASKS)
    assert all(e.answer is None for e in first)  # nothing of the checker travels with the prompt
    assert build_terminal_task("csv_sum", 5).files == build_terminal_task("csv_sum", 5).files
    with pytest.raises(ValueError, match="unknown terminal tasks"):
        TerminalEnvironment.make_tasks(1, seed=0, tasks=["no_such_task"])


@pytest.mark.parametrize("name", sorted(TERMINAL_TASKS))
def test_every_task_scores_0_untouched_and_1_when_solved(pool: SandboxPool, name: str) -> None:
    example = _task(name, index=1)
    _, results = _episode(pool, example, [_call("ls"), _call(_solution(example)), "Done."])
    untouched, solved, answer = results
    assert untouched.reward == 0.0, _outputs(results)
    assert solved.reward == 1.0, _outputs(results)
    assert answer.terminated and answer.reward == 0.0 and answer.info["grade"] == 1.0
    assert sum(r.reward or 0.0 for r in results) == 1.0


def test_a_wrong_solution_scores_0(pool: SandboxPool) -> None:
    _, counted = _episode(pool, _task("count_errors"), [_call("grep -c INFO app.log > answer.txt"), "Done."])
    _, doubled = _episode(pool, _task("double_script"), [_call("echo 'echo 42' > double.sh"), "Done."])
    assert [r.reward for r in counted] == [0.0, 0.0] and [r.reward for r in doubled] == [0.0, 0.0]
    _, undone = _episode(
        pool, _task("max_value"), [_call("sort -n numbers.txt | tail -n 1 > answer.txt"), _call("rm answer.txt")]
    )
    assert [r.reward for r in undone] == [1.0, -1.0]  # rewards sum to the grade of the last turn


def test_the_working_directory_files_and_exports_persist(pool: SandboxPool) -> None:
    commands = ["mkdir -p a/b && cd a/b && echo kept > f.txt && export GREETING=hi", "pwd; cat f.txt; echo $GREETING"]
    _, results = _episode(pool, _task("create_file"), [_call(c) for c in commands])
    assert _outputs(results) == ["exit code: 0", "exit code: 0\n/home/sandbox/a/b\nkept\nhi"]


def test_a_command_past_its_limit_is_cut_and_the_shell_goes_on(pool: SandboxPool) -> None:
    commands = ["cd /tmp", "sleep 30; cd /", "pwd; exit 3", "echo still here; pwd"]
    _, results = _episode(pool, _task("create_file"), [_call(c) for c in commands], command_timeout_seconds=1.0)
    assert "ran past its 1 s limit and was killed" in _outputs(results)[1]
    assert _outputs(results)[2:] == ["exit code: 3\n/tmp", "exit code: 0\nstill here\n/tmp"]


def test_a_flood_of_output_is_cut_to_its_head_and_tail(pool: SandboxPool) -> None:
    _, results = _episode(pool, _task("create_file"), [_call("seq 1 200000")], max_output_chars=400)
    (output,) = _outputs(results)
    assert output.startswith("exit code: 0 (output of 1288895 bytes, cut to its start and end)\n1\n2\n")
    assert output.endswith("199999\n200000") and "bytes of output cut" in output and len(output) < 600


def test_no_state_crosses_episodes(pool: SandboxPool) -> None:
    _, first = _episode(pool, _task("create_file"), [_call("echo secret > left.txt; echo x > /tmp/left; ls")])
    _, second = _episode(pool, _task("create_file"), [_call("ls; ls /tmp/left; cat ~/left.txt")])
    assert "left.txt" in _outputs(first)[0]
    assert "left.txt\n" not in _outputs(second)[0] and "No such file" in _outputs(second)[0]


def test_the_hidden_checker_is_out_of_the_shells_reach(pool: SandboxPool) -> None:
    example = _task("double_script")
    check = build_terminal_task("double_script", example.metadata["task_seed"]).check
    assert isinstance(check, SandboxCheck)
    search = (
        "find / \\( -path /proc -o -path /usr \\) -prune -o -name 'test_double*' -print 2>/dev/null; "
        "grep -rlF --exclude-dir=.terminal 'timeout 5 bash double.sh' ~ /tmp"
    )
    _, results = _episode(pool, example, [_call(search)])
    assert _outputs(results) == ["exit code: 1"]  # neither the checker's file nor its text is anywhere (grep: none)


def test_the_shell_cannot_write_outside_its_workspace(pool: SandboxPool) -> None:
    writes = "for p in /usr/x /etc/x /x /home/x /work/x; do touch $p 2>/dev/null && echo wrote $p; done; ls /work"
    _, results = _episode(pool, _task("create_file"), [_call(writes)])
    assert _outputs(results)[0].startswith("exit code: 2\n") and "wrote" not in _outputs(results)[0]


def test_a_shell_killed_by_its_own_command_ends_the_episode(pool: SandboxPool) -> None:
    kill = "kill -9 $(awk '{print $4}' /proc/$PPID/stat)"  # the controller: the parent of the command's timeout
    example = _task("max_value")
    _, results = _episode(pool, example, [_call(_solution(example)), _call(kill), _call("ls")])
    assert [r.reward for r in results] == [1.0, 0.0] and results[-1].truncated
    assert results[-1].info["stop"] == "shell_lost" and results[-1].info["grade"] == 1.0


def test_the_episode_ends_at_max_turns_and_without_a_tool_call(pool: SandboxPool) -> None:
    environment, results = _episode(pool, _task("create_file"), [_call("ls"), _call("ls")], max_turns=1)
    assert len(results) == 1 and results[0].reward == 0.0
    assert environment.shell is not None and environment.shell.close_blocking() is None  # closed after the last turn
    _, answered = _episode(pool, _task("create_file"), ["I am done."])
    assert answered[0].terminated and answered[0].reward == 0.0


def test_the_config_builds_the_environment_its_tasks_and_its_sandbox() -> None:
    config = TerminalEnvironmentConfig(tasks=["csv_sum"], command_timeout_seconds=2.0, max_output_chars=100)
    environment = build_environment_factory(config)()
    assert isinstance(environment, TerminalEnvironment)
    assert environment.command_timeout_seconds == 2.0 and environment.keep_bytes == 100
    assert {e.metadata["task"] for e in environment_tasks(config, size=3, seed=0)} == {"csv_sum"}
    with pytest.raises(ValueError, match="unknown terminal tasks"):
        build_environment_factory(TerminalEnvironmentConfig(tasks=["nope"]))


def test_the_sandbox_must_outlive_an_episode() -> None:
    with pytest.raises(ConfigError, match=r"sandbox\.wall_seconds"):
        load_config(RECIPE, ["environment.wall_seconds=120", "sandbox.wall_seconds=10"])
    assert load_config(RECIPE).environment.type == "terminal"
