#!/usr/bin/env bash
# Sets up .venv if needed and runs the test suite (GPU tests skip without a GPU).
# Extra arguments go to pytest, e.g. scripts/test.sh -k grouped_gemm -x
source "$(dirname "$0")/_env.sh"
cd "$ROOT"
exec python -m pytest -q "$@"
