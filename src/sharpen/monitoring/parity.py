"""The parity probe: how far the engine's logprobs are from the trainer's on a fixed probe set, as metrics.

The weight-sync check (`rollout/weight_sync/verify.py`) proves that each sync arrived, on one probe text, and stops
the run on a mismatch. This module watches the mismatch over the whole run, on the policy's own kind of text: a few
of the run's prompts, each with the engine's greedy completion, made once at the start and then fixed. Only the
completion tokens are compared. It reports (``parity/*``) and never stops the run; when to run it is the loop's call.

Two halves, because in asynchronous training the trainer and the engine hold a given weight version at different
times: `ParityProbe.reference` takes the trainer's logprobs while the trainer holds version v, and
`ParityProbe.measure` the engine's once the engine holds v. `ParityProbe.run` does both at once, for when they hold
the same weights (synchronous training, right after a sync).

Monitoring may not import rollout or trainer, so the engine and the trainer are seen through two small protocols,
and prompts arrive already rendered (rendering is `sharpen.data`'s).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, cast

from sharpen.types import Completion, ImagePart, PolicyVersion, SamplingParams


class ProbeEngine(Protocol):
    """The part of `InferenceEngine` the probe uses."""

    @property
    def policy_version(self) -> PolicyVersion: ...

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]: ...

    def score(self, token_ids: list[int]) -> list[float]:
        """Logprobs of ``token_ids[1:]`` given their prefixes, at temperature 1."""
        ...


class ProbeTrainer(Protocol):
    """The part of `Trainer` the probe uses."""

    def compute_logprobs(self, token_ids: list[int]) -> list[float]:
        """Logprobs of ``token_ids[1:]`` given their prefixes under the current weights, at temperature 1."""
        ...


class ImageProbeEngine(Protocol):
    """An engine's ``score`` for probes with images (the `hf` and `vllm` engines'): only image probes call it, so
    engines without image prompts keep the plain `ProbeEngine.score`."""

    def score(self, token_ids: list[int], images: tuple[ImagePart, ...]) -> list[float]: ...

    def generate_with_images(
        self, prompts: list[list[int]], images: Sequence[tuple[ImagePart, ...]], params: list[SamplingParams]
    ) -> list[Completion]: ...


class ImageProbeTrainer(Protocol):
    """The trainer's ``compute_logprobs`` for probes with images."""

    def compute_logprobs(self, token_ids: list[int], images: tuple[ImagePart, ...]) -> list[float]: ...


@dataclass(kw_only=True, slots=True, frozen=True)
class ParityReference:
    """The trainer's side of one measurement."""

    version: PolicyVersion
    """The policy version the trainer held; the engine must hold the same one when it is measured against it."""
    logprobs: list[list[float]]
    """Per probe, the trainer's logprob of each completion token."""


def parity_metrics(differences: Sequence[float]) -> dict[str, float]:
    """``parity/*`` metrics of per-token differences ``d = trainer logprob - engine logprob``.

    ``parity/k3`` is the mean of ``exp(d) - 1 - d``: Schulman's k3 estimator of KL(engine || trainer), which treats
    the tokens as drawn from the engine (for ``q`` = engine, ``p`` = trainer and tokens ``x ~ q``, k3 is
    ``r - 1 - log r`` with ``r = p(x)/q(x) = exp(d)``). It is never negative and zero only where the two agree. The
    probe's tokens are the engine's greedy choices, not samples, so it is a mismatch in KL's units (nats per token)
    rather than an unbiased estimate of the KL.
    """
    if not differences:
        raise ValueError("parity_metrics: no tokens to compare")
    num = len(differences)
    return {
        "parity/mean_abs_diff": math.fsum(abs(d) for d in differences) / num,
        "parity/max_abs_diff": max(abs(d) for d in differences),
        "parity/k3": math.fsum(math.expm1(d) - d for d in differences) / num,  # expm1: exact for tiny d
        "parity/num_tokens": float(num),
    }


