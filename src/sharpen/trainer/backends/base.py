"""The `TrainerBackend` contract: what the `Trainer` needs from wherever the parameters live.

Owns the protocol, the data it returns (`TokenScores`) and what `export` copies beside the weights
(`PROCESSOR_FILES`). `SingleDeviceBackend` (one process) and `FSDP2Backend` (one process per rank, sharded)
implement it and import it from here, never the other way round; on one device the data-parallel collectives are
identities.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from sharpen.config.schema import TrainerConfig
from sharpen.expert_routes import RouterReplay, Routers, Routes, checkpoint_contexts, is_moe_model
from sharpen.trainer.algorithms.sampling_mask import SamplingMask
from sharpen.types import ImagePart
from sharpen.weight_shards import WeightShard

PROCESSOR_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "preprocessor_config.json",
    "processor_config.json",
)
"""What `export` copies beside the weights: the tokenizer, and a vision-language model's image processor (and its
processor's settings, e.g. Idefics3's tokens per image)."""


@dataclass(kw_only=True, slots=True)
class TokenScores:
    logprobs: torch.Tensor  # [batch, seq - 1] float32, 0 outside the target mask
    entropy: torch.Tensor | None  # [batch, seq - 1] float32 (when asked for), 0 outside the target mask
    routes: Routes | None = None
    """A Mixture-of-Experts policy under routing replay (``trainer.moe``): the experts every input token went to, as
    the backend's forward flattened them (`Routes`; replayed ones with their ``differs``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ScoreInputs:
    """One micro-batch's model inputs, as `TrainerBackend.score_tokens` takes them: right-padded rows with their
    ``attention_mask``, or packed rows with ``position_ids`` and no attention mask."""

    input_ids: torch.Tensor  # [batch, seq]
    attention_mask: torch.Tensor | None  # [batch, seq]; None for packed rows
    target_mask: torch.Tensor  # [batch, seq - 1] bool
    position_ids: torch.Tensor | None = None  # [batch, seq], packed rows only
    prompt_lengths: Sequence[int] | None = None
    images: Sequence[tuple[ImagePart, ...]] = ()
    routes: Routes | None = None
    """Expert routes to replay over the flattened ``input_ids`` (`UNROUTED` tokens route themselves); needs a
    backend with a `RouterReplay` (``trainer.moe.routing_replay``)."""
    balance_weight: float = 0.0
    """The pass's load-balancing loss weight (``trainer.moe.aux_loss_coef`` x its real tokens / its mini-batch's):
    a pipeline's stages add their layers' share to the backward themselves, since the loss on the last stage cannot
    see their routers' probabilities; every other backend ignores it (the loss adds the balance term)."""


MicroBatchLoss = Callable[[int, TokenScores], torch.Tensor]
"""The loss of micro-batch ``index`` from the policy's scores of it (`TrainerBackend.train_micro_batches`)."""


