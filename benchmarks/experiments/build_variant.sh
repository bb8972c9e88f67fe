#!/usr/bin/env bash
# Builds a package copy with a patch of this folder applied, for A/B runs on the GPU machine (ab_builds.py
# main=. NAME=.carry/variants/NAME; carry the folder with the run):
#   benchmarks/experiments/build_variant.sh decode_pdl.patch pdl
#   benchmarks/experiments/build_variant.sh @f6205e4 base     # main at a commit instead of a patch
# Run from the repository root with a configured CMake build folder (BUILD, default build; CMAKE, default cmake on
# PATH; PYTHON, default python3, with jax, for the closing check). Applies the patch (or checks out ffi/ of the
# commit), builds, installs into a temporary prefix, copies jax_w4a8/ with those modules (and the patch's Python
# changes; not the embedded model's files, so that three variants and jax_w4a8/_lib fit a device call's carry) to
# .carry/variants/NAME, then restores ffi/ and the patch's other files and rebuilds main's modules.
# Refuses to run with uncommitted changes or untracked files under ffi/ or in the patch's files (it cleans ffi/
# afterwards).
set -euo pipefail
[[ $# -eq 2 ]] || { echo "usage: $0 PATCH|@COMMIT NAME" >&2; exit 2; }
src=$1 name=$2
BUILD=${BUILD:-build}
CMAKE=${CMAKE:-cmake}
here=$(cd "$(dirname "$0")" && pwd)
[[ -d $BUILD ]] || { echo "no CMake build folder $BUILD (configure one first: see README, Building by hand)" >&2; exit 2; }
touched=(ffi)
[[ $src == @* ]] || mapfile -t -O 1 touched < <(git apply --numstat "$here/$src" | cut -f3)
git diff --quiet -- "${touched[@]}" && git diff --cached --quiet -- "${touched[@]}" ||
  { echo "uncommitted changes under ${touched[*]}" >&2; exit 2; }
[[ -z $(git ls-files --others --exclude-standard -- ffi) ]] || { echo "untracked files under ffi/" >&2; exit 2; }
applied=0
restore() {
  if [[ $src == @* ]]; then git checkout -q HEAD -- ffi && git clean -qfd -- ffi
  elif ((applied)); then git apply -R "$here/$src" && applied=0  # its new files too
  fi
}
trap restore EXIT
if [[ $src == @* ]]; then
  git checkout -q "${src#@}" -- ffi
else
  git apply "$here/$src"  # a patch that does not apply stops the script here (set -e), before any build
  applied=1
fi
"$CMAKE" --build "$BUILD" -j "$(nproc)" > /dev/null
prefix=$(mktemp -d)
"$CMAKE" --install "$BUILD" --prefix "$prefix" > /dev/null
dest=.carry/variants/$name
rm -rf "$dest" && mkdir -p "$dest"
cp -r jax_w4a8 "$dest/"
find "$dest" -name __pycache__ -prune -exec rm -rf {} +
rm -rf "$dest"/jax_w4a8/models/deepseek/assets  # the embedded model (4.6 MB): the A/B and kernel tests need none
rm -f "$dest"/jax_w4a8/_lib/*.so
cp "$prefix"/jax_w4a8/_lib/*.so "$dest/jax_w4a8/_lib/"
rm -rf "$prefix"
restore
trap - EXIT
"$CMAKE" --build "$BUILD" -j "$(nproc)" > /dev/null
(cd /tmp && PYTHONPATH="$OLDPWD/$dest" "${PYTHON:-python3}" -c "import jax_w4a8 as j; print('$dest:', j.build_info()['cuda'])")
