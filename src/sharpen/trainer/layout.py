"""`ParallelLayout`: how a trainer's ranks split the work, as one pure object checked before any process starts.

The axes, outermost first (the order of the device mesh, as torchtitan orders it, so that the innermost axis, the one
with the most traffic, holds ranks that are neighbours): ``pp`` (pipeline stages) x ``dp_replicate`` (replicated
data parallelism: HSDP's replicas) x ``dp_shard`` (sharded data parallelism: FSDP2) x ``cp`` (context parallelism:
the sequence split over ranks) x ``tp`` (tensor parallelism, with sequence parallelism). Their product is the world
size. Expert parallelism (``ep``) is not a sixth axis: an MoE layer re-factorises the ranks of ``dp_shard x cp`` into
``ep`` expert groups (each rank holds num_experts / ep experts), as torchtitan does, so it must divide that product.

`check` says in one line what does not fit: the world size, the model's heads, key/value heads, layers, vocabulary,
hidden and intermediate sizes and experts, and the pipeline's micro-batch count. It imports no torch: the runtime and
the config can validate a layout for 64 ranks on a laptop. `sharpen.trainer.backends.mesh` turns a checked layout
into a torch `DeviceMesh`; applying the axes to a model (DTensor plans, FSDP2, pipelining) is the backends' job.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from sharpen.config import ConfigError

if TYPE_CHECKING:
    from sharpen.config.parallel import ParallelConfig

Axis = Literal["pp", "dp_replicate", "dp_shard", "cp", "tp"]
AXES: tuple[Axis, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""The mesh's axes, outermost first."""

PipelineSchedule = Literal["gpipe", "1f1b", "interleaved_1f1b"]


TP_STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce")
"""The entries of a model's ``base_model_tp_plan`` that sharpen's tensor parallelism applies (`backends/tensor_
parallel.py`); any other is refused."""


