"""A model's weights as the pieces its trainer ranks hold, and their assembly into whole tensors: the direct path of
weight sync (``weight_sync.assemble = "receiver"``).

A sharded trainer rank (FSDP2 over data, DTensor over tensor parallelism, a pipeline stage) holds a box of some of
the model's weights. On the direct path each rank hands out its boxes as `WeightShard`s (where the box sits in the
whole tensor, and the whole tensor's shape), without any collective among the trainer ranks, and the receiver
`assemble_weights`: it puts the boxes of every weight together and proves that they cover it exactly once, before
an engine loads it. The golden path (the trainer ranks gather each whole tensor and rank 0 sends it) must give the
same tensors, bit for bit; `tests/integration/test_vllm_tensor_parallel.py` checks both against the weights on disk.

It sits in the lowest layer, beside `types` and `weight_files`, because the trainer makes the pieces and the
rollout side (or the orchestration that carries them) assembles them, and the two may not import each other. It
imports nothing of sharpen.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from math import prod

import torch


class WeightShardError(ValueError):
    """The pieces of a weight do not fit together: the message names the weight and what is wrong."""


@dataclass(kw_only=True, slots=True)
class WeightShard:
    """One rank's box of one weight (HF name ``name``): ``tensor`` is the box, which starts at ``offsets`` of the
    whole tensor of ``shape``. ``order`` is the weight's position among the model's weights (its HF order): the
    receiver loads whole tensors in that order, so a layer's tensors stay together."""

    name: str
    order: int
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    tensor: torch.Tensor

    @staticmethod
    def whole(name: str, order: int, tensor: torch.Tensor) -> WeightShard:
        """A weight held whole by one rank (a single-device trainer, a tensor nothing splits)."""
        shape = tuple(tensor.shape)
        return WeightShard(name=name, order=order, shape=shape, offsets=(0,) * len(shape), tensor=tensor)


def assemble_weights(shards: Iterable[WeightShard]) -> Iterator[tuple[str, torch.Tensor]]:
    """Whole tensors, in the weights' order, from every rank's pieces (in any order). Each weight's pieces must agree
    on its shape, dtype and order, lie inside it, not overlap, and cover all of it; otherwise `WeightShardError`
    names the weight. Every weight is checked before the first tensor is made, so an engine never loads part of a
    sync that does not fit together."""
    by_name: dict[str, list[WeightShard]] = {}
    for shard in shards:
        by_name.setdefault(shard.name, []).append(shard)
    for name, pieces in by_name.items():
        _check_pieces(name, pieces)
    names = sorted(by_name, key=lambda name: (by_name[name][0].order, name))
    for name in names:
        pieces = by_name.pop(name)
        first = pieces[0]
        whole = torch.empty(first.shape, dtype=first.tensor.dtype, device=first.tensor.device)
        for piece in pieces:
            if piece.tensor.numel():
                box = tuple(
                    slice(start, start + size) for start, size in zip(piece.offsets, piece.tensor.shape, strict=True)
                )
                whole[box] = piece.tensor
        yield name, whole


def assemble_ranks(ranks: Iterable[Iterable[WeightShard]]) -> Iterator[tuple[str, torch.Tensor]]:
    """`assemble_weights` of every rank's pieces (``ranks``: one list of pieces a rank, as each sends them)."""
    return assemble_weights(itertools.chain.from_iterable(ranks))


def _check_pieces(name: str, pieces: list[WeightShard]) -> None:
    """That ``pieces`` tile the weight ``name`` exactly (see `assemble_weights`)."""
    first = pieces[0]
    shape, dtype, order = first.shape, first.tensor.dtype, first.order
    for piece in pieces[1:]:
        if (piece.shape, piece.tensor.dtype, piece.order) != (shape, dtype, order):
            raise WeightShardError(
                f"weight {name}: its pieces disagree on its shape, dtype or order ({list(shape)} {dtype} #{order} "
                f"against {list(piece.shape)} {piece.tensor.dtype} #{piece.order})"
            )
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for piece in pieces:
        sizes = tuple(piece.tensor.shape)
        if len(piece.offsets) != len(shape) or len(sizes) != len(shape):
            raise WeightShardError(f"weight {name}: a piece of {len(sizes)} dimensions for a tensor of {len(shape)}")
        if any(o < 0 or o + s > whole for o, s, whole in zip(piece.offsets, sizes, shape, strict=True)):
            raise WeightShardError(
                f"weight {name}: a piece of shape {list(sizes)} at {list(piece.offsets)} lies outside its {list(shape)}"
            )
        if prod(sizes):
            boxes.append((piece.offsets, sizes))
    for index, (offsets, sizes) in enumerate(boxes):
        for other_offsets, other_sizes in boxes[index + 1 :]:
            if all(
                a < b + bs and b < a + s for a, s, b, bs in zip(offsets, sizes, other_offsets, other_sizes, strict=True)
            ):
                raise WeightShardError(
                    f"weight {name}: two pieces overlap (at {list(offsets)} and {list(other_offsets)}): a replica "
                    "was sent twice, or the pieces come from two layouts"
                )
    covered, total = sum(prod(sizes) for _, sizes in boxes), prod(shape)
    if covered != total:
        raise WeightShardError(
            f"weight {name}: its pieces cover {covered} of its {total} elements: a rank's pieces are missing"
        )
