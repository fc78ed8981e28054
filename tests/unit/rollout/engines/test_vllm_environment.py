"""The CPU build's core binding: one set of cores per tensor-parallel rank, replaced when the rank count changes
(sharpen's own value), never when a user set it, and a clear error when there are fewer cores than ranks."""

from __future__ import annotations

import pytest
import torch

from sharpen.rollout.engines import EngineError
from sharpen.rollout.engines import vllm as vllm_engine


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(vllm_engine.os, "cpu_count", lambda: 4)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(vllm_engine, "_bound_by_us", None)
    return monkeypatch


def bind() -> str | None:
    return vllm_engine.os.environ.get("VLLM_CPU_OMP_THREADS_BIND")


def test_each_tensor_parallel_rank_gets_cores_of_its_own(machine: pytest.MonkeyPatch) -> None:
    vllm_engine.prepare_cpu_environment(1)
    assert bind() == "0-3"
    vllm_engine.prepare_cpu_environment(2)
    assert bind() == "0-1|2-3"
    vllm_engine.prepare_cpu_environment(4)
    assert bind() == "0|1|2|3"
    with pytest.raises(EngineError, match="4 cores cannot hold tensor_parallel_size = 8"):
        vllm_engine.prepare_cpu_environment(8)


def test_a_users_binding_is_kept(machine: pytest.MonkeyPatch) -> None:
    machine.setenv("VLLM_CPU_OMP_THREADS_BIND", "1|3")
    vllm_engine.prepare_cpu_environment(2)
    assert bind() == "1|3"


def test_a_users_binding_for_another_number_of_workers_is_one_clear_error(machine: pytest.MonkeyPatch) -> None:
    machine.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    vllm_engine.prepare_cpu_environment(1)
    with pytest.raises(EngineError, match=r"= '0-1' binds 1 vLLM worker\(s\), but tensor_parallel_size = 2"):
        vllm_engine.prepare_cpu_environment(2)
