"""Replaying a recorded episode's environment side: same task, same seed, the recorded actions in order.

Owns the comparison of a re-run with its record: the first observation's prompt tokens, then per turn the
environment's observation tokens, reward and end flags, and the digests of its images where the environment recorded
them (``info["image_sha256"]``, as the browser's screenshots do: an image's tokens depend only on its size). The
policy is not re-run (its actions come from the record), so a replay isolates the environment: a difference means
the environment, its task data or its dependencies changed, or the environment is not deterministic given its seed.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sharpen.data import render_continuation, render_prompt
from sharpen.data.vision import VisionProcessor
from sharpen.environments import Environment, EpisodeContext, EpisodeLimits
from sharpen.types import Example, ImagePart, Message, prompt_images


@dataclass(kw_only=True, slots=True)
class ReplayReport:
    num_turns: int
    differences: list[str] = field(default_factory=list[str])

    @property
    def is_reproduced(self) -> bool:
        return not self.differences


def replay_episode(
    record: dict[str, Any],
    example: Example,
    environment: Environment,
    *,
    tokenizer: Any,
    limits: EpisodeLimits,
    sandbox: Any = None,
    vision: VisionProcessor | None = None,
) -> ReplayReport:
    """Re-run the environment of a rollout record (as `sharpen.monitoring.rollout_record` writes it). ``vision``: the
    run's vision-language model's processor, which renders observations that hold images (as the episode runner
    did)."""
    return asyncio.run(
        _replay(record, example, environment, tokenizer=tokenizer, limits=limits, sandbox=sandbox, vision=vision)
    )


async def _replay(
    record: dict[str, Any],
    example: Example,
    environment: Environment,
    *,
    tokenizer: Any,
    limits: EpisodeLimits,
    sandbox: Any,
    vision: VisionProcessor | None,
) -> ReplayReport:
    episode = record.get("episode")
    if not episode:
        raise ValueError(f"rollout {record.get('task_key')} has no episode record to replay")
    report = ReplayReport(num_turns=len(episode["turns"]))
    differences = report.differences
    if example.task_hash != record["task_hash"]:
        differences.append(
            f"task {example.task_key}: content hash {example.task_hash} != recorded {record['task_hash']}"
        )
    recorded_env = (episode["environment"], episode["environment_version"])
    if (environment.name, environment.version) != recorded_env:
        differences.append(
            f"environment {environment.name} v{environment.version} != recorded {recorded_env[0]} v{recorded_env[1]}"
        )
    context = EpisodeContext(
        seed=episode["seed"],
        sample_index=record["sample_index"],
        max_turns=limits.max_turns,
        max_tokens=limits.max_tokens,
        wall_seconds=limits.wall_seconds,
        sandbox=sandbox,
    )
    first = await environment.reset(example, context)
    prompt_ids = (
        vision.render_prompt(first) if vision is not None and _images(first) else render_prompt(tokenizer, first)
    )
    if prompt_ids != record["prompt_ids"]:
        differences.append("reset: the first observation renders to different prompt tokens")
    shown = [image.to_json() for image in _images(first)]
    if shown and record.get("images", shown)[: len(shown)] != shown:  # records of older runs hold no images
        differences.append("reset: the first observation's images differ (sha256 of their bytes)")
    for index, turn in enumerate(episode["turns"]):
        result = await environment.step(turn["action_text"])
        replayed = {"reward": result.reward, "is_terminated": result.terminated, "is_truncated": result.truncated}
        for name, value in replayed.items():
            if value != turn[name]:
                differences.append(f"turn {index}: {name} {value!r} != recorded {turn[name]!r}")
        recorded_ids = turn["observation_ids"]
        if recorded_ids:
            end_of_turn_id = tokenizer.eos_token_id
            if vision is not None and _images(result.observation):
                ids = vision.render_continuation(result.observation, end_of_turn_id=end_of_turn_id)
            else:
                ids = render_continuation(tokenizer, result.observation, end_of_turn_id=end_of_turn_id)
            if recorded_ids not in (ids, [end_of_turn_id, *ids]):
                differences.append(f"turn {index}: the observation renders to different tokens")
        recorded_digests = turn.get("info", {}).get("image_sha256")
        if recorded_digests is not None:
            digests = [_digest(image) for image in _images(result.observation)]
            if digests != recorded_digests:
                differences.append(f"turn {index}: the observation's images differ (sha256 of their bytes)")
    return report


def _images(observation: Sequence[Any]) -> tuple[ImagePart, ...]:
    """The images of an observation's `Message`s (OpenAI-style dict messages hold none here)."""
    return prompt_images([message for message in observation if isinstance(message, Message)])


def _digest(image: ImagePart) -> str:
    return hashlib.sha256(image.data or Path(image.path).read_bytes()).hexdigest()
