"""On-policy distillation in the trainer, on a tiny random Llama: the teacher is frozen and never leaves through
`named_weights`, the advantages are the task advantage plus coef * the hand-computed distillation advantage, the
teacher prompt lines the teacher up with exactly the completion tokens, and every mode's gradient is the same for
any micro-batch split."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from sharpen.config.algorithm import DistillationConfig
from sharpen.config.schema import TrainerConfig
from sharpen.trainer import SingleDeviceBackend, Trainer
from sharpen.trainer.backends.teacher import TeacherPolicy, TeacherPrompt
from sharpen.trainer.distill_step import DistillationStep
from sharpen.trainer.packing import MicroBatch, pack_micro_batch
from sharpen.types import Example, Message, Rollout, TrainBatch
from support.tiny_trainer import PAD, captured_step, random_rollouts


def _config(distillation: DistillationConfig | None = None, **overrides) -> TrainerConfig:
    values = {"device": "cpu", "precision": "float32", "learning_rate": 1e-3, "micro_batch_size": 6, "num_threads": 1}
    distillation = distillation or DistillationConfig(enabled=True)
    return TrainerConfig(**{**values, **overrides}, distillation=distillation)


def _teacher(model_dir: Path, **kwargs) -> TeacherPolicy:
    return TeacherPolicy(
        model_path=model_dir, dtype="float32", device=torch.device("cpu"), precision="float32", **kwargs
    )


def _example(index: int) -> Example:
    return Example(task_key=f"t/{index}", prompt=(Message(role="user", content=f"q{index}"),), answer=str(index))


def _own_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    """A plain HF forward: the model's logprob of each completion token after ``prompt``."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logprobs = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
    targets = ids[0, 1:]
    values = logprobs.gather(1, targets[:, None])[:, 0]
    return values[len(prompt) - 1 :].tolist()


def test_teacher_is_frozen_and_never_in_the_weights_sent_to_the_engine(model_dir):
    config = _config(DistillationConfig(enabled=True, mode="loss"))
    teacher = _teacher(model_dir, temperature=0.7)  # the same weights, sharper: a KL above 0
    trainer = Trainer(
        config,
        backend=SingleDeviceBackend(config, model_path=model_dir, dtype="float32"),
        pad_token_id=PAD,
        teacher=teacher,
    )
    before = {name: p.clone() for name, p in teacher.model.named_parameters()}
    metrics = trainer.step(TrainBatch(rollouts=random_rollouts(seed=3, example=_example), step=0))
    assert metrics["distill/reverse_kl"] != 0.0 and math.isfinite(metrics["distill/loss_k2"])
    teacher_storage = {p.data_ptr() for p in teacher.model.parameters()}
    for name, param in teacher.model.named_parameters():
        assert not param.requires_grad and param.grad is None, name
        assert torch.equal(param, before[name]), name
    sent = list(trainer.named_weights())
    assert sent and all(tensor.data_ptr() not in teacher_storage for _, tensor in sent)
    assert isinstance(trainer.backend, SingleDeviceBackend)
    optimized = {p.data_ptr() for group in trainer.backend.optimizer.param_groups for p in group["params"]}
    assert not optimized & teacher_storage
    # the policy moved, the teacher did not: the same weights at the start, different now
    assert any(not torch.equal(tensor, before[name]) for name, tensor in sent if name in before)


def test_trainer_needs_a_teacher_exactly_when_distillation_is_enabled(model_dir):
    config = _config()
    backend = SingleDeviceBackend(config, model_path=model_dir, dtype="float32")
    with pytest.raises(ValueError, match=r"distillation\.enabled"):
        Trainer(config, backend=backend, pad_token_id=PAD)
    with pytest.raises(ValueError, match=r"distillation\.enabled"):
        Trainer(_config(DistillationConfig()), backend=backend, pad_token_id=PAD, teacher=_teacher(model_dir))


def _with_old(step: DistillationStep, rollouts: list[Rollout], shift: float, **inputs) -> MicroBatch:
    """`DistillationStep.with_advantages` of ``rollouts`` in one micro-batch, pi_old = the teacher's own logprobs +
    ``shift`` at every trained token (the teacher's prompt is the student's here)."""
    micro = pack_micro_batch(rollouts, pad_token_id=PAD, device=torch.device("cpu"), **inputs)
    old = torch.zeros(micro.loss_mask.shape)
    own = [_own_logprobs(step.teacher.model, r.prompt_ids, r.completion_ids) for r in rollouts]
    old[micro.loss_mask] = torch.tensor([lp + shift for row in own for lp in row])
    return step.with_advantages(rollouts, micro, old)


