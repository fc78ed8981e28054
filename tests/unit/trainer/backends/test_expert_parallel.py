"""Expert parallelism (`trainer.parallel.ep`): on 2 gloo ranks, each with its own rows (so the all-to-all splits are
uneven), FSDP2 with the experts split over ep = 2 computes what FSDP2 with whole experts (ep = 1) computes — the
logprobs, the loss and every parameter's gradient, float32, 1e-5 — on tiny random models of the three expert
families (Mixtral, Qwen3-MoE, DeepSeek-V3 with a shared expert and expert groups); and the layouts it cannot run
are one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sharpen.config.schema import TrainerConfig
from sharpen.trainer.layout import LayoutError, ParallelLayout
from sharpen.weight_shards import assemble_ranks
from support.ranks import join_process_group, launch_ranks
from support.tiny_moe import FAMILIES, VOCAB, tiny_moe


def _save(family: str, folder: Path) -> Path:
    model = tiny_moe(family, tie_word_embeddings=False)
    with torch.no_grad():  # routers that choose clearly, and experts that differ (transformers starts some at 0)
        for name, parameter in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "gate_up_proj", "down_proj")):
                parameter.normal_(0, 0.5 if "gate.weight" in name else 0.05)
    model.save_pretrained(folder)
    return folder


def _rows(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's right-padded rows (rank 0: three, rank 1: one longer), their mask and targets."""
    generator = torch.Generator().manual_seed(10 + rank)
    lengths = [9, 5, 7] if rank == 0 else [12]
    width = max(lengths)
    ids = torch.randint(1, VOCAB, (len(lengths), width), generator=generator)
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    return ids * mask, mask, mask[:, 1:].bool()


