"""Fixtures shared by the integration tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def ray_instance() -> Iterator[None]:
    """One local Ray instance per module, two CPUs (actors take fractions, so nothing starves). Ray workers do not
    inherit pytest's sys.path: this folder goes on their PYTHONPATH, so fakes defined in test modules import."""
    ray = pytest.importorskip("ray")
    saved = {name: os.environ.get(name) for name in ("RAY_AUTH_MODE", "PYTHONPATH")}
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).parent), saved["PYTHONPATH"]) if p)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
