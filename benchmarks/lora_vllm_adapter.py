"""Does the installed vLLM CPU build serve a peft LoRA adapter, and replace it in place? (The check behind
docs/weight-sync.md, LoRA; `trainer.lora.sync = "adapter"` is not wired yet.)

Run: .venv/bin/python benchmarks/lora_vllm_adapter.py [--folder /tmp/sharpen-lora-check]
SmolLM2-135M, float32: a random rank-8 adapter (B nonzero) is saved as a peft folder; vLLM (enable_lora) scores a
probe with it, then with a second adapter under the same id and ``load_inplace=True``. Printed: vLLM's start-up
time, the probe mismatch against peft's own forward (base, adapter 1, adapter 2 and adapter 2 against adapter 1's
logprobs, which must differ), and each adapter's load + score time.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", type=Path, default=Path("/tmp/sharpen-lora-check"))
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from sharpen.config.models import resolve_model_path

    path = resolve_model_path("smollm2-135m-instruct")
    torch.manual_seed(0)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        LoraConfig(r=8, lora_alpha=16, target_modules=targets, task_type="CAUSAL_LM"),
    )
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param.data, std=0.02)
    ids = list(range(100, 140))
    tensor = torch.tensor([ids])

    @torch.no_grad()
    def peft_logprobs() -> torch.Tensor:
        logits = model(input_ids=tensor).logits[0, :-1]
        return torch.log_softmax(logits, -1).gather(-1, tensor[0, 1:, None])[:, 0]

    first = peft_logprobs()
    with model.disable_adapter():
        base = peft_logprobs()
    model.save_pretrained(args.folder / "adapter1")
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.mul_(-1.0)
    second = peft_logprobs()
    model.save_pretrained(args.folder / "adapter2")

    started = time.perf_counter()
    llm = LLM(
        model=str(path),
        dtype="float32",
        max_model_len=512,
        enforce_eager=True,
        seed=0,
        gpu_memory_utilization=0.2,
        enable_lora=True,
        max_lora_rank=8,
        max_loras=1,
    )
    print(f"vLLM start with enable_lora: {time.perf_counter() - started:.1f} s")
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)

    def engine_logprobs(request: LoRARequest | None) -> torch.Tensor:
        output = llm.generate([{"prompt_token_ids": ids}], params, lora_request=request, use_tqdm=False)[0]
        rows = output.prompt_logprobs or []
        return torch.tensor([row[token].logprob for row, token in zip(rows[1:], ids[1:], strict=True) if row])

    print(f"base      mismatch {(engine_logprobs(None) - base).abs().mean():.2e}")
    for label, folder, expected, inplace in (
        ("adapter1", "adapter1", first, False),
        ("adapter2", "adapter2", second, True),
    ):
        started = time.perf_counter()
        got = engine_logprobs(LoRARequest("policy", 1, str(args.folder / folder), load_inplace=inplace))
        seconds = time.perf_counter() - started
        print(f"{label}  mismatch {(got - expected).abs().mean():.2e}  load + score {seconds:.2f} s")
    print(f"adapter2 against adapter1's logprobs: {(got - first).abs().mean():.2e} (must be large)")
    print(f"the adapter's own effect on the probe: {(first - base).abs().mean():.2e}")


if __name__ == "__main__":
    main()
