"""Choosing a backend: the strongest one that actually works here, and an honest report of what it lacks.

Owns the order of preference, the probe (a trivial command run through the real launch chain, cgroups
included), the isolation report, and the refusal of weak isolation. Weak isolation is never silent: it is logged
as a warning and, unless ``allow_weak_isolation``, refused with SandboxUnavailable.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence

from sharpen.config.sandbox import SandboxConfig
from sharpen.environments.sandbox.backends import Backend
from sharpen.environments.sandbox.result import ExecutionResult, ExecutionStatus, IsolationReport, SandboxUnavailable

logger = logging.getLogger(__name__)

PROBE_ARGV = ["true"]


def host_gaps(*, has_pids_cgroup: bool, has_memory_cgroup: bool) -> list[str]:
    """Protections missing because of this host, whatever the backend."""
    gaps = []
    if not has_pids_cgroup:
        gaps.append("process-count limit: no writable pids cgroup, a fork bomb is stopped only by wall_seconds")
    if not has_memory_cgroup:
        gaps.append("job-wide memory limit and the oom status: no writable memory cgroup (RLIMIT_AS per process only)")
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
    """The first of ``candidates`` (strongest first) whose probe succeeds, or SandboxUnavailable."""
    if config.backend != "auto":
        candidates = [backend for backend in candidates if backend.name == config.backend]
    failures: list[str] = []
    for backend in candidates:
        reason = backend.unavailable_reason()
        if reason is None:
            result = probe(backend)
            if result.status == ExecutionStatus.OK:
                report = IsolationReport(
                    backend=backend.name, level=backend.level, missing=(*backend.missing(), *host_missing)
                )
                _check_report(config, report, failures)
                return backend, report
            reason = f"probe ended {result.status}: {result.detail or result.stderr.strip()}"
        failures.append(f"{backend.name}: {reason}")
        if config.backend == "auto":
            logger.info("sandbox backend %s does not work here (%s)", backend.name, reason)
    raise SandboxUnavailable("no sandbox backend works on this host: " + "; ".join(failures))


def _check_report(config: SandboxConfig, report: IsolationReport, failures: list[str]) -> None:
    stronger = f" (stronger backends failed: {'; '.join(failures)})" if failures else ""
    if report.level == "weak":
        message = (
            f"the only sandbox that works here is the {report.backend!r} backend, weak isolation{stronger}; "
            f"missing: {'; '.join(report.missing)}"
        )
        if not config.allow_weak_isolation:
            raise SandboxUnavailable(
                message + ". Untrusted code would run almost unprotected; install bubblewrap, or set "
                "sandbox.allow_weak_isolation = true to accept this."
            )
        logger.warning("%s (accepted: allow_weak_isolation)", message)
    elif report.missing or report.level != "strong":
        logger.warning(
            "sandbox backend %r gives %s isolation%s; missing: %s",
            report.backend,
            report.level,
            stronger,
            "; ".join(report.missing) or "nothing",
        )
