"""The browser environment with real Chromium and MiniWoB tasks: scripted right and wrong actions (on the page as
text, on screenshots, on both), a browser killed mid-episode (the episode abstains, the pool replaces the browser),
replays that see the same pages and the same screenshots, and screenshot episodes of a vision-language model whose
tokens are exactly what the engine was given turn by turn."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import io
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from test_tiny_loop import tiny_config

from sharpen.cli.main import main
from sharpen.config.browser import BrowserEnvironmentConfig
from sharpen.config.engines import ScriptedEngineConfig
from sharpen.config.schema import EnvironmentTasksDataConfig
from sharpen.data.vision import VisionProcessor
from sharpen.environments.base import EnvironmentInfraError, EpisodeContext, EpisodeLimits
from sharpen.environments.browser import BrowserEnvironment, BrowserPool
from sharpen.environments.browser.environment import Observation
from sharpen.monitoring import read_jsonl, rollout_record
from sharpen.orchestration.embedded import run_embedded
from sharpen.rewards.scoring import score_rollout
from sharpen.rollout.engines.hf import HfEngine
from sharpen.rollout.engines.scripted import ScriptedEngine
from sharpen.rollout.episodes import EpisodeRunner
from sharpen.rollout.replay import replay_episode
from sharpen.types import Completion, Example, ImagePart, Message, RewardResult, RewardStatus, SamplingParams

pytestmark = pytest.mark.slow


def click(element_id: int) -> str:
    return f'<tool_call>{{"name": "click", "arguments": {{"id": {element_id}}}}}</tool_call>'


def call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


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


def play(pool: BrowserPool, example: Example, *, is_right: bool, observation: Observation = "text") -> float | None:
    async def episode() -> float | None:
        environment = BrowserEnvironment(pool=pool, observation=observation)
        first = await environment.reset(example, context())
        if observation == "screenshot":
            action = await pointed_action(environment, first[-1], is_right=is_right)
        else:
            action = scripted_action(first[-1].text, is_right=is_right)
        if observation != "text":
            assert_task_area_png(first[-1])
        result = await environment.step(action)
        assert result.terminated
        return result.reward

    return asyncio.run(episode())


def assert_task_area_png(message: Message) -> None:
    """``message`` shows one screenshot: a PNG of MiniWoB's 160x210 task area, after its text."""
    from PIL import Image

    assert isinstance(message.content, tuple) and isinstance(message.content[-1], ImagePart)
    [image] = message.images
    with Image.open(io.BytesIO(image.data)) as opened:
        assert (opened.format, opened.size) == ("PNG", (160, 210))


# The text and centre (in screenshot pixels) of each element that matches a selector: where a policy reading the
# screenshot would point (the scripted policies read the page instead).
_CENTRES_JS = """
const area = document.getElementById('wrap').getBoundingClientRect();
return Array.from(document.querySelectorAll(arguments[0])).map(el => {
  const box = el.getBoundingClientRect();
  const x = box.x + box.width / 2 - area.x, y = box.y + box.height / 2 - area.y;
  return [el.textContent.trim(), Math.round(x), Math.round(y)];
});
"""


async def centres(environment: BrowserEnvironment, selector: str) -> list[tuple[str, int, int]]:
    async with environment.pool.lease(environment) as lease:  # the browser that shows the episode's page
        return await lease.run(lambda driver: driver.execute_script(_CENTRES_JS, selector))


async def pointed_action(environment: BrowserEnvironment, shown: Message, *, is_right: bool) -> str:
    """`scripted_action` for a screenshot: a click at the named button's centre, or at another button's."""
    name = re.search(r'Click on the "(.*)" button\.', shown.text)
    assert name is not None and "[1]" not in shown.text, shown.text  # the instruction, no element ids
    buttons = await centres(environment, "#area button")
    right = [(x, y) for text, x, y in buttons if text == name.group(1)]
    wrong = [(x, y) for text, x, y in buttons if text != name.group(1)]
    if is_right:
        return call("click_at", x=right[0][0], y=right[0][1])
    return call("click_at", x=wrong[0][0], y=wrong[0][1]) if wrong else call("done")


@pytest.mark.parametrize(("observation", "num_tasks"), [("text", 6), ("screenshot", 3), ("both", 3)])
def test_scripted_right_and_wrong_clicks_on_click_button_score_1_and_0(
    observation: Observation, num_tasks: int
) -> None:
    pool = BrowserPool(size=2)
    try:
        for example in BrowserEnvironment.make_tasks(num_tasks, seed=3, tasks=["click-button"]):
            assert play(pool, example, is_right=True, observation=observation) == 1.0
            assert play(pool, example, is_right=False, observation=observation) == 0.0
        assert pool.stats.num_started <= 2 and pool.stats.num_crashed == 0
    finally:
        pool.close()


