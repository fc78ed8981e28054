"""Pipeline parallelism on gloo ranks against one process (float32, a tiny 4-layer Llama with a tied LM head): per-token
logprobs, entropy, loss and every gradient of two optimizer steps through 1F1B (pp 2) and interleaved 1F1B (pp 2, two
stages a rank), micro-batches of different lengths; the real `Trainer` (mini-batches, epochs, the RL loss on the
last stage, metrics from it) on pp 2 with both schedules and with packed rows, on pp 2 x tp 2 and pp 2 x dp_shard 2;
full HF-named weights on every rank, an export that transformers loads, and a pp 2 checkpoint resumed on dp_shard 2.

One launch of 2 ranks runs the 2-rank cases, one of 4 ranks the 2-D layouts, then 2 ranks resume; the tests compare
what the ranks wrote with single-process runs in this process (after the launches).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sharpen.trainer.backends import SingleDeviceBackend
from sharpen.trainer.backends.base import ScoreInputs
from sharpen.trainer.layout import ParallelLayout
from sharpen.types import TrainBatch
from support.parity import (
    NUM_STEPS,
    PAD,
    TOLERANCE,
    WEIGHT_TOLERANCE,
    assert_trainer_matches,
    full,
    max_difference,
    parity_batch,
    relative_difference,
    save_tiny_llama4,
    trainer_config,
    trainer_steps,
)
from support.ranks import join_process_group, launch_ranks
from support.tiny_trainer import uneven_rollouts

slow = pytest.mark.slow  # forks 2, then 4, then 2 ranks

ONE_F_ONE_B = ParallelLayout(pp=2)
INTERLEAVED = ParallelLayout(pp=2, pp_schedule="interleaved_1f1b", pp_stages_per_rank=2)
ROWS = ((0, 12), (1, 12), (2, 10))  # the micro-batches: one row each, the last cut to its 10 tokens


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama4(tmp_path_factory.mktemp("pp_model"))


def _steps(backend) -> list[dict]:
    """Two optimizer steps of a policy-gradient loss with an entropy bonus (temperature 0.7), the rows of
    `parity_batch` as three micro-batches (`ROWS`) through `train_micro_batches`: each step's logprobs and entropy
    ([3, 11], from the micro-batches the loss saw), loss, this rank's full gradients and the pre-clip norm."""
    return [_step(backend) for _ in range(NUM_STEPS)]


def _step(backend) -> dict:
    ids, attention, targets, advantages = parity_batch()
    count = targets.sum()
    inputs = [
        ScoreInputs(
            input_ids=ids[row : row + 1, :width],
            attention_mask=attention[row : row + 1, :width],
            target_mask=targets[row : row + 1, : width - 1],
        )
        for row, width in ROWS
    ]
    logprobs, entropy = torch.zeros(3, 11), torch.zeros(3, 11)
    losses = []

    def loss(index: int, scores) -> torch.Tensor:
        row, width = ROWS[index]
        logprobs[row, : width - 1] = scores.logprobs.detach()[0]
        entropy[row, : width - 1] = scores.entropy.detach()[0]
        advantage, mask = advantages[row : row + 1, : width - 1], targets[row : row + 1, : width - 1]
        value = -(scores.logprobs * advantage * mask).sum() / count - 0.01 * (scores.entropy * mask).sum() / count
        losses.append(value.detach())
        return value

    backend.train_micro_batches(inputs, loss, temperature=0.7, with_entropy=True, entropy_requires_grad=True)
    grads = {name: full(p.grad) for name, p in backend.model.named_parameters() if p.grad is not None}
    step = {"grads": grads, "norm": backend.clip_and_step()}
    if losses:  # the last stage's
        step |= {"logprobs": logprobs, "entropy": entropy, "loss": torch.stack(losses).sum()}
    return step


