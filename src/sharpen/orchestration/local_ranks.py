"""Trainer ranks as processes of this machine, for the embedded runtime: ``runtime.trainer_ranks > 1`` without Ray.

Owns `LocalTrainerRanks`, a `TrainerHandle` whose trainer is ``trainer_ranks`` processes, each one rank of the
sharded trainer (`FSDP2Backend`, split as ``trainer.parallel`` says), joined in one process group as torchrun's ranks
are (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; gloo on the CPU, NCCL with a GPU a rank). Every
call goes to every rank at once, with the same arguments, and returns rank 0's result, as the Ray runtime's
`TrainerGroupProxy` does with actors: the trainer's collectives must run on all ranks in step. The weights leave
rank 0 as one dict of host tensors (shared memory, not copies through the pipe), or with ``weight_sync.assemble =
"receiver"`` as every rank's pieces, assembled here. An error on any rank ends the call
with that rank's traceback; a rank that does not answer within ``runtime.call_timeout_s`` ends it too, naming the
rank; either way every rank is then stopped.

The ranks are spawned (not forked: the driver may already hold threads of an engine or a tokenizer), so each imports
torch and loads its share of the model itself. It does not place engines (they stay in the driver, as the embedded
runtime places them) or know what a step does.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from collections.abc import Iterator
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from sharpen.config import SharpenConfig
from sharpen.orchestration.object_store import RANK_CALLS
from sharpen.orchestration.storage import answer_marker
from sharpen.rollout.engines.server import free_port
from sharpen.types import ImagePart, ProbeScores, Rollout, TrainBatch
from sharpen.weight_shards import assemble_ranks

_READY, _OK, _ERROR = "ready", "ok", "error"


class LocalTrainerRanks:
    """The trainer of ``config.runtime.trainer_ranks`` local rank processes (see the module docstring). Start-up
    waits for every rank to load its shard (``runtime.start_timeout_s``); `close` stops them."""

    def __init__(self, config: SharpenConfig, *, model_path: Path) -> None:
        runtime = config.runtime
        self.num_ranks = runtime.trainer_ranks
        self.assemble_at_receiver = config.weight_sync.assemble == "receiver"
        self.timeout_s = runtime.call_timeout_s
        context = mp.get_context("spawn")
        port = free_port()
        self._lock = threading.Lock()  # one call at a time (async mode snapshots weights from another thread)
        self._connections: list[Connection] = []
        self._processes: list[Any] = []
        for rank in range(self.num_ranks):
            parent, child = context.Pipe()
            process = context.Process(
                target=_serve_rank,
                args=(config, model_path, rank, self.num_ranks, port, child),
                name=f"sharpen trainer rank {rank}",
                daemon=True,
            )
            process.start()
            child.close()
            self._connections.append(parent)
            self._processes.append(process)
        try:
            self._gather("start", timeout_s=runtime.start_timeout_s)
        except BaseException:
            self.kill()
            raise

    # -- TrainerHandle ---------------------------------------------------------------------------------------------

    def step(self, batch: TrainBatch) -> dict[str, float]:
        return self.call("step", batch)

    def compute_logprobs(self, token_ids: list[int], images: tuple[ImagePart, ...] = ()) -> list[float]:
        return self.call("compute_logprobs", token_ids, images)

    def probe(self, token_ids: list[int]) -> ProbeScores:
        return self.call("probe", token_ids)

    def kl_penalties(self, rollouts: list[Rollout]) -> list[list[float]]:
        return self.call("kl_penalties", rollouts)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self._whole_weights()

    def snapshot_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The weights as host tensors that later steps do not change (rank 0's copies, or assembled here)."""
        return list(self._whole_weights())

    def _whole_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Rank 0's gathered tensors, or (``weight_sync.assemble = "receiver"``) every rank's pieces, assembled and
        checked here."""
        if self.assemble_at_receiver:
            return assemble_ranks(self.call_all("weight_shards"))
        return iter(self.call("full_weights").items())

    def save_checkpoint(self, folder: Path) -> None:
        self.call("save_checkpoint", folder)

    def load_checkpoint(self, folder: Path) -> None:
        self.call("load_checkpoint", folder)

    def export(self, folder: Path) -> None:
        self.call("export", folder)

    # -- the ranks -------------------------------------------------------------------------------------------------

    def call(self, method: str, *args: Any) -> Any:
        """``method(*args)`` on every rank's trainer at once; rank 0's result."""
        return self.call_all(method, *args)[0]

    def call_all(self, method: str, *args: Any) -> list[Any]:
        """``method(*args)`` on every rank's trainer at once; every rank's result, in rank order."""
        with self._lock:
            for connection in self._connections:
                connection.send((method, args))
            try:
                return self._gather(method, timeout_s=self.timeout_s)
            except BaseException:
                self.kill()  # the other ranks may wait in a collective for the one that failed
                raise

    def _gather(self, call: str, *, timeout_s: float) -> list[Any]:
        """Every rank's answer to ``call``, in rank order; raises on the first error or at the deadline."""
        results: dict[int, Any] = {}
        waiting = {connection: rank for rank, connection in enumerate(self._connections)}
        deadline = time.monotonic() + timeout_s
        while waiting:
            ready = wait(list(waiting), timeout=max(deadline - time.monotonic(), 0.0))
            if not ready:
                late = ", ".join(str(rank) for rank in sorted(waiting.values()))
                raise TimeoutError(f"trainer rank(s) {late} did not finish {call} within {timeout_s:.0f} s")
            for ready_one in ready:
                connection = _connection(ready_one)
                rank = waiting.pop(connection)
                try:
                    status, value = connection.recv()
                except EOFError:
                    raise RuntimeError(f"trainer rank {rank} exited during {call}") from None
                if status == _ERROR:
                    raise RuntimeError(f"trainer rank {rank} failed in {call}:\n{value}")
                results[rank] = value
        return [results[rank] for rank in range(self.num_ranks)]

    def close(self) -> None:
        """Leave the process group on every rank, then stop the processes."""
        try:
            for connection in self._connections:
                connection.send(("close", ()))
            self._gather("close", timeout_s=60.0)
        except (OSError, RuntimeError, TimeoutError):
            pass  # a rank already gone: kill() below
        finally:
            self.kill(grace_s=30.0)

    def kill(self, *, grace_s: float = 0.0) -> None:
        """Stop every rank process: those still running after ``grace_s`` (the time to exit after `close`) are
        terminated."""
        deadline = time.monotonic() + grace_s
        for process in self._processes:
            process.join(timeout=max(deadline - time.monotonic(), 0.0))
            if process.is_alive():
                process.terminate()
        for process in self._processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()


