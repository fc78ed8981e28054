"""A Ray run whose trainer actor is on another node, with another disk at the driver's ``run.output_dir`` (two Ray
nodes on this machine, `support.ray_nodes`): refused at start in one line that names the rank, its host and what to
set; with the checkpoints in an object store (SeaweedFS on loopback) it runs, checkpoints into the bucket from node 2,
and a second invocation with ``--resume auto`` continues from the bucket to the metrics of an uninterrupted run; two
FSDP2 rank actors on the two nodes each upload their shard and resume from the bucket.

Placement: the head has 1 CPU and node 2 has 2, and the trainer actor reserves 1.5 CPUs, so it can only start on
node 2; ``SPREAD`` normally puts the engine actor (0.5) on the head, the driver's node (not relied on)."""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_object_store_runs import manifest_files, store_options
from test_tiny_loop import run_in_this_process, stable, tiny_config, vowel_reward

from sharpen.config.loader import ConfigError
from sharpen.config.runtime import RuntimeConfig
from sharpen.monitoring import read_jsonl
from sharpen.orchestration.runtime import run
from support.object_store import KEY, KEY_ENV, SECRET, SECRET_ENV, S3Server
from support.ray_nodes import NODE2_HOST, TwoNodes, bwrap_binary, start_two_nodes

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.ray, pytest.mark.slow]

THREADS = {"trainer.num_threads": "1"}  # the actors' count: the Ray run then equals the embedded one bit for bit


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoNodes]:
    """The two-node cluster of this module, checked before use: a 1.5-CPU task runs on node 2 and does not see a
    file the driver wrote into the output folder. Stopped after the module; no process of it may outlive that."""
    if bwrap_binary() is None:
        pytest.skip("no bwrap: the second node needs its own mount namespace (apt-get install bubblewrap)")
    # Every process of both nodes holds the store's credentials in its environment, as on a real cluster.
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", KEY_ENV: KEY, SECRET_ENV: SECRET}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_AUTH_MODE", "disabled")  # this driver connects without a token, as the nodes expect
        nodes = start_two_nodes(tmp_path_factory.mktemp("two-nodes"), head_cpus=1, node2_cpus=2, env=env)
        try:
            check_the_emulation(nodes)
            yield nodes
        finally:
            killed = nodes.stop()
    assert not killed, f"processes of the two-node cluster outlived its ray start: {killed}"


def check_the_emulation(nodes: TwoNodes) -> None:
    (nodes.output_dir / "from-the-driver").write_text("")
    ray.init(address=nodes.address, log_to_driver=False)
    try:
        assert len([node for node in ray.nodes() if node["Alive"]]) == 2

        @ray.remote(num_cpus=1.5)
        def look(folder: str) -> tuple[str, list[str]]:
            return socket.gethostname(), os.listdir(folder)

        assert ray.get(look.remote(str(nodes.output_dir)), timeout=60) == (NODE2_HOST, [])
    finally:
        ray.shutdown()
        (nodes.output_dir / "from-the-driver").unlink()


def two_node_runtime(nodes: TwoNodes) -> RuntimeConfig:
    return RuntimeConfig(
        type="ray",
        address=nodes.address,
        trainer_cpus=1.5,  # only node 2 has room
        engine_cpus=0.5,
        placement_strategy="SPREAD",
        call_timeout_s=120,
        start_timeout_s=120,
    )


def test_a_trainer_on_another_disk_is_refused_at_start(tiny_model_path: Path, two_nodes: TwoNodes) -> None:
    config = tiny_config(tiny_model_path, two_nodes.output_dir, name="refused", num_steps=2, **THREADS)
    with pytest.raises(ConfigError) as refused:
        run(config, runtime=two_node_runtime(two_nodes), reward_fn=vowel_reward)
    out, run_dir = two_nodes.output_dir, two_nodes.output_dir / "refused"
    expected = (
        re.escape(
            f"run.output_dir {out} is not shared: trainer rank 0 on host {NODE2_HOST} cannot read the driver's "
            f"marker (No such file or directory) in {run_dir}/.shared-check-"
        )
        + "[0-9a-f]{12}"
        + re.escape(
            "; put run.output_dir on a filesystem every node mounts, or the checkpoints in an object store "
            "(run.checkpoint_uri)"
        )
    )
    assert re.fullmatch(expected, str(refused.value)), str(refused.value)
    assert not (run_dir / "metrics.jsonl").exists()  # refused before step 0
    assert list(run_dir.iterdir()) == [run_dir / "config.toml"]  # the check's markers are removed
    assert list(two_nodes.node2_disk.iterdir()) == []


