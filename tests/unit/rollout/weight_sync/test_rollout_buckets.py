"""Bucketed weight sync: exact round trip across dtypes, layers never split, and every way a sync can go wrong
(a corrupted, dropped or reordered bucket, a lying receiver, a failing producer) is refused with a clear error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from sharpen.rollout.weight_sync.buckets import (
    BucketError,
    BucketManifest,
    engine_sync_dtype,
    group_key,
    shared_memory_dir,
)
from sharpen.rollout.weight_sync.streaming import BucketedSender, BucketReceiver, iter_groups


def _weights(num_layers: int = 4) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    weights = [("model.embed_tokens.weight", torch.randn(64, 16, generator=generator))]
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}"
        weights += [
            (f"{prefix}.self_attn.q_proj.weight", torch.randn(16, 16, generator=generator)),
            (f"{prefix}.mlp.up_proj.weight", torch.randn(32, 16, generator=generator).to(torch.bfloat16)),
            (f"{prefix}.input_layernorm.weight", torch.ones(16)),
        ]
    weights += [("model.norm.weight", torch.ones(16)), ("model.step", torch.tensor([7], dtype=torch.int64))]
    return weights


class LocalBucketTarget:
    """The sender's target: a `BucketReceiver` in this process, called directly."""

    def __init__(self, receiver: BucketReceiver) -> None:
        self.receiver = receiver

    def begin(self, sync_id: str, version: int) -> None:
        self.receiver.begin(sync_id, version)

    def load(self, manifest: BucketManifest) -> None:
        self.receiver.load(manifest)

    def finish(self, sync_id: str, num_buckets: int, checksum: str) -> dict[str, Any]:
        return self.receiver.finish(sync_id, num_buckets, checksum)

    def abort(self, sync_id: str) -> None:
        self.receiver.abort(sync_id)


