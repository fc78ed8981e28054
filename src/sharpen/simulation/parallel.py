"""What the trainer's parallel layout costs: tensor- and context-parallel collectives per layer, the pipeline bubble,
FSDP's gathers, and the bytes of model state and of activations each GPU holds.

It owns the formulas and the collectives each tensor-parallel plan runs per decoder layer (`layer_collectives`),
which mirror sharpen's plans (`trainer/backends/tensor_parallel.py`): the unit tests count the collectives DTensor
actually issues for each plan and compare them with this table. Times come from the alpha-beta closed forms of
`collectives`; it ignores compute/communication overlap inside a layer (tensor- and context-parallel collectives sit
on the critical path) and assumes FSDP's gathers overlap compute fully (`max`). It does not schedule (cluster.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sharpen.simulation.collectives import ring_allgather_seconds, ring_allreduce_seconds

Collective = Literal["all_gather", "all_reduce", "reduce_scatter", "all_to_all"]
Width = Literal["hidden", "intermediate", "qkv"]
Pass = Literal["forward", "backward"]


@dataclass(frozen=True, slots=True)
class LayerCollective:
    """One collective a decoder layer runs per micro-batch: its kind, the width of the ``[tokens, width]`` tensor
    it moves (the whole tensor, before any split), and the pass."""

    kind: Collective
    width: Width
    pass_: Pass


def layer_collectives(tp_plan: str, *, tp: int, cp: int) -> tuple[LayerCollective, ...]:
    """The collectives of one decoder layer (forward and backward) under ``tp_plan`` (``gather`` or ``rowwise``),
    with ``tp`` tensor-parallel and ``cp`` context-parallel (Ulysses) ranks. Sizes of 1 run none."""
    out: list[LayerCollective] = []
    if tp > 1:
        # backward: the gradient of each block's replicated input (attention, MLP) is all-reduced once
        block_inputs = [LayerCollective("all_reduce", "hidden", "backward")] * 2
        if tp_plan == "rowwise":
            out += [LayerCollective("all_reduce", "hidden", "forward")] * 2 + block_inputs
        elif tp_plan == "gather":
            out += [
                LayerCollective("all_gather", "hidden", "forward"),  # attention output projection's input
                LayerCollective("all_gather", "hidden", "forward"),  # ... and its output
                LayerCollective("all_gather", "intermediate", "forward"),  # MLP down projection's input
                LayerCollective("all_gather", "hidden", "forward"),  # ... and its output
                *block_inputs,
                LayerCollective("reduce_scatter", "hidden", "backward"),  # the gathered inputs' gradients
                LayerCollective("reduce_scatter", "intermediate", "backward"),
            ]
        else:
            raise ValueError(f"unknown tensor-parallel plan {tp_plan!r}")
    if cp > 1:  # Ulysses: q, k, v to heads-split before attention, the output back, in both passes
        for pass_ in ("forward", "backward"):
            out += [LayerCollective("all_to_all", "qkv", pass_), LayerCollective("all_to_all", "hidden", pass_)]
    return tuple(out)


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerShape:
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int

    def width(self, width: Width) -> int:
        if width == "hidden":
            return self.hidden_size
        if width == "intermediate":
            return self.intermediate_size
        head_dim = self.hidden_size // self.num_attention_heads
        return self.hidden_size + 2 * self.num_key_value_heads * head_dim  # q, k and v


def all_to_all_seconds(num_bytes: float, num_ranks: int, *, alpha: float, beta: float) -> float:
    """Every rank sends 1/p of its ``num_bytes`` to each other rank (pairwise exchange: p - 1 steps)."""
    if num_ranks <= 1:
        return 0.0
    return (num_ranks - 1) * (alpha + num_bytes / num_ranks / beta)


def collective_seconds(kind: Collective, num_bytes: float, num_ranks: int, *, alpha: float, beta: float) -> float:
    if kind == "all_reduce":
        return ring_allreduce_seconds(num_bytes, num_ranks, alpha=alpha, beta=beta)
    if kind == "all_to_all":
        return all_to_all_seconds(num_bytes, num_ranks, alpha=alpha, beta=beta)
    return ring_allgather_seconds(num_bytes, num_ranks, alpha=alpha, beta=beta)  # a reduce-scatter moves as much


def pipeline_bubble_factor(pp: int, micro_batches: int, *, stages_per_rank: int = 1) -> float:
    """Step time over the time without a bubble for 1F1B (``stages_per_rank`` 1) or interleaved 1F1B: each rank
    idles (pp - 1) / stages_per_rank micro-batch slots at the pipeline's fill and drain (Narayanan et al., 2021)."""
    if pp <= 1:
        return 1.0
    return (micro_batches + (pp - 1) / stages_per_rank) / micro_batches


