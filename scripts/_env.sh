# Sourced by scripts/main.sh and scripts/test.sh: makes .venv (Python >= 3.12) and installs the
# package in editable mode, rebuilding the FFI handlers when ffi/, CMakeLists.txt, pyproject.toml or
# scripts/constraints.txt changed since the last install; with an NVIDIA GPU, also JAX's CUDA plugin.
# Set JAX_W4A8_PYTHON to pick the interpreter.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${JAX_W4A8_VENV:-$ROOT/.venv}"

find_python() {
  local candidates=("${JAX_W4A8_PYTHON:-}" python3.13 python3.12 python3)
  local c
  for c in "${candidates[@]}" "$HOME"/.pyenv/versions/3.1[2-9]*/bin/python3 /usr/bin/python3.1[2-9]; do
    [ -n "$c" ] || continue
    if "$c" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; then
      echo "$c"; return 0
    fi
  done
  echo "error: no Python >= 3.12 found (set JAX_W4A8_PYTHON)" >&2
  return 1
}

if [ ! -x "$VENV/bin/python" ]; then
  PY="$(find_python)"
  echo "[jax_w4a8] creating $VENV with $("$PY" --version)"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
PIP="$VENV/bin/python -m pip"
export PIP_CONSTRAINT="$ROOT/scripts/constraints.txt"

STAMP="$VENV/.jax_w4a8_build_stamp"
HASH="$(cd "$ROOT" && cat pyproject.toml CMakeLists.txt scripts/constraints.txt $(find ffi -type f | sort) | sha256sum | cut -c1-16)"
# An NVIDIA GPU (grep reads all of nvidia-smi's output: with -q it could exit early, SIGPIPE under pipefail)
GPU=0
if [ "${JAX_W4A8_JAX_CUDA:-1}" != 0 ] && nvidia-smi -L 2>/dev/null | grep '^GPU' >/dev/null; then GPU=1; fi
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$HASH" ]; then
  echo "[jax_w4a8] installing build tools and the package (editable)"
  $PIP install -q "scikit-build-core>=0.10" "nanobind>=2.4" "cmake>=3.30" "ninja>=1.11" "jax>=0.11.2"
  # CUTLASS headers for the fp8 einsum's prefill kernel (the wheel's Python deps are not needed to build)
  $PIP install -q --no-deps "nvidia-cutlass==4.2.0.0"
  # cuBLASLt's header for the fp8 einsum's cuBLASLt path (the library is loaded at run time: JAX's CUDA plugin
  # depends on this wheel, so a GPU machine has it, in the version JAX chose: never replaced here)
  $PIP show -q nvidia-cublas >/dev/null 2>&1 || $PIP install -q --no-deps "nvidia-cublas==13.0.2.14"
  $PIP install -q --no-build-isolation -e "$ROOT[test]"
  if [ "$GPU" = 1 ] && $PIP show -q jax-cuda13-plugin >/dev/null 2>&1; then  # kept at jaxlib's (pinned) version
    $PIP install -q "jax[cuda13]" || echo "[jax_w4a8] warning: jax[cuda13] did not update" >&2
  fi
  echo "$HASH" > "$STAMP"
fi
# On a machine with an NVIDIA GPU, JAX's CUDA plugin unless one (CUDA 12 or 13) is there already (else JAX runs
# on the CPU and the GPU tests skip); JAX_W4A8_JAX_CUDA=0 skips the install. A failed install (no network) warns
# and leaves the CPU build working.
if [ "$GPU" = 1 ] && ! $PIP show -q jax-cuda13-plugin >/dev/null 2>&1 \
    && ! $PIP show -q jax-cuda12-plugin >/dev/null 2>&1; then
  echo "[jax_w4a8] an NVIDIA GPU is present: installing JAX's CUDA 13 plugin (jax[cuda13])"
  $PIP install -q "jax[cuda13]" || echo "[jax_w4a8] warning: jax[cuda13] did not install; JAX will run on the CPU" >&2
fi
export PATH="$VENV/bin:$PATH"
