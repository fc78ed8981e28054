"""The hf engine returns a Mixture-of-Experts model's routes with each completion (routing replay R3 on a CPU):
every prompt and generated token's experts, the last sampled token's unknown; they equal the routes of one full
forward of the same tokens with the same weights (the trainer's view) on nearly every token; and a trainer step
that replays them reproduces the engine's logprobs."""

from __future__ import annotations

from pathlib import Path

import torch

from sharpen.config.schema import TrainerConfig
from sharpen.expert_routes import UNROUTED, RouterReplay, routes_tensor
from sharpen.rollout.engines.hf import HfEngine
from sharpen.trainer import SingleDeviceBackend, Trainer
from sharpen.types import Example, Message, Rollout, SamplingParams, TrainBatch

PROMPTS = [[1, 400, 500, 600, 700], [1, 41, 42], [1, 9000, 9001, 9002, 9003, 9004, 9005]]


def _full_forward_routes(model_path: Path, tokens: list[int]) -> torch.Tensor:
    """[tokens, layers, top_k]: one forward of ``tokens`` (no cache, no padding) with its own routes."""
    from transformers import MixtralForCausalLM

    model = MixtralForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    replay = RouterReplay(model)
    with torch.no_grad(), replay.capture() as routes:
        model(input_ids=torch.tensor([tokens]))
    return torch.stack(routes.layers, dim=1)


def test_the_hf_engine_returns_the_routes_of_every_token_and_a_replaying_trainer_matches_its_logprobs(
    tiny_moe_path: Path,
):
    engine = HfEngine(tiny_moe_path)
    params = [SamplingParams(max_new_tokens=6, temperature=1.0, seed=seed) for seed in range(len(PROMPTS))]
    completions = engine.generate(PROMPTS, params)
    same = total = 0
    rollouts = []
    for prompt, completion in zip(PROMPTS, completions, strict=True):
        assert completion.routes is not None
        routes = routes_tensor(completion.routes)
        tokens = prompt + completion.token_ids
        assert routes.shape == (len(tokens), 2, 2)
        assert (routes[-1] == UNROUTED).all() and (routes[:-1] >= 0).all()  # the last sampled token never ran
        full = _full_forward_routes(tiny_moe_path, tokens)[:-1].sort(dim=-1).values
        agree = (routes[:-1].sort(dim=-1).values == full).all(dim=-1)  # [tokens - 1, layers]
        same, total = same + int(agree.sum()), total + agree.numel()
        rollouts.append(
            Rollout(
                example=Example(task_key=f"t/{len(rollouts)}", prompt=(Message(role="user", content="q"),)),
                prompt_ids=prompt,
                completion_ids=completion.token_ids,
                completion_logprobs=completion.logprobs,
                versions=[0] * len(completion.token_ids),
                advantage=1.0,
                routes=completion.routes,
            )
        )
    assert same / total >= 0.9  # a KV-cached decode and a full forward round differently only at near ties
    config = TrainerConfig.model_validate({"precision": "float32", "moe": {"routing_replay": "r3"}})
    backend = SingleDeviceBackend(config, model_path=tiny_moe_path, dtype="float32")
    metrics = Trainer(config, backend=backend, pad_token_id=2).step(TrainBatch(rollouts=rollouts, step=0))
    assert metrics["moe/engine_disagreement"] <= 0.1
    assert metrics["moe/logprob_gap_replayed"] < 1e-4  # the engine's logprobs, from the engine's routes


def test_the_weight_sync_probe_replays_the_trainers_routes_in_the_hf_engine(tmp_path: Path, smollm2_path: Path):
    """The probe of an MoE policy that records its routes (``trainer.moe.routing_replay``) carries them, and the hf
    engine replays them: with the same weights the engine's probe equals the trainer's exactly. With the engine's
    routers nudged by 1e-3 (as an engine's rounding may move them), its own routes flip on a few tokens, and on a
    model whose experts differ the check sees that as a mismatch many times the nudge's own; replaying the trainer's
    routes, only the nudge's is left."""
    from transformers import AutoTokenizer

    from sharpen.orchestration.weight_sync import WeightSync
    from support.tiny_moe import tiny_moe

    model = tiny_moe("mixtral", vocab_size=512)
    with torch.no_grad():  # experts that differ: a flipped route changes the logprobs
        for name, parameter in model.named_parameters():
            if name.endswith(("gate_up_proj", "down_proj")):
                parameter.normal_(0, 0.05)
    model.save_pretrained(tmp_path / "moe")
    AutoTokenizer.from_pretrained(smollm2_path).save_pretrained(tmp_path / "moe")  # the engine loads one
    config = TrainerConfig(device="cpu", precision="float32", moe={"routing_replay": "r2"})
    backend = SingleDeviceBackend(config, model_path=tmp_path / "moe", dtype="float32")
    trainer = Trainer(config, backend=backend, pad_token_id=0)
    probe_ids = [1, *range(300, 360)]
    scores = trainer.probe(probe_ids)
    assert scores.routes is not None and scores.logprobs == trainer.compute_logprobs(probe_ids)
    assert routes_tensor(scores.routes).equal(_full_forward_routes(tmp_path / "moe", probe_ids))

    engine = HfEngine(tmp_path / "moe")
    sync = WeightSync(probe_ids=probe_ids, tolerance=1e-5, verify=True)
    metrics = sync(trainer, engine, version=1)
    assert metrics["sync/probe_replayed"] == 1.0 and metrics["sync/probe_mismatch_max"] < 1e-6

    generator = torch.Generator().manual_seed(0)
    nudged = [
        (name, tensor + 1e-3 * torch.randn(tensor.shape, generator=generator) if "gate.weight" in name else tensor)
        for name, tensor in trainer.named_weights()
    ]
    engine.load_weights(nudged, version=2)
    assert engine.router is not None
    with engine.router.capture() as own:
        unreplayed = engine.score(probe_ids)
    trainers = routes_tensor(scores.routes).sort(dim=-1).values
    flipped = (torch.stack(own.layers, dim=1).sort(dim=-1).values != trainers).any(dim=-1).any(dim=-1)
    assert 0 < int(flipped.sum()) < len(probe_ids) // 4, "the nudge flips a few tokens' routes"
    replayed = engine.score_replaying(probe_ids, scores.routes)
    gap = sum(abs(a - b) for a, b in zip(unreplayed, scores.logprobs, strict=True))
    replayed_gap = sum(abs(a - b) for a, b in zip(replayed, scores.logprobs, strict=True))
    assert replayed_gap < 0.2 * gap
