#!/usr/bin/env bash
# The prepared GPU checks of benchmarks/experiments/README.md ("Waiting for a device") in one or two device calls: run from
# the repository root on the GPU machine, with the library built (jax_w4a8/_lib, carried from the build machine).
# Each step runs under its own time limit (killed past it) and logs to $OUT/STEP.log (default /tmp/device_check); the
# console gets each step's exit status and last lines. STEPS picks steps by name prefix (default: all), e.g.
#   STEPS="sanitizer plan" OUT=$OUT benchmarks/experiments/device_check.sh
# The whole list takes longer than one device call (600 s): run it in two, STEPS="sanitizer plan" (at most 570 s),
# then STEPS="prefill decode_stalls" (570 s). An inner timeout runs in the foreground (in the step's process group), so
# a step killed at its limit leaves no profiler behind. LIMIT_<step>=SECONDS shortens a step (an A/B's deadline follows it), e.g.
#   LIMIT_prefill_ab=280 STEPS=prefill OUT=$OUT benchmarks/experiments/device_check.sh
set -u
OUT=${OUT:-/tmp/device_check}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
STEPS=${STEPS:-"sanitizer plan prefill decode_stalls"}
# Package copies whose _lib holds other builds (carry them too; their steps are skipped when missing):
# BASE = main before the forty-first session's int4 -> e4m3 selector change (.carry/variants/base), VARIANT = main
# with einsum_decode_plan.patch applied (.carry/variants/einsum_plan). Recipe: benchmarks/experiments/README.md.
BASE=${BASE:-.carry/variants/base}
VARIANT=${VARIANT:-.carry/variants/einsum_plan}

wanted() { local s; for s in $STEPS; do [[ $1 == "$s"* ]] && return 0; done; return 1; }
step() {  # step NAME LIMIT_S COMMAND...; LIMIT_<NAME>=S in the environment overrides the limit
  local name=$1 over="LIMIT_$1"
  local limit=${!over:-$2}
  shift 2
  wanted "$name" || return 0
  echo "=== $name $(date +%T) (limit ${limit} s)"
  timeout -s KILL "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "rc $?"
  grep -v -i "warn" "$OUT/$name.log" | tail -n 8
}

nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader
# 1. every handler under memcheck, racecheck and synccheck, the grouped decode kernel included, through the test
#    that first fills a JAX compilation cache (run bare, the forty-first session's racecheck stopped while XLA loaded
#    an executable under it, as in the eighteenth session)
step sanitizer 300 python3 -m pytest -q -m gpu tests/test_sanitizer.py
# 2. the einsum decode plan's two-warp blocks for q_b: kernel alone under ncu (main, then the patch), then its GPU
#    tests with its modules in
if [[ -d $VARIANT/jax_w4a8/_lib ]]; then
  plan_ncu() {
    local c b
    for c in q_b1 qkv_a1 shared_up1; do for b in . "$VARIANT"; do
      echo "## $c $b"
      PYTHONPATH=$b timeout --foreground 70 ncu --clock-control none --kernel-name regex:Fp8Decode --metrics gpu__time_duration.sum \
        python3 benchmarks/profile_case.py "$c" --calls 4 2>&1 | grep -E "^  [A-Za-z_].*\(|gpu__time_duration"
    done; done
  }
  export -f plan_ncu && export VARIANT
  step plan_ncu 150 bash -c plan_ncu  # timeout runs programs, not shell functions
  if wanted plan_tests; then
    mkdir -p "$OUT/main_lib" && cp jax_w4a8/_lib/*.so "$OUT/main_lib/" && cp "$VARIANT"/jax_w4a8/_lib/*.so jax_w4a8/_lib/
    step plan_tests 120 python3 scripts/gpu_tests.py --shards 8 tests/test_fp8_einsum.py -m gpu -k decode
    cp "$OUT"/main_lib/*.so jax_w4a8/_lib/ && rm -rf "$OUT/main_lib"
  fi
fi
# 3. the int4 -> e4m3 selector change at prefill on the power-capped H200 (timing loop, alternating processes)
if [[ -d $BASE/jax_w4a8/_lib ]]; then
  prefill_limit=${LIMIT_prefill_ab:-300}
  step prefill_ab "$prefill_limit" python3 benchmarks/ab_builds.py main="$BASE" sel=. --cases prefill --rounds 3 \
    --deadline $((prefill_limit - 30))
fi
# 4. what sets the f16 decode tiles' pace at 2.3 TB/s (not the integer pipe: NOTEBOOK, forty-second session): stall
#    reasons and issue activity of the grouped GEMM's kernel at 512 rows, per SASS line (ncu_summary.py)
decode_stalls() {
  local c
  for c in decode512 down512; do
    ncu --clock-control none --kernel-name regex:HopperGemmKernel --launch-skip 1 --launch-count 1 \
      --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section SourceCounters \
      -f -o "$OUT/$c" python3 benchmarks/profile_case.py "$c" > /dev/null
    ncu --import "$OUT/$c.ncu-rep" --page details > "$OUT/$c.details.txt"
    ncu --import "$OUT/$c.ncu-rep" --page source --print-source sass --csv > "$OUT/$c.csv"
    echo "## $c" && python3 benchmarks/ncu_summary.py "$OUT/$c.csv" --top 20 && rm -f "$OUT/$c.csv"
  done
}
export -f decode_stalls && export OUT
step decode_stalls 270 bash -c decode_stalls
# keep the parallel test runs' per-shard logs (gpu_tests.py writes them under /tmp)
cat /tmp/gpu_tests_*/* > "$OUT/gpu_tests_shards.log" 2>/dev/null
echo "=== end $(date +%T)"
