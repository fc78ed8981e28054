"""Streaming weight sync: the sender fills bucket k+1 while the receiver loads bucket k; both halves verify.

Owns the protocol of one sync, which any receiver (a vLLM worker extension, an in-process engine) follows:
``begin(sync_id, version)``, then ``load(bucket)`` for every bucket in order, then ``finish(sync_id, num_buckets,
checksum)``, whose reply names the version, the number of buckets and the checksum the receiver verified. The
receiver refuses a corrupted bucket (its checksum), an out-of-order or foreign one (index, sync id), and at the end
a missing one (the count and the combined checksum); the sender refuses a reply that does not match what it sent.
Any refusal is a `BucketError`, and the run stops: a half-loaded engine must never generate.

Bucket size trades memory for overlap: the sender holds ``num_slots`` buckets in shared memory, and a bucket is
closed at the first layer boundary after ``bucket_bytes``.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from sharpen.rollout.weight_sync.buckets import (
    BucketError,
    BucketManifest,
    SharedMemorySlot,
    combine_checksums,
    group_key,
    read_bucket,
    sent_dtype,
)


class BucketTarget(Protocol):
    """The receiving side as the sender sees it (a remote call per method, or a direct one)."""

    def begin(self, sync_id: str, version: int) -> None: ...

    def load(self, manifest: BucketManifest) -> None: ...

    def finish(self, sync_id: str, num_buckets: int, checksum: str) -> dict[str, Any]: ...

    def abort(self, sync_id: str) -> None:
        """End a failed sync: the receiver leaves its loading state (its weights may now mix two versions; the
        caller must not generate with it)."""
        ...


@dataclass(kw_only=True, slots=True)
class SyncReport:
    version: int
    num_buckets: int
    num_tensors: int
    num_bytes: int
    checksum: str
    fill_seconds: float
    """Time spent copying tensors into buckets (overlaps with loading)."""
    wall_seconds: float
    receiver_verify_seconds: float
    """Time the receiver spent mapping and checksumming buckets."""
    receiver_load_seconds: float
    """Time the receiver's engine spent taking the tensors in (for vLLM: its loader and kernel repacking)."""

    def metrics(self) -> dict[str, float]:
        return {
            "sync/num_buckets": float(self.num_buckets),
            "sync/num_tensors": float(self.num_tensors),
            "sync/gib": self.num_bytes / 2**30,
            "sync/fill_seconds": self.fill_seconds,
            "sync/transfer_seconds": self.wall_seconds,
            "sync/receiver_verify_seconds": self.receiver_verify_seconds,
            "sync/receiver_load_seconds": self.receiver_load_seconds,
        }


