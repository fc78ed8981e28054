"""Reads W&B offline run files (``run-<id>.wandb``) back, for the tracking tests.

wandb 0.31 ships no Python reader for this transaction log (its Go core reads it), so this is one, following the
format the core writes: a 7-byte header (":W&B", magic 0xBEE1, version 0), then LevelDB-log records (32 KiB blocks;
each chunk: crc32 of type byte + data, length, type FULL/FIRST/MIDDLE/LAST) holding serialised `Record` protobufs
from wandb's own ``wandb_internal.proto``.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any

from sharpen.monitoring import WANDB_DIR_NAME

_BLOCK, _CHUNK_HEADER, _FULL, _LAST = 32768, 7, 1, 4


def wandb_records(path: Path) -> list[Any]:
    """Every `Record` of a run file, in order, each chunk's checksum checked."""
    from wandb.proto.wandb_internal_pb2 import Record  # pyright: ignore[reportAttributeAccessIssue]

    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    records, pieces, pos = [], [], 7
    while pos + _CHUNK_HEADER <= len(data):
        if _BLOCK - pos % _BLOCK < _CHUNK_HEADER:  # a block's tail too short for a chunk header is padding
            pos += _BLOCK - pos % _BLOCK
            continue
        checksum, length, kind = struct.unpack("<IHB", data[pos : pos + _CHUNK_HEADER])
        payload = data[pos + _CHUNK_HEADER : pos + _CHUNK_HEADER + length]
        pos += _CHUNK_HEADER + length
        if kind == 0:
            break  # zero padding at the end of the last block
        assert zlib.crc32(payload, zlib.crc32(bytes([kind]))) == checksum
        pieces.append(payload)
        if kind in (_FULL, _LAST):
            record = Record()
            record.ParseFromString(b"".join(pieces))
            records.append(record)
            pieces = []
    return records


def wandb_run_files(run_dir: Path, run_id: str) -> list[Path]:
    """Oldest first. Folders are ``offline-run-<time>-<id>``, then ``-1``, ``-2`` when one of that second exists."""

    def start(path: Path) -> tuple[str, int]:
        time, _, suffix = path.parent.name.removeprefix("offline-run-").partition(f"-{run_id}")
        return time, int(suffix.lstrip("-") or 0)

    return sorted((run_dir / WANDB_DIR_NAME).glob(f"offline-run-*/run-{run_id}.wandb"), key=start)


def wandb_history(path: Path) -> list[dict[str, float]]:
    """The history rows of a run file, without W&B's own ``_runtime``/``_timestamp`` keys."""
    rows = []
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            rows.append({key: value for key, value in items.items() if key not in {"_runtime", "_timestamp"}})
    return rows


def wandb_config(path: Path) -> dict[str, Any]:
    (run,) = [record.run for record in wandb_records(path) if record.WhichOneof("record_type") == "run"]
    return {item.key: json.loads(item.value_json) for item in run.config.update}