class _Collector:
    def __init__(self) -> None:
        self.received: dict[str, torch.Tensor] = {}
        self.buckets: list[list[str]] = []

    def __call__(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.buckets.append([name for name, _ in tensors])
        self.received.update({name: tensor.clone() for name, tensor in tensors})  # views die with the call


class _Tampering(LocalBucketTarget):
    """Delivers buckets through a hook that may corrupt, drop or reorder them."""

    def __init__(self, receiver: BucketReceiver, hook) -> None:
        super().__init__(receiver)
        self.hook = hook
        self.aborted = False

    def load(self, manifest: BucketManifest) -> None:
        self.hook(self, manifest)

    def abort(self, sync_id: str) -> None:
        self.aborted = True
        super().abort(sync_id)


@pytest.fixture
def sender():
    sender = BucketedSender(bucket_bytes=3000)
    yield sender
    sender.close()


def test_round_trip_is_exact_and_buckets_never_split_a_layer(sender):
    collector = _Collector()
    weights = _weights()
    report = sender.send(iter(weights), version=3, target=LocalBucketTarget(BucketReceiver(collector)))
    assert report.num_buckets == len(collector.buckets) > 2 and report.num_tensors == len(weights)
    assert report.num_bytes == sum(t.numel() * t.element_size() for _, t in weights)
    for name, tensor in weights:
        assert collector.received[name].dtype == tensor.dtype and torch.equal(collector.received[name], tensor)
    groups = [{group_key(name) for name in bucket} for bucket in collector.buckets]
    assert all(a.isdisjoint(b) for i, a in enumerate(groups) for b in groups[i + 1 :])
    again = sender.send(iter(weights), version=4, target=LocalBucketTarget(BucketReceiver(_Collector())))
    assert again.checksum == report.checksum  # same bytes, same checksum; the slots are reused
    assert report.metrics()["sync/num_buckets"] == report.num_buckets


def test_group_keys_and_batches():
    assert group_key("model.layers.12.mlp.up_proj.weight") == "model.layers.12"
    assert group_key("model.embed_tokens.weight") == "model.embed_tokens"
    assert group_key("lm_head.weight") == "lm_head"
    sizes = [sum(t.numel() * t.element_size() for _, t in batch) for batch in iter_groups(iter(_weights()), 3000)]
    assert all(size >= 3000 for size in sizes[:-1])
    shuffled = [_weights()[1], _weights()[4], _weights()[2]]  # layer 0, layer 1, layer 0 again
    with pytest.raises(BucketError, match="not contiguous"):
        list(iter_groups(iter(shuffled), 10))


def _corrupt(target, manifest):
    if manifest.index == 1:
        with open(manifest.path, "r+b") as handle:  # one flipped byte in the shared memory, after the checksum
            handle.seek(manifest.num_bytes // 2)
            byte = handle.read(1)
            handle.seek(manifest.num_bytes // 2)
            handle.write(bytes([byte[0] ^ 0x01]))
    target.receiver.load(manifest)


def _drop(target, manifest):
    if manifest.index != 1:
        target.receiver.load(manifest)


def _reorder(target, manifest):
    target.receiver.load(manifest if manifest.index != 0 else BucketManifest(**{**_fields(manifest), "index": 1}))


def _foreign(target, manifest):
    target.receiver.load(BucketManifest(**{**_fields(manifest), "sync_id": "someone-else"}))


def _fields(manifest: BucketManifest) -> dict:
    return {name: getattr(manifest, name) for name in BucketManifest.__slots__}


@pytest.mark.parametrize(
    ("hook", "message"),
    [
        (_corrupt, r"bucket 1 of sync \w+ \(version 5\) is corrupted"),
        (_drop, "bucket 2 arrived, expected bucket 1"),
        (_reorder, "bucket 1 arrived, expected bucket 0"),
        (_foreign, "arrived during sync"),
    ],
)
def test_a_bad_bucket_is_refused_and_the_sync_aborted(sender, hook, message):
    target = _Tampering(BucketReceiver(_Collector()), hook)
    with pytest.raises(BucketError, match=message):
        sender.send(iter(_weights()), version=5, target=target)
    assert target.aborted
    report = sender.send(iter(_weights()), version=6, target=LocalBucketTarget(BucketReceiver(_Collector())))
    assert report.version == 6  # the sender recovers: its slots are free again


def test_a_dropped_last_bucket_and_a_lying_receiver_are_caught_at_finish(sender):
    weights = _weights()
    num_buckets = len(list(iter_groups(iter(weights), sender.bucket_bytes)))

    def drop_last(target, manifest):
        if manifest.index != num_buckets - 1:
            target.receiver.load(manifest)

    with pytest.raises(BucketError, match=f"sent {num_buckets} buckets .* received {num_buckets - 1}"):
        sender.send(iter(weights), version=1, target=_Tampering(BucketReceiver(_Collector()), drop_last))

    class Lying(LocalBucketTarget):
        def finish(self, sync_id, num_buckets, checksum):
            return {**super().finish(sync_id, num_buckets, checksum), "version": 99}

    with pytest.raises(BucketError, match="receiver reports version 99"):
        sender.send(iter(weights), version=2, target=Lying(BucketReceiver(_Collector())))


def test_a_failing_producer_surfaces_in_the_caller_and_aborts(sender):
    def weights():
        yield from _weights()[:4]
        raise RuntimeError("gather failed on rank 1")

    target = _Tampering(BucketReceiver(_Collector()), lambda t, m: t.receiver.load(m))
    with pytest.raises(RuntimeError, match="gather failed"):
        sender.send(weights(), version=1, target=target)
    assert target.aborted


def test_close_leaves_no_shared_memory_behind():
    sender = BucketedSender(bucket_bytes=1000, num_slots=3)
    paths = [Path(slot.path) for slot in sender.slots]
    assert all(path.parent == shared_memory_dir() and path.exists() for path in paths)
    sender.send(iter(_weights()), version=1, target=LocalBucketTarget(BucketReceiver(_Collector())))
    sender.close()
    assert not any(path.exists() for path in paths)
    with pytest.raises(ValueError, match="bucket_bytes"):
        BucketedSender(bucket_bytes=0)


def test_floating_point_weights_travel_in_the_engines_dtype_with_the_loaders_bits():
    weights = _weights()
    collector = _Collector()
    sender = BucketedSender(bucket_bytes=1500, dtype=engine_sync_dtype("bfloat16"))
    try:
        report = sender.send(iter(weights), version=3, target=LocalBucketTarget(BucketReceiver(collector)))
    finally:
        sender.close()
    assert report.num_bytes == sum(t.numel() * (2 if t.is_floating_point() else 8) for _, t in weights)
    for name, tensor in weights:
        got = collector.received[name]
        if tensor.is_floating_point():
            loaded = torch.empty(tensor.shape, dtype=torch.bfloat16)
            loaded.copy_(tensor)  # what an engine's loader does with a float32 tensor for a bf16 parameter
            assert got.dtype == torch.bfloat16 and torch.equal(got, loaded)
        else:
            assert got.dtype == tensor.dtype and torch.equal(got, tensor)  # the int64 buffer keeps its dtype
    sizes = [
        sum(t.numel() * 2 for _, t in batch) for batch in iter_groups(iter(weights[:-1]), 1500, dtype=torch.bfloat16)
    ]
    assert all(size >= 1500 for size in sizes[:-1])  # buckets are sized by the bytes sent
    assert engine_sync_dtype("float32") is torch.float32 and engine_sync_dtype("auto") is None
