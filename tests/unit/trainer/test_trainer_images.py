"""GRPO on image prompts of the tiny Qwen2-VL: a step on rollouts the engine generated from images changes the
weights (the vision tower's too: the loss reaches the pixels), the loss mask never covers an image placeholder, the
KL term's reference policy (a frozen copy, or the LoRA policy without its adapters), PPO's critic and a distillation
teacher score the same image rows, and what cannot take images yet (packed rows, top-k distillation) refuses them with
a clear error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sharpen.config.schema import TrainerConfig
from sharpen.data.vision import VisionProcessor
from sharpen.rollout.engines.hf import HfEngine
from sharpen.trainer import SingleDeviceBackend, Trainer
from sharpen.trainer.algorithms.advantages import compute_grpo_advantages
from sharpen.trainer.packing import pack_micro_batch
from sharpen.types import Example, Rollout, SamplingParams, TrainBatch
from support.images import image_prompt, png_image

GROUP_SIZE = 4


@pytest.fixture(scope="module")
def rollouts(tiny_vlm_path: Path) -> list[Rollout]:
    """Two image prompts, four sampled completions each, given an arbitrary reward (the token ids' sum modulo 7) and
    GRPO advantages."""
    vision = VisionProcessor.from_pretrained(tiny_vlm_path)
    engine = HfEngine(tiny_vlm_path)
    out = []
    for index, image in enumerate((png_image((200, 30, 30)), png_image((30, 30, 200), stripe=True))):
        example = Example(task_key=f"colour/{index}", prompt=image_prompt(image))
        prompt = vision.render_prompt(example.prompt)
        params = [SamplingParams(max_new_tokens=6, seed=10 * index + s) for s in range(GROUP_SIZE)]
        completions = engine.generate_with_images([prompt] * GROUP_SIZE, [(image,)] * GROUP_SIZE, params)
        scores = torch.tensor([[float(sum(c.token_ids) % 7) for c in completions]])
        advantages = compute_grpo_advantages(scores)[0].tolist()
        for sample, (completion, advantage) in enumerate(zip(completions, advantages, strict=True)):
            out.append(
                Rollout(
                    example=example,
                    prompt_ids=prompt,
                    completion_ids=completion.token_ids,
                    completion_logprobs=completion.logprobs,
                    versions=[0] * len(completion.token_ids),
                    images=(image,),
                    sample_index=sample,
                    advantage=advantage,
                )
            )
    assert any(r.advantage for r in out), "the rewards must differ within a group for a gradient"
    return out


def _trainer(model_path: Path, **overrides) -> tuple[Trainer, SingleDeviceBackend]:
    values = {"device": "cpu", "precision": "float32", "num_threads": 1, "learning_rate": 1e-2, "micro_batch_size": 4}
    config = TrainerConfig(**{**values, **overrides})
    backend = SingleDeviceBackend(config, model_path=model_path, dtype="float32")
    assert backend.vision is not None, "a vision-language model's backend has its image processor"
    return Trainer(config, backend=backend, pad_token_id=backend.vision.tokenizer.pad_token_id), backend


def test_a_grpo_step_on_image_prompts_changes_the_weights_vision_tower_included(tiny_vlm_path, rollouts):
    trainer, backend = _trainer(tiny_vlm_path)
    model = backend.model
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    metrics = trainer.step(TrainBatch(rollouts=rollouts, step=0))
    assert all(torch.isfinite(torch.tensor(value)) for value in metrics.values()), metrics
    assert metrics["train/num_sequences"] == len(rollouts)
    changed = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    assert any(name.startswith("model.visual.") for name in changed), "the loss did not reach the vision tower"
    assert any(name.startswith("model.language_model.") for name in changed)


def test_the_loss_mask_never_covers_an_image_placeholder(tiny_vlm_path, rollouts):
    image_token_id = VisionProcessor.from_pretrained(tiny_vlm_path).image_token_id
    micro = pack_micro_batch(rollouts, pad_token_id=0, device=torch.device("cpu"))
    targets = micro.input_ids[:, 1:]  # [batch, seq - 1]: the token each loss-mask position predicts
    assert int((targets == image_token_id).sum()) > 0
    assert not bool(micro.loss_mask[targets == image_token_id].any())
    assert micro.images == tuple(r.images for r in rollouts)
    text = pack_micro_batch(
        [Rollout(**{**_fields(rollouts[0]), "images": ()})], pad_token_id=0, device=torch.device("cpu")
    )
    assert text.images == ()


@pytest.mark.parametrize("lora", [False, True], ids=["frozen_copy", "lora_without_adapters"])
def test_the_kl_reference_scores_image_rows_with_their_pixels(tiny_vlm_path, rollouts, lora):
    from sharpen.trainer.backends.frozen import LoraReferencePolicy, ReferencePolicy

    trainer_config = TrainerConfig.model_validate(
        {
            "device": "cpu",
            "precision": "float32",
            "num_threads": 1,
            "algorithm": {"kl": {"type": "loss", "coef": 0.1}},
            "lora": {"enabled": lora, "rank": 4},
        }
    )
    backend = SingleDeviceBackend(trainer_config, model_path=tiny_vlm_path, dtype="float32")
    if lora:
        assert backend.lora is not None
        reference = LoraReferencePolicy(
            backend.lora, device=backend.device, precision="float32", vision=backend.vision, model_path=tiny_vlm_path
        )
    else:
        reference = ReferencePolicy(
            model_path=tiny_vlm_path, dtype="float32", device=backend.device, precision="float32"
        )
    micro = pack_micro_batch(rollouts[:4], pad_token_id=0, device=torch.device("cpu"))
    # before any update the reference is the policy: the same logprobs from the same pixels
    policy = backend.score_tokens(
        micro.input_ids, micro.attention_mask, micro.loss_mask, temperature=1.0, images=micro.images
    ).logprobs
    ref = reference.token_logprobs(
        micro.input_ids, micro.attention_mask, micro.loss_mask, temperature=1.0, images=micro.images
    )
    assert torch.allclose(ref[micro.loss_mask], policy[micro.loss_mask].detach(), atol=1e-5)
    with pytest.raises(ValueError, match="image placeholders but no images"):
        reference.token_logprobs(micro.input_ids, micro.attention_mask, micro.loss_mask, temperature=1.0)
    trainer = Trainer(trainer_config, backend=backend, pad_token_id=0, reference=reference)
    first = trainer.step(TrainBatch(rollouts=rollouts, step=0))
    second = trainer.step(TrainBatch(rollouts=rollouts, step=1))
    assert abs(first["train/kl"]) < 1e-5  # the first mini-batch's update comes after its KL
    assert second["train/kl"] > first["train/kl"]  # the policy moved away from the reference


def test_ppo_with_a_critic_values_image_rows_from_their_pixels(tiny_vlm_path, rollouts):
    from sharpen.types import RewardResult, RewardStatus
    from support.tiny_trainer import tiny_critic

    config = TrainerConfig.model_validate(
        {"device": "cpu", "precision": "float32", "num_threads": 1, "algorithm": {"advantage": "gae"}}
    )
    critic = tiny_critic(tiny_vlm_path, config)
    backend = SingleDeviceBackend(config, model_path=tiny_vlm_path, dtype="float32")
    trainer = Trainer(config, backend=backend, pad_token_id=0, critic=critic)
    reward = [RewardResult(score=float(index % 2), status=RewardStatus.OK) for index in range(len(rollouts))]
    scored = [Rollout(**{**_fields(r), "images": r.images, "reward": w}) for r, w in zip(rollouts, reward, strict=True)]
    before = {name: p.detach().clone() for name, p in critic.network.named_parameters()}
    for step in range(2):  # the value head starts at zero: the second step's value loss reaches the body
        metrics = trainer.step(TrainBatch(rollouts=scored, step=step))
        assert all(torch.isfinite(torch.tensor(value)) for value in metrics.values()), metrics
    changed = {name for name, p in critic.network.named_parameters() if not torch.equal(p, before[name])}
    assert any(".visual." in name for name in changed), "the value loss did not reach the critic's vision tower"
    # the critic's values of the same tokens depend on the image shown
    micro = pack_micro_batch(scored[:1], pad_token_id=0, device=torch.device("cpu"))
    other = scored[GROUP_SIZE].images  # the other prompt's image, of the same size (the same placeholders)
    with torch.no_grad():
        shown = critic.values(micro.input_ids, micro.attention_mask, micro.loss_mask, micro.images)
        swapped = critic.values(micro.input_ids, micro.attention_mask, micro.loss_mask, [other])
    assert not torch.equal(shown[micro.loss_mask], swapped[micro.loss_mask])


def test_a_teacher_scores_image_rows_with_their_pixels(tiny_vlm_path, rollouts):
    from sharpen.config.algorithm import DistillationConfig
    from sharpen.trainer.backends.teacher import TeacherPolicy

    def teacher() -> TeacherPolicy:
        return TeacherPolicy(model_path=tiny_vlm_path, dtype="float32", device=torch.device("cpu"), precision="float32")

    distillation = DistillationConfig(enabled=True, mode="loss")
    config = TrainerConfig(
        device="cpu", precision="float32", num_threads=1, learning_rate=1e-2, distillation=distillation
    )
    backend = SingleDeviceBackend(config, model_path=tiny_vlm_path, dtype="float32")
    trainer = Trainer(config, backend=backend, pad_token_id=0, teacher=teacher())
    first = trainer.step(TrainBatch(rollouts=rollouts, step=0))
    # the teacher is the student's initial weights: the same logprobs from the same pixels, then they part
    assert abs(first["distill/reverse_kl"]) < 1e-5
    second = trainer.step(TrainBatch(rollouts=rollouts, step=1))
    assert second["distill/reverse_kl"] > 1e-4
    top_k = TrainerConfig(
        device="cpu", precision="float32", num_threads=1, distillation=distillation.model_copy(update={"top_k": 4})
    )
    refused = Trainer(top_k, backend=backend, pad_token_id=0, teacher=teacher())
    with pytest.raises(ValueError, match=r"cannot be trained with trainer\.distillation\.top_k > 0 yet"):
        refused.step(TrainBatch(rollouts=rollouts, step=0))


def test_what_takes_no_images_yet_refuses_them(tiny_vlm_path, rollouts):
    with pytest.raises(ValueError, match="rollouts with images cannot be packed"):
        pack_micro_batch(rollouts, pad_token_id=0, device=torch.device("cpu"), is_packed=True)
    trainer, _ = _trainer(tiny_vlm_path, packing=True)
    with pytest.raises(ValueError, match=r"rollouts with images cannot be trained with trainer\.packing yet"):
        trainer.step(TrainBatch(rollouts=rollouts, step=0))


def _fields(rollout: Rollout) -> dict:
    return {
        "example": rollout.example,
        "prompt_ids": rollout.prompt_ids,
        "completion_ids": rollout.completion_ids,
        "completion_logprobs": rollout.completion_logprobs,
        "versions": rollout.versions,
        "advantage": rollout.advantage,
    }
