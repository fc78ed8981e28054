"""Tensor parallelism: a HF decoder's linear layers split over the ``tp`` ranks of a device mesh with DTensor.

Owns the plans (`TensorParallelPlan`), `apply_tensor_parallel` (which turns a model's parameters into DTensors on
the ``tp`` mesh and returns this rank's `vocab_parallel.VocabShard`, the slice of the LM head's vocabulary that
`vocab_parallel.vocab_parallel_scores` scores). It neither shards data (FSDP2 does, on the
other mesh axes) nor runs steps.

Which layers split how comes from the model's own plan: transformers' ``base_model_tp_plan`` (Llama, Qwen2, Qwen3,
Mistral and the families that copy them) names each projection ``colwise`` or ``rowwise``; a model without one is
refused in one line (`layout.decoder_tp_plan`, which the driver also checks before any rank starts). Two plans
differ in the layers the model calls ``rowwise`` (the attention's output and the MLP's down projection):

* ``"gather"`` (the default): those layers split by output column too. Their input (heads or intermediate features,
  split over ranks) is all-gathered first, and every output element is one whole dot product computed on one rank,
  as on one device; the output is all-gathered. Nothing is summed across ranks in the forward pass; what still
  differs from one device is how the matmul kernel rounds a column slice (measured on SmolLM2-135M, tp 3: half the
  mean logprob difference of the rowwise plan, `docs/parallelism.md`). It moves 1.4x the rowwise plan's bytes for a
  model whose intermediate size is 2.7x its hidden size.
* ``"rowwise"`` (Megatron's): those layers split by input row; each rank's partial output is all-reduced. Fewer bytes
  moved; the sum over ranks rounds differently from one device's dot product, which published RL work names as one
  source of engine/trainer logprob mismatch (`docs/parallelism.md` gives the measured difference).

Both plans split the embedding and the LM head over the vocabulary (the embedding's all-reduce adds one row to
zeros: exact). The LM head's output stays split: each rank scores its vocabulary slice (`VocabShard`), and nothing
gathers ``[tokens, vocab]``. Every other parameter (the norms') becomes a DTensor replicated over the ``tp`` ranks, so
that all parameters live on one mesh (FSDP2 then shards each over the data-parallel axes, and the gradient norm and
the optimizer see one kind of tensor). A per-head norm (Qwen3's ``q_norm``/``k_norm``, ``replicated_with_grad_
allreduce`` in the model's plan) sees only the rank's heads: its input is marked split over heads, so DTensor adds its
weight's gradient over the ``tp`` ranks.

A Mixture-of-Experts layer (Mixtral, Qwen2-MoE, Qwen3-MoE) takes tp too: its experts split by output rows
(`expert_parallel.apply_expert_tensor_parallel`, whatever the plan; the plan's own expert entries are not applied),
its router and any shared expert's gate are replicated, and a shared expert follows the plan like a dense MLP. The
MoE block works on whole replicated rows: with sequence parallelism its input is all-gathered over the sequence and
its output split again, as a dense MLP's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from sharpen.trainer.backends.expert_parallel import EXPERT_CLASSES, apply_expert_tensor_parallel
from sharpen.trainer.backends.vocab_parallel import VocabShard
from sharpen.trainer.layout import LayoutError, decoder_tp_plan

if TYPE_CHECKING:
    from transformers import PreTrainedModel

TensorParallelPlan = Literal["gather", "rowwise"]
TENSOR_PARALLEL_PLANS: tuple[TensorParallelPlan, ...] = ("gather", "rowwise")


def model_tp_plan(model: PreTrainedModel) -> dict[str, str]:
    """The decoder layers' plan ``model``'s config declares (`layout.decoder_tp_plan`), keys relative to the decoder
    (``layers.*.self_attn.q_proj``). The embedding's entry (``embed_tokens``) is left out: `apply_tensor_parallel`
    splits the embedding and the LM head over the vocabulary itself."""
    declared = cast(dict[str, str] | None, getattr(model.config, "base_model_tp_plan", None))
    return decoder_tp_plan(declared, family=type(model.config).__name__)


def _style(name: str, plan: TensorParallelPlan, *, between: Placement) -> ParallelStyle | None:
    """The style of a layer of the model's plan; ``between``: the layout of the residual stream between blocks
    (Replicate, or Shard(1) with sequence parallelism)."""
    if name == "colwise":
        return ColwiseParallel()
    if name == "rowwise" and plan == "rowwise":  # reduce (all-reduce, or reduce-scatter over the sequence)
        return RowwiseParallel(output_layouts=between)
    if name == "rowwise":  # "gather": all-gather the split input, split the output columns, gather them
        return ColwiseParallel(input_layouts=Shard(-1), output_layouts=between)
    return None  # replicated_with_grad_allreduce: the weight stays whole; its gradient is all-reduced


def apply_tensor_parallel(
    model: PreTrainedModel,
    mesh: DeviceMesh,
    *,
    plan: TensorParallelPlan = "gather",
    sequence_parallel: bool = False,
    experts: bool = True,
) -> VocabShard:
    """Split ``model``'s decoder layers, embedding and LM head over ``mesh`` (the 1-D ``tp`` mesh), in place, before
    FSDP2 shards the result over the data-parallel axes. A tied LM head stays tied to the (vocabulary-split)
    embedding. ``sequence_parallel``: between the blocks, the residual stream and its norms hold ``1 / tp`` of the
    sequence on each rank (the sequence must divide by ``tp``: `context_parallel.ContextParallel` pads it and
    supplies the attention mask of the whole rows); the decoder's output is then a DTensor split over the
    sequence. ``experts``: split an MoE's experts over ``mesh`` too (False: expert parallelism splits them over ep x
    tp, `expert_parallel.apply_expert_parallel`). Returns this rank's slice of the LM head's vocabulary."""
    if plan not in TENSOR_PARALLEL_PLANS:
        raise LayoutError(f"unknown tensor-parallel plan {plan!r}; choose one of {TENSOR_PARALLEL_PLANS}")
    layer_plan = model_tp_plan(model)
    decoder = model.get_decoder()
    moe_blocks = [name for name, module in decoder.named_modules() if _holds_experts(module)]
    styles: dict[str, ParallelStyle] = {}
    per_head: list[str] = []  # modules whose input holds the rank's heads (replicated_with_grad_allreduce)
    colwise_blocks: set[str] = set()  # the blocks of the projections split by column
    between: Placement = Shard(1) if sequence_parallel else Replicate()
    for name, module in decoder.named_modules():
        for pattern, style_name in layer_plan.items():
            if not _matches(name, pattern):
                continue
            # inside an MoE block (a shared expert), the rows are whole and replicated
            style = _style(style_name, plan, between=Replicate() if _inside(name, moe_blocks) else between)
            if style is None:
                per_head.append(name)
            elif isinstance(module, nn.Linear | nn.Embedding):
                styles[name] = style
                if style_name == "colwise":
                    colwise_blocks.add(name.rsplit(".", 1)[0])
    styles = {**_shared_inputs(colwise_blocks, moe_blocks, between=between), **styles}
    if sequence_parallel:  # an MoE block takes whole rows, gathered over the sequence, and splits its output again
        for block in moe_blocks:
            styles[block] = _SequenceGathered(between)
    if experts:
        apply_expert_tensor_parallel(decoder, mesh)
    embeddings = cast(nn.Module, model.get_input_embeddings())
    lm_head = cast(nn.Module, model.get_output_embeddings())
    is_tied = lm_head.weight is embeddings.weight
    parallelize_module(decoder, mesh, styles)
    parallelize_module(embeddings, mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=between))
    # the LM head's output stays split over the vocabulary (a local [tokens, vocab / tp] slice)
    parallelize_module(lm_head, mesh, ColwiseParallel(output_layouts=Shard(-1)))
    if is_tied:  # parallelize_module made the head a parameter of its own: make it the embedding's again
        lm_head.weight = embeddings.weight
    for name, module in decoder.named_modules():
        if type(module).__name__ in EXPERT_CLASSES:  # experts split over ep x tp (not experts): left to that
            continue
        if any(not isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            split_heads = name in per_head
            in_moe = _inside(name, moe_blocks)  # a router: on whole rows
            if sequence_parallel and not split_heads and not in_moe:  # a norm of the residual stream: its shard
                parallelize_module(module, mesh, SequenceParallel(use_local_output=False))
            else:
                _replicate(module, mesh, input_layout=Shard(-2) if split_heads else Replicate())
    vocab_size = int(cast(torch.Tensor, lm_head.weight).shape[0])
    local = vocab_size // mesh.size()
    return VocabShard(start=mesh.get_local_rank() * local, size=local, group=mesh.get_group())


def _shared_inputs(blocks: set[str], moe_blocks: list[str], *, between: Placement) -> dict[str, ParallelStyle]:
    """One replicated DTensor input for each of ``blocks``, those whose projections split by column (attention:
    q/k/v; MLP or shared expert: gate/up): their input gradients, partial sums on each rank, then add up in that one
    DTensor and are all-reduced once per block instead of once per projection (2 all-reduces per layer in the
    backward, not 5). The attention takes its input as the ``hidden_states`` keyword, an MLP as its one argument
    (Llama, Qwen2, Qwen3, Mistral); a block called otherwise keeps one all-reduce per projection (the same values). A
    block inside an MoE block (``moe_blocks``) gets whole replicated rows."""
    inputs: dict[str, ParallelStyle] = {}
    for block in sorted(blocks):
        layout = Replicate() if _inside(block, moe_blocks) else between
        if block.rsplit(".", 1)[-1] != "self_attn":
            inputs[block] = PrepareModuleInput(
                input_layouts=(layout,), desired_input_layouts=(Replicate(),), use_local_output=False
            )
        else:
            inputs[block] = PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": layout},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
                use_local_output=False,
            )
    return inputs


def _holds_experts(module: nn.Module) -> bool:
    """An MoE block: the module whose children are its router and its experts."""
    return any(type(child).__name__ in EXPERT_CLASSES for child in module.children())


def _inside(name: str, blocks: list[str]) -> bool:
    """Whether module ``name`` lies inside one of ``blocks`` (module names)."""
    return any(name.startswith(block + ".") for block in blocks)


class _SequenceGathered(ParallelStyle):
    """An MoE block under sequence parallelism: its input all-gathered over the sequence into whole replicated rows
    (local tensors), its output split over the sequence again, as the residual stream between blocks holds it
    (``between``). Without sequence parallelism the block's input is already whole and replicated."""

    def __init__(self, between: Placement) -> None:
        super().__init__()
        self.input = PrepareModuleInput(
            input_layouts=(between,), desired_input_layouts=(Replicate(),), use_local_output=True
        )
        self.output = PrepareModuleOutput(output_layouts=(Replicate(),), desired_output_layouts=(between,))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return self.output._apply(self.input._apply(module, device_mesh), device_mesh)


