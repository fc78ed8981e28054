"""The bodies of the Ray actors: one holds the run's `Trainer`, one its `InferenceEngine`.

Each builds its component with the embedded runtime's builders (`build_trainer`, `build_run_engine`), so a
component is the same object in both runtimes, and exposes its methods to the proxies in `proxies.py`. Plain
classes: `runtime.py` turns them into actors with the resources of the config. Nothing here waits on another actor.

The proxies call every method through `SpanRecordingActor.invoke`, which records the call as a span of the actor's
own process (named after the method: ``step``, ``generate``, ...) and hands back the spans recorded since the last
call with the result, so the driver can put them on the run's timeline without an extra round trip.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
import torch

from sharpen.config import SharpenConfig
from sharpen.config.models import resolve_model_path
from sharpen.monitoring import Span, SpanBuffer
from sharpen.orchestration.local import build_run_engine, build_trainer, load_tokenizer
from sharpen.trainer.backends.single_device import resolve_device
from sharpen.types import Completion, PolicyVersion, Rollout, SamplingParams, TrainBatch

if TYPE_CHECKING:
    from sharpen.rollout.engines import InferenceEngine


class SpanRecordingActor:
    """What the actors share: spans of their own work, recorded in this process and drained by each call."""

    def __init__(self, *, process_name: str) -> None:
        self.spans = SpanBuffer(process_name=process_name)

    def invoke(self, method: str, *args: Any, **kwargs: Any) -> tuple[Any, list[Span]]:
        """``method(*args, **kwargs)`` timed as a span, and every span not yet handed out. A call that raises keeps
        its span (marked with the error) for the next call."""
        with self.spans.span(method, category="actor"):
            result = getattr(self, method)(*args, **kwargs)
        return result, self.spans.drain()


class TrainerActor(SpanRecordingActor):
    def __init__(self, config: SharpenConfig) -> None:
        super().__init__(process_name="trainer actor")
        with self.spans.span("start", category="actor"):  # loading the model: the first thing on its timeline
            model_path = resolve_model_path(config.model.path)
            self.trainer = build_trainer(config, model_path=model_path, tokenizer=load_tokenizer(model_path))

    def step(self, batch: TrainBatch) -> dict[str, float]:
        return self.trainer.step(batch)

    def compute_logprobs(self, token_ids: list[int]) -> list[float]:
        return self.trainer.compute_logprobs(token_ids)

    def kl_penalties(self, rollouts: list[Rollout]) -> list[list[float]]:
        return self.trainer.kl_penalties(rollouts)

    def put_weights(self) -> list[Any]:
        """The full weights as one object-store entry owned by this actor; returned inside a list so the caller
        gets the ObjectRef rather than the tensors."""
        weights = {name: tensor.detach().cpu() for name, tensor in self.trainer.named_weights()}
        return [ray.put(weights)]

    def save_checkpoint(self, folder: Path) -> None:
        self.trainer.save_checkpoint(folder)

    def load_checkpoint(self, folder: Path) -> None:
        self.trainer.load_checkpoint(folder)

    def export(self, folder: Path) -> None:
        self.trainer.export(folder)

    def close(self) -> None:
        pass  # the trainer holds nothing outside this process


class EngineActor(SpanRecordingActor):
    def __init__(self, config: SharpenConfig) -> None:
        super().__init__(process_name="engine actor")
        with self.spans.span("start", category="actor"):
            model_path = resolve_model_path(config.model.path)
            self.engine: InferenceEngine = build_run_engine(
                config,
                model_path=model_path,
                tokenizer=load_tokenizer(model_path),
                device=str(resolve_device(config.trainer.device)),  # the device the embedded runtime would use
            )

    def get_policy_version(self) -> PolicyVersion:
        return self.engine.policy_version

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        return self.engine.generate(prompts, params)

    def score(self, token_ids: list[int]) -> list[float]:
        return self.engine.score(token_ids)

    def load_weights(self, weights: dict[str, torch.Tensor], *, version: PolicyVersion) -> dict[str, float]:
        return self.engine.load_weights(weights.items(), version=version)

    def close(self) -> None:
        self.engine.close()
