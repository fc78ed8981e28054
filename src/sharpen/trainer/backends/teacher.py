"""The distillation teacher: a frozen HF causal LM that scores the student's sampled tokens, and what it sees.

`TeacherPolicy` is the reference policy's machinery (`frozen.ReferencePolicy`: a frozen copy on the trainer's
device, eval mode, no gradient, bf16 autocast under the run's precision) loaded from the teacher's folder, plus the
teacher's logprobs of the student's top-k candidates (`scoring.score_top_k`) for the top-k distillation variant. It
is never part of the policy's parameters, so the optimizer never sees it and `Trainer.named_weights` (what the
engine receives) never includes it.

`TeacherPrompt` builds the prompt the teacher sees instead of the student's (context distillation: a privileged
system prompt, e.g. with the task's answer); the completion tokens stay the student's, so the teacher scores
exactly the tokens the student sampled.

Not here: an engine-served teacher (vLLM prompt logprobs); the trainer-side forward is the only teacher for now.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from sharpen.expert_routes import Routes
from sharpen.trainer.backends.frozen import ReferencePolicy
from sharpen.trainer.backends.scoring import autocast_to, score_top_k
from sharpen.trainer.precision import Precision
from sharpen.types import Example, ImagePart, Message, Rollout

TEACHER_PROMPT_FIELDS = frozenset({"answer", "system"})
"""Placeholders of ``trainer.distillation.teacher_prompt``: the example's reference answer and the student's
system prompt (empty when it has none)."""


class TeacherPolicy(ReferencePolicy):
    """A frozen teacher on the trainer's device (`frozen.ReferencePolicy`'s loading and scoring, from the teacher's
    folder). ``prompt``: what the teacher sees instead of the student's prompt (None: the student's own prompt ids);
    ``temperature``: the teacher's logits are divided by it (None: the rollout temperature, the student's)."""

    def __init__(
        self,
        *,
        model_path: Path,
        dtype: str,
        device: torch.device,
        precision: Precision,
        prompt: TeacherPrompt | None = None,
        temperature: float | None = None,
    ) -> None:
        super().__init__(model_path=model_path, dtype=dtype, device=device, precision=precision)
        self.prompt = prompt
        self.temperature = temperature

    def prompt_ids(self, rollout: Rollout) -> list[int]:
        """The prompt the teacher scores ``rollout``'s completion after."""
        return rollout.prompt_ids if self.prompt is None else self.prompt.prompt_ids(rollout)

    def token_logprobs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        target_mask: torch.Tensor,
        *,
        temperature: float,
        images: Sequence[tuple[ImagePart, ...]] = (),
        routes: Routes | None = None,
    ) -> torch.Tensor:
        """[batch, seq - 1] logprobs of the target tokens, without gradient (`FrozenScorer.token_logprobs`), at the
        teacher's temperature when it has one, else at ``temperature``; ``images``: each row's (a vision-language
        teacher scoring the student's image rows). A teacher routes its own tokens: ``routes`` (the student's) are
        refused."""
        if routes is not None:
            raise ValueError("a distillation teacher routes its own tokens; it takes no replayed routes")
        return super().token_logprobs(
            input_ids, attention_mask, target_mask, temperature=self.temperature or temperature, images=images
        )

    @torch.no_grad()
    def candidate_logprobs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        target_mask: torch.Tensor,
        candidate_ids: torch.Tensor,
        *,
        temperature: float,
    ) -> torch.Tensor:
        """[num_targets, k] the teacher's logprobs of ``candidate_ids`` (the student's top-k) at each target
        (`scoring.score_top_k`)."""
        with autocast_to(self.device, self.autocast_dtype):
            _, logprobs = score_top_k(
                self.model,
                input_ids,
                attention_mask,
                target_mask,
                temperature=self.temperature or temperature,
                candidate_ids=candidate_ids,
            )
        return logprobs


class TeacherPrompt:
    """The teacher's prompt from a template for its system message (``{answer}``, ``{system}``), rendered with the
    chat template by ``render`` (messages -> prompt ids ending with the assistant generation prompt). The teacher
    sees the example's messages with the system message replaced by the template (put first where there is none).

    The teacher must score exactly the tokens the student sampled, after the same conversation: a rollout whose
    prompt ids are not the rendered prompt of its example (an agent's segment, a rewritten history) is refused."""

    def __init__(self, template: str, *, render: Callable[[Sequence[Message]], list[int]]) -> None:
        fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
        if fields - TEACHER_PROMPT_FIELDS:
            raise ValueError(
                f"trainer.distillation.teacher_prompt: unknown placeholders {sorted(fields - TEACHER_PROMPT_FIELDS)}; "
                f"it may use {{answer}} and {{system}}"
            )
        self.template = template
        self.render = render
        self.needs_answer = "answer" in fields
        self._cache: dict[tuple[tuple[int, ...], str, str | None], list[int]] = {}

    def messages(self, example: Example) -> tuple[Message, ...]:
        if self.needs_answer and example.answer is None:
            raise ValueError(
                f"trainer.distillation.teacher_prompt uses {{answer}}, but example {example.task_key} has no answer"
            )
        system = next((m.text for m in example.prompt if m.role == "system"), "")
        content = self.template.format(answer=example.answer or "", system=system)
        return (Message(role="system", content=content), *(m for m in example.prompt if m.role != "system"))

    def prompt_ids(self, rollout: Rollout) -> list[int]:
        example = rollout.example
        key = (tuple(rollout.prompt_ids), example.task_key, example.answer)
        if key in self._cache:
            return self._cache[key]
        if self.render(example.prompt) != rollout.prompt_ids:
            raise ValueError(
                f"rollout {example.task_key}: its prompt ids are not its example's rendered prompt (an agent "
                "segment or a rewritten history), so trainer.distillation.teacher_prompt cannot align the teacher's "
                "prompt with it; leave teacher_prompt unset for such environments"
            )
        if len(self._cache) >= 4096:  # a step's prompts at most are reused; bound the memory of a long run
            self._cache.clear()
        self._cache[key] = ids = self.render(self.messages(example))
        return ids


def check_same_vocabulary(student_path: Path, teacher_path: Path) -> None:
    """The teacher must score the student's token ids: the same vocabulary size and, where both folders ship one,
    the same tokenizer.json."""
    from transformers import AutoConfig

    if Path(student_path).resolve() == Path(teacher_path).resolve():
        return
    student, teacher = AutoConfig.from_pretrained(student_path), AutoConfig.from_pretrained(teacher_path)
    if student.vocab_size != teacher.vocab_size:
        raise ValueError(
            f"trainer.distillation.teacher_path {teacher_path}: vocabulary of {teacher.vocab_size} tokens, the "
            f"student's has {student.vocab_size}; the teacher needs the student's tokenizer"
        )
    files = [Path(student_path) / "tokenizer.json", Path(teacher_path) / "tokenizer.json"]
    if all(f.is_file() for f in files) and files[0].read_bytes() != files[1].read_bytes():
        raise ValueError(
            f"trainer.distillation.teacher_path {teacher_path}: its tokenizer.json differs from the student's; the "
            "teacher needs the student's tokenizer"
        )
