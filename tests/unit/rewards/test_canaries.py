"""Judge canaries in a run: the schedule (steps 0, N, 2N, ...), per-judge metrics, the alert metric and its warning,
and which reward functions get a monitor."""

from __future__ import annotations

import json
import logging

import pytest

from sharpen.config.rewards import RewardConfig
from sharpen.rewards import Rubric
from sharpen.rewards.canaries import CanaryMonitor, build_canary_monitor
from sharpen.rewards.judge import ChatReply, Judge
from sharpen.rewards.judge_prompts import CANARIES
from sharpen.types import Example, RewardResult, RewardStatus

JUDGE = {"type": "judge", "base_url": "http://127.0.0.1:9", "model": "m"}


class FakeChat:
    """A `ChatClient` that grades by a rule on the candidate response it was shown; counts its requests."""

    def __init__(self, grade, *, model: str = "fake") -> None:
        self.model = model
        self.grade = grade
        self.num_requests = 0

    def chat(self, messages: list[dict[str, str]]) -> ChatReply:
        self.num_requests += 1
        encoded = messages[1]["content"].split("<data>\n")[1].split("\n</data>")[0]
        score = self.grade(json.loads(encoded)["response"])
        return ChatReply(
            text=f'{{"reasoning": "r", "score": {score}}}', prompt_tokens=3, completion_tokens=2, finish_reason="stop"
        )


def sound(response: str) -> float:
    return 0.0


def fooled_by_a_colon(response: str) -> float:
    return 9.0 if response == ":" else 1.0


def test_canaries_run_at_step_zero_and_every_n_steps_after():
    client = FakeChat(sound)
    monitor = CanaryMonitor({"judge": Judge(client)}, 3)
    ran = [step for step in range(8) if monitor.maybe_run(step)]
    assert ran == [0, 3, 6]
    assert client.num_requests == 3 * len(CANARIES), "each run grades every canary, never from the cache"


def test_a_sound_judge_raises_no_alert():
    metrics = CanaryMonitor({"judge": Judge(FakeChat(sound))}, 1).maybe_run(0)
    assert metrics["hack/judge_canary_alert"] == 0.0
    assert metrics["judge/judge/canary_max_score"] == 0.0 and metrics["judge/judge/canary_abstained"] == 0.0
    assert {f"judge/judge/canary/{name}" for name in CANARIES} <= set(metrics)


def test_a_gullible_judge_raises_the_alert_and_a_warning_naming_it(caplog):
    judges = {"strict": Judge(FakeChat(sound)), "gullible": Judge(FakeChat(fooled_by_a_colon), canary_threshold=0.5)}
    with caplog.at_level(logging.WARNING, logger="sharpen.rewards.canaries"):
        metrics = CanaryMonitor(judges, 5).maybe_run(10)
    assert metrics["hack/judge_canary_alert"] == 1.0
    assert metrics["judge/gullible/canary_alert"] == 1.0 and metrics["judge/strict/canary_alert"] == 0.0
    assert metrics["judge/gullible/canary/colon"] == pytest.approx(0.9)
    assert "step 10: judge canary alert: gullible scored" in caplog.text


def test_the_threshold_is_the_judges():
    judge = Judge(FakeChat(fooled_by_a_colon), canary_threshold=0.95)
    assert CanaryMonitor({"judge": judge}, 1).maybe_run(0)["hack/judge_canary_alert"] == 0.0


def test_monitor_needs_judges_and_a_positive_period():
    with pytest.raises(ValueError, match="every_steps must be >= 1"):
        CanaryMonitor({"judge": Judge(FakeChat(sound))}, 0)
    with pytest.raises(ValueError, match="no judges"):
        CanaryMonitor({}, 2)


def test_build_canary_monitor_for_a_rubric_with_judges_and_canaries_on():
    config = RewardConfig.model_validate({"components": [JUDGE, {**JUDGE, "name": "second"}], "judge_canary_every": 4})
    rubric = Rubric(config)
    monitor = build_canary_monitor(rubric)
    assert monitor is not None and monitor.every_steps == 4
    assert monitor.judges == rubric.judges() and set(monitor.judges) == {"judge", "second"}


def test_no_monitor_without_canaries_judges_or_a_rubric():
    assert build_canary_monitor(Rubric(RewardConfig.model_validate({"components": [JUDGE]}))) is None
    assert build_canary_monitor(Rubric(RewardConfig())) is None
    # a judge supplied as something else than a Judge (e.g. a test's fake) has no canaries to run
    config = RewardConfig.model_validate({"components": [JUDGE], "judge_canary_every": 2})
    fake = Rubric(config, components={"judge": lambda e, c: RewardResult(score=1.0, status=RewardStatus.OK)})
    assert build_canary_monitor(fake) is None

    def reward_fn(example: Example, completion: str) -> RewardResult:
        return RewardResult(score=1.0, status=RewardStatus.OK)

    assert build_canary_monitor(reward_fn) is None
