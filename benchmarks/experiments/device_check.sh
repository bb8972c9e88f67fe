#!/usr/bin/env bash
# The prepared GPU checks of benchmarks/experiments/README.md ("Waiting for a device") in one device call: run from
# the repository root on the GPU machine, with the library built (jax_w4a8/_lib, carried from the build machine).
# Each step runs under its own time limit (killed past it) and logs to $OUT/STEP.log (default /tmp/device_check); the
# console gets each step's exit status and last lines. STEPS picks steps by name prefix (default: all), e.g.
#   STEPS="tests sanitizer" OUT=$OUT benchmarks/experiments/device_check.sh
set -u
OUT=${OUT:-/tmp/device_check}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
STEPS=${STEPS:-"tests sanitizer sass ab ncu plan"}
# The einsum plan patch (einsum_decode_plan.patch) prebuilt as a package copy whose _lib holds the patched modules
# (carry it too); its steps are skipped when it is missing.
VARIANT=${VARIANT:-.carry/variants/einsum_plan}

wanted() { local s; for s in $STEPS; do [[ $1 == "$s"* ]] && return 0; done; return 1; }
step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2
  shift 2
  wanted "$name" || return 0
  echo "=== $name $(date +%T)"
  timeout -s KILL "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "rc $?"
  grep -v -i "warn" "$OUT/$name.log" | tail -n 8
}

nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader
# 1. the grouped decode kernel (8- and 16-row units) and the GPU tests whose outputs are now poisoned
step tests_decode 300 python3 scripts/gpu_tests.py --shards 6 tests/test_w4a8_grouped_gemm.py -m gpu \
  -k "decode_kernel or batch1 or f16-decode or repeated or scale_extremes or infinite"
step tests_poisoned 300 python3 scripts/gpu_tests.py --shards 6 tests/test_quantize_fp8_groups.py \
  tests/test_w4a8_moe_up.py tests/test_fp8_einsum.py -m gpu -k "not every_tile"
step sanitizer_memcheck 150 compute-sanitizer --tool memcheck --kernel-name kns=W4a8DecodeKernel \
  python3 tests/sanitizer_case.py
step sanitizer_racecheck 200 compute-sanitizer --tool racecheck --racecheck-report hazard \
  --kernel-name kns=W4a8DecodeKernel python3 tests/sanitizer_case.py
step sass 120 python3 -m pytest -q tests/test_sass.py
# 2. its speed: the timing loop (plan vs decode 8 / 16 vs the 16-token tile), then each kernel alone under ncu
step ab_grouped_decode 240 python3 benchmarks/experiments/grouped_decode_ab.py
for c in top8_up1 top8_down1 decode64 decode512; do
  for o in "" "--kernel decode --tile-tokens 8" "--kernel decode --tile-tokens 16"; do
    tag=${o//--kernel decode --tile-tokens /decode}
    step "ncu_${c}${tag:+_$tag}" 90 ncu --clock-control none --kernel-name regex:"HopperGemm|Prepare|W4a8Decode" \
      --metrics gpu__time_duration.sum python3 benchmarks/profile_case.py "$c" --calls 3 $o
  done
done
# 3. the einsum plan patch: timing-loop A/B against main, then its GPU tests with its modules swapped in
if [[ -d $VARIANT/jax_w4a8/_lib ]]; then
  step plan_ab 330 python3 benchmarks/ab_builds.py main=. plan="$VARIANT" --cases einsum1 --rounds 2 --deadline 300
  if wanted plan_tests; then
    mkdir -p "$OUT/main_lib" && cp jax_w4a8/_lib/*.so "$OUT/main_lib/" && cp "$VARIANT"/jax_w4a8/_lib/*.so jax_w4a8/_lib/
    step plan_tests 300 python3 scripts/gpu_tests.py --shards 8 tests/test_fp8_einsum.py -m gpu -k decode
    for c in qkv_a1 q_b1 q_a1 kv_a1 shared_up1; do
      step "plan_ncu_$c" 60 ncu --clock-control none --kernel-name regex:Fp8Decode --metrics gpu__time_duration.sum \
        python3 benchmarks/profile_case.py "$c" --calls 3
    done
    cp "$OUT"/main_lib/*.so jax_w4a8/_lib/ && rm -rf "$OUT/main_lib"
  fi
fi
echo "=== end $(date +%T)"
