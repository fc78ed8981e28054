"""Expert parallelism composed with the other axes trains like one process (the real `Trainer`, two steps of two
mini-batches: every metric and the weights, float32): the experts split over ep ranks carved out of the context-
parallel ranks (cp 2 x ep 2: a row's two halves are routed on two ranks, and each rank's experts serve both), out of
each pipeline stage's data ranks (pp 2 x dp_shard 2 x ep 2), beside HSDP's replicas (dp_replicate 2 x dp_shard 2 x
ep 2), and with each expert split over tensor-parallel ranks too (dp_shard 2 x tp 2 x ep 2: experts on ep x tp), on
a tiny random Mixtral; with the engine's routes replayed (R3) on the context-parallel layout, and on a pipeline of
tensor-parallel stages (pp 2 x tp 2, no ep: each stage's MoE blocks see the rows padded for sequence parallelism).
The ranks' pieces for the direct weight sync assemble into the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sharpen.trainer.backends import SingleDeviceBackend
from sharpen.trainer.layout import ParallelLayout
from sharpen.weight_shards import assemble_ranks
from support.parity import PAD, VOCAB, assert_trainer_matches, trainer_config, trainer_steps
from support.ranks import join_process_group, launch_ranks
from support.tiny_moe import decisive_routers, replayed_steps, tiny_moe

pytestmark = pytest.mark.slow  # forks 2 and 4 ranks

LAYOUTS = {  # name: (layout, routing replay)
    "cp 2 x ep 2": (ParallelLayout(cp=2, ep=2), "none"),
    "cp 2 x ep 2, R3": (ParallelLayout(cp=2, ep=2), "r3"),
    "pp 2 x dp_shard 2 x ep 2": (ParallelLayout(pp=2, dp_shard=2, ep=2), "none"),
    "dp_replicate 2 x dp_shard 2 x ep 2": (ParallelLayout(dp_replicate=2, dp_shard=2, ep=2), "none"),
    "dp_shard 2 x tp 2 x ep 2": (ParallelLayout(dp_shard=2, tp=2, ep=2), "none"),
    "pp 2 x tp 2, R3": (ParallelLayout(pp=2, tp=2), "r3"),  # no ep: an MoE's tp stages, padded for sequence parallelism
}
NUM_LAYERS = 2


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny Mixtral as built ("none"), and with decisive routers for R3 ("r3": the replayed routes then differ
    from the routers' own; without replay such routers make one step's tiny rounding differences flip routes)."""
    folder = tmp_path_factory.mktemp("ep_axes")
    tiny_moe("mixtral", vocab_size=VOCAB, pad_token_id=PAD).save_pretrained(folder / "none")
    model = tiny_moe("mixtral", vocab_size=VOCAB, pad_token_id=PAD)
    decisive_routers(model)
    model.save_pretrained(folder / "r3")
    return {"none": folder / "none", "r3": folder / "r3"}


def _config(replay: str):
    return trainer_config(moe={"routing_replay": replay})


def _worker(rank: int, num_ranks: int, port: int, models: dict[str, Path], names: list[str], out: Path) -> None:
    import torch.distributed as dist

    from sharpen.trainer.backends.fsdp2 import FSDP2Backend

    join_process_group(rank, num_ranks, port)
    results = {}
    for name in names:
        layout, replay = LAYOUTS[name]
        backend = FSDP2Backend(_config(replay), model_path=models[replay], dtype="float32", layout=layout)
        results[name] = replayed_steps(backend, NUM_LAYERS) if replay == "r3" else trainer_steps(backend)
        pieces: list = [None] * num_ranks  # every rank's pieces for the direct weight sync
        dist.all_gather_object(pieces, backend.weight_shards())
        results[name, "assembled"] = dict(assemble_ranks(pieces))
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    results = {}
    for num_ranks in (2, 4):
        names = [name for name, (layout, _) in LAYOUTS.items() if layout.world_size == num_ranks]
        out = tmp_path_factory.mktemp(f"ep_axes_{num_ranks}") / "results.pt"
        launch_ranks(_worker, num_ranks, models, names, out)
        results |= torch.load(out)
    return results


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_parallelism_with_another_axis_trains_like_one_process(runs: dict, models: dict[str, Path], name: str):
    replay = LAYOUTS[name][1]
    one = SingleDeviceBackend(_config(replay), model_path=models[replay], dtype="float32")
    expected = replayed_steps(one, NUM_LAYERS) if replay == "r3" else trainer_steps(one)
    got_metrics, got_weights = runs[name]
    if LAYOUTS[name][0].pp > 1:  # a pipeline measures no balancing loss (the routers' probabilities stay on stages)
        expected = ([{k: v for k, v in m.items() if k != "moe/train_aux_loss"} for m in expected[0]], expected[1])
    assert_trainer_matches((got_metrics, got_weights), expected)
    assembled = runs[name, "assembled"]  # the engine gets the same weights from the ranks' pieces
    assert assembled.keys() == got_weights.keys()
    for weight_name, weight in got_weights.items():
        torch.testing.assert_close(assembled[weight_name], weight, rtol=0, atol=0, msg=weight_name)
    if replay == "r3":
        assert expected[0][0]["moe/engine_disagreement"] > 0.1  # the replayed routes are not the routers' own
