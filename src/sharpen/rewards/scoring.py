"""Scoring a finished rollout: the environment's own reward when it gave one, else the run's reward function.

Owns the one rule that picks a rollout's verdict, so that training (`sharpen.orchestration.phases.score_groups`)
and evaluation (`sharpen.evaluation`) score every rollout the same way; it lives here, below both. It does not
shape rewards for training (overlong penalties, KL terms) and does not aggregate them.
"""

from __future__ import annotations

import logging

from sharpen.rewards.base import RewardContractError, RewardFn
from sharpen.types import Example, RewardResult, RewardStatus, Rollout

logger = logging.getLogger(__name__)


def score_rollout(rubric: RewardFn, example: Example, rollout: Rollout) -> RewardResult:
    """The environment's own reward when it gave one, else the rubric's verdict on the final turn's text. An
    episode that the environment broke (it raised, or ran out of its wall clock) abstains: the policy is not to
    blame for it."""
    episode = rollout.episode
    if episode is None:
        return _judge(rubric, example, rollout.completion_text)
    verifier = f"environment:{episode.environment}"
    if episode.stop_reason == "environment_error":
        return RewardResult(score=None, status=RewardStatus.INFRA_ERROR, verifier=verifier)
    if episode.stop_reason == "wall_clock":
        return RewardResult(score=None, status=RewardStatus.TIMEOUT, verifier=verifier)
    score = episode.env_reward
    if score is None:
        return _judge(rubric, example, rollout.completion_text)
    status = RewardStatus.OK if score >= 1.0 else RewardStatus.WRONG
    return RewardResult(score=score, status=status, components={"environment": score}, verifier=verifier)


def _judge(rubric: RewardFn, example: Example, completion: str) -> RewardResult:
    """The reward function's verdict; one that raises (a reward worker or a service that failed) abstains with
    ``infra_error`` instead of stopping the run or scoring 0."""
    try:
        return rubric(example, completion)
    except RewardContractError:  # a reward function that returns the wrong thing would abstain on every rollout
        raise
    except Exception as error:  # fault tolerance: a failing scorer must not stop a long run
        logger.warning("reward function failed on %s; abstaining: %r", example.task_key, error)
        return RewardResult(score=None, status=RewardStatus.INFRA_ERROR, verifier=type(rubric).__name__)