class TrainerBackend(Protocol):
    device: torch.device
    rank: int
    """This process's data-parallel rank: which share of a batch it trains on (ranks that split one model with
    tensor parallelism share it)."""
    num_ranks: int
    """Data-parallel ranks: the shares a batch is split into."""
    is_writer: bool
    """Whether this process writes the files one process writes for all (global rank 0)."""

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
        """Per-token logprobs (and entropy) where ``target_mask`` is set: right-padded rows with their
        ``attention_mask``, or packed rows (`packing.PackedRow`) with ``position_ids`` and no attention mask.
        ``prompt_lengths`` (right-padded rows only): each row's prompt tokens, which lets a backend compute a prompt
        that several rows share once (`prefix.score_shared_prompts`); a backend may ignore it, the scores are the
        same either way. ``images`` (right-padded rows only): each row's images, in the order of its image
        placeholders (`Rollout.images`); empty for text rows. A backend that takes no images raises on any.
        ``sampling_mask``: the engine's top-k / top-p, applied after the temperature (`chunked_logits`); None: the
        full distribution (the probe, the reference)."""
        ...

    def token_logprobs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        target_mask: torch.Tensor,
        *,
        temperature: float,
        use_autocast: bool = True,
    ) -> torch.Tensor: ...

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
        """Accumulate the gradients of ``loss(index, scores)`` summed over one optimizer step's micro-batches
        ``inputs``. One process runs them in turn (forward, loss, backward); a pipeline runs them through its
        schedule, and ``loss`` then runs on the last stage alone (its side effects, the metric sums, there only:
        `share_loss_sums`). A Mixture-of-Experts policy's routes: in ``scores.routes`` when the loss runs where every
        layer ran (None: the backend returns them after, each micro-batch's, on every rank, as a pipeline does)."""
        ...

    def score_micro_batches(
        self,
        inputs: Sequence[ScoreInputs],
        *,
        temperature: float,
        use_autocast: bool = True,
        sampling_mask: SamplingMask | None = None,
    ) -> list[TokenScores]:
        """The logprobs of each micro-batch of ``inputs`` (forward only, no entropy), on every rank."""
        ...

    def share_loss_sums(self, sums: dict[str, float]) -> dict[str, float]:
        """The metric sums that `train_micro_batches`' losses wrote, on every rank that trains the same rows: the
        last pipeline stage's (the identity without a pipeline); collective."""
        ...

    def clip_and_step(self, *, skip_above: float = math.inf) -> float:
        """Clip the accumulated gradient, step the optimizer, clear gradients; returns the pre-clip global norm. A
        norm that is not finite, or is above ``skip_above``, skips the optimizer step (on every rank together)."""
        ...

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]: ...

    def weight_shards(self) -> list[WeightShard]:
        """This rank's boxes of the weights `named_weights` sends whole, as host copies, for the direct weight sync
        (the receiver assembles them: `sharpen.weight_shards`); no collective. A box other ranks hold too is sent by
        one of them."""
        ...

    def all_reduce_sum(self, values: dict[str, float]) -> dict[str, float]:
        """Sum metric sums over ranks (a name missing on a rank counts as 0)."""
        ...

    def all_reduce_max(self, value: int) -> int: ...

    def save(self, folder: Path) -> None: ...

    def load(self, folder: Path) -> None: ...

    def export(self, folder: Path) -> None: ...


class ReferenceScorer(Protocol):
    """What the trainer needs of a reference policy (the KL term): `frozen.ReferencePolicy` (a frozen copy) or
    `frozen.LoraReferencePolicy` (the LoRA policy with its adapters disabled)."""

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
        """[batch, seq - 1] logprobs of the target tokens, without gradient; ``images``: each row's (a
        vision-language model's image rows); ``routes``: a Mixture-of-Experts reference's expert routes to replay
        over the flattened rows (the policy's, under ``trainer.moe.routing_replay``)."""
        ...


@runtime_checkable
class UpFrontReferenceScorer(ReferenceScorer, Protocol):
    """A reference policy that scores a mini-batch's passes before they train (`sharded_reference.ShardedReference`:
    collective, so it cannot run inside a pipeline's last-stage loss)."""

    def score_micro_batches(self, inputs: Sequence[ScoreInputs], *, temperature: float) -> list[torch.Tensor]:
        """The logprobs of each micro-batch of ``inputs``, on every rank (collective)."""
        ...


@contextlib.contextmanager
def replaying(router: RouterReplay | None, routes: Routes | None) -> Iterator[None]:
    """Replay ``routes`` with ``router`` inside (nothing without routes); routes without a router are an error."""
    if routes is None:
        yield
        return
    if router is None:
        raise ValueError("expert routes to replay need trainer.moe.routing_replay and a Mixture-of-Experts policy")
    with router.replay(routes):
        yield


def checkpointing_kwargs(model: torch.nn.Module) -> dict[str, object]:
    """transformers' ``gradient_checkpointing_kwargs`` for ``model``: non-reentrant, and for a Mixture-of-Experts
    model a recomputation that replays the routes its forward replayed (`expert_routes.checkpoint_contexts`)."""
    if is_moe_model(model):
        return {"use_reentrant": False, "context_fn": checkpoint_contexts}
    return {"use_reentrant": False}


def replay_routes_of(model: torch.nn.Module, config: TrainerConfig, *, name: str) -> RouterReplay | None:
    """The policy's `RouterReplay`: when ``trainer.moe.routing_replay`` asks for one (a `RoutingError` for a dense
    model or a router family without replay), or to measure the routes of an MoE of a known family without
    replaying them; None for a dense model."""
    if config.moe.routing_replay == "none" and not is_moe_model(model):
        return None
    return RouterReplay(model, name=name, float32=config.moe.router_float32)


