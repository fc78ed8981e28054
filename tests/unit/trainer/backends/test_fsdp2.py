"""FSDP2 backend on 2 CPU ranks (gloo) against the single-device backend: per-step losses, grad norms and final
weights of 3 optimizer steps (fp32, gradient checkpointing, bf16), full HF-named weights, a bit-exact sharded
save -> load resume, an export that transformers loads, and the collectives a data-parallel trainer needs.

All FSDP2 runs happen in one launch of 2 processes (a module fixture; then one more of 1 rank that resumes the
2-rank checkpoint); the tests compare what rank 0 wrote against single-process runs in this process. The data are
split with `split_rollouts_by_tokens` so that one rank has more micro-batches than the other, and the short rank
runs zero-weighted filler passes: the lockstep scheme the trainer uses with this backend.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from sharpen.config.corrections import TokenTISCorrection
from sharpen.config.policy_losses import PPOClipLoss
from sharpen.config.schema import TrainerConfig
from sharpen.trainer.algorithms.aggregation import aggregate_loss, aggregation_normalizer
from sharpen.trainer.backends import SingleDeviceBackend
from sharpen.trainer.packing import pack_micro_batch, split_micro_batches
from sharpen.trainer.sharding import split_rollouts_by_tokens
from sharpen.types import Example, Message, Rollout
from support.ranks import join_process_group, launch_ranks
from support.tiny_trainer import uneven_rollouts

VOCAB, PAD = 128, 0  # the tiny model of conftest.model_dir
NUM_STEPS, MICRO_BATCH_SIZE, NUM_RANKS = 3, 2, 2
SCENARIOS = {
    "fp32": {"precision": "float32"},
    "checkpointing": {"precision": "float32", "gradient_checkpointing": True},
    "bf16": {"precision": "bf16"},
}

slow = pytest.mark.slow  # the tests on `fsdp2_run`, which forks 2 ranks, then 1: ~10-15 s on 2 shared cores


def _config(**overrides) -> TrainerConfig:
    # a small max_grad_norm so that clipping (by the global norm) is active in every step
    # float32 unless a scenario asks for bf16 ("auto" would depend on the CPU)
    config = {"device": "cpu", "precision": "float32", "learning_rate": 1e-2, "max_grad_norm": 0.05}
    return TrainerConfig(**{**config, **overrides})


def _train(
    backend, rollouts: list[Rollout], *, num_steps: int = NUM_STEPS, rank: int = 0, num_ranks: int = 1
) -> tuple[list[float], list[float]]:
    """Policy-gradient steps (token-mean, global normaliser) on this rank's share; (losses, grad norms)."""
    losses, grad_norms = [], []
    lengths = torch.tensor([r.num_loss_tokens for r in rollouts])
    normalizer = aggregation_normalizer("token_mean", torch.arange(int(lengths.max()))[None, :] < lengths[:, None])
    chunks = split_micro_batches(split_rollouts_by_tokens(rollouts, num_ranks)[rank], MICRO_BATCH_SIZE)
    num_passes = backend.all_reduce_max(len(chunks)) if num_ranks > 1 else len(chunks)
    for _ in range(num_steps):
        loss_sum = 0.0
        for index in range(num_passes):
            is_filler = index >= len(chunks)  # keeps this rank's all-gathers in step with the others
            micro = pack_micro_batch(
                rollouts[:1] if is_filler else chunks[index], pad_token_id=PAD, device=backend.device
            )
            logprobs = backend.token_logprobs(micro.input_ids, micro.attention_mask, micro.loss_mask, temperature=1.0)
            loss = aggregate_loss(-logprobs * micro.advantages, micro.loss_mask, "token_mean", normalizer=normalizer)
            if is_filler:
                loss = loss * 0.0
            loss.backward()
            loss_sum += float(loss.detach())
        losses.append(backend.all_reduce_sum({"loss": loss_sum})["loss"] if num_ranks > 1 else loss_sum)
        grad_norms.append(backend.clip_and_step())
    return losses, grad_norms


def _calls_of(module: torch.nn.Module) -> list[None]:
    """One entry per call of ``module``, recomputations by gradient checkpointing included (a pre-hook: the
    recomputation stops early, once the tensors the backward needs exist, so a forward hook would miss it)."""
    calls: list[None] = []
    module.register_forward_pre_hook(lambda *_: calls.append(None))
    return calls


