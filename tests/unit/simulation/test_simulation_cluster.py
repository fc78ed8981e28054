"""The simulated loop's behaviour: what async buys and when, staleness 0 is sync, scaling engines, the split
search, colocation, failures and stragglers."""

from __future__ import annotations

import pytest
from simulation_scenarios import base_scenario

from sharpen.simulation import parse_scenario, search_split, simulate


def _async_tail_case(response: dict[str, object]) -> tuple[float, float]:
    """Generation only (training nearly free), each engine full with one batch: async can only help by putting
    the next batch into the slots a batch's tail leaves empty."""
    data = base_scenario(
        response=response,
        cluster={"num_engine_gpus": 4, "num_trainer_gpus": 4, "max_sequences_per_engine": 8},
        costs={"decode_round_seconds": 0.01, "train_seconds_per_step": 1e-3, "sync_seconds": 0.0},
    )
    sync = simulate(parse_scenario(data))
    data["rollout"] = {"mode": "async", "max_staleness": 1, "continuous_batching": True}
    return sync.step_seconds, simulate(parse_scenario(data)).step_seconds


def test_async_pays_off_with_heavy_tailed_lengths_and_not_with_constant_ones() -> None:
    sync, asynchronous = _async_tail_case({"kind": "lognormal", "median": 100, "sigma": 1.2, "max": 2000})
    assert sync / asynchronous > 1.3
    sync, asynchronous = _async_tail_case({"median": 100})
    assert sync / asynchronous == pytest.approx(1.0, abs=0.02)


def test_async_overlaps_generation_with_training() -> None:
    data = base_scenario(costs={"decode_round_seconds": 0.01, "train_seconds_per_step": 1.0, "sync_seconds": 0.0})
    sync = simulate(parse_scenario(data))  # 100 rounds of 0.01 s, then 1 s of training
    assert sync.step_seconds == pytest.approx(2.0, rel=1e-6)
    data["rollout"] = {"mode": "async", "max_staleness": 1}
    asynchronous = simulate(parse_scenario(data))
    assert asynchronous.step_seconds == pytest.approx(1.0, rel=1e-6)
    assert asynchronous.staleness_mean > 0.5


def test_async_with_zero_staleness_is_the_sync_run() -> None:
    data = base_scenario(response={"kind": "lognormal", "median": 100, "sigma": 1.0})
    sync = simulate(parse_scenario(data))
    data["rollout"] = {"mode": "async", "max_staleness": 0}
    zero = simulate(parse_scenario(data))
    assert zero.step_times == sync.step_times
    assert zero.staleness_mean == 0.0


def _step_with_engines(num_engine_gpus: int) -> float:
    """Decode cost grows with the sequences a replica runs (compute-bound), so more replicas split it."""
    data = base_scenario(
        cluster={"num_engine_gpus": num_engine_gpus, "num_trainer_gpus": 4},
        costs={
            "decode_round_seconds": 1e-4,
            "decode_round_seconds_per_sequence": 3e-3,
            "train_seconds_per_step": 1.0,
            "sync_seconds": 0.0,
        },
        rollout={"mode": "async", "max_staleness": 1},
    )
    return simulate(parse_scenario(data)).step_seconds


def test_more_engines_cut_the_step_until_training_dominates() -> None:
    steps = [_step_with_engines(n) for n in (1, 2, 4, 8, 16, 32)]
    assert steps[0] > steps[1] > steps[2] > steps[3] > 1.0  # 32 sequences x 100 rounds x 3 ms / engines
    assert steps[4] == pytest.approx(1.0, rel=0.01) and steps[5] == pytest.approx(1.0, rel=0.01)


def test_the_split_search_finds_the_balanced_split() -> None:
    """Generation costs 3x training on one GPU each and both scale linearly: of 8 GPUs, 6 engines + 2 trainer
    GPUs balance them (step = 1/2 of one GPU's training); 5 + 3 and 7 + 1 are slower. 48 episodes split evenly
    over 6 replicas."""
    one_gpu_train = 6 * 1e9 * 48 * 150 / (989e12 * 0.35)  # the FLOP model's seconds on one H100
    per_sequence = 3 * one_gpu_train / (48 * 100)  # 48 sequences x 100 rounds on one engine = 3x that
    data = base_scenario(
        costs={"decode_round_seconds": 1e-9, "decode_round_seconds_per_sequence": per_sequence, "sync_seconds": 0.0},
        rollout={"mode": "async", "max_staleness": 1},
        workload={"prompts_per_step": 12},
    )
    candidates = search_split(parse_scenario(data), 8)
    best = min(candidates, key=lambda c: c.step_seconds)
    assert (best.num_engine_gpus, best.num_trainer_gpus) == (6, 2)
    assert best.step_seconds == pytest.approx(one_gpu_train / 2, rel=0.01)


