"""Where the loop's batches come from, side by side: generated on demand (sync mode, `SyncBatches`) or by a producer
thread running ahead of the trainer within a staleness bound (async mode, `AsyncBatches`). Both make each batch
with the same `GroupCollector` and hand it over as a `ProducedBatch` behind the `BatchSource` protocol, so
everything the loop does after taking a batch is the same code in both modes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from sharpen.config.corrections import NoCorrection
from sharpen.orchestration.batches.base import BatchSource, ProducedBatch, load_pending, save_pending
from sharpen.orchestration.batches.collect import GroupCollector, rollout_sampling
from sharpen.orchestration.batches.partial import PartialCollector
from sharpen.orchestration.batches.producer import AsyncBatches, staleness_metrics
from sharpen.orchestration.batches.sync import SyncBatches

if TYPE_CHECKING:
    from sharpen.config.schema import SharpenConfig
    from sharpen.monitoring import PhaseTimer, Timeline
    from sharpen.orchestration.weight_sync import WeightSync
    from sharpen.rollout.engines import InferenceEngine

__all__ = [
    "AsyncBatches",
    "BatchSource",
    "GroupCollector",
    "PartialCollector",
    "ProducedBatch",
    "SyncBatches",
    "build_batch_source",
    "load_pending",
    "rollout_sampling",
    "save_pending",
    "staleness_metrics",
]

logger = logging.getLogger(__name__)


def build_batch_source(
    config: SharpenConfig,
    collector: GroupCollector,
    *,
    engine: InferenceEngine,
    weight_sync: WeightSync,
    start_step: int,
    timer: PhaseTimer,
    timeline: Timeline | None,
    decode: Callable[[list[int]], str],
    pending: Sequence[ProducedBatch] = (),
) -> BatchSource:
    """The batch source of ``rollout.mode``; ``timer`` times the trainer thread's phases, and the async producer
    records its own on ``timeline``. With ``rollout.partial`` the batches are made by a `PartialCollector` around
    ``collector``, which takes the carried groups of ``pending``'s last batch."""
    maker = PartialCollector(collector, pending=pending) if config.rollout.partial.enabled else collector
    if config.rollout.mode == "sync":
        return SyncBatches(
            maker,
            engine=engine,
            weight_sync=weight_sync,
            timer=timer,
            colocate=config.runtime.colocate,
            pending=pending,
        )
    if isinstance(config.trainer.algorithm.off_policy_correction, NoCorrection):
        logger.warning("async mode without off-policy correction: stale tokens are trained on as if on-policy")
    return AsyncBatches(
        maker,
        engine=engine,
        weight_sync=weight_sync,
        rollout=config.rollout,
        start_step=start_step,
        num_steps=config.run.num_steps,
        timeline=timeline,
        decode=decode,
        pending=pending,
    )
