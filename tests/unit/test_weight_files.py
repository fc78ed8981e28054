"""`write_safetensors`: HF's file names and index, shards cut at the limit in the weights' order, tied weights
written, dtype applied to floating-point weights only, a name given twice refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sharpen.weight_files import INDEX_FILE, write_safetensors


def _weights() -> list[tuple[str, torch.Tensor]]:
    embedding = torch.randn(8, 4)  # 128 bytes each
    return [
        ("embed.weight", embedding),
        ("lm_head.weight", embedding),  # tied: the same storage
        ("layer.weight", torch.randn(8, 4)),
        ("layer.count", torch.arange(4)),  # int64: 32 bytes
    ]


def test_one_shard_is_model_safetensors_without_an_index(tmp_path: Path) -> None:
    weights = _weights()
    written = write_safetensors(weights, tmp_path, max_shard_bytes=1 << 20)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model.safetensors"]
    assert written.num_tensors == 4 and written.num_bytes == 3 * 128 + 32
    loaded = load_file(tmp_path / "model.safetensors")
    assert all(torch.equal(loaded[name], tensor) for name, tensor in weights)


def test_shards_are_cut_at_the_limit_and_indexed(tmp_path: Path) -> None:
    weights = _weights()
    written = write_safetensors(weights, tmp_path, max_shard_bytes=256)
    files = {
        "embed.weight": "model-00001-of-00002.safetensors",
        "lm_head.weight": "model-00001-of-00002.safetensors",
        "layer.weight": "model-00002-of-00002.safetensors",
        "layer.count": "model-00002-of-00002.safetensors",
    }
    assert written.files == files
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index == {"metadata": {"total_size": written.num_bytes}, "weight_map": files}
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted({*files.values(), INDEX_FILE})
    for name, tensor in weights:
        assert torch.equal(load_file(tmp_path / files[name])[name], tensor)


def test_dtype_applies_to_floating_point_weights_only(tmp_path: Path) -> None:
    write_safetensors(_weights(), tmp_path, max_shard_bytes=1 << 20, dtype=torch.bfloat16)
    loaded = load_file(tmp_path / "model.safetensors")
    assert loaded["layer.weight"].dtype == torch.bfloat16 and loaded["layer.count"].dtype == torch.int64


def test_a_name_given_twice_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"'layer\.weight' given twice"):
        write_safetensors([*_weights(), ("layer.weight", torch.zeros(2))], tmp_path, max_shard_bytes=1 << 20)
