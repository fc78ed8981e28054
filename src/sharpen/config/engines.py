"""Inference engine sections (``rollout.engine``), chosen by their ``type``: in-process vLLM (batch or async),
vLLM and SGLang servers, transformers, and the scripted test engine (docs/engines.md)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from sharpen.config.section import Section, internal, rename_keys


class VllmEngineConfig(Section):
    type: Literal["vllm"] = "vllm"
    gpu_memory_utilization: float = Field(default=0.2, gt=0.0, le=1.0)
    """Fraction of device memory vLLM may take (on the CPU: of its KV-cache budget)."""
    max_model_len: int = Field(default=1024, ge=16)
    """Longest prompt + completion the engine accepts."""
    enforce_eager: bool = True
    """Disable CUDA graphs / compilation (start-up is faster; required on the CPU build)."""
    tensor_parallel_size: int = Field(default=1, ge=1)
    """GPUs (on the CPU build: sets of cores) one engine shards the model over, one vLLM worker each. Weight syncs
    reach every worker; in the Ray runtime give the engine actor as many GPUs (runtime.engine_gpus)."""
    async_engine: bool = False
    """Run vLLM's async engine (AsyncLLM) in this process: every episode's request goes to it on its own and vLLM
    batches them continuously, instead of sharpen grouping the requests that wait together into batch calls."""


class HfEngineConfig(Section):
    type: Literal["hf"] = "hf"


class EngineServerFields(Section):
    """Where an engine server is: a URL to connect to, or a server sharpen starts itself on ``host:port``."""

    url: str | None = None
    """The server's base URL (e.g. http://10.0.0.5:8000) to connect to; None: sharpen starts the server itself,
    stops it at the end of the run, and writes its output to the run directory's engine logs."""
    host: str = "127.0.0.1"
    """The address a server sharpen starts listens on."""
    port: int = Field(default=0, ge=0, le=65535)
    """The port a server sharpen starts listens on (0: any free port)."""
    start_timeout_s: float = Field(default=900.0, gt=0.0)
    """How long a server sharpen starts may take to become ready before the run stops with its log's end (named
    like the other start timeouts; startup_timeout_s before)."""
    extra_args: list[str] = Field(default_factory=list[str])
    """More command-line arguments for a server sharpen starts."""
    served_model_name: str | None = None
    """The model name the server must report (checked when connecting to a URL; None: the run's model path)."""

    @model_validator(mode="before")
    @classmethod
    def _rename_old_keys(cls, data: Any) -> Any:
        return rename_keys(data, {"startup_timeout_s": "start_timeout_s"}, section="rollout.engine")


class VllmServerEngineConfig(EngineServerFields):
    """vLLM behind its HTTP server (``vllm serve``): token ids in and out, continuous batching across every
    episode's requests, weight syncs through the development routes (VLLM_SERVER_DEV_MODE)."""

    type: Literal["vllm_server"] = "vllm_server"
    gpu_memory_utilization: float = Field(default=0.2, gt=0.0, le=1.0)
    """Fraction of device memory vLLM may take (on the CPU: of its KV-cache budget)."""
    max_model_len: int = Field(default=1024, ge=16)
    """Longest prompt + completion the engine accepts."""
    enforce_eager: bool = True
    """Disable CUDA graphs / compilation (start-up is faster; required on the CPU build)."""
    tensor_parallel_size: int = Field(default=1, ge=1)
    """GPUs (on the CPU build: sets of cores) the server shards the model over."""


class SglangEngineConfig(EngineServerFields):
    """SGLang behind its native HTTP API (``/generate`` with input ids, weight-update routes)."""

    type: Literal["sglang"] = "sglang"
    mem_fraction_static: float | None = Field(default=None, gt=0.0, lt=1.0)
    """SGLang's static memory fraction for a server sharpen starts (None: SGLang's default)."""
    tensor_parallel_size: int = Field(default=1, ge=1)
    """GPUs the server shards the model over (SGLang's --tp-size)."""
    deterministic_inference: bool = False
    """Start the server with --enable-deterministic-inference: only then does SGLang sample each request with its
    own seed (its ``sampling_seed``), the same in any batch; without it SGLang ignores per-request seeds. Costs
    throughput (batch-invariant kernels)."""
    enable_memory_saver: bool = False
    """Start the server with --enable-memory-saver, which `sleep`/`wake_up` (``runtime.colocate``) need: without
    it SGLang's release_memory_occupation frees nothing."""
    weights_dir: str | None = None
    """Folder for the safetensors snapshots that weight syncs write and the server loads
    (/update_weights_from_disk); the server must read it at the same path (same host or shared storage). None: a
    temporary folder on this host."""


class ScriptedEngineConfig(Section):
    """A fake engine that returns fixed texts, for tests of everything but the engine (internal: not listed)."""

    model_config = ConfigDict(json_schema_extra=internal())

    type: Literal["scripted"] = "scripted"
    completions: list[str] = Field(default_factory=lambda: ["<answer>0</answer>"])
    """Texts returned in turn."""


class FailoverConfig(Section):
    """What the router does when one of several engine replicas (rollout.num_engines > 1) fails: a request whose
    replica is down, unreachable, failing (HTTP 5xx) or stuck is sent to another serving replica with the same prompt
    and seed (on vLLM: the same tokens), and the failed replica is restarted in the background; it rejoins at the
    next weight sync (docs/engines.md)."""

    restart: bool = True
    """Restart a failed replica in the background: a server sharpen started gets a new server on the same port; a
    server at a URL is waited for until it answers again (in-process engines cannot be restarted). False: a failed
    replica stays out for the rest of the run."""
    replica_timeout_s: float | None = Field(default=None, gt=0.0)
    """A request (or a batch's share) one replica has not answered within this many seconds counts as a hang:
    the replica is taken out and restarted, and the request sent to another one. Keep it below
    rollout.request_timeout_s, which bounds a request with all its retries (None: only errors count as failures)."""
    replica_wait_s: float = Field(default=300.0, gt=0.0)
    """How long a request waits for a replica to serve again while none does (all are restarting) before the run
    stops with an error giving each replica's state."""
    max_retries: int = Field(default=3, ge=0)
    """How often one request is sent again after its replica failed before the run stops (a request that brings
    down every server it reaches is not retried for ever)."""


EngineConfig = Annotated[
    VllmEngineConfig | VllmServerEngineConfig | SglangEngineConfig | HfEngineConfig | ScriptedEngineConfig,
    Field(discriminator="type"),
]
