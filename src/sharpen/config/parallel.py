"""The ``[trainer.parallel]`` section: how the trainer's ranks split the model beside FSDP2's data shards.

Pydantic only (no torch): `sharpen.trainer.layout.ParallelLayout` is the layout these sizes make once the number of
ranks is known (``dp_shard`` takes the ranks that the other axes leave), and it checks them against the model before
any process starts (docs/parallelism.md).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from sharpen.config.section import Section


class ParallelConfig(Section):
    """The size of each parallel axis other than ``dp_shard`` (FSDP2's shards), which takes the rest of
    ``runtime.trainer_ranks``, and how the pipeline runs (docs/parallelism.md)."""

    tp: int = Field(default=1, ge=1)
    """Tensor-parallel ranks: each decoder layer's projections, the embedding and the LM head are split over them
    (neighbouring ranks: on a GPU cluster, ranks of one node). Must divide the model's heads, key/value heads, hidden
    and intermediate sizes and vocabulary."""
    tp_plan: Literal["gather", "rowwise"] = "gather"
    """How the layers the model's plan calls row-wise (attention output, MLP down projection) split: ``gather``
    all-gathers their input so that no sum crosses ranks (the default: the logprobs closest to one device's,
    measured); ``rowwise`` is Megatron's split with an all-reduce of partial sums (fewer bytes moved)."""
    sequence_parallel: bool = True
    """With tp > 1: between the tensor-parallel blocks, the residual stream and its norms hold 1 / tp of the sequence
    on each rank (their activations shrink by tp; the same values: the gather plan gathers instead of summing, the
    rowwise plan reduce-scatters what it all-reduced)."""
    dp_replicate: int = Field(default=1, ge=1)
    """Replicas of the sharded model (HSDP): FSDP2 shards over ``dp_shard`` ranks inside each replica and the
    replicas all-reduce gradients; data is split over both."""
    pp: int = Field(default=1, ge=1)
    """Pipeline ranks: each holds a contiguous slice of the decoder layers (the first also the embedding, the last
    the final norm and the LM head), and an optimizer step's micro-batches flow through them by ``pp_schedule``.
    Not with cp > 1, LoRA or a vision-language model yet."""
    pp_schedule: Literal["1f1b", "interleaved_1f1b", "gpipe"] = "1f1b"
    """The pipeline's schedule (torch.distributed.pipelining): ``1f1b`` holds at most pp micro-batches' activations;
    ``interleaved_1f1b`` gives each rank ``pp_stages_per_rank`` stages, which shrinks the bubble by that factor;
    ``gpipe`` runs every forward, then every backward. A step's micro-batches are made a multiple of pp x
    pp_stages_per_rank (with passes whose loss is 0)."""
    pp_stages_per_rank: int = Field(default=1, ge=1)
    """Stages each pipeline rank holds (interleaved 1F1B only; there it must be at least 2)."""
    cp: int = Field(default=1, ge=1)
    """Context-parallel ranks (Ulysses): each runs every row's decoder on 1 / cp of its sequence and attention trades
    that split for one over heads, so the heads (per tensor-parallel rank) must divide by it. Right-padded and
    packed rows; FSDP2 shards parameters over dp_shard x cp."""

    ep: int = Field(default=1, ge=1)
    """Expert-parallel ranks of a Mixture-of-Experts model: each MoE layer's experts are split over ep ranks, and
    every token goes to the rank of each expert it is routed to (all-to-all) and comes back. Carved out of the
    data-parallel ranks (dp_shard, times cp), which it must divide, as must the model's experts; FSDP2 shards the
    experts over the ranks that hold the same ones. Runs with cp, pp and dp_replicate, not with tp (docs/moe.md)."""

    @property
    def ranks_per_shard(self) -> int:
        """The ranks one data shard spans on the other axes (``runtime.trainer_ranks`` must be a multiple)."""
        return self.tp * self.dp_replicate * self.pp * self.cp
