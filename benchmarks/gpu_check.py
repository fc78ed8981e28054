"""What a lent CUDA machine can prove about sharpen, one part at a time (`benchmarks/gpu_check.sh` runs them all).

Run: python benchmarks/gpu_check.py PART --out DIR [--device cuda]
Parts (each writes ``DIR/PART.json``: ``ok``, what was compared, the numbers, and on failure why; exit 1 when a check
fails):

- ``device``: torch, CUDA and the device's name and memory.
- ``trainer_step``: two trainer steps of a tiny Llama built from a config (no download) on the device in float32 and
  in bf16 against the CPU's float32 result: losses, gradient norms and the weights after the steps.
- ``hf_engine``: the ``hf`` engine on the device: its sampled tokens' logprobs and its probe scores against the
  trainer's on the device (float32), and the same seeded completions twice.
- ``weight_sync``: the trainer's weights (on the device) through a shared-memory bucket (`SharedMemorySlot`) back
  bit for bit, and a verified `WeightSync` into the ``hf`` engine on the device after a training step (the probe check
  passes, and the engine's scores change).
- ``flops``: the achieved FLOP/s of a training step of a ~0.5B-parameter Llama in bf16 (model FLOPs: 6 x the weights
  x the tokens, plus attention's, and 2 x for the old-logprob pass when the objective needs one) against the card's
  dense bf16 peak where the card is known.

``--device cpu`` runs every part on the CPU (the comparisons then compare the CPU with itself): how the script is
tested where no GPU is.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

VOCAB, PAD, EOS = 128, 0, 1
PEAK_BF16_FLOPS = {"H100": 989.4e12, "H200": 989.4e12, "H20": 148e12, "A100": 312e12, "L40S": 362.05e12}
"""Dense bf16 tensor-core peaks (the vendors' data sheets, without sparsity) by a part of the device's name."""


def _tiny_model(folder: Path, *, hidden_size: int = 64, layers: int = 2, vocab: int = VOCAB) -> Path:
    """A random Llama and a word-level tokenizer of ``vocab`` tokens, saved to ``folder`` (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=(heads := max(4, hidden_size // 128)),
        num_key_value_heads=heads // 2,
        intermediate_size=2 * hidden_size,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=PAD,
        eos_token_id=EOS,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    words = {"<pad>": PAD, "</s>": EOS, **{f"w{i}": i for i in range(2, vocab)}}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>").save_pretrained(folder)
    return folder


def _rollouts(seed: int, num: int = 6) -> list[Any]:
    from sharpen.types import Example, Message, Rollout

    rng = random.Random(seed)
    example = Example(task_key="t/0", prompt=(Message(role="user", content="q"),), answer="a")
    out = []
    for index in range(num):
        prompt = [rng.randrange(2, VOCAB) for _ in range(rng.randint(3, 9))]
        completion = [rng.randrange(2, VOCAB) for _ in range(rng.randint(2, 8))]
        logprobs = [math.log(1 / VOCAB) + rng.uniform(-0.4, 0.4) for _ in completion]
        out.append(
            Rollout(
                example=example,
                prompt_ids=prompt,
                completion_ids=completion,
                completion_logprobs=logprobs,
                versions=[0] * len(completion),
                sample_index=index,
                advantage=rng.uniform(-1.5, 1.5),
            )
        )
    return out


def _trainer(model: Path, *, device: str, precision: str, **overrides: Any) -> Any:
    from sharpen.config.schema import TrainerConfig
    from sharpen.trainer import SingleDeviceBackend, Trainer

    fields = {"device": device, "precision": precision, "learning_rate": 1e-2, "micro_batch_size": 4, **overrides}
    config = TrainerConfig(**fields)  # type: ignore[arg-type]
    backend = SingleDeviceBackend(config, model_path=model, dtype="float32")
    return Trainer(config, backend=backend, pad_token_id=PAD)


def _steps(trainer: Any, num_steps: int = 2) -> dict[str, Any]:
    from sharpen.types import TrainBatch

    metrics = [trainer.step(TrainBatch(rollouts=_rollouts(step), step=step)) for step in range(num_steps)]
    weights = {name: tensor.detach().float().cpu() for name, tensor in trainer.named_weights()}
    return {"metrics": metrics, "weights": weights}


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _max_weight_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[name] - b[name]).abs().max() / b[name].abs().max().clamp_min(1e-12)) for name in b)


def part_device(device: str, work: Path) -> dict[str, Any]:
    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": device}
    if device == "cuda":
        properties = torch.cuda.get_device_properties(0)
        info |= {"name": properties.name, "memory_gib": properties.total_memory / 2**30}
        info["count"] = torch.cuda.device_count()
        info["ok"] = torch.cuda.is_available()
    else:
        info["ok"] = True
    return info


def _update_cosine(run: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], start: dict[str, torch.Tensor]):
    """Cosine similarity of the two runs' whole updates (weights after minus before, all tensors as one vector)."""
    a = torch.cat([(run[name] - start[name]).flatten() for name in start])
    b = torch.cat([(reference[name] - start[name]).flatten() for name in start])
    return float(a @ b / (a.norm() * b.norm()).clamp_min(1e-30))


