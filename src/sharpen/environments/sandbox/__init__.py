"""Running untrusted, model-written code: `Sandbox` (one fresh sandbox per execution) and `SandboxPool`
(asyncio, bounded concurrency, optionally warm workers). Code-execution environments and code-test rewards call
it; it knows neither. It returns what happened (`ExecutionResult`, with an `ExecutionStatus`); it does not judge
the output, install packages, or give the code a network.

Backends, chosen at construction by running a trivial command through each (probe.py); `Sandbox.report`
(`IsolationReport`) names the backend, its level and every protection it lacks on this host:

- ``bwrap`` (strong): bubblewrap run as uid 65534; own user, mount, pid, network (loopback only), IPC, UTS and
  cgroup namespaces; a minimal read-only filesystem (/usr, a few /etc files copied in, private tmpfs /tmp and
  home; nothing of /work, /root, the project or any host directory of ours); an empty environment; a seccomp
  filter. See bwrap.py.
- ``unshare`` (medium): own mount, pid, network, IPC and UTS namespaces, private /tmp, /run, /home and /root, uid
  65534; the rest of the host filesystem is visible, protected only by permissions.
- ``process`` (weak): a child process with rlimits, as uid 65534 when we are root, in a host work dir.

A backend below ``min_isolation`` (default strong) is refused with `SandboxUnavailable`, whether "auto" would
fall to it after a stronger one failed or the config names it; it is never probed. Accepted weaker isolation is
logged as a warning.

Every chain ends in the same init (warm_controller.py, once mode), pid 1 of the sandbox: it unpacks the files
into the private home, sets the rlimits on the program alone, writes the ready marker, and reports the program's
real wait status on a pipe the program never holds, so an exit code can never pose as a signal or a timeout and
every signal number (real-time ones too) is reported as it is. Once the program has started, nothing it does
can make the result a ``sandbox_error`` (`ExecutionResult.is_program_started`; see result.classify).

Every backend adds the same limits: RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_NOFILE and no core dumps, set on
the program alone; a pids cgroup (RLIMIT_NPROC does not bind root), a memory cgroup and a cpu cgroup (at most
``cpu_fraction`` of a core) per execution, v1 or v2 as the host has them, which also tell "oom" apart and let the
wall-clock timeout kill the whole process tree, daemons included; stdout and stderr capped at max_output_bytes
each. Nothing outlives an execution: processes, cgroups and files are gone when `run` returns.

Cold executions are prepared ahead (``prepare_ahead``, bwrap): while one program runs, the sandbox of the next
sets itself up and waits, blocked right before its program (launch.py). It has run nothing when it is used, and
serves one execution only: every execution still gets fresh namespaces, cgroups and work dir.

Warm workers (``warm_workers = true``, `SandboxPool` only, bwrap only): each worker is one bwrap sandbox as above,
started once, whose controller (pid 1, warm_controller.py) forks a child per job: the rlimits set in the child,
the wall clock enforced per job, and after each job every process of the sandbox but the controller killed,
/home/sandbox and /tmp emptied and put back as they were (mode, extended attributes, access and modification
times). A job that leaves what cannot be undone (an entry that will not go, a socket alive in the kernel after
its processes) gets its worker replaced before the next job. A few ms per job instead of ~20 ms.

What warm mode does NOT give: the jobs of one worker share one sandbox, one after another. They share its
namespaces and its cgroup (the pids and memory limits hold per worker, so per job since jobs never overlap), and
a Python job runs in a fork of the worker's interpreter (its modules already imported) rather than a fresh one.
A job cannot reach another job's files, stdin or output (the controller never holds them; it sees a job's argv
only), nor signal, trace or read the controller, nor leave a process or a file behind, nor keyring or SysV/POSIX
message-queue state (the seccomp filter denies those calls). What remains shared is what no job can change
without capabilities (routes, sysctls, hostname), the timing of the machine, and counters a job can read but not
set: the pids and inode numbers it is given (how many earlier jobs forked or created files) and the ctime of
/home/sandbox and /tmp (when the last reset ran). Jobs that must not share even a kernel namespace with earlier
jobs need the cold `Sandbox`.
"""

from sharpen.environments.sandbox.pool import SandboxPool
from sharpen.environments.sandbox.result import (
    ExecutionResult,
    ExecutionStatus,
    IsolationReport,
    SandboxUnavailable,
)
from sharpen.environments.sandbox.sandbox import Sandbox

__all__ = ["ExecutionResult", "ExecutionStatus", "IsolationReport", "Sandbox", "SandboxPool", "SandboxUnavailable"]
