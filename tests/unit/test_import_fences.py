"""Fences import-linter cannot express (it rejects subpackages of external packages in contracts): FSDP and
DTensor are imported only by trainer backends and the weight-sync halves (docs/architecture.md)."""

from __future__ import annotations

import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "sharpen"
ALLOWED = ("trainer/backends/", "rollout/weight_sync/")
FSDP = re.compile(r"^\s*(?:from|import)\s+torch\.distributed\.(?:fsdp|tensor|_composable)\b", re.MULTILINE)


def test_fsdp_and_dtensor_stay_in_trainer_backends_and_weight_sync():
    offenders = [
        str(path.relative_to(SRC))
        for path in SRC.rglob("*.py")
        if FSDP.search(path.read_text()) and not str(path.relative_to(SRC)).startswith(ALLOWED)
    ]
    assert offenders == []
    assert FSDP.search((SRC / "trainer" / "backends" / "fsdp2.py").read_text())  # the pattern does match
