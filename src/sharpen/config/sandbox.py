"""Configuration of the sandbox that runs untrusted, model-written code (`sharpen.environments.sandbox`).

Pydantic only, like the rest of `sharpen.config`: a field's docstring is its help text. The section is mounted in
the run schema by the environments that execute code; this module does not know them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from sharpen.config.section import Section, internal
from sharpen.config.service import RemoteConfig, ServiceConfig, ServiceFleetConfig

_SANDBOX_PATHS = ("/home/sandbox", "/tmp", "/proc", "/dev")


class SandboxConfig(Section):
    """Where and under which limits untrusted code runs. Every limit applies to one execution."""

    backend: Literal["auto", "bwrap", "unshare", "process", "remote"] = "auto"
    """Isolation mechanism: bubblewrap (strong: own user, mount, pid, network and IPC namespaces, a minimal
    read-only filesystem), unshare (medium: own namespaces but the host filesystem stays visible, read-only by
    permissions), a plain process with rlimits (weak: no isolation beyond a non-root uid). "auto" picks the strongest
    that works on this host, checked by running a trivial command in each. Either way a backend weaker than
    ``min_isolation`` is refused. "remote": executions run on `sharpen serve-sandbox` replicas (``remote.urls``),
    whose own [sandbox] section chooses their isolation."""
    min_isolation: Literal["strong", "medium", "weak"] = "strong"
    """The weakest isolation accepted. The backend chosen (or named in ``backend``) must give at least this
    level, or the Sandbox refuses to start with SandboxUnavailable: a host where bubblewrap fails never falls back
    to unshare or a plain process silently. Lower it only to run untrusted code less protected on purpose."""
    wall_seconds: float = Field(default=10.0, gt=0.0)
    """Wall-clock limit; at the limit every process of the execution is killed and the status is "timeout"."""
    cpu_seconds: int = Field(default=10, ge=1)
    """CPU-time limit of each process (RLIMIT_CPU); reaching it ends the process (status "timeout")."""
    cpu_fraction: float = Field(default=1.0, gt=0.0, le=1024.0)
    """CPU cores one execution may use at once, all its processes and threads together (a cpu cgroup's
    bandwidth limit), so that concurrent executions cannot starve the trainer. Where the host has no writable cpu
    controller, the isolation report names it as missing."""
    memory_mb: int = Field(default=512, ge=32)
    """Memory of one execution in MiB. Where a memory cgroup can be made it holds all processes of the execution
    together, files in its tmpfs included (exceeding it is "oom"), and RLIMIT_AS caps each process's address space at
    twice this value (address space runs ahead of resident memory). Without a memory cgroup, RLIMIT_AS alone caps
    each process at this value and running out shows as the program's own error."""
    file_size_mb: int = Field(default=16, ge=1)
    """Largest file a process may write (RLIMIT_FSIZE)."""
    max_open_files: int = Field(default=64, ge=16)
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    max_processes: int = Field(default=32, ge=1)
    """Processes and threads of the execution together, held by a pids cgroup (RLIMIT_NPROC does not bind root);
    the sandbox's own helper processes are not counted."""
    max_output_bytes: int = Field(default=1 << 20, ge=1)
    """Bytes kept of stdout and of stderr each. An execution that writes more is killed (status "killed",
    is_output_truncated)."""
    max_concurrency: int = Field(default=2, ge=1)
    """Executions a SandboxPool runs at once (and warm workers it keeps)."""
    prepare_ahead: bool = Field(default=True, json_schema_extra=internal())
    """While one execution runs, set up the sandbox of the next (bwrap): its namespaces, mounts, cgroups and uid
    drop are then off the critical path (about a quarter more cold executions per second on a busy 2-core host).
    An idle Sandbox holds one prepared sandbox (two sleeping processes) that has run nothing."""
    warm_workers: bool = False
    """SandboxPool keeps long-lived sandboxed workers that fork per job (a few ms instead of ~20 ms per execution).
    Jobs run by one worker share that worker's sandbox, one after another; see the sandbox package docstring."""
    extra_ro_binds: list[str] = Field(default_factory=list[str])
    """Host paths made visible read-only inside the sandbox, as "SRC" (same path inside) or "SRC:DEST" (e.g. a
    site-packages directory). Honoured by the bwrap backend; the others see the host's filesystem anyway."""
    python_executable: str = Field(default="/usr/bin/python3", json_schema_extra=internal())
    """Interpreter of run_python: the system Python (not the project's virtual environment), started with
    ``-E -s -S`` so that no environment variable, user or site directory shapes it."""
    work_root: str | None = Field(default=None, json_schema_extra=internal())
    """Host directory of a Sandbox's own state (warm workers' logs) and, for the weak ``process`` backend only,
    its executions' work directories (None: /dev/shm when present, else the system temp dir). The other backends
    give every execution a private tmpfs home: nothing of an execution is on a host filesystem."""

    remote: RemoteConfig = Field(default_factory=RemoteConfig)
    """The `sharpen serve-sandbox` replicas of ``backend = "remote"`` and how calls to them are retried."""
    service: ServiceConfig = Field(default_factory=ServiceConfig)
    """How `sharpen serve-sandbox` admits work (its queue, request limits, idle sessions); read by the server."""
    fleet: ServiceFleetConfig | None = None
    """With ``backend = "remote"``: the run starts the replicas itself, as Ray actors that serve this section with
    ``fleet.backend``, and fills ``remote.urls`` with their URLs."""

    @model_validator(mode="after")
    def _check_remote(self) -> SandboxConfig:
        if self.backend == "remote" and not self.remote.urls and self.fleet is None:
            raise ValueError(
                'sandbox.backend = "remote" needs the replicas\' URLs in sandbox.remote.urls (or a sandbox.fleet)'
            )
        if self.fleet is not None and self.backend != "remote":
            raise ValueError('sandbox.fleet serves the sandbox to its clients: set sandbox.backend = "remote"')
        return self

    @field_validator("extra_ro_binds")
    @classmethod
    def _check_binds(cls, binds: list[str]) -> list[str]:
        for bind in binds:
            source, _, dest = bind.partition(":")
            dest = dest or source
            if not (source.startswith("/") and dest.startswith("/")):
                raise ValueError(f"extra_ro_binds entry {bind!r}: SRC and DEST must be absolute paths")
            if any(dest == path or dest.startswith(path + "/") for path in _SANDBOX_PATHS) or dest == "/":
                raise ValueError(f"extra_ro_binds entry {bind!r}: DEST may not cover the sandbox's own {dest}")
        return binds

    @field_validator("python_executable", "work_root")
    @classmethod
    def _check_absolute(cls, path: str | None) -> str | None:
        if path is not None and not path.startswith("/"):
            raise ValueError(f"{path!r} must be an absolute path")
        return path
