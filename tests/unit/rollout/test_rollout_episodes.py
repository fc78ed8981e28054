"""generate_groups with the scripted engine: group structure, version stamps, truncation, per-sample seeds."""

from __future__ import annotations

import subprocess
import sys

from sharpen.rollout.engines.scripted import ScriptedEngine
from sharpen.rollout.episodes import EpisodeRunner, derive_seed
from sharpen.types import Completion, Example, Message, SamplingParams

EOS = 0


def _encode(text: str) -> list[int]:
    return [ord(c) for c in text]


class _FakeTokenizer:
    """A chat template that renders each message as its role id followed by its characters."""

    def apply_chat_template(self, conversation, *, add_generation_prompt, tokenize):
        assert add_generation_prompt and tokenize
        ids = []
        for message in conversation:
            ids += [1 if message["role"] == "system" else 2, *_encode(message["content"])]
        return [*ids, 3]


def _example(index: int, question: str) -> Example:
    return Example(task_key=f"t/{index}", prompt=(Message(role="user", content=question),), answer=str(index))


def test_derive_seed_is_stable_and_separates_its_parts():
    # pinned: a change here changes every run's samples, so it must be deliberate
    assert derive_seed(0, 1, 2) == 3662037204992188296
    assert derive_seed("0/3", 1, 2) == 4844571840686137175
    code = "from sharpen.rollout.episodes import derive_seed; print(derive_seed(0, 1, 2))"
    other_process = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(other_process.stdout) == derive_seed(0, 1, 2)  # no per-process hash salt
    seeds = [derive_seed(*parts) for parts in [(0, 1, 2), (0, 2, 1), (1, 1, 2), (0, 1, 3), (0, 12), (0, 1), (0,)]]
    assert len(set(seeds)) == len(seeds)
    assert all(0 <= seed < 2**63 for seed in seeds)


def test_generate_groups_structure_versions_truncation_and_seeds():
    engine = ScriptedEngine(["ab", "abcdefgh", "abcd"], encode=_encode, logprob=-0.5, eos_token_id=EOS)
    engine.policy_version = 3
    requests: list[tuple[list[int], SamplingParams]] = []
    generate = engine.generate

    def recording_generate(prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        requests.extend(zip(prompts, params, strict=True))
        return generate(prompts, params)

    engine.generate = recording_generate  # type: ignore[method-assign]
    examples = [_example(0, "hi"), _example(1, "yo!")]
    sampling = SamplingParams(max_new_tokens=5, temperature=0.7)
    groups = EpisodeRunner(tokenizer=_FakeTokenizer()).generate_groups(
        engine, examples, sampling=sampling, num_samples=3, seed=11
    )

    assert [g.example for g in groups] == examples
    assert [[r.sample_index for r in g.rollouts] for g in groups] == [[0, 1, 2], [0, 1, 2]]
    assert all(r.example is g.example for g in groups for r in g.rollouts)
    assert groups[0].rollouts[0].prompt_ids == [2, *_encode("hi"), 3]
    assert groups[1].rollouts[2].prompt_ids == [2, *_encode("yo!"), 3]

    # texts are handed out in turn: "ab" stops (eos appended), "abcdefgh" hits the 5-token limit, "abcd" stops
    first = groups[0].rollouts
    assert first[0].completion_ids == [*_encode("ab"), EOS] and not first[0].is_truncated
    assert first[1].completion_ids == _encode("abcde") and first[1].is_truncated
    assert first[2].completion_ids == [*_encode("abcd"), EOS] and not first[2].is_truncated
    assert [r.is_truncated for r in groups[1].rollouts] == [False, True, False]
    assert first[1].completion_text == "abcdefgh"
    for rollout in (r for g in groups for r in g.rollouts):
        assert rollout.versions == [3] * len(rollout.completion_ids)
        assert rollout.completion_logprobs == [-0.5] * len(rollout.completion_ids)
        assert rollout.reward is None and rollout.advantage is None

    # one request per sample, each with its own derived seed and the caller's other settings
    assert len(requests) == 6
    seeds = [params.seed for _, params in requests]
    assert seeds == [derive_seed(11, i, s) for i in range(2) for s in range(3)]
    assert len(set(seeds)) == 6
    assert all(params.max_new_tokens == 5 and params.temperature == 0.7 for _, params in requests)


def test_seeds_depend_on_the_run_seed_not_on_the_batch():
    def seeds(run_seed: int, num_examples: int) -> list[int | None]:
        engine = ScriptedEngine(["x"], encode=_encode)
        captured: list[int | None] = []
        generate = engine.generate

        def recording_generate(prompts, params):
            captured.extend(p.seed for p in params)
            return generate(prompts, params)

        engine.generate = recording_generate  # type: ignore[method-assign]
        examples = [_example(i, f"q{i}") for i in range(num_examples)]
        sampling = SamplingParams(max_new_tokens=4)
        EpisodeRunner(tokenizer=_FakeTokenizer()).generate_groups(
            engine, examples, sampling=sampling, num_samples=2, seed=run_seed
        )
        return captured

    assert seeds(5, 2) == seeds(5, 3)[:4]  # adding an example does not reshuffle the others' seeds
    assert set(seeds(5, 2)).isdisjoint(seeds(6, 2))


def test_loop_style_string_seed_gives_per_step_seeds():
    engine = ScriptedEngine(["x"], encode=_encode)
    captured: list[int | None] = []
    generate = engine.generate

    def recording_generate(prompts, params):
        captured.extend(p.seed for p in params)
        return generate(prompts, params)

    engine.generate = recording_generate  # type: ignore[method-assign]
    sampling = SamplingParams(max_new_tokens=4)
    for step in range(2):  # the loop seeds each step with f"{run.seed}/{step}"
        EpisodeRunner(tokenizer=_FakeTokenizer()).generate_groups(
            engine, [_example(0, "q")], sampling=sampling, num_samples=2, seed=f"7/{step}"
        )
    assert captured == [derive_seed(f"7/{step}", 0, s) for step in range(2) for s in range(2)]
    assert len(set(captured)) == 4
