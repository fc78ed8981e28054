"""Engine/trainer mismatch by precision on the demo's model and first prompts (docs/algorithms.md, Precision).

For each row (a ``trainer.precision`` and ``trainer.lm_head_float32``): the hf engine in that precision's engine
dtype (`ModelConfig.engine_dtype`) generates the demo's first prompts twice, greedily and sampled at temperature 1
(seed i for prompt i); the trainer's own backend (`SingleDeviceBackend`, float32 master weights, that precision)
scores the same tokens. d = trainer logprob - engine logprob per completion token.

- ``step0``: the sampled completions scored under the trainer's autocast: what ``offpolicy/kl_k3`` compares at the
  first step (k3 = mean of exp(d) - 1 - d, and mean/max |d|).
- ``parity``: the greedy completions scored without autocast, as the parity probe does (`parity_metrics`).

    .venv/bin/python benchmarks/precision_mismatch.py                      # the five rows of the docs' table
    .venv/bin/python benchmarks/precision_mismatch.py --rows float32,fp16 --prompts 1 --tokens 8

The rows run one after another in this process; on a CPU without native bf16/fp16 arithmetic those two are
emulated and slow (minutes per row). The table in the docs came from a run of this measurement.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
from transformers import AutoTokenizer

from sharpen.config import load_config
from sharpen.config.models import resolve_model_path
from sharpen.config.schema import TrainerConfig
from sharpen.data.sources import load_examples
from sharpen.monitoring.parity import parity_metrics
from sharpen.rollout.engines.hf import HfEngine
from sharpen.trainer import SingleDeviceBackend
from sharpen.types import SamplingParams

ROWS = {
    "float32": ("float32", False),
    "bf16": ("bf16", False),
    "bf16-head32": ("bf16", True),
    "fp16": ("fp16", False),
    "fp16-head32": ("fp16", True),
}


def measure(name: str, *, prompts: list[list[int]], tokens: int, model_path: Any, config: Any) -> dict[str, Any]:
    precision, head32 = ROWS[name]
    started = time.time()
    engine = HfEngine(model_path, dtype=config.model.engine_dtype(precision), lm_head_float32=head32)
    greedy = engine.generate(prompts, [SamplingParams(max_new_tokens=tokens, temperature=0.0)] * len(prompts))
    sampled = engine.generate(
        prompts, [SamplingParams(max_new_tokens=tokens, temperature=1.0, seed=i) for i in range(len(prompts))]
    )
    del engine
    backend = SingleDeviceBackend(
        TrainerConfig(device="cpu", precision=precision, lm_head_float32=head32, num_threads=torch.get_num_threads()),
        model_path=model_path,
        dtype="float32",
    )

    def differences(completions: list[Any], *, use_autocast: bool) -> list[float]:
        out: list[float] = []
        for prompt, completion in zip(prompts, completions, strict=True):
            ids = torch.tensor([list(prompt) + completion.token_ids])
            target = torch.zeros(1, ids.shape[1] - 1, dtype=torch.bool)
            target[0, len(prompt) - 1 :] = True
            with torch.no_grad():
                logprobs = backend.token_logprobs(
                    ids, torch.ones_like(ids), target, temperature=1.0, use_autocast=use_autocast
                )
            trainer = logprobs[0][target[0]].tolist()
            out += [t - e for t, e in zip(trainer, completion.logprobs, strict=True)]
        return out

    parity = parity_metrics(differences(greedy, use_autocast=False))
    step0 = parity_metrics(differences(sampled, use_autocast=True))
    return {
        "row": name,
        "engine_dtype": config.model.engine_dtype(precision),
        "step0_k3": step0["parity/k3"],
        "step0_mean_abs": step0["parity/mean_abs_diff"],
        "step0_max_abs": step0["parity/max_abs_diff"],
        "step0_tokens": step0["parity/num_tokens"],
        "parity_k3": parity["parity/k3"],
        "parity_mean_abs": parity["parity/mean_abs_diff"],
        "parity_max_abs": parity["parity/max_abs_diff"],
        "parity_tokens": parity["parity/num_tokens"],
        "seconds": time.time() - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    parser.add_argument("--recipe", default="recipes/demo.toml")
    parser.add_argument("--prompts", type=int, default=4, help="the recipe's first N prompts")
    parser.add_argument("--tokens", type=int, default=32, help="completion tokens per prompt")
    args = parser.parse_args()
    names = args.rows.split(",")
    unknown = [name for name in names if name not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}: choose from {', '.join(ROWS)}")
    config = load_config(args.recipe)
    model_path = resolve_model_path(config.model.path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    examples = load_examples(config.data, seed=0)[: args.prompts]
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in example.prompt],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for example in examples
    ]
    results = []
    for name in names:
        result = measure(name, prompts=prompts, tokens=args.tokens, model_path=model_path, config=config)
        print(json.dumps(result), flush=True)
        results.append(result)
    print("| row | engine dtype | step-0 k3 | step-0 mean / max abs d | parity k3 | parity mean / max abs d | s |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['row']} | {r['engine_dtype']} | {r['step0_k3']:.2g} | {r['step0_mean_abs']:.2g} / "
            f"{r['step0_max_abs']:.2g} | {r['parity_k3']:.2g} | {r['parity_mean_abs']:.2g} / "
            f"{r['parity_max_abs']:.2g} | {r['seconds']:.0f} |"
        )


if __name__ == "__main__":
    main()