@pytest.mark.parametrize("gamma", [0.0, 0.5])
def test_token_advantages_are_task_advantage_plus_coef_times_minus_reverse_kl(model_dir, gamma):
    teacher = _teacher(model_dir)
    rollouts = random_rollouts(seed=5, num=3, example=_example)  # their engine logprobs are random: never read
    config = DistillationConfig(enabled=True, coef=2.0, gamma=gamma)
    step = DistillationStep(config, teacher, rollouts, micro_batch_size=2, pad_token_id=PAD, temperature=1.0)
    micro = _with_old(step, rollouts, 0.25)  # pi_old = the teacher's own + 0.25: rkl = 0.25 on every token
    for row, rollout in enumerate(rollouts):
        n = len(rollout.completion_ids)
        # A_t = A - coef * 0.25 * sum_{k=t}^{n-1} gamma^(k-t)
        assert rollout.advantage is not None
        expected = [rollout.advantage - 2.0 * 0.25 * sum(gamma**j for j in range(n - t)) for t in range(n)]
        assert micro.advantages[row][micro.loss_mask[row]].tolist() == pytest.approx(expected, abs=1e-5)
        assert not micro.advantages[row][~micro.loss_mask[row]].any()
    metrics = step.metrics(dict, 1)
    assert metrics["distill/reverse_kl"] == pytest.approx(0.25, abs=1e-5)
    assert metrics["distill/reverse_kl_p50"] == pytest.approx(0.25, abs=1e-5)
    assert metrics["distill/reverse_kl_p90"] == pytest.approx(0.25, abs=1e-5)


def test_critic_token_advantages_get_the_distillation_advantage_added(model_dir):
    teacher = _teacher(model_dir)
    rollouts = random_rollouts(seed=6, num=2, example=_example)
    step = DistillationStep(
        DistillationConfig(enabled=True), teacher, rollouts, micro_batch_size=2, pad_token_id=PAD, temperature=1.0
    )
    gae = [[0.1 * t for t in range(len(r.completion_ids))] for r in rollouts]
    micro = _with_old(step, rollouts, -0.5, token_advantages=gae, returns=gae)  # rkl = -0.5
    assert micro.returns is not None
    for row, base in enumerate(gae):
        assert micro.advantages[row][micro.loss_mask[row]].tolist() == pytest.approx([b + 0.5 for b in base], abs=1e-5)
        assert micro.returns[row][micro.loss_mask[row]].tolist() == pytest.approx(base, abs=1e-6)


@pytest.mark.parametrize("num_mini_batches", [1, 3])
def test_the_students_side_is_the_trainers_pi_old_not_the_engines_logprobs(model_dir, monkeypatch, num_mini_batches):
    """A teacher equal to the policy (its initial weights, the same prompt and temperature) is at KL 0, token by
    token, whatever the engine's logprobs say (here: random), and whichever mini-batch a rollout trains in (after
    the first update the policy's current logprobs differ from pi_old): no distillation advantage, the plain
    step's gradient. With the engine's logprobs as the student's side the KL would be their mismatch."""
    rollouts = random_rollouts(seed=2, example=_example)
    model = _teacher(model_dir).model
    gaps = [
        abs(engine - own)
        for r in rollouts
        for engine, own in zip(r.completion_logprobs, _own_logprobs(model, r.prompt_ids, r.completion_ids), strict=True)
    ]
    assert sum(gaps) / len(gaps) > 0.1  # the engine's logprobs are far from the policy's
    overrides = {"algorithm": {"num_mini_batches": num_mini_batches}, "micro_batch_size": 2}
    config = _config(DistillationConfig(enabled=True, coef=3.0), **overrides)
    backend = SingleDeviceBackend(config, model_path=model_dir, dtype="float32")
    trainer = Trainer(config, backend=backend, pad_token_id=PAD, teacher=_teacher(model_dir))
    metrics = trainer.step(TrainBatch(rollouts=rollouts, step=0))  # real updates between the mini-batches
    assert metrics["train/num_optimizer_steps"] == num_mini_batches
    assert metrics["distill/reverse_kl"] == pytest.approx(0.0, abs=1e-5)
    assert metrics["distill/reverse_kl_p90"] == pytest.approx(0.0, abs=1e-5)
    if num_mini_batches == 1:
        fresh = SingleDeviceBackend(config, model_path=model_dir, dtype="float32")
        distilled = Trainer(config, backend=fresh, pad_token_id=PAD, teacher=_teacher(model_dir))
        with_teacher = captured_step(distilled, TrainBatch(rollouts=rollouts, step=0), monkeypatch)[1]
        plain = Trainer(_config(DistillationConfig(), **overrides), backend=fresh, pad_token_id=PAD)
        without = captured_step(plain, TrainBatch(rollouts=rollouts, step=0), monkeypatch)[1]
        for name, grad in with_teacher.items():
            assert torch.allclose(grad, without[name], atol=1e-6), name


def _render(messages) -> list[int]:
    """A stand-in chat template: each message's characters as token ids, a marker between messages, and a
    generation prompt (3) at the end."""
    ids = []
    for message in messages:
        ids += [1, 4 + len(message.role)] + [5 + ord(ch) % 100 for ch in message.content]
    return [*ids, 3]


