"""Sharded training with FSDP2: each rank holds a shard of every parameter, gradient and optimizer state, and, as a
`ParallelLayout` says, splits each layer with tensor parallelism (`tensor_parallel`, with sequence parallelism) and
each sequence with context parallelism (`context_parallel`) on one device mesh (`mesh`).

Owns the sharded model, its optimizer and their persistence, behind the methods of `SingleDeviceBackend`
(`score_tokens`, `token_logprobs`, `clip_and_step`, `named_weights`, `save`/`load`/`export`, `device`), plus the
few collectives a data-parallel trainer needs (`all_reduce_sum`, `all_reduce_max`). Every method that touches
parameters is collective: all ranks call it, in the same order, or the job hangs.

It does not start processes, split batches (`trainer.sharding`) or know what a loss is. Gradients are *summed*
over ranks (not averaged): each rank divides its loss by the whole step's normaliser, so the sum is the
single-process gradient. The reference policy and the critic are not sharded here.

Sharding: tensor parallelism first (DTensors on the ``tp`` axis), then ``fully_shard`` over ``dp_shard`` (x ``cp``;
HSDP: x ``dp_replicate``) on each decoder layer and on a root that wraps the HF model. The trainer's ``rank`` and
``num_ranks`` are the data-parallel coordinate: the ``tp`` and ``cp`` ranks of a data shard train on the same rows.
The root's forward is the whole `score_tokens` computation (decoder, then the LM head on the selected positions
only), so FSDP's root hooks run around both halves; a tied LM head is the embedding's parameter and lives in the
root's group.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from sharpen.config.schema import TrainerConfig
from sharpen.data.vision import VisionProcessor, is_vision_model, model_class
from sharpen.expert_routes import RouterReplay, Routers, Routes, is_moe_model
from sharpen.trainer.algorithms.sampling_mask import SamplingMask
from sharpen.trainer.backends.base import (
    PROCESSOR_FILES,
    MicroBatchLoss,
    ScoreInputs,
    ScoresTokenLogprobs,
    TokenScores,
    checkpointing_kwargs,
    replay_routes_of,
)
from sharpen.trainer.backends.context_parallel import ContextParallel
from sharpen.trainer.backends.cpu_memory import FreedMemory
from sharpen.trainer.backends.expert_parallel import apply_expert_parallel, expert_modules
from sharpen.trainer.backends.lora import adapter_state_dict, apply_lora, export_merged, merged_target_weights
from sharpen.trainer.backends.mesh import build_device_mesh, data_meshes, expert_meshes, rank_device, weight_shard
from sharpen.trainer.backends.pipeline_parallel import PipelineParallel
from sharpen.trainer.backends.scoring import autocast_to, rows_image_inputs, score_tokens
from sharpen.trainer.backends.tensor_parallel import apply_tensor_parallel
from sharpen.trainer.backends.vocab_parallel import VocabShard
from sharpen.trainer.layout import ModelShape, ParallelLayout
from sharpen.trainer.optim import build_adamw, mesh_groups
from sharpen.trainer.precision import (
    LossScaler,
    PrecisionChoice,
    keep_lm_head_float32,
    loss_scaler_for,
    resolve_precision,
)
from sharpen.types import ImagePart
from sharpen.weight_files import write_safetensors
from sharpen.weight_shards import WeightShard

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel


class _ScoringRoot(nn.Module):
    """The FSDP root. Its forward is `score_tokens`, which calls the decoder and the LM head separately: as the
    root's forward, FSDP unshards the embedding, final norm and LM head before it and registers the gradient
    reduction after it. Outputs are a tuple (FSDP hooks the backward through tensors in pytrees, not dataclasses)."""

    def __init__(self, model: PreTrainedModel, *, is_vision_model: bool = False) -> None:
        super().__init__()
        self.model = model
        decoder = model.get_decoder()
        # a vision-language model's image side (vision tower, connector): the base model's other children
        self.image_side = [c for c in model.base_model.children() if c is not decoder] if is_vision_model else []

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        target_mask: torch.Tensor,
        temperature: float,
        with_entropy: bool,
        entropy_requires_grad: bool,
        position_ids: torch.Tensor | None,
        logits_chunk_tokens: int,
        image_inputs: dict[str, torch.Tensor] | None,
        vocab: VocabShard | None,
        context: ContextParallel | None,
        sampling_mask: SamplingMask | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        scores = score_tokens(
            self.model,
            input_ids,
            attention_mask,
            target_mask,
            temperature=temperature,
            with_entropy=with_entropy,
            entropy_requires_grad=entropy_requires_grad,
            position_ids=position_ids,
            logits_chunk_tokens=logits_chunk_tokens,
            image_inputs=image_inputs,
            vocab=vocab,
            context=context,
            sampling_mask=sampling_mask,
        )
        logprobs = scores.logprobs
        if image_inputs is None and self.image_side:
            # Rows without images leave the image side unused, and the root's gradient reduction takes the
            # parameters that have a gradient: ranks whose rows differ would reduce different sets (a hang). A zero
            # term gives every image-side parameter a (zero) gradient on every rank.
            anchor = sum(p.sum() for module in self.image_side for p in module.parameters() if p.requires_grad)
            logprobs = logprobs + 0.0 * anchor
        return logprobs, scores.entropy


def _agreed_precision(choice: PrecisionChoice, device: torch.device) -> PrecisionChoice:
    """Every rank's probe decides alone, and a noisy one may differ: bf16 only when every rank chose it (collective).
    An explicit trainer.precision is the same on every rank already."""
    if choice.requested != "auto":
        return choice
    votes = torch.tensor([int(choice.is_bf16)], device=device)
    dist.all_reduce(votes, op=dist.ReduceOp.MIN)
    if choice.is_bf16 and not votes.item():
        return dataclasses.replace(choice, precision="float32", reason=f"{choice.reason}; another rank chose float32")
    return choice


class FSDP2Backend(ScoresTokenLogprobs):
    """One rank of an FSDP2-sharded policy. Build it on every rank after `init_distributed`; ``layout``: how the ranks
    split the model (default: every rank of the process group a data shard), checked against the model first.

    Every rank reads the full HF checkpoint onto the CPU (after ``torch.manual_seed(seed)``, so any weight the
    checkpoint lacks is the same everywhere), then ``fully_shard`` keeps only this rank's slice on ``device``. Host
    memory thus holds one full copy per rank of a node while the model is sharded; a model too large for that
    needs loading on rank 0 alone and broadcasting the shards (``set_model_state_dict`` with
    ``broadcast_from_rank0``), which this backend does not do yet. Mixed precision: with ``config.precision``
    resolved to bf16 (the ranks agree: "auto" is bf16 only where every rank chose it) the unsharded (computing)
    parameters are bfloat16 while the sharded master weights and AdamW state keep ``dtype``; gradients are reduced
    in float32. Because the compute dtype is fixed when the
    model is sharded, ``use_autocast=False`` still computes with bfloat16 parameters (then only autocast's
    float32 ops are turned off): a weight-sync probe under bf16 needs a bf16-sized tolerance.
    """

    def __init__(
        self,
        config: TrainerConfig,
        *,
        model_path: Path,
        dtype: str,
        layout: ParallelLayout | None = None,
        seed: int = 0,
    ) -> None:

        if not dist.is_initialized():
            raise ValueError("FSDP2Backend needs a process group: call init_distributed() on every rank first")
        torch.set_num_threads(config.resolved_num_threads)
        self.config = config
        self.model_path = Path(model_path)
        self.device = rank_device(config.device)
        # a process-wide setting of the C library (`cpu_memory`), bounded after every optimizer step
        self.freed_memory = FreedMemory.keep(config.reuse_cpu_memory_mb) if self.device.type == "cpu" else None
        expected = "nccl" if self.device.type == "cuda" else "gloo"
        if dist.get_backend() != expected:
            raise ValueError(f"device {self.device} needs a {expected} process group, not {dist.get_backend()}")
        self.layout = layout or ParallelLayout(dp_shard=dist.get_world_size())
        _check_layout(self.layout, self.model_path, config=config)
        self.precision: PrecisionChoice = _agreed_precision(
            resolve_precision(config.precision, self.device, num_threads=config.resolved_num_threads), self.device
        )
        mesh = build_device_mesh(self.layout, device_type=self.device.type)
        fsdp_mesh, data_mesh = data_meshes(mesh, self.layout)
        self._group = data_mesh.get_group()  # the data-parallel ranks: metrics and lockstep counts are summed here
        self.rank, self.num_ranks = data_mesh.get_local_rank(), data_mesh.size()
        self.is_writer = dist.get_rank() == 0  # tensor- and context-parallel ranks share a data shard: one writes
        torch.manual_seed(seed)
        self.model: PreTrainedModel = model_class(self.model_path).from_pretrained(
            self.model_path, dtype=getattr(torch, dtype)
        )
        self.vision = VisionProcessor.from_pretrained(self.model_path) if is_vision_model(self.model_path) else None
        """A vision-language model's image processor (rows with images); None for a text-only model."""
        self.model.config.use_cache = False
        if config.lm_head_float32:  # before sharding: FSDP2 subclasses the module's class
            keep_lm_head_float32(self.model)
        self.loss_scaler: LossScaler | None = loss_scaler_for(self.precision)
        """fp16's dynamic loss scale (`train_micro_batches` scales, `clip_and_step` unscales); None otherwise."""
        self.router: RouterReplay | None = None
        """A Mixture-of-Experts policy's `RouterReplay` (``trainer.moe``) without a pipeline (whose stages have
        theirs: `routers`)."""
        if self.layout.pp == 1:  # every layout runs routes (context and pipeline together are refused above)
            self.router = replay_routes_of(self.model, config, name=str(self.model_path))
        elif config.moe.routing_replay != "none" and not is_moe_model(self.model):
            RouterReplay(self.model, name=str(self.model_path))  # raises: a dense model, or routers it cannot replay
        self.lora: PeftModel | None = None  # the adapters' wrapper when trainer.lora.enabled, injected before sharding
        if config.lora.enabled:
            self.lora = apply_lora(self.model, config.lora)
        self.vocab_shard: VocabShard | None = None
        """Tensor parallelism (tp > 1): this rank's slice of the LM head's vocabulary."""
        sequence_parallel = self.layout.tp > 1 and config.parallel.sequence_parallel
        if self.layout.tp > 1:
            self.vocab_shard = apply_tensor_parallel(
                self.model,
                mesh["tp"],
                plan=config.parallel.tp_plan,
                sequence_parallel=sequence_parallel,
                experts=self.layout.ep == 1,  # else split over ep x tp below
            )
        experts_fsdp_mesh = None
        """Expert parallelism (ep > 1): the mesh FSDP2 shards each rank's experts over (`mesh.expert_meshes`)."""
        if self.layout.ep > 1:
            ep_mesh, experts_fsdp_mesh = expert_meshes(mesh, fsdp_mesh, self.layout)
            apply_expert_parallel(self.model, ep_mesh)
        self.context_parallel: ContextParallel | None = None
        """Context parallelism (cp > 1): this rank's slice of every row's sequence (Ulysses attention); with
        sequence parallelism alone, the whole rows' attention mask."""
        if self.layout.cp > 1 or sequence_parallel:
            cp_mesh = mesh["cp"]
            group = cp_mesh.get_group() if self.layout.cp > 1 else None
            self.context_parallel = ContextParallel(
                group, cp_mesh.get_local_rank(), cp_mesh.size(), multiple=self.layout.tp if sequence_parallel else 1
            )
            self.context_parallel.attach(self.model)
        self.route_view = self.context_parallel
        """Context parallelism: each rank's routers route its slice of every row; sequence parallelism alone: the
        rows padded to a multiple of tp (`base.RouteView`)."""
        if config.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing_kwargs(self.model))
        self.model.train()
        policy = MixedPrecisionPolicy(param_dtype=self.precision.autocast_dtype, reduce_dtype=torch.float32)
        self.pipeline: PipelineParallel | None = None
        """Pipeline parallelism (pp > 1): this rank's stages, and the schedule that runs them."""
        layers = cast(nn.ModuleList, self.model.get_decoder().layers)
        if self.layout.pp > 1:  # this rank keeps its stages' layers; each stage is an FSDP root
            self.pipeline = PipelineParallel(
                self.model,
                mesh,
                self.layout,
                device=self.device,
                boundary_dtype=torch.bfloat16 if self.precision.is_bf16 else getattr(torch, dtype),
                logits_chunk_tokens=config.logits_chunk_tokens,
                context=self.context_parallel,
                vocab=self.vocab_shard,
                routes=is_moe_model(self.model),
                router_float32=config.moe.router_float32,
            )
            layers, roots = self.pipeline.owned_layers, list(self.pipeline.stages)
        else:
            self._root = _ScoringRoot(self.model, is_vision_model=self.vision is not None)
            roots = [self._root]
        for layer in layers:
            if experts_fsdp_mesh is not None:  # a layer's experts: over the ranks that hold the same experts
                for experts in expert_modules(layer):
                    fully_shard(experts, mesh=experts_fsdp_mesh, mp_policy=policy)
            fully_shard(layer, mesh=fsdp_mesh, mp_policy=policy)
        self._fsdp_roots = [cast(FSDPModule, fully_shard(root, mesh=fsdp_mesh, mp_policy=policy)) for root in roots]
        for root in self._fsdp_roots:
            for module in cast(nn.Module, root).modules():
                if isinstance(module, FSDPModule):
                    # Sum, not mean: each rank's loss is already divided by the whole step's normaliser. Forcing
                    # plain SUM also avoids PREMUL_SUM, which gloo lacks.
                    module.set_gradient_divide_factor(1.0)
                    module.set_force_sum_reduction_for_comms(True)
        self.optimizer = build_adamw(
            (p for p in self.model.parameters() if p.requires_grad),  # all, or the LoRA adapters alone
            learning_rate=config.learning_rate,
            betas=config.betas,
            weight_decay=config.weight_decay,
        )

    def score_tokens(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        target_mask: torch.Tensor,
        *,
        temperature: float,
        use_autocast: bool = True,
        with_entropy: bool = False,
        entropy_requires_grad: bool = False,
        position_ids: torch.Tensor | None = None,
        prompt_lengths: Sequence[int] | None = None,
        images: Sequence[tuple[ImagePart, ...]] = (),
        sampling_mask: SamplingMask | None = None,
    ) -> TokenScores:
        """This rank's rows only; collective (every rank must call it, also with a zero-weighted filler batch).
        ``prompt_lengths`` is ignored: shared prompts are computed once on the single-device backend only (the
        sharded root's forward takes whole rows). Rows with ``images`` (one tuple per row) run with their pixel
        inputs, as on one device."""
        if position_ids is not None and any(images):
            raise ValueError("rows with images cannot be packed (trainer.packing = false for image prompts)")
        if self.pipeline is not None:
            if torch.is_grad_enabled() or with_entropy:
                raise ValueError(
                    "with pipeline parallelism, scores with gradients or entropy come from train_micro_batches only"
                )
            inputs = ScoreInputs(
                input_ids=input_ids, attention_mask=attention_mask, target_mask=target_mask, position_ids=position_ids
            )
            return self.score_micro_batches(
                [inputs], temperature=temperature, use_autocast=use_autocast, sampling_mask=sampling_mask
            )[0]
        image_inputs = rows_image_inputs(self.vision, input_ids, images, model=str(self.model_path))
        with autocast_to(self.device, self.precision.autocast_dtype if use_autocast else None):
            logprobs, entropy = self._root(
                input_ids,
                attention_mask,
                target_mask,
                temperature,
                with_entropy,
                entropy_requires_grad,
                position_ids,
                self.config.logits_chunk_tokens,
                image_inputs,
                self.vocab_shard,
                self.context_parallel,
                sampling_mask,
            )
        return TokenScores(logprobs=logprobs, entropy=entropy)

    @property
    def routers(self) -> Routers | None:
        """The policy's routers as the trainer needs them (`expert_routes.Routers`): the pipeline stages' together,
        or `router`."""
        if self.pipeline is not None:
            return self.pipeline.routers
        return self.router

    def train_micro_batches(
        self,
        inputs: Sequence[ScoreInputs],
        loss: MicroBatchLoss,
        *,
        temperature: float,
        with_entropy: bool = False,
        entropy_requires_grad: bool = False,
        sampling_mask: SamplingMask | None = None,
    ) -> list[Routes] | None:
        """Each micro-batch in turn (`ScoresTokenLogprobs`), or all of them through the pipeline's schedule (an
        MoE's routes returned after)."""
        if self.pipeline is None:
            return super().train_micro_batches(
                inputs,
                loss,
                temperature=temperature,
                with_entropy=with_entropy,
                entropy_requires_grad=entropy_requires_grad,
                sampling_mask=sampling_mask,
            )
        with autocast_to(self.device, self.precision.autocast_dtype):
            return self.pipeline.train(
                inputs,
                loss,
                temperature=temperature,
                with_entropy=with_entropy,
                entropy_requires_grad=entropy_requires_grad,
                sampling_mask=sampling_mask,
            )

    def score_micro_batches(
        self,
        inputs: Sequence[ScoreInputs],
        *,
        temperature: float,
        use_autocast: bool = True,
        sampling_mask: SamplingMask | None = None,
    ) -> list[TokenScores]:
        if self.pipeline is None:
            return super().score_micro_batches(
                inputs, temperature=temperature, use_autocast=use_autocast, sampling_mask=sampling_mask
            )
        with torch.no_grad(), autocast_to(self.device, self.precision.autocast_dtype if use_autocast else None):
            return self.pipeline.score(inputs, temperature=temperature, sampling_mask=sampling_mask)

    def share_loss_sums(self, sums: dict[str, float]) -> dict[str, float]:
        """The last pipeline stage's metric sums on every stage (collective over the pipeline)."""
        if self.pipeline is None:
            return sums
        shared: list[dict[str, float] | None] = [sums]
        dist.broadcast_object_list(shared, src=self.pipeline.last_rank, group=self.pipeline.group)
        return dict(shared[0] or {})

    def clip_and_step(self, *, skip_above: float = math.inf) -> float:
        """Clip to the global gradient norm (over all shards, and all pipeline stages), step, clear gradients;
        returns the pre-clip norm. A norm that is not finite or is above ``skip_above`` skips the step."""
        pipeline = self.pipeline
        if pipeline is not None:
            pipeline.sync_tied_gradients(self.model)
        parameters = [p for p in self.model.parameters() if p.grad is not None]
        counted = [p for p in parameters if pipeline is None or pipeline.counted_in_norm(self.model, p)]
        if self.loss_scaler is not None:  # this rank's shards; the global norm below decides for every rank
            self.loss_scaler.unscale_([p.grad for p in parameters if p.grad is not None])
        total_norm = _global_grad_norm([p.grad for p in counted if p.grad is not None])
        if pipeline is not None:
            total_norm = pipeline.norm_over_stages(total_norm)
        is_finite = bool(torch.isfinite(total_norm))
        if self.loss_scaler is not None:
            self.loss_scaler.update(is_finite=is_finite)
        if is_finite and float(total_norm) <= skip_above:  # the global norm: ranks skip together
            # one call cannot take DTensors of two meshes (expert parallelism's experts beside the rest)
            for group in mesh_groups(list[torch.Tensor](parameters)):
                torch.nn.utils.clip_grads_with_norm_(group, self.config.max_grad_norm, total_norm)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.freed_memory is not None:
            self.freed_memory.bound()
        return float(total_norm)

    def all_reduce_sum(self, values: dict[str, float]) -> dict[str, float]:
        """Each name's sum over the ranks (a name a rank lacks counts 0 there); collective. The single-device
        backend's version returns ``values``."""
        names_per_rank: list[list[str] | None] = [None] * self.num_ranks
        dist.all_gather_object(names_per_rank, sorted(values), group=self._group)
        names = sorted({name for names in names_per_rank for name in names or ()})
        summed = torch.tensor([values.get(name, 0.0) for name in names], dtype=torch.float64, device=self.device)
        dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=self._group)
        return dict(zip(names, summed.tolist(), strict=True))

    def all_reduce_max(self, value: int) -> int:
        """The largest ``value`` over the ranks (e.g. the number of micro-batches every rank must run); collective."""
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self._group)
        return int(tensor.item())

    @torch.no_grad()
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors in HF naming, one at a time, gathered from the shards; collective (every rank must consume
        the whole iterator in step). Every rank receives each tensor; only rank 0 needs to keep them (an engine
        sender), the others drop each one, so no rank holds more than one gathered tensor beyond what it keeps.

        A tied output embedding is left out, as in `SingleDeviceBackend.named_weights`; with LoRA, the merged target
        weights only, gathered the same way, or the adapter tensors alone with ``trainer.lora.sync = "adapter"``."""
        if self.lora is not None:
            self._reshard()
            if self.config.lora.syncs_adapter:
                yield from adapter_state_dict(self.lora, full=_full_tensor).items()
            else:
                yield from merged_target_weights(self.lora, full=_full_tensor)
            return
        if self.pipeline is not None:  # each stage's weights, broadcast from it to the others
            self._reshard()
            yield from self.pipeline.named_weights(self.model.state_dict())
            return
        for name, tensor in self._sharded_weights().items():
            yield name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()

    @torch.no_grad()
    def weight_shards(self) -> list[WeightShard]:
        """This rank's boxes of the weights `named_weights` gathers (its FSDP2 and tensor-parallel shards, its pipeline
        stages' weights), as host copies, with no collective: the direct weight sync, whose receiver assembles them
        (`sharpen.weight_shards.assemble_weights`). A replicated box is sent by one rank (`mesh.weight_shard`)."""
        if self.lora is not None:
            raise ValueError(
                'the direct weight sync (weight_sync.assemble = "receiver") sends the base weights, not LoRA\'s '
                'merged or adapter weights: use weight_sync.assemble = "trainer"'
            )
        weights = self._sharded_weights()
        if self.pipeline is not None:
            return self.pipeline.weight_shards(weights)
        # a plain tensor (a buffer FSDP2 does not shard, such as DeepSeek-V3's expert bias) is on every rank: rank 0
        # sends it
        shards = (
            weight_shard(name, order, tensor)
            for order, (name, tensor) in enumerate(weights.items())
            if isinstance(tensor, DTensor) or self.is_writer
        )
        return [shard for shard in shards if shard is not None]

    def _reshard(self) -> None:
        # After a forward without backward a root still holds its gathered (compute-dtype) parameters; free them
        # (FSDP's state-dict hook would return the shards either way).
        for root in self._fsdp_roots:
            root.reshard()

    def _sharded_weights(self) -> dict[str, torch.Tensor]:
        """The HF-named state dict as this rank's DTensor shards (no copies), without a tied ``lm_head.weight``."""
        self._reshard()
        is_tied = getattr(self.model.config, "tie_word_embeddings", False)
        return {name: t for name, t in self.model.state_dict().items() if not (is_tied and name == "lm_head.weight")}

    def save(self, folder: Path) -> None:
        """A sharded checkpoint (model and AdamW state, each rank writing its shards) with torch.distributed.checkpoint.
        ``folder`` must be one path every rank can write to (a shared filesystem across nodes); collective."""
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.checkpoint.state_dict_saver import save

        self._reshard()
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        if self.pipeline is not None:
            optimizer_state = self.pipeline.optimizer_names(cast(dict, optimizer_state), saving=True)
        save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=Path(folder))
        if self.loss_scaler is not None and dist.get_rank() == 0:  # the same on every rank (`LossScaler`)
            self.loss_scaler.save(Path(folder))

    def load(self, folder: Path) -> None:
        """Resume from `save`'s folder (the same number of ranks or another: DCP reshards); collective."""
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        from torch.distributed.checkpoint.state_dict_loader import load

        self._reshard()
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        if self.pipeline is not None:
            optimizer_state = self.pipeline.optimizer_names(cast(dict, optimizer_state), saving=True)
        state = {"model": model_state, "optimizer": optimizer_state}
        load(state, checkpoint_id=Path(folder))
        if self.pipeline is not None:
            state["optimizer"] = self.pipeline.optimizer_names(state["optimizer"], saving=False)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        if self.loss_scaler is not None:
            self.loss_scaler.load(Path(folder))

    def export(self, folder: Path, *, max_shard_bytes: int = 5 * 2**30) -> None:
        """A HF folder (config, safetensors, tokenizer) that transformers and vLLM load, written by rank 0 alone
        from the gathered weights, one safetensors shard (at most ``max_shard_bytes``) in memory at a time;
        collective. Several shards get HF's ``model.safetensors.index.json`` (`weight_files.write_safetensors`)."""
        folder = Path(folder)
        is_writer = self.is_writer
        if self.lora is not None:  # the merged model and the adapter (`lora.export_merged`), in one piece
            self._reshard()
            export_merged(self.lora, folder, full=_full_tensor, is_writer=is_writer)
        else:
            weights = self.named_weights()  # every rank gathers each weight in step; rank 0 writes them
            if is_writer:
                write_safetensors(weights, folder, max_shard_bytes=max_shard_bytes)
            else:
                for _ in weights:
                    pass
        if is_writer:
            self._write_metadata(folder)
        dist.barrier(group=self._group)  # the folder is complete when any rank returns

    def _write_metadata(self, folder: Path) -> None:
        self.model.config.save_pretrained(folder)
        for name in (*PROCESSOR_FILES, "generation_config.json"):
            if (self.model_path / name).is_file():
                shutil.copy2(self.model_path / name, folder / name)


def _global_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all the gradients together, reduced over the ranks that hold their shards (collective). With
    tensor parallelism, gradients live on different meshes (FSDP's alone, or FSDP's x tp) and placements; the norm
    of each such group is reduced on its own mesh, then the groups' norms are combined."""
    groups: dict[object, list[torch.Tensor]] = {}
    for grad in grads:
        key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None
        groups.setdefault(key, []).append(grad)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack(norms))


def _check_layout(layout: ParallelLayout, model_path: Path, *, config: TrainerConfig) -> None:
    """Refuse, in one line, a layout that this backend does not run or that the model's sizes do not fit."""
    layout.check_built()
    layout.check_features(
        lora=config.lora.enabled, vision=is_vision_model(model_path), distillation=config.distillation.enabled
    )
    layout.check(world_size=dist.get_world_size(), model=ModelShape.from_model_folder(model_path))


def _full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter as one whole tensor: gathered from the ranks' shards (collective) when it is a DTensor."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
