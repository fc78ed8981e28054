"""The cluster simulator's validation table: predicted vs measured (this machine) vs published (AReaL, verl), each
with its error, and the error range of each kind of prediction over the rows that set no input. docs/scaling.md,
"Cluster simulator", holds its output; `sharpen simulate` prints the ranges beside its predictions
(`sharpen.simulation.report.STATED_ERROR`, checked against these rows by tests/unit/simulation/).

    .venv/bin/python benchmarks/simulator_validation.py

Every target below is a recorded figure, with where it was read; the simulator's inputs are in scenarios/*.toml.
Measured: benchmarks/async_overlap.py (scripted), the run recorded in docs/async.md ("Measured here") and a rerun
on 2026-12-04 with three other jobs on the machine. Published: Fu et al., "AReaL: A Large-Scale Asynchronous
Reinforcement Learning System for Language Reasoning", arXiv 2505.24298 (the PDF in github.com/inclusionAI/AReaL,
assets/paper.pdf), Table 1 (training hours for 250 PPO steps) and Table 7 (throughput vs staleness, 8 GPUs);
verl's docs/advance/one_step_off.md (github.com/volcengine/verl), "Experimental Results", the Megatron rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sharpen.simulation import Scenario, load_scenario, simulate
from sharpen.simulation.report import STATED_ERROR, with_changes

SCENARIOS = Path(__file__).parents[1] / "scenarios"
HOURS_TO_STEP_SECONDS = 3600 / 250  # Table 1: hours for 250 PPO steps -> seconds per step

# gen:train ratio -> (sync s/step, async s/step), benchmarks/async_overlap.py
RECORDED_SCRIPTED = {
    0.25: (0.709, 0.574),
    0.5: (0.777, 0.554),
    1.0: (0.990, 0.579),
    2.0: (1.389, 0.812),
    4.0: (2.186, 1.582),
}
RERUN_SCRIPTED = {0.25: (0.825, 0.707), 2.0: (1.239, 0.805), 4.0: (2.066, 1.595)}  # 0.5 and 1 were disturbed
TABLE7 = {0: 27.1, 1: 47.8, 2: 47.8, 4: 49.0, 8: 51.5, 16: 52.0}  # eta -> throughput (k tokens/s)


@dataclass(frozen=True, slots=True)
class Row:
    """One prediction against its target. ``kind`` is the kind of prediction `sharpen simulate` prints
    (`STATED_ERROR`'s keys; ``speedup_over_colocated`` is not printed); ``fitted`` rows set one of the scenario's
    inputs, so their error says nothing about the model."""

    what: str
    kind: str
    predicted: float
    target: float
    source: str
    fitted: bool = False

    @property
    def error(self) -> float:
        return self.predicted / self.target - 1


def scripted(ratio: float, overhead: float) -> tuple[float, float]:
    """Predicted (sync, async) s/step at a gen:train ratio; `overhead` is the run's seconds per step besides the
    two sleeps, set by one ratio of that run (the machine's load changes it from run to run)."""
    scenario = load_scenario(SCENARIOS / "this_machine_scripted.toml")
    scenario = with_changes(scenario, costs={"decode_round_seconds": 0.4 * ratio, "step_overhead_s": overhead})
    asynchronous = simulate(scenario).step_seconds
    return simulate(with_changes(scenario, rollout={"mode": "sync"})).step_seconds, asynchronous


def sync_of(scenario: Scenario) -> Scenario:
    return with_changes(scenario, rollout={"mode": "sync", "continuous_batching": False})


def colocated_of(scenario: Scenario) -> Scenario:
    gpus = scenario.cluster.num_engine_gpus + scenario.cluster.num_trainer_gpus
    return with_changes(
        sync_of(scenario), cluster={"placement": "colocated", "num_engine_gpus": gpus, "num_trainer_gpus": gpus}
    )


def scripted_rows() -> list[Row]:
    rows = []
    for runs, calibration, source in (
        (RECORDED_SCRIPTED, 1.0, "measured, docs/async.md"),
        (RERUN_SCRIPTED, 4.0, "measured, rerun"),
    ):
        overhead = runs[calibration][0] - 0.4 * calibration - 0.4
        for ratio, (sync_s, async_s) in runs.items():
            predicted_sync, predicted_async = scripted(ratio, overhead)
            what, fitted = f"scripted gen:train {ratio:g}", ratio == calibration
            if fitted:
                what += f" (its sync s/step sets the overhead, {overhead:.3f} s)"
            rows.append(Row(f"{what}: async s/step", "step_seconds", predicted_async, async_s, source, fitted))
            speedup = predicted_sync / predicted_async
            rows.append(Row(f"{what}: async speedup", "async_speedup", speedup, sync_s / async_s, source, fitted))
    demo = simulate(load_scenario(SCENARIOS / "this_machine.toml"))
    # its inputs are the same run's phase medians: a consistency check, not a prediction
    rows.append(
        Row(
            "demo recipe (SmolLM2, vLLM CPU): sync s/step",
            "step_seconds",
            demo.step_seconds,
            5.84,
            "measured, runs/demo-s26",
            fitted=True,
        )
    )
    return rows


def areal_rows() -> list[Row]:
    rows = []
    for name, nodes, (verl_h, sync_h, async_h) in (
        ("1p5b", 16, (33.6, 41.0, 14.8)),
        ("7b", 24, (52.1, 57.7, 25.4)),
    ):
        scenario = load_scenario(SCENARIOS / f"areal_{name}_async.toml")
        asynchronous = simulate(scenario).step_seconds
        synchronous = simulate(sync_of(scenario)).step_seconds
        colocated = simulate(colocated_of(scenario)).step_seconds
        label, fitted = f"AReaL {name.replace('p', '.').upper()}, {nodes} nodes", name == "1p5b"
        if fitted:
            label += " (its async and sync s/step set the efficiencies)"
        source = "published, Table 1"
        rows += [
            Row(
                f"{label}: async s/step", "step_seconds", asynchronous, async_h * HOURS_TO_STEP_SECONDS, source, fitted
            ),
            Row(
                f"{label}: sync s/step (eta 0)",
                "step_seconds",
                synchronous,
                sync_h * HOURS_TO_STEP_SECONDS,
                source,
                fitted,
            ),
            Row(
                f"{label}: verl-like colocated s/step",
                "step_seconds",
                colocated,
                verl_h * HOURS_TO_STEP_SECONDS,
                source,
            ),
            Row(
                f"{label}: async speedup over sync",
                "async_speedup",
                synchronous / asynchronous,
                sync_h / async_h,
                source,
                fitted,
            ),
            Row(
                f"{label}: async speedup over verl",
                "speedup_over_colocated",
                colocated / asynchronous,
                verl_h / async_h,
                source,
            ),
        ]
    sweep = load_scenario(SCENARIOS / "areal_1p5b_8gpu.toml")
    base = simulate(with_changes(sweep, rollout={"max_staleness": 0})).step_seconds
    for eta, throughput in TABLE7.items():
        if eta:
            step = simulate(with_changes(sweep, rollout={"max_staleness": eta})).step_seconds
            rows.append(
                Row(
                    f"AReaL 1.5B, 8 GPUs: speedup at eta {eta} over eta 0",
                    "async_speedup",
                    base / step,
                    throughput / TABLE7[0],
                    "published, Table 7",
                )
            )
    return rows


def verl_rows() -> list[Row]:
    one_step_off = load_scenario(SCENARIOS / "verl_7b_one_step_off.toml")
    colocated = simulate(colocated_of(one_step_off))
    asynchronous = simulate(one_step_off)
    label, source = "verl DAPO 7B, 16 H20", "published, verl one_step_off.md"
    return [
        Row(f"{label}: colocated sync s/step (fitted)", "step_seconds", colocated.step_seconds, 699, source, True),
        Row(
            f"{label}: colocated generation s (fitted)",
            "generation_seconds",
            colocated.generation_seconds,
            207,
            source,
            True,
        ),
        Row(f"{label}: one-step-off 4 + 12 s/step", "step_seconds", asynchronous.step_seconds, 566, source),
        Row(f"{label}: one-step-off generation s", "generation_seconds", asynchronous.generation_seconds, 501, source),
        Row(
            f"{label}: speedup",
            "speedup_over_colocated",
            colocated.step_seconds / asynchronous.step_seconds,
            699 / 566,
            source,
        ),
    ]


def validation_rows() -> list[Row]:
    return [*scripted_rows(), *areal_rows(), *verl_rows()]


def error_ranges(rows: list[Row]) -> dict[str, tuple[float, float]]:
    """Per kind of prediction, the lowest and highest error of the rows that set no input."""
    ranges: dict[str, tuple[float, float]] = {}
    for row in rows:
        if not row.fitted:
            low, high = ranges.get(row.kind, (row.error, row.error))
            ranges[row.kind] = (min(low, row.error), max(high, row.error))
    return ranges


def main() -> None:
    rows = validation_rows()
    print("| quantity | predicted | target | error | target's source |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row.what} | {row.predicted:.3g} | {row.target:.3g} | {row.error:+.1%} | {row.source} |")
    print("\nerror range per kind of prediction (rows that set no input) | stated by `sharpen simulate`")
    for kind, (low, high) in error_ranges(rows).items():
        stated = STATED_ERROR.get(kind)
        print(f"{kind}: {low:+.1%} to {high:+.1%} | {stated.tag() if stated else 'not printed'}")


if __name__ == "__main__":
    main()
