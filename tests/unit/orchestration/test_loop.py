"""`run_loop` alone: a scripted engine, a tiny real trainer (vocab 128), a reward that prefers one answer; what the
loop does with them step by step (order of phases, advantages, the weight sync, metrics, checkpoints)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sharpen.config import load_config
from sharpen.data import ExampleSampler
from sharpen.monitoring import RolloutRecorder
from sharpen.orchestration.checkpoint import latest_checkpoint
from sharpen.orchestration.loop import Components, run_loop
from sharpen.orchestration.weight_sync import WeightSync
from sharpen.rollout.engines.scripted import ScriptedEngine
from sharpen.rollout.episodes import EpisodeRunner
from sharpen.trainer import SingleDeviceBackend, Trainer
from sharpen.types import Example, Message, RewardResult, RewardStatus, TrainBatch

VOCAB, EOS = 128, 3


def encode(text: str) -> list[int]:
    return [10 + ord(c) % 100 for c in text]


class ChatTokenizer:
    """Each message as its characters after a role token (ids below 128, the tiny model's vocab)."""

    eos_token_id = EOS
    pad_token_id = 0

    def apply_chat_template(self, conversation, *, add_generation_prompt, tokenize):
        ids = []
        for message in conversation:
            ids += [1 if message["role"] == "system" else 2, *encode(message["content"])]
        return [*ids, 4]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return encode(text)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


class ListSink:
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []

    def log(self, metrics: dict[str, float], *, step: int) -> None:
        self.rows.append((step, metrics))

    def close(self) -> None:
        pass


class RecordingTrainer(Trainer):
    """The real trainer, recording the batches it is given."""

    batches: list[TrainBatch]

    def step(self, batch: TrainBatch) -> dict[str, float]:
        self.batches.append(batch)
        return super().step(batch)


def likes_seven(example: Example, completion: str) -> RewardResult:
    score = float(completion.strip() == "7")
    return RewardResult(score=score, status=RewardStatus.OK, components={"seven": score}, verifier="test")


@pytest.fixture
def components(tmp_path: Path) -> Components:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            max_position_embeddings=64,
            tie_word_embeddings=True,
            pad_token_id=0,
        )
    )
    model.save_pretrained(tmp_path / "model")
    config = load_config(
        None,
        [
            "run.num_steps=3",
            "run.checkpoint_every=2",
            "rollout.prompts_per_step=2",
            "rollout.num_samples_per_prompt=2",
            "rollout.max_new_tokens=4",
            "trainer.micro_batch_size=2",
            "trainer.learning_rate=1e-3",
            "trainer.precision=float32",
            "monitoring.parity_probe_every=0",
        ],
    )
    trainer = RecordingTrainer(
        config.trainer,
        backend=SingleDeviceBackend(config.trainer, model_path=tmp_path / "model", dtype="float32"),
        pad_token_id=0,
    )
    trainer.batches = []
    tokenizer = ChatTokenizer()
    examples = [Example(task_key=f"t/{i}", prompt=(Message(role="user", content=f"q{i}"),)) for i in range(6)]
    return Components(
        config=config,
        run_dir=tmp_path / "run",
        tokenizer=tokenizer,
        engine=ScriptedEngine(["7", "8", "8", "7"], encode=encode, eos_token_id=EOS),
        trainer=trainer,
        sampler=ExampleSampler(examples, seed=0),
        rubric=likes_seven,
        sink=ListSink(),
        recorder=RolloutRecorder(tmp_path / "run" / "rollouts.jsonl", num_per_step=1),
        weight_sync=WeightSync(probe_ids=encode("probe"), tolerance=1e-3, verify=False),
        runner=EpisodeRunner(tokenizer=tokenizer),
    )


def test_each_step_trains_on_its_scored_groups_and_syncs_the_new_version(components: Components) -> None:
    run_loop(components)
    trainer, engine, sink = components.trainer, components.engine, components.sink
    assert isinstance(trainer, RecordingTrainer) and isinstance(engine, ScriptedEngine) and isinstance(sink, ListSink)

    assert [batch.step for batch in trainer.batches] == [0, 1, 2]
    for batch in trainer.batches:
        assert len(batch.rollouts) == 4  # 2 prompts x 2 samples
        by_text = {r.completion_text: r.advantage for r in batch.rollouts}
        # the scripted texts go round "7", "8", "8", "7": every group holds one of each, so GRPO gives +/-
        assert by_text["7"] is not None and by_text["8"] is not None and by_text["7"] > 0 > by_text["8"]
    assert engine.policy_version == 3 and engine.num_weight_loads == 3  # one load after each step
    assert [step for step, _ in sink.rows] == [0, 1, 2]
    for step, metrics in sink.rows:
        assert metrics["policy/version"] == step + 1
        assert metrics["reward/mean"] == 0.5 and metrics["reward/seven"] == 0.5
        assert metrics["train/num_sequences"] == 4 and metrics["train/grad_norm"] > 0
        assert metrics["time/step"] > 0 and "time/generate" in metrics and "time/train" in metrics
    checkpoint = latest_checkpoint(components.run_dir)
    assert checkpoint is not None and checkpoint.name == "step_000003"  # every 2 steps, and the last
    assert (components.run_dir / "checkpoints" / "step_000002").is_dir()


def test_resumed_at_a_step_the_loop_runs_only_the_remaining_steps(components: Components) -> None:
    components.engine.policy_version = 2  # type: ignore[misc]  (the engine holds the resumed weights)
    run_loop(components, start_step=2)
    trainer, sink = components.trainer, components.sink
    assert isinstance(trainer, RecordingTrainer) and isinstance(sink, ListSink)
    assert [batch.step for batch in trainer.batches] == [2]
    assert [step for step, _ in sink.rows] == [2]


class _BrokenEnvironment:
    """A user's environment whose reset raises."""

    name, version = "broken", "1"

    async def reset(self, example, ctx):
        raise KeyError("missing_field")

    async def step(self, action):
        raise AssertionError("never reached")


def test_a_step_whose_every_episode_failed_in_the_environment_code_stops_the_run(components: Components) -> None:
    """32 tracebacks, reward NaN and exit 0 before: now the run stops at the first such step with one line naming the
    first error; the CLI reports it as the user's to fix."""
    from sharpen.cli.errors import user_error_message
    from sharpen.environments.base import EnvironmentCodeError

    components.runner = EpisodeRunner(tokenizer=components.tokenizer, make_environment=_BrokenEnvironment)
    with pytest.raises(
        EnvironmentCodeError, match=r"step 0: all 4 episodes failed in the environment's code \(broken\)"
    ) as caught:
        run_loop(components)
    assert "KeyError('missing_field')" in str(caught.value)
    assert user_error_message(caught.value) == str(caught.value)
    assert components.trainer.batches == []  # nothing trained on  # pyright: ignore[reportAttributeAccessIssue]