def iter_groups(
    weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, *, dtype: torch.dtype | None = None
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Batches of at least ``bucket_bytes`` (but the last, counted as sent in ``dtype``: `sent_dtype`), cut only
    between module groups."""
    batch: list[tuple[str, torch.Tensor]] = []
    size, current, closed = 0, None, set()
    for name, tensor in weights:
        group = group_key(name)
        if group != current:
            if group in closed:
                raise BucketError(f"weights of {group} are not contiguous ({name} came after other modules)")
            if current is not None:
                closed.add(current)
            if size >= bucket_bytes:
                yield batch
                batch, size = [], 0
            current = group
        batch.append((name, tensor))
        size += tensor.numel() * sent_dtype(tensor, dtype).itemsize
    if batch:
        yield batch


class BucketedSender:
    """Sends named full tensors to a `BucketTarget` through reused shared-memory slots; floating-point tensors
    travel in ``dtype`` when it is given (the engine's: `engine_sync_dtype`), the checksums cover what was sent."""

    def __init__(self, *, bucket_bytes: int, num_slots: int = 2, dtype: torch.dtype | None = None) -> None:
        if bucket_bytes <= 0 or num_slots < 1:
            raise ValueError(f"bucket_bytes must be > 0 and num_slots >= 1, got {bucket_bytes}, {num_slots}")
        self.bucket_bytes = bucket_bytes
        self.dtype = dtype
        self.slots = [SharedMemorySlot(bucket_bytes) for _ in range(num_slots)]

    def send(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int, target: BucketTarget) -> SyncReport:
        started = time.perf_counter()
        sync_id = uuid.uuid4().hex[:12]
        target.begin(sync_id, version)
        free: queue.Queue[SharedMemorySlot | None] = queue.Queue()
        filled: queue.Queue[tuple[SharedMemorySlot, BucketManifest] | BaseException | None] = queue.Queue()
        for slot in self.slots:
            free.put(slot)
        fill_seconds = [0.0]
        producer = threading.Thread(
            target=self._produce, args=(weights, sync_id, version, free, filled, fill_seconds), daemon=True
        )
        producer.start()
        checksums: list[str] = []
        num_tensors = num_bytes = 0
        try:
            while (item := filled.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                slot, manifest = item
                target.load(manifest)
                checksums.append(manifest.checksum)
                num_tensors += len(manifest.entries)
                num_bytes += manifest.num_bytes
                free.put(slot)
        except BaseException:
            target.abort(sync_id)
            raise
        finally:
            free.put(None)  # unblocks a producer waiting for a slot after a failure
            producer.join()
        checksum = combine_checksums(checksums)
        reply = target.finish(sync_id, len(checksums), checksum)
        if (reply.get("version"), reply.get("num_buckets"), reply.get("checksum")) != (
            version,
            len(checksums),
            checksum,
        ):
            raise BucketError(
                f"receiver reports version {reply.get('version')}, {reply.get('num_buckets')} buckets, checksum "
                f"{reply.get('checksum')}; sent version {version}, {len(checksums)} buckets, checksum {checksum}"
            )
        return SyncReport(
            version=version,
            num_buckets=len(checksums),
            num_tensors=num_tensors,
            num_bytes=num_bytes,
            checksum=checksum,
            fill_seconds=fill_seconds[0],
            wall_seconds=time.perf_counter() - started,
            receiver_verify_seconds=float(reply.get("verify_seconds", 0.0)),
            receiver_load_seconds=float(reply.get("load_seconds", 0.0)),
        )

    def _produce(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        sync_id: str,
        version: int,
        free: queue.Queue[SharedMemorySlot | None],
        filled: queue.Queue[tuple[SharedMemorySlot, BucketManifest] | BaseException | None],
        fill_seconds: list[float],
    ) -> None:
        try:
            for index, batch in enumerate(iter_groups(weights, self.bucket_bytes, dtype=self.dtype)):
                slot = free.get()
                if slot is None:
                    return  # the consumer failed
                started = time.perf_counter()
                manifest = slot.fill(batch, sync_id=sync_id, version=version, index=index, dtype=self.dtype)
                filled.put((slot, manifest))
                fill_seconds[0] += time.perf_counter() - started
            filled.put(None)
        except BaseException as error:  # handed to the consumer, which raises it in the caller's thread
            filled.put(error)

    def close(self) -> None:
        for slot in self.slots:
            slot.close()


class BucketReceiver:
    """The receiving half's bookkeeping, engine-agnostic: ``load_tensors`` gets each verified bucket's tensors
    (views of shared memory, valid until the call returns)."""

    def __init__(self, load_tensors: Callable[[list[tuple[str, torch.Tensor]]], None]) -> None:
        self.load_tensors = load_tensors
        self.sync_id: str | None = None
        self.version = -1
        self.checksums: list[str] = []
        self.verify_seconds = 0.0
        self.load_seconds = 0.0

    def begin(self, sync_id: str, version: int) -> None:
        self.sync_id, self.version, self.checksums = sync_id, version, []
        self.verify_seconds = self.load_seconds = 0.0

    def load(self, manifest: BucketManifest) -> None:
        if manifest.sync_id != self.sync_id:
            raise BucketError(f"bucket of sync {manifest.sync_id} arrived during sync {self.sync_id}")
        if manifest.index != len(self.checksums):
            raise BucketError(
                f"sync {self.sync_id}: bucket {manifest.index} arrived, expected bucket {len(self.checksums)} "
                "(one was dropped or reordered)"
            )
        started = time.perf_counter()
        tensors = read_bucket(manifest)
        verified = time.perf_counter()
        self.load_tensors(tensors)
        self.verify_seconds += verified - started
        self.load_seconds += time.perf_counter() - verified
        self.checksums.append(manifest.checksum)

    def abort(self, sync_id: str) -> None:
        self.sync_id = None

    def finish(self, sync_id: str, num_buckets: int, checksum: str) -> dict[str, Any]:
        received = combine_checksums(self.checksums)
        if sync_id != self.sync_id or num_buckets != len(self.checksums) or checksum != received:
            raise BucketError(
                f"sync {sync_id}: the sender sent {num_buckets} buckets (checksum {checksum}); "
                f"received {len(self.checksums)} (checksum {received})"
            )
        self.sync_id = None
        return {
            "version": self.version,
            "num_buckets": len(self.checksums),
            "checksum": received,
            "verify_seconds": self.verify_seconds,
            "load_seconds": self.load_seconds,
        }
