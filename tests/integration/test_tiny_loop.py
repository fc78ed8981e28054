"""A few real steps of the whole loop with a tiny random model and the transformers engine: run directory
contents, verified weight sync, exported model, and exact resume."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from sharpen.config import SharpenConfig, load_config
from sharpen.monitoring import DIGEST_FILE_NAME, read_jsonl, read_timeline
from sharpen.orchestration.embedded import run_embedded
from sharpen.types import Example, RewardResult, RewardStatus

VOLATILE_PREFIXES = ("time/", "throughput/", "memory/")


def is_volatile(key: str) -> bool:
    """Timings and memory: everything else in a run's metrics is reproducible bit for bit."""
    return key.startswith(VOLATILE_PREFIXES) or key.endswith(("seconds", "per_second"))


def vowel_reward(example: Example, completion: str) -> RewardResult:
    """Random tokens give varied scores, so advantages are non-zero and the weights really move."""
    score = sum(ch in "aeiou" for ch in completion) / max(len(completion), 1)
    return RewardResult(score=score, status=RewardStatus.OK, components={"vowels": score}, verifier="vowels")


def tiny_config(model: Path, out: Path, *, name: str, num_steps: int, **extra: str) -> SharpenConfig:
    overrides = {
        "run.name": name,
        "run.output_dir": str(out),
        "run.num_steps": str(num_steps),
        "model.path": str(model),
        "data.task_config": "{min_terms = 2, max_terms = 2, min_digits = 1, max_digits = 1, operators = ['+']}",
        "data.size": "64",
        "rollout.engine.type": "hf",
        "rollout.prompts_per_step": "2",
        "rollout.num_samples_per_prompt": "4",
        "rollout.max_new_tokens": "12",
        "trainer.micro_batch_size": "4",
        "trainer.learning_rate": "1e-3",
        "trainer.precision": '"float32"',  # float32 numerics (the comparisons below), not the CPU's choice
        "monitoring.progress": "false",
        **extra,
    }
    # Values are TOML; names and paths are strings.
    quoted = {"run.name", "run.output_dir", "model.path", "rollout.engine.type"}
    return load_config(None, [f"{k}={json.dumps(v) if k in quoted else v}" for k, v in overrides.items()])


def run_in_this_process(config: SharpenConfig, **options: Any) -> Path:
    """A comparison run in this process (`sharpen.orchestration.runtime.run` with `vowel_reward`); it sets torch's
    thread count for this whole process, restored after."""
    import torch

    from sharpen.orchestration.runtime import run

    previous_threads = torch.get_num_threads()
    try:
        return run(config, reward_fn=vowel_reward, **options)
    finally:
        torch.set_num_threads(previous_threads)


def stable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not is_volatile(k)} for row in rows]


@pytest.mark.slow
def test_tiny_run_writes_everything_and_syncs(tiny_model_path: Path, tmp_path: Path) -> None:
    evaluation = {"evaluation.every_steps": "2", "evaluation.num_tasks": "2", "evaluation.num_samples": "2"}
    config = tiny_config(
        tiny_model_path,
        tmp_path,
        name="full",
        num_steps=3,
        **evaluation,
        **{"evaluation.ks": "[1, 2]", "monitoring.parity_probe_every": "2"},
    )
    run_dir = run_embedded(config, reward_fn=vowel_reward)

    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == [0, 1, 2]
    for row in rows:
        assert row["sync/probe_mismatch_mean"] < 1e-4  # same weights, same arithmetic: engine == trainer
        assert row["rollout/num_tokens"] > 0
        assert row["train/num_loss_tokens"] > 0
    assert rows[-1]["sync/probe_trainer_delta"] > 1e-4  # the weights moved, and the check saw the engine follow
    assert (run_dir / "config.toml").is_file()
    assert list((run_dir / "tensorboard").iterdir())
    recorded = read_jsonl(run_dir / "rollouts.jsonl")
    assert {r["step"] for r in recorded} == {0, 1, 2}
    # periodic evaluation after steps 2 and 3 (every 2 steps, and the last), with the rubric of the run
    assert ["eval/pass@2" in row for row in rows] == [False, True, True]
    assert all(0.0 <= rows[i]["eval/mean@1"] <= 1.0 and rows[i]["time/evaluate"] > 0 for i in (1, 2))
    # the parity probe (the run's first prompts with greedy completions) after step 2 only
    assert ["parity/k3" in row for row in rows] == [False, True, False]
    assert rows[1]["parity/mean_abs_diff"] < 1e-4 and rows[1]["parity/num_tokens"] > 0
    events = read_timeline(run_dir / "timeline.json")
    assert {"generate", "train", "sync", "evaluate"} <= {e["name"] for e in events if e.get("ph") == "X"}

    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(run_dir / "model")
    assert exported.config.num_hidden_layers == 2
    assert (run_dir / "model" / "tokenizer.json").is_file()