def test_on_a_screenshot_the_policy_points_and_types_at_pixels_and_a_point_outside_is_an_error() -> None:
    [example] = BrowserEnvironment.make_tasks(1, seed=4, tasks=["enter-text"])
    pool = BrowserPool(size=1)

    async def episode() -> list[Any]:
        environment = BrowserEnvironment(pool=pool, observation="screenshot")
        system, shown = await environment.reset(example, context())
        assert '"name": "click_at"' in system.text and '"name": "click"' not in system.text
        word = re.search(r'Enter "(.*)" into the text field', shown.text)
        assert word is not None, shown.text
        [(_, *field)], [(_, *submit)] = (
            await centres(environment, "#area input"),
            await centres(environment, "#area button"),
        )
        actions = [call("click_at", x=160, y=5), call("type_at", x=field[0], y=field[1], text=word.group(1))]
        actions.append(call("click_at", x=submit[0], y=submit[1]))
        return [await environment.step(action) for action in actions]

    try:
        outside, typed, submitted = asyncio.run(episode())
    finally:
        pool.close()
    assert outside.observation[0].text.startswith("error: (160, 5) is outside the screenshot (160x210 pixels")
    assert outside.info["num_invalid_actions"] == 1 and not outside.terminated
    assert typed.observation[0].text.startswith("typed ") and typed.info["num_invalid_actions"] == 0
    assert typed.info["image_sha256"] != outside.info["image_sha256"]  # the typed word shows
    assert submitted.terminated and submitted.reward == 1.0


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


def test_a_browser_over_its_memory_limit_is_killed_and_replaced() -> None:
    """chromedriver and Chromium run in a cgroup of their own: a page that allocates past its memory limit crashes
    there (not the host), the call is an infrastructure error naming the limit, and the next call gets a new one."""
    pool = BrowserPool(size=1, memory_mb=300)
    if not pool.has_cgroup_limits:
        pool.close()
        pytest.skip("this process may not make cgroups here (the browser runs without a memory limit)")
    allocate = "window.kept = []; for (let i = 0; i < 40; i++) { window.kept.push(new Uint8Array(50 << 20).fill(1)); }"

    async def episode() -> int:
        async with pool.lease(object()) as lease:
            await lease.run(lambda driver: driver.get("about:blank"))
            assert lease.browser.cgroup is not None
            members = len(lease.browser.cgroup.pids())  # chromedriver and Chromium's processes, all inside
            with pytest.raises(EnvironmentInfraError, match="ran out of its 300 MB memory limit"):
                await lease.run(lambda driver: driver.execute_script(allocate))
        async with pool.lease(object()) as lease:  # a new browser in a new cgroup
            await lease.run(lambda driver: driver.get("about:blank"))
        return members

    try:
        assert asyncio.run(episode()) >= 3
        assert pool.stats.num_crashed == 1 and pool.stats.num_started == 2
    finally:
        pool.close()
    # the pool's cgroups are gone with it
    assert not [path for d in pool._cgroup_dirs if d.path.exists() for path in d.path.iterdir() if path.is_dir()]


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
        seen = [(await environment.reset(example, context(seed)))[-1].text]
        for action in actions:
            seen.extend(m.text for m in (await environment.step(action)).observation)
        return seen

    return asyncio.run(episode())


def shown(message: Message) -> tuple[str, list[str]]:
    """A message as its text and the sha256 of each image's bytes."""
    return message.text, [hashlib.sha256(image.data).hexdigest() for image in message.images]


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
            seen = [(await mine.reset(example, context()))[-1].text]
            await theirs.reset(other, context())
            restores = []
            for action in actions:
                result = await mine.step(action)
                seen.extend(m.text for m in result.observation)
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


def screens(pool: BrowserPool, example: Example, actions: list[str], *, pause_s: float = 0.0) -> list[Any]:
    """The screenshot episode's observations (text and screenshot digests), waiting ``pause_s`` before each turn."""

    async def episode() -> list[tuple[str, list[str]]]:
        environment = BrowserEnvironment(pool=pool, observation="screenshot")
        seen = [shown((await environment.reset(example, context()))[-1])]
        for action in actions:
            await asyncio.sleep(pause_s)
            result = await environment.step(action)
            assert not result.terminated
            seen.extend(shown(message) for message in result.observation)
            assert result.info["image_sha256"] == seen[-1][1]
        return seen

    return asyncio.run(episode())


