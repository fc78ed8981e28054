"""Fixtures shared by the integration tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from sharpen.config.schema import TrainerConfig
from sharpen.trainer import SingleDeviceBackend, Trainer


@pytest.fixture(scope="module")
def ray_instance() -> Iterator[None]:
    """One local Ray instance per module, two CPUs (actors take fractions, so nothing starves). Ray workers do not
    inherit pytest's sys.path: this folder goes on their PYTHONPATH, so fakes defined in test modules import."""
    ray = pytest.importorskip("ray")
    saved = {name: os.environ.get(name) for name in ("RAY_AUTH_MODE", "PYTHONPATH")}
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).parent), saved["PYTHONPATH"]) if p)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="module")
def trainer(smollm2_path: Path) -> Trainer:
    """SmolLM2 on one device at lr 1e-3, one per module (tests move its weights): the engine tests' trainer side.
    float32, not the CPU's choice: the tests compare its logprobs with a float32 engine's to 1e-3."""
    config = TrainerConfig(learning_rate=1e-3, micro_batch_size=4, num_threads=2, precision="float32")
    return Trainer(
        config, backend=SingleDeviceBackend(config, model_path=smollm2_path, dtype="float32"), pad_token_id=2
    )


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)