def _merged(parts: list[list[dict]]) -> list[dict]:
    """Each rank's `_steps` merged: the gradients of every stage, the last stage's scores and loss."""
    steps = []
    for per_rank in zip(*parts, strict=True):
        step: dict = {"grads": {}}
        for part in per_rank:
            for name, grad in part["grads"].items():
                assert name not in step["grads"], f"{name} on two stages"
                step["grads"][name] = grad
            step |= {key: value for key, value in part.items() if key != "grads"}
        norms = {part["norm"] for part in per_rank}
        assert len(norms) == 1, "every stage reports the same (global) gradient norm"
        steps.append(step)
    return steps


def _two_rank_worker(rank: int, num_ranks: int, port: int, model: Path, out_dir: Path) -> None:
    import torch.distributed as dist

    from sharpen.trainer.backends.fsdp2 import FSDP2Backend

    join_process_group(rank, num_ranks, port)
    results: dict[str, object] = {}
    for name, layout in (("1f1b", ONE_F_ONE_B), ("interleaved", INTERLEAVED)):
        backend = FSDP2Backend(trainer_config(), model_path=model, dtype="float32", layout=layout)
        parts: list[object] = [None] * num_ranks
        dist.all_gather_object(parts, _steps(backend))
        results[f"{name}/steps"] = _merged(parts)  # pyright: ignore[reportArgumentType]
        backend = FSDP2Backend(trainer_config(), model_path=model, dtype="float32", layout=layout)
        results[f"{name}/trainer"] = trainer_steps(backend)
        if name == "1f1b":
            backend.save(out_dir / "checkpoint")
            backend.export(out_dir / "export")
            results["ranks"] = (backend.rank, backend.num_ranks)
    backend = FSDP2Backend(trainer_config(packing=True), model_path=model, dtype="float32", layout=ONE_F_ONE_B)
    results["packed/trainer"] = trainer_steps(backend)
    if rank == 0:
        torch.save(results, out_dir / "pp2.pt")
    dist.destroy_process_group()


def _four_rank_worker(rank: int, num_ranks: int, port: int, model: Path, out_dir: Path) -> None:
    import torch.distributed as dist

    from sharpen.trainer.backends.fsdp2 import FSDP2Backend

    join_process_group(rank, num_ranks, port)
    results = {}
    for name, layout in (("tp", ParallelLayout(pp=2, tp=2)), ("dp_shard", ParallelLayout(pp=2, dp_shard=2))):
        backend = FSDP2Backend(trainer_config(), model_path=model, dtype="float32", layout=layout)
        results[name] = {"trainer": trainer_steps(backend), "ranks": (backend.rank, backend.num_ranks)}
    if rank == 0:
        torch.save(results, out_dir / "four_ranks.pt")
    dist.destroy_process_group()


