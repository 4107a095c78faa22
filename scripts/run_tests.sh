#!/usr/bin/env bash
# Runs the test suite in the project env. pytest's exit code 5 (no tests collected) is reported and treated as a
# failure: a suite that silently runs nothing must not pass.
#
# The default run (no arguments) has two tiers:
#   1. the suite with the machine's own kernels (torch's CPU capability: AVX2, AVX-512, AMX ...);
#   2. the parity tests (marker `parity`) again as an AVX2 machine computes them, so a tolerance fitted to one kernel
#      set's rounding fails here, not on the next machine. Three libraries pick kernels, each by its own switch: ATen's
#      (ATEN_CPU_CAPABILITY), oneDNN's (ONEDNN_MAX_CPU_ISA: bf16 attention packs for AMX when oneDNN reports it, and
#      then fails in ATen's AVX2 kernels) and MKL's float32 GEMM (MKL_ENABLE_INSTRUCTIONS). Skipped, with a note, where the
#      machine's own capability is already AVX2 (tier 1 ran those kernels) or lower.
# With arguments (e.g. `-m slow`, a path, `-k name`), pytest runs once with them; PORTABILITY=1 adds tier 2 for the
# same selection restricted to `parity`, PORTABILITY=0 drops it from the default run.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${VENV:-.venv}/bin/python

run_pytest() {
    "$PY" -m pytest "$@"
    local code=$?
    if [ "$code" -eq 5 ]; then
        echo "error: pytest collected no tests (exit code 5); check the test paths and -m/-k filters" >&2
        return 1
    fi
    return "$code"
}

default_run=1
[ "$#" -gt 0 ] && default_run=0
portability=${PORTABILITY:-$default_run}

run_pytest "$@"
code=$?

if [ "$portability" = "1" ]; then
    capability=$("$PY" -c "import torch; print(torch.backends.cpu.get_cpu_capability())" 2>/dev/null || echo unknown)
    case "$capability" in
        AVX512*|AMX*|avx512*|amx*)
            echo "== portability tier: the parity tests under AVX2 kernels (this machine's own: $capability) =="
            # vLLM's own kernels do not follow ATEN_CPU_CAPABILITY: an engine test here would run a mix no CPU has
            # (parity_repeat: a layout or variant whose kernels a kept case of the same test already runs here)
            marker="parity and not parity_repeat and not slow and not gpu and not vllm"
            ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
                run_pytest -m "$marker" "$@"
            tier=$?
            [ "$code" -eq 0 ] && code=$tier
            ;;
        *)
            echo "== portability tier skipped: this machine's kernels are $capability (tier 1 ran them already) ==";;
    esac
fi
exit "$code"
