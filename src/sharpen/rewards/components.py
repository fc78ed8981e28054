"""The extra weighted components of a `Rubric`, built from their ``[[reward.components]]`` tables.

Owns turning a component's config into a `RewardFn`: an LLM `Judge` on an OpenAI-compatible server, a
`RewardModelClient` of ``sharpen serve-rm``, `LengthReward` shaping, or a user's `CustomReward`. It does not build
the Ray backend of the reward model: actors are orchestration's (`sharpen.orchestration.ray.reward_actors`), which
hands the finished reward function to the `Rubric`. Weighing and combining the components is the `Rubric`'s.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, assert_never

from sharpen.config.rewards import (
    CustomComponentConfig,
    JudgeComponentConfig,
    LengthComponentConfig,
    RewardComponentConfig,
    RewardModelComponentConfig,
)
from sharpen.plugins import check_call, load_object
from sharpen.rewards.base import RewardContractError, RewardFn
from sharpen.rewards.judge import Judge, OpenAICompatibleClient
from sharpen.rewards.judge_prompts import DEFAULT_CRITERIA, RubricPrompt
from sharpen.rewards.rm_client import RewardModelClient
from sharpen.types import Example, RewardResult, RewardStatus


class LengthReward:
    """0 up to ``target_length``, then linearly down to -1 at ``max_length``, and -1 beyond; a `RewardFn` that
    never abstains. ``count`` measures a completion (characters, or tokens of the policy's tokenizer)."""

    def __init__(self, config: LengthComponentConfig, *, count: Callable[[str], int]) -> None:
        self.config = config
        self.count = count
        self.verifier = f"length:{config.unit}"

    def __call__(self, example: Example, completion: str) -> RewardResult:
        excess = (self.count(completion) - self.config.target_length) / (
            self.config.max_length - self.config.target_length
        )
        score = -min(1.0, max(0.0, excess))
        return RewardResult(score=score, status=RewardStatus.OK, verifier=self.verifier)


class CustomReward:
    """A user's reward (``type = "custom"``), loaded once: a function called ``(example, completion, **kwargs)``, or a
    class built with ``**kwargs`` whose instance is called ``(example, completion)``. A number becomes an ``ok``
    verdict with that score; a `RewardResult` is passed on as it is (``score=None`` abstains); anything else is a
    `RewardContractError`, which stops the run instead of abstaining on every rollout.

    The calls are checked against the callable's signature now, so a misspelt keyword fails at start."""

    def __init__(self, config: CustomComponentConfig) -> None:
        self.config = config
        what = f"reward component {config.name!r}: function = {config.function!r}"
        target = load_object(config.function, what=f"reward component {config.name!r}: function")
        if isinstance(target, type):
            check_call(target, (), config.kwargs, what=what)
            self._call, self._kwargs = target(**config.kwargs), {}
        else:
            self._call, self._kwargs = target, dict(config.kwargs)
        check_call(self._call, ("example", "completion"), self._kwargs, what=what)
        self.verifier = f"custom:{config.function.rpartition(':')[2]}"

    def __call__(self, example: Example, completion: str) -> RewardResult:
        value: Any = self._call(example, completion, **self._kwargs)
        if isinstance(value, RewardResult):
            return value
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise RewardContractError(
                f"reward component {self.config.name!r} ({self.config.function}) returned {value!r:.60} "
                f"({type(value).__name__}); return a finite number or a RewardResult (score=None abstains)"
            )
        return RewardResult(score=float(value), status=RewardStatus.OK, verifier=self.verifier)


def build_component(config: RewardComponentConfig, *, count_tokens: Callable[[str], int] | None = None) -> RewardFn:
    """The reward function of one component table. ``count_tokens`` (the policy's tokenizer) is needed only by a
    length component that counts tokens."""
    match config:
        case JudgeComponentConfig():
            return build_judge(config)
        case RewardModelComponentConfig():
            if config.backend != "http":
                raise ValueError(
                    f'reward component {config.name!r}: backend = "{config.backend}" runs in actors that the runtime '
                    "starts (sharpen.orchestration.ray.reward_actors.start_reward_model_pools) and hands to the "
                    "Rubric"
                )
            assert config.url is not None  # the config checks that http has a url
            return RewardModelClient(
                config.url,
                token_env=config.token_env,
                timeout_s=config.timeout_s,
                max_retries=config.max_retries,
                batch_size=config.batch_size,
            )
        case LengthComponentConfig(unit="chars"):
            return LengthReward(config, count=len)
        case LengthComponentConfig():
            if count_tokens is None:
                raise ValueError(
                    f"length component {config.name!r} counts tokens: pass count_tokens (the policy's tokenizer)"
                )
            return LengthReward(config, count=count_tokens)
        case CustomComponentConfig():
            return CustomReward(config)
        case _:
            assert_never(config)


def build_judge(config: JudgeComponentConfig) -> Judge:
    """A `Judge` on ``config.base_url``; the API key is read from ``config.api_key_env`` now, so a missing one is
    an error at start rather than 401s in every step."""
    if config.api_key_env is not None and not os.environ.get(config.api_key_env, "").strip():
        raise ValueError(
            f"judge {config.name!r}: api_key_env = {config.api_key_env!r}, but that environment variable is not set"
        )
    client = OpenAICompatibleClient(
        config.base_url,
        model=config.model,
        api_key_env=config.api_key_env,
        timeout_s=config.timeout_s,
        max_retries=config.max_retries,
    )
    prompt = RubricPrompt(
        criteria=config.criteria if config.criteria is not None else DEFAULT_CRITERIA,
        min_score=config.min_score,
        max_score=config.max_score,
        max_response_chars=config.max_response_chars,
    )
    cache_path = None
    if config.cache_path is not None:
        cache_path = Path(config.cache_path)
        cache_path.parent.mkdir(parents=True, exist_ok=True)
    return Judge(
        client,
        prompt=prompt,
        cache_path=cache_path,
        canary_threshold=config.canary_threshold,
        on_canary_failure=config.on_canary_failure,
    )
