"""What `sharpen simulate` prints: a scenario's simulated step time, utilisation per role, sync time, the async
speedup over the same cluster run synchronously, and, on request, the best rollout/trainer split of a GPU budget.

It owns running the variants a report needs (the sync counterpart, the split candidates), reporting progress on
the searches, and formatting them as text or JSON with each prediction's stated error (`STATED_ERROR`). It does not
model anything itself (cluster.py, costs.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from sharpen.simulation.cluster import SimulationResult, simulate
from sharpen.simulation.costs import CostModel
from sharpen.simulation.parallel import activation_bytes_per_gpu, state_bytes_per_gpu
from sharpen.simulation.scenario import Scenario, ScenarioError, check_layout

MAX_SPLIT_CANDIDATES = 24
MAX_LAYOUT_LINES = 12
AXIS_SIZES = (1, 2, 4, 8, 16)

Progress = Callable[[str], None]
"""Receives one line per finished candidate of a search (the CLI prints it on stderr)."""


@dataclass(frozen=True, slots=True)
class StatedError:
    """How far one kind of prediction was from measured and published runs: predicted / actual - 1, lowest and
    highest, over the validation rows that set none of the scenario's inputs (docs/scaling.md, "Cluster simulator";
    benchmarks/simulator_validation.py computes them, and a test checks these bounds against it)."""

    low: float
    high: float

    def tag(self) -> str:
        return f"[validated {self.low:+.0%} to {self.high:+.0%}]"


STATED_ERROR = {
    "step_seconds": StatedError(low=-0.35, high=0.67),
    "generation_seconds": StatedError(low=0.17, high=0.18),
    "async_speedup": StatedError(low=-0.17, high=0.05),
}
"""The error ranges `sharpen simulate` prints beside its step time, generation time and async speedup; the other
numbers it prints (busy fractions, staleness, a best split or layout) were not compared with a real run."""
NOT_VALIDATED = (
    "[validated ...]: how far this kind of prediction was from measured and published runs (predicted / actual - 1;\n"
    "docs/scaling.md, Cluster simulator); the other numbers, and a best split or layout, were not validated"
)


def with_changes(scenario: Scenario, **sections: dict[str, object]) -> Scenario:
    """A copy with some keys of some sections replaced, validated again (so a bad combination still errors)."""
    data = scenario.model_dump()
    for section, values in sections.items():
        data[section].update(values)
    return Scenario.model_validate(data)


@dataclass(kw_only=True, slots=True)
class SplitCandidate:
    num_engine_gpus: int
    num_trainer_gpus: int
    step_seconds: float


@dataclass(kw_only=True, slots=True)
class LayoutCandidate:
    tp: int
    pp: int
    cp: int
    dp_shard: int
    train_seconds: float
    state_gib_per_gpu: float
    activation_gib_per_gpu: float
    fits: bool


@dataclass(kw_only=True, slots=True)
class SimulationReport:
    result: SimulationResult
    sync_result: SimulationResult | None = None  # the same cluster in sync mode, when the scenario is async
    split: list[SplitCandidate] = field(default_factory=list)
    layouts: list[LayoutCandidate] = field(default_factory=list)

    @property
    def best_layout(self) -> LayoutCandidate | None:
        fitting = [c for c in self.layouts if c.fits]
        return min(fitting, key=lambda c: (c.train_seconds, c.tp * c.pp * c.cp)) if fitting else None

    @property
    def async_speedup(self) -> float | None:
        if self.sync_result is None:
            return None
        return self.sync_result.step_seconds / self.result.step_seconds

    @property
    def best_split(self) -> SplitCandidate | None:
        return min(self.split, key=lambda c: (c.step_seconds, c.num_engine_gpus)) if self.split else None

    def to_json(self) -> str:
        data = {
            "result": _without_step_times(self.result),
            "sync_result": _without_step_times(self.sync_result) if self.sync_result else None,
            "async_speedup": self.async_speedup,
            "split": [asdict(c) for c in self.split],
            "best_split": asdict(self.best_split) if self.best_split else None,
            "layouts": [asdict(c) for c in self.layouts],
            "best_layout": asdict(self.best_layout) if self.best_layout else None,
            "stated_error": {kind: asdict(error) for kind, error in STATED_ERROR.items()},
        }
        return json.dumps(data, indent=2)

    def to_text(self) -> str:
        r = self.result
        occupancy = "n/a, capacity unbounded" if r.engine_occupancy is None else f"{r.engine_occupancy:.0%}"
        lines = [
            f"scenario: {r.name}",
            f"  {r.mode} (max_staleness {r.max_staleness}), {r.placement}: {r.num_engines} engine replicas on "
            f"{r.num_engine_gpus} GPUs, trainer on {r.num_trainer_gpus} GPUs",
            f"  step time        {r.step_seconds:10.2f} s   {STATED_ERROR['step_seconds'].tag()} (steady state; "
            f"{r.total_seconds:.1f} s in all)",
            f"  generation       {r.generation_seconds:10.2f} s   {STATED_ERROR['generation_seconds'].tag()} per "
            "batch, admission to last score",
            f"  training         {r.train_seconds:10.2f} s   per step",
            f"  weight sync      {r.sync_seconds:10.3f} s   per step",
            f"  engine GPUs      {r.engine_busy_fraction:10.0%}     busy (slot occupancy {occupancy})",
            f"  trainer GPUs     {r.trainer_busy_fraction:10.0%}     busy (training + sync)",
            f"  staleness        {r.staleness_mean:10.2f}     mean versions behind, trained batches",
            f"  throughput       {r.tokens_per_second:10.0f}     trained tokens/s",
        ]
        if r.num_engine_failures:
            lines.append(
                f"  failures         {r.num_engine_failures:10d}     engine restarts, {r.wasted_tokens:.0f} tokens lost"
            )
        if self.sync_result is not None and self.async_speedup is not None:
            lines.append(
                f"  async speedup    {self.async_speedup:10.2f}x    {STATED_ERROR['async_speedup'].tag()} over "
                f"sync on the same GPUs ({self.sync_result.step_seconds:.2f} s/step)"
            )
        if self.split:
            lines.append("split search (engine GPUs + trainer GPUs: step time):")
            best = self.best_split
            for c in self.split:
                mark = "  <- best" if c is best else ""
                lines.append(f"  {c.num_engine_gpus:5d} + {c.num_trainer_gpus:<5d} {c.step_seconds:10.2f} s{mark}")
        if self.layouts:
            lines.append(
                f"trainer layouts on {r.num_trainer_gpus} GPUs (training s/step; model state + activations "
                "GiB/GPU; model checked: docs/parallelism.md):"
            )
            best = self.best_layout
            if best is None:
                lines.append(
                    "  none fits: the model state and activations need more GPUs (or LoRA, or "
                    "trainer.activation_checkpointing)"
                )
            for c in sorted(self.layouts, key=lambda c: (not c.fits, c.train_seconds))[:MAX_LAYOUT_LINES]:
                mark = "  <- best" if c is best else ("  does not fit" if not c.fits else "")
                lines.append(
                    f"  tp {c.tp:<2d} pp {c.pp:<2d} cp {c.cp:<2d} dp_shard {c.dp_shard:<5d} {c.train_seconds:10.2f} s "
                    f"{c.state_gib_per_gpu:8.1f} + {c.activation_gib_per_gpu:.1f} GiB{mark}"
                )
        lines.append(NOT_VALIDATED)
        return "\n".join(lines)


def _without_step_times(result: SimulationResult) -> dict[str, object]:
    data = asdict(result)
    data["step_times"] = [round(t, 6) for t in result.step_times]
    return data


def split_candidates(scenario: Scenario, budget: int) -> list[int]:
    """Engine GPU counts to try: multiples of the replica size that leave the trainer at least one GPU."""
    size = scenario.cluster.gpus_per_engine
    counts = list(range(size, budget, size))
    if not counts:
        raise ScenarioError(f"--search-split {budget}: the budget must exceed one engine replica ({size} GPUs)")
    stride = -(-len(counts) // MAX_SPLIT_CANDIDATES)
    picked = counts[::stride]
    return picked if picked[-1] == counts[-1] else [*picked, counts[-1]]


def search_split(scenario: Scenario, budget: int, *, progress: Progress | None = None) -> list[SplitCandidate]:
    """Simulate every candidate split of `budget` GPUs between engines and trainer (disaggregated)."""
    if scenario.cluster.placement == "colocated":
        raise ScenarioError("--search-split splits GPUs between engines and trainer: use a disaggregated scenario")
    candidates = []
    counts = split_candidates(scenario, budget)
    for engine_gpus in counts:
        variant = with_changes(
            scenario, cluster={"num_engine_gpus": engine_gpus, "num_trainer_gpus": budget - engine_gpus}
        )
        result = simulate(variant)
        candidates.append(
            SplitCandidate(
                num_engine_gpus=engine_gpus, num_trainer_gpus=budget - engine_gpus, step_seconds=result.step_seconds
            )
        )
        if progress is not None:
            progress(
                f"split {len(candidates)}/{len(counts)}: {engine_gpus} + {budget - engine_gpus} GPUs, "
                f"{result.step_seconds:.2f} s/step"
            )
    return candidates


def search_layouts(scenario: Scenario) -> list[LayoutCandidate]:
    """Every trainer layout (tp, pp, cp in 1, 2, 4, ..., tp within a node) that the model and the trainer's GPUs
    allow, priced for a step of the workload's median tokens: training seconds, and the model state (float32
    weights, gradients and AdamW moments) plus the activations of the busiest GPU (`activation_bytes_per_gpu`; a
    micro-batch holds one longest sequence at least: the prompt's median and the response's cap), which together must
    fit the GPU's memory."""
    shape = scenario.model.layer_shape()
    if shape is None:
        raise ScenarioError(
            "--search-layout needs the model's layer sizes: model.num_layers, hidden_size, intermediate_size, "
            "num_attention_heads, num_key_value_heads"
        )
    workload, num_gpus = scenario.workload, scenario.cluster.num_trainer_gpus
    tokens = (
        workload.prompts_per_step
        * workload.samples_per_prompt
        * (workload.prompt_tokens.median + workload.response_tokens.median)
    )
    response = workload.response_tokens
    longest = workload.prompt_tokens.median + (response.max if response.max is not None else response.median)
    memory = scenario.cluster.gpu_kind().memory_bytes
    candidates = []
    for tp in AXIS_SIZES:
        for pp in AXIS_SIZES:
            for cp in AXIS_SIZES:
                layout = scenario.trainer.model_copy(update={"tp": tp, "pp": pp, "cp": cp})
                if tp > scenario.network.gpus_per_node:
                    continue
                try:
                    check_layout(layout, shape, num_gpus=num_gpus)
                except ValueError:
                    continue
                variant = scenario.model_copy(update={"trainer": layout})
                dp_shard = num_gpus // layout.ranks_per_shard
                state = state_bytes_per_gpu(scenario.model.num_params, tp=tp, pp=pp, dp_shard=dp_shard, cp=cp)
                activations = activation_bytes_per_gpu(
                    shape,
                    max(tokens / dp_shard / layout.micro_batches, longest),  # a micro-batch holds whole sequences
                    tp=tp,
                    pp=pp,
                    cp=cp,
                    micro_batches=layout.micro_batches,
                    stages_per_rank=layout.pp_stages_per_rank,
                    sequence_parallel=layout.sequence_parallel,
                    checkpointing=layout.activation_checkpointing,
                    bytes_per_value=scenario.model.bytes_per_param,
                )
                candidates.append(
                    LayoutCandidate(
                        tp=tp,
                        pp=pp,
                        cp=cp,
                        dp_shard=dp_shard,
                        train_seconds=CostModel(scenario=variant).train_seconds(tokens),
                        state_gib_per_gpu=state / 2**30,
                        activation_gib_per_gpu=activations / 2**30,
                        fits=state + activations <= memory * scenario.cluster.memory_utilization,
                    )
                )
    return candidates


def build_report(
    scenario: Scenario,
    *,
    split_budget: int | None = None,
    search_layout: bool = False,
    progress: Progress | None = None,
) -> SimulationReport:
    """The scenario simulated, with its sync counterpart when async; ``progress`` hears of each simulation done."""
    result = simulate(scenario)
    if progress is not None:
        progress(f"{scenario.name}: {result.step_seconds:.2f} s/step")
    sync_result = None
    if scenario.rollout.mode == "async":
        sync_result = simulate(with_changes(scenario, rollout={"mode": "sync", "continuous_batching": False}))
        if progress is not None:
            progress(f"the same cluster in sync mode: {sync_result.step_seconds:.2f} s/step")
    split = search_split(scenario, split_budget, progress=progress) if split_budget is not None else []
    layouts = search_layouts(scenario) if search_layout else []
    return SimulationReport(result=result, sync_result=sync_result, split=split, layouts=layouts)