def _connection(connection: object) -> Connection:
    """`multiprocessing.connection.wait` returns the objects it was given (typed as a union)."""
    assert isinstance(connection, Connection)
    return connection


def _serve_rank(
    config: SharpenConfig, model_path: Path, rank: int, world_size: int, port: int, conn: Connection
) -> None:
    """One rank: join the process group, build its shard of the trainer, then run the driver's calls until
    ``close``."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    try:
        trainer = _build_rank(config, model_path, world_size)
        conn.send((_READY, None))
    except BaseException:
        conn.send((_ERROR, traceback.format_exc()))
        return
    while True:
        try:
            method, args = conn.recv()
        except EOFError:  # the driver is gone
            return
        try:
            if method == "close":
                import torch.distributed as dist

                dist.destroy_process_group()
                conn.send((_OK, None))
                return
            if method == "full_weights":  # collective: every rank gathers, rank 0 keeps
                weights = {name: tensor.detach().to("cpu", copy=True) for name, tensor in trainer.named_weights()}
                result: Any = weights if rank == 0 else None
            elif method == "check_shared_dir":  # this process's view of the run directory or the store (`storage.py`)
                result = answer_marker(*args, rank=rank)
            elif method in RANK_CALLS:  # checkpoint files through a local staging folder (`object_store.py`)
                result = RANK_CALLS[method](trainer, *args)
            else:
                result = getattr(trainer, method)(*args)
            conn.send((_OK, result))
        except BaseException:
            conn.send((_ERROR, traceback.format_exc()))


def _build_rank(config: SharpenConfig, model_path: Path, world_size: int) -> Any:
    from sharpen.orchestration.build import build_trainer, load_tokenizer
    from sharpen.trainer.backends.fsdp2 import FSDP2Backend
    from sharpen.trainer.backends.mesh import init_distributed
    from sharpen.trainer.layout import ParallelLayout

    init_distributed()
    backend = FSDP2Backend(
        config.trainer,
        model_path=model_path,
        dtype=config.model.master_dtype,
        layout=ParallelLayout.from_config(config.trainer.parallel, world_size),
        seed=config.run.seed,
    )
    return build_trainer(config, model_path=model_path, tokenizer=load_tokenizer(model_path), backend=backend)
