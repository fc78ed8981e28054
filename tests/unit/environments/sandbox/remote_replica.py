"""A sandbox replica for test_remote_kill.py, run as its own process: the real `SandboxService` over a bwrap pool
that also appends the stdout of every execution it finished to a log file, so that the test can tell which replica
ran what (the sandboxed programs themselves cannot write to the host).

Run: python remote_replica.py LOG_PATH; prints the service's URL on its first line, then serves until killed.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from sharpen.config.sandbox import SandboxConfig
from sharpen.environments.sandbox import SandboxPool
from sharpen.environments.sandbox.service import SandboxService


class LoggingPool:
    """`SandboxPool`'s calls, each finished execution's stdout appended to ``log_path`` (one line each)."""

    def __init__(self, pool: SandboxPool, log_path: str) -> None:
        self.pool, self.sandbox, self.report, self.config = pool, pool.sandbox, pool.report, pool.config
        self.log = open(log_path, "a", buffering=1)  # noqa: SIM115 - lives as long as the process

    async def run_python(self, code: str, **kwargs: Any) -> Any:
        result = await self.pool.run_python(code, **kwargs)
        self.log.write(result.stdout.strip() + "\n")
        return result

    async def run(self, argv: Any, **kwargs: Any) -> Any:
        result = await self.pool.run(argv, **kwargs)
        self.log.write(result.stdout.strip() + "\n")
        return result


def main(log_path: str) -> None:
    config = SandboxConfig(backend="bwrap", wall_seconds=20.0, max_concurrency=2, prepare_ahead=False)
    with SandboxPool(config) as pool:
        service = SandboxService(config, pool=LoggingPool(pool, log_path), token=os.environ["SHARPEN_SERVICE_TOKEN"])  # type: ignore[arg-type]
        print(service.url, flush=True)
        service.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1])