def test_colocated_sync_adds_sleep_and_wake_and_the_roles_share_gpus() -> None:
    data = base_scenario(
        cluster={"placement": "colocated", "num_engine_gpus": 4, "num_trainer_gpus": 4},
        costs={"decode_round_seconds": 0.01, "train_seconds_per_step": 1.0, "sync_seconds": 0.1},
    )
    plain = simulate(parse_scenario(data))
    assert plain.step_seconds == pytest.approx(1.0 + 1.0 + 0.1, rel=1e-6)
    data["costs"]["sleep_wake_seconds"] = 0.5
    assert simulate(parse_scenario(data)).step_seconds == pytest.approx(2.6, rel=1e-6)


def test_failures_and_stragglers_slow_the_run() -> None:
    data = base_scenario(costs={"decode_round_seconds": 0.01, "train_seconds_per_step": 0.1, "sync_seconds": 0.0})
    healthy = simulate(parse_scenario(data))
    data["failures"] = {"engine_mtbf_hours": 0.001, "restart_seconds": 0.5}  # one failure per 3.6 s per engine
    failing = simulate(parse_scenario(data))
    assert failing.num_engine_failures > 0 and failing.wasted_tokens > 0
    assert failing.step_seconds > healthy.step_seconds
    data["failures"] = {"straggler_fraction": 0.25, "straggler_slowdown": 3.0}
    straggling = simulate(parse_scenario(data))  # one of 4 replicas, and one of 4 trainer GPUs, 3x slower
    assert straggling.step_seconds == pytest.approx(3 * 1.0 + 3 * 0.1, rel=0.01)


def test_the_bandwidth_model_prices_decode_and_the_sync() -> None:
    """A 1B bf16 model on an H100 at 60% of 3.35 TB/s: a round with no KV cache reads 2 GB in ~1 ms."""
    data = base_scenario(model={"num_params": 1e9, "kv_bytes_per_token": 0.0})
    result = simulate(parse_scenario(data))
    round_seconds = 2e9 / (3.35e12 * 0.6)
    assert result.generation_seconds == pytest.approx(100 * round_seconds, rel=0.05)
    # 4 trainer GPUs gather 2 GB over NVLink, then a chain of 5 ranks within a node sends 15 buckets of 128 MiB
    gather = 3 * (1e-5 + 2e9 / 4 / 400e9)
    chain = (4 + 14) * (1e-5 + 2e9 / 15 / 400e9)
    assert result.sync_seconds == pytest.approx(gather + chain, rel=1e-6)


def test_environment_and_reward_fleets_queue_their_calls() -> None:
    """32 episodes of 100 tokens on 4 replicas take 1 s at 0.01 s per round; one worker serving 0.01 s calls
    holds the last one back 0.32 s; as many workers as episodes do not."""
    costs = {"decode_round_seconds": 0.01, "train_seconds_per_step": 0.1, "sync_seconds": 0.0}
    one_worker = {"num_workers": 1, "service_seconds": {"median": 0.01}}
    data = base_scenario(costs=costs)
    assert simulate(parse_scenario(data)).step_seconds == pytest.approx(1.1, rel=1e-6)
    data["reward"] = one_worker
    assert simulate(parse_scenario(data)).step_seconds == pytest.approx(1.42, rel=1e-6)
    data["reward"] = {"num_workers": 32, "service_seconds": {"median": 0.01}}
    assert simulate(parse_scenario(data)).step_seconds == pytest.approx(1.11, rel=1e-6)
    # two turns of 50 tokens: the environment call between them queues the same way
    data = base_scenario(costs=costs, workload={"num_turns": 2})
    data["environment"] = one_worker
    assert simulate(parse_scenario(data)).step_seconds == pytest.approx(1.42, rel=1e-6)
