#!/usr/bin/env bash
# `make test-gpu`: the tests marked gpu, in a Python whose torch has CUDA (scripts/gpu_env.sh picks it), never the
# CPU env. Without a CUDA GPU it stops with one line and exit code 1 instead of skipping every test.
#   TE=0   hide Transformer Engine from megarl (the path without TE); TE=1 require it; default: use it when it imports
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_env.sh
gpu_env || exit 1
"$GPU_PY" -c "import pytest" 2>/dev/null \
    || { echo "error: pytest does not import in $GPU_PY; add its wheel (and pluggy, iniconfig) to WHEELS=DIR" >&2; exit 1; }
case "${TE:-auto}" in
    0) export MEGARL_USE_TE=0;;
    1) export MEGARL_USE_TE=1
       "$GPU_PY" -c "import transformer_engine.pytorch" 2>/dev/null \
           || { echo "error: TE=1 but transformer_engine.pytorch does not import in $GPU_PY" >&2; exit 1; };;
esac
echo "test-gpu: $("$GPU_PY" -c 'import sys, torch; print(sys.executable, "torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name())') TE=${TE:-auto}" >&2
"$GPU_PY" -m pytest -m gpu -o addopts="-ra --strict-markers -p no:cacheprovider" "$@"
code=$?
if [ "$code" -eq 5 ]; then echo "error: pytest collected no gpu tests (exit code 5)" >&2; exit 1; fi
exit "$code"
