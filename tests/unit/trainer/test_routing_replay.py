"""Routing replay in the trainer (``trainer.moe.routing_replay``) on a tiny random Mixtral: R3 replays the engine's
routes in every pass of the policy (measured by hooks on the experts, which see the indices they are given); R2
replays the old-policy pass's routes after an update moved the routers (and without replay the routes move: the
control); the engine/trainer logprob gap with the engine's routes is zero against a hand-written forced-routing
forward; packing changes nothing; two FSDP2 ranks take the same step as one device, also with the experts split
over them (expert parallelism); bad input is one clear error."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from sharpen.config.algorithm import AlgorithmConfig
from sharpen.config.schema import TrainerConfig
from sharpen.expert_routes import UNROUTED, RoutingError, expert_routes, routes_tensor
from sharpen.trainer import SingleDeviceBackend, Trainer
from sharpen.trainer.layout import ParallelLayout
from sharpen.types import Example, ExpertRoutes, Message, Rollout, TrainBatch
from support.ranks import join_process_group, launch_ranks
from support.tiny_moe import tiny_moe

VOCAB, EXPERTS, TOP_K, LAYERS, PAD = 128, 4, 2, 2, 0
_EXAMPLE = Example(task_key="t/0", prompt=(Message(role="user", content="q"),), answer="a")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tiny_moe("mixtral", vocab_size=VOCAB, tie_word_embeddings=True, pad_token_id=PAD)
    with torch.no_grad():  # decisive routers: a route is a clear choice, not a near tie
        for router in _routers(model):
            router.weight.normal_(0, 1.0)
    folder = tmp_path_factory.mktemp("tiny_mixtral")
    model.save_pretrained(folder)
    return folder


def _routers(model) -> list:
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def _engine_routes(num_tokens: int, seed: int) -> torch.Tensor:
    """Random routes (two distinct experts per token and layer), the last token unknown, as the hf engine leaves
    the token it sampled last."""
    generator = torch.Generator().manual_seed(seed)
    routes = torch.stack(
        [
            torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOP_K] for _ in range(LAYERS)])
            for _ in range(num_tokens)
        ]
    )
    routes[-1] = UNROUTED
    return routes


def _rollouts(*, with_routes: bool, completion_logprobs: list[list[float]] | None = None) -> list[Rollout]:
    shapes = [([3, 4, 5], [6, 7, 8, 9]), ([10, 11], [12, 13, 14]), ([15, 16, 17, 18], [19, 20]), ([21], [22, 23])]
    out = []
    for index, (prompt, completion) in enumerate(shapes):
        routes = None
        if with_routes:
            routes = expert_routes(_engine_routes(len(prompt) + len(completion), seed=index), num_experts=EXPERTS)
        out.append(
            Rollout(
                example=_EXAMPLE,
                prompt_ids=prompt,
                completion_ids=completion,
                completion_logprobs=(
                    completion_logprobs[index] if completion_logprobs else [math.log(1 / VOCAB)] * len(completion)
                ),
                versions=[0] * len(completion),
                sample_index=index,
                advantage=[1.0, -1.0, 0.5, -0.5][index],
                routes=routes,
            )
        )
    return out


def _config(replay: str, **options) -> TrainerConfig:
    return TrainerConfig.model_validate(
        {
            "algorithm": AlgorithmConfig(num_mini_batches=2),
            "learning_rate": 0.05,
            "micro_batch_size": 8,
            "precision": "float32",
            "moe": {"routing_replay": replay},
            "device": "cpu",
            **options,
        }
    )


def _trainer(moe_dir: Path, replay: str, **options) -> Trainer:
    config = _config(replay, **options)
    backend = SingleDeviceBackend(config, model_path=moe_dir, dtype="float32")
    return Trainer(config, backend=backend, pad_token_id=PAD, max_new_tokens=8)


def _record_gradients(trainer: Trainer) -> list[dict[str, torch.Tensor]]:
    """Each optimizer step's whole gradients (before clipping), by parameter name, recorded as the step runs."""
    from torch.distributed.tensor import DTensor

    backend = trainer.backend
    step = backend.clip_and_step
    recorded: list[dict[str, torch.Tensor]] = []

    def recording(**options: float) -> float:
        model = backend.model  # pyright: ignore[reportAttributeAccessIssue]
        grads = {}
        for name, param in model.named_parameters():
            grad = param.grad
            if grad is not None:
                grads[name] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach().clone()
        recorded.append(grads)
        return step(**options)

    backend.clip_and_step = recording  # pyright: ignore[reportAttributeAccessIssue]
    return recorded


