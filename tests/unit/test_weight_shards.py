"""`assemble_weights`: whole tensors from the boxes trainer ranks send on the direct weight sync, in the weights'
order, and one clear error (before any tensor is made) when the boxes do not tile a weight exactly."""

from __future__ import annotations

import pytest
import torch

from sharpen.weight_shards import WeightShard, WeightShardError, assemble_weights


def box(name: str, order: int, whole: torch.Tensor, rows: slice, cols: slice) -> WeightShard:
    """The box ``whole[rows, cols]`` of a 2-D weight, as a rank would send it (a copy)."""
    offsets = (rows.start, cols.start)
    return WeightShard(
        name=name, order=order, shape=tuple(whole.shape), offsets=offsets, tensor=whole[rows, cols].clone()
    )


def test_the_boxes_of_a_2x2_split_and_a_whole_weight_are_put_together_in_the_weights_order() -> None:
    weight = torch.arange(24.0).reshape(4, 6)
    bias = torch.arange(6.0)
    pieces = [
        WeightShard.whole("b", 0, bias),  # order 0: first out, although it comes last from the ranks
        box("w", 1, weight, slice(2, 4), slice(3, 6)),
        box("w", 1, weight, slice(0, 2), slice(0, 3)),
        box("w", 1, weight, slice(2, 4), slice(0, 3)),
        box("w", 1, weight, slice(0, 2), slice(3, 6)),
    ]
    assembled = list(assemble_weights(reversed(pieces)))
    assert [name for name, _ in assembled] == ["b", "w"]
    assert torch.equal(assembled[0][1], bias) and torch.equal(assembled[1][1], weight)


def test_an_empty_piece_of_an_uneven_split_is_ignored() -> None:
    """FSDP2 splits 3 rows over 4 ranks as 1, 1, 1, 0 rows: the last rank's piece is empty."""
    weight = torch.randn(3, 2)
    pieces = [box("w", 0, weight, slice(row, row + 1), slice(0, 2)) for row in range(3)]
    pieces.append(WeightShard(name="w", order=0, shape=(3, 2), offsets=(3, 0), tensor=torch.empty(0, 2)))
    ((_, whole),) = assemble_weights(pieces)
    assert torch.equal(whole, weight)


def test_a_missing_piece_is_named_before_any_weight_is_made() -> None:
    weight = torch.randn(4, 2)
    pieces = [WeightShard.whole("a", 0, torch.ones(2)), box("w", 1, weight, slice(0, 3), slice(0, 2))]
    weights = assemble_weights(pieces)
    with pytest.raises(WeightShardError, match=r"weight w: its pieces cover 6 of its 8 elements"):
        next(weights)  # "a" is whole, but nothing is handed out from a sync that does not fit


def test_overlapping_pieces_are_refused() -> None:
    """A replica sent twice (two data-parallel ranks that both sent a replicated weight) covers some elements twice
    and, with a gap elsewhere, could add up to the right count."""
    weight = torch.randn(4, 2)
    pieces = [box("w", 0, weight, slice(0, 2), slice(0, 2)), box("w", 0, weight, slice(1, 3), slice(0, 2))]
    pieces.append(box("w", 0, weight, slice(3, 4), slice(0, 2)))
    with pytest.raises(WeightShardError, match=r"weight w: two pieces overlap \(at \[0, 0\] and \[1, 0\]\)"):
        list(assemble_weights(pieces))


def test_pieces_that_disagree_on_the_shape_or_lie_outside_it_are_refused() -> None:
    weight = torch.randn(4, 2)
    other = WeightShard(name="w", order=0, shape=(4, 3), offsets=(2, 0), tensor=torch.randn(2, 2))
    with pytest.raises(WeightShardError, match=r"weight w: its pieces disagree on its shape, dtype or order"):
        list(assemble_weights([box("w", 0, weight, slice(0, 2), slice(0, 2)), other]))
    outside = WeightShard(name="w", order=0, shape=(4, 2), offsets=(3, 0), tensor=torch.randn(2, 2))
    with pytest.raises(WeightShardError, match=r"lies outside its \[4, 2\]"):
        list(assemble_weights([box("w", 0, weight, slice(0, 2), slice(0, 2)), outside]))
