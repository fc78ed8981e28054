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


class SharedVllmEngine:
    """SmolLM2 on vLLM's batch engine (float32, seed 0), started on first use and shared by the modules that need
    that very engine (a start costs 40 s or more on 2 cores): test_vllm_async's reference and test_vllm_sync's engine.
    Tests load weights into it; one that needs SmolLM2's own loads them (`with_smollm2_weights`). The last module to
    use it (test_vllm_sync) closes it when it ends, so it holds no memory through the rest of the session; a later
    use starts a new one."""

    def __init__(self, model_path: Path) -> None:
        self.model_path = model_path
        self._engine = None

    def get(self):
        if self._engine is None:
            from sharpen.config.engines import VllmEngineConfig
            from sharpen.rollout.engines.vllm import VllmEngine

            self._engine = VllmEngine(VllmEngineConfig(), model_path=self.model_path, dtype="float32", seed=0)
        return self._engine

    def with_smollm2_weights(self):
        """The engine, holding SmolLM2's own weights again (version 0)."""
        from safetensors.torch import load_file

        engine = self.get()
        engine.load_weights(load_file(self.model_path / "model.safetensors").items(), version=0)
        return engine

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None


@pytest.fixture(scope="session")
def shared_vllm_engine(smollm2_path: Path) -> Iterator[SharedVllmEngine]:
    shared = SharedVllmEngine(smollm2_path)
    yield shared
    shared.close()
