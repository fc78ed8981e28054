"""evaluate() end to end with the scripted engine: batching, seeds, counts, every metric's value, abstentions from
the rubric and from a broken environment, the report's JSON and tables; and the EvalConfig section."""

from __future__ import annotations

import io
import json
from fractions import Fraction

import pytest
from pydantic import ValidationError

from sharpen.config.evaluation import EvalConfig
from sharpen.config.schema import RewardConfig
from sharpen.environments import EpisodeContext, StepResult
from sharpen.evaluation import EvalReport, evaluate
from sharpen.rewards import ExactMatchVerifier, Rubric
from sharpen.rollout.engines.scripted import ScriptedEngine
from sharpen.rollout.episodes import EpisodeRunner
from sharpen.types import Completion, Example, Message, SamplingParams

EOS = 0


def _encode(text: str) -> list[int]:
    return [ord(c) for c in text]


class _FakeTokenizer:
    """A chat template that renders each message as its role id followed by its characters."""

    eos_token_id = EOS

    def apply_chat_template(self, conversation, *, add_generation_prompt, tokenize):
        ids = []
        for message in conversation:
            ids += [1 if message["role"] == "system" else 2, *_encode(message["content"])]
        return [*ids, 3]


class _CrashOnBoom:
    """Exact match, except that the answer "boom" crashes the verifier (the rubric then abstains)."""

    name = "exact_match"

    def __call__(self, example: Example, answer: str) -> float:
        if answer == "boom":
            raise RuntimeError("verifier crashed")
        return ExactMatchVerifier()(example, answer)


def _example(index: int, answer: str) -> Example:
    return Example(
        task_key=f"t/{index}",
        prompt=(Message(role="user", content=f"question {index}"),),
        answer=answer,
        metadata={"source": "jsonl"},
    )


def _tag(answer: str) -> str:
    return f"<answer>{answer}</answer>"


EXAMPLES = [_example(0, "19"), _example(1, "7"), _example(2, "3")]
# The scripted engine answers requests in order: task 0's four samples, then task 1's, then task 2's.
TEXTS = [
    *[_tag("19"), _tag("18"), _tag(" 19 "), "I don't know"],  # c = 2 of 4, one format error
    *[_tag("6"), _tag("6"), _tag("6"), _tag("7")],  # c = 1 of 4, the majority is wrong
    *[_tag("4"), _tag("boom"), _tag("3"), _tag("boom")],  # two abstain: c = 1 of n = 2
]


