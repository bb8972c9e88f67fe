#!/usr/bin/env bash
# The prepared GPU checks of benchmarks/experiments/README.md ("Waiting for a device") in a few device calls: run
# from the repository root on the GPU machine, with the library built (jax_w4a8/_lib, carried from the build
# machine). Each step runs under its own time limit (killed past it) and logs to $OUT/STEP.log (default
# /tmp/device_check); the console gets each step's exit status and last lines. STEPS picks steps by name prefix
# (default: all). The whole list takes longer than one device call (600 s): run it in calls of at most 600 s, e.g.
#   STEPS="decode_stalls decode_tiles" OUT=$OUT benchmarks/experiments/device_check.sh      (470 s)
#   STEPS="variant prefill" LIMIT_variant_ab=180 LIMIT_prefill_ab=150 OUT=$OUT ...            (570 s)
# LIMIT_<step>=SECONDS shortens a step (an A/B's deadline follows it). An inner timeout runs in the foreground (in
# the step's process group), so a step killed at its limit leaves no profiler behind.
set -u
OUT=${OUT:-/tmp/device_check}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
STEPS=${STEPS:-"cmdbuf sanitizer einsum_tests variant_tests variant_ab prefill decode_stalls decode_tiles variant_ncu l1_survey"}
# Package copies whose _lib holds another build (carry them too; their steps are skipped when missing): BASE = main
# before the forty-first session's int4 -> e4m3 selector change (.carry/variants/base). Recipe:
# benchmarks/experiments/README.md.
BASE=${BASE:-.carry/variants/base}
# VARIANT = main with a patch of this folder applied, for the steps variant_tests and variant_ab (the A/B times
# VARIANT_CASES of ab_builds.py, default decode): none by default (fused_wide.patch, the last default, landed in the
# fifty-sixth session). Build: build_variant.sh PATCH NAME.
# AB_VARIANTS (space-separated folders, default VARIANT) puts several copies in the one A/B, e.g.
# AB_VARIANTS=".carry/variants/half16 .carry/variants/scalepf".
VARIANT=${VARIANT:-}

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
# Package copies carried packed (tar cJf .carry/bundle.tar.xz .carry/variants/...: the CUDA modules compress 5x, so
# four copies fit a call's carry beside jax_w4a8/_lib) are unpacked here.
[[ -f .carry/bundle.tar.xz ]] && tar xJf .carry/bundle.tar.xz
# 0c. the kernels' first call of a process inside a command buffer XLA records (tests/command_buffer_case.py), five
#     processes sharing the GPU as in the other GPU test runs (each child process inherits its shard's memory cap)
step cmdbuf 150 python3 scripts/gpu_tests.py --shards 8 tests/test_fp8_einsum.py tests/test_w4a8_grouped_gemm.py \
  -k first_call_inside -m gpu
# 1. every handler under memcheck, racecheck and synccheck, the grouped decode kernel included, through the test
#    that first fills a JAX compilation cache (run bare, the forty-first session's racecheck stopped while XLA loaded
#    an executable under it, as in the eighteenth session)
step sanitizer 300 python3 -m pytest -q -m gpu tests/test_sanitizer.py
# 1b. the einsum's GPU tests on main's build
step einsum_tests 150 python3 scripts/gpu_tests.py --shards 8 tests/test_fp8_einsum.py -m gpu
# A package copy's whole package (its Python modules may differ too) in the checkout's place for its tests (python -m
# pytest puts the checkout ahead of PYTHONPATH), then the checkout's back.
package_in() { rm -rf "$OUT/main_pkg" && cp -r jax_w4a8 "$OUT/main_pkg" && cp -r "$1"/jax_w4a8/. jax_w4a8/; }
package_out() { rm -rf jax_w4a8 && mv "$OUT/main_pkg" jax_w4a8; }
# variant_checks FOLDER LIMIT_S TEST_FILE...: the copy's GPU tests of those files (none where LIMIT_S is 0), then
# racecheck and synccheck (whole report in $OUT/sanitizer_NAME.log; unbuffered, so a run killed at its limit
# still shows how far it got)
variant_checks() {
  package_in "$1"
  (($2)) && timeout --foreground "$2" python3 scripts/gpu_tests.py --shards 8 "${@:3}" -m gpu 2>&1 | tail -n 9
  timeout --foreground ${SANITIZER_LIMIT:-220} python3 -u -m pytest -q -m gpu tests/test_sanitizer.py \
    -k "racecheck or synccheck" > "$OUT/sanitizer_$(basename "$1").log" 2>&1
  echo "sanitizer rc $?" && tail -n 3 "$OUT/sanitizer_$(basename "$1").log"
  package_out
}
export -f package_in package_out variant_checks
# 1c. the variant: the grouped GEMM's GPU tests with its modules in, then a same-machine A/B at decode
if [[ -d $VARIANT/jax_w4a8/_lib ]]; then
  if wanted variant_tests; then
    package_in "$VARIANT"
    step variant_tests 330 python3 scripts/gpu_tests.py --shards 8 tests/test_w4a8_grouped_gemm.py \
      tests/test_w4a8_moe_up.py -m gpu
    package_out
  fi
