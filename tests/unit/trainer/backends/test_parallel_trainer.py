"""Tensor and context parallelism on gloo ranks against one process (float32, tiny models): per-token logprobs,
entropy, loss and every gradient of two optimizer steps, for tp 2 on Llama (tied LM head; both plans; with and
without sequence parallelism), Qwen2 (attention biases) and Qwen3 (per-head q/k norms), and for cp 2 (Ulysses) on
Llama and Qwen3 (grouped key/value heads); packed rows on each; the real `Trainer` on tp 2, cp 2 (packed rows),
tp 2 x dp_shard 2, tp 2 x dp_replicate 2 (HSDP), tp 2 x cp 2 and dp_replicate 2 x cp 2; full HF-named weights, an
export that transformers loads, and a tp 2 checkpoint resumed on another layout (dp_shard 2).

One launch of 2 ranks runs every 2-rank case, one launch of 4 ranks the 2-D layouts, then 2 ranks resume; the tests
compare what rank 0 wrote with single-process runs in this process (after the launches).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sharpen.config.schema import TrainerConfig
from sharpen.trainer.backends import SingleDeviceBackend
from sharpen.trainer.layout import LayoutError, ParallelLayout
from support.parity import (
    NUM_STEPS,
    PAD,
    TOLERANCE,
    VOCAB,
    WEIGHT_TOLERANCE,
    assert_trainer_matches,
    full,
    max_difference,
    parity_batch,
    relative_difference,
    trainer_config,
    trainer_steps,
)
from support.ranks import join_process_group, launch_ranks

# TOLERANCE (support.parity): measured here at most 1.4e-6 (gradients), 0 (first step's logprobs); WEIGHT_TOLERANCE:
# at most 1.5e-5
slow = pytest.mark.slow  # forks 2, then 4, then 2 ranks: ~1 min on 2 shared cores

FAMILIES = ("llama", "qwen2", "qwen3")
CASES = (  # layout, family, tensor-parallel plan
    ("tp2", "llama", "gather"),
    ("tp2 without sp", "llama", "gather"),
    ("tp2", "llama", "rowwise"),
    ("tp2", "qwen2", "gather"),
    ("tp2", "qwen3", "gather"),
    ("cp2", "llama", "gather"),
    ("cp2", "qwen3", "gather"),
)
LAYOUTS = {"tp2": ParallelLayout(tp=2), "tp2 without sp": ParallelLayout(tp=2), "cp2": ParallelLayout(cp=2)}
SEQUENCE_PARALLEL = {"tp2 without sp": False}  # trainer.parallel.sequence_parallel (default: on)


def _save_tiny(family: str, folder: Path) -> Path:
    """A 2-layer random model of ``family`` whose heads (4), key/value heads (2), hidden (32), intermediate (64) and
    vocabulary (128) sizes divide by 2."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    sizes = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
        "max_position_embeddings": 64,
        "pad_token_id": PAD,
    }
    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM, {"tie_word_embeddings": True}),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": False}),  # q/k/v carry biases
        "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"tie_word_embeddings": True, "head_dim": 8}),  # q_norm, k_norm
    }
    config_class, model_class, extra = classes[family]
    torch.manual_seed(0)
    model = model_class(config_class(**sizes, **extra))
    if family == "qwen2":  # random biases (the initialiser leaves them 0, which would test nothing)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith("bias"):
                    parameter.normal_(0, 0.1)
    if family == "qwen3":  # norm weights away from 1, so a per-head gradient that is not all-reduced shows
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "norm" in name:
                    parameter.uniform_(0.5, 1.5)
    model.save_pretrained(folder / family)
    return folder / family


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("tp_models")
    return {family: _save_tiny(family, folder) for family in FAMILIES}


def _config(plan: str = "gather", *, sequence_parallel: bool = True, **overrides) -> TrainerConfig:
    return trainer_config(parallel={"tp_plan": plan, "sequence_parallel": sequence_parallel}, **overrides)


def _steps(backend) -> list[dict]:
    """Two optimizer steps of a policy-gradient loss with an entropy bonus (temperature 0.7) on the whole batch:
    each step's logprobs, entropy, loss, every parameter's full gradient and the pre-clip norm."""
    ids, attention, targets, advantages = (t.to(backend.device) for t in parity_batch())
    steps = []
    for _ in range(NUM_STEPS):
        scores = backend.score_tokens(
            ids, attention, targets, temperature=0.7, with_entropy=True, entropy_requires_grad=True
        )
        assert scores.entropy is not None
        count = targets.sum()
        loss = -(scores.logprobs * advantages * targets).sum() / count - 0.01 * (scores.entropy * targets).sum() / count
        loss.backward()
        grads = {name: full(p.grad) for name, p in backend.model.named_parameters() if p.grad is not None}
        steps.append(
            {
                "logprobs": scores.logprobs.detach().cpu().clone(),
                "entropy": scores.entropy.detach().cpu().clone(),
                "loss": loss.detach().cpu().clone(),
                "grads": grads,
                "norm": backend.clip_and_step(),
            }
        )
    return steps


