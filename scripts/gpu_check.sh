#!/usr/bin/env bash
# megarl's GPU check on one CUDA machine, in one command (docs/gpu.md):
#   GPU_PYTHON=python3 WHEELS=DIR bash scripts/gpu_check.sh [--full]
#   make gpu-check [WHEELS=DIR] [PYTHON=... | VENV=...] [OUT=DIR] [FULL=1]
# Quick mode (the default): each step under its own time cap (STEPS below), all of them within GPU_CHECK_BUDGET_S
# (480 s; where Transformer Engine imports, its two steps bring their own share on top). The caps of the steps that run
# add up to at most 80% of the budget, so a step that runs to its cap still leaves every later step its own; a step
# that would start with under 30 s of the budget left is reported as not run.
#   tests-no-te, tests-te   every gpu-marked test with Transformer Engine hidden (MEGARL_USE_TE=0), then with it, but
#                           the two whose work a later step does anyway (the 1.1B benchmark, megarl doctor)
#   models                  the nine tiny architectures' models, for verify
#   verify-fp32-no-te/-te   `megarl verify --dtype float32` (TF32 off) on them, 5 at a time
#   bench-train             bench/bench_train.py at 1.1B / 2048: megarl TE (where TE imports), megarl no TE, plain
#                           torch (MFU, peak memory, the top kernels of one profiled step, the offload round trip)
#   bench-ipc               bench/bench_ipc.py: the colocated weight pull of the 1.1B layout vs a device memcpy
#   doctor                  megarl doctor
# --full, the long form (no budget): the same with bf16 verify too, 1.1B and 3B benchmarks, and the benchmark again
# where Transformer Engine is not installed at all (from a copy of WHEELS without it).
# A step whose requirement is absent here (Transformer Engine for the -te steps) is reported as `n/a` with the reason,
# e.g. "n/a   tests-te (TE not installed)", and fails nothing; the summary's `not shown:` line names every point the
# check could not show and why. OUT (default gpu-check/) holds two files, summary.txt and logs.tgz (every step's full
# log), both rewritten after each step, so a run cut short still reports what it measured. Tiny models and logs are
# written to a scratch folder outside OUT (under TMPDIR), removed at the end.
# Exit code: 0 when every step that could run passed, 1 when one failed or was not run, 2 for a bad argument. Without
# a CUDA GPU it stops before anything else with one line (scripts/gpu_env.sh). The machine's CUDA torch is used;
# WHEELS=DIR (a relative DIR is taken from the checkout's root) supplies what that Python lacks, never a torch.
# GPU_CHECK_STUB=FILE is for tests: a bash file sourced once the functions below are defined, which replaces the
# machine's probes and the steps' commands (find_python, describe_machine, probe_te, execute), so that the check's
# own logic (caps, budget, n/a, summary, exit code) runs on a machine without a GPU.
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

# ---- the steps -----------------------------------------------------------------------------------------------------
# name, time cap in s in the quick form and in --full (- : not a step of that form), what it needs besides a CUDA GPU.
# The quick caps are estimates for one H100 (each PASS line gives the seconds a step took); without TE they add up to
# 380 s of the 480 s budget (tests/unit/test_gpu_check.py holds them to 80% of it).
STEPS="
tests-no-te             110  1800  -
tests-te                110  1800  te
models                   25   120  -
verify-fp32-no-te        70   900  -
verify-fp32-te           70   900  te
verify-bf16               -   900  -
bench-train              85  2400  -
bench-ipc                40   600  -
doctor                   50   600  -
bench-train-without-te    -  2400  te-free-copy
"
QUICK_BUDGET=480
cap() { awk -v n="$1" -v col="$([ "$MODE" = quick ] && echo 2 || echo 3)" '$1 == n {print $col}' <<< "$STEPS"; }
needs() { awk -v n="$1" '$1 == n {print $4}' <<< "$STEPS"; }
# missing NAME: why the step's requirement is absent here (empty: present)
missing() {
    case "$(needs "$1")" in
        te) [ "$TE_OK" -eq 1 ] || echo "$TE_WHY";;
        te-free-copy) [ -n "${WHEELS:-}" ] || echo "no WHEELS=DIR to install a copy without TE from";;
    esac
}
# planned: "name cap" of every step of this form whose requirement is present
planned() {
    local name
    for name in $(awk 'NF {print $1}' <<< "$STEPS"); do
        [ "$(cap "$name")" != - ] && [ -z "$(missing "$name")" ] && echo "$name $(cap "$name")"
    done
}

