#!/usr/bin/env bash
# Sets up .venv if needed and runs the main job on its embedded default.
# Extra arguments go to the program (python -m jax_w4a8 --help).
source "$(dirname "$0")/_env.sh"
cd "$ROOT"
exec python -m jax_w4a8 "$@"
