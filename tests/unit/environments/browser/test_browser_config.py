"""The browser section: what it accepts, what it refuses (with one clear message), what reaches the environment, and
the tasks it makes."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sharpen.config import load_config
from sharpen.config.browser import BrowserEnvironmentConfig
from sharpen.environments.browser import BrowserEnvironment, BrowserPool, make_browser_tasks
from sharpen.environments.registry import (
    build_environment_factory,
    close_environment_factory,
    environment_tasks,
    episode_limits,
)


def test_a_recipe_selects_the_browser_environment_by_type() -> None:
    config = load_config(
        None,
        [
            'environment.type="browser"',
            'environment.tasks=["click-test-2"]',
            "environment.max_turns=3",
            'data.type="environment"',
            "data.size=5",
        ],
    )
    assert isinstance(config.environment, BrowserEnvironmentConfig)
    assert episode_limits(config.environment).max_turns == 3
    examples = environment_tasks(config.environment, size=5, seed=0)
    assert [e.metadata["task"] for e in examples] == ["click-test-2"] * 5


@pytest.mark.parametrize(
    ("observation", "tools"),
    [
        ("text", ["click", "type", "press", "scroll", "done"]),
        ("screenshot", ["click_at", "type_at", "press", "scroll", "done"]),  # no element ids: pixels
        ("both", ["click", "type", "press", "scroll", "done"]),
    ],
)
def test_the_observation_reaches_the_environment_with_its_tools(observation: str, tools: list[str]) -> None:
    config = load_config(None, ['environment.type="browser"', f'environment.observation="{observation}"'])
    assert isinstance(config.environment, BrowserEnvironmentConfig)
    factory = build_environment_factory(config.environment)
    try:
        environment = factory()
        assert isinstance(environment, BrowserEnvironment)  # the pool has started no browser for it
        assert environment.observation == observation and list(environment.tools) == tools
    finally:
        close_environment_factory(factory)


def test_an_unknown_observation_is_refused_by_the_section_and_the_environment() -> None:
    with pytest.raises(ValidationError, match="'text', 'screenshot' or 'both'"):
        BrowserEnvironmentConfig(observation="video")  # type: ignore[arg-type]
    pool = BrowserPool()  # starts no browser
    with pytest.raises(ValueError, match="unknown browser observation 'video'"):
        BrowserEnvironment(pool=pool, observation="video")  # type: ignore[arg-type]
    pool.close()


def test_the_text_demonstration_is_refused_with_screenshots_alone() -> None:
    with pytest.raises(ValidationError, match=r'demonstration = true shows a page as text.*observation = "both"'):
        BrowserEnvironmentConfig(observation="screenshot", demonstration=True)
    assert BrowserEnvironmentConfig(observation="both", demonstration=True).demonstration


def test_a_malformed_task_name_is_refused_by_the_section() -> None:
    with pytest.raises(ValidationError, match="not MiniWoB task names"):
        BrowserEnvironmentConfig(tasks=["Click Button"])


def test_an_unknown_task_fails_when_the_environment_is_built_naming_known_ones() -> None:
    config = BrowserEnvironmentConfig(tasks=["click-button", "click-the-moon"])
    with pytest.raises(ValueError, match=r"unknown MiniWoB task 'click-the-moon' \(\d+ known, e\.g\. "):
        build_environment_factory(config)
    with pytest.raises(ValueError, match="click-the-moon"):
        make_browser_tasks(config, size=2, seed=0)


def test_a_missing_browser_executable_is_one_clear_error() -> None:
    config = BrowserEnvironmentConfig(chromedriver="/nonexistent/chromedriver")
    with pytest.raises(ValueError, match="chromium-driver"):
        build_environment_factory(config)


def test_tasks_cycle_through_the_names_with_seeds_fixed_by_the_run_seed() -> None:
    config = BrowserEnvironmentConfig(tasks=["click-button", "click-link"])
    first = make_browser_tasks(config, size=4, seed=7)
    assert [e.task_key for e in first] == [
        "browser/click-button/0",
        "browser/click-link/1",
        "browser/click-button/2",
        "browser/click-link/3",
    ]
    assert first == make_browser_tasks(config, size=4, seed=7)
    seeds = [e.metadata["seed"] for e in first]
    assert len(set(seeds)) == 4
    assert seeds != [e.metadata["seed"] for e in make_browser_tasks(config, size=4, seed=8)]
    assert all(e.prompt for e in first)  # a prompt to render (the parity probe renders every example's)


def test_browser_episodes_can_run_on_served_replicas_and_remote_needs_urls() -> None:
    section = BrowserEnvironmentConfig.model_validate({"remote": {"urls": ["http://10.0.0.7:8200"]}})
    assert section.remote is not None and section.remote.urls == ["http://10.0.0.7:8200"]
    with pytest.raises(ValidationError, match=r"environment\.remote\.urls"):
        BrowserEnvironmentConfig.model_validate({"remote": {}})
