"""Weight sync as a `torch.distributed` broadcast: the trainer (rank 0 of a weight group) sends checksummed buckets
to every engine process of the group at once, over gloo (CPU, any network) or NCCL (GPUs).

Owns the weight group (a process group of its own, built from a TCP store, so it lives beside the trainer's FSDP2
group and vLLM's own groups without touching the default one) and the wire format: per bucket a header (version,
index, the tensors' names, dtypes, shapes and offsets, the xxh3 checksum, the size), then the bucket's bytes; a
final header with the number of buckets and the checksum of all of them. A receiver checks the version, the order,
every bucket's checksum and the totals, and raises `BucketError` on any mismatch, so a corrupted or truncated sync
fails loudly instead of loading wrong weights. Buckets are cut only between module groups (`iter_groups`), like the
shared-memory transport's. How an engine loads the received tensors is its `load_weights`.
"""

from __future__ import annotations

import pickle
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from sharpen.rollout.weight_sync.buckets import BucketError, bytes_checksum, combine_checksums
from sharpen.rollout.weight_sync.streaming import iter_groups

SOURCE = 0
"""The sender's rank in the weight group (the trainer's rank 0)."""


def open_weight_group(
    *,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    backend: str = "gloo",
    timeout: timedelta = timedelta(minutes=10),
) -> Any:
    """A process group of the sender (rank 0, which hosts the store) and the engine processes; every member calls
    this with the same address, port and size. ``timeout`` bounds every broadcast, so a member that died makes the
    others fail instead of hang."""
    store = dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
        master_addr, master_port, world_size, is_master=rank == 0, timeout=timeout
    )
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    raise ValueError(f"weight group backend must be 'gloo' or 'nccl', got {backend!r}")


def _broadcast(group: Any, tensor: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = SOURCE
    group.broadcast([tensor], options).wait()


def _send_object(group: Any, value: object, device: torch.device) -> None:
    payload = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8).to(device)
    _broadcast(group, torch.tensor([payload.numel()], dtype=torch.int64, device=device))
    _broadcast(group, payload)


def _receive_object(group: Any, device: torch.device) -> Any:
    size = torch.zeros(1, dtype=torch.int64, device=device)
    _broadcast(group, size)
    payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    _broadcast(group, payload)
    return pickle.loads(payload.cpu().numpy().tobytes())


def _ahead(items: Iterable[Any], *, depth: int = 1) -> Iterator[Any]:
    """``items``, produced by a background thread up to ``depth`` items ahead of the consumer (packing the next
    bucket while this one is on the wire; receiving the next while the engine copies this one). An exception in
    the producer is raised in the consumer."""
    slots: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=depth)

    def produce() -> None:
        try:
            for item in items:
                slots.put(("item", item))
            slots.put(("end", None))
        except BaseException as error:
            slots.put(("error", error))

    threading.Thread(target=produce, name="sharpen-weight-broadcast", daemon=True).start()
    while True:
        kind, value = slots.get()
        if kind == "end":
            return
        if kind == "error":
            raise value
        yield value


def _pack(
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    version: int,
    bucket_bytes: int,
    device: torch.device,
    tamper: Callable[[int, torch.Tensor], None] | None,
) -> Iterator[tuple[dict[str, Any], torch.Tensor]]:
    for index, batch in enumerate(iter_groups(weights, bucket_bytes)):
        entries, parts, offset = [], [], 0
        for name, tensor in batch:
            flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
            entries.append((name, str(tensor.dtype), tuple(tensor.shape), offset, flat.numel()))
            parts.append(flat)
            offset += flat.numel()
        bucket = torch.cat(parts).to(device)
        checksum = bytes_checksum(bucket.cpu())
        if tamper is not None:
            tamper(index, bucket)
        yield {"version": version, "index": index, "entries": entries, "checksum": checksum, "size": offset}, bucket


def send_weights(
    group: Any,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    version: int,
    bucket_bytes: int,
    device: torch.device | None = None,
    tamper: Callable[[int, torch.Tensor], None] | None = None,
) -> dict[str, float]:
    """Broadcast ``weights`` (full tensors) in buckets to the group, packing bucket k+1 while bucket k is sent;
    returns ``sync/*`` metrics. ``device``: where buckets are assembled (cuda for NCCL); ``tamper`` (tests only)
    changes a bucket after its checksum."""
    device = device or torch.device("cpu")
    checksums: list[str] = []
    num_bytes = 0
    packed = _pack(weights, version=version, bucket_bytes=bucket_bytes, device=device, tamper=tamper)
    for header, bucket in _ahead(packed):
        _send_object(group, header, device)
        _broadcast(group, bucket)
        checksums.append(header["checksum"])
        num_bytes += header["size"]
    _send_object(
        group,
        {"version": version, "end": True, "num_buckets": len(checksums), "checksum": combine_checksums(checksums)},
        device,
    )
    return {"sync/num_buckets": float(len(checksums)), "sync/bytes": float(num_bytes)}


def _receive_buckets(group: Any, device: torch.device) -> Iterator[tuple[dict[str, Any], torch.Tensor | None]]:
    """Every (header, bucket) of one sync, then the final header (with None)."""
    while True:
        header = _receive_object(group, device)
        if header.get("end"):
            yield header, None
            return
        bucket = torch.empty(header["size"], dtype=torch.uint8, device=device)
        _broadcast(group, bucket)
        yield header, bucket


def receive_weights(
    group: Any, *, version: int, device: torch.device | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of one broadcast sync, verified bucket by bucket (they are views into the received bucket; the
    caller copies them into its model), the next bucket received while the caller copies this one. Must be
    consumed to the end, in step with the sender."""
    device = device or torch.device("cpu")
    checksums: list[str] = []
    error: BucketError | None = None  # after a bad bucket the rest is drained (the sender is mid-send), then raised
    final: dict[str, Any] = {}
    for header, bucket in _ahead(_receive_buckets(group, device)):
        if bucket is None:
            final = header
            break
        got = bytes_checksum(bucket.cpu())
        checksums.append(header["checksum"])
        if error is not None:
            continue
        if header["version"] != version:
            error = BucketError(f"weight broadcast: expected version {version}, the sender sent {header['version']}")
        elif header["index"] != len(checksums) - 1:
            due = len(checksums) - 1
            error = BucketError(f"weight broadcast: bucket {header['index']} arrived where {due} was due")
        elif got != header["checksum"]:
            error = BucketError(
                f"weight broadcast of version {version}: bucket {header['index']} is corrupted (checksum {got}, "
                f"sent {header['checksum']})"
            )
        else:
            for name, dtype, shape, offset, size in header["entries"]:
                tensor = bucket[offset : offset + size].view(getattr(torch, dtype.removeprefix("torch.")))
                yield name, tensor.view(shape)
    if error is not None:
        raise error
    if final.get("version") != version:
        raise BucketError(
            f"weight broadcast: expected version {version}, the sender ended version {final.get('version')}"
        )
    if final["num_buckets"] != len(checksums) or final["checksum"] != combine_checksums(checksums):
        raise BucketError(
            f"weight broadcast of version {version}: received {len(checksums)} buckets, the sender sent "
            f"{final['num_buckets']} (or their checksums differ)"
        )