def _worker(rank: int, num_ranks: int, port: int, model_dir: Path, out_dir: Path, device_type: str) -> None:
    import torch.distributed as dist

    from sharpen.trainer.backends.fsdp2 import FSDP2Backend

    join_process_group(rank, num_ranks, port, backend="gloo" if device_type == "cpu" else "nccl")
    results: dict[str, object] = {}
    rollouts = uneven_rollouts()

    def train(backend: FSDP2Backend, num_steps: int = NUM_STEPS) -> tuple[list[float], list[float]]:
        return _train(backend, rollouts, num_steps=num_steps, rank=rank, num_ranks=num_ranks)

    def backend_for(**overrides) -> FSDP2Backend:
        return FSDP2Backend(_config(device=device_type, **overrides), model_path=model_dir, dtype="float32")

    for name, overrides in SCENARIOS.items():
        backend = backend_for(**overrides)
        mlp_calls = _calls_of(backend.model.get_decoder().layers[0].mlp)
        losses, grad_norms = train(backend)
        weights = {key: value.cpu() for key, value in backend.named_weights()}
        results[name] = {"losses": losses, "grad_norms": grad_norms, "weights": weights, "mlp_calls": len(mlp_calls)}
    # resume: 1 step, save, 2 more steps; a fresh backend loads and takes the same 2 steps
    backend = backend_for()
    train(backend, num_steps=1)
    backend.save(out_dir / "checkpoint")
    results["continued_losses"] = train(backend, num_steps=2)[0]
    with torch.no_grad():  # a forward without backward leaves the root unsharded: named_weights must cope
        backend.token_logprobs(*_probe(backend.device), temperature=1.0)
    results["continued"] = {key: value.cpu() for key, value in backend.named_weights()}
    backend.export(out_dir / "export")
    backend.export(out_dir / "export_sharded", max_shard_bytes=20_000)
    resumed = backend_for()
    resumed.load(out_dir / "checkpoint")
    results["resumed_losses"] = train(resumed, num_steps=2)[0]
    results["resumed"] = {key: value.cpu() for key, value in resumed.named_weights()}
    results["reduced"] = (
        resumed.all_reduce_sum({"a": 1.0, f"only_{rank}": 2.0 + rank}),
        resumed.all_reduce_max(rank * 5),
    )
    if rank == 0:
        torch.save(results, out_dir / "results.pt")
    dist.destroy_process_group()


def _resume_worker(rank: int, num_ranks: int, port: int, model_dir: Path, out_dir: Path, device_type: str) -> None:
    """Load the 2-rank checkpoint on ``num_ranks`` ranks and take the same 2 steps."""
    import torch.distributed as dist

    from sharpen.trainer.backends.fsdp2 import FSDP2Backend

    join_process_group(rank, num_ranks, port, backend="gloo" if device_type == "cpu" else "nccl")
    backend = FSDP2Backend(_config(device=device_type), model_path=model_dir, dtype="float32")
    backend.load(out_dir / "checkpoint")
    _train(backend, uneven_rollouts(), num_steps=2, rank=rank, num_ranks=num_ranks)
    weights = {key: value.cpu() for key, value in backend.named_weights()}
    if rank == 0:
        torch.save(weights, out_dir / f"resumed_on_{num_ranks}.pt")
    dist.destroy_process_group()


