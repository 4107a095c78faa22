#!/usr/bin/env bash
# One command that measures every GPU acceptance point of megarl's GPU training path on a CUDA machine (an H100):
#   bash scripts/gpu_check.sh            (or: make gpu-check [WHEELS=DIR] [PYTHON=... | VENV=...] [OUT=DIR])
# 1. make test-gpu with Transformer Engine (when it imports) and without it (TE=0)
# 2. megarl verify --dtype float32 on the seven tiny architectures (<= 1e-5 each), and --dtype bfloat16 (derived tol)
# 3. megarl doctor
# 4. bench/bench_train.py at 1.1B/2048 and 3B/4096: megarl TE, megarl no TE, plain torch; MFU, peak memory, the top
#    kernels of one profiled step, and the offload round trip of megarl's states (bytes, seconds, memory freed)
# 5. with WHEELS: the benchmark again where Transformer Engine is not installed at all (no TE kernels anywhere)
# 6. bench/bench_ipc.py: the colocated GPU weight sync of a 1.1B model vs a device memcpy, and its bytes over PCIe
# Logs go to OUT (default gpu-check/, git-ignored), one file per part, and OUT/summary.txt lists each part's result.
# Exit code: 0 when every part passed, 1 otherwise. The machine's CUDA torch is used; WHEELS=DIR supplies what it lacks
# (megatron-core, pydantic, Transformer Engine; see scripts/gpu_env.sh) and never a torch.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_env.sh
gpu_env || exit 1
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
failed=0
part() {  # part NAME COMMAND...: run, log to OUT/NAME.log, record PASS/FAIL with the time taken
    local name=$1; shift
    local t0=$SECONDS
    echo "== $name: $*" | tee -a "$SUMMARY"
    "$@" > "$OUT/$name.log" 2>&1
    local code=$?
    local verdict=PASS; [ "$code" -eq 0 ] || { verdict="FAIL (exit $code)"; failed=1; }
    echo "   $verdict in $((SECONDS - t0)) s, log $OUT/$name.log" | tee -a "$SUMMARY"
    return 0
}
{
    echo "machine: $(hostname) $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
    "$GPU_PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "CUDA", torch.version.cuda)'
    "$GPU_PY" -c 'import transformer_engine; print("transformer_engine", transformer_engine.__version__)' 2>/dev/null \
        || echo "transformer_engine: not importable"
    git rev-parse --short HEAD 2>/dev/null | sed 's/^/megarl commit /'
} | tee -a "$SUMMARY"

TE_OK=0
"$GPU_PY" -c "import transformer_engine.pytorch" 2>/dev/null && TE_OK=1

# 1. the gpu tests, with and without Transformer Engine
if [ "$TE_OK" -eq 1 ]; then
    part test-gpu-te env TE=1 bash scripts/gpu_tests.sh -q
else
    echo "== test-gpu-te: skipped, transformer_engine.pytorch does not import (give WHEELS=DIR)" | tee -a "$SUMMARY"
    failed=1
fi
part test-gpu-no-te env TE=0 bash scripts/gpu_tests.sh -q

# 2. verify on the seven tiny architectures (float32: TF32 off, <= 1e-5; bf16: the derived tolerance)
MODELS="$OUT/models"
"$GPU_PY" - "$MODELS" <<'PY' >> "$SUMMARY" 2>&1
import sys
from pathlib import Path
from tests.helpers.tiny_models import ARCHS, make_tiny_model
for arch in ARCHS:
    if not (Path(sys.argv[1]) / arch / "config.json").exists():
        make_tiny_model(arch, Path(sys.argv[1]) / arch)
print("tiny models:", " ".join(ARCHS))
PY
for arch in llama qwen2 qwen3 mistral mixtral qwen3_moe qwen2_moe; do
    part "verify-fp32-$arch" "$GPU_PY" -m megarl verify --hf "$MODELS/$arch" --dtype float32
    grep -h "max abs logprob difference" "$OUT/verify-fp32-$arch.log" | sed 's/^/   /' | tee -a "$SUMMARY"
    part "verify-bf16-$arch" "$GPU_PY" -m megarl verify --hf "$MODELS/$arch" --dtype bfloat16
    grep -h "mean abs logprob difference" "$OUT/verify-bf16-$arch.log" | sed 's/^/   /' | tee -a "$SUMMARY"
done

# 3. doctor
part doctor "$GPU_PY" -m megarl doctor
grep -hE "^(PASS|FAIL|skip)" "$OUT/doctor.log" | sed 's/^/   /' | tee -a "$SUMMARY"

# 4. the training benchmark at both sizes, top kernels and the offload round trip
part bench-train "$GPU_PY" bench/bench_train.py --sizes 1b,3b --profile 12 --offload
grep -hE "^\[|^megarl|^plain|offload round trip|out of GPU memory" "$OUT/bench-train.log" | sed 's/^/   /' \
    | tee -a "$SUMMARY"

# 6. the colocated weight sync without leaving the GPU (pulled writes over CUDA IPC into a stand-in worker with a
#    real vLLM worker's recorded layout; the bitwise and sleep/wake tests ran in part 1): a 1.1B model's pieces vs a
#    device memcpy of the same bytes, and the bytes per memcpy kind (HtoD/DtoH: over PCIe)
part bench-ipc "$GPU_PY" bench/bench_ipc.py
grep -hE "^device|^sync|^write|^floor|^memcpy|over PCIe" "$OUT/bench-ipc.log" | sed 's/^/   /' | tee -a "$SUMMARY"

# 5. without Transformer Engine installed at all (megatron's own optimizer kernels too), when TE came from WHEELS:
#    the same wheels minus TE into a second folder, and the benchmark's no-TE and torch rows from there
if [ -n "${WHEELS:-}" ]; then
    NO_TE_SITE="${GPU_SITE:-.gpu-site}-no-te"
    mkdir -p "$NO_TE_SITE"
    mapfile -t no_te < <(ls "$WHEELS"/*.whl | grep -v -e transformer_engine -e nvdlfw_inspect -e '/torch-')
    if "$GPU_PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$NO_TE_SITE" "${no_te[@]}" \
        && ! PYTHONPATH="$NO_TE_SITE:$PWD" "$GPU_PY" -c "import transformer_engine" 2>/dev/null; then
        part bench-train-without-te env PYTHONPATH="$NO_TE_SITE:$PWD" "$GPU_PY" bench/bench_train.py --sizes 1b,3b \
            --contenders no-te,torch --profile 12
        grep -hE "^\[|^megarl|^plain|out of GPU memory" "$OUT/bench-train-without-te.log" | sed 's/^/   /' \
            | tee -a "$SUMMARY"
    else
        echo "== bench-train-without-te: skipped (Transformer Engine is installed in $GPU_PY's own site-packages)" \
            | tee -a "$SUMMARY"
    fi
fi

echo "gpu-check: $([ "$failed" -eq 0 ] && echo 'every part passed' || echo 'some parts FAILED'); see $SUMMARY" \
    | tee -a "$SUMMARY"
exit "$failed"