fi
# AB_VARIANTS: the package copies the A/B times against main, each named by its folder (default: VARIANT)
ab_builds=()
for v in ${AB_VARIANTS:-$VARIANT}; do [[ -d $v/jax_w4a8/_lib ]] && ab_builds+=("$(basename "$v")=$v"); done
if ((${#ab_builds[@]})); then
  variant_limit=${LIMIT_variant_ab:-240}
  step variant_ab "$variant_limit" python3 benchmarks/ab_builds.py main=. "${ab_builds[@]}" --cases ${VARIANT_CASES:-decode} \
    --rounds 4 --deadline $((variant_limit - 30))
fi
# 2. the int4 -> e4m3 selector change at prefill on the power-capped H200 (timing loop, alternating processes)
if [[ -d $BASE/jax_w4a8/_lib ]]; then
  prefill_limit=${LIMIT_prefill_ab:-300}
  step prefill_ab "$prefill_limit" python3 benchmarks/ab_builds.py main="$BASE" sel=. --cases prefill --rounds 3 \
    --deadline $((prefill_limit - 30))
fi
# launch_skip CASE: ncu's --launch-skip for the grouped GEMM kernel of profile_case.py CASE's second call (the
# folding cases launch the plain kernel after the folding one, and it exits at once)
launch_skip() { [[ $1 == *_fold ]] && echo 2 || echo 1; }
export -f launch_skip
# 3. what sets the f16 decode tiles' pace at 2.3 TB/s (not the integer pipe: NOTEBOOK, forty-second session): stall
#    reasons and issue activity of the grouped GEMM's kernel at 512 rows, per SASS line (ncu_summary.py)
decode_stalls() {
  local c
  for c in $STALL_CASES; do
    # stall reasons per SASS line, and the DRAM throughput, issue activity and occupancy of the same launch
    ncu --clock-control none --kernel-name regex:HopperGemmKernel --launch-skip "$(launch_skip "$c")" --launch-count 1 \
      --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section SourceCounters \
      --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis \
      -f -o "$OUT/$c" python3 benchmarks/profile_case.py "$c" > /dev/null
    ncu --import "$OUT/$c.ncu-rep" --page details > "$OUT/$c.details.txt"
    ncu --import "$OUT/$c.ncu-rep" --page source --print-source sass --csv > "$OUT/$c.csv"
    echo "## $c" && python3 benchmarks/ncu_summary.py "$OUT/$c.csv" --top 20 && rm -f "$OUT/$c.csv"
    grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Executed Ipc A|Issue Slots Busy|L2 Hit" \
      "$OUT/$c.details.txt"
  done
}
export -f decode_stalls && export OUT STALL_CASES=${STALL_CASES:-"decode512 down512"}  # e.g. fused512 too
step decode_stalls 270 bash -c decode_stalls
# 4. the same kernel at other token tiles and MMA formats: kernel time, DRAM and L2 throughput, L2 read sectors
#    (activation bytes through L2 grow with the tile: f16 rows of 2 bytes per K against 64 int4 bytes per K)
kernel_counters() {  # kernel_counters LIMIT_S CASE [profile_case.py options]: one launch of the grouped GEMM kernel
  timeout --foreground "$1" ncu --clock-control none --kernel-name regex:HopperGemmKernel \
    --launch-skip "$(launch_skip "$2")" --launch-count 1 \
    --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_srcunit_tex_op_read.sum,dram__bytes_read.sum,sm__inst_executed.avg.per_cycle_active \
    python3 benchmarks/profile_case.py "${@:2}" 2>&1 | grep -E "HopperGemmKernel<|__"
}
decode_tiles() {
  local c o
  for c in $TILE_CASES; do for o in "" "--tile-tokens 16" "--tile-tokens 64" "--mma e4m3"; do
    echo "## $c $o"
    kernel_counters 40 "$c" $o
  done; done
}
export -f kernel_counters decode_tiles && export TILE_CASES=${TILE_CASES:-decode512 down512}  # the cases it profiles
step decode_tiles 200 bash -c decode_tiles
# 5. the same counters for main's build and the variant's, at the plan's tile
# time_builds LIMIT_S "CASES" PACKAGE...: kernel_counters of each case for each package copy that is there (main's
# is $PWD), cases outermost
time_builds() {
  local c pkg
  for c in $2; do for pkg in "${@:3}"; do
    [[ -d $pkg/jax_w4a8/_lib ]] || continue
    echo "## $c ${pkg#$PWD}"
    PYTHONPATH=$pkg kernel_counters "$1" "$c"
  done; done
}
variant_ncu() { time_builds 90 "$TILE_CASES" "$PWD" "$PWD/$VARIANT"; }
export -f time_builds variant_ncu && export VARIANT
[[ -d $VARIANT/jax_w4a8/_lib ]] && step variant_ncu 300 bash -c variant_ncu
# 5b. fused up-projection variants (FUSED_VARIANTS: package copies, none by default; fifty-first to fifty-third
#     sessions): each one's fused GPU tests (FUSED_TESTS, default tests/test_w4a8_moe_up.py; FUSED_TESTS_LIMIT s,
#     default 150) and racecheck / synccheck with its package in the checkout's place,
#     then the fused kernel's time beside main's (kernel alone, fused512, fused1024 and fused64). About 300 s on
#     an H100 for one variant: a call of its own.
fused_variants() {
  local v
  for v in $FUSED_VARIANTS; do
    [[ -d $v/jax_w4a8/_lib ]] || continue
    echo "## $(basename "$v"): tests, racecheck, synccheck"
    variant_checks "$v" "${FUSED_TESTS_LIMIT:-150}" ${FUSED_TESTS:-tests/test_w4a8_moe_up.py}
  done
  time_builds 40 "fused512 fused1024 fused64" "$PWD" $FUSED_VARIANTS
}
export -f fused_variants && export FUSED_VARIANTS=${FUSED_VARIANTS:-}
[[ -n $FUSED_VARIANTS ]] && step fused_variants 560 bash -c fused_variants
# 5c. timing-only builds (EPI_PROBES, default fused_epilogue_probes.py's noepi, .carry/variants/epi_noepi, where
#     carried): each one's time beside main's (kernel alone, EPI_CASES: the fused kernel and the plain gate+up GEMM
#     at M = 512). Codes are wrong in the probes: no tests here. About 40 s per build and case on an H100.
#     Fifty-third session (H100, fused512): without SiLU, barriers or stores each 192-196 us, main 194-196.
epi_probes() { time_builds 40 "$EPI_CASES" "$PWD" $EPI_PROBES; }
export -f epi_probes
export EPI_PROBES=${EPI_PROBES:-.carry/variants/epi_noepi}
export EPI_CASES=${EPI_CASES:-"fused512 decode512"}
step epi_probes 450 bash -c epi_probes
# 5d. the model's fused up-projection (DeepseekV3ForCausalLM.set_moe_up, fifty-fourth session; main's build): its GPU
#     tests, then a 2-layer W4A8 model at V3 widths, unfused vs fused on the same weights in one process (decode at
#     MOE_UP_BATCHES, prefill at MOE_UP_PREFILL tokens; MOE_UP_SCALES=--ue8m0, the default, or empty: float32
#     scales). Not in the default STEPS: STEPS=moe_up (about 300 s).
moe_up() {
  timeout --foreground 150 python3 -m pytest -q -m gpu tests/test_deepseek_layers.py tests/test_deepseek_model.py \
    -k "fused_up or moe_up" 2>&1 | tail -n 5
  python3 benchmarks/bench_generate.py --layers 2 --variants w4a8 --moe-up unfused fused $MOE_UP_SCALES --batches $MOE_UP_BATCHES \
    --prefill $MOE_UP_PREFILL --out "$OUT/moe_up" 2>&1 | grep -v -i warn | tail -n 12
}
export -f moe_up
export MOE_UP_BATCHES=${MOE_UP_BATCHES:-"1 16 32 64 128"} MOE_UP_PREFILL=${MOE_UP_PREFILL:-1024} MOE_UP_SCALES=${MOE_UP_SCALES---ue8m0}
step moe_up 420 bash -c moe_up
# 5e. UE8M0 models without per-step code encoding (fifty-seventh session: their einsums take the float32 powers of two
#     directly): the model's GPU tests, then a 2-layer W4A8 model with float32 activation scales and one with UE8M0
#     ones (decode at MOE_UP_BATCHES, prefill at MOE_UP_PREFILL tokens), each in its own process. Not in the default
#     STEPS: STEPS=ue8m0 (about 250 s on an H100). Before the change, H100: batch 16 2.52 ms (UE8M0) vs 2.28 ms.
ue8m0() {
  timeout --foreground 150 python3 scripts/gpu_tests.py --shards 8 tests/test_deepseek_model.py \
    tests/test_deepseek_layers.py -m gpu 2>&1 | tail -n 4
  local sc
  for sc in "" --ue8m0; do
    python3 benchmarks/bench_generate.py --layers 2 --variants w4a8 $sc --batches $MOE_UP_BATCHES \
      --prefill $MOE_UP_PREFILL --out "$OUT/ue8m0$sc" 2>&1 | grep -v -i warn | tail -n 8
  done
}
export -f ue8m0
step ue8m0 360 bash -c ue8m0
# 5f. how much of a prefill call the preparation (the UE8M0 activations folded and reordered: a read and a write of x)
#     takes at M = 4096 and 16384 (sixty-second session: sizes the case for a quantizer that writes the folded layout
#     itself): every kernel of profile_case.py's second call with its duration; PREP_PACKAGE=FOLDER times a package
#     copy's build instead of main's (e.g. .carry/variants/asyncfold). Not in the default STEPS: STEPS=prep_share
#     (about 60 s on an H100).
prep_share() {
  local c
  for c in ${PREP_CASES:-prefill4k_fold prefill16k_fold down16k_fold}; do
    echo "## $c"
    PYTHONPATH=${PREP_PACKAGE:-$PWD} timeout --foreground 90 ncu --clock-control none --metrics gpu__time_duration.sum \
      --kernel-name regex:"Prepare|HopperGemmKernel" python3 benchmarks/profile_case.py "$c" 2>&1 \
      | grep -E "Prepare|HopperGemmKernel<|gpu__time_duration" | sed -e "s/(CUtensorMap.*//" | tail -n 12
  done
}
export -f prep_share
step prep_share 300 bash -c prep_share
# 5g. the fold preparation, next (sixty-second session; experiments README 0d / 0e): main's fold GPU tests (a case
#     added after the last GPU run), ASYNC_FOLD's (default .carry/variants/asyncfold, prep_async_fold.patch) with its
#     package in place, the preparation's time for both (prep_share), then the prefill A/B of the two builds. Not in
#     the default STEPS: STEPS=fold_next (about 420 s on an H100; carry jax_w4a8/_lib and the variant).
fold_next() {
  timeout --foreground 100 python3 scripts/gpu_tests.py --shards 8 tests/test_w4a8_grouped_gemm.py -k fold -m gpu 2>&1 \
    | tail -n 7
  [[ -d $ASYNC_FOLD/jax_w4a8/_lib ]] || { echo "no $ASYNC_FOLD: main's tests and preparation only"; prep_share; return; }
  package_in "$ASYNC_FOLD"
  echo "## $ASYNC_FOLD: fold tests"
  timeout --foreground 100 python3 scripts/gpu_tests.py --shards 8 tests/test_w4a8_grouped_gemm.py -k fold -m gpu 2>&1 \
    | tail -n 7
  package_out
  echo "## main" && prep_share
  echo "## $ASYNC_FOLD" && PREP_PACKAGE=$PWD/$ASYNC_FOLD prep_share
  timeout --foreground 150 python3 benchmarks/ab_builds.py main=. async="$ASYNC_FOLD" --cases prefill --rounds 2 \
    --deadline 140 2>&1 | tail -n 12
}
export -f fold_next && export ASYNC_FOLD=${ASYNC_FOLD:-.carry/variants/asyncfold}
step fold_next 540 bash -c fold_next
# 5h. folded activations (sixty-third session: quantize_fp8_groups / silu_mul_quantize_fp8_groups layout="folded",
#     w4a8_grouped_gemm x_layout="folded"): every fold GPU test (quantizers, grouped GEMM, experts, MoE), the
#     interleaved timing of both layouts (benchmarks/bench_folded_layout.py: GEMM, quantizer, quantize + gather +
#     GEMM; JSON in $OUT), then each kernel alone under ncu (FOLDED_NCU=0 skips it): the standard call's
#     preparation + GEMM vs the folded call's GEMM, and the quantizers' two layouts. Not in the default STEPS:
#     STEPS=folded (about 450 s on an H100; carry jax_w4a8/_lib).
folded() {
  timeout --foreground 170 python3 scripts/gpu_tests.py --shards 8 tests/test_quantize_fp8_groups.py \
    tests/test_w4a8_grouped_gemm.py tests/test_deepseek_layers.py -k fold -m gpu 2>&1 | tail -n 12
  timeout --foreground 170 python3 benchmarks/bench_folded_layout.py --out "$OUT" 2>&1 | grep -v -i warn | tail -n 6
  [[ ${FOLDED_NCU:-1} == 0 ]] && return
  local c
  for c in prefill16k_fold prefill16k_folded down16k_fold down16k_folded quantize2k quantize2k_folded silu16k \
           silu16k_folded; do
    echo "## $c"
    timeout --foreground 40 ncu --clock-control none --metrics gpu__time_duration.sum \
      --kernel-name regex:"Prepare|HopperGemmKernel|Quantize" python3 benchmarks/profile_case.py "$c" 2>&1 \
      | grep -E "Prepare|HopperGemmKernel<|Quantize|gpu__time_duration" | sed -e "s/(CUtensorMap.*//" | tail -n 8
  done
}
export -f folded
step folded 540 bash -c folded
# 5i. expert parallelism's padded buffers on one GPU (sixty-fourth session; benchmarks/bench_ep_buffer.py): one EP8
#     shard's experts on the real rows alone, in the padded buffer planned for the real rows (the model's way since
#     the sixty-fourth session) and planned from the buffer (before), 64 to 16384 tokens; JSON in $OUT. Not in the
#     default STEPS: STEPS=ep_buffer (sixty-fifth session, H100: the 64-token case alone took the 300 s while the
#     weights were compiled into every program; they are arguments now; carry jax_w4a8/_lib).
step ep_buffer 300 python3 benchmarks/bench_ep_buffer.py --out "$OUT"
# 5j. the acceptance tables of issues #3 and #4 in one call (sixty-fifth session, H100: 361 s + 150 s): the grouped
#     GEMM's and the einsum's, JSON (and the grouped GEMM's plot) in $OUT; `--report` renders them into RESULTS.md
#     (into the section of the card they ran on). Not in the default STEPS: STEPS=tables (carry jax_w4a8/_lib).
step tables_grouped_gemm 420 python3 benchmarks/bench_grouped_gemm.py --quick --peers fast --out "$OUT"
step tables_fp8_einsum 170 python3 benchmarks/bench_fp8_einsum.py --quick --out "$OUT"
# 6. where else L1 misses cost L2 traffic (forty-ninth session: the 32-token wide tile's weight-scale loads hit L1
#    38% of the time in the 228 KiB shared-memory configuration, 87% in the 196 KiB one): per kernel of the main
#    decode cases (main's build, or L1_BUILD's), the L1 hit rate of its global loads, their sectors and misses, the
#    shared-memory configuration and the L2 read sectors from the SMs
l1_survey() {
  local c
  for c in $L1_CASES; do
    echo "## $c"
    PYTHONPATH=$PWD/${L1_BUILD:-.} timeout --foreground 50 ncu --clock-control none \
      --kernel-name regex:"HopperGemmKernel|Fp8Decode" --launch-skip "$(launch_skip "$c")" --launch-count 1 \
      --metrics gpu__time_duration.sum,l1tex__t_sector_hit_rate.pct,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld_lookup_miss.sum,launch__shared_mem_config_size,lts__t_sectors_srcunit_tex_op_read.sum \
      python3 benchmarks/profile_case.py "$c" 2>&1 | grep -E "Kernel<|Kernel\(|__"
  done
}
export -f l1_survey && export L1_CASES=${L1_CASES:-"fused64 fused512 decode64 top8_up1 o_proj1 square64 q_b1"}
step l1_survey 300 bash -c l1_survey
# keep the parallel test runs' per-shard logs (gpu_tests.py writes them under /tmp)
cat /tmp/gpu_tests_*/* > "$OUT/gpu_tests_shards.log" 2>/dev/null
echo "=== end $(date +%T)"
