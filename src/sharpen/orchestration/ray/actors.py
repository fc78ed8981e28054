"""The bodies of the Ray actors: one holds the run's `Trainer`, one its `InferenceEngine`.

Each builds its component with the builders of `sharpen.orchestration.build` (`build_trainer`, `build_run_engine`), so a
component is the same object in both runtimes, and exposes its methods to the proxies in `proxies.py`. Plain
classes: `runtime.py` turns them into actors with the resources of the config. Nothing here waits on another actor.

The proxies call every method through `SpanRecordingActor.invoke`, which records the call as a span of the actor's
own process (named after the method: ``step``, ``generate``, ...) and hands back the spans recorded since the last
call with the result, so the driver can put them on the run's timeline without an extra round trip.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
import torch

from sharpen.config import SharpenConfig
from sharpen.config.models import resolve_model_path
from sharpen.monitoring import Span, SpanBuffer
from sharpen.orchestration.build import build_run_engine, build_trainer, load_tokenizer
from sharpen.orchestration.manifest import Entries
from sharpen.orchestration.object_store import StoreFolder, export_to_store, load_from_store, save_to_store
from sharpen.orchestration.storage import MarkerAnswer, answer_marker
from sharpen.rollout.engines import WeightGroupEngine, probe_engine, sleepable
from sharpen.rollout.engines.base import generate_prompts, score_prompt
from sharpen.rollout.weight_sync.broadcast import open_weight_group, receive_weights, send_weights
from sharpen.trainer.backends.single_device import resolve_device
from sharpen.types import (
    Completion,
    ExpertRoutes,
    ImagePart,
    PolicyVersion,
    ProbeScores,
    Rollout,
    SamplingParams,
    TrainBatch,
)
from sharpen.weight_shards import assemble_ranks

if TYPE_CHECKING:
    from sharpen.rollout.engines import InferenceEngine
    from sharpen.trainer import Trainer


class SpanRecordingActor:
    """What the actors share: spans of their own work, recorded in this process and drained by each call."""

    def __init__(self, *, process_name: str) -> None:
        self.spans = SpanBuffer(process_name=process_name)

    def invoke(self, method: str, *args: Any, **kwargs: Any) -> tuple[Any, list[Span]]:
        """``method(*args, **kwargs)`` timed as a span, and every span not yet handed out. A call that raises keeps
        its span (marked with the error) for the next call."""
        with self.spans.span(method, category="actor"):
            result = getattr(self, method)(*args, **kwargs)
        return result, self.spans.drain()


class TrainerActor(SpanRecordingActor):
    """One trainer rank. With ``world_size`` 1 it builds the single-device trainer at once; with more, the ranks
    first agree on a rendezvous (`rendezvous_address` on rank 0), then each `join`s the process group and builds
    its FSDP2 shard of the trainer. Every collective method must then be called on all ranks together (the
    driver's `TrainerGroupProxy` does)."""

    def __init__(self, config: SharpenConfig, *, rank: int = 0, world_size: int = 1) -> None:
        name = "trainer actor" if world_size == 1 else f"trainer rank {rank}"
        super().__init__(process_name=name)
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.trainer: Trainer | None = None
        if world_size == 1:
            with self.spans.span("start", category="actor"):  # loading the model: the first thing on its timeline
                model_path = resolve_model_path(config.model.path)
                self.trainer = build_trainer(config, model_path=model_path, tokenizer=load_tokenizer(model_path))

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's address and a free port on it, for the process group's store (rank 0 hosts it)."""
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def join(self, master_addr: str, master_port: int) -> None:
        """Join the process group (blocks until every rank has joined) and build this rank's FSDP2 trainer, split as
        ``trainer.parallel`` says."""
        from sharpen.trainer.backends.fsdp2 import FSDP2Backend
        from sharpen.trainer.backends.mesh import init_distributed
        from sharpen.trainer.layout import ParallelLayout

        os.environ.update(
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            LOCAL_RANK="0",  # Ray gives each GPU actor its own CUDA_VISIBLE_DEVICES
        )
        init_distributed()
        model_path = resolve_model_path(self.config.model.path)
        backend = FSDP2Backend(
            self.config.trainer,
            model_path=model_path,
            dtype=self.config.model.master_dtype,
            layout=ParallelLayout.from_config(self.config.trainer.parallel, self.world_size),
            seed=self.config.run.seed,
        )
        self.trainer = build_trainer(
            self.config, model_path=model_path, tokenizer=load_tokenizer(model_path), backend=backend
        )

    def join_weight_group(self, master_addr: str, master_port: int, world_size: int, backend: str = "gloo") -> None:
        """Rank 0 joins the weight-broadcast group as its sender (and hosts its store); other ranks take no part.
        With NCCL the buckets are assembled on this rank's GPU."""
        if self.rank == 0:
            self.weight_group = open_weight_group(
                rank=0, world_size=world_size, master_addr=master_addr, master_port=master_port, backend=backend
            )
            self.weight_device = _group_device(backend)

    def broadcast_weights(self, version: PolicyVersion) -> dict[str, float]:
        """Send the full weights to the engine actors of the weight group; the other ranks only take part in
        gathering them (collective)."""
        if self.rank != 0:
            for _ in self._trainer.named_weights():
                pass
            return {}
        bucket_bytes = self.config.weight_sync.bucket_mb << 20
        return send_weights(
            self.weight_group,
            self._trainer.named_weights(),
            version=version,
            bucket_bytes=bucket_bytes,
            device=self.weight_device,
        )

    @property
    def _trainer(self) -> Trainer:
        if self.trainer is None:
            raise RuntimeError(f"trainer rank {self.rank} has not joined its process group")
        return self.trainer

    def step(self, batch: TrainBatch) -> dict[str, float]:
        return self._trainer.step(batch)

    def compute_logprobs(self, token_ids: list[int], images: tuple[ImagePart, ...] = ()) -> list[float]:
        return self._trainer.compute_logprobs(token_ids, images)

    def probe(self, token_ids: list[int]) -> ProbeScores:
        return self._trainer.probe(token_ids)

    def kl_penalties(self, rollouts: list[Rollout]) -> list[list[float]]:
        return self._trainer.kl_penalties(rollouts)

    def put_weights(self) -> list[Any]:
        """The full weights as one object-store entry owned by this actor; returned inside a list so the caller
        gets the ObjectRef rather than the tensors."""
        if self.rank != 0:  # the gather is collective: the other ranks take part and drop each tensor
            for _ in self._trainer.named_weights():
                pass
            return []
        weights = {name: tensor.detach().cpu() for name, tensor in self._trainer.named_weights()}
        return [ray.put(weights)]

    def put_shards(self) -> list[Any]:
        """This rank's pieces of the weights (`Trainer.weight_shards`; no collective) as one object-store entry
        owned by this actor, inside a list as `put_weights`'."""
        return [ray.put(self._trainer.weight_shards())]

    def check_shared_dir(self, folder: Path | StoreFolder, token: str) -> MarkerAnswer:
        """This actor's half of the start-up check that checkpoints have one place (`storage.check_storage`)."""
        return answer_marker(folder, token, rank=self.rank)

    def save_to_store(self, target: StoreFolder) -> Entries:
        """This rank's checkpoint files, uploaded to the object store (`object_store.RANK_CALLS`, as all three)."""
        return save_to_store(self._trainer, target)

    def export_to_store(self, target: StoreFolder) -> Entries:
        return export_to_store(self._trainer, target)

    def load_from_store(self, source: StoreFolder, files: Entries) -> str | None:
        return load_from_store(self._trainer, source, files)

    def save_checkpoint(self, folder: Path) -> None:
        self._trainer.save_checkpoint(folder)

    def load_checkpoint(self, folder: Path) -> None:
        self._trainer.load_checkpoint(folder)

    def export(self, folder: Path) -> None:
        self._trainer.export(folder)

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class EngineActor(SpanRecordingActor):
    """One engine replica (the driver routes between replicas, `EngineRouter`)."""

    def __init__(self, config: SharpenConfig, *, replica: int = 0, num_replicas: int = 1) -> None:
        super().__init__(process_name="engine actor" if num_replicas == 1 else f"engine replica {replica}")
        with self.spans.span("start", category="actor"):
            model_path = resolve_model_path(config.model.path)
            one = config.model_copy(update={"rollout": config.rollout.model_copy(update={"num_engines": 1})})
            self.engine: InferenceEngine = build_run_engine(
                one,
                model_path=model_path,
                tokenizer=load_tokenizer(model_path),
                device=str(resolve_device(config.trainer.device)),  # the device the embedded runtime would use
            )

    def get_policy_version(self) -> PolicyVersion:
        return self.engine.policy_version

    def num_weight_group_members(self) -> int:
        """Ranks this actor takes in the weight group: its engine's workers (vLLM) or itself."""
        return self.engine.num_weight_group_members if isinstance(self.engine, WeightGroupEngine) else 1

    def join_weight_group(
        self, master_addr: str, master_port: int, rank: int, world_size: int, backend: str = "gloo"
    ) -> None:
        if isinstance(self.engine, WeightGroupEngine):  # the workers receive the broadcast themselves
            address = {"master_addr": master_addr, "master_port": master_port}
            self.engine.join_weight_group(**address, first_rank=rank, world_size=world_size, backend=backend)
            return
        self.weight_group = open_weight_group(
            rank=rank, world_size=world_size, master_addr=master_addr, master_port=master_port, backend=backend
        )
        self.weight_device = _group_device(backend)

    def receive_weights(self, version: PolicyVersion) -> dict[str, float]:
        """Load the weights the trainer broadcasts to the weight group (verified bucket by bucket)."""
        if isinstance(self.engine, WeightGroupEngine):
            return self.engine.receive_broadcast(version=version)
        tensors = receive_weights(self.weight_group, version=version, device=self.weight_device)
        return self.engine.load_weights(tensors, version=version)

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        return self.engine.generate(prompts, params)

    def generate_with_images(
        self, prompts: list[list[int]], images: list[tuple[ImagePart, ...]], params: list[SamplingParams]
    ) -> list[Completion]:
        return generate_prompts(self.engine, prompts, images, params)

    def score(self, token_ids: list[int], images: tuple[ImagePart, ...] = ()) -> list[float]:
        return score_prompt(self.engine, token_ids, images)

    def probe(self, token_ids: list[int], routes: ExpertRoutes | None) -> tuple[list[float], bool]:
        """The weight-sync probe's logprobs, replaying the trainer's ``routes`` where the engine can."""
        return probe_engine(self.engine, token_ids, routes)

    def load_weights(self, weights: dict[str, torch.Tensor], *, version: PolicyVersion) -> dict[str, float]:
        return self.engine.load_weights(weights.items(), version=version)

    def load_shards(self, pieces: list[Any], *, version: PolicyVersion) -> dict[str, float]:
        """Load the weights whose pieces each trainer rank put (``pieces``: one ObjectRef a rank), assembled and
        checked here (`assemble_ranks`: every weight covered exactly once) before the engine takes any."""
        ranks = ray.get(pieces)
        metrics = self.engine.load_weights(assemble_ranks(ranks), version=version)
        return {**metrics, "sync/num_pieces": float(sum(len(shards) for shards in ranks))}

    def sleep(self) -> dict[str, float]:
        return sleepable(self.engine).sleep()

    def wake_up(self) -> dict[str, float]:
        return sleepable(self.engine).wake_up()

    def close(self) -> None:
        self.engine.close()


def _group_device(backend: str) -> torch.device:
    """Where a weight group's buckets live: this actor's GPU for NCCL, host memory for gloo."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