def _resume_worker(rank: int, num_ranks: int, port: int, model: Path, out_dir: Path) -> None:
    """The pp 2 checkpoint loaded on dp_shard 2 (DCP re-shards): its weights, before any step; then that run's own
    checkpoint (no pipeline) loaded back on pp 2, and one more optimizer step on each of the two."""
    import torch.distributed as dist

    from sharpen.trainer import Trainer
    from sharpen.trainer.backends.fsdp2 import FSDP2Backend

    join_process_group(rank, num_ranks, port)
    results = {}
    for name, layout, checkpoint in (("dp_shard", None, "checkpoint"), ("pp", ONE_F_ONE_B, "checkpoint_dp_shard")):
        backend = FSDP2Backend(trainer_config(), model_path=model, dtype="float32", layout=layout)
        backend.load(out_dir / checkpoint)
        weights = {key: tensor.clone() for key, tensor in backend.named_weights()}
        if name == "dp_shard":
            backend.save(out_dir / "checkpoint_dp_shard")
        trainer = Trainer(backend.config, backend=backend, pad_token_id=PAD, max_new_tokens=12)
        trainer.step(TrainBatch(rollouts=uneven_rollouts()[:5], step=NUM_STEPS))
        results[name] = (weights, {key: tensor.clone() for key, tensor in backend.named_weights()})
    if rank == 0:
        torch.save(results, out_dir / "resumed.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict, Path]:
    out_dir = tmp_path_factory.mktemp("pp")
    launch_ranks(_two_rank_worker, 2, model, out_dir)
    launch_ranks(_four_rank_worker, 4, model, out_dir)
    launch_ranks(_resume_worker, 2, model, out_dir)
    return torch.load(out_dir / "pp2.pt"), torch.load(out_dir / "four_ranks.pt"), out_dir


@pytest.fixture(scope="module")
def single(runs, model: Path) -> dict[str, object]:
    """The same steps on one device (after the launches: see `support.ranks.launch_ranks`)."""
    return {
        "steps": _steps(SingleDeviceBackend(trainer_config(), model_path=model, dtype="float32")),
        "trainer": trainer_steps(SingleDeviceBackend(trainer_config(), model_path=model, dtype="float32")),
        "packed/trainer": trainer_steps(
            SingleDeviceBackend(trainer_config(packing=True), model_path=model, dtype="float32")
        ),
    }


@slow
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_steps_match_one_process(runs, single, schedule):
    for step, (got, expected) in enumerate(zip(runs[0][f"{schedule}/steps"], single["steps"], strict=True)):
        for key in ("logprobs", "entropy", "loss"):
            assert max_difference(got[key], expected[key]) < TOLERANCE, (step, key)
        grads = dict(got["grads"])
        # the tied embedding's two copies (first stage: the embedding; last: the LM head) hold the two halves of the
        # one gradient a single device sums
        grads["model.embed_tokens.weight"] = grads["model.embed_tokens.weight"] + grads.pop("lm_head.weight")
        assert grads.keys() == expected["grads"].keys()
        for name, grad in expected["grads"].items():
            assert max_difference(grads[name], grad) < TOLERANCE, (step, name)
        assert got["norm"] == pytest.approx(expected["norm"], rel=TOLERANCE)


@slow
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_the_trainer_on_pp2_matches_one_device(runs, single, schedule):
    assert runs[0]["ranks"] == (0, 1)  # both stages train the same rows: one data-parallel rank
    assert_trainer_matches(runs[0][f"{schedule}/trainer"], single["trainer"])


@slow
def test_the_packed_trainer_on_pp2_matches_one_device(runs, single):
    assert_trainer_matches(runs[0]["packed/trainer"], single["packed/trainer"])


@slow
def test_the_trainer_on_pp2_x_tp2_matches_one_device(runs, single):
    """4 ranks, one data shard: each stage on a tp 2 pair (sequence parallel between blocks and between stages)."""
    assert runs[1]["tp"]["ranks"] == (0, 1)
    assert_trainer_matches(runs[1]["tp"]["trainer"], single["trainer"])


@slow
def test_the_trainer_on_pp2_x_dp_shard2_matches_one_device(runs, single):
    """4 ranks: the data split over 2 FSDP2 shards, each stage sharded over its 2 data-parallel ranks."""
    assert runs[1]["dp_shard"]["ranks"] == (0, 2)
    assert_trainer_matches(runs[1]["dp_shard"]["trainer"], single["trainer"])


@slow
def test_a_pp2_checkpoint_resumes_on_another_layout_and_back(runs):
    """pp 2 -> dp_shard 2 -> pp 2: the weights bit for bit each time, and the next optimizer step (AdamW moments
    included, the tied head's under the embedding's name) the same on both layouts."""
    _, _, out_dir = runs
    saved = runs[0]["1f1b/trainer"][1]
    resumed = torch.load(out_dir / "resumed.pt")
    for name in ("dp_shard", "pp"):
        weights = resumed[name][0]
        assert weights.keys() == saved.keys()
        for key, tensor in saved.items():
            assert torch.equal(weights[key], tensor), (name, key)
    for key, tensor in resumed["dp_shard"][1].items():
        assert relative_difference(resumed["pp"][1][key], tensor) < WEIGHT_TOLERANCE, key
        assert not torch.equal(tensor, saved[key]), key  # the step moved it


@slow
def test_the_pp2_export_loads_in_transformers(runs):
    from transformers import AutoModelForCausalLM

    _, _, out_dir = runs
    model = AutoModelForCausalLM.from_pretrained(out_dir / "export")
    for name, tensor in runs[0]["1f1b/trainer"][1].items():
        assert torch.equal(model.state_dict()[name], tensor), name
