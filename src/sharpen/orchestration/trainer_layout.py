"""`check_trainer_layout`: the driver's check of ``trainer.parallel`` against the model, before any trainer rank
starts (the Ray runtime's actors or the embedded runtime's local ranks), so a layout that cannot run is one line,
not a traceback from a rank.
"""

from __future__ import annotations

import logging

from sharpen.config import SharpenConfig
from sharpen.config.models import resolve_model_path
from sharpen.data.vision import is_vision_model
from sharpen.trainer.layout import ModelShape, ParallelLayout, decoder_tp_plan

logger = logging.getLogger(__name__)


def check_trainer_layout(config: SharpenConfig) -> None:
    """Raise `LayoutError` (one line) unless ``trainer.parallel`` on ``runtime.trainer_ranks`` ranks fits the model
    (its family's tensor-parallel plan, its heads, sizes, vocabulary and layers) and asks only for axes that are
    built."""
    layout = ParallelLayout.from_config(config.trainer.parallel, config.runtime.trainer_ranks)
    layout.check_built()
    model_path = resolve_model_path(config.model.path)
    trainer = config.trainer
    layout.check_features(
        lora=trainer.lora.enabled, vision=is_vision_model(model_path), distillation=trainer.distillation.enabled
    )
    if layout.tp > 1:  # the model family's own plan (a class attribute of its transformers config)
        from transformers import AutoConfig

        model_config = AutoConfig.from_pretrained(model_path)
        decoder_tp_plan(getattr(model_config, "base_model_tp_plan", None), family=type(model_config).__name__)
    layout.check(world_size=config.runtime.trainer_ranks, model=ModelShape.from_model_folder(model_path))
    if layout.pp > 1 and not trainer.packing:
        _warn_pipeline_fillers(config, layout)


def _warn_pipeline_fillers(config: SharpenConfig, layout: ParallelLayout) -> None:
    """One line at start when a step's micro-batches per data shard (without filters' losses) are not a multiple of
    the pipeline's stages: the schedule then computes copies whose loss is 0 (`pipeline_parallel`)."""
    rows = config.rollout.prompts_per_step * config.rollout.num_samples_per_prompt
    per_shard = -(-rows // (config.trainer.algorithm.num_mini_batches * layout.dp_replicate * layout.dp_shard))
    micro_batches = -(-per_shard // config.trainer.micro_batch_size)
    unit = layout.pp * layout.pp_stages_per_rank
    if micro_batches % unit:
        fillers = -(-micro_batches // unit) * unit - micro_batches
        logger.warning(
            "trainer.parallel: %d micro-batches per mini-batch and data shard (trainer.micro_batch_size %d) are not "
            "a multiple of pp x pp_stages_per_rank = %d: the pipeline computes %d more pass(es) whose loss is 0; "
            "make them a multiple for no waste, and more of them for a smaller bubble",
            micro_batches,
            config.trainer.micro_batch_size,
            unit,
            fillers,
        )