# ---- the machine (GPU_CHECK_STUB replaces these) -----------------------------------------------------------------
find_python() { . scripts/gpu_env.sh; gpu_env; }
describe_machine() {
    say "gpu: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)"
    say "python: $("$GPU_PY" -c 'import sys, torch; print(sys.executable, sys.version.split()[0], "torch", torch.__version__, "CUDA", torch.version.cuda)' 2>&1 | tail -1)"
    if [ -n "${WHEELS:-}" ]; then
        say "wheels: $WHEELS into ${GPU_SITE:-?} (${t_wheels} s)${GPU_WHEELS_NOTE:+; $GPU_WHEELS_NOTE}"
    else
        say "wheels: none given (WHEELS=DIR); the Python's own packages"
    fi
}
probe_te() {  # one line: the version and "imports", or why TE is not used
    "$GPU_PY" - <<'PY' 2>/dev/null
import importlib.util
from megarl.megatron.te_guard import te_import_failure
failure = te_import_failure()
if failure:
    print(f"does not import ({failure}); the TE steps are n/a")
elif importlib.util.find_spec("transformer_engine") is None:
    print("not installed; the TE steps are n/a")
else:
    import transformer_engine
    import transformer_engine.pytorch  # noqa: F401
    print(f"{transformer_engine.__version__}, imports")
PY
}
# execute NAME LIMIT COMMAND...: the step's command under `timeout`, its output in logs/NAME.log
execute() { local name=$1 limit=$2; shift 2; timeout -k 20 "$limit" "$@" > "$LOGS/$name.log" 2>&1; }
[ -z "${GPU_CHECK_STUB:-}" ] || . "$GPU_CHECK_STUB"

t_wheels=$SECONDS
find_python || exit 1
t_wheels=$((SECONDS - t_wheels))

OUT=${OUT:-gpu-check}
mkdir -p "$OUT" || exit 1
SUMMARY="$OUT/summary.txt"
rm -f "$SUMMARY" "$OUT/logs.tgz"
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/megarl-gpu-check.XXXXXX") || exit 1
LOGS="$SCRATCH/logs"
MODELS="$SCRATCH/models"
mkdir -p "$LOGS" "$MODELS"
START=$SECONDS  # from here for an interruption's line; the steps' budget counts from the first step
trap 'rm -rf "$SCRATCH"' EXIT
trap 'say "interrupted after $((SECONDS - START)) s"; pack; exit 130' INT TERM
steps=0
failed=()     # steps that failed or were not run: the exit code
not_shown=()  # "what (why)": every point the check could not show

say() { echo "$*" | tee -a "$SUMMARY"; }
pack() { tar -czf "$OUT/.logs.tgz" -C "$SCRATCH" logs 2>/dev/null && mv -f "$OUT/.logs.tgz" "$OUT/logs.tgz"; }
detail() { sed 's/^/      /' | tee -a "$SUMMARY"; }
show() { [ ! -f "$LOGS/$1.log" ] || detail < "$LOGS/$1.log"; }  # a step's whole log (a few lines) in the summary

# run NAME COMMAND...: the step of this form, n/a where its requirement is absent, else under its cap (within what is
# left of the budget) with one PASS / FAIL / SKIP line in the summary
run() {
    local name=$1 limit why; shift
    limit=$(cap "$name")
    [ "$limit" != - ] || return 0
    why=$(missing "$name")
    if [ -n "$why" ]; then na "$name" "$why"; return 0; fi
    steps=$((steps + 1))
    if [ "$BUDGET" -gt 0 ]; then
        local left=$((BUDGET - (SECONDS - START)))
        if [ "$left" -lt 30 ]; then
            say "SKIP  $name: not run, ${left} s of the ${BUDGET} s budget left"
            failed+=("$name"); not_shown+=("$name (not run: the budget was spent)"); pack; return 1
        fi
        [ "$left" -lt "$limit" ] && limit=$left
    fi
    echo "..    $name (at most $limit s)"
    local t0=$SECONDS code
    execute "$name" "$limit" "$@"
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
na() { say "n/a   $1 ($2)"; not_shown+=("$1 ($2)"); pack; }

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
describe_machine
te_state=$(probe_te)
say "transformer_engine: ${te_state:-its probe failed}"
TE_OK=0
TE_WHY="TE not installed"
case "$te_state" in
    *", imports") TE_OK=1;;
    "does not import"*) TE_WHY="TE does not import";;
esac
if [ "$MODE" = full ]; then
    BUDGET=0
else  # where TE imports, its steps come with their caps and the same 20% spare
    te_caps=$(awk '$4 == "te" {s += $2} END {print s + 0}' <<< "$STEPS")
    BUDGET=${GPU_CHECK_BUDGET_S:-$((QUICK_BUDGET + TE_OK * te_caps * 5 / 4))}
fi
plan=$(planned)
say "plan: $(awk '{printf "%s%s %s s", (NR > 1 ? ", " : ""), $1, $2; s += $2} END {printf " = %d s", s}' <<< "$plan")$(
    [ "$BUDGET" -gt 0 ] && echo " of the $BUDGET s budget" || echo ", no budget")"
XDIST=()
"$GPU_PY" -c "import xdist" 2>/dev/null && XDIST=(-n "${TEST_JOBS:-4}")
START=$SECONDS
pack

