"""The frozen scorers: models that score tokens without gradient and that the optimizer never sees.

Owns `FrozenScorer`, the one scoring path they share (a vision-language model's image rows, bf16 autocast under the
run's precision, `scoring.score_tokens` under ``torch.no_grad``), and the two reference policies of the KL term:
`ReferencePolicy` (a frozen copy of the initial policy on the trainer's device) and `LoraReferencePolicy` (a LoRA
run's own model with its adapters disabled, which is exactly the initial policy, at the cost of one extra forward and
no second model copy). The distillation teacher (`teacher.TeacherPolicy`) is a `ReferencePolicy` loaded from the
teacher's folder. Nothing here trains, shards or is sent to an engine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from sharpen.data.vision import VisionProcessor, is_vision_model, model_class
from sharpen.expert_routes import RouterReplay, Routes
from sharpen.trainer.backends.base import replaying
from sharpen.trainer.backends.scoring import autocast_to, rows_image_inputs, score_tokens
from sharpen.trainer.precision import AUTOCAST_DTYPES, Precision
from sharpen.types import ImagePart

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel


class FrozenScorer:
    """Per-token logprobs without gradient from a model nobody trains; a subclass says which model runs
    (`frozen_model`)."""

    def __init__(
        self, *, device: torch.device, precision: Precision, vision: VisionProcessor | None, model_path: Path | None
    ) -> None:
        """``vision``: the model's image processor (a vision-language model's image rows; None: text only);
        ``model_path``: named in the error for images given to a text-only model."""
        self.device = device
        self.autocast_dtype = AUTOCAST_DTYPES[precision]  # forward only: no loss scale needed
        self.vision = vision
        self.model_path = model_path
        self.router: RouterReplay | None = None
        """A Mixture-of-Experts model's routes, replayed when `token_logprobs` is given some."""

    def frozen_model(self) -> contextlib.AbstractContextManager[PreTrainedModel]:
        """The model to run, for the duration of one forward pass."""
        raise NotImplementedError

    @torch.no_grad()
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
        """[batch, seq - 1] logprobs of the target tokens (`scoring.score_tokens`); ``images``: each row's, for a
        vision-language model's rows that hold image placeholders; ``routes``: expert routes to replay (a
        Mixture-of-Experts model with a ``router``; a scorer built without one routes its tokens itself)."""
        image_inputs = rows_image_inputs(self.vision, input_ids, images, model=str(self.model_path))
        with (
            self.frozen_model() as model,
            autocast_to(self.device, self.autocast_dtype),
            replaying(self.router, routes if self.router is not None else None),  # without one: its own routes
        ):
            return score_tokens(
                model, input_ids, attention_mask, target_mask, temperature=temperature, image_inputs=image_inputs
            ).logprobs


class ReferencePolicy(FrozenScorer):
    """A frozen copy of the initial policy for the KL term; built only when the KL coefficient is positive."""

    def __init__(
        self,
        *,
        model_path: Path,
        dtype: str,
        device: torch.device,
        precision: Precision,
        replay_routes: bool = False,
        router_float32: bool = False,
    ) -> None:
        """``replay_routes``: a Mixture-of-Experts reference replays the routes it is given (routing replay), its
        routers in float32 with ``router_float32`` (as the policy's: ``trainer.moe.router_float32``)."""
        model_path = Path(model_path)
        vision = VisionProcessor.from_pretrained(model_path) if is_vision_model(model_path) else None
        super().__init__(device=device, precision=precision, vision=vision, model_path=model_path)
        model = model_class(model_path).from_pretrained(model_path, dtype=getattr(torch, dtype))
        # transformers wraps `to` with functools.wraps, which its stubs leave unbound (self is not passed)
        self.model: PreTrainedModel = model.to(device)  # pyright: ignore[reportArgumentType]
        self.model.eval().requires_grad_(False)
        if replay_routes:
            self.router = RouterReplay(self.model, name=str(model_path), float32=router_float32)

    def frozen_model(self) -> contextlib.AbstractContextManager[PreTrainedModel]:
        return contextlib.nullcontext(self.model)


class LoraReferencePolicy(FrozenScorer):
    """The reference policy of a LoRA run: the trainer's own model with its adapters disabled, which is exactly the
    initial policy (the base weights never train), at the cost of one extra forward and no second model copy."""

    def __init__(
        self,
        peft_model: PeftModel,
        *,
        device: torch.device,
        precision: Precision,
        vision: VisionProcessor | None = None,
        model_path: Path | None = None,
        router: RouterReplay | None = None,
    ) -> None:
        """``vision``: the policy backend's processor, for a vision-language model's image rows; ``router``: the
        policy backend's (its routers are this model's)."""
        super().__init__(device=device, precision=precision, vision=vision, model_path=model_path)
        self.peft_model = peft_model
        self.router = router

    @contextlib.contextmanager
    def frozen_model(self) -> Iterator[PreTrainedModel]:
        with self.peft_model.disable_adapter():
            yield cast("PreTrainedModel", self.peft_model.get_base_model())