def test_the_same_seed_shows_the_same_screenshots_on_a_reused_a_shared_and_a_fresh_browser() -> None:
    # enter-text: a text field to focus (a caret blinks in it every 0.5 s unless the page is kept still)
    example, other = (BrowserEnvironment.make_tasks(1, seed=seed, tasks=["enter-text"])[0] for seed in (21, 22))
    pool = BrowserPool(size=1)

    async def field_centre() -> tuple[int, int]:  # each instance puts its text field elsewhere
        environment = BrowserEnvironment(pool=pool, observation="screenshot")
        await environment.reset(example, context())
        [(_, x, y)] = await centres(environment, "#area input")
        return x, y

    try:
        x, y = asyncio.run(field_centre())
        actions = [call("type_at", x=x, y=y, text="abc"), call("scroll", dx=0, dy=40), call("press", key="Backspace")]
        actions.append(call("click_at", x=5, y=200))  # an empty spot
        first = screens(pool, example, actions)
        assert len({digest for _, digests in first for digest in digests}) >= 3  # typing and deleting show
        assert screens(pool, other, actions)[0] != first[0]  # another instance, another page
        assert screens(pool, example, actions, pause_s=0.6) == first  # turns 0.6 s apart: past a caret blink

        async def interleaved() -> list[tuple[str, list[str]]]:  # two episodes take turns on one browser
            mine = BrowserEnvironment(pool=pool, observation="screenshot")
            theirs = BrowserEnvironment(pool=pool, observation="screenshot")
            seen = [shown((await mine.reset(example, context()))[-1])]
            await theirs.reset(other, context())
            for action in actions:
                result = await mine.step(action)
                assert result.info["num_page_restores"] == 1  # it found the other page and rebuilt its own
                seen.extend(shown(message) for message in result.observation)
                await theirs.step(action)  # and their pointer was elsewhere
            return seen

        assert asyncio.run(interleaved()) == first
    finally:
        pool.close()
    fresh = BrowserPool(size=1)
    try:
        assert screens(fresh, example, actions) == first
    finally:
        fresh.close()


