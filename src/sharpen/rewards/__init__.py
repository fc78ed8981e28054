"""Rewards: the `RewardFn` protocol, answer extraction, verifiers per data source, and the weighted `Rubric`."""

from sharpen.rewards.answers import AnswerFormat, extract_answer
from sharpen.rewards.base import RewardFn
from sharpen.rewards.rubric import Rubric, VerifierReward, default_verifiers, score_weights
from sharpen.rewards.verifiers import ExactMatchVerifier, ReasoningGymVerifier, Verifier, answers_match

__all__ = [
    "AnswerFormat",
    "ExactMatchVerifier",
    "ReasoningGymVerifier",
    "RewardFn",
    "Rubric",
    "Verifier",
    "VerifierReward",
    "answers_match",
    "default_verifiers",
    "extract_answer",
    "score_weights",
]
