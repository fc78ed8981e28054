"""The checks of a whole config that span its sections (scale-out's own are `scale_out.check_scale_out`): batch sizes
against the group sizes, environments against data and the sandbox, the advantage estimator against the episodes,
LoRA against the engine, precision against the layout, sampling cuts against the trainer's scoring, guards against
checkpoints. Pydantic-free functions over a validated `SharpenConfig` (`schema.SharpenConfig` calls
`check_across_sections` from its model validator); each raises ValueError with one line for the user, in the order
below."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sharpen.config.advantages import PassKAdvantage
from sharpen.config.engines import VllmEngineConfig
from sharpen.config.environments import (
    CustomEnvironmentConfig,
    RepositoryEnvironmentConfig,
    TerminalEnvironmentConfig,
)
from sharpen.config.episodes import EpisodeLimitsSection
from sharpen.config.scale_out import check_scale_out

if TYPE_CHECKING:
    from sharpen.config.schema import SharpenConfig

ENVIRONMENTS_WITH_TASKS = ("guess_number", "gymnasium", "textarena", "verifiers", "browser", "terminal", "repository")
"""The environments that make their own tasks (``data.type = "environment"``)."""


PARTIAL_ENVIRONMENTS = ("single_turn", "guess_number")
"""The environments whose unfinished episodes ``rollout.partial`` may carry across steps (and checkpoints): their
state is plain data that pickles with the episode."""


def check_across_sections(config: SharpenConfig) -> None:
    _check_batches(config)
    _check_environment(config)
    check_scale_out(config)
    _check_advantage(config)
    if config.rollout.partial.enabled and config.environment.type not in PARTIAL_ENVIRONMENTS:
        raise ValueError(
            "rollout.partial carries episodes whose environment state is plain data "
            f"({', '.join(PARTIAL_ENVIRONMENTS)}), "
            f'not environment.type = "{config.environment.type}": an unfinished episode goes into the checkpoint with '
            "its environment, which an outside sandbox, browser or service cannot"
        )
    environment = config.environment
    is_remote = isinstance(environment, EpisodeLimitsSection) and (environment.remote or environment.fleet) is not None
    if config.rollout.partial.enabled and is_remote:
        raise ValueError(
            "rollout.partial carries an unfinished episode with its environment, in this process and into the "
            "checkpoint; with environment.remote or environment.fleet the environments live on their replicas: "
            "drop one of the two"
        )
    _check_lora(config)
    _check_fp16(config)
    if config.monitoring.guards.rolls_back and not config.run.checkpoint_every:
        raise ValueError(
            'monitoring.guards: a "rollback" policy restores the newest checkpoint; set run.checkpoint_every > 0 '
            "(with 0 the only checkpoint is the last step's)"
        )
    _check_sampling_cut(config)
    num_rollouts, num_mini = config.num_rollouts_per_step, config.trainer.algorithm.num_mini_batches
    if num_rollouts % (num_mini * config.trainer.micro_batch_size) != 0:
        raise ValueError(
            f"trainer.algorithm.num_mini_batches = {num_mini} x trainer.micro_batch_size = "
            f"{config.trainer.micro_batch_size} does not divide the {num_rollouts} rollouts per step"
        )


def _check_batches(config: SharpenConfig) -> None:
    rollout, num_rollouts = config.rollout, config.num_rollouts_per_step
    if num_rollouts % config.trainer.micro_batch_size != 0:
        raise ValueError(
            f"trainer.micro_batch_size = {config.trainer.micro_batch_size} does not divide the rollouts per step "
            f"(rollout.prompts_per_step {rollout.prompts_per_step} x rollout.num_samples_per_prompt "
            f"{rollout.num_samples_per_prompt} = {num_rollouts})"
        )
    if config.reward.overlong_buffer_tokens > rollout.max_new_tokens:
        raise ValueError(
            f"reward.overlong_buffer_tokens = {config.reward.overlong_buffer_tokens} is larger than "
            f"rollout.max_new_tokens = {rollout.max_new_tokens}"
        )


def _check_environment(config: SharpenConfig) -> None:
    """Where the environment's tasks come from, and whether its shell outlives its sandbox."""
    environment = config.environment
    makes_tasks = environment.type in ENVIRONMENTS_WITH_TASKS or (
        isinstance(environment, CustomEnvironmentConfig) and environment.tasks is not None
    )
    if config.data.type == "environment" and not makes_tasks:
        raise ValueError(
            f'data.type = "environment" needs an environment that makes its own tasks '
            f"({', '.join(ENVIRONMENTS_WITH_TASKS)}, or custom with environment.tasks), "
            f"not {environment.type!r}"
        )
    if (
        isinstance(environment, TerminalEnvironmentConfig | RepositoryEnvironmentConfig)
        and environment.remote is None
        and (environment.wall_seconds is None or environment.wall_seconds > config.sandbox.wall_seconds)
    ):
        raise ValueError(
            f"environment.wall_seconds = {environment.wall_seconds} is longer than sandbox.wall_seconds = "
            f"{config.sandbox.wall_seconds}: the terminal's shell (one sandbox session per episode) would be "
            "killed mid-episode; raise sandbox.wall_seconds"
        )


