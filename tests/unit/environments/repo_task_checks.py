"""The default repository task set the repository environment's tests run on (the Makefile's DEFAULT_TASKS, built
by `make tasks`); the ``task`` fixture over it is in conftest.py."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
TASKS_DIR = ROOT / ".sharpen-tasks" / "h11-0.16.0-seed0"
