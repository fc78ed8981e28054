"""Pipeline parallelism: a HF decoder's layers cut into stages, one (or, interleaved, several) per ``pp`` rank, run by
a `torch.distributed.pipelining` schedule (GPipe, 1F1B or interleaved 1F1B).

Owns `PipelineParallel`: it keeps on this rank only the layers of its stages (the others become `_Skip`, so every
parameter keeps its HF name, and checkpoints and weight sync see the model's own names), wraps each stage in a
`_Stage` module whose forward is the decoder over those layers (the first stage embeds the token ids, the last one
applies the final norm and scores the targets with `scoring.score_hidden`), and runs one optimizer step's
micro-batches through the schedule (`train`) or scores them without gradient (`score`).

What crosses stages is one tensor, the hidden states ``[rows, seq, hidden]`` (this rank's sequence shard with
sequence or context parallelism), in the compute dtype. Everything else a stage needs (token ids, attention mask,
positions, target mask) every ``pp`` rank of a data shard already has: the schedule hands it to every stage as
keyword arguments, micro-batch by micro-batch. A schedule needs micro-batches of one shape: they are padded to the
step's most rows and longest row (rows of padding tokens that score nothing), and their number to a multiple of the
stages per rank x pp with passes whose loss is 0 x their scores. The RL loss runs on the last stage, per micro-batch,
with that micro-batch's advantages, masks and off-policy weights (the trainer's `MicroBatchLoss`); each loss is
already divided by the whole step's normaliser, so the schedule must not divide the gradients again
(``scale_grads=False``). Logprobs for scoring are computed on the last stage and broadcast to the others.

A tied LM head (SmolLM2) lives twice: as the embedding on the first stage and as the head on the last. Both start
equal, their gradients are added (`sync_tied_gradients`) before each optimizer step, and AdamW then moves them
alike, so they stay equal, as Megatron keeps its word embeddings. It does not shard parameters (FSDP2 does, within a
stage), split layers (tensor parallelism) or decide what a loss is.

A Mixture-of-Experts model's routes (``trainer.moe``, docs/moe.md) ride with the micro-batches too: the routes to
replay, ``[rows, length, MoE layers, top_k]`` per micro-batch, are a keyword argument like the masks, and each stage
replays its own layers' (a `RouterReplay` per stage) and captures what its routers chose. After a run the ranks of
the pipeline exchange their layers' captured routes, so every rank returns each micro-batch's routes over all layers
(`PipelineRouters` stands for the stages' routers together). The loss on the last stage runs before the other
stages' routes are known, so it gets none; the trainer reads them after the run.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor

from sharpen.expert_routes import RouterReplay, Routes, RoutingError, is_moe_model
from sharpen.trainer.algorithms.sampling_mask import SamplingMask
from sharpen.trainer.backends.base import MicroBatchLoss, ScoreInputs, TokenScores, replaying
from sharpen.trainer.backends.context_parallel import ContextParallel
from sharpen.trainer.backends.mesh import weight_shard
from sharpen.trainer.backends.pipeline_routes import (
    Captured,
    PipelineRouters,
    balance_inputs,
    stage_balance,
    with_added_loss,
)
from sharpen.trainer.backends.scoring import score_hidden
from sharpen.trainer.backends.vocab_parallel import VocabShard
from sharpen.trainer.layout import LayoutError, ParallelLayout
from sharpen.weight_shards import WeightShard

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def stage_layers(num_layers: int, num_stages: int) -> list[range]:
    """The decoder layers of each stage: contiguous, as equal as they divide (the first stages take one more)."""
    if not 1 <= num_stages <= num_layers:
        raise LayoutError(f"{num_stages} pipeline stages for {num_layers} layers: every stage needs a layer at least")
    size, extra = divmod(num_layers, num_stages)
    bounds = [0]
    for stage in range(num_stages):
        bounds.append(bounds[-1] + size + (1 if stage < extra else 0))
    return [range(bounds[i], bounds[i + 1]) for i in range(num_stages)]


class _Skip(nn.Module):
    """A decoder layer that another stage holds: the hidden states pass through unchanged."""

    def forward(self, hidden_states: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return hidden_states


@dataclass(slots=True)
class _Run:
    """What every stage needs to know about the schedule run in progress (set before each run)."""

    temperature: float = 1.0
    sampling_mask: SamplingMask | None = None
    with_entropy: bool = False
    entropy_requires_grad: bool = False
    packed: bool = False
    logits_chunk_tokens: int = 0
    captured: Captured = field(default_factory=dict)
    """An MoE's routes captured by this rank's stages in the run: per micro-batch, per MoE layer (its position among
    the model's), the ``[rows x length, top_k]`` expert indices and, under replay, ``differs``."""


class _Stage(nn.Module):
    """One pipeline stage: the decoder over the stage's layers (a shallow copy of the decoder whose other layers are
    `_Skip`), with the embedding on the first stage and the final norm and LM head on the last. Its input is the
    token ids (first stage) or the previous stage's hidden states; its output is the hidden states, or on the last
    stage the targets' logprobs (and entropy)."""

    def __init__(
        self,
        decoder: nn.Module,
        lm_head: nn.Module | None,
        *,
        run: _Run,
        is_first: bool,
        context: ContextParallel | None,
        vocab: VocabShard | None,
    ) -> None:
        super().__init__()
        self.decoder = decoder
        self.lm_head = lm_head
        self.is_first = is_first
        self._run = run
        self._context = context
        self._vocab = vocab
        self.router: RouterReplay | None = None
        """An MoE stage's routers (`PipelineParallel.routers`); None: a dense stage, or routes not measured."""
        self.route_layers: list[int] = []
        """The positions, among the model's MoE layers, of this stage's."""
        self.num_route_layers = 0
        """The model's MoE layers (all stages')."""

    def forward(
        self,
        x: torch.Tensor,
        *,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        target_mask: torch.Tensor,
        pass_index: torch.Tensor | None = None,
        routes: torch.Tensor | None = None,
        balance: torch.Tensor | None = None,
        real_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        run = self._run
        positions: torch.Tensor | None = position_ids if run.packed else None
        mask: torch.Tensor | None = None if run.packed else attention_mask
        ids = input_ids
        if self._context is not None:  # this rank's slice of the sequence, and the whole rows' attention mask
            ids, positions = self._context.split(input_ids, positions)
            mask = None
        inputs = {"input_ids": ids} if self.is_first else {"inputs_embeds": x}
        hidden, used = self._decoded(inputs, mask, positions, pass_index, routes, shape=input_ids.shape)
        if used is not None and balance is not None and real_tokens is not None:
            added = stage_balance(used, real_tokens, float(balance[0]), num_layers=self.num_route_layers)
            hidden = hidden if added is None else with_added_loss(hidden, added)
        if self.lm_head is None:
            return hidden.to_local() if isinstance(hidden, DTensor) else hidden
        scores = score_hidden(
            self.lm_head,
            hidden,
            input_ids,
            target_mask,
            temperature=run.temperature,
            with_entropy=run.with_entropy,
            entropy_requires_grad=run.entropy_requires_grad,
            logits_chunk_tokens=run.logits_chunk_tokens,
            vocab=self._vocab,
            context=self._context,
            sampling_mask=run.sampling_mask,
        )
        if run.with_entropy:
            assert scores.entropy is not None, "score_hidden returns the entropy it was asked for"
            return scores.logprobs, scores.entropy
        return scores.logprobs

    def _decoded(
        self,
        inputs: dict[str, torch.Tensor],
        mask: torch.Tensor | None,
        positions: torch.Tensor | None,
        pass_index: torch.Tensor | None,
        routes: torch.Tensor | None,
        *,
        shape: torch.Size,
    ) -> tuple[torch.Tensor, Routes | None]:
        """The stage's decoder over ``inputs``, and the routes its MoE layers used (None: a dense stage). An MoE
        stage replays its layers' part of ``routes`` (``[rows, length, MoE layers, top_k]``, the micro-batch's;
        None: its routers choose) and keeps what they chose, for micro-batch ``pass_index``, in the run's
        ``captured``."""
        router = self.router
        if router is None:
            output = self.decoder(attention_mask=mask, position_ids=positions, use_cache=False, **inputs)
            return output.last_hidden_state, None
        given = None
        rows, length = shape  # the micro-batch's padded rows (before a sequence split)
        if routes is not None:
            flat = routes.reshape(-1, *routes.shape[2:])  # [rows x length, MoE layers, top_k]
            given = Routes(layers=[flat[:, position] for position in self.route_layers])
            if self._context is not None:  # sequence parallelism: the MoE blocks see the rows padded to tp
                given = self._context.local_routes(given, rows, length)
        with router.capture() as used, replaying(router, given):
            hidden = self.decoder(attention_mask=mask, position_ids=positions, use_cache=False, **inputs)
        if self._context is not None:
            used = self._context.whole_routes(used, rows, length)
        assert pass_index is not None, "an MoE stage's run numbers its micro-batches"
        captured = self._run.captured.setdefault(int(pass_index[0]), {})
        differs = used.differs or [None] * len(used.layers)
        for position, indices, differ in zip(self.route_layers, used.layers, differs, strict=True):
            captured[position] = (indices.cpu(), None if differ is None else differ.cpu())
        return hidden.last_hidden_state, used


@dataclass(frozen=True, slots=True)
class _Batch:
    """An optimizer step's micro-batches stacked for a schedule: each padded to ``rows`` x ``length``, and
    ``passes`` of them in all (the real ones first)."""

    rows: int
    length: int
    passes: int
    tensors: dict[str, torch.Tensor]
    """input_ids, attention_mask, position_ids, target_mask: ``[passes x rows, ...]``."""

    def kwargs(self) -> dict[str, Any]:
        """The tensors as the stages' keyword arguments (the schedule splits them by micro-batch)."""
        return dict(self.tensors)


class PipelineParallel:
    """This rank's stages of ``model`` (pruned in place to their layers) and the schedules that run them.

    ``mesh``: the whole device mesh (its ``pp`` axis is the pipeline); ``boundary_dtype``: the dtype of the hidden
    states between stages (the compute dtype: bfloat16 under bf16 mixed precision); ``context``: context or
    sequence parallelism (`context_parallel`); ``vocab``: this rank's vocabulary slice with tensor parallelism;
    ``routes``: an MoE model's stages capture and replay expert routes (`routers`; in float32 with
    ``router_float32``)."""

    def __init__(
        self,
        model: PreTrainedModel,
        mesh: DeviceMesh,
        layout: ParallelLayout,
        *,
        device: torch.device,
        boundary_dtype: torch.dtype,
        logits_chunk_tokens: int,
        context: ContextParallel | None = None,
        vocab: VocabShard | None = None,
        routes: bool = False,
        router_float32: bool = False,
    ) -> None:
        pp_mesh = mesh["pp"]
        self.layout = layout
        self.device = device
        self.group = pp_mesh.get_group()
        self.pp_rank, self.pp = pp_mesh.get_local_rank(), pp_mesh.size()
        self.boundary_dtype = boundary_dtype
        self.context = context
        self.run = _Run(logits_chunk_tokens=logits_chunk_tokens)
        decoder = model.get_decoder()
        layers = cast(nn.ModuleList, decoder.layers)
        config = model.config
        self.hidden_size = int(getattr(config, "hidden_size"))  # noqa: B009 (a decoder config's)
        num_stages = layout.num_stages
        self.stage_ids = [self.pp_rank + k * self.pp for k in range(layout.pp_stages_per_rank)]
        ranges = stage_layers(len(layers), num_stages)
        self.layer_stage = {i: stage for stage, span in enumerate(ranges) for i in span}
        embeddings = cast(nn.Module, model.get_input_embeddings())
        lm_head = cast(nn.Module, model.get_output_embeddings())
        self.is_tied = lm_head.weight is embeddings.weight
        # every weight's HF name, global shape and dtype, before pruning: weight sync receives the others' weights
        self._specs = {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}
        self._embedding_name = next(n for n, m in model.named_modules() if m is embeddings) + ".weight"
        moe_layers = [i for i, layer in enumerate(layers) if is_moe_model(cast(nn.Module, layer))]
        first_moe = cast(nn.Module, layers[moe_layers[0]]) if moe_layers else nn.Module()
        routers = [m for m in first_moe.modules() if type(m).__name__.endswith(("TopKRouter", "TopkRouter"))]
        owned = {i for stage in self.stage_ids for i in ranges[stage]}
        self.owned_layers = [cast(nn.Module, layers[i]) for i in sorted(owned)]
        has_first, has_last = 0 in self.stage_ids, num_stages - 1 in self.stage_ids
        norm = cast(nn.Module, decoder.norm)
        self.stages: list[_Stage] = []
        for stage in self.stage_ids:
            view = copy.copy(decoder)  # the decoder's forward over this stage's layers
            view._modules = dict(decoder._modules)
            view.layers = nn.ModuleList(
                [cast(nn.Module, layer) if i in ranges[stage] else _Skip() for i, layer in enumerate(layers)]
            )
            is_first, is_last = stage == 0, stage == num_stages - 1
            setattr(view, "embed_tokens", embeddings if is_first else None)  # noqa: B010 (None unregisters it)
            view.norm = norm if is_last else nn.Identity()
            self.stages.append(
                _Stage(
                    view,
                    lm_head if is_last else None,
                    run=self.run,
                    is_first=is_first,
                    context=context,
                    vocab=vocab if is_last else None,
                )
            )
        self.routers: PipelineRouters | None = None
        """An MoE model's routers on this rank's stages (``routes``)."""
        if routes:
            if not moe_layers:
                raise RoutingError("routing replay needs a Mixture-of-Experts model: this one has no expert router")
            router = cast(Any, routers[0])
            for stage, module in zip(self.stage_ids, self.stages, strict=True):
                module.route_layers = [moe_layers.index(i) for i in ranges[stage] if i in moe_layers]
                module.num_route_layers = len(moe_layers)
                if module.route_layers:
                    module.router = RouterReplay(module.decoder, name=f"pipeline stage {stage}", float32=router_float32)
            self.routers = PipelineRouters(
                [(m.router, m.route_layers) for m in self.stages if m.router is not None],
                num_layers=len(moe_layers),
                top_k=int(router.top_k),
                num_experts=int(router.weight.shape[0]),
            )
        # prune the model itself to what this rank holds, so that its state dict has this rank's weights only
        for i in range(len(layers)):
            if i not in owned:
                layers[i] = _Skip()
        if not has_first:
            setattr(decoder, "embed_tokens", None)  # noqa: B010 (None unregisters the module)
        if not has_last:
            decoder.norm = nn.Identity()
            setattr(model, "lm_head", None)  # noqa: B010
        self._tied_group = self._tied_groups(mesh) if self.is_tied else None
        self.last_rank = dist.get_global_rank(self.group, (num_stages - 1) % self.pp)

    def _tied_groups(self, mesh: DeviceMesh) -> dist.ProcessGroup | None:
        """The group of this rank's first- and last-stage ranks (which hold the two copies of a tied embedding), or
        None on the ranks between; every rank creates every such group, in the same order (collective)."""
        ranks = mesh.mesh.movedim(0, -1).reshape(-1, self.pp)  # each row: one pipeline's ranks, by stage rank
        last = (self.layout.num_stages - 1) % self.pp
        mine = None
        for row in ranks.tolist():
            group = cast(dist.ProcessGroup, dist.new_group([row[0], row[last]]))
            if dist.get_rank() in (row[0], row[last]):
                mine = group
        return mine

    # -- the schedule ----------------------------------------------------------------------------------------------

    def train(
        self,
        inputs: Sequence[ScoreInputs],
        loss: MicroBatchLoss,
        *,
        temperature: float,
        with_entropy: bool,
        entropy_requires_grad: bool,
        sampling_mask: SamplingMask | None = None,
    ) -> list[Routes] | None:
        """Forward and backward of ``inputs`` through the schedule; ``loss(index, scores)`` runs on the last stage,
        in micro-batch order. Gradients accumulate on every stage (collective over the pipeline). Returns an MoE's
        routes of each of ``inputs`` (`routers`; the loss got none), else None."""
        batch = self._stack(inputs)
        self._set_run(
            inputs,
            temperature=temperature,
            sampling_mask=sampling_mask,
            with_entropy=with_entropy,
            entropy_requires_grad=entropy_requires_grad,
        )

        def schedule_loss(output: torch.Tensor | tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
            index = int(target[0])
            logprobs, entropy = output if isinstance(output, tuple) else (output, None)
            if index >= len(inputs):  # a pass that only fills the schedule
                return logprobs.sum() * 0.0
            rows, length = inputs[index].input_ids.shape
            scores = TokenScores(
                logprobs=logprobs[:rows, : length - 1],
                entropy=None if entropy is None else entropy[:rows, : length - 1],
            )
            return loss(index, scores)

        schedule = self._schedule(batch, loss=schedule_loss)
        target = torch.arange(batch.passes, device=self.device).repeat_interleave(batch.rows)
        schedule.step(batch.tensors["input_ids"], target=target, return_outputs=False, **batch.kwargs())
        return self._gathered_routes(inputs, batch)

    def score(
        self, inputs: Sequence[ScoreInputs], *, temperature: float, sampling_mask: SamplingMask | None = None
    ) -> list[TokenScores]:
        """The logprobs of each of ``inputs`` (forward only), computed on the last stage and broadcast to every
        stage (collective over the pipeline)."""
        batch = self._stack(inputs)
        self._set_run(inputs, temperature=temperature, sampling_mask=sampling_mask, with_entropy=False)
        schedule = self._schedule(batch, loss=None)
        merged = schedule.eval(batch.tensors["input_ids"], **batch.kwargs())
        if merged is None:
            merged = torch.empty(batch.passes * batch.rows, batch.length - 1, device=self.device)
        merged = merged.contiguous()
        dist.broadcast(merged, src=self.last_rank, group=self.group)
        routes = self._gathered_routes(inputs, batch)
        scores = []
        for index, item in enumerate(inputs):
            rows, length = item.input_ids.shape
            start = index * batch.rows
            logprobs = merged[start : start + rows, : length - 1]
            scores.append(
                TokenScores(logprobs=logprobs, entropy=None, routes=None if routes is None else routes[index])
            )
        return scores

    def _gathered_routes(self, inputs: Sequence[ScoreInputs], batch: _Batch) -> list[Routes] | None:
        """Each of ``inputs``' routes over its own rows and every MoE layer, from the stages that ran them
        (collective over the pipeline); None without `routers`."""
        captured, self.run.captured = self.run.captured, {}
        if self.routers is None:
            return None
        padded = (batch.rows, batch.length)
        return self.routers.gathered(captured, inputs, padded=padded, group=self.group, device=self.device)

    def _set_run(
        self,
        inputs: Sequence[ScoreInputs],
        *,
        temperature: float,
        with_entropy: bool,
        entropy_requires_grad: bool = False,
        sampling_mask: SamplingMask | None = None,
    ) -> None:
        """What every stage needs to know about the run about to start (`_Run`)."""
        packed = inputs[0].position_ids is not None
        if any((item.position_ids is not None) != packed for item in inputs):
            raise ValueError("a pipeline runs packed or right-padded micro-batches, not both in one step")
        self.run.temperature = temperature
        self.run.sampling_mask = sampling_mask
        self.run.with_entropy = with_entropy
        self.run.entropy_requires_grad = entropy_requires_grad
        self.run.packed = packed

    def _stack(self, inputs: Sequence[ScoreInputs]) -> _Batch:
        """``inputs`` padded to one shape and stacked, with filler passes up to a multiple of the schedule's
        stages."""
        if not inputs:
            raise ValueError("a pipeline step needs one micro-batch at least")
        if any(item.images for item in inputs):
            raise ValueError("pipeline parallelism runs text rows only")
        rows = max(item.input_ids.shape[0] for item in inputs)
        length = max(item.input_ids.shape[1] for item in inputs)
        unit = self.pp * self.layout.pp_stages_per_rank
        passes = math.ceil(len(inputs) / unit) * unit
        parts: dict[str, list[torch.Tensor]] = {
            "input_ids": [],
            "attention_mask": [],
            "position_ids": [],
            "target_mask": [],
            "pass_index": [],
        }
        routed = self.routers is not None and any(item.routes is not None for item in inputs)
        if routed:
            parts["routes"] = []
        balanced = self.routers is not None and any(item.balance_weight > 0 for item in inputs)
        if balanced:
            parts["balance"], parts["real_tokens"] = [], []
        for index in range(passes):
            item = inputs[index] if index < len(inputs) else inputs[0]
            for name, tensor in _padded(item, rows=rows, length=length).items():
                parts[name].append(tensor)
            parts["pass_index"].append(torch.full((rows,), index, dtype=torch.long))
            if routed:
                assert self.routers is not None
                parts["routes"].append(self.routers.padded(item, rows=rows, length=length))
            if balanced:  # a filler pass adds none
                weighted = item if index < len(inputs) else replace(item, balance_weight=0.0)
                for name, tensor in balance_inputs(weighted, rows=rows, length=length).items():
                    parts[name].append(tensor)
        tensors = {name: torch.cat(values).to(self.device) for name, values in parts.items()}
        return _Batch(rows=rows, length=length, passes=passes, tensors=tensors)

    def _schedule(
        self, batch: _Batch, *, loss: Callable[..., torch.Tensor] | None
    ) -> Schedule1F1B | ScheduleGPipe | ScheduleInterleaved1F1B:
        """A schedule for ``batch``'s shape: its stages are made anew for each shape (their buffers are)."""
        num_stages = self.layout.num_stages
        boundary = self._boundary_length(batch.length)
        stages = []
        for stage_id, module in zip(self.stage_ids, self.stages, strict=True):
            rows, length = batch.rows, batch.length
            if stage_id == 0:
                inputs = torch.empty(rows, length, dtype=torch.long, device="meta")
            else:
                inputs = torch.empty(
                    rows, boundary, self.hidden_size, dtype=self.boundary_dtype, device="meta", requires_grad=True
                )
            if stage_id < num_stages - 1:
                outputs: torch.Tensor | tuple[torch.Tensor, ...] = torch.empty(
                    rows, boundary, self.hidden_size, dtype=self.boundary_dtype, device="meta", requires_grad=True
                )
            else:
                scores = torch.empty(rows, length - 1, dtype=torch.float32, device="meta")
                outputs = (scores, scores.clone()) if self.run.with_entropy else scores
            stages.append(
                PipelineStage(
                    module,
                    stage_id,
                    num_stages,
                    self.device,
                    input_args=inputs,
                    output_args=outputs,
                    group=self.group,
                )
            )
        kind = self.layout.pp_schedule
        if kind == "interleaved_1f1b":
            return ScheduleInterleaved1F1B(list(stages), batch.passes, loss_fn=loss, scale_grads=False)
        single = ScheduleGPipe if kind == "gpipe" else Schedule1F1B
        return single(stages[0], batch.passes, loss_fn=loss, scale_grads=False)

    def _boundary_length(self, length: int) -> int:
        """The sequence length of the hidden states between stages for rows of ``length`` tokens: this rank's shard
        with sequence or context parallelism."""
        if self.context is None:
            return length
        return -(-length // (self.context.size * self.context.multiple))  # the padded rows' share

    # -- gradients and weights -------------------------------------------------------------------------------------

    @torch.no_grad()
    def sync_tied_gradients(self, model: PreTrainedModel) -> None:
        """Add the gradients of a tied embedding's two copies (first stage: the embedding; last: the LM head), so
        that AdamW moves both alike (collective over each pipeline's first and last ranks)."""
        if self._tied_group is None:
            return
        module = model.get_input_embeddings() if self.pp_rank == 0 else model.get_output_embeddings()
        grad = cast(nn.Module, module).weight.grad
        assert grad is not None, "both copies of a tied embedding have a gradient after a training pass"
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        dist.all_reduce(local, group=self._tied_group)

    def counted_in_norm(self, model: PreTrainedModel, parameter: torch.Tensor) -> bool:
        """Whether ``parameter``'s gradient counts in the global norm: a tied embedding's counts once (its first
        copy)."""
        if not self.is_tied or 0 in self.stage_ids:
            return True
        head = model.get_output_embeddings()
        return head is None or parameter is not cast(nn.Module, head).weight

    def norm_over_stages(self, local_norm: torch.Tensor) -> torch.Tensor:
        """The gradient norm of all stages from each stage's own (collective over the pipeline)."""
        squared = (local_norm.to(self.device, torch.float64) ** 2).reshape(1)
        dist.all_reduce(squared, group=self.group)
        return squared.sqrt()[0].to(local_norm.dtype)

    def named_weights(self, sharded: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight of the whole model in HF order, whole, on every rank: its stage gathers it from its shards
        (`sharded`: this rank's, keyed by HF name) and broadcasts it over the pipeline (collective)."""
        for name, (shape, dtype) in self._specs.items():
            if self.is_tied and name == "lm_head.weight":
                continue  # the embedding is sent; the engine ties the head to it
            owner = self._owner(name)
            if owner == self.pp_rank:
                tensor = sharded[name]
                tensor = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()
                tensor = tensor.contiguous()
            else:
                tensor = torch.empty(shape, dtype=dtype, device=self.device)
            dist.broadcast(tensor, src=dist.get_global_rank(self.group, owner), group=self.group)
            yield name, tensor

    def weight_shards(self, sharded: dict[str, torch.Tensor]) -> list[WeightShard]:
        """This rank's boxes of the weights its stages own (`sharded`: keyed by HF name), in the whole model's HF
        order; no collective. A tied LM head is left out: the first stage sends the embedding."""
        shards = []
        for order, name in enumerate(self._specs):
            if (self.is_tied and name == "lm_head.weight") or self._owner(name) != self.pp_rank:
                continue
            shard = weight_shard(name, order, sharded[name])
            if shard is not None:
                shards.append(shard)
        return shards

    def optimizer_names(self, state: dict[str, Any], *, saving: bool) -> dict[str, Any]:
        """``state`` (`get_state_dict`'s optimizer state) with a tied LM head's copy on the last stage named as the
        embedding (``saving``) or back (loading). A checkpoint then holds the AdamW state of a tied embedding once,
        under one name, as one process saves it: any layout resumes from it."""
        head = "lm_head.weight"
        if not self.is_tied or 0 in self.stage_ids or self._embedding_name == head:
            return state
        old, new = (head, self._embedding_name) if saving else (self._embedding_name, head)
        states = {new if name == old else name: value for name, value in state["state"].items()}
        groups = [
            {**group, "params": [new if n == old else n for n in group["params"]]} for group in state["param_groups"]
        ]
        return {**state, "state": states, "param_groups": groups}

    def _owner(self, name: str) -> int:
        """The pipeline rank that holds the weight ``name``."""
        parts = name.split(".")
        if "layers" in parts:
            index = int(parts[parts.index("layers") + 1])
            return self.layer_stage[index] % self.pp
        if name == self._embedding_name:
            return 0
        return (self.layout.num_stages - 1) % self.pp


def _padded(item: ScoreInputs, *, rows: int, length: int) -> dict[str, torch.Tensor]:
    """``item``'s tensors padded to ``rows`` x ``length``: right padding (mask 0, no targets; packed rows: the padding
    is one more sequence, positions from 0), and rows of padding tokens that attend to themselves and score nothing.
    A filler pass is a copy of a real one (its loss is 0 x its scores)."""
    ids = item.input_ids
    batch, width = ids.shape
    extra = length - width
    mask = item.attention_mask if item.attention_mask is not None else torch.ones_like(ids)
    if item.position_ids is not None:
        tail = torch.arange(extra, device=ids.device).expand(batch, extra)
        positions = torch.cat([item.position_ids, tail], dim=1)
    else:
        positions = torch.arange(length, device=ids.device).expand(batch, length)
    padded = {
        "input_ids": F.pad(ids, (0, extra), value=0),
        "attention_mask": F.pad(mask, (0, extra), value=0),
        "position_ids": positions,
        "target_mask": F.pad(item.target_mask, (0, extra), value=False),
    }
    more = rows - batch
    if more:
        fill = {
            "input_ids": torch.zeros(more, length, dtype=ids.dtype, device=ids.device),
            "attention_mask": torch.ones(more, length, dtype=mask.dtype, device=ids.device),
            "position_ids": torch.arange(length, device=ids.device).expand(more, length),
            "target_mask": torch.zeros(more, length - 1, dtype=torch.bool, device=ids.device),
        }
        padded = {name: torch.cat([tensor, fill[name]]) for name, tensor in padded.items()}
    return padded