class RouteView(Protocol):
    """How a backend's routers see a micro-batch's tokens when the backend splits its rows (context parallelism:
    each rank routes its slice of every row; `context_parallel.ContextParallel`)."""

    def local_routes(self, routes: Routes, rows: int, length: int) -> Routes:
        """Routes over whole rows -> this rank's."""
        ...

    def whole_routes(self, routes: Routes, rows: int, length: int) -> Routes:
        """This rank's captured routes -> over whole rows (collective)."""
        ...


def local_routes(backend: object, item: ScoreInputs) -> Routes | None:
    """The routes of ``item`` as the backend's routers see its tokens (`RouteView`; as they are without one)."""
    view: RouteView | None = getattr(backend, "route_view", None)
    if item.routes is None or view is None:
        return item.routes
    rows, length = item.input_ids.shape
    return view.local_routes(item.routes, rows, length)


def scored_routes(backend: TrainerBackend, item: ScoreInputs, *, replay: bool = True, **options: object) -> TokenScores:
    """``score_tokens`` of ``item``, capturing its routes (over its whole rows) when the backend has a router
    (``replay`` False: the caller replays ``local_routes(backend, item)`` around this call)."""
    router: RouterReplay | None = getattr(backend, "router", None)
    capturing = router.capture() if router is not None else contextlib.nullcontext(None)
    with capturing as used, replaying(router, local_routes(backend, item) if replay else None):
        scores = backend.score_tokens(
            item.input_ids,
            item.attention_mask,
            item.target_mask,
            position_ids=item.position_ids,
            prompt_lengths=item.prompt_lengths if router is None else None,  # routes are over whole rows
            images=item.images,
            **options,  # pyright: ignore[reportArgumentType]
        )
    view: RouteView | None = getattr(backend, "route_view", None)
    if used is not None and view is not None:
        used = view.whole_routes(used, *item.input_ids.shape)
    scores.routes = used
    return scores


class ScoresTokenLogprobs:
    """`TrainerBackend.token_logprobs`, `train_micro_batches`, `score_micro_batches` and `share_loss_sums` for a
    backend that has `score_tokens` and runs every micro-batch whole on each rank (both backends share it; a
    pipeline overrides the micro-batch methods). A backend with a `RouterReplay` in ``router`` replays each
    micro-batch's ``routes`` in its forward and in the backward's recomputation, and returns the routes used."""

    router: RouterReplay | None = None

    @property
    def routers(self) -> Routers | None:
        """The policy's routers as the trainer needs them (`expert_routes.Routers`): `router`."""
        return self.router

    def train_micro_batches(
        self: TrainerBackend,
        inputs: Sequence[ScoreInputs],
        loss: MicroBatchLoss,
        *,
        temperature: float,
        with_entropy: bool = False,
        entropy_requires_grad: bool = False,
        sampling_mask: SamplingMask | None = None,
    ) -> list[Routes] | None:
        """Forward, loss and backward of each micro-batch in turn (its graph freed before the next); replayed routes
        stay in force through the backward, where activation checkpointing recomputes the forward. The loss gets
        each micro-batch's routes (returns None)."""
        for index, item in enumerate(inputs):
            with replaying(getattr(self, "router", None), local_routes(self, item)):
                scores = scored_routes(
                    self,
                    item,
                    replay=False,
                    temperature=temperature,
                    with_entropy=with_entropy,
                    entropy_requires_grad=entropy_requires_grad,
                    sampling_mask=sampling_mask,
                )
                value = loss(index, scores)
                scaler = getattr(self, "loss_scaler", None)  # fp16: `precision.LossScaler`, undone in clip_and_step
                (value if scaler is None else scaler.scale_loss(value)).backward()
        return None

    def score_micro_batches(
        self: TrainerBackend,
        inputs: Sequence[ScoreInputs],
        *,
        temperature: float,
        use_autocast: bool = True,
        sampling_mask: SamplingMask | None = None,
    ) -> list[TokenScores]:
        return [
            scored_routes(self, item, temperature=temperature, use_autocast=use_autocast, sampling_mask=sampling_mask)
            for item in inputs
        ]

    def share_loss_sums(self, sums: dict[str, float]) -> dict[str, float]:
        return sums

    def token_logprobs(
        self: TrainerBackend,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        target_mask: torch.Tensor,
        *,
        temperature: float,
        use_autocast: bool = True,
    ) -> torch.Tensor:
        """Logprob of each next token where ``target_mask`` is set (see `score_tokens`); [batch, seq - 1]."""
        return self.score_tokens(
            input_ids, attention_mask, target_mask, temperature=temperature, use_autocast=use_autocast
        ).logprobs
