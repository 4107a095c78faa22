#!/usr/bin/env bash
# Source this (`. scripts/gpu_env.sh`) to get GPU_PY: a Python whose torch is a CUDA build with a visible GPU, and a
# PYTHONPATH on which megarl (this checkout) and its GPU dependencies import. It never uses the CPU env (.venv) and
# never installs torch.
#   GPU_VENV=DIR     use DIR/bin/python                (make test-gpu VENV=DIR)
#   GPU_PYTHON=EXE   use that interpreter               (make test-gpu PYTHON=EXE)
#   otherwise        the first of python3, python on PATH (the machine's, or the Docker image's /opt/venv)
#   WHEELS=DIR       wheels to install, without an index and without dependencies, into GPU_SITE (default
#                    .gpu-site, git-ignored) for what that Python lacks: megatron-core, pydantic, Transformer Engine
#                    (transformer_engine, transformer_engine_cu*, transformer_engine_torch), nvdlfw_inspect, ...
#                    Any torch wheel in DIR is skipped: the machine's CUDA torch stays the one used. Without TE's
#                    core library wheel (transformer_engine_cu*) the other TE wheels are left out too, and
#                    GPU_WHEELS_NOTE says so. A relative DIR is taken from the checkout's root.
# On failure it prints one line "error: ..." and returns 1 (the caller exits with it).
_gpu_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_gpu_fail() { echo "error: $*" >&2; return 1; }

_gpu_pick() {
    local cands=()
    if [ -n "${GPU_VENV:-}" ]; then cands=("$GPU_VENV/bin/python")
    elif [ -n "${GPU_PYTHON:-}" ]; then cands=("$GPU_PYTHON")
    else
        local c
        for c in python3 python; do
            c=$(command -v "$c" 2>/dev/null) || continue
            # the project's CPU env is never the GPU Python
            case "$(cd "$(dirname "$c")/.." 2>/dev/null && pwd -P)" in "$(cd "$_gpu_root/.venv" 2>/dev/null && pwd -P)") continue;; esac
            cands+=("$c")
        done
    fi
    [ ${#cands[@]} -gt 0 ] || { _gpu_fail "make test-gpu: no Python found (give one with PYTHON=... or VENV=...)"; return 1; }
    local why="" py
    for py in "${cands[@]}"; do
        local out
        out=$("$py" - <<'PY' 2>&1
import sys
try:
    import torch
except Exception as exc:
    print(f"{sys.executable}: torch does not import ({exc.__class__.__name__}: {exc})"); sys.exit(1)
if torch.version.cuda is None:
    print(f"{sys.executable}: torch {torch.__version__} is a CPU build"); sys.exit(1)
if not torch.cuda.is_available():
    print(f"{sys.executable}: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"); sys.exit(1)
print(sys.executable)
PY
        )
        if [ $? -eq 0 ]; then GPU_PY=$(echo "$out" | tail -1); return 0; fi
        why="${why:+$why; }$(echo "$out" | tail -1)"
    done
    _gpu_fail "megarl's GPU checks (make test-gpu, gpu-check) need a CUDA GPU and a Python whose torch is a CUDA build: $why"
}

_gpu_wheels() {
    GPU_WHEELS_NOTE=""
    [ -n "${WHEELS:-}" ] || return 0
    [ -d "$WHEELS" ] || { _gpu_fail "WHEELS=$WHEELS is not a directory"; return 1; }
    GPU_SITE=${GPU_SITE:-$_gpu_root/.gpu-site}
    local stamp="$GPU_SITE/.installed-from"
    local plain=() ext=() te=() w te_core=0
    for w in "$WHEELS"/*.whl; do
        case "$(basename "$w")" in transformer_engine_cu[0-9]*) te_core=1;; esac
    done
    for w in "$WHEELS"/*.whl; do
        [ -e "$w" ] || continue
        case "$(basename "$w")" in
            torch-*|torchvision-*|torchaudio-*|triton-*) echo "note: skipping $(basename "$w"): the machine's torch is used" >&2;;
            transformer_engine_cu[0-9]*) plain+=("$w");;
            # without TE's core library `import transformer_engine` raises: its other wheels would only break imports
            transformer_engine_torch-*) if [ "$te_core" -eq 1 ]; then ext+=("$w"); else te+=("$(basename "$w")"); fi;;
            transformer_engine-*|nvdlfw_inspect-*) if [ "$te_core" -eq 1 ]; then plain+=("$w"); else te+=("$(basename "$w")"); fi;;
            *) plain+=("$w");;
        esac
    done
    if [ ${#te[@]} -gt 0 ]; then
        GPU_WHEELS_NOTE="Transformer Engine not installed from WHEELS: no TE core library wheel (transformer_engine_cu*) in $WHEELS, so ${te[*]} were left out"
        echo "note: $GPU_WHEELS_NOTE" >&2
    fi
    local listing
    listing=$(cd "$WHEELS" && ls -1 ./*.whl 2>/dev/null | sort | tr '\n' ' ')
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$listing" ]; then return 0; fi
    # another set of wheels: start from an empty folder (only one this script made: it holds the stamp)
    if [ -f "$stamp" ]; then rm -rf "$GPU_SITE"; fi
    mkdir -p "$GPU_SITE"
    if [ ${#plain[@]} -gt 0 ]; then
        "$GPU_PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$GPU_SITE" "${plain[@]}" \
            || { _gpu_fail "pip could not install the wheels of $WHEELS into $GPU_SITE"; return 1; }
    fi
    for w in "${ext[@]}"; do  # a second wheel into TE's package folder: pip --target would not add it
        "$GPU_PY" -m zipfile -e "$w" "$GPU_SITE" || { _gpu_fail "could not unpack $w"; return 1; }
    done
    echo "$listing" > "$stamp"
}

gpu_env() {
    _gpu_pick || return 1
    _gpu_wheels || return 1
    export PYTHONPATH="${GPU_SITE:+$GPU_SITE:}$_gpu_root${PYTHONPATH:+:$PYTHONPATH}"
    export GPU_PY GPU_WHEELS_NOTE
    "$GPU_PY" -c "import torch, megatron.core, pydantic, transformers, megarl" 2>/dev/null || {
        _gpu_fail "$GPU_PY cannot import megarl's dependencies ($("$GPU_PY" -c 'import megatron.core, pydantic, transformers' 2>&1 | tail -1)); give WHEELS=DIR with their wheels, or install them into that env"
        return 1
    }
}
