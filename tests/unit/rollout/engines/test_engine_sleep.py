"""Engines that sleep while a colocated trainer steps (runtime.colocate): the memory really goes, nothing runs while
asleep, and after waking every weight must be loaded again before the engine answers — a missed weight is an error,
never stale or uninitialised numbers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sharpen.rollout.engines import EngineError, SleepableEngine, sleepable
from sharpen.rollout.engines.hf import HfEngine
from sharpen.rollout.engines.router import EngineRouter
from sharpen.rollout.engines.scripted import ScriptedEngine
from sharpen.types import SamplingParams

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path) -> HfEngine:
    return HfEngine(tiny_model_path)


def test_the_hf_engine_frees_its_weights_asleep_and_answers_the_same_once_reloaded(engine: HfEngine) -> None:
    prompt = [[1, 2, 3, 4]]
    before = engine.generate(prompt, [GREEDY])[0]
    probe = engine.score([5, 6, 7, 8, 9])
    state = {name: tensor.clone() for name, tensor in engine.model.state_dict().items()}
    num_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    assert isinstance(engine, SleepableEngine)

    assert engine.sleep() == {"colocate/freed_bytes": float(num_bytes)}
    assert engine.is_asleep and all(p.numel() == 0 for p in engine.model.parameters())
    assert engine.sleep() == {"colocate/freed_bytes": 0.0}, "a second sleep frees nothing more"
    with pytest.raises(EngineError, match=r"generate\(\) while asleep"):
        engine.generate(prompt, [GREEDY])
    with pytest.raises(EngineError, match=r"score\(\) while asleep"):
        engine.score([1, 2])
    with pytest.raises(EngineError, match=r"load_weights\(\) while asleep"):
        engine.load_weights(state.items(), version=1)

    engine.wake_up()
    assert all(torch.isnan(p).all() for p in engine.model.parameters()), "woken weights are NaN until loaded"
    with pytest.raises(EngineError, match=r"weights never loaded"):
        engine.generate(prompt, [GREEDY])
    some = [(name, tensor) for name, tensor in state.items() if "layers.1." not in name]
    with pytest.raises(EngineError, match=r"left \d+ woken weights unloaded \(e.g. 'model.layers.1"):
        engine.load_weights(some, version=1)
    with pytest.raises(EngineError, match="weights never loaded"):
        engine.score([1, 2])

    metrics = engine.load_weights(state.items(), version=1)
    assert metrics["sync/num_tensors"] == len(state) and engine.policy_version == 1
    after = engine.generate(prompt, [GREEDY])[0]
    assert after.token_ids == before.token_ids and after.logprobs == pytest.approx(before.logprobs, abs=1e-6)
    assert engine.score([5, 6, 7, 8, 9]) == pytest.approx(probe, abs=1e-6)


def test_a_tied_weight_counts_as_loaded_under_either_name(tiny_model_path: Path) -> None:
    engine = HfEngine(tiny_model_path)
    model = engine.model
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight, "the tiny Llama ties them"
    state = dict(model.state_dict())
    engine.sleep()
    engine.wake_up()
    state.pop("model.embed_tokens.weight")  # the lm head's name only: the shared storage is loaded all the same
    engine.load_weights(list(state.items()), version=3)
    assert engine.policy_version == 3 and not any(torch.isnan(p).any() for p in engine.model.parameters())


def test_the_scripted_engine_refuses_work_while_asleep_and_until_reloaded() -> None:
    engine = ScriptedEngine(["abc"], encode=lambda text: [ord(ch) for ch in text])
    assert len(engine.generate([[1]], [GREEDY])) == 1
    engine.sleep()
    with pytest.raises(EngineError, match="asleep"):
        engine.generate([[1]], [GREEDY])
    with pytest.raises(EngineError, match="asleep"):
        engine.load_weights([], version=1)
    engine.wake_up()
    with pytest.raises(EngineError, match="before weights were loaded"):
        engine.score([1, 2])
    engine.load_weights([], version=1)
    assert engine.score([1, 2]) == [-1.0] and engine.num_sleeps == 1


class Awake:
    """An engine without sleep."""

    policy_version = 0


def test_the_router_puts_every_replica_to_sleep_and_names_one_that_cannot() -> None:
    encode = lambda text: [1]  # noqa: E731
    a, b = ScriptedEngine(["x"], encode=encode), ScriptedEngine(["y"], encode=encode)
    router = EngineRouter([a, b])
    assert isinstance(router, SleepableEngine)
    assert router.sleep() == {"colocate/freed_bytes": 0.0}
    assert a.is_asleep and b.is_asleep
    router.wake_up()
    assert not a.is_asleep and a.needs_weights and b.needs_weights
    mixed = EngineRouter([a, Awake()], names=["a", "b"])  # type: ignore[list-item]
    with pytest.raises(EngineError, match=r"b \(Awake\) cannot sleep"):
        mixed.sleep()
    with pytest.raises(EngineError, match=r"the engine \(Awake\) cannot sleep, which runtime.colocate needs"):
        sleepable(Awake())


def test_vllm_without_sleep_mode_refuses_colocation_before_starting(tiny_model_path: Path) -> None:
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    from sharpen.config.engines import VllmEngineConfig
    from sharpen.rollout.engines.vllm import VllmEngine

    if current_platform.is_sleep_mode_available():
        pytest.skip("this platform has vLLM's sleep mode (benchmarks/gpu_check.sh runs it)")
    with pytest.raises(EngineError, match=r"runtime\.colocate needs vLLM's sleep mode, which vLLM does not offer"):
        VllmEngine(VllmEngineConfig(), model_path=tiny_model_path, dtype="float32", seed=0, sleep_mode=True)
