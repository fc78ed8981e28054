"""The transformers engine samples every request with its own seed: a request gives the same tokens alone or in any
batch, and its logprobs are the temperature-scaled distribution's (what the trainer recomputes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sharpen.rollout.engines.hf import HfEngine
from sharpen.types import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path) -> HfEngine:
    return HfEngine(tiny_model_path)


PROMPTS = [[1, 5, 9, 200, 300], [1, 7], [1, 8, 9, 10, 11, 12, 13]]


def test_a_request_samples_the_same_tokens_alone_or_in_any_batch(engine: HfEngine) -> None:
    params = [SamplingParams(max_new_tokens=8, temperature=0.9, seed=seed) for seed in (11, 22, 33)]
    batch = engine.generate(PROMPTS, params)
    reversed_batch = engine.generate(PROMPTS[::-1], params[::-1])[::-1]
    alone = [engine.generate([prompt], [param])[0] for prompt, param in zip(PROMPTS, params, strict=True)]
    assert [c.token_ids for c in batch] == [c.token_ids for c in alone] == [c.token_ids for c in reversed_batch]
    for together, single in zip(batch, alone, strict=True):  # padding changes a logit's last bits, no more
        assert together.logprobs == pytest.approx(single.logprobs, abs=1e-4)
    other_seed = engine.generate([PROMPTS[0]], [SamplingParams(max_new_tokens=8, temperature=0.9, seed=12)])[0]
    assert other_seed.token_ids != batch[0].token_ids


def test_sampled_logprobs_are_the_temperature_scaled_policy(engine: HfEngine) -> None:
    [completion] = engine.generate([PROMPTS[2]], [SamplingParams(max_new_tokens=6, temperature=1.0, seed=5)])
    scored = engine.score(PROMPTS[2] + completion.token_ids)[len(PROMPTS[2]) - 1 :]
    assert completion.logprobs == pytest.approx(scored, abs=1e-5)