def test_teacher_prompt_scores_exactly_the_completion_tokens_after_the_teachers_prompt(model_dir):
    prompt = TeacherPrompt("The answer is {answer}. {system}", render=_render)
    teacher = _teacher(model_dir, prompt=prompt)
    system = Message(role="system", content="Be brief.")
    examples = [
        Example(task_key="a", prompt=(system, Message(role="user", content="2+2")), answer="4"),
        Example(task_key="b", prompt=(Message(role="user", content="3+5"),), answer="8"),
    ]
    completions = [[7, 8, 9, 10], [11, 12]]
    rollouts = [
        Rollout(
            example=e,
            prompt_ids=_render(e.prompt),
            completion_ids=c,
            completion_logprobs=[-1.0] * len(c),
            versions=[0] * len(c),
            advantage=0.0,
            loss_mask=[True, False, True, True] if len(c) == 4 else None,
        )
        for e, c in zip(examples, completions, strict=True)
    ]
    assert prompt.messages(examples[0]) == (
        Message(role="system", content="The answer is 4. Be brief."),
        Message(role="user", content="2+2"),
    )
    assert prompt.messages(examples[1])[0] == Message(role="system", content="The answer is 8. ")
    step = DistillationStep(
        DistillationConfig(enabled=True), teacher, rollouts, micro_batch_size=2, pad_token_id=PAD, temperature=1.0
    )
    micro = step.teacher_micro_batch(rollouts)
    targets = micro.input_ids[:, 1:][micro.loss_mask].tolist()
    assert targets == [7, 9, 10, 11, 12]  # the trained completion tokens, in order (8 was an environment's)
    for rollout in rollouts:
        teacher_ids = _render(prompt.messages(rollout.example))
        own = _own_logprobs(teacher.model, teacher_ids, rollout.completion_ids)
        trained = [lp for lp, keep in zip(own, rollout.loss_mask or [True] * len(own), strict=True) if keep]
        assert step.teacher_logprobs[id(rollout)] == pytest.approx(trained, abs=1e-5)
    shifted = Rollout(
        example=examples[1],
        prompt_ids=[*_render(examples[1].prompt), 99],
        completion_ids=[5],
        completion_logprobs=[-1.0],
        versions=[0],
        advantage=0.0,
    )
    with pytest.raises(ValueError, match="teacher_prompt cannot align"):
        prompt.prompt_ids(shifted)


def test_teacher_temperature_divides_the_teachers_logits(model_dir):
    rollouts = random_rollouts(seed=8, num=2, example=_example)
    sharp = DistillationStep(
        DistillationConfig(enabled=True),
        _teacher(model_dir, temperature=0.5),
        rollouts,
        micro_batch_size=2,
        pad_token_id=PAD,
        temperature=1.0,
    )
    model = _teacher(model_dir).model
    for rollout in rollouts:
        ids = torch.tensor([rollout.prompt_ids + rollout.completion_ids])
        with torch.no_grad():
            logprobs = (model(input_ids=ids).logits[0, :-1] / 0.5).log_softmax(-1)
        expected = logprobs.gather(1, ids[0, 1:, None])[:, 0][len(rollout.prompt_ids) - 1 :].tolist()
        assert sharp.teacher_logprobs[id(rollout)] == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize(
    "distillation",
    [
        DistillationConfig(enabled=True, mode="advantage", coef=0.7, gamma=0.5),
        DistillationConfig(enabled=True, mode="loss", coef=0.7),
        DistillationConfig(enabled=True, mode="loss", coef=0.7, top_k=5),
    ],
    ids=["advantage", "loss", "loss-top-k"],
)
def test_distillation_gradient_does_not_depend_on_the_micro_batch_size(model_dir, monkeypatch, distillation):
    batch = TrainBatch(rollouts=random_rollouts(seed=1, example=_example), step=0)
    teacher = _teacher(model_dir, temperature=0.7)  # differs from the policy (temperature 1)
    backend = SingleDeviceBackend(_config(distillation), model_path=model_dir, dtype="float32")
    gradients = {}
    for size in (6, 2, 1):
        trainer = Trainer(
            _config(distillation, micro_batch_size=size), backend=backend, pad_token_id=PAD, teacher=teacher
        )
        gradients[size] = captured_step(trainer, batch, monkeypatch)[1]
    plain = Trainer(_config(DistillationConfig()), backend=backend, pad_token_id=PAD)
    without = captured_step(plain, batch, monkeypatch)[1]
    whole = gradients[6]
    assert max((g - without[name]).abs().max().item() for name, g in whole.items()) > 1e-4  # distillation acts
    for size in (2, 1):
        for name, grad in gradients[size].items():
            diff = (grad - whole[name]).abs().max().item()
            assert diff < 1e-5, f"micro_batch_size={size}: {name} differs by {diff}"


def test_top_k_distillation_runs_only_on_the_single_device_backend(model_dir):
    class OtherBackend:
        device = torch.device("cpu")
        rank, num_ranks = 0, 1

    with pytest.raises(ValueError, match="single-device backend"):
        Trainer(
            _config(DistillationConfig(enabled=True, mode="loss", top_k=4)),
            backend=OtherBackend(),  # pyright: ignore[reportArgumentType]
            pad_token_id=PAD,
            teacher=_teacher(model_dir),
        )
