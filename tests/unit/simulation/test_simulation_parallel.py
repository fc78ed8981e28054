"""The simulator's model of a parallel trainer layout: the collectives each tensor-parallel plan runs per layer
(counted from DTensor on sharpen's real plans), the alpha-beta times and pipeline bubble by hand, the model state per
GPU, the layout search, and bad layouts."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
from simulation_scenarios import base_scenario
from torch.testing._internal.distributed.fake_pg import FakeStore

from sharpen.simulation import ScenarioError, parse_scenario
from sharpen.simulation.costs import CostModel
from sharpen.simulation.parallel import (
    LayerShape,
    activation_bytes_per_gpu,
    layer_collectives,
    pipeline_bubble_factor,
    state_bytes_per_gpu,
)
from sharpen.simulation.report import build_report

NUM_LAYERS = 3
_KINDS = {  # DTensor's functional collectives -> the simulator's names
    "c10d_functional.all_gather_into_tensor": "all_gather",
    "c10d_functional.all_reduce": "all_reduce",
    "c10d_functional.reduce_scatter_tensor": "reduce_scatter",
}


def _counted(plan: str) -> tuple[Counter[str], Counter[str]]:
    """The functional collectives (forward, backward) of one scoring pass of a 3-layer Llama under sharpen's
    tensor-parallel ``plan`` with tp 2, counted by DTensor's CommDebugMode on a fake 2-rank process group, in a
    spawned process. DTensor keeps state process-wide (most likely its sharding-propagation cache, which holds the
    vocabulary-split embedding's mask placement): run in the test process, the ranks that test_parallel_trainer
    forks later inherited it and their embedding gradients were off by 0.5. Spawned, not forked: a child forked
    after earlier tests had started threads in this process hung on a lock those threads held (twice, here)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_count_into, args=(plan, sender))
    child.start()
    sender.close()  # the child's end alone stays open: if it dies, recv raises EOFError instead of waiting
    try:
        assert receiver.poll(300), "the counting process gave no answer within 300 s"
        counts = receiver.recv()
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
    return counts


def _count_into(plan: str, sender: Any) -> None:
    sender.send(_count(plan))


def _count(plan: str) -> tuple[Counter[str], Counter[str]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from transformers import LlamaConfig, LlamaForCausalLM

    from sharpen.trainer.backends.scoring import score_tokens
    from sharpen.trainer.backends.tensor_parallel import apply_tensor_parallel

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=128,
            hidden_size=32,
            num_hidden_layers=NUM_LAYERS,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
        )
        model = LlamaForCausalLM(config)
        vocab = apply_tensor_parallel(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))["tp"], plan=plan)
        ids = torch.randint(1, 128, (2, 8))
        with CommDebugMode() as forward:
            scores = score_tokens(model, ids, None, torch.ones(2, 7, dtype=torch.bool), temperature=1.0, vocab=vocab)
        with CommDebugMode() as backward:
            scores.logprobs.sum().backward()
    finally:
        dist.destroy_process_group()

    def named(mode: Any) -> Counter[str]:
        return Counter({_KINDS[str(op)]: n for op, n in mode.get_comm_counts().items() if str(op) in _KINDS})

    return named(forward), named(backward)


@pytest.mark.parametrize("plan", ["gather", "rowwise"])
def test_the_collectives_per_layer_are_those_dtensor_runs(plan: str) -> None:
    forward, backward = _counted(plan)
    table = layer_collectives(plan, tp=2, cp=1)
    expected_forward = Counter()
    expected_backward = Counter()
    for collective in table:
        (expected_forward if collective.pass_ == "forward" else expected_backward)[collective.kind] += NUM_LAYERS
    # outside the layers: the vocabulary-split embedding's all-reduce (forward) and the LM head input's gradient
    expected_forward["all_reduce"] += 1
    expected_backward["all_reduce"] += 1
    assert forward == expected_forward
    assert backward == expected_backward


def test_tensor_parallel_time_by_hand() -> None:
    """rowwise, tp 2, one layer, 1000 tokens of width 1000 in bf16 (2 MB a tensor), no latency, 100 GB/s: 4 ring
    all-reduces over 2 ranks, each 2 x (2 - 1) x (2 MB / 2) / 100 GB/s = 2e-5 s."""
    model = {"num_params": 1e9, "num_layers": 1, "hidden_size": 1000, "intermediate_size": 3000}
    model |= {"num_attention_heads": 8, "num_key_value_heads": 8, "bytes_per_param": 2.0}
    network = {"latency_us": 0.0, "intra_node_gbps": 100.0}
    layout = {"tp": 2, "tp_plan": "rowwise"}
    data = base_scenario(model=model, cluster={"num_trainer_gpus": 2}) | {"network": network, "trainer": layout}
    scenario = parse_scenario(data)
    assert CostModel(scenario=scenario).layer_collective_seconds(1000) == pytest.approx(4 * 2e-5)