def test_with_the_object_store_the_two_node_run_checkpoints_and_resumes(
    tiny_model_path: Path, tmp_path: Path, two_nodes: TwoNodes, s3_uri: str, s3_server: S3Server
) -> None:
    store = {**THREADS, **store_options(s3_uri, s3_server)}
    runtime = two_node_runtime(two_nodes)
    full = run_in_this_process(tiny_config(tiny_model_path, tmp_path, name="full", num_steps=4, **THREADS))
    first = tiny_config(tiny_model_path, two_nodes.output_dir, name="split", num_steps=2, **store)
    run(first, runtime=runtime, resume="auto", reward_fn=vowel_reward)
    second = tiny_config(tiny_model_path, two_nodes.output_dir, name="split", num_steps=4, **store)
    split = run(second, runtime=runtime, resume="auto", reward_fn=vowel_reward)

    # node 2's trainer wrote its checkpoints and the model into the bucket; nothing went to either node's disk
    listed = s3_server.filesystem().ls(f"{s3_uri.removeprefix('s3://')}/split/checkpoints", detail=False)
    assert sorted(path.rsplit("/", 1)[-1] for path in listed) == ["step_000002", "step_000004"]
    assert not (split / "checkpoints").exists() and not (split / "model").exists()
    assert not (split / "attempts").exists()  # the second invocation continued from the bucket's step 2
    assert list(two_nodes.node2_disk.iterdir()) == []
    rows, full_rows = read_jsonl(split / "metrics.jsonl"), read_jsonl(full / "metrics.jsonl")
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    # The reference runs in this pytest process, whose torch state earlier tests of a full suite may have changed:
    # alone, this module's runs equal it bit for bit (seen 3 times); after the whole suite, within ~1e-5 relative
    # (a grad norm of 0.72212917 against 0.72212929, the probe's engine delta 0.00586586 against 0.00586591, seen
    # once). So the rollouts' rewards must be equal and every other number within 1e-4 relative: a resume from wrong
    # weights, or none, moves them by far more.
    for resumed, uninterrupted in zip(stable(rows), stable(full_rows), strict=True):
        assert resumed.keys() == uninterrupted.keys()
        assert resumed == pytest.approx(uninterrupted, rel=1e-4, abs=1e-6)
    assert [row["reward/mean"] for row in rows] == [row["reward/mean"] for row in full_rows]
    assert full_rows[3]["reward/mean"] != full_rows[2]["reward/mean"]  # the compared steps carry real signal
    assert rows[2]["sync/probe_mismatch_mean"] < 1e-4  # the weights loaded from the bucket reached the engine


def test_two_fsdp2_rank_actors_upload_their_shards_from_two_nodes_and_resume(
    tiny_model_path: Path, two_nodes: TwoNodes, s3_uri: str, s3_server: S3Server
) -> None:
    """2 FSDP2 rank actors (0.75 CPU each: the head's 1 CPU holds at most one, so at least one is on node 2): each
    writes its shard into its own node's staging folder and uploads it; the resumed ranks each download the
    checkpoint and load their shards from it."""
    options = {**THREADS, "runtime.trainer_ranks": "2", **store_options(s3_uri, s3_server)}
    runtime = two_node_runtime(two_nodes).model_copy(update={"trainer_ranks": 2, "trainer_cpus": 0.75})
    first = tiny_config(tiny_model_path, two_nodes.output_dir, name="ranks", num_steps=1, **options)
    run(first, runtime=runtime, resume="auto", reward_fn=vowel_reward)
    files = manifest_files(s3_server, f"{s3_uri}/ranks/checkpoints/step_000001")
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "state.json"} <= files  # every rank's shard
    second = tiny_config(tiny_model_path, two_nodes.output_dir, name="ranks", num_steps=2, **options)
    run_dir = run(second, runtime=runtime, resume="auto", reward_fn=vowel_reward)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == [0, 1]
    assert not (run_dir / "attempts").exists()  # continued from the bucket's checkpoint, not started over
    assert rows[1]["sync/probe_mismatch_mean"] < 1e-4  # the resumed ranks' weights reached the engine
    assert list(two_nodes.node2_disk.iterdir()) == []