def _worker(rank: int, num_ranks: int, port: int, folders: dict[str, Path], out: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from sharpen.trainer.backends.fsdp2 import FSDP2Backend

    join_process_group(rank, num_ranks, port)
    config = TrainerConfig(device="cpu", precision="float32")
    ids, mask, targets = _rows(rank)
    results = {}
    for family, folder in folders.items():
        for ep in (1, 2):
            backend = FSDP2Backend(config, model_path=folder, dtype="float32", layout=ParallelLayout(dp_shard=2, ep=ep))
            logprobs = backend.score_tokens(ids, mask, targets, temperature=1.0).logprobs
            loss = -(logprobs * targets).sum()
            loss.backward()
            gradients = {}
            for name, parameter in backend.model.named_parameters():
                grad = parameter.grad
                if grad is not None:
                    gradients[name] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach().clone()
            total = backend.all_reduce_sum({"loss": float(loss.detach())})["loss"]
            weights = {name: tensor.clone() for name, tensor in backend.named_weights()}
            results[family, ep] = {"logprobs": logprobs.detach(), "loss": total, "grads": gradients, "weights": weights}
            if ep == 2:  # this rank's pieces for the direct weight sync; a checkpoint written and read back
                results[family, "pieces"] = backend.weight_shards()
                backend.clip_and_step()
                backend.save(out / f"{family}-checkpoint")
                stepped = {name: tensor.clone() for name, tensor in backend.named_weights()}
                loaded = FSDP2Backend(
                    config, model_path=folder, dtype="float32", layout=ParallelLayout(dp_shard=2, ep=2)
                )
                loaded.load(out / f"{family}-checkpoint")
                results[family, "stepped"] = stepped
                results[family, "loaded"] = {name: tensor.clone() for name, tensor in loaded.named_weights()}
    torch.save(results, out / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    folders = {family: _save(family, tmp_path_factory.mktemp(family)) for family in FAMILIES}
    out = tmp_path_factory.mktemp("ep_runs")
    launch_ranks(_worker, 2, folders, out)
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(2)]  # WeightShard objects


@pytest.mark.parametrize("family", FAMILIES)
def test_ep2_equals_ep1_in_logprobs_loss_and_gradients(runs: list[dict], family: str):
    for rank, results in enumerate(runs):
        whole, split = results[family, 1], results[family, 2]
        torch.testing.assert_close(split["logprobs"], whole["logprobs"], rtol=1e-5, atol=1e-6, msg=f"rank {rank}")
        assert split["loss"] == pytest.approx(whole["loss"], rel=1e-5)
        assert split["grads"].keys() == whole["grads"].keys()
        for name, gradient in whole["grads"].items():  # 1e-5 of each gradient's scale (float32 sums' rounding)
            scale = float(gradient.abs().max())
            torch.testing.assert_close(split["grads"][name], gradient, rtol=1e-5, atol=1e-5 * scale, msg=name)
        experts = [name for name in whole["grads"] if name.endswith("gate_up_proj")]
        assert experts and all(float(whole["grads"][name].abs().sum()) > 0 for name in experts)
        # the weights an engine receives are whole, in HF names, whatever the split
        assert split["weights"].keys() == whole["weights"].keys()
        for name, weight in whole["weights"].items():
            torch.testing.assert_close(split["weights"][name], weight, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_split_experts_sync_by_pieces_and_survive_a_checkpoint(runs: list[dict], family: str):
    whole = runs[0][family, 1]["weights"]
    assembled = dict(assemble_ranks(results[family, "pieces"] for results in runs))
    assert assembled.keys() == whole.keys()
    for name, weight in whole.items():
        torch.testing.assert_close(assembled[name], weight, rtol=0, atol=0, msg=name)
    stepped, loaded = runs[0][family, "stepped"], runs[0][family, "loaded"]
    assert any(not torch.equal(stepped[name], whole[name]) for name in whole if "experts" in name)  # it stepped
    for name, weight in stepped.items():
        torch.testing.assert_close(loaded[name], weight, rtol=0, atol=0, msg=name)


def test_layouts_expert_parallelism_cannot_run_are_one_line():
    with pytest.raises(LayoutError, match="ep 2 must divide dp_shard x cp = 3"):
        ParallelLayout(dp_shard=3, ep=2).check(world_size=3)
    with pytest.raises(LayoutError, match=r"expert parallelism \(ep 2\) with both tensor \(tp 2\) and context"):
        ParallelLayout(cp=2, tp=2, ep=2).check_built()
    ParallelLayout(cp=2, ep=2).check_built()  # with context, tensor, pipeline and replicated data parallelism, it runs
    ParallelLayout(dp_shard=2, tp=2, ep=2).check_built()
    ParallelLayout(pp=2, dp_shard=2, ep=2).check_built()
    ParallelLayout(dp_replicate=2, dp_shard=2, ep=2).check_built()
    with pytest.raises(LayoutError, match=r"takes neither trainer\.lora"):
        ParallelLayout(dp_shard=2, ep=2).check_features(lora=True, vision=False, distillation=False)


def _skewed_worker(rank: int, num_ranks: int, port: int, out: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from sharpen.trainer.backends.expert_parallel import apply_expert_parallel, expert_modules

    join_process_group(rank, num_ranks, port)
    model = tiny_moe("mixtral")  # seeded: the same weights on both ranks
    whole = tiny_moe("mixtral")
    generator = torch.Generator().manual_seed(rank)
    hidden = torch.randn(5, 32, generator=generator)
    top_k_index = torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0], [0, 1]])  # experts 0 and 1: rank 0's
    top_k_weights = torch.rand(5, 2, generator=generator)
    results = {}
    for name, module in (("split", model), ("whole", whole)):
        if name == "split":
            apply_expert_parallel(module, init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))["ep"])
        inputs = hidden.clone().requires_grad_(True)
        output = expert_modules(module)[0](inputs, top_k_index, top_k_weights)
        (output * torch.arange(32.0)).sum().backward()
        results[name] = (output.detach(), inputs.grad)
    torch.save(results, out / f"skewed{rank}.pt")
    dist.destroy_process_group()


def test_a_rank_whose_experts_receive_no_tokens_still_joins_the_backward(tmp_path: Path):
    """Every token of both ranks goes to rank 0's experts: rank 1's experts receive nothing, yet the rows rank 1 sent
    must come back with their gradient (the reverse all-to-all needs both ranks: a rank whose received rows left the
    graph skipped it, and the ranks' collectives went out of step). Outputs and input gradients equal the whole
    experts' on each rank."""
    launch_ranks(_skewed_worker, 2, tmp_path)
    for rank in range(2):
        results = torch.load(tmp_path / f"skewed{rank}.pt")
        for got, expected in zip(results["split"], results["whole"], strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=f"rank {rank}")
