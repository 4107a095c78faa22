#!/usr/bin/env bash
# megarl's GPU check on one CUDA machine, in one command (docs/gpu.md):
#   GPU_PYTHON=python3 WHEELS=DIR bash scripts/gpu_check.sh [--full]
#   make gpu-check [WHEELS=DIR] [PYTHON=... | VENV=...] [OUT=DIR] [FULL=1]
# Quick mode (the default; about 8 minutes on one H100 once the wheels are installed, never more than
# GPU_CHECK_BUDGET_S=480 seconds of steps: a step that would start later is reported as not run):
#   tests-no-te, tests-te   every gpu-marked test with Transformer Engine hidden (MEGARL_USE_TE=0), then with it
#   verify-fp32-no-te/-te   `megarl verify --dtype float32` (TF32 off) on the nine tiny architectures, 5 at a time
#   bench-train             bench/bench_train.py at 1.1B / 2048: megarl TE, megarl no TE, plain torch (MFU, peak
#                           memory, the top kernels of one profiled step, the offload round trip of megarl's states)
#   bench-ipc               bench/bench_ipc.py: the colocated weight pull of the 1.1B layout vs a device memcpy
#   doctor                  megarl doctor
# --full, the long form (no budget): the same with bf16 verify too, 1.1B and 3B benchmarks, and the benchmark again
# where Transformer Engine is not installed at all (with WHEELS).
# Every step runs under its own `timeout`. OUT (default gpu-check/) holds two files, summary.txt and logs.tgz (every
# step's full log), both rewritten after each step, so a run cut short still reports what it measured. Tiny models
# and logs are written to a scratch folder outside OUT (under TMPDIR), removed at the end.
# Exit code: 0 when every step passed, 1 when one failed or was not run, 2 for a bad argument. Without a CUDA GPU it
# stops before anything else with one line (scripts/gpu_env.sh). The machine's CUDA torch is used; WHEELS=DIR (a
# relative DIR is taken from the checkout's root) supplies what that Python lacks, never a torch.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=quick
for arg in "$@"; do
    case "$arg" in
        --full) MODE=full;;
        --quick) MODE=quick;;
        *) echo "error: gpu_check.sh: unknown argument '$arg'; give --full for the long form, nothing for the quick one" >&2
           exit 2;;
    esac
done
command -v timeout > /dev/null || { echo "error: gpu_check.sh needs coreutils' timeout on PATH" >&2; exit 1; }
. scripts/gpu_env.sh
t_wheels=$SECONDS
gpu_env || exit 1
t_wheels=$((SECONDS - t_wheels))

OUT=${OUT:-gpu-check}
mkdir -p "$OUT" || exit 1
SUMMARY="$OUT/summary.txt"
rm -f "$SUMMARY" "$OUT/logs.tgz"
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/megarl-gpu-check.XXXXXX") || exit 1
LOGS="$SCRATCH/logs"
MODELS="$SCRATCH/models"
mkdir -p "$LOGS" "$MODELS"
START=$SECONDS
trap 'rm -rf "$SCRATCH"' EXIT
trap 'say "interrupted after $((SECONDS - START)) s"; pack; exit 130' INT TERM
if [ "$MODE" = quick ]; then BUDGET=${GPU_CHECK_BUDGET_S:-480}; else BUDGET=0; fi
steps=0
failed=()

say() { echo "$*" | tee -a "$SUMMARY"; }
pack() { tar -czf "$OUT/.logs.tgz" -C "$SCRATCH" logs 2>/dev/null && mv -f "$OUT/.logs.tgz" "$OUT/logs.tgz"; }
detail() { sed 's/^/      /' | tee -a "$SUMMARY"; }
show() { [ ! -f "$LOGS/$1.log" ] || detail < "$LOGS/$1.log"; }  # a step's whole log (a few lines) in the summary