def _packed_scores(backend) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs and entropy of two packed rows (sequences of 5 and 7 tokens in one, 12 in the other; positions
    restart at 0 where a sequence starts), before any step."""
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(1, VOCAB, (2, 12), generator=generator)
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6], list(range(12))])
    targets = torch.ones(2, 11, dtype=torch.bool)
    targets[0, 4] = False  # the first sequence's last token does not predict the second's first
    with torch.no_grad():
        scores = backend.score_tokens(ids, None, targets, temperature=1.0, position_ids=positions, with_entropy=True)
    assert scores.entropy is not None
    return scores.logprobs.clone(), scores.entropy.clone()


def _tp2_worker(rank: int, num_ranks: int, port: int, models: dict[str, Path], out_dir: Path) -> None:
    import torch.distributed as dist

    from sharpen.trainer.backends.fsdp2 import FSDP2Backend

    join_process_group(rank, num_ranks, port)
    results: dict[str, object] = {}
    for layout, family, plan in CASES:
        config = _config(plan, sequence_parallel=SEQUENCE_PARALLEL.get(layout, True))
        backend = FSDP2Backend(config, model_path=models[family], dtype="float32", layout=LAYOUTS[layout])
        if family == "llama" and plan == "gather":
            results[f"{layout}/packed"] = _packed_scores(backend)
        results[f"{layout}/{family}/{plan}"] = _steps(backend)
        weights = {name: tensor.clone() for name, tensor in backend.named_weights()}
        results[f"{layout}/{family}/{plan}/weights"] = weights
    packed = _config(packing=True)
    backend = FSDP2Backend(packed, model_path=models["llama"], dtype="float32", layout=LAYOUTS["cp2"])
    results["cp2/trainer"] = trainer_steps(backend)
    layout = LAYOUTS["tp2"]
    backend = FSDP2Backend(_config(), model_path=models["llama"], dtype="float32", layout=layout)
    results["trainer"] = trainer_steps(backend)
    backend.save(out_dir / "checkpoint")
    backend.export(out_dir / "export")
    results["ranks"] = (backend.rank, backend.num_ranks)
    writers: list[object] = [None] * num_ranks
    dist.all_gather_object(writers, backend.is_writer)
    results["writers"] = writers
    if rank == 0:
        torch.save(results, out_dir / "tp2.pt")
    dist.destroy_process_group()


def _four_rank_worker(rank: int, num_ranks: int, port: int, models: dict[str, Path], out_dir: Path) -> None:
    import torch.distributed as dist

    from sharpen.trainer.backends.fsdp2 import FSDP2Backend

    join_process_group(rank, num_ranks, port)
    results = {}
    for name, layout in (
        ("dp_shard", ParallelLayout(dp_shard=2, tp=2)),
        ("hsdp", ParallelLayout(dp_replicate=2, tp=2)),
        ("cp", ParallelLayout(cp=2, tp=2)),
        ("hsdp_cp", ParallelLayout(dp_replicate=2, cp=2)),
    ):
        backend = FSDP2Backend(_config(), model_path=models["llama"], dtype="float32", layout=layout)
        results[name] = {"trainer": trainer_steps(backend), "ranks": (backend.rank, backend.num_ranks)}
    if rank == 0:
        torch.save(results, out_dir / "four_ranks.pt")
    dist.destroy_process_group()


def _resume_worker(rank: int, num_ranks: int, port: int, models: dict[str, Path], out_dir: Path) -> None:
    """The tp 2 checkpoint loaded on dp_shard 2 (DCP re-shards): its weights, before any step."""
    import torch.distributed as dist

    from sharpen.trainer.backends.fsdp2 import FSDP2Backend

    join_process_group(rank, num_ranks, port)
    backend = FSDP2Backend(_config(), model_path=models["llama"], dtype="float32")
    backend.load(out_dir / "checkpoint")
    weights = {name: tensor.clone() for name, tensor in backend.named_weights()}
    if rank == 0:
        torch.save(weights, out_dir / "resumed.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict, Path]:
    out_dir = tmp_path_factory.mktemp("tp")
    launch_ranks(_tp2_worker, 2, models, out_dir)
    launch_ranks(_four_rank_worker, 4, models, out_dir)
    launch_ranks(_resume_worker, 2, models, out_dir)
    return torch.load(out_dir / "tp2.pt"), torch.load(out_dir / "four_ranks.pt"), out_dir


@pytest.fixture(scope="module")
def single(runs, models: dict[str, Path]) -> dict[str, object]:
    """The same steps on one device (after the launches: see `support.ranks.launch_cpu_ranks`)."""
    results: dict[str, object] = {}
    for family in FAMILIES:
        backend = SingleDeviceBackend(_config(), model_path=models[family], dtype="float32")
        results[family] = _steps(backend)
        results[f"{family}/weights"] = dict(backend.named_weights())
    backend = SingleDeviceBackend(_config(), model_path=models["llama"], dtype="float32")
    results["trainer"] = trainer_steps(backend)
    backend = SingleDeviceBackend(_config(packing=True), model_path=models["llama"], dtype="float32")
    results["packed/trainer"] = trainer_steps(backend)
    results["packed"] = _packed_scores(SingleDeviceBackend(_config(), model_path=models["llama"], dtype="float32"))
    return results


@slow
@pytest.mark.parametrize(("layout", "family", "plan"), CASES)
def test_steps_match_one_process(runs, single, layout, family, plan):
    got_steps, expected_steps = runs[0][f"{layout}/{family}/{plan}"], single[family]
    for step, (got, expected) in enumerate(zip(got_steps, expected_steps, strict=True)):
        for key in ("logprobs", "entropy", "loss"):
            assert max_difference(got[key], expected[key]) < TOLERANCE, (step, key)
        assert got["grads"].keys() == expected["grads"].keys()
        for name, grad in expected["grads"].items():
            assert max_difference(got["grads"][name], grad) < TOLERANCE, (step, name)
        assert got["norm"] == pytest.approx(expected["norm"], rel=TOLERANCE)
    weights = runs[0][f"{layout}/{family}/{plan}/weights"]
    expected_weights = single[f"{family}/weights"]
    assert weights.keys() == expected_weights.keys()  # HF names, a tied LM head left out as on one device
    for name, tensor in expected_weights.items():
        assert relative_difference(weights[name], tensor) < WEIGHT_TOLERANCE, name


@slow
def test_the_default_plan_scores_as_one_process_does(runs, single):
    """The gather plan sums nothing across ranks: the first step's logprobs (before any update) are those of one
    process to float32 rounding of the split matmuls and the vocabulary-parallel log-softmax (measured: identical on
    these tiny models; on SmolLM2 at tp 3 they differ by up to 3e-5, docs/parallelism.md)."""
    for family in FAMILIES:
        got, expected = runs[0][f"tp2/{family}/gather"][0]["logprobs"], single[family][0]["logprobs"]
        assert max_difference(got, expected) <= 1e-6, family


@slow
def test_the_trainer_on_tp2_matches_one_device(runs, single):
    assert runs[0]["ranks"] == (0, 1)  # both ranks hold the same data: one data-parallel rank
    assert runs[0]["writers"] == [True, False]  # one of them writes the files written once (export, trainer.json)
    assert_trainer_matches(runs[0]["trainer"], single["trainer"])


@slow
@pytest.mark.parametrize("data_axis", ["dp_shard", "hsdp"])
def test_the_trainer_on_tp2_x_dp2_matches_one_device(runs, single, data_axis):
    """4 ranks: the data split over 2 data-parallel ranks (FSDP2's shards, or HSDP's replicas of an unsharded
    model), each of them a tp 2 pair."""
    assert runs[1][data_axis]["ranks"] == (0, 2)
    assert_trainer_matches(runs[1][data_axis]["trainer"], single["trainer"])


@slow
def test_the_trainer_on_tp2_x_cp2_matches_one_device(runs, single):
    """4 ranks, one data shard: each half of the sequence on a tp 2 pair."""
    assert runs[1]["cp"]["ranks"] == (0, 1)
    assert_trainer_matches(runs[1]["cp"]["trainer"], single["trainer"])


@slow
def test_the_trainer_on_dp_replicate2_x_cp2_matches_one_device(runs, single):
    """4 ranks: 2 HSDP replicas, each sharded over its 2 context-parallel ranks (FSDP2's dp_shard x cp)."""
    assert runs[1]["hsdp_cp"]["ranks"] == (0, 2)
    assert_trainer_matches(runs[1]["hsdp_cp"]["trainer"], single["trainer"])


@slow
@pytest.mark.parametrize("layout", ["tp2", "tp2 without sp", "cp2"])
def test_packed_rows_match_one_process(runs, single, layout):
    """Packed rows (attention never crosses a sequence): the scores under tensor parallelism with and without
    sequence parallelism (the decoder sees a shard of the sequence, the mask is the whole rows') and split over 2
    context-parallel ranks."""
    for got, expected in zip(runs[0][f"{layout}/packed"], single["packed"], strict=True):
        assert max_difference(got, expected) < TOLERANCE


@slow
def test_the_packed_trainer_on_cp2_matches_one_device(runs, single):
    assert_trainer_matches(runs[0]["cp2/trainer"], single["packed/trainer"])


@slow
def test_a_tp2_checkpoint_resumes_on_another_layout(runs):
    _, _, out_dir = runs
    saved = runs[0]["trainer"][1]
    resumed = torch.load(out_dir / "resumed.pt")
    assert resumed.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(resumed[name], tensor), name


@slow
def test_the_tp2_export_loads_in_transformers(runs):
    from transformers import AutoModelForCausalLM

    _, _, out_dir = runs
    model = AutoModelForCausalLM.from_pretrained(out_dir / "export")
    for name, tensor in runs[0]["trainer"][1].items():
        assert torch.equal(model.state_dict()[name], tensor), name


def test_a_model_without_a_plan_is_refused_in_one_line():
    from transformers import GPT2Config, GPT2LMHeadModel

    from sharpen.trainer.backends.tensor_parallel import model_tp_plan

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16))
    with pytest.raises(LayoutError, match="GPT2Config declares no tensor-parallel plan") as error:
        model_tp_plan(model)
    assert "\n" not in str(error.value)


