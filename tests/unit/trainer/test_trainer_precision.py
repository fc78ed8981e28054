"""trainer.precision: the choice from the hardware (fake cpuinfo, fake probe, a monkeypatched torch.cuda), the
per-process cache, the real probe's shape, the engine dtype that follows the choice, the backend that applies it
(float32 master weights under bf16 autocast), and the one error for the retired bf16_autocast key."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from sharpen.config import ConfigError, load_config
from sharpen.config.schema import ModelConfig, TrainerConfig
from sharpen.trainer import SingleDeviceBackend
from sharpen.trainer import precision as precision_module
from sharpen.trainer.precision import (
    MIN_BF16_SPEEDUP,
    choose_precision,
    cpu_bf16_flags,
    measure_matmul_gflops,
    resolve_precision,
)

CPU = torch.device("cpu")
CUDA = torch.device("cuda")


def _cpuinfo(*flags: str) -> str:
    """A two-processor /proc/cpuinfo with ``flags`` besides the usual ones."""
    processor = "processor\t: {i}\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx2 avx512f {flags}\n\n"
    return "".join(processor.format(i=i, flags=" ".join(flags)) for i in range(2))


def _probe(float32: float, bf16: float):
    """A fake matmul probe with fixed speeds that records the dtypes it was asked for."""
    calls: list[torch.dtype] = []

    def measure(dtype: torch.dtype, device: torch.device) -> float:
        calls.append(dtype)
        return {torch.float32: float32, torch.bfloat16: bf16}[dtype]

    return measure, calls


def _no_probe(dtype: torch.dtype, device: torch.device) -> float:
    raise AssertionError("the probe must not run here")


@pytest.mark.parametrize("flags", [("avx512_bf16",), ("amx_bf16", "amx_tile"), ("avx512_bf16", "amx_bf16")])
def test_bf16_flags_and_a_fast_probe_choose_bf16(flags):
    measure, calls = _probe(float32=200.0, bf16=950.0)
    choice = choose_precision("auto", CPU, cpuinfo=_cpuinfo(*flags), measure=measure)
    assert choice.precision == "bf16" and choice.is_bf16 and choice.is_bf16_capable
    assert (choice.float32_gflops, choice.bf16_gflops) == (200.0, 950.0) and calls == [torch.float32, torch.bfloat16]
    assert choice.bf16_speedup == pytest.approx(4.75)
    assert "4.75x" in choice.reason and flags[0] in choice.reason
    line = choice.describe()
    assert "bf16" in line and "200 GFLOP/s" in line and "950 GFLOP/s" in line
    assert choice.metrics() == {
        "precision/is_bf16": 1.0,
        "precision/float32_gflops": 200.0,
        "precision/bf16_gflops": 950.0,
    }


def test_no_bf16_flag_chooses_float32_without_probing():
    choice = choose_precision("auto", CPU, cpuinfo=_cpuinfo(), measure=_no_probe)
    assert choice.precision == "float32" and not choice.is_bf16_capable
    assert choice.float32_gflops is None and "no AVX512-BF16 or AMX flag" in choice.reason
    assert choose_precision("auto", CPU, cpuinfo="", measure=_no_probe).precision == "float32"  # no /proc/cpuinfo


@pytest.mark.parametrize("bf16", [150.0, 200.0, 0.99 * MIN_BF16_SPEEDUP * 200.0])
def test_bf16_flags_but_a_probe_not_clearly_faster_choose_float32(bf16):
    measure, _ = _probe(float32=200.0, bf16=bf16)
    choice = choose_precision("auto", CPU, cpuinfo=_cpuinfo("avx512_bf16"), measure=measure)
    assert choice.precision == "float32" and choice.is_bf16_capable
    assert choice.bf16_gflops == bf16 and "below 1.3x" in choice.reason


def test_the_threshold_itself_is_fast_enough():
    measure, _ = _probe(float32=200.0, bf16=MIN_BF16_SPEEDUP * 200.0)
    assert choose_precision("auto", CPU, cpuinfo=_cpuinfo("avx512_bf16"), measure=measure).precision == "bf16"


@pytest.mark.parametrize(("is_supported", "bf16", "expected"), [(True, 9e5, "bf16"), (True, 5e4, "float32")])
def test_cuda_with_native_bf16_follows_the_probe(monkeypatch, is_supported, bf16, expected):
    asked: list[bool] = []

    def is_bf16_supported(including_emulation: bool = True) -> bool:
        asked.append(including_emulation)
        return is_supported

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    measure, calls = _probe(float32=6e4, bf16=bf16)
    choice = choose_precision("auto", CUDA, cpuinfo="", measure=measure)
    assert choice.precision == expected and choice.device == "cuda" and calls == [torch.float32, torch.bfloat16]
    assert asked == [False]  # emulated bf16 does not count as fast


def test_cuda_without_native_bf16_is_float32(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    # the CPU's flags say nothing about a GPU
    choice = choose_precision("auto", CUDA, cpuinfo=_cpuinfo("avx512_bf16"), measure=_no_probe)
    assert choice.precision == "float32" and "without native bf16" in choice.reason


@pytest.mark.parametrize("requested", ["float32", "bf16"])
def test_an_explicit_precision_is_kept_and_not_probed(requested):
    for cpuinfo in (_cpuinfo(), _cpuinfo("avx512_bf16")):
        choice = choose_precision(requested, CPU, cpuinfo=cpuinfo, measure=_no_probe)
        assert choice.precision == requested and choice.reason == "set by trainer.precision"


def test_cpu_flags_are_read_from_the_flags_line_only():
    assert cpu_bf16_flags(_cpuinfo("amx_bf16", "avx512_bf16")) == ["avx512_bf16", "amx_bf16"]
    assert cpu_bf16_flags("model name\t: avx512_bf16 in the name\nflags\t\t: fpu sse2\n") == []
    assert cpu_bf16_flags("Features\t: fp asimd bf16\n") == []  # an aarch64 cpuinfo has no x86 flags line


def test_resolution_is_probed_once_per_process_and_logged(monkeypatch, caplog):
    monkeypatch.setattr(precision_module, "_CHOICES", {})
    monkeypatch.setattr(precision_module, "read_cpuinfo", lambda: _cpuinfo("avx512_bf16"))
    measure, calls = _probe(float32=100.0, bf16=400.0)
    real_choose = precision_module.choose_precision
    monkeypatch.setattr(
        precision_module,
        "choose_precision",
        lambda requested, device, *, cpuinfo: real_choose(requested, device, cpuinfo=cpuinfo, measure=measure),
    )
    with caplog.at_level("INFO", logger="sharpen.trainer.precision"):
        first = resolve_precision("auto", CPU, num_threads=1)
        again = resolve_precision("auto", CPU, num_threads=1)
    assert first is again and first.precision == "bf16" and len(calls) == 2  # one probe: float32 and bf16
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 1 and "100 GFLOP/s" in lines[0] and "400 GFLOP/s" in lines[0]


def test_the_real_probe_measures_a_positive_speed_and_restores_threads():
    threads = torch.get_num_threads()
    for dtype in (torch.float32, torch.bfloat16):
        gflops = measure_matmul_gflops(dtype, CPU, size=64)
        assert math.isfinite(gflops) and gflops > 0
    assert torch.get_num_threads() == threads


@pytest.mark.parametrize(
    ("dtype", "precision", "engine", "master"),
    [
        ("auto", "bf16", "bfloat16", "float32"),
        ("auto", "float32", "float32", "float32"),
        ("float32", "bf16", "float32", "float32"),
        ("bfloat16", "float32", "bfloat16", "bfloat16"),
        ("bfloat16", "bf16", "bfloat16", "bfloat16"),
    ],
)
def test_the_engine_dtype_follows_the_resolved_precision(dtype, precision, engine, master):
    model = ModelConfig(dtype=dtype)
    assert model.engine_dtype(precision) == engine and model.master_dtype == master


def test_auto_is_the_default_of_both_keys():
    config = load_config(None)
    assert config.trainer.precision == "auto" and config.model.dtype == "auto"
    assert config.weight_sync.tolerance == "auto"


def test_bf16_autocast_gets_one_error_naming_trainer_precision(tmp_path: Path):
    recipe = tmp_path / "old.toml"
    recipe.write_text("[trainer]\nlearning_rate = 1e-5\nbf16_autocast = true\n")
    for path, overrides in ((recipe, []), (None, ["trainer.bf16_autocast=false"])):
        with pytest.raises(ConfigError) as info:
            load_config(path, overrides)
        message = str(info.value)
        assert "\n" not in message and message.startswith("trainer: bf16_autocast was replaced")
        assert 'trainer.precision = "bf16"' in message
    with pytest.raises(ValueError, match=re.escape('trainer.precision = "bf16"')):
        TrainerConfig.model_validate({"bf16_autocast": True})


def test_bf16_autocasts_over_float32_master_weights(model_dir: Path):
    ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    mask, targets = torch.ones_like(ids), torch.ones((2, 11), dtype=torch.bool)
    scores = {}
    for name in ("float32", "bf16"):
        config = TrainerConfig(device="cpu", precision=name)
        backend = SingleDeviceBackend(config, model_path=model_dir, dtype="float32")
        assert backend.precision.precision == name
        assert all(p.dtype == torch.float32 for p in backend.model.parameters())  # master weights stay float32
        with torch.no_grad():
            scores[name] = backend.score_tokens(ids, mask, targets, temperature=1.0).logprobs
            # the weight-sync probe computes without autocast: float32 arithmetic in both
            plain = backend.score_tokens(ids, mask, targets, temperature=1.0, use_autocast=False).logprobs
        scores[f"{name}-plain"] = plain
    assert torch.equal(scores["float32-plain"], scores["bf16-plain"])
    assert torch.equal(scores["float32"], scores["float32-plain"])
    assert not torch.equal(scores["bf16"], scores["float32"])  # bf16 rounding shows
    assert torch.allclose(scores["bf16"], scores["float32"], atol=0.1)
