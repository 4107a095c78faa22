#!/usr/bin/env bash
# Runs the test suite in the project env. pytest's exit code 5 (no tests collected) is reported and treated as a
# failure: a suite that silently runs nothing must not pass.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${VENV:-.venv}/bin/python
"$PY" -m pytest "$@"
code=$?
if [ "$code" -eq 5 ]; then
    echo "error: pytest collected no tests (exit code 5); check the test paths and -m/-k filters" >&2
    exit 1
fi
exit "$code"