def _probe(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.tensor([[3, 14, 15, 92, 65]], device=device)
    return ids, torch.ones_like(ids), torch.ones((1, 4), dtype=torch.bool, device=device)


def _launch(model_dir: Path, out_dir: Path, device_type: str, num_ranks: int, worker=_worker) -> None:
    """Run ``worker`` on ``num_ranks`` processes (`support.ranks.launch_ranks`: forked on the CPU, spawned for CUDA)."""
    launch_ranks(worker, num_ranks, model_dir, out_dir, device_type, device_type=device_type)


@pytest.fixture(scope="module")
def fsdp2_run(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out_dir = tmp_path_factory.mktemp("fsdp2")
    _launch(model_dir, out_dir, "cpu", NUM_RANKS)
    _launch(model_dir, out_dir, "cpu", 1, worker=_resume_worker)
    return torch.load(out_dir / "results.pt"), out_dir


@pytest.fixture(scope="module")
def single_runs(model_dir: Path) -> dict[str, dict]:
    runs = {}
    for name, overrides in SCENARIOS.items():
        backend = SingleDeviceBackend(_config(**overrides), model_path=model_dir, dtype="float32")
        losses, grad_norms = _train(backend, uneven_rollouts())
        runs[name] = {"losses": losses, "grad_norms": grad_norms, "weights": dict(backend.named_weights())}
    return runs


def _max_relative_difference(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    assert got.keys() == expected.keys()
    return max(((got[k] - expected[k]).norm() / expected[k].norm()).item() for k in expected)


def _assert_close(values: list[float], expected: list[float], rtol: float) -> None:
    assert values == pytest.approx(expected, rel=rtol), (values, expected)


FLOAT32_UNIT_ROUNDOFF = 2.0**-24


def _loss_tolerance(*, num_tokens: int, max_term: float, num_updates: int) -> float:
    """Absolute tolerance between two float32 runs of a token-mean loss that differ only in summation order (micro-
    batches split across ranks, gradients reduced in another order), measured after ``num_updates`` optimizer steps.

    The loss sums ``num_tokens`` terms of size at most ``max_term`` / num_tokens and cancels heavily (advantages of
    both signs: here ~0.007 out of terms of size ~1), so a relative tolerance on it measures the cancellation, not
    the arithmetic: on another CPU's kernels a 1e-5 relative test failed at 3.8e-5. Rounding errors of random sign
    grow like sqrt(n) u max_term in a sum of n terms (u = 2^-24); each optimizer step adds that much again to how
    far the two runs' weights, and with them the losses, have drifted apart, so the bound grows linearly in the
    steps taken. A factor of 4 covers the tail. Measured: differences of 1e-7 to 2.5e-7 (two CPUs) against
    bounds from 1.6e-5 (first step) up; a lost or double-counted token moves the loss by ~1e-2."""
    return 4 * num_tokens**0.5 * FLOAT32_UNIT_ROUNDOFF * max_term * num_updates


def _max_loss_term(rollouts: list[Rollout], *, weight_bound: float) -> float:
    """Bound on |A_t * weight_t| for the policy-gradient losses here: |logprob| < 2 log VOCAB for a near-uniform
    random model (``weight_bound`` = 2 log VOCAB), or ratio * off-policy weight for the trainer's PPO loss."""
    return max(abs(r.advantage or 0.0) for r in rollouts) * weight_bound


def test_init_distributed_needs_the_launcher_variables(monkeypatch):
    from sharpen.trainer.backends.mesh import init_distributed

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"):
        init_distributed()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(ValueError, match="'gloo'"):
        init_distributed("mpi")


def test_the_backend_needs_a_process_group(model_dir):
    from sharpen.trainer.backends.fsdp2 import FSDP2Backend

    with pytest.raises(ValueError, match="init_distributed"):
        FSDP2Backend(_config(), model_path=model_dir, dtype="float32")


def test_split_leaves_one_rank_with_fewer_micro_batches():
    shares = split_rollouts_by_tokens(uneven_rollouts(), NUM_RANKS)
    counts = sorted(len(split_micro_batches(share, MICRO_BATCH_SIZE)) for share in shares)
    assert counts == [1, 3]  # so the filler passes of the lockstep scheme really run


@slow
@pytest.mark.parametrize("scenario", ["fp32", "checkpointing"])
def test_fp32_steps_match_the_single_device_backend(fsdp2_run, single_runs, scenario):
    """Measured: losses and grad norms agree to 1.3e-7 relative; the final weights to 4.7e-6 (the largest over
    tensors of |difference| / |weight|; AdamW at lr 1e-2 magnifies float32 summation-order noise in small
    gradients). The losses cancel, so they are compared to an absolute bound of float32 rounding (`_loss_tolerance`)."""
    got, expected = fsdp2_run[0][scenario], single_runs[scenario]
    rollouts = uneven_rollouts()
    num_tokens = sum(r.num_loss_tokens for r in rollouts)
    max_term = _max_loss_term(rollouts, weight_bound=2 * math.log(VOCAB))
    for step, (loss, expected_loss) in enumerate(zip(got["losses"], expected["losses"], strict=True)):
        # the loss of step k is measured after k updates, from rounding of its own sums too: k + 1
        tolerance = _loss_tolerance(num_tokens=num_tokens, max_term=max_term, num_updates=step + 1)
        assert loss == pytest.approx(expected_loss, rel=0, abs=tolerance), (step, got["losses"], expected["losses"])
    _assert_close(got["grad_norms"], expected["grad_norms"], rtol=1e-5)  # a norm does not cancel: relative holds
    assert expected["grad_norms"][0] > _config().max_grad_norm  # clipping is active, by the global norm
    assert len(set(expected["losses"])) == NUM_STEPS  # the steps changed the weights
    assert _max_relative_difference(got["weights"], expected["weights"]) < 5e-5
    num_passes = NUM_STEPS * 3  # 3 micro-batches on the busier rank, so 3 passes on each
    assert got["mlp_calls"] == num_passes * (2 if scenario == "checkpointing" else 1)


@slow
def test_bf16_steps_stay_near_the_single_device_autocast_run(fsdp2_run, single_runs):
    """bf16 parameters (FSDP2) and bf16 autocast over fp32 weights (single device) round differently, and AdamW
    turns rounding noise in tiny gradients into full-size updates. Measured: losses agree to 7e-4 relative; the final
    weights differ by 0.067 (relative), the single-device bf16 run from its own fp32 run by about the same."""
    got, expected = fsdp2_run[0]["bf16"], single_runs["bf16"]
    _assert_close(got["losses"], expected["losses"], rtol=5e-3)
    assert all(tensor.dtype == torch.float32 for tensor in got["weights"].values())  # master weights stay fp32
    bf16_noise = _max_relative_difference(expected["weights"], single_runs["fp32"]["weights"])
    assert _max_relative_difference(got["weights"], expected["weights"]) < 2 * bf16_noise


@slow
def test_named_weights_are_full_tensors_with_hf_names(fsdp2_run, single_runs):
    got, expected = fsdp2_run[0]["fp32"]["weights"], single_runs["fp32"]["weights"]
    assert list(got) == list(expected)  # same names, same order; the tied lm_head.weight left out
    assert all(got[name].shape == expected[name].shape for name in expected)


@slow
def test_sharded_checkpoint_resumes_bit_exactly(fsdp2_run):
    results = fsdp2_run[0]
    assert results["resumed_losses"] == results["continued_losses"]
    continued, resumed = results["continued"], results["resumed"]
    assert continued.keys() == resumed.keys()
    for name in continued:
        assert torch.equal(continued[name], resumed[name]), name


@slow
def test_a_2_rank_checkpoint_resumes_on_1_rank(fsdp2_run):
    """DCP reshards on load; 1 rank sums the gradient in another order than 2, so equal to float32 noise."""
    results, out_dir = fsdp2_run
    resumed = torch.load(out_dir / "resumed_on_1.pt")
    assert _max_relative_difference(resumed, results["continued"]) < 5e-5


@slow
@pytest.mark.parametrize("folder", ["export", "export_sharded"])
def test_export_loads_in_transformers(fsdp2_run, folder):
    from transformers import AutoModelForCausalLM

    results, out_dir = fsdp2_run
    if folder == "export_sharded":
        assert (out_dir / folder / "model.safetensors.index.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(out_dir / folder, dtype=torch.float32)
    state = model.state_dict()
    for name, tensor in results["continued"].items():
        assert torch.equal(state[name], tensor), name
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)  # the tie is rebuilt


@slow
def test_all_reduce_helpers_sum_names_and_take_the_max(fsdp2_run):
    summed, largest = fsdp2_run[0]["reduced"]
    assert summed == {"a": 2.0, "only_0": 2.0, "only_1": 3.0}
    assert largest == 5


@slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_nccl_fp32_steps_match_the_single_device_backend(model_dir, tmp_path):
    """One rank per GPU (NCCL refuses two ranks on one GPU), so on a 1-GPU machine this is a world of 1."""
    num_ranks = min(torch.cuda.device_count(), NUM_RANKS)
    _launch(model_dir, tmp_path, "cuda", num_ranks)
    results = torch.load(tmp_path / "results.pt")
    backend = SingleDeviceBackend(_config(device="cuda"), model_path=model_dir, dtype="float32")
    losses, _ = _train(backend, uneven_rollouts())
    _assert_close(results["fp32"]["losses"], losses, rtol=1e-4)
    expected = {name: tensor.cpu() for name, tensor in backend.named_weights()}
    assert _max_relative_difference(results["fp32"]["weights"], expected) < 1e-4
    for name, tensor in results["continued"].items():
        assert torch.equal(tensor, results["resumed"][name]), name


def _trainer_config() -> TrainerConfig:
    algorithm = {"num_mini_batches": 2, "num_epochs": 2, "entropy_coef": 0.01}
    return _config(micro_batch_size=MICRO_BATCH_SIZE, algorithm=algorithm)


def _trainer_steps(backend) -> tuple[list[dict[str, float]], dict[str, torch.Tensor]]:
    from sharpen.trainer import Trainer
    from sharpen.types import TrainBatch

    trainer = Trainer(_trainer_config(), backend=backend, pad_token_id=PAD, max_new_tokens=12)
    metrics = [trainer.step(TrainBatch(rollouts=uneven_rollouts()[: 7 - step], step=step)) for step in range(NUM_STEPS)]
    return metrics, {name: tensor.detach().cpu().clone() for name, tensor in backend.named_weights()}


def _trainer_worker(rank: int, num_ranks: int, port: int, model_dir: Path, out_dir: Path, device_type: str) -> None:
    import torch.distributed as dist

    from sharpen.trainer.backends.fsdp2 import FSDP2Backend

    join_process_group(rank, num_ranks, port, backend="gloo" if device_type == "cpu" else "nccl")
    result = _trainer_steps(FSDP2Backend(_trainer_config(), model_path=model_dir, dtype="float32"))
    if rank == 0:
        torch.save(result, out_dir / "trainer.pt")
    dist.destroy_process_group()


@slow
def test_the_trainer_on_2_fsdp2_ranks_matches_one_device(model_dir, tmp_path):
    """The real `Trainer` (2 mini-batches x 2 epochs, entropy bonus, clipping) drives both backends; every rank gets
    the whole batch and trains on its token-balanced share in lockstep."""
    _launch(model_dir, tmp_path, "cpu", NUM_RANKS, worker=_trainer_worker)
    got_metrics, got_weights = torch.load(tmp_path / "trainer.pt")
    metrics, weights = _trainer_steps(SingleDeviceBackend(_trainer_config(), model_path=model_dir, dtype="float32"))
    # the ratio quantiles and the effective sample size are per micro-batch statistics: they change with the split
    per_micro_batch = ("offpolicy/ess", "offpolicy/ratio_p")
    config = _trainer_config().algorithm
    # |A| * ratio * off-policy weight (ratio clipped at 1 + eps_high where it counts) plus the entropy bonus
    assert isinstance(config.policy_loss, PPOClipLoss) and isinstance(config.off_policy_correction, TokenTISCorrection)
    weight_bound = (1 + config.policy_loss.clip_eps_high) * config.off_policy_correction.cap
    max_term = _max_loss_term(uneven_rollouts(), weight_bound=weight_bound) + config.entropy_coef * math.log(VOCAB)
    updates_per_step = config.num_epochs * config.num_mini_batches
    for step, (got, expected) in enumerate(zip(got_metrics, metrics, strict=True)):
        assert set(got) == set(expected)
        for name, value in expected.items():
            if name == "train/loss":  # cancels: an absolute bound of float32 rounding over the updates so far
                num_tokens = int(expected["train/num_loss_tokens"])
                num_updates = updates_per_step * (step + 1)
                tolerance = _loss_tolerance(num_tokens=num_tokens, max_term=max_term, num_updates=num_updates)
                assert got[name] == pytest.approx(value, rel=0, abs=tolerance), (step, got[name], value)
            elif not name.startswith(per_micro_batch):
                assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
    assert _max_relative_difference(got_weights, weights) < 5e-5  # measured ~5e-6 (fp32, 2 ranks)


# A vision-language model on 2 ranks: rank 0's rows hold images, rank 1's are text and fewer (a filler pass), so the
# vision tower runs on one rank only and the ranks must still reduce the same gradients.
VLM_STEPS = 2


def _vlm_shares(model_dir: Path) -> list[list[Rollout]]:
    """Rank 0: two image rollouts; rank 1: one text rollout (the tiny Qwen2-VL's tokens)."""
    from sharpen.data.vision import VisionProcessor
    from support.images import image_prompt, png_image

    vision = VisionProcessor.from_pretrained(model_dir)
    rng = random.Random(1)

    def rollout(prompt: tuple[Message, ...], images: tuple) -> Rollout:
        completion = [rng.randrange(100, 40000) for _ in range(4)]
        return Rollout(
            example=Example(task_key="v/0", prompt=prompt),
            prompt_ids=vision.render_prompt(prompt),
            completion_ids=completion,
            completion_logprobs=[-4.0] * len(completion),
            versions=[0] * len(completion),
            images=images,
            advantage=rng.uniform(-1.5, 1.5),
        )

    images = [png_image((200, 30, 30)), png_image((30, 30, 200), stripe=True)]
    with_images = [rollout(image_prompt(image), (image,)) for image in images]
    return [with_images, [rollout((Message(role="user", content="No image."),), ())]]


def _train_vlm(backend, shares: list[list[Rollout]], *, ranks: list[int], num_ranks: int) -> list[float]:
    """Token-mean policy-gradient steps over the micro-batches of ``ranks``' shares (one device: all of them)."""
    everything = [r for share in shares for r in share]
    lengths = torch.tensor([r.num_loss_tokens for r in everything])
    normalizer = aggregation_normalizer("token_mean", torch.arange(int(lengths.max()))[None, :] < lengths[:, None])
    chunks = [chunk for rank in ranks for chunk in split_micro_batches(shares[rank], 1)]
    num_passes = backend.all_reduce_max(len(chunks)) if num_ranks > 1 else len(chunks)
    grad_norms = []
    for _ in range(VLM_STEPS):
        for index in range(num_passes):
            is_filler = index >= len(chunks)
            micro = pack_micro_batch(
                shares[ranks[0]][:1] if is_filler else chunks[index], pad_token_id=PAD, device=backend.device
            )
            scores = backend.score_tokens(
                micro.input_ids, micro.attention_mask, micro.loss_mask, temperature=1.0, images=micro.images
            )
            loss = aggregate_loss(
                -scores.logprobs * micro.advantages, micro.loss_mask, "token_mean", normalizer=normalizer
            )
            (loss * 0.0 if is_filler else loss).backward()
        grad_norms.append(backend.clip_and_step())
    return grad_norms


def _vlm_worker(rank: int, num_ranks: int, port: int, model_dir: Path, out_dir: Path, device_type: str) -> None:
    import torch.distributed as dist

    from sharpen.trainer.backends.fsdp2 import FSDP2Backend

    join_process_group(rank, num_ranks, port, backend="gloo" if device_type == "cpu" else "nccl")
    backend = FSDP2Backend(_config(device=device_type), model_path=model_dir, dtype="float32")
    grad_norms = _train_vlm(backend, _vlm_shares(model_dir), ranks=[rank], num_ranks=num_ranks)
    weights = {key: value.cpu() for key, value in backend.named_weights()}
    backend.export(out_dir / "export")
    if rank == 0:
        torch.save({"grad_norms": grad_norms, "weights": weights}, out_dir / "vlm.pt")
    dist.destroy_process_group()


@slow
def test_a_vision_model_trains_on_2_ranks_like_on_one_device(tiny_vlm_path: Path, tmp_path: Path) -> None:
    """Measured: grad norms agree to float32 rounding and the final weights to ~1e-6 relative; without the zero
    gradient the image-free rank gives its vision tower, the ranks' reductions would not match."""
    from sharpen.data.vision import VisionProcessor

    _launch(tiny_vlm_path, tmp_path, "cpu", NUM_RANKS, worker=_vlm_worker)
    got = torch.load(tmp_path / "vlm.pt")
    single = SingleDeviceBackend(_config(), model_path=tiny_vlm_path, dtype="float32")
    shares = _vlm_shares(tiny_vlm_path)
    expected_norms = _train_vlm(single, shares, ranks=[0, 1], num_ranks=1)
    _assert_close(got["grad_norms"], expected_norms, rtol=1e-5)
    expected = dict(single.named_weights())
    assert _max_relative_difference(got["weights"], expected) < 5e-5
    before = SingleDeviceBackend(_config(), model_path=tiny_vlm_path, dtype="float32")
    moved = {k for k, v in before.named_weights() if not torch.equal(v, got["weights"][k])}
    assert any(k.startswith("model.visual.") for k in moved)  # the image rows' loss reached the vision tower
    assert VisionProcessor.from_pretrained(tmp_path / "export").image_token_id > 0  # a VLM folder again