# step NAME LIMIT_S COMMAND...: run under `timeout` (within what is left of the budget), log to logs/NAME.log, one
# PASS / FAIL / SKIP line in the summary; returns the command's exit code
step() {
    local name=$1 limit=$2; shift 2
    steps=$((steps + 1))
    if [ "$BUDGET" -gt 0 ]; then
        local left=$((BUDGET - (SECONDS - START)))
        if [ "$left" -lt 30 ]; then
            say "SKIP  $name: not run, ${left} s of the ${BUDGET} s budget left"
            failed+=("$name"); pack; return 1
        fi
        [ "$left" -lt "$limit" ] && limit=$left
    fi
    echo "..    $name (at most $limit s)"
    local t0=$SECONDS code
    timeout -k 20 "$limit" "$@" > "$LOGS/$name.log" 2>&1
    code=$?
    if [ "$code" -eq 0 ]; then
        say "PASS  $name ($((SECONDS - t0)) s)"
    elif [ "$code" -eq 124 ] || [ "$code" -eq 137 ]; then
        say "FAIL  $name: stopped at its ${limit} s limit (logs.tgz: logs/$name.log)"; failed+=("$name")
    else
        say "FAIL  $name: exit code $code after $((SECONDS - t0)) s (logs.tgz: logs/$name.log)"; failed+=("$name")
        grep -v '^\s*$' "$LOGS/$name.log" | tail -n 2 | cut -c1-240 | detail
    fi
    pack
    return "$code"
}
skip() { steps=$((steps + 1)); say "SKIP  $1: $2"; failed+=("$1"); pack; }

# verify_one ARCH DTYPE TE: megarl verify of one tiny model (TE=0 hides Transformer Engine); one line: the largest
# difference, its derived tolerance, the verdict
verify_one() {
    local log="$LOGS/verify-$2-te$3/$1.log" code
    mkdir -p "$(dirname "$log")"
    if [ "$3" = 0 ]; then export MEGARL_USE_TE=0; fi
    "$GPU_PY" -m megarl verify --hf "$MODELS/$1" --dtype "$2" > "$log" 2>&1
    code=$?
    echo "$1: $(grep -h "abs .* difference" "$log" | tail -1 \
        | sed -E 's/^max abs ([a-z]+) difference ([^ ]+) \([^,]*, tolerance ([^,]+),[^:]*\): ([A-Z]+).*/\1 \2 <= \3 \4/')$(
        [ "$code" -eq 0 ] || echo " (exit code $code)")"
    return "$code"
}
# verify_all TE DTYPE: every tiny architecture, VERIFY_JOBS at a time
verify_all() {
    set -o pipefail
    printf '%s\n' $VERIFY_ARCHS | xargs -P "${VERIFY_JOBS:-5}" -I{} bash -c 'verify_one "$@"' _ {} "$2" "$1" | sort
}
export -f verify_one verify_all
export LOGS MODELS VERIFY_ARCHS="llama qwen2 qwen3 mistral mixtral qwen3_moe qwen2_moe deepseek_v3 glm4_moe"

# ---- the machine -------------------------------------------------------------------------------------------------
say "megarl gpu-check ($MODE) $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), megarl $(git rev-parse --short HEAD 2>/dev/null || echo '(no git)')"
say "gpu: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)"
say "python: $("$GPU_PY" -c 'import sys, torch; print(sys.executable, sys.version.split()[0], "torch", torch.__version__, "CUDA", torch.version.cuda)' 2>&1 | tail -1)"
if [ -n "${WHEELS:-}" ]; then
    say "wheels: $WHEELS into ${GPU_SITE:-?} (${t_wheels} s)${GPU_WHEELS_NOTE:+; $GPU_WHEELS_NOTE}"
else
    say "wheels: none given (WHEELS=DIR); the Python's own packages"
fi
te_state=$("$GPU_PY" - <<'PY' 2>/dev/null
import importlib.util
from megarl.megatron.te_guard import te_import_failure
failure = te_import_failure()
if failure:
    print(f"does not import ({failure}); the TE steps are not run")
elif importlib.util.find_spec("transformer_engine") is None:
    print("not installed; the TE steps are not run")
else:
    import transformer_engine
    import transformer_engine.pytorch  # noqa: F401
    print(f"{transformer_engine.__version__}, imports")
PY
)
say "transformer_engine: ${te_state:-its probe failed}"
TE_OK=0
case "$te_state" in *", imports") TE_OK=1;; esac
XDIST=()
"$GPU_PY" -c "import xdist" 2>/dev/null && XDIST=(-n "${TEST_JOBS:-4}")
pack

# ---- tests ---------------------------------------------------------------------------------------------------------
test_lines() { grep -shE '^(FAILED|ERROR|SKIPPED) |[0-9]+ (passed|failed|errors?)' "$LOGS/$1.log" | tail -12 | detail; }
if [ "$MODE" = quick ]; then t_tests=200; else t_tests=1800; fi
step tests-no-te "$t_tests" env TE=0 bash scripts/gpu_tests.sh -q "${XDIST[@]}"; test_lines tests-no-te
if [ "$TE_OK" -eq 1 ]; then
    step tests-te "$t_tests" env TE=1 bash scripts/gpu_tests.sh -q "${XDIST[@]}"; test_lines tests-te