def test_the_pipeline_bubble_and_the_state_per_gpu_by_hand() -> None:
    assert pipeline_bubble_factor(4, 8) == pytest.approx(11 / 8)  # (m + p - 1) / m
    assert pipeline_bubble_factor(4, 8, stages_per_rank=2) == pytest.approx(9.5 / 8)  # (m + (p - 1) / v) / m
    assert pipeline_bubble_factor(1, 8) == 1.0
    assert state_bytes_per_gpu(7e10, tp=4, pp=2, dp_shard=4) == pytest.approx(16 * 7e10 / 32)


def test_the_activations_per_gpu_by_hand() -> None:
    """2 layers of hidden 1000, intermediate 3000, 8 heads and 8 key/value heads (q, k, v: 3000 wide), bf16: per token
    and layer 2 x (4 x 1000 norms + 1000 attention output + 3000 q/k/v + 4 x 3000 MLP) = 40000 bytes."""
    shape = LayerShape(
        num_layers=2, hidden_size=1000, intermediate_size=3000, num_attention_heads=8, num_key_value_heads=8
    )

    def activations(**layout: Any) -> float:
        sizes = {"tp": 1, "pp": 1, "cp": 1, "micro_batches": 4} | layout
        return activation_bytes_per_gpu(shape, 100, **sizes)

    assert activations() == pytest.approx(100 * 2 * 40000)  # 100 tokens x 2 layers, one micro-batch in flight
    assert activations(cp=2) == pytest.approx(100 * 2 * 40000 / 2)
    assert activations(tp=2) == pytest.approx(100 * 2 * 20000)  # sequence parallel: all of it split
    assert activations(tp=2, sequence_parallel=False) == pytest.approx(100 * 2 * 2 * (4000 + 16000 / 2))
    assert activations(pp=2) == pytest.approx(100 * 1 * 2 * 40000)  # 1 layer a stage, 2 micro-batches in flight
    assert activations(pp=2, stages_per_rank=2) == pytest.approx(100 * 1 * 2 * 1.25 * 40000)  # x (1 + 1 / (2 x 2))
    # checkpointing: each layer's input (2 x 1000 bytes a token), plus one layer recomputed whole
    assert activations(checkpointing=True) == pytest.approx(100 * (2 * 2000 + 40000))


def test_long_sequences_need_context_or_tensor_parallelism_to_fit() -> None:
    """An 8B-shaped model on 8 H100s with responses up to 64k tokens: one sequence's activations (168 kB a token and
    layer, 32 layers) are 353 GB, so only a layout that splits each sequence 8 ways (tp x cp = 8) fits; the search
    names one."""
    model = {"num_params": 8e9, "num_layers": 32, "hidden_size": 4096, "intermediate_size": 14336}
    model |= {"num_attention_heads": 32, "num_key_value_heads": 8}
    response = {"kind": "lognormal", "median": 8000, "sigma": 0.5, "max": 65536}
    data = base_scenario(model=model, response=response, cluster={"num_trainer_gpus": 8})
    report = build_report(parse_scenario(data), search_layout=True)
    best = report.best_layout
    assert best is not None and best.tp * best.cp == 8
    alone = next(c for c in report.layouts if (c.tp, c.pp, c.cp) == (1, 1, 1))
    assert not alone.fits and alone.activation_gib_per_gpu > 300
    assert all(c.tp * c.cp == 8 for c in report.layouts if c.fits)


def _seventy_b(num_trainer_gpus: int) -> dict[str, Any]:
    model = {"num_params": 7.06e10, "num_layers": 80, "hidden_size": 8192, "intermediate_size": 28672}
    model |= {"num_attention_heads": 64, "num_key_value_heads": 8}
    cluster = {"num_engine_gpus": 8, "num_trainer_gpus": num_trainer_gpus}
    return base_scenario(model=model, cluster=cluster, trainer={"activation_checkpointing": True})


def test_the_layout_search_names_the_fastest_layout_that_fits() -> None:
    report = build_report(parse_scenario(_seventy_b(32)), search_layout=True)
    best = report.best_layout
    assert best is not None and best.fits
    assert all(c.train_seconds >= best.train_seconds for c in report.layouts if c.fits)
    assert all(c.tp * c.pp * c.cp * c.dp_shard == 32 and c.tp <= 8 for c in report.layouts)
    assert "<- best" in report.to_text()


def test_a_model_no_layout_fits_says_so() -> None:
    """1.1 TB of model state over 8 H100s (80 GiB) cannot fit whatever the split."""
    report = build_report(parse_scenario(_seventy_b(8)), search_layout=True)
    assert report.best_layout is None
    assert "none fits" in report.to_text()


@pytest.mark.parametrize(
    ("trainer", "message"),
    [
        ({"tp": 3}, r"trainer: tp 3 x pp 1 x cp 1 = 3 does not divide cluster.num_trainer_gpus = 4"),
        ({"tp": 2}, r"a parallel layout needs the model's layer sizes"),
    ],
)
def test_a_bad_layout_is_one_scenario_error(trainer: dict[str, int], message: str) -> None:
    with pytest.raises(ScenarioError, match=message):
        parse_scenario(base_scenario() | {"trainer": trainer})