def part_trainer_step(device: str, work: Path) -> dict[str, Any]:
    """float32 on the device must give the CPU's steps to 1e-4 (weights element by element); bf16 autocast rounds
    the gradient, so AdamW's sign-like first steps flip on its smallest elements: its losses and norms within 5e-2
    and its whole update pointing the CPU's way (cosine > 0.9)."""
    model = _tiny_model(work / "tiny")
    cpu = _trainer(model, device="cpu", precision="float32")
    start = {name: tensor.detach().float().cpu().clone() for name, tensor in cpu.named_weights()}
    reference = _steps(cpu)
    out: dict[str, Any] = {"ok": True}
    for precision, tolerance in (("float32", 1e-4), ("bf16", 5e-2)):
        run = _steps(_trainer(model, device=device, precision=precision))
        pairs = list(zip(run["metrics"], reference["metrics"], strict=True))
        losses = [_relative(m["train/loss"], r["train/loss"]) for m, r in pairs]
        norms = [_relative(m["train/grad_norm"], r["train/grad_norm"]) for m, r in pairs]
        weights = _max_weight_difference(run["weights"], reference["weights"])
        cosine = _update_cosine(run["weights"], reference["weights"], start)
        is_close = weights < tolerance if precision == "float32" else cosine > 0.9
        is_ok = max(losses) < tolerance and max(norms) < tolerance and is_close
        out[precision] = {"loss_rel": losses, "grad_norm_rel": norms, "weights_max_rel": weights}
        out[precision] |= {"update_cosine": cosine, "tolerance": tolerance, "ok": is_ok}
        out["ok"] = out["ok"] and is_ok
    return out


def part_hf_engine(device: str, work: Path) -> dict[str, Any]:
    from sharpen.rollout.engines.hf import HfEngine
    from sharpen.types import SamplingParams

    model = _tiny_model(work / "tiny")
    trainer = _trainer(model, device=device, precision="float32")
    engine = HfEngine(model, dtype="float32", device=device)
    prompts = [[random.Random(i).randrange(2, VOCAB) for _ in range(5 + i)] for i in range(4)]
    params = [SamplingParams(max_new_tokens=8, temperature=1.0, seed=i) for i in range(4)]
    first, second = engine.generate(prompts, params), engine.generate(prompts, params)
    differences = []
    for prompt, completion in zip(prompts, first, strict=True):
        ids = prompt + completion.token_ids
        trained = trainer.compute_logprobs(ids)[len(prompt) - 1 :]
        differences += [abs(a - b) for a, b in zip(completion.logprobs, trained, strict=True)]
    probe = prompts[0] + first[0].token_ids
    scores = zip(engine.score(probe), trainer.compute_logprobs(probe), strict=True)
    probe_difference = max(abs(a - b) for a, b in scores)
    is_seeded = [c.token_ids for c in first] == [c.token_ids for c in second]
    out = {"sampled_logprob_max_abs": max(differences), "probe_max_abs": probe_difference, "seeded": is_seeded}
    return out | {"ok": max(differences) < 1e-4 and probe_difference < 1e-4 and is_seeded}


