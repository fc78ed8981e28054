"""Two Ray nodes on this machine with two disks, for the tests of runs whose trainer writes on another node.

The head node runs as any Ray node does; the second node's ``ray start`` runs inside bubblewrap (``bwrap``), in its
own mount namespace where another folder is bind-mounted over the driver's output folder, and in its own UTS
namespace with the host name ``node2``. A file a trainer actor on node 2 writes under the output folder lands on
"node 2's disk", which the driver never sees, and the storage check names the host ``node2``: two machines with
local disks, faithfully enough for the start-up check and for checkpoints in an object store.

Each node is one ``ray start --block`` in its own session; `TwoNodes.stop` stops them by their process ids
(never ``ray stop``, which stops every Ray process on the machine, other tests' included) and reports any process
of theirs that outlived it.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

NODE2_HOST = "node2"
"""The host name the second node's processes see (their own UTS namespace)."""


@dataclass
class TwoNodes:
    """A running two-node cluster: ``address`` of its head, ``output_dir`` (the driver's disk at that path; node 2
    sees ``node2_disk`` there), and each node's ``ray start --block`` launcher with its log."""

    address: str
    output_dir: Path
    node2_disk: Path
    ray_temp: Path
    launchers: list[tuple[subprocess.Popen[bytes], Path]] = field(default_factory=list)

    def stop(self, *, timeout_s: float = 45.0) -> list[str]:
        """Stop node 2, then the head: SIGTERM to each ``ray start`` (it drains its node and stops what it started),
        then SIGKILL to whatever of theirs is left after ``timeout_s``; returns what had to be killed."""
        started = [psutil.Process(launcher.pid) for launcher, _ in self.launchers if launcher.poll() is None]
        tree = [*started, *(child for process in started for child in _children(process))]
        for launcher, _ in reversed(self.launchers):
            for process in _ray_start(launcher):
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.send_signal(signal.SIGTERM)
        _, alive = psutil.wait_procs(tree, timeout=timeout_s)
        killed = []
        for process in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                killed.append(f"{process.pid} {process.name()}")
                process.kill()
        psutil.wait_procs(alive, timeout=10)
        for launcher, _ in self.launchers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                launcher.wait(timeout=5)
        shutil.rmtree(self.ray_temp, ignore_errors=True)
        return killed


def bwrap_binary() -> str | None:
    return shutil.which("bwrap")


def start_two_nodes(folder: Path, *, head_cpus: int, node2_cpus: int, env: dict[str, str]) -> TwoNodes:
    """A head with ``head_cpus`` and a second node with ``node2_cpus`` under ``folder`` (the output folder, node 2's
    disk, the logs; Ray's own files in a short folder under /tmp: its socket paths must stay under 108 bytes);
    returns once both nodes are up. ``env``: the nodes' environment (their actors inherit it)."""
    output_dir, node2_disk = folder / "out", folder / "node2-disk"
    output_dir.mkdir()
    node2_disk.mkdir()
    ray_temp = Path(tempfile.mkdtemp(prefix="sharpen-2n-", dir="/tmp"))
    ray = str(Path(sys.executable).with_name("ray"))
    port = _free_port()
    common = ["--block", f"--temp-dir={ray_temp}", "--node-ip-address=127.0.0.1", "--object-store-memory=200000000"]
    nodes = TwoNodes(address=f"127.0.0.1:{port}", output_dir=output_dir, node2_disk=node2_disk, ray_temp=ray_temp)
    try:
        head = [ray, "start", "--head", f"--port={port}", f"--num-cpus={head_cpus}", "--include-dashboard=false"]
        _launch(nodes, [*head, *common], log=folder / "head.log", env=env)
        bwrap = [bwrap_binary() or "bwrap", "--dev-bind", "/", "/", "--bind", str(node2_disk), str(output_dir)]
        bwrap += ["--unshare-uts", "--hostname", NODE2_HOST, "--"]
        node2 = [ray, "start", f"--address={nodes.address}", f"--num-cpus={node2_cpus}"]
        _launch(nodes, [*bwrap, *node2, *common], log=folder / "node2.log", env=env)
    except BaseException:
        nodes.stop()
        raise
    return nodes


def _launch(nodes: TwoNodes, command: list[str], *, log: Path, env: dict[str, str], timeout_s: float = 90.0) -> None:
    """Start one node and wait until its ``ray start`` says it is up."""
    with log.open("wb") as out:
        launcher = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
    nodes.launchers.append((launcher, log))
    deadline = time.monotonic() + timeout_s
    while "Ray runtime started" not in log.read_text(errors="replace"):
        tail = log.read_text(errors="replace")[-3000:]
        if launcher.poll() is not None:
            raise RuntimeError(f"{' '.join(command[:4])} exited with {launcher.returncode}:\n{tail}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{' '.join(command[:4])} not up within {timeout_s:.0f} s:\n{tail}")
        time.sleep(0.5)


def _ray_start(launcher: subprocess.Popen[bytes]) -> list[psutil.Process]:
    """The ``ray start`` process of a launcher: the launcher itself, or bwrap's child."""
    try:
        process = psutil.Process(launcher.pid)
        return process.children() if process.name() == "bwrap" else [process]
    except psutil.NoSuchProcess:
        return []


def _children(process: psutil.Process) -> list[psutil.Process]:
    try:
        return process.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