class ParityProbe:
    """Fixed probe sequences, each ``(token_ids, prompt_length)``: the prompt is ``token_ids[:prompt_length]`` and
    the rest is the completion whose logprobs are compared. ``images`` (one tuple per sequence, when some prompts
    hold images): the images each prompt's placeholders stand for, passed to the engine's ``score`` and the
    trainer's ``compute_logprobs`` (an image prompt is compared with the same pixels on both sides)."""

    def __init__(
        self, sequences: Sequence[tuple[list[int], int]], images: Sequence[tuple[ImagePart, ...]] | None = None
    ) -> None:
        if not sequences:
            raise ValueError("ParityProbe: no probe sequences")
        if images is not None and len(images) != len(sequences):
            raise ValueError(f"ParityProbe: {len(images)} image tuples for {len(sequences)} probe sequences")
        self.images: list[tuple[ImagePart, ...]] = list(images) if images is not None else [()] * len(sequences)
        for index, (token_ids, prompt_length) in enumerate(sequences):
            if not 1 <= prompt_length < len(token_ids):
                raise ValueError(
                    f"ParityProbe: probe {index} has {len(token_ids)} tokens and a prompt of {prompt_length}; it "
                    "needs at least one prompt token and one completion token"
                )
        self.sequences = [(list(token_ids), prompt_length) for token_ids, prompt_length in sequences]

    @property
    def num_tokens(self) -> int:
        """Completion tokens compared per measurement."""
        return sum(len(token_ids) - prompt_length for token_ids, prompt_length in self.sequences)

    def reference(self, trainer: ProbeTrainer, *, version: PolicyVersion) -> ParityReference:
        """The trainer's logprobs of every probe's completion; ``version`` is the policy version it holds now."""
        return ParityReference(
            version=version,
            logprobs=[
                _completion_logprobs(
                    # an image probe needs a trainer that takes images (`Trainer.compute_logprobs` does)
                    cast(ImageProbeTrainer, trainer).compute_logprobs(token_ids, images)
                    if images
                    else trainer.compute_logprobs(token_ids),
                    token_ids,
                    prompt_length,
                    source="trainer",
                )
                for (token_ids, prompt_length), images in zip(self.sequences, self.images, strict=True)
            ],
        )

    def measure(self, engine: ProbeEngine, reference: ParityReference) -> dict[str, float]:
        """The engine's logprobs of the same tokens against ``reference`` (`parity_metrics`). The engine must hold
        the reference's policy version: otherwise the comparison would measure training progress, not mismatch."""
        if engine.policy_version != reference.version:
            raise ValueError(
                f"ParityProbe.measure: the engine holds policy version {engine.policy_version} but the reference "
                f"was taken at version {reference.version}; measure once the engine has loaded that version"
            )
        if len(reference.logprobs) != len(self.sequences):
            raise ValueError(
                f"ParityProbe.measure: the reference has {len(reference.logprobs)} probes, this probe set "
                f"{len(self.sequences)}"
            )
        differences: list[float] = []
        for (token_ids, prompt_length), images, trainer_logprobs in zip(
            self.sequences, self.images, reference.logprobs, strict=True
        ):
            # an image probe was built by an engine that generates from images, which also scores them
            scored = cast(ImageProbeEngine, engine).score(token_ids, images) if images else engine.score(token_ids)
            engine_logprobs = _completion_logprobs(scored, token_ids, prompt_length, source="engine")
            differences.extend(t - e for t, e in zip(trainer_logprobs, engine_logprobs, strict=True))
        return parity_metrics(differences)

    def run(self, trainer: ProbeTrainer, engine: ProbeEngine) -> dict[str, float]:
        """`reference` and `measure` at once, for a trainer and an engine that hold the same weights (the
        engine's policy version is taken as the trainer's)."""
        return self.measure(engine, self.reference(trainer, version=engine.policy_version))


def _completion_logprobs(
    logprobs: list[float], token_ids: list[int], prompt_length: int, *, source: str
) -> list[float]:
    """The completion's part of logprobs of ``token_ids[1:]``: ``logprobs[i]`` belongs to ``token_ids[i + 1]``, so
    the first completion token's is at ``prompt_length - 1``."""
    if len(logprobs) != len(token_ids) - 1:
        raise ValueError(
            f"ParityProbe: the {source} returned {len(logprobs)} logprobs for a probe of {len(token_ids)} tokens "
            f"(expected {len(token_ids) - 1}, one per token after the first)"
        )
    return logprobs[prompt_length - 1 :]


def build_probe_set(
    prompts: list[list[int]],
    engine: ProbeEngine,
    *,
    max_new_tokens: int,
    images: Sequence[tuple[ImagePart, ...]] | None = None,
) -> ParityProbe:
    """Probes from rendered prompts (e.g. ``render_prompt`` of the run's first examples), each completed greedily
    by ``engine`` in one ``generate`` call: the policy's own kind of text, then fixed for the run. A prompt whose
    completion comes back empty is left out. ``images``: each prompt's images, when some prompts hold images (a
    vision model's `VisionProcessor.render_prompt`); the engine then generates with them (``generate_with_images``)."""
    if not prompts:
        raise ValueError("build_probe_set: no prompts")
    params = [SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)] * len(prompts)  # 0: greedy
    per_prompt = list(images) if images is not None else [()] * len(prompts)
    if any(per_prompt):  # image prompts need an engine that generates from images (the hf engine)
        completions = cast(ImageProbeEngine, engine).generate_with_images(prompts, per_prompt, params)
    else:
        completions = engine.generate(prompts, params)
    kept = [
        (prompt + completion.token_ids, len(prompt), prompt_images)
        for prompt, completion, prompt_images in zip(prompts, completions, per_prompt, strict=True)
        if completion.token_ids
    ]
    if not kept:
        raise ValueError(f"build_probe_set: the engine's greedy completions of all {len(prompts)} prompts are empty")
    return ParityProbe([(ids, length) for ids, length, _ in kept], [found for _, _, found in kept])