class LayoutError(ConfigError):
    """A layout that does not fit the world or the model; the message is one line meant for the user (a
    `ConfigError`, so the CLI prints it as one and never needs to import the trainer to catch it)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelShape:
    """The sizes of a model that a layout must divide, read from its HF ``config.json`` (`from_hf_config`)."""

    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_experts: int = 0
    """Routed experts per MoE layer (0: a dense model)."""

    @classmethod
    def from_model_folder(cls, folder: Path) -> ModelShape:
        """From the ``config.json`` of a HF model folder."""
        return cls.from_hf_config(json.loads((Path(folder) / "config.json").read_text()))

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelShape:
        """From a transformers ``config.json`` as a dict (a VLM's text model from its ``text_config``). MoE
        families name their expert count differently (``num_local_experts``: Mixtral; ``num_experts``: Qwen-MoE,
        OLMoE; ``n_routed_experts``: DeepSeek-V3)."""
        text = config.get("text_config") or config
        missing = [
            key for key in ("num_attention_heads", "num_hidden_layers", "vocab_size", "hidden_size") if key not in text
        ]
        if missing:
            raise LayoutError(
                f"the model's config.json has no {', '.join(missing)} (a {text.get('model_type', 'model')} names its "
                "sizes otherwise): sharpen cannot lay this model out over several ranks"
            )
        heads = int(text["num_attention_heads"])
        experts = next(
            (int(text[k]) for k in ("num_local_experts", "num_experts", "n_routed_experts") if text.get(k)), 0
        )
        intermediate = text.get("moe_intermediate_size") if experts else None
        return cls(
            num_layers=int(text["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(text.get("num_key_value_heads") or heads),
            vocab_size=int(text["vocab_size"]),
            hidden_size=int(text["hidden_size"]),
            intermediate_size=int(intermediate or text["intermediate_size"]),
            num_experts=experts,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelLayout:
    """The size of each axis (1: not split along it). ``ep``: expert-parallel groups of an MoE model's layers,
    carved out of ``dp_shard x cp``. ``pp_schedule`` and ``pp_stages_per_rank`` (virtual stages, interleaved
    1F1B only) say how the pipeline runs."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    pp_schedule: PipelineSchedule = "1f1b"
    pp_stages_per_rank: int = 1

    @classmethod
    def filling(cls, world_size: int, **sizes: Any) -> ParallelLayout:
        """The layout with ``sizes`` and ``dp_shard`` filling the rest of ``world_size`` (what FSDP2 alone is: every
        rank a shard). Raises `LayoutError` when the other axes do not divide the world."""
        if "dp_shard" in sizes:
            raise LayoutError("filling() chooses dp_shard itself; pass the other axes")
        others = math.prod(int(sizes.get(axis, 1)) for axis in AXES if axis != "dp_shard")
        if others < 1 or world_size % others:
            named = " x ".join(f"{axis} {sizes.get(axis, 1)}" for axis in AXES if axis != "dp_shard")
            raise LayoutError(f"{named} = {others} ranks does not divide the world of {world_size} ranks")
        return cls(dp_shard=world_size // others, **sizes)

    @classmethod
    def from_config(cls, parallel: ParallelConfig, world_size: int) -> ParallelLayout:
        """The layout ``[trainer.parallel]`` asks for on ``world_size`` ranks (``dp_shard`` takes the rest)."""
        return cls.filling(
            world_size,
            tp=parallel.tp,
            dp_replicate=parallel.dp_replicate,
            pp=parallel.pp,
            cp=parallel.cp,
            ep=parallel.ep,
            pp_schedule=parallel.pp_schedule,
            pp_stages_per_rank=parallel.pp_stages_per_rank,
        )

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if isinstance(value, int) and value < 1:
                raise LayoutError(f"{item.name} = {value}: every axis needs a size of at least 1")
        if self.pp_stages_per_rank > 1 and self.pp_schedule != "interleaved_1f1b":
            raise LayoutError(
                f'pp_stages_per_rank = {self.pp_stages_per_rank} needs pp_schedule = "interleaved_1f1b" (the other '
                "schedules run one stage per rank)"
            )
        if self.pp > 1 and self.pp_schedule == "interleaved_1f1b" and self.pp_stages_per_rank < 2:
            raise LayoutError(
                'pp_schedule = "interleaved_1f1b" needs pp_stages_per_rank >= 2 (one stage per rank is plain 1F1B)'
            )

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes)

    @property
    def sizes(self) -> tuple[int, ...]:
        """The mesh's shape: the size of each axis of `AXES`, in that order."""
        return tuple(getattr(self, axis) for axis in AXES)

    @property
    def num_stages(self) -> int:
        """Pipeline stages in all (pp x virtual stages per rank)."""
        return self.pp * self.pp_stages_per_rank

    def describe(self) -> str:
        """``pp 2 x dp_shard 4 x tp 2`` (axes of size 1 left out; ``single device`` when all are 1)."""
        named = [f"{axis} {size}" for axis, size in zip(AXES, self.sizes, strict=True) if size > 1]
        if self.ep > 1:
            named.append(f"(ep {self.ep})")
        return " x ".join(named) or "single device"

    def coordinates(self, rank: int) -> dict[Axis, int]:
        """Where ``rank`` sits on each axis (row-major over `AXES`, as `DeviceMesh` numbers ranks)."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside the world of {self.world_size} ranks")
        coordinates: dict[Axis, int] = {}
        for axis, size in reversed(list(zip(AXES, self.sizes, strict=True))):
            rank, coordinates[axis] = divmod(rank, size)
        return {axis: coordinates[axis] for axis in AXES}

    def group(self, axis: Axis, rank: int) -> list[int]:
        """The ranks that share every coordinate of ``rank`` but ``axis``: ``rank``'s group along ``axis``."""
        here = self.coordinates(rank)
        strides = {a: math.prod(self.sizes[i + 1 :]) for i, a in enumerate(AXES)}
        base = sum(here[a] * strides[a] for a in AXES if a != axis)
        return [base + k * strides[axis] for k in range(getattr(self, axis))]

    def check(
        self,
        *,
        world_size: int,
        model: ModelShape | None = None,
        num_micro_batches: int | None = None,
    ) -> None:
        """Raise `LayoutError` (one line) unless this layout fits ``world_size`` ranks, ``model``'s sizes and, with
        a pipeline, ``num_micro_batches`` per optimizer step."""
        if self.world_size != world_size:
            raise LayoutError(
                f"{self._product()} = {self.world_size} ranks, but the trainer has {world_size}: make the product "
                "of the axes equal the number of trainer ranks"
            )
        if self.ep > 1 and (self.dp_shard * self.cp) % self.ep:
            raise LayoutError(
                f"ep {self.ep} must divide dp_shard x cp = {self.dp_shard * self.cp}: expert groups are carved out "
                "of the data- and context-parallel ranks"
            )
        if model is not None:
            self._check_model(model)
        if self.pp > 1 and num_micro_batches is not None:
            self._check_micro_batches(num_micro_batches)

    def check_built(self) -> None:
        """Raise `LayoutError` for axes whose trainer is not built together yet: pipeline with context parallelism,
        expert parallelism with tensor parallelism."""
        if self.pp > 1 and self.cp > 1:
            raise LayoutError(
                f"pipeline and context parallelism together (pp {self.pp} x cp {self.cp}) are not built yet: use one "
                "of them (docs/parallelism.md)"
            )
        if self.ep > 1 and self.tp > 1 and self.cp > 1:
            raise LayoutError(
                f"expert parallelism (ep {self.ep}) with both tensor (tp {self.tp}) and context (cp {self.cp}) "
                "parallelism is not built yet (docs/moe.md)"
            )

    def check_features(self, *, lora: bool, vision: bool, distillation: bool) -> None:
        """Raise `LayoutError` (one line) for a trainer feature this layout's axes do not run with: LoRA with
        tensor, context or pipeline parallelism, a vision-language model with any of them, distillation with a
        pipeline."""
        split = [f"{axis} > 1" for axis in ("tp", "cp", "pp") if getattr(self, axis) > 1]
        if lora and split:
            raise LayoutError(
                f"trainer.lora with {' and '.join(split)} is not supported: use tp = cp = pp = 1 with LoRA"
            )
        if vision and split:
            raise LayoutError(
                f"tensor, context and pipeline parallelism split text decoders only: a vision-language model needs "
                f"tp = cp = pp = 1, not {' and '.join(split)}"
            )
        if distillation and self.pp > 1:
            raise LayoutError("trainer.distillation with pipeline parallelism (pp > 1) is not supported: use pp = 1")
        if self.ep > 1 and (lora or vision):
            raise LayoutError(
                f"expert parallelism (ep {self.ep}) takes neither trainer.lora nor a vision-language model"
            )

    def _check_model(self, model: ModelShape) -> None:
        tp, cp = self.tp, self.cp
        divides = [
            ("attention heads", model.num_attention_heads, tp * cp, "tp x cp (Ulysses splits heads over cp)"),
            ("key/value heads", model.num_key_value_heads, tp, "tp"),
            ("vocabulary", model.vocab_size, tp, "tp (the LM head is split over the vocabulary)"),
            ("hidden size", model.hidden_size, tp, "tp"),
            ("intermediate size", model.intermediate_size, tp, "tp"),
        ]
        for what, size, by, axes in divides:
            if by > 1 and size % by:
                raise LayoutError(f"the model's {what} ({size}) are not divisible by {axes} = {by}")
        if self.num_stages > model.num_layers:
            raise LayoutError(
                f"{self.num_stages} pipeline stages (pp {self.pp} x {self.pp_stages_per_rank} per rank) for "
                f"{model.num_layers} layers: every stage needs a layer at least"
            )
        if self.ep > 1 and not model.num_experts:
            raise LayoutError(f"ep {self.ep} needs a Mixture-of-Experts model; this one is dense")
        if self.ep > 1 and model.num_experts % self.ep:
            raise LayoutError(f"the model's {model.num_experts} experts are not divisible by ep {self.ep}")

    def _check_micro_batches(self, num_micro_batches: int) -> None:
        if num_micro_batches < self.pp:
            raise LayoutError(
                f"{num_micro_batches} micro-batches per optimizer step for pp {self.pp}: a pipeline needs at least "
                "one per stage (more shrink its bubble)"
            )
        if self.pp_schedule == "interleaved_1f1b" and num_micro_batches % self.pp:
            raise LayoutError(
                f"interleaved 1F1B needs a multiple of pp {self.pp} micro-batches per step, got {num_micro_batches}"
            )

    def _product(self) -> str:
        return " x ".join(f"{axis} {size}" for axis, size in zip(AXES, self.sizes, strict=True))


def decoder_tp_plan(declared: Mapping[str, str] | None, *, family: str) -> dict[str, str]:
    """The decoder layers' entries (``layers.*``) of a model's declared tensor-parallel plan (transformers'
    ``base_model_tp_plan`` of its config class, named ``family``); raises `LayoutError` when there is none or it uses
    a style sharpen does not apply. An MoE's experts entries (``layers.*.mlp.experts...``) are left out: sharpen splits
    the experts itself (`expert_parallel.apply_expert_tensor_parallel`). Pure: the driver checks it before any rank
    starts."""
    plan = {
        pattern: style
        for pattern, style in (declared or {}).items()
        if pattern.startswith("layers.") and ".experts" not in pattern
    }
    if not plan:
        raise LayoutError(
            f"{family} declares no tensor-parallel plan (transformers' base_model_tp_plan): this model family "
            "cannot run with trainer.parallel.tp > 1"
        )
    unknown = sorted({style for style in plan.values() if style not in TP_STYLES})
    if unknown:
        raise LayoutError(
            f"{family}'s tensor-parallel plan uses {', '.join(unknown)}, which sharpen does not apply (it applies "
            f"{', '.join(TP_STYLES)}): this model family cannot run with trainer.parallel.tp > 1"
        )
    if not any(".self_attn." in pattern for pattern in plan):  # DeepSeek-V3's latent attention
        raise LayoutError(
            f"{family}'s tensor-parallel plan does not split its attention: this model family cannot run with "
            "trainer.parallel.tp > 1"
        )
    return plan