class _RecordingHfEngine(HfEngine):
    """The `hf` engine, keeping every prompt it is given with its images."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.requests: list[tuple[list[int], tuple[ImagePart, ...]]] = []

    def generate_with_images(
        self, prompts: list[list[int]], images: Sequence[tuple[ImagePart, ...]], params: list[SamplingParams]
    ) -> list[Completion]:
        self.requests.extend((list(prompt), tuple(row)) for prompt, row in zip(prompts, images, strict=True))
        return super().generate_with_images(prompts, images, params)


def test_screenshot_episodes_of_a_vision_model_keep_exact_token_continuity_and_replay(tiny_vlm_path: Path) -> None:
    vision = VisionProcessor.from_pretrained(tiny_vlm_path)
    engine = _RecordingHfEngine(tiny_vlm_path)
    examples = BrowserEnvironment.make_tasks(1, seed=5, tasks=["click-button"])
    pool = BrowserPool(size=1)
    make_environment = lambda: BrowserEnvironment(pool=pool, observation="screenshot")  # noqa: E731
    limits = EpisodeLimits(max_turns=3)
    runner = EpisodeRunner(tokenizer=vision.tokenizer, vision=vision, make_environment=make_environment, limits=limits)
    # a random model does not end its turn: every token stops it (the runner then closes the turn itself); its turn
    # is no tool call, so every turn gets an error line and a screenshot back, up to max_turns
    sampling = SamplingParams(max_new_tokens=4, temperature=1.0, stop_token_ids=tuple(range(len(vision.tokenizer))))
    try:
        [group] = runner.generate_groups(engine, examples, sampling=sampling, num_samples=2, seed=5)
        assert len(engine.requests) == 2 * 3
        for rollout in group.rollouts:
            assert rollout.episode is not None and [t.is_terminated for t in rollout.episode.turns] == [False] * 3
            assert len(rollout.images) == 3  # the reset's screenshot and one after each of the first two turns
            tokens = rollout.prompt_ids + rollout.completion_ids  # what the trainer sees
            length, num_images, loss_mask = len(rollout.prompt_ids), 1, []
            for turn in rollout.episode.turns:
                # the engine got exactly the trainer's tokens so far, with the screenshots so far
                assert (tokens[:length], rollout.images[:num_images]) in engine.requests
                assert tokens[:length].count(vision.image_token_id) == sum(
                    vision.num_image_tokens(rollout.images[:num_images])
                )
                loss_mask += [True] * turn.num_action_tokens + [False] * len(turn.observation_ids)
                length += turn.num_action_tokens + len(turn.observation_ids)
                num_images += bool(turn.observation_ids)
            assert length == len(tokens) and rollout.loss_mask == loss_mask
            assert_task_area_png(Message(role="user", content=(rollout.images[-1],)))

        record = rollout_record(0, group.rollouts[0])

        def replay(recorded: dict[str, Any]) -> list[str]:
            environment = make_environment()
            tokenizer = vision.tokenizer
            return replay_episode(
                recorded, examples[0], environment, tokenizer=tokenizer, limits=limits, vision=vision
            ).differences

        assert replay(record) == []
        tampered = copy.deepcopy(record)
        tampered["episode"]["turns"][1]["info"]["image_sha256"] = ["0" * 64]
        assert replay(tampered) == ["turn 1: the observation's images differ (sha256 of their bytes)"]
        assert record["images"][0]["sha256"] == hashlib.sha256(group.rollouts[0].images[0].data).hexdigest()
        tampered = copy.deepcopy(record)  # the reset's screenshot, from the record's images
        tampered["images"][0]["sha256"] = "0" * 64
        assert replay(tampered) == ["reset: the first observation's images differ (sha256 of their bytes)"]
    finally:
        pool.close()


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


def test_a_screenshot_run_of_a_vision_model_trains_and_replays_from_the_cli(
    tiny_vlm_path: Path, tmp_path: Path, capsys
) -> None:
    config = tiny_config(tiny_vlm_path, tmp_path, name="screens", num_steps=1, **{"weight_sync.verify": "false"})
    config.environment = BrowserEnvironmentConfig(
        tasks=["click-test-2"], max_turns=2, pool_size=1, observation="screenshot"
    )
    config.data = EnvironmentTasksDataConfig(size=4)
    config.rollout.num_samples_per_prompt = 2
    config.rollout.max_new_tokens = 4
    config.monitoring.num_recorded_rollouts = 4
    run_dir = run_embedded(config)
    [row] = read_jsonl(run_dir / "metrics.jsonl")
    assert row["train/num_loss_tokens"] > 0 and row["reward/num_abstained"] == 0
    assert row["env/screenshot_seconds_mean"] > 0
    recorded = read_jsonl(run_dir / "rollouts.jsonl")
    # a random model's turn runs out of tokens, which ends its episode: the first screenshot is in every prompt
    image_token_id = VisionProcessor.from_pretrained(tiny_vlm_path).image_token_id
    assert all(image_token_id in r["prompt_ids"] for r in recorded)
    index = 0
    # the CLI renders the screenshots with the model's processor (`replay_episode` also compares later turns'
    # digests: test_screenshot_episodes_of_a_vision_model_keep_exact_token_continuity_and_replay)
    assert main(["replay", str(run_dir), "--step", "0", "--index", str(index)]) == 0
    out = capsys.readouterr().out
    assert "reproduced" in out, out


def _chromedrivers() -> set[int]:
    """The chromedriver processes this test process started (each pool's browsers hang below one of them)."""
    found = set()
    for pid in Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split():
        with contextlib.suppress(FileNotFoundError):  # a child that ended meanwhile
            if Path(f"/proc/{pid}/comm").read_text().strip() == "chromedriver":
                found.add(int(pid))
    return found


def run_documented(marker: str, folder: Path) -> str:
    """The output of the python block of docs/environments.md that holds ``marker`` (run as a script)."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "environments.md").read_text()
    [code] = [b for b in re.findall(r"```python\n(.*?)```", doc, re.DOTALL) if marker in b]
    (folder / "browser_example.py").write_text(code)
    done = subprocess.run([sys.executable, str(folder / "browser_example.py")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_documented_example_runs(tmp_path: Path) -> None:
    out = run_documented("BrowserPool(size=1)", tmp_path)
    assert out.endswith('[1] button "ONE"\n[2] button "TWO"\nreward 1.0 terminated True\n'), out


def test_the_documented_screenshot_example_runs(tmp_path: Path) -> None:
    out = run_documented('observation="screenshot"', tmp_path)
    expected = (
        "Task: Click button ONE. (160, 210)\nerror: (200, 5) is outside the screenshot (160x210 pixels, x < 160, "
    )
    assert out == expected + "y < 210)\nreward 1.0 terminated True\n", out
