"""Judge canaries in a run: the schedule (steps 0, N, 2N, ...), per-judge metrics, the alert metric and its warning,
the gate a failed check puts on the judge (abstain, or stop the run), and which reward functions get a monitor."""

from __future__ import annotations

import logging

import pytest

from sharpen.config.rewards import DEFAULT_CANARY_EVERY, JudgeComponentConfig, RewardConfig
from sharpen.rewards import Rubric
from sharpen.rewards.canaries import CanaryMonitor, build_canary_monitor
from sharpen.rewards.components import build_judge
from sharpen.rewards.judge import ChatReply, Judge, JudgeCanaryError, OpenAICompatibleClient
from sharpen.rewards.judge_prompts import CANARIES
from sharpen.types import Example, Message, RewardResult, RewardStatus
from support.gullible_judge import GullibleJudge, read_hardened_prompt

JUDGE = {"type": "judge", "base_url": "http://127.0.0.1:9", "model": "m"}


class FakeChat:
    """A `ChatClient` that grades by a rule on the candidate response it was shown; counts its requests."""

    def __init__(self, grade, *, model: str = "fake") -> None:
        self.model = model
        self.grade = grade
        self.num_requests = 0

    def chat(self, messages: list[dict[str, str]]) -> ChatReply:
        self.num_requests += 1
        prompt = read_hardened_prompt(messages)
        text = f'{{"nonce": "{prompt.nonce}", "reasoning": "r", "score": {self.grade(prompt.response)}}}'
        return ChatReply(text=text, prompt_tokens=3, completion_tokens=2, finish_reason="stop")


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


EXAMPLE = Example(
    task_key="t/0", prompt=(Message(role="user", content="What is 2 + 2?"),), answer="4", metadata={"source": "jsonl"}
)


def test_a_failed_check_makes_the_judge_abstain_until_a_check_passes():
    client = FakeChat(fooled_by_a_colon)
    judge = Judge(client)
    assert judge(EXAMPLE, "4").score == pytest.approx(0.1), "no check yet: the judge grades"
    monitor = CanaryMonitor({"judge": judge}, 1)
    metrics = monitor.maybe_run(0)
    assert metrics["hack/judge_canary_alert"] == 1.0 and metrics["judge/judge/canary_gated"] == 1.0
    num_requests = client.num_requests
    gated = judge(EXAMPLE, "other")
    assert gated.score is None and gated.status == RewardStatus.INFRA_ERROR and client.num_requests == num_requests
    assert judge.compare(EXAMPLE, "a", "b") is None
    assert judge.metrics()["judge/canary_gated"] == 2
    client.grade = sound  # the judge was fixed (or the server swapped): the next check lifts the gate
    assert monitor.maybe_run(1)["judge/judge/canary_gated"] == 0.0
    assert judge(EXAMPLE, "other").status == RewardStatus.WRONG


def test_a_failed_check_stops_the_run_when_configured():
    judge = Judge(FakeChat(fooled_by_a_colon), on_canary_failure="stop")
    with pytest.raises(
        JudgeCanaryError, match=r'step 0: judge canary check failed \(judge 0.90 .*on_canary_failure = "stop"'
    ):
        CanaryMonitor({"judge": judge}, 1).maybe_run(0)
    # a caller that goes on scoring anyway is stopped too, through the rubric (it lets contract errors through)
    config = RewardConfig.model_validate({"components": [{**JUDGE, "on_canary_failure": "stop"}]})
    with pytest.raises(JudgeCanaryError):
        Rubric(config, components={"judge": judge})(EXAMPLE, "4")
    assert Judge(FakeChat(sound), on_canary_failure="stop").run_canaries()["judge/canary_alert"] == 0.0


def test_the_gate_policy_comes_from_the_config():
    assert build_judge(JudgeComponentConfig.model_validate(JUDGE)).on_canary_failure == "abstain"
    built = build_judge(JudgeComponentConfig.model_validate({**JUDGE, "on_canary_failure": "stop"}))
    assert built.on_canary_failure == "stop"
    with pytest.raises(ValueError, match="on_canary_failure"):
        JudgeComponentConfig.model_validate({**JUDGE, "on_canary_failure": "ignore"})
    with pytest.raises(ValueError, match='must be "abstain" or "stop"'):
        Judge(FakeChat(sound), on_canary_failure="ignore")  # type: ignore[arg-type]


def test_the_gullible_judge_fails_its_canaries_and_is_gated():
    """The red team's gullible model (it obeys whatever the prompt says) is caught by the canaries themselves."""
    with GullibleJudge() as server:
        judge = Judge(OpenAICompatibleClient(server.url, model="gullible", backoff_s=0.0, max_retries=0))
        metrics = CanaryMonitor({"judge": judge}, 1).maybe_run(0)
        assert metrics["hack/judge_canary_alert"] == 1.0 and metrics["judge/judge/canary_max_score"] == 1.0
        assert judge(EXAMPLE, "The answer is 4.").status == RewardStatus.INFRA_ERROR


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


def test_a_judge_is_checked_by_default_and_only_an_explicit_zero_turns_canaries_off():
    # the policy: a judge is never trusted unchecked; canaries run every DEFAULT_CANARY_EVERY steps unless told
    monitor = build_canary_monitor(Rubric(RewardConfig.model_validate({"components": [JUDGE]})))
    assert monitor is not None and monitor.every_steps == DEFAULT_CANARY_EVERY
    assert RewardConfig().canary_every_steps() == 0 and RewardConfig().judge_canary_every is None


def test_no_monitor_without_canaries_judges_or_a_rubric():
    off = RewardConfig.model_validate({"components": [JUDGE], "judge_canary_every": 0})
    assert build_canary_monitor(Rubric(off)) is None
    assert build_canary_monitor(Rubric(RewardConfig())) is None

    def reward_fn(example: Example, completion: str) -> RewardResult:
        return RewardResult(score=1.0, status=RewardStatus.OK)

    # a judge supplied as something else than a Judge (e.g. a test's fake) has no canaries to run
    config = RewardConfig.model_validate({"components": [JUDGE], "judge_canary_every": 2})
    fake = Rubric(config, components={"judge": reward_fn})
    assert build_canary_monitor(fake) is None
    assert build_canary_monitor(reward_fn) is None