def test_a_layout_that_does_not_divide_the_heads_is_refused(models):
    """Checked from config.json before any rank starts (`trainer.layout.ParallelLayout.check`)."""
    import json

    from sharpen.trainer.layout import ModelShape

    shape = ModelShape.from_hf_config(json.loads((models["llama"] / "config.json").read_text()))
    with pytest.raises(LayoutError, match=r"key/value heads \(2\) are not divisible by tp = 4"):
        ParallelLayout(tp=4).check(world_size=4, model=shape)


def _nccl_worker(rank: int, num_ranks: int, port: int, model_dir: Path, out_dir: Path) -> None:
    """One CUDA rank: the FSDP2 backend at layout size 1 (two optimizer steps), and the tensor-parallel plan at size
    1 on a model of its own (every parameter a DTensor on a 1-rank NCCL mesh, the LM head's vocabulary scored by
    `vocab_parallel_scores`; the backend applies the plan only for tp > 1)."""

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from sharpen.trainer.backends.fsdp2 import FSDP2Backend
    from sharpen.trainer.backends.scoring import score_tokens
    from sharpen.trainer.backends.tensor_parallel import apply_tensor_parallel

    join_process_group(rank, num_ranks, port, backend="nccl")
    backend = FSDP2Backend(_config(device="cuda"), model_path=model_dir, dtype="float32", layout=ParallelLayout())
    steps = [{key: value for key, value in step.items() if key != "grads"} for step in _steps(backend)]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda()
    vocab = apply_tensor_parallel(model, init_device_mesh("cuda", (1,), mesh_dim_names=("tp",))["tp"])
    ids, attention, targets, _ = (t.cuda() for t in parity_batch())
    with torch.no_grad():
        scores = score_tokens(model, ids, attention, targets, temperature=0.7, vocab=vocab)
    torch.save({"steps": steps, "plan_logprobs": scores.logprobs.cpu()}, out_dir / "nccl.pt")
    dist.destroy_process_group()


@slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_every_axis_at_size_1_on_nccl_matches_the_cpu(models, tmp_path):
    """The lent GPU machine's parallel-trainer check (benchmarks/gpu_check.sh runs every `gpu` test): the FSDP2
    backend at layout size 1 and the tensor-parallel plan at size 1 on NCCL, against the single-device CPU run."""
    launch_ranks(_nccl_worker, 1, models["llama"], tmp_path, device_type="cuda")
    got = torch.load(tmp_path / "nccl.pt")
    expected = _steps(SingleDeviceBackend(_config(), model_path=models["llama"], dtype="float32"))
    for got_step, step in zip(got["steps"], expected, strict=True):
        for key in ("logprobs", "entropy", "loss"):
            assert max_difference(got_step[key], step[key]) < TOLERANCE, key
    assert max_difference(got["plan_logprobs"], expected[0]["logprobs"]) < TOLERANCE
