"""Configuration of the runtime that drives the loop: one process ("embedded") or actors on a Ray cluster ("ray").

Pydantic only, like the rest of `sharpen.config`: a field's docstring is its help text. The loop is the same in
both runtimes; this section only says where the trainer and the engine live and how long a call to them may take.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal, cast

from pydantic import Field, model_validator

from sharpen.config.section import DeprecatedKeyWarning, Section, rename_keys


class RuntimeConfig(Section):
    """Where the components run. "ray" puts the trainer and the engine in one Ray actor each; the loop, the
    sampler, the environments and the rewards stay in the driver process."""

    type: Literal["embedded", "ray"] = "embedded"
    """"embedded": every component in this process (`orchestration/embedded.py`). "ray": the trainer and the engine
    as Ray actors. ("local", its name before, still loads, with a deprecation line.)"""
    address: str | None = None
    """Address of a running Ray cluster ("auto", "ray://host:10001", "host:6379"); None starts a local Ray instance
    (stopped at the end of the run). The embedded runtime uses Ray only for reward models with backend = "ray" and
    for fleets."""
    ray_cpus: int | None = Field(default=None, ge=1)
    """CPUs of the local Ray instance (None: all of this machine's); only when address is None. (num_cpus before:
    a fleet's num_cpus is what each of its replicas reserves.)"""
    trainer_cpus: float = Field(default=0.5, gt=0.0)
    """CPUs reserved for the trainer actor (fractions allowed; leave room on small machines: an actor waiting
    for CPUs never starts)."""
    engine_cpus: float = Field(default=0.5, gt=0.0)
    """CPUs reserved for the engine actor (fractions allowed)."""
    trainer_ranks: int = Field(default=1, ge=1)
    """Data-parallel trainer ranks, one actor each: 1 runs the single-device backend, more run FSDP2 (gloo on the
    CPU, NCCL with GPUs), each rank reserving trainer_cpus and trainer_gpus."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """How the placement group of the trainer ranks and the engine spreads over nodes (Ray's strategies: PACK
    fills as few nodes as possible, SPREAD uses as many as possible; STRICT_ variants fail rather than bend)."""
    trainer_gpus: float = Field(default=0.0, ge=0.0)
    """GPUs reserved for the trainer actor (Ray sets its CUDA_VISIBLE_DEVICES). Not yet exercised on a GPU."""
    engine_gpus: float = Field(default=0.0, ge=0.0)
    """GPUs reserved for the engine actor. Not yet exercised on a GPU."""
    colocate: bool = False
    """Trainer and engine share devices: the engine sleeps (frees its weights and cache) while the trainer steps and
    wakes for the weight sync after the step. In the Ray runtime engine replica i goes into trainer rank i's
    placement bundle (so rollout.num_engines must equal trainer_ranks) and, with GPUs, trainer_gpus +
    engine_gpus must be at most 1 (e.g. 0.5 each: both actors on the same GPU). Sync mode only; vLLM needs its
    sleep mode (CUDA, ROCm, XPU), the hf and scripted engines sleep anywhere."""
    call_timeout_s: float = Field(default=600.0, gt=0.0)
    """Longest wait for any call to an actor (a generate, a training step, a weight sync); past it the run stops
    with an error naming the actor and the call."""
    start_timeout_s: float = Field(default=1800.0, gt=0.0)
    """Longest wait for an actor to start and build its component (loading a model, starting vLLM)."""
    max_restarts: int = Field(default=0, ge=0)
    """Ray runtime: how many times a run whose trainer rank or engine actor died (its process ended: a crash, an OOM
    kill, a lost node) restarts itself: the actors are stopped, started again and the run continues from its newest
    complete checkpoint (as ``--resume auto`` would), with one line in the log; past this many the run stops with the
    actor's error. 0: a dead actor ends the run. A hung actor (call_timeout_s) or an error raised by a component is
    never restarted. The embedded runtime restarts nothing: rerun its command with ``--resume auto``."""

    @model_validator(mode="before")
    @classmethod
    def _rename_old_keys(cls, data: Any) -> Any:
        renamed = rename_keys(data, {"num_cpus": "ray_cpus"}, section="runtime")
        if not isinstance(renamed, dict):
            return renamed
        section = cast(dict[str, Any], renamed)
        if section.get("type") != "local":
            return section
        warnings.warn(
            'runtime.type = "local" is now called "embedded": write runtime.type = "embedded"',
            DeprecatedKeyWarning,
            stacklevel=2,
        )
        return {**section, "type": "embedded"}

    @model_validator(mode="after")
    def _check_local_instance(self) -> RuntimeConfig:
        if self.ray_cpus is not None and self.address is not None:
            raise ValueError("runtime.ray_cpus sizes a local Ray instance; leave it unset with runtime.address")
        if self.colocate and self.trainer_gpus + self.engine_gpus > 1:
            raise ValueError(
                f"runtime.colocate puts a trainer rank and an engine on one GPU, but trainer_gpus = "
                f"{self.trainer_gpus:g} and engine_gpus = {self.engine_gpus:g} add up to more than 1 "
                "(use fractions, e.g. 0.5 each)"
            )
        return self
