"""Internal knobs (marked in the schema, left out of `sharpen config --keys`) and the thread count the runtime
derives when a recipe does not set one."""

from __future__ import annotations

import os

import pytest
from pydantic import ConfigDict, Field

from sharpen.config import ConfigError, load_config
from sharpen.config.engines import ScriptedEngineConfig, VllmEngineConfig
from sharpen.config.schema import TrainerConfig, WeightSyncConfig
from sharpen.config.section import Section, internal, is_internal


class _Knobs(Section):
    model_config = ConfigDict(json_schema_extra=internal())

    shown: int = 1
    hidden: int = Field(default=2, json_schema_extra=internal())


def test_internal_marks_fields_and_sections():
    assert is_internal(_Knobs) and not is_internal(VllmEngineConfig)
    assert is_internal(_Knobs.model_fields["hidden"]) and not is_internal(_Knobs.model_fields["shown"])
    assert is_internal(ScriptedEngineConfig) and is_internal(WeightSyncConfig.model_fields["probe_text"])
    assert _Knobs(hidden=3).hidden == 3  # still settable


def test_num_threads_set_in_the_recipe_wins(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    assert TrainerConfig(num_threads=3).resolved_num_threads == 3


def test_num_threads_follows_omp_num_threads_where_set(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what Ray gives an actor with one CPU
    assert TrainerConfig().resolved_num_threads == 1


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="the CPU affinity call is Linux's")
def test_num_threads_defaults_to_the_cores_this_process_may_run_on(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 2, 5})  # e.g. under `taskset -c 0,2,5`
    assert TrainerConfig().resolved_num_threads == 3


@pytest.mark.parametrize(
    "override", ['environment={type = "python", sandbox = {memory_mb = 256}}', "reward.sandbox.memory_mb=256"]
)
def test_the_sandbox_is_one_top_level_section(override: str):
    assert load_config(None, ["sandbox.memory_mb=256"]).sandbox.memory_mb == 256
    with pytest.raises(ConfigError, match=r"sandbox: unknown key \(it moved to \[sandbox\]\)"):
        load_config(None, [override])