def _engine() -> ScriptedEngine:
    engine = ScriptedEngine(TEXTS, encode=_encode, eos_token_id=EOS)
    engine.policy_version = 7
    calls: list[tuple[int, list[int | None]]] = []
    generate = engine.generate

    def recording_generate(prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        calls.append((len(prompts), [p.seed for p in params]))
        return generate(prompts, params)

    engine.generate = recording_generate  # type: ignore[method-assign]
    engine.calls = calls  # type: ignore[attr-defined]
    return engine


def _evaluate(engine: ScriptedEngine, *, prompts_per_batch: int = 2, **options) -> EvalReport:
    return evaluate(
        engine,
        EXAMPLES,
        runner=EpisodeRunner(tokenizer=_FakeTokenizer(), episode_seed=5),
        rubric=Rubric(RewardConfig(), verifiers={"jsonl": _CrashOnBoom()}),
        sampling=SamplingParams(max_new_tokens=64, temperature=0.6),
        num_samples=4,
        ks=options.pop("ks", [4, 2]),
        seed=5,
        prompts_per_batch=prompts_per_batch,
        **options,
    )


def test_evaluate_counts_and_values_end_to_end():
    engine = _engine()
    report = _evaluate(engine)
    # two batches (2 tasks, then 1), each one engine call of all its samples; every sample has its own seed
    assert [size for size, _ in engine.calls] == [8, 4]  # type: ignore[attr-defined]
    seeds = [seed for _, batch in engine.calls for seed in batch]  # type: ignore[attr-defined]
    assert len(set(seeds)) == 12
    assert report.ks == [1, 2, 4]

    first, second, third = report.tasks
    assert [t.task_key for t in report.tasks] == ["t/0", "t/1", "t/2"]
    assert (first.num_samples, first.num_abstained, first.num_correct) == (4, 0, 2)
    assert first.pass_at_k == {1: 0.5, 2: float(1 - Fraction(1, 6)), 4: 1.0}
    # maj@2: blocks [19, 18] (a tie: 0.5) and [19, no answer] (1); at 4 the two 19s outvote 18
    assert first.maj_at_k == {1: 0.5, 2: 0.75, 4: 1.0}
    assert first.mean_at_k == {1: 0.5, 2: 0.5, 4: 0.5}
    assert (second.num_correct, second.pass_at_k) == (1, {1: 0.25, 2: 0.5, 4: 1.0})
    assert second.maj_at_k == {1: 0.25, 2: 0.25, 4: 0.0}  # blocks [6, 6] and [6, 7]
    assert (third.num_samples, third.num_abstained, third.num_correct) == (4, 2, 1)
    assert third.pass_at_k == {1: 0.5, 2: 1.0, 4: None}  # n = 2: abstentions are not failures
    assert third.maj_at_k == {1: 0.5, 2: 0.5, 4: None}  # "4" vs "3": a tie is worth its expected value

    overall = report.overall
    assert (overall.num_tasks, overall.num_samples, overall.num_abstained, overall.num_correct) == (3, 12, 2, 4)
    assert overall.num_tasks_at_k == {1: 3, 2: 3, 4: 2}
    assert report.metric("pass", 1) == pytest.approx((0.5 + 0.25 + 0.5) / 3)
    assert report.metric("pass", 2) == pytest.approx((5 / 6 + 0.5 + 1.0) / 3)
    assert report.metric("pass", 4) == 1.0
    assert report.metric("maj", 4) == 0.5
    assert report.metric("mean", 4) == pytest.approx((0.5 + 0.25) / 2)
    assert report.status_counts == {"ok": 4, "wrong": 5, "format_error": 1, "infra_error": 2}
    assert report.num_generated_tokens == sum(len(text) + 1 for text in TEXTS)  # each text and its EOS
    assert report.wall_seconds >= report.generate_seconds > 0 and report.tokens_per_second > 0
    assert report.settings["temperature"] == 0.6 and report.settings["policy_version"] == 7


def test_batching_changes_the_calls_not_the_numbers():
    one = _evaluate(_engine(), prompts_per_batch=1)
    all_at_once_engine = _engine()
    all_at_once = _evaluate(all_at_once_engine, prompts_per_batch=10)
    assert [size for size, _ in all_at_once_engine.calls] == [12]  # type: ignore[attr-defined]
    assert one.tasks == all_at_once.tasks and one.overall == all_at_once.overall


class _BrokenOnSecondSample:
    """Answers like the single-turn environment, but its step raises for sample 1 (an environment bug)."""

    name = "broken"
    version = "1"

    async def reset(self, example: Example, ctx: EpisodeContext) -> list[Message]:
        self.sample_index = ctx.sample_index
        return list(example.prompt)

    async def step(self, action: str) -> StepResult:
        if self.sample_index == 1:
            raise RuntimeError("environment bug")
        return StepResult(terminated=True)


def test_an_episode_the_environment_broke_abstains():
    engine = ScriptedEngine([_tag("19")], encode=_encode, eos_token_id=EOS)
    report = evaluate(
        engine,
        EXAMPLES[:1],
        runner=EpisodeRunner(tokenizer=_FakeTokenizer(), make_environment=_BrokenOnSecondSample),
        rubric=Rubric(RewardConfig()),
        sampling=SamplingParams(max_new_tokens=64),
        num_samples=3,
        ks=[3],
    )
    [task] = report.tasks
    assert (task.num_samples, task.num_abstained, task.num_correct) == (3, 1, 2)
    assert task.pass_at_k == {1: 1.0, 3: None}
    assert report.status_counts == {"ok": 2, "infra_error": 1}


def test_report_json_and_tables():
    report = _evaluate(_engine())
    data = json.loads(report.to_json())
    assert data["num_tasks"] == 3 and data["num_samples"] == 12 and data["num_abstained"] == 2
    assert data["ks"] == [1, 2, 4] and data["num_samples_per_task"] == 4
    assert data["pass_at_k"]["1"] == pytest.approx(report.metric("pass", 1))
    assert data["num_tasks_at_k"] == {"1": 3, "2": 3, "4": 2}
    assert [t["task_key"] for t in data["tasks"]] == ["t/0", "t/1", "t/2"]
    assert data["tasks"][2]["pass_at_k"] == {"1": 0.5, "2": 1.0, "4": None}
    assert data["settings"]["seed"] == 5
    assert data["tokens_per_second"] > 0
    metrics = report.to_metrics()
    assert metrics["eval/pass@1"] == report.metric("pass", 1) and metrics["eval/maj@4"] == 0.5
    assert metrics["eval/num_abstained"] == 2.0 and len(metrics) == 3 * 3 + 2

    text = report.to_text(max_task_rows=2)
    assert "pass@k" in text and "maj@4" in text and "t/1" in text and "t/2" not in text
    assert "... 1 more tasks in the JSON report" in text
    assert "infra_error 2" in text
    assert report.summary_line().startswith("pass@1 = 0.417 over 12 samples (3 tasks x 4, 2 abstained)")

    from rich.console import Console

    console = Console(file=io.StringIO(), width=120)
    console.print(report.to_rich())
    rendered = console.file.getvalue()  # type: ignore[attr-defined]
    assert "pass@k" in rendered and "t/2" in rendered


def test_evaluate_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"every k must be between 1 and num_samples = 4, got \[5\]"):
        _evaluate(_engine(), ks=[5])
    with pytest.raises(ValueError, match="prompts_per_batch must be at least 1"):
        _evaluate(_engine(), prompts_per_batch=0)
    with pytest.raises(ValueError, match="no examples"):
        evaluate(
            _engine(),
            [],
            runner=EpisodeRunner(tokenizer=_FakeTokenizer()),
            rubric=Rubric(RewardConfig()),
            sampling=SamplingParams(max_new_tokens=8),
            num_samples=1,
        )


def test_eval_config_checks_ks_against_num_samples():
    config = EvalConfig()
    assert (config.num_samples, config.ks, config.every_steps, config.max_new_tokens) == (4, [1, 4], 0, None)
    assert EvalConfig(num_samples=8, ks=[1, 8], num_tasks=10).num_tasks == 10
    with pytest.raises(ValidationError, match=r"ks = \[1, 4\]: every k must be between 1 and num_samples = 2"):
        EvalConfig(num_samples=2)
    with pytest.raises(ValidationError, match="extra"):
        EvalConfig(samples=2)  # type: ignore[call-arg]