def state_bytes_per_gpu(num_params: float, *, tp: int, pp: int, dp_shard: int, cp: int = 1) -> float:
    """Float32 master weights, gradients and AdamW's two moments (16 bytes a parameter), split over tp x pp and
    sharded by FSDP2 over dp_shard x cp (context-parallel ranks shard parameters too, as in torchtitan);
    activations are `activation_bytes_per_gpu`."""
    return 16.0 * num_params / (tp * pp * dp_shard * cp)


def activation_bytes_per_token(shape: LayerShape, *, tp: int, sequence_parallel: bool, bytes_per_value: float) -> float:
    """What one decoder layer keeps for its backward per token of a micro-batch on one GPU (a pre-norm decoder with
    a gated MLP and fused attention, whose scores are recomputed rather than stored; Korthikanti et al., 2022, count
    the same tensors): the inputs and outputs of the two norms (4 x hidden), the attention's output (hidden), q, k
    and v (the `qkv` width) and the MLP's gate, up, activation and product (4 x intermediate). With tensor
    parallelism the projections' tensors are split over ``tp``; the norms' are too with sequence parallelism, else
    every tp rank holds them whole."""
    norms = 4 * shape.hidden_size
    split = shape.hidden_size + shape.width("qkv") + 4 * shape.intermediate_size
    per_rank = (norms + split) / tp if sequence_parallel else norms + split / tp
    return bytes_per_value * per_rank


def activation_bytes_per_gpu(
    shape: LayerShape,
    tokens_per_micro_batch: float,
    *,
    tp: int,
    pp: int,
    cp: int,
    micro_batches: int,
    stages_per_rank: int = 1,
    sequence_parallel: bool = True,
    checkpointing: bool = False,
    bytes_per_value: float = 2.0,
) -> float:
    """The activations the busiest GPU (the first pipeline stage) holds at once: ``tokens_per_micro_batch`` (its data
    shard's, before the context-parallel split) x the layers it keeps for the backward x `activation_bytes_per_token`.
    Without a pipeline one micro-batch is in flight (its graph is freed by its backward); 1F1B keeps min(m, pp) on
    the first stage, interleaved 1F1B (1 + (pp - 1) / (pp x v)) times that (Narayanan et al., 2021). With activation
    checkpointing a layer keeps only its input (hidden, split like the norms), plus one layer recomputed whole."""
    tokens = tokens_per_micro_batch / cp
    layers = shape.num_layers / pp
    in_flight = (
        1.0
        if pp == 1
        else min(micro_batches, pp) * (1 + (pp - 1) / (pp * stages_per_rank) if stages_per_rank > 1 else 1)
    )
    whole_layer = activation_bytes_per_token(
        shape, tp=tp, sequence_parallel=sequence_parallel, bytes_per_value=bytes_per_value
    )
    if not checkpointing:
        return tokens * layers * in_flight * whole_layer
    layer_input = bytes_per_value * shape.hidden_size / (tp if sequence_parallel else 1)
    return tokens * (layers * in_flight * layer_input + whole_layer)
