#!/usr/bin/env bash
# The GPU checks of sharpen in one call, as they can run on a lent CUDA machine (CUDA PyTorch, transformers and
# peft, no network, no vLLM, Ray, SGLang or SmolLM2 there):
#   make gpu-wheels                          # here: sharpen's small dependencies that machine lacks, into .whl/
#   bash benchmarks/gpu_check.sh OUT [PYTHON] # there, from the repository root, with .whl/ carried along
# Installs the carried wheels (pydantic and its parts) into a folder of its own, puts src/ on the path, then runs each
# part of benchmarks/gpu_check.py under its own time limit (device; trainer_step: float32 and bf16 on CUDA against
# the CPU; hf_engine; weight_sync: buckets and a verified sync into the hf engine on CUDA; flops: a training step's
# achieved FLOP/s against the card's bf16 peak), then the tests marked `gpu` that need no vLLM: FSDP2 on NCCL against
# the single-device backend (tests/unit/trainer/backends/test_fsdp2.py) and the parallel trainer with every axis at
# size 1 on NCCL (test_parallel_trainer.py). Each part writes OUT/<part>.json (their stderr: OUT/parts.log), pytest
# OUT/pytest_gpu.log, and OUT/summary.json says which passed: 8 files, what a lent machine sends back. Where `vllm`
# imports (a full CUDA environment), the vLLM colocation tests run too, and where `sglang` imports, the sglang
# engine's test against a real server this script starts.
# Exit code: 0 when every part and test passed. Verified nowhere yet: vLLM and SGLang on CUDA, multi-GPU NCCL.
set -uo pipefail
OUT=${1:?usage: gpu_check.sh OUT [PYTHON]}
PYTHON=${2:-python3}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    SITE=$(mktemp -d -t sharpen-site-XXXXXX)
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl || exit 1
    export PYTHONPATH="$SITE:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
declare -A STATUS
for part in device:60 trainer_step:180 hf_engine:180 weight_sync:180 flops:240; do
    name=${part%%:*}
    timeout "${part##*:}" "$PYTHON" benchmarks/gpu_check.py "$name" --out "$OUT" 2>>"$OUT/parts.log"
    STATUS[$name]=$?
    echo "part $name: exit ${STATUS[$name]}"
done

TESTS=(tests/unit/trainer/backends/test_fsdp2.py tests/unit/trainer/backends/test_parallel_trainer.py)
if "$PYTHON" -c "import vllm" 2>/dev/null; then
    TESTS+=(tests/integration/test_gpu_colocate.py)
fi
if "$PYTHON" -c "import sglang" 2>/dev/null; then
    # A real SGLang server for the sglang engine's gpu test, in its own process group, stopped on exit.
    MODEL=$("$PYTHON" -c "from sharpen.config.models import resolve_model_path as p; print(p('smollm2-135m-instruct'))")
    PORT=$("$PYTHON" -c "from sharpen.rollout.engines.server import free_port; print(free_port())")
    setsid "$PYTHON" -m sglang.launch_server --model-path "$MODEL" --host 127.0.0.1 --port "$PORT" --dtype bfloat16 \
        --random-seed 0 --weight-version 0 --mem-fraction-static 0.3 >>"$OUT/parts.log" 2>&1 &
    SGLANG_PID=$!
    trap 'kill -TERM -- "-$SGLANG_PID" 2>/dev/null || true' EXIT
    for _ in $(seq 450); do
        if "$PYTHON" -c "import httpx, sys; sys.exit(httpx.get('http://127.0.0.1:$PORT/health', timeout=5).status_code != 200)" \
            2>/dev/null; then
            export SHARPEN_SGLANG_URL="http://127.0.0.1:$PORT"
            break
        fi
        kill -0 "$SGLANG_PID" 2>/dev/null || break
        sleep 2
    done
    TESTS+=(tests/unit/rollout/engines/test_sglang_engine.py)
fi
timeout 420 "$PYTHON" -m pytest -q -rA -m gpu -p no:cacheprovider "${TESTS[@]}" >"$OUT/pytest_gpu.log" 2>&1
STATUS[pytest_gpu]=$?
tail -n 5 "$OUT/pytest_gpu.log"

"$PYTHON" - "$OUT" "$(for k in "${!STATUS[@]}"; do echo "$k=${STATUS[$k]}"; done)" <<'PY'
import json, sys
out, lines = sys.argv[1], sys.argv[2].split()
status = {line.split("=")[0]: int(line.split("=")[1]) for line in lines}
summary = {"passed": sorted(k for k, v in status.items() if v == 0), "failed": {k: v for k, v in status.items() if v}}
summary["note"] = "exit 124: the part ran past its time limit"
open(f"{out}/summary.json", "w").write(json.dumps(summary, indent=1) + "\n")
print(json.dumps(summary))
PY
for code in "${STATUS[@]}"; do
    [ "$code" -eq 0 ] || exit 1
done