def part_weight_sync(device: str, work: Path) -> dict[str, Any]:
    from sharpen.orchestration.weight_sync import WeightSync
    from sharpen.rollout.engines.hf import HfEngine
    from sharpen.rollout.weight_sync.buckets import SharedMemorySlot, read_bucket
    from sharpen.types import TrainBatch

    model = _tiny_model(work / "tiny")
    trainer = _trainer(model, device=device, precision="float32")
    weights = list(trainer.named_weights())
    slot = SharedMemorySlot(1)
    try:
        manifest = slot.fill(weights, sync_id="gpu-check", version=0, index=0)
        arrived = dict(read_bucket(manifest))
        is_exact = all(torch.equal(arrived[name], tensor.detach().cpu()) for name, tensor in weights)
    finally:
        slot.close()
    engine = HfEngine(model, dtype="float32", device=device)
    probe = [2 + (7 * i) % (VOCAB - 2) for i in range(24)]
    before = engine.score(probe)
    trainer.step(TrainBatch(rollouts=_rollouts(0), step=0))
    sync = WeightSync(probe_ids=probe, tolerance=1e-4, verify=True)
    metrics = sync(trainer, engine, version=1)
    after = engine.score(probe)
    moved = max(abs(a - b) for a, b in zip(before, after, strict=True))
    mismatch = metrics.get("sync/probe_mismatch_mean", math.nan)
    return {"bucket_exact": is_exact, "probe_mismatch_mean": mismatch, "engine_moved_max_abs": moved} | {
        "ok": is_exact and mismatch < 1e-4 and moved > 1e-3
    }


def part_flops(device: str, work: Path) -> dict[str, Any]:
    from sharpen.types import Example, Message, Rollout, TrainBatch

    large = device == "cuda"
    hidden, layers, vocab, length = (2048, 8, 32000, 1024) if large else (64, 2, VOCAB, 64)
    model = _tiny_model(work / "flops", hidden_size=hidden, layers=layers, vocab=vocab)
    trainer = _trainer(model, device=device, precision="bf16" if large else "float32", micro_batch_size=8)
    rng = random.Random(0)
    example = Example(task_key="t/0", prompt=(Message(role="user", content="q"),), answer="a")
    rollouts = [
        Rollout(
            example=example,
            prompt_ids=[rng.randrange(2, vocab) for _ in range(length // 4)],
            completion_ids=(completion := [rng.randrange(2, vocab) for _ in range(length - length // 4)]),
            completion_logprobs=[-math.log(vocab)] * len(completion),
            versions=[0] * len(completion),
            sample_index=i,
            advantage=rng.uniform(-1, 1),
        )
        for i in range(8)
    ]
    times = []
    for step in range(4):
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        trainer.step(TrainBatch(rollouts=rollouts, step=step))
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    parameters = sum(t.numel() for _, t in trainer.named_weights())
    non_embedding = parameters - vocab * hidden  # tied embeddings: the head's matmul counts, the lookup does not
    tokens = len(rollouts) * length
    attention = 12 * layers * hidden * length * tokens  # QK^T and AV, forward and backward (x6 / 2 per token pair)
    passes = 3 + (1 if trainer.objective.needs_old_logprobs else 0)  # forward + backward (2x), old-logprob forward
    flops = passes * 2 * (non_embedding + vocab * hidden) * tokens + attention * passes / 3
    seconds = sorted(times[1:])[len(times[1:]) // 2]  # the median after the first (warm-up) step
    achieved = flops / seconds
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    peak = next((value for key, value in PEAK_BF16_FLOPS.items() if key in name), None)
    out = {"device_name": name, "parameters": parameters, "tokens_per_step": tokens, "step_seconds": times}
    out |= {"model_flops_per_step": flops, "achieved_flops": achieved, "peak_bf16_flops": peak}
    out["mfu"] = None if peak is None else achieved / peak
    return out | {"ok": math.isfinite(achieved) and achieved > 0}


PARTS: dict[str, Callable[[str, Path], dict[str, Any]]] = {
    "device": part_device,
    "trainer_step": part_trainer_step,
    "hf_engine": part_hf_engine,
    "weight_sync": part_weight_sync,
    "flops": part_flops,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("part", choices=sorted(PARTS))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        try:
            result = PARTS[args.part](args.device, Path(work))
        except Exception as error:  # the part's failure is its result: written, and the next part still runs
            result = {"ok": False, "error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
    result = {"part": args.part, "device": args.device, "seconds": time.perf_counter() - started, **result}
    (args.out / f"{args.part}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "traceback"}, default=str))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