def _check_advantage(config: SharpenConfig) -> None:
    """What the advantage estimator needs from the group size and the reward."""
    advantage, num_samples = config.trainer.algorithm.advantage, config.rollout.num_samples_per_prompt
    largest_k = max(num_samples - 1, 1)
    if isinstance(advantage, PassKAdvantage) and advantage.k > largest_k:
        raise ValueError(
            f"trainer.algorithm.advantage.k = {advantage.k} must be between 1 and {largest_k} "
            f"(below rollout.num_samples_per_prompt = {num_samples}): pass@k is estimated from each group's "
            "samples, and with k >= their number every group's estimate is 0 or 1, so every advantage is 0"
        )
    environment = config.environment
    has_turns = isinstance(environment, EpisodeLimitsSection) and environment.max_turns > 1
    if advantage.needs_turns and not has_turns:
        one_turn = " with max_turns = 1" if isinstance(environment, EpisodeLimitsSection) else ""
        raise ValueError(
            f'trainer.algorithm.advantage = "{advantage.type}" gives each turn of an episode its own advantage and '
            f"needs a multi-turn environment (environment.max_turns > 1), not environment.type = "
            f'"{environment.type}"{one_turn}: use an episode-level estimator such as "grpo" there'
        )
    if config.reward.component_normalization == "group" and advantage.needs_greedy_baseline:
        raise ValueError(
            f'reward.component_normalization = "group" cannot be used with advantage = "{advantage.type}": the '
            "greedy baseline is a group of one, whose normalised components are all 0"
        )


def _check_lora(config: SharpenConfig) -> None:
    """LoRA with a colocated engine, and an adapter-only sync, which needs an engine that serves adapters and a
    transport that carries them."""
    lora = config.trainer.lora
    if lora.enabled and config.runtime.colocate:
        # a LoRA sync sends the target modules only; a woken engine lost every weight (docs/weight-sync.md, LoRA)
        raise ValueError(
            "trainer.lora.enabled with runtime.colocate is not supported: a LoRA sync sends only "
            "the merged target modules, and an engine woken from sleep needs every weight"
        )
    if not lora.syncs_adapter:
        return
    engine = config.rollout.engine
    if not isinstance(engine, VllmEngineConfig) or engine.async_engine:
        kind = "vllm with async_engine" if isinstance(engine, VllmEngineConfig) else engine.type
        raise ValueError(
            f'trainer.lora.sync = "adapter" needs rollout.engine.type = "vllm" (batch; the engine that serves '
            f'LoRA adapters here), not {kind}: use sync = "merged" with this engine'
        )
    if config.weight_sync.transport == "broadcast":
        raise ValueError('trainer.lora.sync = "adapter" goes through the object store, not transport = "broadcast"')


def _check_fp16(config: SharpenConfig) -> None:
    """fp16 is float16 autocast over float32 master weights with a loss scale that the backends' own backward
    applies (docs/algorithms.md, Precision): refused where either does not hold, in one line."""
    trainer = config.trainer
    if trainer.precision == "fp16" and config.model.dtype != "auto":
        raise ValueError(
            f'trainer.precision = "fp16" needs float32 master weights: model.dtype must be "auto", not '
            f'"{config.model.dtype}" (pure float16 weights would lose small updates)'
        )
    if trainer.precision == "fp16" and trainer.parallel.pp > 1:
        raise ValueError('trainer.precision = "fp16" is not supported with pipeline parallelism (parallel.pp > 1)')
    if trainer.lm_head_float32 and trainer.parallel.tp > 1:
        raise ValueError("trainer.lm_head_float32 is not supported with a vocabulary-parallel head (parallel.tp > 1)")


def _check_sampling_cut(config: SharpenConfig) -> None:
    """A top-k or top-p cut is scored by the trainer on the whole vocabulary of one rank, and has no teacher KL."""
    rollout = config.rollout
    if not (rollout.top_k > 0 or rollout.top_p < 1.0):
        return
    cut = f"rollout.top_k = {rollout.top_k} / top_p = {rollout.top_p}"
    if config.trainer.parallel.tp > 1:
        raise ValueError(
            f"{cut} cannot be used with trainer.parallel.tp = {config.trainer.parallel.tp}: the trainer scores the "
            "truncated distribution, which needs the whole vocabulary on each rank (set tp = 1, or top_k = 0 and "
            "top_p = 1)"
        )
    if config.trainer.distillation.enabled:
        raise ValueError(
            f"{cut} cannot be used with trainer.distillation: the student's truncated logprob of a token outside its "
            "cut is -inf, which the teacher's reverse KL cannot take (set top_k = 0 and top_p = 1, or turn "
            "distillation off)"
        )
