"""Checkpoints in an object store, against a real S3-compatible server on loopback (SeaweedFS, `s3_uri`): each
rank uploads its own files and the driver's manifest, written last, lists them all; the newest complete checkpoint is
found in the store; a missing, truncated or changed object refuses the load in one line naming it; the start-up
check proves the driver and every rank reach the store, or refuses in one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_checkpoint import ShardedTrainer

from sharpen.config import ConfigError, load_config
from sharpen.data import ExampleSampler
from sharpen.orchestration.checkpoint import (
    CheckpointError,
    checkpoint_home,
    export_model,
    load_checkpoint,
    save_checkpoint,
    scan_checkpoints,
)
from sharpen.orchestration.manifest import MANIFEST_NAME
from sharpen.orchestration.object_store import RANK_CALLS, StoreAccess, StoreFolder
from sharpen.orchestration.storage import answer_marker, check_storage
from sharpen.types import Example, Message
from support.object_store import KEY_ENV, SECRET_ENV, S3Server


class RankProcesses:
    """Two trainer ranks "in other processes" (`TrainerProcesses`): each serves the rank side's calls as a local rank
    process does, with its own trainer writing only its own shard."""

    def __init__(self, environments: list[dict[str, str]] | None = None) -> None:
        self.trainers = [OneRank(rank) for rank in range(2)]
        self.environments = environments or [{}, {}]
        self.calls: list[str] = []

    def call_all(self, method: str, *args: Any) -> list[Any]:
        self.calls.append(method)
        answers = []
        for rank, trainer in enumerate(self.trainers):
            with pytest.MonkeyPatch.context() as patch:  # this rank's own environment
                for name, value in self.environments[rank].items():
                    patch.setenv(name, value) if value else patch.delenv(name, raising=False)
                if method == "check_shared_dir":
                    answers.append(answer_marker(*args, rank=rank))
                else:
                    answers.append(RANK_CALLS[method](trainer, *args))
        return answers


class OneRank:
    """What one FSDP2 rank writes: its shard; rank 0 also DCP's metadata and the objective's state."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.loaded: list[set[str]] = []

    def save_checkpoint(self, folder: Path) -> None:
        (folder / f"__{self.rank}_0.distcp").write_bytes(bytes([self.rank]) * 1000)
        if self.rank == 0:
            (folder / ".metadata").write_bytes(b"metadata")
            (folder / "trainer.json").write_text("{}")

    def load_checkpoint(self, folder: Path) -> None:
        self.loaded.append({p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()})

    def export(self, folder: Path) -> None:
        if self.rank == 0:
            (folder / "model.safetensors").write_bytes(b"weights")
            (folder / "config.json").write_text("{}")


def _run_config(uri: str, endpoint: str, *, name: str = "run", **extra: str):
    overrides = {
        "run.name": f'"{name}"',
        "run.checkpoint_uri": f'"{uri}/runs"',
        "run.object_store.endpoint_url": f'"{endpoint}"',
        "run.object_store.key_env": f'"{KEY_ENV}"',
        "run.object_store.secret_env": f'"{SECRET_ENV}"',
        **extra,
    }
    return load_config(None, [f"{key}={value}" for key, value in overrides.items()])


def _home(uri: str, s3_server: S3Server) -> StoreFolder:
    home = checkpoint_home(_run_config(uri, s3_server.endpoint_url).run, Path("unused"))
    assert isinstance(home, StoreFolder)
    return home


def _sampler(step: int = 0) -> ExampleSampler:
    examples = [Example(task_key=f"t/{i}", prompt=(Message(role="user", content=f"q{i}"),)) for i in range(4)]
    sampler = ExampleSampler(examples, seed=0)
    for _ in range(step):
        sampler.next_batch(2)
    return sampler


def _save(home: StoreFolder, step: int, trainer: Any) -> StoreFolder:
    folder = save_checkpoint(home, next_step=step, trainer=trainer, sampler_state=_sampler(step).state_dict())
    assert isinstance(folder, StoreFolder)
    return folder


def test_each_rank_uploads_its_files_and_the_manifest_lists_them(s3_uri: str, s3_server: S3Server) -> None:
    home = _home(s3_uri, s3_server)
    assert home.uri == f"{s3_uri}/runs/run"
    ranks = RankProcesses()
    folder = _save(home, 2, ranks)
    fs = s3_server.filesystem()
    stored = {path.removeprefix(f"{folder.path}/") for path in fs.find(folder.path)}
    manifest = json.loads(fs.cat_file(f"{folder.path}/{MANIFEST_NAME}"))
    expected = {"__0_0.distcp", "__1_0.distcp", ".metadata", "trainer.json", "state.json", "rng.pt"}
    assert set(manifest["files"]) == expected and stored == expected | {MANIFEST_NAME}
    assert manifest["files"]["__1_0.distcp"]["size"] == 1000
    assert ranks.calls == ["save_to_store"]
    # found and loaded from the bucket: every rank gets every trainer file, the driver its own
    scan = scan_checkpoints(home)
    assert scan.latest == folder and not scan.skipped
    sampler = _sampler()
    assert load_checkpoint(folder, trainer=ranks, sampler=sampler) == (2, [])
    assert sampler.state_dict() == _sampler(2).state_dict()
    for trainer in ranks.trainers:
        assert trainer.loaded == [{"__0_0.distcp", "__1_0.distcp", ".metadata", "trainer.json"}]