else
    skip tests-te "Transformer Engine does not import here"
fi

# ---- verify on the tiny architectures --------------------------------------------------------------------------------
step models 120 "$GPU_PY" -c "
import sys
from tests.helpers.tiny_models import make_tiny_model
for arch in sys.argv[1].split():
    make_tiny_model(arch, sys.argv[2] + '/' + arch)
print('tiny models:', sys.argv[1])" "$VERIFY_ARCHS" "$MODELS"
if [ "$MODE" = quick ]; then t_verify=150; else t_verify=900; fi
step verify-fp32-no-te "$t_verify" bash -c 'verify_all 0 float32'; show verify-fp32-no-te
if [ "$TE_OK" -eq 1 ]; then
    step verify-fp32-te "$t_verify" bash -c 'verify_all 1 float32'; show verify-fp32-te
else
    skip verify-fp32-te "Transformer Engine does not import here"
fi
if [ "$MODE" = full ]; then
    step verify-bf16 "$t_verify" bash -c "verify_all $TE_OK bfloat16"; show verify-bf16
fi

# ---- benchmarks ----------------------------------------------------------------------------------------------------
bench_lines() {
    [ -f "$LOGS/$1.log" ] || return 0
    awk '/^\[|^trainer|^megarl|^plain|^MFU peak|^target:|offload round trip|out of GPU memory/ {print; next}
         /^  [^ ].*: / {print; kernels = 0; next}
         /^    +[0-9.]+%/ && kernels < 5 {print; kernels++}' "$LOGS/$1.log" | detail
}
if [ "$MODE" = quick ]; then
    step bench-train 240 "$GPU_PY" bench/bench_train.py --sizes 1b --warmup 2 --steps 3 --profile 10 --offload 1b
    bench_lines bench-train
else
    step bench-train 2400 "$GPU_PY" bench/bench_train.py --sizes 1b,3b --profile 12 --offload 1b
    bench_lines bench-train
fi
step bench-ipc "$([ "$MODE" = quick ] && echo 150 || echo 600)" "$GPU_PY" bench/bench_ipc.py
grep -shE '^device|^(sync|write|floor) |^memcpy|over PCIe|^target:' "$LOGS/bench-ipc.log" | detail

# ---- doctor ----------------------------------------------------------------------------------------------------------
step doctor "$([ "$MODE" = quick ] && echo 120 || echo 600)" "$GPU_PY" -m megarl doctor
grep -shE '^(PASS|FAIL|skip) |^Transformer Engine layer spec|^doctor:' "$LOGS/doctor.log" | detail

# ---- full: the benchmark where Transformer Engine is not installed at all (megatron's own optimizer kernels too) ------
if [ "$MODE" = full ] && [ -n "${WHEELS:-}" ]; then
    NO_TE_SITE="$SCRATCH/site-no-te"
    mapfile -t no_te < <(ls "$WHEELS"/*.whl | grep -v -e transformer_engine -e nvdlfw_inspect -e '/torch-')
    if "$GPU_PY" -m pip install -q --no-index --no-deps --no-compile --target "$NO_TE_SITE" "${no_te[@]}" \
        > "$LOGS/site-no-te.log" 2>&1 && ! PYTHONPATH="$NO_TE_SITE:$PWD" "$GPU_PY" -c "import transformer_engine" 2>/dev/null; then
        step bench-train-without-te 2400 env PYTHONPATH="$NO_TE_SITE:$PWD" "$GPU_PY" bench/bench_train.py \
            --sizes 1b,3b --contenders no-te,torch --profile 12
        bench_lines bench-train-without-te
    else
        skip bench-train-without-te "Transformer Engine is installed in $GPU_PY's own site-packages"
    fi
fi

if [ ${#failed[@]} -eq 0 ]; then
    say "result: all $steps steps passed in $((SECONDS - START)) s$([ "$BUDGET" -gt 0 ] && echo " (budget $BUDGET s)")"
else
    say "result: ${#failed[@]} of $steps steps failed or were not run (${failed[*]}) in $((SECONDS - START)) s"
fi
pack
[ ${#failed[@]} -eq 0 ]
