"""What each piece of work costs in seconds, from a scenario: a decode round, a prefill, a training step, a
weight sync.

It owns the formulas. A decode round reads the weights and every running sequence's KV cache once, so it is
memory-bandwidth bound: (weight bytes + KV bytes) / (GPUs * bandwidth * efficiency), or the compute bound
2 * params * sequences / (GPUs * peak * MFU) when that is larger (big batches). Training is
`train_flops_per_token` * params * tokens / (GPUs * peak * MFU). A weight sync gathers the trainer's shards
(ring all-gather) and sends them to every engine replica (ring or tree broadcast). Measured costs in the
scenario replace the formulas. It does not schedule anything (cluster.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from sharpen.simulation.collectives import (
    ring_allgather_seconds,
    ring_broadcast_seconds,
    tree_broadcast_seconds,
)
from sharpen.simulation.parallel import collective_seconds, layer_collectives, pipeline_bubble_factor
from sharpen.simulation.scenario import Scenario, ScenarioError


@dataclass(kw_only=True, slots=True)
class CostModel:
    scenario: Scenario

    @property
    def weight_bytes(self) -> float:
        model = self.scenario.model
        return model.num_params * model.bytes_per_param

    def decode_round_seconds(self, num_sequences: int, context_tokens: float) -> float:
        """One decode round of one replica: `num_sequences` running, `context_tokens` summed over them."""
        costs, cluster = self.scenario.costs, self.scenario.cluster
        if costs.decode_round_seconds is not None:
            return costs.decode_round_seconds + costs.decode_round_seconds_per_sequence * num_sequences
        gpu, num_gpus = cluster.gpu_kind(), cluster.gpus_per_engine
        read = self.weight_bytes + self.scenario.model.kv_bytes_per_token * context_tokens
        memory = read / (num_gpus * gpu.memory_bandwidth * costs.decode_bandwidth_efficiency)
        compute = 2.0 * self.scenario.model.num_params * num_sequences / (num_gpus * gpu.peak_flops * costs.prefill_mfu)
        return costs.decode_round_overhead_s + max(memory, compute)

    def prefill_seconds(self, num_tokens: float) -> float:
        cluster = self.scenario.cluster
        if self.scenario.costs.decode_round_seconds is not None:
            return 0.0  # measured rounds include their prefill
        flops = 2.0 * self.scenario.model.num_params * num_tokens
        return flops / (cluster.gpus_per_engine * cluster.gpu_kind().peak_flops * self.scenario.costs.prefill_mfu)

    def max_sequences_per_engine(self, mean_context_tokens: float) -> int:
        cluster, model = self.scenario.cluster, self.scenario.model
        if cluster.max_sequences_per_engine is not None:
            return cluster.max_sequences_per_engine
        if model.kv_bytes_per_token == 0.0 or self.scenario.costs.decode_round_seconds is not None:
            return 1_000_000  # nothing bounds it in the model
        memory = cluster.gpus_per_engine * cluster.gpu_kind().memory_bytes * cluster.memory_utilization
        free = memory - self.weight_bytes
        if free <= 0:
            raise ScenarioError(
                f"model.num_params: the weights ({self.weight_bytes / 1e9:.1f} GB) do not fit one engine replica "
                f"({memory / 1e9:.1f} GB usable); raise cluster.gpus_per_engine"
            )
        return max(1, int(free / (model.kv_bytes_per_token * mean_context_tokens)))

    def train_seconds(self, num_tokens: float, *, slowdown: float = 1.0) -> float:
        """Compute at the trainer's MFU over all its GPUs (one more forward with activation checkpointing), times the
        pipeline bubble ([trainer] pp), with FSDP's
        gathers and reduce-scatters hidden behind compute where compute is longer, plus the tensor- and
        context-parallel collectives (on the critical path)."""
        costs, cluster = self.scenario.costs, self.scenario.cluster
        if costs.train_seconds_per_step is not None:
            return costs.train_seconds_per_step * slowdown
        layout = self.scenario.trainer
        per_token = costs.train_flops_per_token + (2.0 if layout.activation_checkpointing else 0.0)  # a 2nd forward
        flops = per_token * self.scenario.model.num_params * num_tokens
        rate = cluster.num_trainer_gpus * cluster.gpu_kind().peak_flops * costs.train_mfu
        compute = flops / rate * slowdown
        bubble = pipeline_bubble_factor(layout.pp, layout.micro_batches, stages_per_rank=layout.pp_stages_per_rank)
        return max(compute * bubble, self.fsdp_seconds()) + self.layer_collective_seconds(num_tokens)

    def _link(self, num_gpus: int) -> float:
        """Bytes per second of a collective over ``num_gpus`` neighbouring GPUs (one node or several)."""
        net = self.scenario.network
        return (net.intra_node_gbps if num_gpus <= net.gpus_per_node else net.inter_node_gbps) * 1e9

    def layer_collective_seconds(self, num_tokens: float) -> float:
        """The tensor- and context-parallel collectives of one step on one GPU: its stage's layers, over the
        tokens of its data shard (each context-parallel rank holds 1 / cp of them)."""
        scenario = self.scenario
        layout, shape = scenario.trainer, scenario.model.layer_shape()
        if shape is None or layout.ranks_per_shard == 1:
            return 0.0
        data_shards = scenario.cluster.num_trainer_gpus // layout.ranks_per_shard
        tokens = num_tokens / data_shards / layout.cp
        alpha, width_bytes = scenario.network.latency_us * 1e-6, scenario.model.bytes_per_param
        seconds = 0.0
        for collective in layer_collectives(layout.tp_plan, tp=layout.tp, cp=layout.cp):
            ranks = layout.cp if collective.kind == "all_to_all" else layout.tp
            link = self._link(layout.tp * layout.cp if collective.kind == "all_to_all" else layout.tp)
            size = tokens * shape.width(collective.width) * width_bytes
            seconds += collective_seconds(collective.kind, size, ranks, alpha=alpha, beta=link)
        return seconds * shape.num_layers / layout.pp

    def fsdp_seconds(self) -> float:
        """FSDP2 over the data shards and the context-parallel ranks: the parameters all-gathered for the forward
        and again for the backward, the gradients reduce-scattered, each GPU's stage and tensor slice only."""
        scenario = self.scenario
        layout = scenario.trainer
        data_shards = scenario.cluster.num_trainer_gpus // (layout.tp * layout.pp)
        slice_bytes = scenario.model.num_params * scenario.model.bytes_per_param / (layout.tp * layout.pp)
        alpha = scenario.network.latency_us * 1e-6
        link = self._link(scenario.cluster.num_trainer_gpus)
        return 3 * ring_allgather_seconds(slice_bytes, data_shards, alpha=alpha, beta=link)

    def sync_seconds(self) -> float:
        """Gather the trainer's shards, then broadcast to every replica (their first GPUs)."""
        scenario = self.scenario
        if scenario.costs.sync_seconds is not None:
            return scenario.costs.sync_seconds
        net, cluster = scenario.network, scenario.cluster
        alpha = net.latency_us * 1e-6
        trainer_link = net.intra_node_gbps if cluster.num_trainer_gpus <= net.gpus_per_node else net.inter_node_gbps
        gather = ring_allgather_seconds(
            self.weight_bytes, cluster.num_trainer_gpus, alpha=alpha, beta=trainer_link * 1e9
        )
        if cluster.placement == "colocated":
            return gather  # every engine already sits on a GPU that holds the gathered weights
        num_ranks = cluster.num_engine_gpus // cluster.gpus_per_engine + 1
        total_gpus = cluster.num_engine_gpus + cluster.num_trainer_gpus
        link = net.intra_node_gbps if total_gpus <= net.gpus_per_node else net.inter_node_gbps
        if net.algorithm == "tree":
            send = tree_broadcast_seconds(self.weight_bytes, num_ranks, alpha=alpha, beta=link * 1e9)
        else:
            chunks = max(1, round(self.weight_bytes / (net.bucket_mb * 2**20)))
            send = ring_broadcast_seconds(self.weight_bytes, num_ranks, alpha=alpha, beta=link * 1e9, num_chunks=chunks)
        return gather + send