def _fsdp2_worker(rank: int, num_ranks: int, port: int, moe_dir: Path, out: Path) -> None:
    import torch.distributed as dist

    from sharpen.trainer.backends.fsdp2 import FSDP2Backend

    join_process_group(rank, num_ranks, port)
    results = {}
    for name, (replay, layout, options) in FSDP2_CASES.items():
        config = _config(replay, **options)
        backend = FSDP2Backend(config, model_path=moe_dir, dtype="float32", layout=layout)
        trainer = Trainer(config, backend=backend, pad_token_id=PAD, max_new_tokens=8)
        gradients = _record_gradients(trainer)
        metrics = trainer.step(TrainBatch(rollouts=_rollouts(with_routes=replay == "r3"), step=0))
        if layout.pp > 1:  # each stage has its layers' gradients
            parts: list = [None] * num_ranks
            dist.all_gather_object(parts, gradients)
            gradients = [_stages_gradients([part[step] for part in parts]) for step in range(len(gradients))]
        results[name] = {"metrics": metrics, "gradients": gradients}
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def _stages_gradients(stages: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The pipeline stages' gradients of one optimizer step as one model's: the tied LM head's (last stage) added to
    the embedding's (first stage), as on one device, where they are one tensor."""
    merged: dict[str, torch.Tensor] = {}
    for grads in stages:
        for name, grad in grads.items():
            name = "model.embed_tokens.weight" if name == "lm_head.weight" else name
            merged[name] = merged[name] + grad if name in merged else grad
    return merged


FSDP2_CASES = {  # name: routing replay, layout, trainer options
    "r3": ("r3", ParallelLayout(dp_shard=2), {}),
    "r2": ("r2", ParallelLayout(dp_shard=2), {}),
    "r3, ep 2": ("r3", ParallelLayout(dp_shard=2, ep=2), {}),
    # context parallelism: each rank routes its slice of every row (the cp ranks share their rows, so the
    # micro-batches, and with them the per-pass balancing loss, are one device's)
    "r3, cp 2": ("r3", ParallelLayout(dp_shard=1, cp=2), {}),
    "r2, cp 2, packed": ("r2", ParallelLayout(dp_shard=1, cp=2), {"packing": True, "micro_batch_tokens": 16}),
    "r3, cp 2, aux loss": (
        "r3",
        ParallelLayout(dp_shard=1, cp=2),
        {"moe": {"routing_replay": "r3", "aux_loss_coef": 0.5}},
    ),
    # pipeline parallelism (1F1B, a layer a stage): each stage replays and captures its layers' routes; the ranks
    # exchange them after the schedule's run
    "r3, pp 2": ("r3", ParallelLayout(pp=2), {}),
    "r2, pp 2": ("r2", ParallelLayout(pp=2), {}),
    "r3, pp 2, packed": ("r3", ParallelLayout(pp=2), {"packing": True, "micro_batch_tokens": 16}),
    # expert parallelism out of the context-parallel ranks: a row's two halves routed on two ranks whose experts
    # serve both
    "r2, cp 2, ep 2": ("r2", ParallelLayout(dp_shard=1, cp=2, ep=2), {}),
}


@pytest.fixture(scope="module")
def fsdp2_results(moe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """R3 and R2 steps on 2 FSDP2 ranks (launched before this module trains on one device: forked ranks)."""
    out = tmp_path_factory.mktemp("fsdp2_moe") / "results.pt"
    launch_ranks(_fsdp2_worker, 2, moe_dir, out)
    return torch.load(out)


@pytest.mark.parametrize("layout", list(FSDP2_CASES))
def test_two_fsdp2_ranks_replay_and_step_as_one_device(fsdp2_results: dict, moe_dir: Path, layout: str):
    """FSDP2 on 2 ranks, with the experts split over them (ep 2), context parallelism (cp 2), both, and a pipeline
    (pp 2)."""
    replay, parallel, options = FSDP2_CASES[layout]
    trainer = _trainer(moe_dir, replay, **options)
    gradients = _record_gradients(trainer)
    metrics = trainer.step(TrainBatch(rollouts=_rollouts(with_routes=replay == "r3"), step=0))
    sharded = fsdp2_results[layout]
    names = [name for name in metrics if name.startswith("moe/")] + ["train/loss", "train/grad_norm"]
    assert "moe/train_disagreement" in names
    if parallel.pp > 1:  # the routers' probabilities stay on their stages: no balancing loss is measured
        names.remove("moe/train_aux_loss")
        assert "moe/train_aux_loss" not in sharded["metrics"]
    for name in names:
        assert sharded["metrics"][name] == pytest.approx(metrics[name], rel=1e-5, abs=1e-6), name
    # the gradients of both optimizer steps (the second after an update moved the routers), every parameter; not
    # the weights: AdamW's first update, about lr * g / |g|, magnifies the rounding of gradients near 0, so the
    # second step's gradients are taken at weights that differ by more than rounding (measured: the first step's
    # within 5e-7, the second's within 3e-6 with cp 2 and the balancing loss, of gradients up to 0.8)
    assert len(gradients) == len(sharded["gradients"]) == 2
    for step, (mine, theirs) in enumerate(zip(gradients, sharded["gradients"], strict=True)):
        assert mine.keys() == theirs.keys()
        for name, gradient in mine.items():
            atol = 1e-6 if step == 0 else 1e-5
            torch.testing.assert_close(theirs[name], gradient, rtol=1e-5, atol=atol, msg=f"step {step}: {name}")


def _record_experts(trainer: Trainer) -> list[list[torch.Tensor]]:
    """Per MoE layer, the expert indices its experts were handed, one [tokens, top_k] tensor per forward."""
    calls: list[list[torch.Tensor]] = [[] for _ in range(LAYERS)]
    experts = [m for m in trainer.backend.model.modules() if type(m).__name__ == "MixtralExperts"]
    assert len(experts) == LAYERS
    for layer, module in enumerate(experts):
        module.register_forward_pre_hook(lambda _, args, layer=layer: calls[layer].append(args[1].clone()))
    return calls


def _rows(call: torch.Tensor, rollouts: list[Rollout]) -> list[torch.Tensor]:
    """A padded forward's [tokens, top_k] indices back on ``rollouts`` (its rows: the rollouts shortest first, as
    the trainer's micro-batches order them; right padding), each [its tokens, top_k], in ``rollouts``' order."""
    width = max(r.num_tokens for r in rollouts)
    grid = call.reshape(len(rollouts), width, TOP_K)
    rows = sorted(range(len(rollouts)), key=lambda index: rollouts[index].num_tokens)
    return [grid[rows.index(index), : r.num_tokens] for index, r in enumerate(rollouts)]


def test_r3_replays_the_engine_routes_in_the_old_policy_and_the_training_passes(moe_dir: Path):
    trainer = _trainer(moe_dir, "r3")
    calls = _record_experts(trainer)
    rollouts = _rollouts(with_routes=True)
    metrics = trainer.step(TrainBatch(rollouts=rollouts, step=0))
    # the passes in order: the measurement with the engine's routes and with the trainer's own, the old-policy
    # pass (all four rollouts), then one training pass per mini-batch of two
    assert [len(layer) for layer in calls] == [5] * LAYERS
    for layer in range(LAYERS):
        replayed_passes = [(calls[layer][0], rollouts), (calls[layer][2], rollouts)]
        replayed_passes += [(calls[layer][3], rollouts[:2]), (calls[layer][4], rollouts[2:])]
        for call, rows in replayed_passes:
            for rollout, received in zip(rows, _rows(call, rows), strict=True):
                assert rollout.routes is not None
                given = routes_tensor(rollout.routes)[:, layer]
                assert torch.equal(received[:-1], given[:-1])  # the last token (unknown) routes itself
        own = _rows(calls[layer][1], rollouts)
        assert any(
            not torch.equal(o[:-1].sort().values, routes_tensor(r.routes)[:-1, layer].sort().values)  # type: ignore[arg-type]
            for o, r in zip(own, rollouts, strict=True)
        )
    # random engine routes disagree with the trainer's on most tokens; every replayed token was counted
    assert 0.5 < metrics["moe/engine_disagreement"] <= 1.0
    assert 0.5 < metrics["moe/train_disagreement"] <= 1.0
    assert set(metrics) >= {"moe/engine_disagreement/layer_000", "moe/engine_disagreement/layer_001"}
    assert metrics["moe/trainer_load_max_over_mean"] >= 1.0


def _forced_routing_logprobs(moe_dir: Path, rollout: Rollout) -> list[float]:
    """The completion logprobs of ``rollout`` with its routes forced by a router written here (Mixtral's: softmax
    over the experts, the chosen experts' probabilities renormalised), independent of `RouterReplay`."""
    from transformers import MixtralForCausalLM

    model = MixtralForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    assert rollout.routes is not None
    given = routes_tensor(rollout.routes)
    for layer, router in enumerate(_routers(model)):

        def forced(hidden, router=router, layer=layer):
            logits = F.linear(hidden.reshape(-1, router.weight.shape[1]), router.weight)
            indices = given[:, layer].clone()
            own = torch.softmax(logits, dim=-1).topk(TOP_K, dim=-1).indices
            indices[-1] = own[-1]
            weights = torch.softmax(logits, dim=-1).gather(1, indices)
            return logits, weights / weights.sum(dim=-1, keepdim=True), indices

        router.forward = forced
    ids = torch.tensor([rollout.prompt_ids + rollout.completion_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
    targets = ids[0, 1:]
    values = logprobs.gather(1, targets[:, None])[:, 0]
    return values[len(rollout.prompt_ids) - 1 :].tolist()


def test_the_logprob_gap_with_the_engine_routes_replayed_is_zero_against_a_hand_written_forced_routing(
    moe_dir: Path,
):
    engine = _rollouts(with_routes=True)
    forced = [_forced_routing_logprobs(moe_dir, r) for r in engine]
    rollouts = _rollouts(with_routes=True, completion_logprobs=forced)
    metrics = _trainer(moe_dir, "none").step(TrainBatch(rollouts=rollouts, step=0))  # measured even without replay
    assert metrics["moe/logprob_gap_replayed"] < 1e-5
    assert metrics["moe/logprob_gap_unreplayed"] > 1e-3  # the trainer's own routes compute other logprobs
    assert "moe/train_disagreement" not in metrics  # nothing replayed in training


def test_r2_replays_the_old_policy_routes_after_an_update_moved_the_routers(moe_dir: Path):
    received = {}
    for replay in ("r2", "none"):
        trainer = _trainer(moe_dir, replay)
        calls = _record_experts(trainer)
        rollouts = _rollouts(with_routes=False)
        metrics = trainer.step(TrainBatch(rollouts=rollouts, step=0))
        assert [len(layer) for layer in calls] == [3] * LAYERS  # the old-policy pass, two training passes
        received[replay] = [
            (_rows(calls[layer][0], rollouts)[2:], _rows(calls[layer][2], rollouts[2:])) for layer in range(LAYERS)
        ]
        if replay == "r2":
            assert metrics["moe/train_disagreement"] > 0  # the moved routers would have chosen otherwise
    for old, trained in received["r2"]:  # the second mini-batch, after one update: the old routes
        assert all(torch.equal(a, b) for a, b in zip(old, trained, strict=True))
    moved = [not torch.equal(a, b) for old, trained in received["none"] for a, b in zip(old, trained, strict=True)]
    assert any(moved)  # the control: without replay, the update moved some routes


def test_packing_replays_the_same_routes_and_gives_the_same_step(moe_dir: Path):
    metrics = {}
    for packing in (False, True):
        trainer = _trainer(moe_dir, "r3", packing=True, micro_batch_tokens=64) if packing else _trainer(moe_dir, "r3")
        metrics[packing] = trainer.step(TrainBatch(rollouts=_rollouts(with_routes=True), step=0))
    for name in ("train/loss", "moe/train_disagreement", "moe/engine_disagreement", "moe/logprob_gap_replayed"):
        assert metrics[True][name] == pytest.approx(metrics[False][name], rel=1e-5, abs=1e-6), name


@pytest.mark.parametrize("replay", ["r3", "r2"])
def test_activation_checkpointing_recomputes_with_the_same_routes(moe_dir: Path, replay: str):
    """The backward recomputes each layer under its forward's routes, computing what the forward's capture computed
    (the routers' probabilities for the balancing loss): the same step with and without checkpointing."""
    runs = []
    for checkpointing in (False, True):
        trainer = _trainer(
            moe_dir, replay, gradient_checkpointing=checkpointing, moe={"routing_replay": replay, "aux_loss_coef": 0.1}
        )
        gradients = _record_gradients(trainer)
        metrics = trainer.step(TrainBatch(rollouts=_rollouts(with_routes=replay == "r3"), step=0))
        runs.append((metrics, gradients))
    (metrics, gradients), (checkpointed, checkpointed_gradients) = runs
    assert metrics["moe/train_disagreement"] > 0  # the replayed routes are not all the routers' own
    for name in [n for n in metrics if n.startswith(("moe/", "train/loss", "train/grad_norm"))]:
        assert checkpointed[name] == pytest.approx(metrics[name], rel=1e-5, abs=1e-7), name
    for mine, theirs in zip(gradients, checkpointed_gradients, strict=True):
        for name, gradient in mine.items():
            torch.testing.assert_close(theirs[name], gradient, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("reference_replays", [True, False])
def test_the_kl_reference_replays_the_routes_the_policy_replays(moe_dir: Path, reference_replays: bool):
    """R3 with a KL term, one mini-batch: before any update the reference is the policy, so with the engine's routes
    replayed in both the KL is 0; a reference that routes itself (the control) sees other experts."""
    from sharpen.trainer.backends import ReferencePolicy

    config = _config("r3", algorithm=AlgorithmConfig.model_validate({"kl": {"type": "loss", "coef": 0.1}}))
    backend = SingleDeviceBackend(config, model_path=moe_dir, dtype="float32")
    reference = ReferencePolicy(
        model_path=moe_dir, dtype="float32", device=backend.device, precision="float32", replay_routes=reference_replays
    )
    trainer = Trainer(config, backend=backend, pad_token_id=PAD, max_new_tokens=8, reference=reference)
    metrics = trainer.step(TrainBatch(rollouts=_rollouts(with_routes=True), step=0))
    if reference_replays:
        assert abs(metrics["train/kl"]) < 1e-7
    else:
        assert metrics["train/kl"] > 1e-6  # measured 1.4e-5: over 100 times the bound above


@pytest.mark.parametrize("reference_replays", [True, False])
def test_the_reward_kl_reference_replays_the_engine_routes(moe_dir: Path, reference_replays: bool):
    """``kl.type = "reward"`` with R3: the penalty compares the engine's logprobs (here computed under its routes by
    the hand-written forced routing) with the reference's, which replays the same routes: 0 before any update; a
    reference that routes itself (the control) measures a KL."""
    from sharpen.trainer.backends import ReferencePolicy

    forced = [_forced_routing_logprobs(moe_dir, r) for r in _rollouts(with_routes=True)]
    rollouts = _rollouts(with_routes=True, completion_logprobs=forced)
    config = _config("r3", algorithm=AlgorithmConfig.model_validate({"kl": {"type": "reward", "coef": 1.0}}))
    backend = SingleDeviceBackend(config, model_path=moe_dir, dtype="float32")
    reference = ReferencePolicy(
        model_path=moe_dir, dtype="float32", device=backend.device, precision="float32", replay_routes=reference_replays
    )
    trainer = Trainer(config, backend=backend, pad_token_id=PAD, max_new_tokens=8, reference=reference)
    penalties = trainer.kl_penalties(rollouts)
    assert [len(p) for p in penalties] == [len(r.completion_ids) for r in rollouts]
    if reference_replays:
        largest = max(abs(value) for row in penalties for value in row)
        assert largest < 1e-7, largest
    else:
        assert trainer.reward_kl > 1e-6  # measured 1.4e-5


def test_bad_routes_are_one_clear_error(moe_dir: Path, model_dir: Path):
    trainer = _trainer(moe_dir, "r3")
    with pytest.raises(ValueError, match='routing_replay = "r3": rollout t/0 came without'):
        trainer.step(TrainBatch(rollouts=_rollouts(with_routes=False), step=0))
    rollouts = _rollouts(with_routes=True)
    rollouts[1].routes = expert_routes(torch.zeros(3, LAYERS, TOP_K, dtype=torch.long), num_experts=EXPERTS)
    with pytest.raises(ValueError, match=r"expert routes of \(3, 2, 2\) .* for 5 tokens"):
        trainer.step(TrainBatch(rollouts=rollouts, step=0))
    with pytest.raises(RoutingError, match="needs a Mixture-of-Experts model"):
        _trainer(model_dir, "r2")


def test_expert_routes_round_trip_compactly_and_continue_by_a_later_call():
    indices = torch.tensor([[[0, 3], [2, 1]], [[UNROUTED] * 2] * 2])  # [tokens, layers, top_k]; token 1 unknown
    compact = expert_routes(indices, num_experts=EXPERTS)
    assert compact.itemsize == 1 and len(compact.data) == indices.numel()
    assert torch.equal(routes_tensor(compact), indices)
    wide = expert_routes(indices + 300 * (indices >= 0), num_experts=512)
    assert wide.itemsize == 2 and torch.equal(routes_tensor(wide), indices + 300 * (indices >= 0))
    # a later call ran both tokens again and a third: the first call's known routes stay, the rest are the later's
    later = expert_routes(torch.tensor([[[3, 2], [0, 1]], [[0, 1], [2, 3]], [[1, 0], [3, 2]]]), num_experts=EXPERTS)
    merged = routes_tensor(compact.extended_by(later))
    assert merged.tolist() == [[[0, 3], [2, 1]], [[0, 1], [2, 3]], [[1, 0], [3, 2]]]
    with pytest.raises(ValueError, match="bytes for"):
        ExpertRoutes(data=b"\x00", num_tokens=1, num_layers=2, top_k=2)