# ---- tests ---------------------------------------------------------------------------------------------------------
test_lines() { grep -shE '^(FAILED|ERROR|SKIPPED) |[0-9]+ (passed|failed|errors?)' "$LOGS/$1.log" | tail -12 | detail; }
# tests whose work bench-train and doctor do in their own steps: each is run once
ONCE=(--deselect tests/gpu/test_gpu_training.py::test_bench_train_reports_tokens_per_second_and_mfu_for_a_1b_model
      --deselect tests/e2e/test_doctor.py::test_doctor_passes_on_the_gpu)
run tests-no-te env TE=0 bash scripts/gpu_tests.sh -q "${XDIST[@]}" "${ONCE[@]}"; test_lines tests-no-te
run tests-te env TE=1 bash scripts/gpu_tests.sh -q "${XDIST[@]}" "${ONCE[@]}"; test_lines tests-te

# ---- verify on the tiny architectures --------------------------------------------------------------------------------
run models "$GPU_PY" -c "
import sys
from tests.helpers.tiny_models import make_tiny_model
for arch in sys.argv[1].split():
    make_tiny_model(arch, sys.argv[2] + '/' + arch)
print('tiny models:', sys.argv[1])" "$VERIFY_ARCHS" "$MODELS"
run verify-fp32-no-te bash -c 'verify_all 0 float32'; show verify-fp32-no-te
run verify-fp32-te bash -c 'verify_all 1 float32'; show verify-fp32-te
run verify-bf16 bash -c "verify_all $TE_OK bfloat16"; show verify-bf16

# ---- benchmarks ----------------------------------------------------------------------------------------------------
bench_lines() {
    [ -f "$LOGS/$1.log" ] || return 0
    awk '/^\[|^trainer|^megarl|^plain|^MFU peak|^target:|offload round trip|out of GPU memory/ {print; next}
         /^  [^ ].*: / {print; kernels = 0; next}
         /^    +[0-9.]+%/ && kernels < 5 {print; kernels++}' "$LOGS/$1.log" | detail
}
if [ "$MODE" = quick ]; then sizes=1b; bench_steps=(--warmup 2 --steps 3 --profile 10); else
    sizes=1b,3b; bench_steps=(--profile 12); fi
run bench-train "$GPU_PY" bench/bench_train.py --sizes "$sizes" "${bench_steps[@]}" --offload 1b
bench_lines bench-train
[ "$TE_OK" -eq 1 ] || not_shown+=("bench-train's megarl TE row ($TE_WHY)")
run bench-ipc "$GPU_PY" bench/bench_ipc.py
grep -shE '^device|^(sync|write|floor) |^memcpy|over PCIe|^target:' "$LOGS/bench-ipc.log" | detail

# ---- doctor ----------------------------------------------------------------------------------------------------------
run doctor "$GPU_PY" -m megarl doctor
grep -shE '^(PASS|FAIL|skip) |^Transformer Engine layer spec|^doctor:' "$LOGS/doctor.log" | detail
! grep -qs 'vLLM does not import' "$LOGS/doctor.log" \
    || not_shown+=("a vLLM engine on this GPU (vLLM does not import here: doctor probed the hf engine instead)")

# ---- full: the benchmark where Transformer Engine is not installed at all (megatron's own optimizer kernels too) ------
if [ "$MODE" = full ] && [ -n "${WHEELS:-}" ]; then
    NO_TE_SITE="$SCRATCH/site-no-te"
    mapfile -t no_te < <(ls "$WHEELS"/*.whl | grep -v -e transformer_engine -e nvdlfw_inspect -e '/torch-')
    if ! "$GPU_PY" -m pip install -q --no-index --no-deps --no-compile --target "$NO_TE_SITE" "${no_te[@]}" \
            > "$LOGS/site-no-te.log" 2>&1; then
        run bench-train-without-te bash -c "echo 'pip could not install the wheels without TE:'; cat '$LOGS/site-no-te.log'; exit 1"
    elif PYTHONPATH="$NO_TE_SITE:$PWD" "$GPU_PY" -c "import transformer_engine" 2>/dev/null; then
        na bench-train-without-te "TE is installed in $GPU_PY's own site-packages: no copy can leave it out"
    else
        run bench-train-without-te env PYTHONPATH="$NO_TE_SITE:$PWD" "$GPU_PY" bench/bench_train.py \
            --sizes 1b,3b --contenders no-te,torch --profile 12
        bench_lines bench-train-without-te
    fi
else
    run bench-train-without-te true  # n/a (no WHEELS), or not a step of the quick form
fi

if [ ${#not_shown[@]} -gt 0 ]; then
    say "not shown: $(printf '%s; ' "${not_shown[@]}" | sed 's/; $//')"
fi
if [ ${#failed[@]} -eq 0 ]; then
    say "result: all $steps steps that could run here passed in $((SECONDS - START)) s$([ "$BUDGET" -gt 0 ] && echo " (budget $BUDGET s)")"
else
    say "result: ${#failed[@]} of $steps steps failed or were not run (${failed[*]}) in $((SECONDS - START)) s"
fi
pack
[ ${#failed[@]} -eq 0 ]
