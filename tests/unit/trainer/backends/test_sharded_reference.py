"""The reference policy of a sharded trainer, split like the policy (`ShardedReference`), on gloo ranks against one
process's whole frozen copy (`ReferencePolicy`), float32, the 4-layer tiny Llama: two steps of the real `Trainer`
with a KL loss term (every metric, the KL included, and the weights) on pp 2, where the loss runs on the last stage
and the reference must be scored before the schedule, and on tp 2; and the reward-KL penalties on both.

One launch of 2 ranks runs every case; the tests compare what rank 0 wrote with single-process runs in this
process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sharpen.trainer.layout import ParallelLayout
from support.parity import (
    PAD,
    assert_trainer_matches,
    save_tiny_llama4,
    trainer_config,
    trainer_steps,
)
from support.ranks import join_process_group, launch_ranks
from support.tiny_trainer import uneven_rollouts

pytestmark = pytest.mark.slow  # forks 2 ranks

LAYOUTS = {"pp2": ParallelLayout(pp=2), "tp2": ParallelLayout(tp=2)}


def _config(kl: str):
    algorithm = {"num_mini_batches": 2, "num_epochs": 2, "entropy_coef": 0.01}
    return trainer_config(algorithm={**algorithm, "kl": {"type": kl, "coef": 0.5, "estimator": "k3"}})


def _penalties(trainer) -> list[list[float]]:
    return trainer.kl_penalties(uneven_rollouts()[:5])


def _worker(rank: int, num_ranks: int, port: int, model: Path, out_dir: Path) -> None:
    import torch.distributed as dist

    from sharpen.trainer import Trainer
    from sharpen.trainer.backends.fsdp2 import FSDP2Backend
    from sharpen.trainer.backends.sharded_reference import ShardedReference

    join_process_group(rank, num_ranks, port)
    results = {}
    for name, layout in LAYOUTS.items():
        backend = FSDP2Backend(_config("loss"), model_path=model, dtype="float32", layout=layout)
        reference = ShardedReference(_config("loss"), model_path=model, dtype="float32", layout=layout)
        results[f"{name}/loss"] = trainer_steps(backend, reference=reference)
        # the reward penalties after the policy moved: the reference must still be the initial weights
        trainer = Trainer(backend.config, backend=backend, pad_token_id=PAD, max_new_tokens=12, reference=reference)
        results[f"{name}/penalties"] = _penalties(trainer)
        results[f"{name}/reference_bytes"] = sum(
            p.to_local().numel() for p in reference.backend.model.parameters() if hasattr(p, "to_local")
        )
    if rank == 0:
        torch.save(results, out_dir / "results.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama4(tmp_path_factory.mktemp("reference_model"))


@pytest.fixture(scope="module")
def ranks(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out_dir = tmp_path_factory.mktemp("reference")
    launch_ranks(_worker, 2, model, out_dir)
    return torch.load(out_dir / "results.pt")


@pytest.fixture(scope="module")
def single(ranks, model: Path) -> dict:
    """One process with a whole frozen copy (run after the ranks: forking after a multi-threaded run can hang)."""
    from sharpen.trainer import ReferencePolicy, SingleDeviceBackend, Trainer

    backend = SingleDeviceBackend(_config("loss"), model_path=model, dtype="float32")
    reference = ReferencePolicy(model_path=model, dtype="float32", device=torch.device("cpu"), precision="float32")
    steps = trainer_steps(backend, reference=reference)
    trainer = Trainer(backend.config, backend=backend, pad_token_id=PAD, max_new_tokens=12, reference=reference)
    return {"loss": steps, "penalties": _penalties(trainer)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_kl_loss_against_a_sharded_reference_trains_as_one_process_does(layout: str, ranks: dict, single) -> None:
    metrics, _ = single["loss"]
    assert metrics[-1]["train/kl"] > 1e-6  # the policy moved away from the reference: the term is live
    assert_trainer_matches(ranks[f"{layout}/loss"], single["loss"])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_reward_penalties_from_a_sharded_reference_match_one_process(layout: str, ranks: dict, single) -> None:
    got, expected = ranks[f"{layout}/penalties"], single["penalties"]
    assert [len(row) for row in got] == [len(row) for row in expected]
    assert any(abs(value) > 1e-6 for row in expected for value in row)
    for got_row, row in zip(got, expected, strict=True):
        assert got_row == pytest.approx(row, abs=1e-5)


def test_each_rank_holds_half_of_the_reference(ranks: dict, model: Path) -> None:
    from safetensors.torch import load_file

    whole = sum(t.numel() for t in load_file(str(model / "model.safetensors")).values())
    for layout in LAYOUTS:  # pp 2: rank 0's stage (the embedding and 2 of 4 layers); tp 2: half of every weight
        assert ranks[f"{layout}/reference_bytes"] < 0.75 * whole, layout