def test_a_trainer_in_this_process_uploads_through_a_staging_folder(s3_uri: str, s3_server: S3Server) -> None:
    class Recording(ShardedTrainer):  # writes subfolders too (the critic's)
        def load_checkpoint(self, folder: Path) -> None:
            self.loaded.append(folder)
            self.files = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}

    trainer = Recording()
    folder = _save(_home(s3_uri, s3_server), 1, trainer)
    manifest = json.loads(s3_server.filesystem().cat_file(f"{folder.path}/{MANIFEST_NAME}"))
    written = {"__0_0.distcp", "__1_0.distcp", ".metadata", "critic/model.safetensors", "trainer.json"}
    assert set(manifest["files"]) == written | {"state.json", "rng.pt"}
    load_checkpoint(folder, trainer=trainer, sampler=_sampler())
    assert trainer.files == written  # a local copy of the trainer's files, without the driver's
    assert not trainer.loaded[0].exists()  # removed after the load


def test_the_exported_model_lands_in_the_bucket_with_a_manifest(s3_uri: str, s3_server: S3Server) -> None:
    model = export_model(_home(s3_uri, s3_server), trainer=RankProcesses())
    assert isinstance(model, StoreFolder) and model.uri == f"{s3_uri}/runs/run/model"
    manifest = json.loads(s3_server.filesystem().cat_file(f"{model.path}/{MANIFEST_NAME}"))
    assert set(manifest["files"]) == {"model.safetensors", "config.json"}


def test_an_incomplete_checkpoint_in_the_bucket_is_skipped(s3_uri: str, s3_server: S3Server) -> None:
    home = _home(s3_uri, s3_server)
    older = _save(home, 2, RankProcesses())
    newer = _save(home, 4, RankProcesses())
    fs = s3_server.filesystem()
    fs.rm(f"{newer.path}/{MANIFEST_NAME}")  # a save that died before its manifest
    scan = scan_checkpoints(home)
    assert scan.latest == older
    assert scan.skipped == ["step_000004: manifest.json is missing (the save did not finish)"]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("missing", "__1_0.distcp is missing"),
        ("truncated", "__1_0.distcp has 10 bytes, its manifest says 1000"),
        (
            "changed",
            "__1_0.distcp does not match its sha256 in the manifest (changed after the save) (as trainer rank 0 read "
            "it)",
        ),
    ],
)
def test_a_damaged_object_refuses_the_load_in_one_line(
    s3_uri: str, s3_server: S3Server, damage: str, message: str
) -> None:
    """Missing and truncated: found by the driver's listing before any rank downloads; changed (same size): by the
    ranks' checksums of what they downloaded, before any of them loads."""
    ranks = RankProcesses()
    folder = _save(_home(s3_uri, s3_server), 2, ranks)
    fs, shard = s3_server.filesystem(), f"{folder.path}/__1_0.distcp"
    if damage == "missing":
        fs.rm(shard)
    else:
        fs.pipe(shard, b"\x07" * (10 if damage == "truncated" else 1000))
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(folder, trainer=ranks, sampler=_sampler())
    assert str(refused.value) == f"checkpoint {folder.uri} cannot be loaded: {message}"
    assert all(trainer.loaded == [] for trainer in ranks.trainers)


def test_the_start_check_passes_for_every_rank_and_leaves_nothing(s3_uri: str, s3_server: S3Server) -> None:
    config = _run_config(s3_uri, s3_server.endpoint_url)
    ranks = RankProcesses()
    check_storage(config.run, Path("/nonexistent/run"), ranks)  # the run directory is not checked: not used
    assert ranks.calls == ["check_shared_dir"]
    left = s3_server.filesystem().find(s3_uri.removeprefix("s3://"))
    assert not [path for path in left if path.endswith(("/driver", "/rank-0", "/rank-1"))]  # the markers are removed
    check_storage(config.run, Path("/nonexistent/run"), ShardedTrainer())  # a trainer here: the driver answers


def test_a_rank_without_credentials_is_refused_in_one_line(s3_uri: str, s3_server: S3Server) -> None:
    config = _run_config(s3_uri, s3_server.endpoint_url)
    ranks = RankProcesses(environments=[{}, {KEY_ENV: ""}])
    with pytest.raises(ConfigError) as refused:
        check_storage(config.run, Path("unused"), ranks)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("run.checkpoint_uri is not usable: trainer rank 1 on host ")
    assert (
        f"cannot read the driver's marker (ConfigError: run.object_store names the environment variable {KEY_ENV}"
        in (message)
    )
    assert message.endswith("and the credentials in the environment of every process")


def test_a_missing_bucket_is_refused_in_one_line(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, "k")
    monkeypatch.setenv(SECRET_ENV, "s")
    config = _run_config("s3://no-such-bucket", s3_server.endpoint_url)
    with pytest.raises(ConfigError) as refused:
        check_storage(config.run, Path("unused"), ShardedTrainer())
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(
        "run.checkpoint_uri is not usable: the driver cannot write into s3://no-such-bucket/runs/run/.shared-check-"
    )
    with pytest.raises(ConfigError, match=r"^run.checkpoint_uri: cannot list s3://no-such-bucket/runs/run/checkpoints"):
        scan_checkpoints(StoreFolder(uri="s3://no-such-bucket/runs/run", access=config_access(config)))


def config_access(config) -> StoreAccess:
    store = config.run.object_store
    return StoreAccess(endpoint_url=store.endpoint_url, key_env=store.key_env, secret_env=store.secret_env)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ('run.checkpoint_uri="/mnt/checkpoints"', "'/mnt/checkpoints' is not an S3 URI"),
        ('run.checkpoint_uri="s3://"', "'s3://' is not an S3 URI"),
        ('run.object_store.key_env="K"', "give key_env and secret_env together, or neither"),
    ],
)
def test_bad_object_store_settings_are_refused(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])
