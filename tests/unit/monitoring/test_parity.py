"""The parity probe: exact mismatch metrics on the completion tokens only, the trainer and engine halves measured at
the same policy version, and a probe set made of the engine's greedy completions."""

from __future__ import annotations

import math

import pytest

from sharpen.monitoring import ParityProbe, ParityReference, build_probe_set, parity_metrics
from sharpen.types import Completion, SamplingParams

# Two probes: prompt [1, 2] + completion [3, 4], prompt [5] + completion [6, 7]. Logprobs are of token_ids[1:].
PROBES = [([1, 2, 3, 4], 2), ([5, 6, 7], 1)]
TRAINER_LOGPROBS = {(1, 2, 3, 4): [-9.0, -1.0, -2.0], (5, 6, 7): [-0.5, -0.25]}
# The first entry of the first probe scores a prompt token: far off, and never compared.
ENGINE_LOGPROBS = {(1, 2, 3, 4): [-7.0, -1.5, -2.0], (5, 6, 7): [-0.25, -1.0]}
DIFFERENCES = [0.5, 0.0, -0.25, 0.75]  # trainer - engine, per completion token


class FakeTrainer:
    def __init__(self, logprobs: dict[tuple[int, ...], list[float]]) -> None:
        self.logprobs = logprobs

    def compute_logprobs(self, token_ids: list[int]) -> list[float]:
        return list(self.logprobs[tuple(token_ids)])


class FakeEngine:
    def __init__(
        self,
        logprobs: dict[tuple[int, ...], list[float]],
        *,
        policy_version: int = 0,
        completions: list[list[int]] | None = None,
    ) -> None:
        self.logprobs = logprobs
        self.policy_version = policy_version
        self.completions = completions or []
        self.generate_calls: list[tuple[list[list[int]], list[SamplingParams]]] = []

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        self.generate_calls.append((prompts, params))
        return [Completion(token_ids=ids, logprobs=[-1.0] * len(ids)) for ids in self.completions]

    def score(self, token_ids: list[int]) -> list[float]:
        return list(self.logprobs[tuple(token_ids)])


def k3(d: float) -> float:
    return math.exp(d) - 1 - d


def test_run_compares_only_completion_tokens_with_exact_values() -> None:
    metrics = ParityProbe(PROBES).run(FakeTrainer(TRAINER_LOGPROBS), FakeEngine(ENGINE_LOGPROBS))
    assert metrics["parity/mean_abs_diff"] == 0.375  # (0.5 + 0 + 0.25 + 0.75) / 4, exact in binary
    assert metrics["parity/max_abs_diff"] == 0.75
    assert metrics["parity/num_tokens"] == 4.0
    assert metrics["parity/k3"] == pytest.approx(sum(k3(d) for d in DIFFERENCES) / 4, rel=1e-14)
    assert set(metrics) == {"parity/mean_abs_diff", "parity/max_abs_diff", "parity/k3", "parity/num_tokens"}


def test_k3_is_the_kl_of_engine_to_trainer_and_never_negative() -> None:
    # A token the trainer finds twice as likely as the engine: d = log 2, k3 = r - 1 - log r with r = 2.
    assert parity_metrics([math.log(2.0)])["parity/k3"] == pytest.approx(1 - math.log(2.0), rel=1e-14)
    # Half as likely: r = 1/2.
    assert parity_metrics([-math.log(2.0)])["parity/k3"] == pytest.approx(math.log(2.0) - 0.5, rel=1e-14)
    assert parity_metrics([0.0, 0.0])["parity/k3"] == 0.0
    # tiny float32-level mismatches stay positive and ~d^2/2 (no cancellation to 0 or below)
    assert parity_metrics([1e-6])["parity/k3"] == pytest.approx(0.5e-12, rel=1e-5)
    with pytest.raises(ValueError, match="no tokens"):
        parity_metrics([])


def test_reference_and_measure_split_across_versions() -> None:
    """Asynchronous training: the trainer's version-3 logprobs are kept while it trains on; the engine is measured
    against them once it holds version 3, whatever the trainer holds by then."""
    probe = ParityProbe(PROBES)
    trainer = FakeTrainer(TRAINER_LOGPROBS)
    reference = probe.reference(trainer, version=3)
    assert reference == ParityReference(version=3, logprobs=[[-1.0, -2.0], [-0.5, -0.25]])
    trainer.logprobs = {ids: [v - 10.0 for v in values] for ids, values in TRAINER_LOGPROBS.items()}  # step 4 ...

    engine = FakeEngine(ENGINE_LOGPROBS, policy_version=2)
    with pytest.raises(ValueError, match="engine holds policy version 2 but the reference was taken at version 3"):
        probe.measure(engine, reference)
    engine.policy_version = 3
    assert probe.measure(engine, reference)["parity/mean_abs_diff"] == 0.375


def test_logprobs_of_the_wrong_length_are_an_error() -> None:
    probe = ParityProbe(PROBES)
    short = {ids: values[:-1] for ids, values in TRAINER_LOGPROBS.items()}
    with pytest.raises(ValueError, match="the trainer returned 2 logprobs for a probe of 4 tokens"):
        probe.reference(FakeTrainer(short), version=0)


@pytest.mark.parametrize(
    ("sequences", "message"),
    [([], "no probe sequences"), ([([1, 2], 2)], "probe 0 has 2 tokens"), ([([1, 2], 0)], "a prompt of 0")],
)
def test_probe_sequences_need_a_prompt_and_a_completion(sequences: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ParityProbe(sequences)


def test_build_probe_set_asks_once_for_greedy_completions() -> None:
    engine = FakeEngine({}, completions=[[3, 4], [], [8]])
    probe = build_probe_set([[1, 2], [9], [5, 6, 7]], engine, max_new_tokens=16)

    ((prompts, params),) = engine.generate_calls
    assert prompts == [[1, 2], [9], [5, 6, 7]]
    assert params == [SamplingParams(max_new_tokens=16, temperature=0.0)] * 3
    # the prompt whose completion came back empty is left out
    assert probe.sequences == [([1, 2, 3, 4], 2), ([5, 6, 7, 8], 3)]
    assert probe.num_tokens == 3


def test_build_probe_set_errors() -> None:
    with pytest.raises(ValueError, match="no prompts"):
        build_probe_set([], FakeEngine({}), max_new_tokens=4)
    with pytest.raises(ValueError, match="all 2 prompts are empty"):
        build_probe_set([[1], [2]], FakeEngine({}, completions=[[], []]), max_new_tokens=4)