@pytest.mark.slow
def test_resume_reproduces_the_uninterrupted_run(tiny_model_path: Path, tmp_path: Path) -> None:
    """With ``--resume auto`` both times: the first run finds no run directory and starts from step 0, the second
    continues from the first's checkpoint (the same command serves a job that is restarted)."""
    full = run_embedded(tiny_config(tiny_model_path, tmp_path, name="full", num_steps=4), reward_fn=vowel_reward)
    run_embedded(
        tiny_config(tiny_model_path, tmp_path, name="split", num_steps=2), resume="auto", reward_fn=vowel_reward
    )
    split = run_embedded(
        tiny_config(tiny_model_path, tmp_path, name="split", num_steps=4), resume="auto", reward_fn=vowel_reward
    )
    full_rows = stable(read_jsonl(full / "metrics.jsonl"))
    split_rows = stable(read_jsonl(split / "metrics.jsonl"))
    assert [r["step"] for r in split_rows] == [0, 1, 2, 3]
    # Steps after the interruption are bit-identical (deterministic CPU kernels, seeded sampling, same data order).
    assert split_rows[2:] == full_rows[2:]
    assert full_rows[3]["reward/mean"] != full_rows[2]["reward/mean"]  # the compared steps carry real signal
    # and so are the episodes: the running digest of every rollout, continued across the resume
    full_digests, split_digests = read_jsonl(full / DIGEST_FILE_NAME), read_jsonl(split / DIGEST_FILE_NAME)
    assert [d["step"] for d in split_digests] == [0, 1, 2, 3] and split_digests == full_digests
    # the same command once more, after the run finished: it resumes at its last checkpoint and runs no step
    run_embedded(
        tiny_config(tiny_model_path, tmp_path, name="split", num_steps=4), resume="auto", reward_fn=vowel_reward
    )
    assert stable(read_jsonl(split / "metrics.jsonl")) == split_rows


@pytest.mark.slow
def test_a_resumed_moe_run_replays_the_same_routes(tiny_moe_path: Path, tmp_path: Path) -> None:
    """R3 on a tiny Mixtral: the engine's routes ride in each rollout, and a run resumed from step 2 replays the
    same ones (every moe/ metric, the loss and the rewards of steps 2 and 3 equal the uninterrupted run's)."""
    moe = {"trainer.moe.routing_replay": '"r3"', "trainer.algorithm.num_mini_batches": "2"}
    full = run_embedded(tiny_config(tiny_moe_path, tmp_path, name="full", num_steps=4, **moe), reward_fn=vowel_reward)
    run_embedded(tiny_config(tiny_moe_path, tmp_path, name="split", num_steps=2, **moe), reward_fn=vowel_reward)
    split = run_embedded(
        tiny_config(tiny_moe_path, tmp_path, name="split", num_steps=4, **moe), resume=True, reward_fn=vowel_reward
    )
    full_rows = stable(read_jsonl(full / "metrics.jsonl"))
    split_rows = stable(read_jsonl(split / "metrics.jsonl"))
    assert [r["step"] for r in split_rows] == [0, 1, 2, 3]
    for row in full_rows[2:]:  # the compared steps replayed the engine's routes and moved the routers
        assert row["moe/logprob_gap_replayed"] < 1e-4 and "moe/train_disagreement" in row
    assert full_rows[3]["moe/train_disagreement"] > 0
    assert split_rows[2:] == full_rows[2:]


@pytest.mark.slow
def test_a_nan_in_training_skips_the_step_dumps_the_batch_and_the_run_goes_on(
    tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sharpen.trainer import SingleDeviceBackend

    score_tokens = SingleDeviceBackend.score_tokens
    training_calls = []

    def nan_in_step_1(self, *args, **kwargs):
        scores = score_tokens(self, *args, **kwargs)
        if kwargs.get("with_entropy"):  # the training passes (2 micro-batches a step)
            training_calls.append(1)
            if len(training_calls) in (3, 4):
                scores.logprobs = scores.logprobs * float("nan")
        return scores

    monkeypatch.setattr(SingleDeviceBackend, "score_tokens", nan_in_step_1)
    run_dir = run_embedded(tiny_config(tiny_model_path, tmp_path, name="nan", num_steps=3), reward_fn=vowel_reward)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == [0, 1, 2]  # the run went on
    assert [row["train/num_nonfinite_updates"] for row in rows] == [0.0, 1.0, 0.0]
    assert [row["health/num_nonfinite_steps"] for row in rows] == [0.0, 1.0, 1.0]
    assert math.isnan(rows[1]["train/grad_norm"]) and math.isfinite(rows[2]["train/grad_norm"])
    assert rows[1]["sync/probe_trainer_delta"] == 0.0  # the skipped step left the weights as they were
    dumped = read_jsonl(run_dir / "nonfinite" / "step_1.jsonl")
    assert len(dumped) == 8 and all(record["step"] == 1 for record in dumped)


class _FlakyRewardWorker:
    """Raises on every third call and reports an infrastructure error on every fifth; flags the first scored
    rollout of each step (8 calls) as a hack."""

    def __init__(self) -> None:
        self.num_calls = 0
        self.flagged_windows: set[int] = set()

    def __call__(self, example: Example, completion: str) -> RewardResult:
        self.num_calls += 1
        if self.num_calls % 3 == 0:
            raise ConnectionError("reward worker went away")
        if self.num_calls % 5 == 0:
            return RewardResult(score=None, status=RewardStatus.INFRA_ERROR, verifier="flaky")
        result = vowel_reward(example, completion)
        window = (self.num_calls - 1) // 8
        if window not in self.flagged_windows:
            self.flagged_windows.add(window)
            result.hack_flags = ["exit_before_asserts"]
        return result


@pytest.mark.slow
def test_a_run_whose_reward_worker_fails_intermittently_completes_and_abstains(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    run_dir = run_embedded(
        tiny_config(tiny_model_path, tmp_path, name="flaky", num_steps=3), reward_fn=_FlakyRewardWorker()
    )
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == [0, 1, 2]
    for row in rows:  # 8 rollouts a step: failures abstain (never 0) and are counted; the rest trains
        assert row["reward/num_abstained"] >= 2 and row["reward/status_infra_error"] > 0
        assert row["hack/num_screened"] == 1 and row["hack/flag_exit_before_asserts"] == 1 / 8
        trained = 8 - row["reward/num_abstained"] - row["hack/num_screened"]
        assert row["train/num_sequences"] == trained