def _replicate(module: nn.Module, mesh: DeviceMesh, *, input_layout: Placement) -> None:
    """``module``'s own parameters as DTensors replicated over ``mesh``; its tensor inputs enter as DTensors with
    ``input_layout`` (Replicate, or Shard over heads for a per-head norm) and its output leaves as a local tensor."""

    def partition(_name: str, owner: nn.Module, owner_mesh: DeviceMesh) -> None:
        for name, parameter in list(owner.named_parameters(recurse=False)):
            replicated = distribute_tensor(parameter.data, owner_mesh, [Replicate()])
            owner.register_parameter(name, nn.Parameter(replicated, requires_grad=parameter.requires_grad))

    def enter(_owner: nn.Module, inputs: tuple[object, ...], owner_mesh: DeviceMesh) -> tuple[object, ...]:
        return tuple(
            DTensor.from_local(x, owner_mesh, [input_layout], run_check=False)
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
            else x
            for x in inputs
        )

    def leave(_owner: nn.Module, output: object, _mesh: DeviceMesh) -> object:
        if isinstance(output, tuple):  # a router's (logits, weights, indices)
            return tuple(x.to_local() if isinstance(x, DTensor) else x for x in cast(tuple[object, ...], output))
        return output.to_local() if isinstance(output, DTensor) else output

    # torch's stubs type input_fn/output_fn as returning None; what they return replaces the inputs/output
    distribute_module(module, mesh, partition, enter, leave)  # pyright: ignore[reportArgumentType]


def _matches(module_name: str, pattern: str) -> bool:
    """``layers.3.self_attn.q_norm`` matches ``layers.*.self_attn.q_norm`` (a module pattern of the plan)."""
    parts, wanted = module_name.split("."), pattern.split(".")
    return len(parts) == len(wanted) and all(w in ("*", p) for w, p in zip(wanted, parts, strict=True))
