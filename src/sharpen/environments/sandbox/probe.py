"""Choosing a backend: the strongest one that actually works here, and an honest report of what it lacks.

Owns the order of preference, the probe (a trivial command run through the real launch chain, cgroups
included), the isolation report, and the refusal of isolation weaker than ``min_isolation``: a backend below it,
chosen by "auto" after stronger ones failed or named in the config, raises SandboxUnavailable with one message
that says what failed and how to accept less. Anything below strong that is accepted is logged as a warning.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence

from sharpen.config.sandbox import SandboxConfig
from sharpen.environments.sandbox.backends import Backend
from sharpen.environments.sandbox.result import (
    ExecutionResult,
    ExecutionStatus,
    IsolationLevel,
    IsolationReport,
    SandboxUnavailable,
)

logger = logging.getLogger(__name__)

PROBE_ARGV = ["true"]


_LEVELS: tuple[IsolationLevel, ...] = ("weak", "medium", "strong")


def host_gaps(*, has_pids_cgroup: bool, has_memory_cgroup: bool, has_cpu_cgroup: bool) -> list[str]:
    """Protections missing because of this host, whatever the backend."""
    gaps = []
    if not has_pids_cgroup:
        gaps.append("process-count limit: no writable pids cgroup, a fork bomb is stopped only by wall_seconds")
    if not has_memory_cgroup:
        gaps.append("job-wide memory limit and the oom status: no writable memory cgroup (RLIMIT_AS per process only)")
    if not has_cpu_cgroup:
        gaps.append("CPU-bandwidth limit (cpu_fraction): no writable cpu cgroup, an execution may use every core")
    if os.geteuid() != 0:
        gaps.append("separate uid: not root, so the code runs as our own user (mapped to 65534 inside bwrap)")
    return gaps


def select_backend(
    config: SandboxConfig,
    candidates: Sequence[Backend],
    probe: Callable[[Backend], ExecutionResult],
    *,
    host_missing: list[str],
) -> tuple[Backend, IsolationReport]:
    """The first of ``candidates`` (strongest first) at ``config.min_isolation`` or above whose probe succeeds,
    or SandboxUnavailable. Backends below that level are never probed: they would run code."""
    if config.backend != "auto":
        candidates = [backend for backend in candidates if backend.name == config.backend]
    accepted = [b for b in candidates if _LEVELS.index(b.level) >= _LEVELS.index(config.min_isolation)]
    failures: list[str] = []
    for backend in accepted:
        reason = backend.unavailable_reason()
        if reason is None:
            result = probe(backend)
            if result.status == ExecutionStatus.OK:
                report = IsolationReport(
                    backend=backend.name, level=backend.level, missing=(*backend.missing(), *host_missing)
                )
                _warn(report, failures)
                return backend, report
            reason = f"probe ended {result.status}: {result.detail or result.stderr.strip()}"
        failures.append(f"{backend.name}: {reason}")
        if config.backend == "auto":
            logger.info("sandbox backend %s does not work here (%s)", backend.name, reason)
    weaker = [b for b in candidates if b not in accepted]
    message = f"no sandbox backend with at least {config.min_isolation} isolation (sandbox.min_isolation) works here"
    if failures:
        message += ": " + "; ".join(failures)
    if weaker:
        names = ", ".join(f"{b.name!r} ({b.level})" for b in weaker)
        message += (
            f". Weaker backends were not tried: {names}. Install bubblewrap (make system-deps) or fix the failure "
            f"above; to run untrusted code less protected on purpose, lower sandbox.min_isolation to "
            f"{weaker[0].level!r}."
        )
    raise SandboxUnavailable(message)


def _warn(report: IsolationReport, failures: list[str]) -> None:
    stronger = f" (stronger backends failed: {'; '.join(failures)})" if failures else ""
    if report.level == "weak":
        logger.warning(
            "sandbox backend %r gives weak isolation%s (accepted: min_isolation = 'weak'); missing: %s",
            report.backend,
            stronger,
            "; ".join(report.missing),
        )
    elif report.missing or report.level != "strong":
        logger.warning(
            "sandbox backend %r gives %s isolation%s; missing: %s",
            report.backend,
            report.level,
            stronger,
            "; ".join(report.missing) or "nothing",
        )
