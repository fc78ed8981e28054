"""The start-up proof that the run directory is shared: the driver's marker read by every trainer rank and each rank's
read back by the driver; a rank on another disk is refused in one line that names it and what to set."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path
from typing import Any

import pytest

from sharpen.config import ConfigError
from sharpen.orchestration.storage import answer_marker, check_shared_run_dir


class RanksWithViews:
    """Trainer ranks in which rank i sees the driver's path ``/a/b`` as ``views[i](/a/b)`` (a node with its own
    disk mounted where the driver's shared one is); each answers with the real rank-side `answer_marker`."""

    def __init__(self, *views: Any) -> None:
        self.views = views
        self.calls: list[str] = []

    def call_all(self, method: str, *args: Any) -> list[Any]:
        self.calls.append(method)
        folder, token = args
        return [answer_marker(view(folder), token, rank=rank) for rank, view in enumerate(self.views)]


def same(folder: Path) -> Path:
    return folder


def test_ranks_that_share_the_run_directory_pass_and_leave_nothing_behind(tmp_path: Path) -> None:
    ranks = RanksWithViews(same, same)
    check_shared_run_dir(tmp_path / "run", ranks, output_dir=str(tmp_path))
    assert ranks.calls == ["check_shared_dir"]
    assert list((tmp_path / "run").iterdir()) == []  # the markers are removed


def test_a_rank_that_cannot_see_the_drivers_folder_is_refused(tmp_path: Path) -> None:
    other_disk = tmp_path / "node-2-local"

    def elsewhere(folder: Path) -> Path:  # rank 1's node mounts its own empty disk at the same path
        return other_disk / folder.relative_to(tmp_path)

    with pytest.raises(ConfigError) as refused:
        check_shared_run_dir(tmp_path / "run", RanksWithViews(same, elsewhere), output_dir=str(tmp_path))
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(
        f"run.output_dir {tmp_path} is not shared: trainer rank 1 on host {socket.gethostname()} cannot read the "
        "driver's marker"
    )
    assert message.endswith(
        "put run.output_dir on a filesystem every node mounts, or the checkpoints in an object store "
        "(run.checkpoint_uri)"
    )


def test_a_rank_whose_writes_the_driver_cannot_read_is_refused(tmp_path: Path) -> None:
    """A rank that reads the driver's marker (a copy synced to its node, say) but writes where the driver cannot
    read it: only the driver's read of the rank's marker finds it."""
    copy_root = tmp_path / "node-2-copy"

    def synced_copy(folder: Path) -> Path:
        mirror = copy_root / folder.relative_to(tmp_path)
        shutil.copytree(folder, mirror)
        return mirror

    with pytest.raises(
        ConfigError, match=r"trainer rank 0 on host .* wrote its marker where the driver cannot read it"
    ):
        check_shared_run_dir(tmp_path / "run", RanksWithViews(synced_copy), output_dir=str(tmp_path))


def test_a_rank_reading_another_token_is_refused(tmp_path: Path) -> None:
    (tmp_path / "driver").write_text("another run's token")
    answer = answer_marker(tmp_path, "this run's token", rank=3)
    assert answer.problem is not None and answer.marker is None
    assert not (tmp_path / "rank-3").exists()
