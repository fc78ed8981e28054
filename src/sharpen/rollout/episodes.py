"""The single-turn episode loop: examples -> prompt tokens -> engine completions -> `RolloutGroup`s.

Prompts are rendered to token ids once, by the tokenizer's chat template; the engine's token ids are kept as
they came (never re-tokenised from text). Every sample gets its own sampling seed derived from
(run seed, step, example index, sample index), so a run is reproducible whatever the engine's batching.
Multi-turn episodes and tools arrive with the environments issue and extend this module.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from typing import Any

from sharpen.data import render_prompt
from sharpen.rollout.engines.base import InferenceEngine
from sharpen.types import Example, Rollout, RolloutGroup, SamplingParams


def derive_seed(*parts: int | str) -> int:
    """A stable 63-bit seed from any parts (Python's ``hash`` is salted per process, so it is not used)."""
    digest = hashlib.blake2b("/".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def generate_groups(
    engine: InferenceEngine,
    examples: list[Example],
    *,
    tokenizer: Any,
    sampling: SamplingParams,
    num_samples: int,
    seed: int | str,
) -> list[RolloutGroup]:
    """``num_samples`` rollouts per example, stamped with the engine's current policy version."""
    prompts = [render_prompt(tokenizer, example.prompt) for example in examples]
    requests = [(i, s) for i in range(len(examples)) for s in range(num_samples)]
    completions = engine.generate(
        [prompts[i] for i, _ in requests],
        [replace(sampling, seed=derive_seed(seed, i, s)) for i, s in requests],
    )
    version = engine.policy_version
    groups = [RolloutGroup(example=example, rollouts=[]) for example in examples]
    for (i, s), completion in zip(requests, completions, strict=True):
        groups[i].rollouts.append(
            Rollout(
                example=examples[i],
                prompt_ids=prompts[i],
                completion_ids=completion.token_ids,
                completion_logprobs=completion.logprobs,
                versions=[version] * len(completion.token_ids),
                completion_text=completion.text,
                is_truncated=completion.finish_reason == "length",
                sample_index=s,
            )
        )
    return groups
