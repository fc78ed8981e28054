"""Whole runs with their checkpoints and exported model in an S3-compatible object store (a real SeaweedFS server on
loopback, `s3_uri`): the run directory keeps the logs, the bucket the checkpoints; ``--resume auto`` continues from
the bucket exactly as the uninterrupted run; two local FSDP2 ranks each upload their own shard."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_tiny_loop import run_in_this_process, stable, tiny_config, vowel_reward

from sharpen.monitoring import read_jsonl
from sharpen.orchestration.embedded import run_embedded
from sharpen.orchestration.manifest import MANIFEST_NAME
from support.object_store import KEY_ENV, SECRET_ENV, S3Server

pytestmark = pytest.mark.slow


def store_options(s3_uri: str, s3_server: S3Server) -> dict[str, str]:
    return {
        "run.checkpoint_uri": json.dumps(s3_uri),
        "run.object_store.endpoint_url": json.dumps(s3_server.endpoint_url),
        "run.object_store.key_env": json.dumps(KEY_ENV),
        "run.object_store.secret_env": json.dumps(SECRET_ENV),
    }


def manifest_files(s3_server: S3Server, folder: str) -> set[str]:
    return set(json.loads(s3_server.filesystem().cat_file(f"{folder.removeprefix('s3://')}/{MANIFEST_NAME}"))["files"])


def test_a_run_resumed_from_the_store_equals_the_uninterrupted_run(
    tiny_model_path: Path, tmp_path: Path, s3_uri: str, s3_server: S3Server
) -> None:
    store = store_options(s3_uri, s3_server)
    full = run_embedded(tiny_config(tiny_model_path, tmp_path, name="full", num_steps=4), reward_fn=vowel_reward)
    split_config = tiny_config(tiny_model_path, tmp_path, name="split", num_steps=2, **store)
    run_embedded(split_config, resume="auto", reward_fn=vowel_reward)
    split = run_embedded(
        tiny_config(tiny_model_path, tmp_path, name="split", num_steps=4, **store),
        resume="auto",
        reward_fn=vowel_reward,
    )
    # the checkpoints and the model are in the bucket, each with its manifest; none in the run directory
    assert not (split / "checkpoints").exists() and not (split / "model").exists()
    listed = s3_server.filesystem().ls(f"{s3_uri.removeprefix('s3://')}/split/checkpoints", detail=False)
    assert sorted(path.rsplit("/", 1)[-1] for path in listed) == ["step_000002", "step_000004"]
    for step in (2, 4):
        files = manifest_files(s3_server, f"{s3_uri}/split/checkpoints/step_{step:06d}")
        assert {"state.json", "rng.pt", "model.safetensors", "optimizer.pt", "trainer.json"} <= files
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= manifest_files(s3_server, f"{s3_uri}/split/model")
    # the resumed steps are bit-identical to the uninterrupted run's
    full_rows, split_rows = stable(read_jsonl(full / "metrics.jsonl")), stable(read_jsonl(split / "metrics.jsonl"))
    assert [r["step"] for r in split_rows] == [0, 1, 2, 3]
    assert split_rows[2:] == full_rows[2:]
    assert full_rows[3]["reward/mean"] != full_rows[2]["reward/mean"]  # the compared steps carry real signal


def test_two_local_ranks_upload_their_shards_and_resume_from_the_store(
    tiny_model_path: Path, tmp_path: Path, s3_uri: str, s3_server: S3Server
) -> None:
    """FSDP2 on 2 local rank processes: each rank writes its shard to its own staging folder and uploads it; the
    resumed run's ranks each download the checkpoint and load their shards from it."""
    options = {"trainer.num_threads": "1", "runtime.trainer_ranks": "2", **store_options(s3_uri, s3_server)}
    run_in_this_process(tiny_config(tiny_model_path, tmp_path, name="ranks", num_steps=1, **options), resume="auto")
    files = manifest_files(s3_server, f"{s3_uri}/ranks/checkpoints/step_000001")
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "state.json"} <= files  # every rank's shard
    run_dir = run_in_this_process(
        tiny_config(tiny_model_path, tmp_path, name="ranks", num_steps=2, **options), resume="auto"
    )
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == [0, 1]
    assert not (run_dir / "attempts").exists()  # continued from the bucket's checkpoint, not started over
    assert rows[1]["sync/probe_mismatch_mean"] < 1e-4  # the resumed ranks' weights reached the engine
    assert "model.safetensors" in manifest_files(s3_server, f"{s3_uri}/ranks/model")  # rank 0's gathered export
