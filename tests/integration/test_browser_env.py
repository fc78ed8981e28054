"""The browser environment with real Chromium and MiniWoB tasks: scripted right and wrong actions, a browser killed
mid-episode (the episode abstains, the pool replaces the browser), and replays that see the same pages."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_tiny_loop import tiny_config

from sharpen.cli.main import main
from sharpen.config.browser import BrowserEnvironmentConfig
from sharpen.config.engines import ScriptedEngineConfig
from sharpen.config.schema import EnvironmentTasksDataConfig
from sharpen.environments.base import EnvironmentInfraError, EpisodeContext
from sharpen.environments.browser import BrowserEnvironment, BrowserPool
from sharpen.monitoring import read_jsonl
from sharpen.orchestration.embedded import run_embedded
from sharpen.rewards.scoring import score_rollout
from sharpen.rollout.engines.scripted import ScriptedEngine
from sharpen.rollout.episodes import EpisodeRunner
from sharpen.types import Example, RewardResult, RewardStatus, SamplingParams

pytestmark = pytest.mark.slow


def click(element_id: int) -> str:
    return f'<tool_call>{{"name": "click", "arguments": {{"id": {element_id}}}}}</tool_call>'


def context(seed: int = 1) -> EpisodeContext:
    return EpisodeContext(seed=seed, sample_index=0, max_turns=4, max_tokens=4096)


def scripted_action(page_text: str, *, is_right: bool) -> str:
    """A click on the button the task names (``is_right``), else on another button, or done() if there is none."""
    name = re.search(r'Click on the "(.*)" button\.', page_text)
    assert name is not None, page_text
    buttons = re.findall(r'^\[(\d+)\] button "(.*)"$', page_text, re.MULTILINE)
    right = [int(i) for i, text in buttons if text == name.group(1)]
    wrong = [int(i) for i, text in buttons if text != name.group(1)]
    if is_right:
        return click(right[0])
    return click(wrong[0]) if wrong else '<tool_call>{"name": "done", "arguments": {}}</tool_call>'


def play(pool: BrowserPool, example: Example, *, is_right: bool) -> float | None:
    async def episode() -> float | None:
        environment = BrowserEnvironment(pool=pool)
        first = await environment.reset(example, context())
        result = await environment.step(scripted_action(first[-1].content, is_right=is_right))
        assert result.terminated
        return result.reward

    return asyncio.run(episode())


def test_scripted_right_and_wrong_clicks_on_click_button_score_1_and_0() -> None:
    pool = BrowserPool(size=2)
    try:
        for example in BrowserEnvironment.make_tasks(6, seed=3, tasks=["click-button"]):
            assert play(pool, example, is_right=True) == 1.0
            assert play(pool, example, is_right=False) == 0.0
        assert pool.stats.num_started <= 2 and pool.stats.num_crashed == 0
    finally:
        pool.close()


class BrowserKillingEnvironment(BrowserEnvironment):
    """Kills every browser of its pool (chromedriver and Chromium) before its first step."""

    async def step(self, action: str) -> Any:
        if not self._turns:
            for browser in list(self.pool._alive):
                os.killpg(browser.process.pid, signal.SIGKILL)
        return await super().step(action)


def test_a_browser_killed_mid_episode_abstains_and_the_pool_replaces_it(tiny_model_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    pool = BrowserPool(size=1)
    examples = BrowserEnvironment.make_tasks(1, seed=0, tasks=["click-test-2"])
    engine = ScriptedEngine([click(1)], encode=tokenizer.encode, eos_token_id=tokenizer.eos_token_id)
    sampling = SamplingParams(max_new_tokens=40)

    def run(environment: type[BrowserEnvironment]) -> RewardResult:
        runner = EpisodeRunner(tokenizer=tokenizer, make_environment=lambda: environment(pool=pool))
        [group] = runner.generate_groups(engine, examples, sampling=sampling, num_samples=1, seed=0)
        [rollout] = group.rollouts
        return score_rollout(lambda example, completion: pytest.fail("the environment scores"), examples[0], rollout)

    try:
        crashed = run(BrowserKillingEnvironment)
        assert crashed.status == RewardStatus.INFRA_ERROR and crashed.score is None
        assert pool.stats.num_crashed == 1
        solved = run(BrowserEnvironment)  # a fresh browser takes the dead one's place
        assert solved.status == RewardStatus.OK and solved.score == 1.0
        assert pool.stats.num_started == 2
    finally:
        pool.close()


def test_a_hung_browser_call_is_cut_at_its_wall_clock_and_the_browser_replaced() -> None:
    pool = BrowserPool(size=1, call_timeout_s=3.0)
    example = BrowserEnvironment.make_tasks(1, seed=0, tasks=["click-test-2"])[0]

    async def episode() -> None:
        environment = BrowserEnvironment(pool=pool)
        await environment.reset(example, context())
        async with pool.lease(environment) as lease:
            with pytest.raises(EnvironmentInfraError, match="ran past 3 s"):
                await lease.run(lambda driver: driver.execute_async_script("setTimeout(arguments[0], 60000);"))
        assert pool.stats.num_crashed == 1
        result = await environment.step(click(1))  # the episode's page is rebuilt on a new browser
        assert result.reward == 1.0

    try:
        asyncio.run(episode())
        assert pool.stats.num_started == 2
    finally:
        pool.close()


def observations(pool: BrowserPool, example: Example, actions: list[str], *, seed: int) -> list[str]:
    async def episode() -> list[str]:
        environment = BrowserEnvironment(pool=pool)
        seen = [(await environment.reset(example, context(seed)))[-1].content]
        for action in actions:
            seen.extend(m.content for m in (await environment.step(action)).observation)
        return seen

    return asyncio.run(episode())


def test_the_same_seed_shows_the_same_pages_on_a_reused_a_fresh_and_a_shared_browser() -> None:
    example = BrowserEnvironment.make_tasks(1, seed=11, tasks=["click-button"])[0]
    other = BrowserEnvironment.make_tasks(1, seed=12, tasks=["click-button"])[0]
    actions = ['<tool_call>{"name": "type", "arguments": {"id": 99, "text": "x"}}</tool_call>', "no action"]
    actions.append('<tool_call>{"name": "scroll", "arguments": {"dx": 0, "dy": 5}}</tool_call>')
    pool = BrowserPool(size=1)
    try:
        first = observations(pool, example, actions, seed=1)
        observations(pool, other, actions, seed=1)
        assert observations(pool, example, actions, seed=2) == first  # reused browser (the page seed is the task's)

        async def interleaved() -> list[str]:  # two episodes take turns on one browser: each restores its page
            mine, theirs = BrowserEnvironment(pool=pool), BrowserEnvironment(pool=pool)
            seen = [(await mine.reset(example, context()))[-1].content]
            await theirs.reset(other, context())
            restores = []
            for action in actions:
                result = await mine.step(action)
                seen.extend(m.content for m in result.observation)
                restores.append(result.info["num_page_restores"])
                await theirs.step(action)
            assert restores == [1] * len(actions)  # every turn found the other page and rebuilt its own
            return seen

        assert asyncio.run(interleaved()) == first
    finally:
        pool.close()
    fresh = BrowserPool(size=1)
    try:
        assert observations(fresh, example, actions, seed=1) == first
    finally:
        fresh.close()


def test_training_on_browser_tasks_records_episodes_that_replay(tiny_model_path: Path, tmp_path: Path, capsys) -> None:
    config = tiny_config(tiny_model_path, tmp_path, name="browser", num_steps=1, **{"weight_sync.verify": "false"})
    config.environment = BrowserEnvironmentConfig(tasks=["click-test-2"], max_turns=3, pool_size=2)
    config.data = EnvironmentTasksDataConfig(size=8)
    config.rollout.engine = ScriptedEngineConfig(completions=["let me look", click(2), click(1)])
    config.rollout.max_new_tokens = 40
    config.monitoring.num_recorded_rollouts = 8
    drivers_before = _chromedrivers()
    run_dir = run_embedded(config)
    assert _chromedrivers() == drivers_before  # the run closed its browser pool: no browser outlives it
    [row] = read_jsonl(run_dir / "metrics.jsonl")
    assert row["reward/num_abstained"] == 0
    assert row["env/num_actions_per_episode"] >= 1.0 and 0.0 < row["env/num_invalid_actions_mean"] < 1.0
    recorded = read_jsonl(run_dir / "rollouts.jsonl")
    assert {r["reward"]["verifier"] for r in recorded} == {"environment:browser"}
    assert {r["reward"]["score"] for r in recorded} == {0.0, 1.0}  # the scripted turns solve some, fail others
    index = next(i for i, r in enumerate(recorded) if len(r["episode"]["turns"]) > 1)
    assert main(["replay", str(run_dir), "--step", "0", "--index", str(index)]) == 0
    out = capsys.readouterr().out
    assert "reproduced" in out, out
    assert recorded[index]["episode"]["turns"][0]["info"]["num_invalid_actions"] == 1  # "let me look": no call
    assert _chromedrivers() == drivers_before  # and so did the replay


def _chromedrivers() -> set[int]:
    """The chromedriver processes this test process started (each pool's browsers hang below one of them)."""
    found = set()
    for pid in Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split():
        with contextlib.suppress(FileNotFoundError):  # a child that ended meanwhile
            if Path(f"/proc/{pid}/comm").read_text().strip() == "chromedriver":
                found.add(int(pid))
    return found


def test_the_documented_example_runs(tmp_path: Path) -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "environments.md").read_text()
    [code] = [b for b in re.findall(r"```python\n(.*?)```", doc, re.DOTALL) if "BrowserPool(size=1)" in b]
    (tmp_path / "browser_example.py").write_text(code)
    done = subprocess.run([sys.executable, str(tmp_path / "browser_example.py")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith('[1] button "ONE"\n[2] button "TWO"\nreward 1.0 terminated True\n'), done.stdout
