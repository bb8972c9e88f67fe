"""The profiling helpers in benchmarks/: ncu_summary.py on a synthetic ncu export with known answers, and
profile_case.py's cases on the CPU handlers (under ncu they run the CUDA kernels)."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
          "Instructions Executed", "stall_long_sb", "stall_wait", "stall_long_sb (Not Issued)"]
# A loop of three lines run 100 times (one of them a stalled barrier wait), a prologue line run 4 times.
LINES = [["0x00", "LDC R1, c[0x0][0x28]", "2", "1", "4", "0", "2", "0"],
         ["0x10", "LOP3.LUT R7, R7, R64, RZ, 0x3c, !PT", "8", "2", "100", "1", "7", "1"],
         ["0x20", "@!P0  BRA 0x7f655f7c79e0", "60", "50", "100", "58", "2", "50"],
         ["0x30", "HGMMA.64x16x16.F32 R24, R32, gdesc[UR4], RZ, !UPT", "30", "20", "100", "0", "30", "0"]]


def _run(args):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}, timeout=300)


def test_ncu_summary_reports_shares_regions_and_top_lines(tmp_path):
    path = tmp_path / "k.csv"
    rows = ['"==PROF== a preamble line"', ",".join(f'"{c}"' for c in HEADER)]
    rows += [",".join(f'"{c}"' for c in line) for line in LINES]
    path.write_text("\n".join(rows) + "\n")
    r = _run([os.path.join(BENCH, "ncu_summary.py"), str(path), "--top", "2"])
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "4 SASS lines, 304 warp instructions executed, 100 stall samples" in out
    # stall reasons over the issued-or-not columns of the plain names: long_sb 59, wait 41 of 100
    assert "long_sb 59.0%" in out and "wait 41.0%" in out
    # the 100x region: 3 lines, 300 of 304 instructions, 98 of 100 samples
    assert "executed        100x     3 lines from line     1:  98.7% of instructions,  98.0% of stall samples" in out
    top = out.split("top 2 lines")[1].splitlines()[1:]
    assert len(top) == 2 and "60.0%" in top[0] and "BRA" in top[0] and "long_sb" in top[0]
    assert "30.0%" in top[1] and "HGMMA" in top[1] and "wait" in top[1]


def test_profile_case_runs_each_case_and_refuses_unknown_ones():
    for case, calls in (("kv_a1", []), ("absorb_o1", ["--calls", "1"]), ("absorb_q1", ["--calls", "3"])):
        r = _run([os.path.join(BENCH, "profile_case.py"), case, *calls])
        assert r.returncode == 0, r.stderr
    r = _run([os.path.join(BENCH, "profile_case.py"), "nope"])
    assert r.returncode != 0 and "invalid choice" in r.stderr


def test_profile_case_top8_puts_one_row_on_each_of_eight_experts():
    sys.path.insert(0, BENCH)
    try:
        import profile_case
    finally:
        sys.path.remove(BENCH)
    import jax
    x, xs, w, ws, sizes = profile_case._top8_case(jax.random.key(1), 256, 256, e=32)
    sizes = np.asarray(sizes)
    assert x.shape == (8, 256) and w.shape == (32, 256, 128) and sizes.sum() == 8
    assert sorted(np.flatnonzero(sizes)) == [0, 4, 8, 12, 16, 20, 24, 28]


def test_back_to_back_prints_the_three_loop_times():
    r = _run([os.path.join(BENCH, "back_to_back.py"), "--shape", "64", "256", "--calls", "3", "--floor"])
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[1].startswith("xla v*2 (128) ") and lines[2].startswith("custom call (quantize 128) ")
    words = lines[-1].split()  # "64x256 chain C | independent I | slope S"
    assert words[0] == "64x256" and [words[1], words[4], words[7]] == ["chain", "independent", "slope"]
    chain, independent = float(words[2]), float(words[5])
    assert chain > 0 and independent > 0
    float(words[8])  # the slope: a difference of two timings, any sign on a busy CPU


def _build_folder(tmp_path):
    """A self-contained build folder for ab_builds.py: this package's sources plus the compiled modules it
    imports (an editable install keeps those outside the checkout)."""
    import importlib
    import shutil

    dst = tmp_path / "build"
    shutil.copytree(os.path.join(ROOT, "jax_w4a8"), dst / "jax_w4a8",
                    ignore=shutil.ignore_patterns("__pycache__", "assets", "*.so"))
    for name in ("_ffi_cpu", "_ffi_cuda"):
        try:
            module = importlib.import_module(f"jax_w4a8._lib.{name}")
        except ImportError:
            continue
        shutil.copy(module.__file__, dst / "jax_w4a8" / "_lib")
    return str(dst)


def _bench_module(relpath):
    """A script under benchmarks/ (relpath, e.g. "experiments/fused_epilogue_probes.py") imported as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(pathlib.Path(relpath).stem, os.path.join(BENCH, relpath))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _ab_module():
    return _bench_module("ab_builds.py")


def test_ab_builds_times_a_case_of_two_sets_once(monkeypatch):
    monkeypatch.syspath_prepend(BENCH)  # the worker's imports (probe_kernels, profile_case)
    ab = _ab_module()
    labels = [label for label, *_ in ab._cases(["tiny", "tiny"])]
    assert labels == ["tiny grouped M=16", "tiny einsum M=8"]


def test_ab_builds_summary_medians_ratios_and_output_check():
    ab = _ab_module()
    results = {"a": [[{"case": "c1", "us": [10.0, 12.0], "checksum": 5.0}],
                     [{"case": "c1", "us": [11.0, 30.0], "checksum": 5.0}]],
               "b": [[{"case": "c1", "us": [9.0, 9.5], "checksum": 5.0}],
                     [{"case": "c1", "us": [8.0, 20.0], "checksum": 6.0}]]}
    table = ab.summarize({"a": ".", "b": "."}, results).splitlines()
    assert table[0] == "| case | a us | b us | b / a | outputs |"
    # process medians a 11.0, 20.5 -> 15.75; b 9.25, 14.0 -> 11.625; ratio 0.738; b's second process changed
    # its checksum
    # (6 - 5) / 6; no star: b's 14.0 lies within a's 11.0 .. 20.5
    assert table[2] == "| c1 | 15.8 (11.0, 20.5) | 11.6 (9.2, 14.0) | 0.738 | DIFFER by 1.7e-01 |"
    assert table[-1].startswith("Ratios with a star: every process of that build was faster")
    # another summation order moves the checksum a little; a NaN output has no relative size
    for b_sum, label in ((4000.4, "DIFFER by 1.0e-04"), (float("nan"), "DIFFER by inf"), (4000.0, "equal")):
        results = {"a": [[{"case": "c1", "us": [1.0], "checksum": 4000.0}]],
                   "b": [[{"case": "c1", "us": [1.0], "checksum": b_sum}]]}
        assert ab.summarize({"a": ".", "b": "."}, results).splitlines()[2].endswith(f"| {label} |")
    # every process of b below every one of a: starred (one process each is never starred: no spread to judge)
    results = {"a": [[{"case": "c1", "us": [10.0], "checksum": 1.0}], [{"case": "c1", "us": [12.0], "checksum": 1.0}]],
               "b": [[{"case": "c1", "us": [9.0], "checksum": 1.0}], [{"case": "c1", "us": [9.5], "checksum": 1.0}]]}
    assert "| 0.841* | equal |" in ab.summarize({"a": ".", "b": "."}, results)


def test_ab_builds_summary_of_traced_kernel_times():
    """--kernel-time rows: the wall-clock table, then the same table over each process's traced kernel time."""
    ab = _ab_module()
    results = {"a": [[{"case": "c1", "us": [10.0, 12.0], "checksum": 5.0, "kernel_us": 8.0}],
                     [{"case": "c1", "us": [11.0, 13.0], "checksum": 5.0, "kernel_us": 9.0}]],
               "b": [[{"case": "c1", "us": [9.0, 9.5], "checksum": 5.0, "kernel_us": 6.0}],
                     [{"case": "c1", "us": [8.0, 10.0], "checksum": 5.0, "kernel_us": 7.0}]]}
    lines = ab.summarize({"a": ".", "b": "."}, results).splitlines()
    assert lines[2] == "| c1 | 11.5 (11.0, 12.0) | 9.1 (9.2, 9.0) | 0.793* | equal |"
    k = lines.index("| case | a kernel us | b kernel us | b / a | outputs |")
    assert lines[k - 2].startswith("Kernel time per call (the device busy with some kernel")
    assert lines[k + 2] == "| c1 | 8.5 (8.0, 9.0) | 6.5 (6.0, 7.0) | 0.765* | equal |"


def test_ab_builds_refuses_one_library_given_twice(tmp_path):
    folder = _build_folder(tmp_path)
    r = _run([os.path.join(BENCH, "ab_builds.py"), f"a={folder}", f"b={folder}", "--cases", "tiny"])
    assert r.returncode != 0 and "run the same library" in r.stderr, r.stderr[-2000:]
    r = _run([os.path.join(BENCH, "ab_builds.py"), f"a={ROOT}", f"b={BENCH}"])
    assert r.returncode != 0 and "FOLDER/jax_w4a8/__init__.py" in r.stderr


def test_ab_builds_times_every_build_in_alternating_processes(tmp_path):
    folder = _build_folder(tmp_path)
    r = _run([os.path.join(BENCH, "ab_builds.py"), f"a={folder}", f"b={folder}", "--cases", "tiny", "--rounds", "2",
              "--timings", "1", "--allow-same", "--kernel-time", "--out", str(tmp_path)])
    assert r.returncode == 0, r.stderr[-2000:]
    order = [line.split(":")[0] for line in r.stdout.splitlines() if line.startswith("round")]
    assert order == ["round 0 a", "round 0 b", "round 1 b", "round 1 a"]
    data = json.loads((tmp_path / "ab_builds.json").read_text())
    assert data["builds"]["a"]["source_sha256"] == data["builds"]["b"]["source_sha256"]
    for name in ("a", "b"):
        assert [[row["case"] for row in rnd] for rnd in data["results"][name]] == [
            ["tiny grouped M=16", "tiny einsum M=8"]] * 2
        assert all(len(row["us"]) == 1 and row["us"][0] > 0 for rnd in data["results"][name] for row in rnd)
    assert data["table"].count("| equal |") == 2
    # --kernel-time: one profiled loop per case; the CPU records no device kernels, and the summary says so
    assert all(row["kernel_us"] is None for name in ("a", "b") for rnd in data["results"][name] for row in rnd)
    assert data["table"].endswith("Kernel time per call: no device kernels traced (a CPU run, or a profiler without "
                                  "CUPTI).")


def test_ab_builds_worker_timeout_keeps_the_complete_rounds(tmp_path, monkeypatch, capsys):
    """A worker that runs past its time in a later round ends the run with the complete rounds' summary; in the
    first round it is an error."""
    ab = _ab_module()
    folders = []
    for name in ("a", "b"):
        (tmp_path / name / "jax_w4a8").mkdir(parents=True)
        (tmp_path / name / "jax_w4a8" / "__init__.py").write_text("")
        folders.append(f"{name}={tmp_path / name}")
    calls = []

    def fake_run_build(folder, names, timings, timeout, kernel_time=False):
        info = {"module": "m", "platform": "cpu", "source_sha256": "s"}
        if names:
            calls.append(pathlib.Path(folder).name)
            if len(calls) == fail_at:
                raise ab.WorkerTimeout(f"build {folder}: worker ran past {timeout:.0f} s")
        return info, [{"case": "c", "us": [float(len(calls))], "checksum": 1.0}] if names else []

    monkeypatch.setattr(ab, "run_build", fake_run_build)
    fail_at = 4  # round 1 runs b, then a: a times out after b's row is in
    assert ab.main([*folders, "--rounds", "3", "--allow-same", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "stopped in round 1: the summary covers the 1 complete round(s)" in out
    assert "| c | 1.0 (1.0) | 2.0 (2.0) | 2.000 | equal |" in out
    data = json.loads((tmp_path / "ab_builds.json").read_text())
    assert data["rounds"] == 1 and [len(data["results"][n]) for n in ("a", "b")] == [1, 1]
    calls.clear()
    fail_at = 2  # the first round's second worker
    with pytest.raises(ab.WorkerTimeout):
        ab.main([*folders, "--rounds", "3", "--allow-same"])


def test_ab_builds_deadline_keeps_the_complete_rounds(tmp_path):
    """--deadline: no round starts that would end past it; the summary and the JSON hold the complete rounds."""
    folder = _build_folder(tmp_path)
    r = _run([os.path.join(BENCH, "ab_builds.py"), f"a={folder}", f"b={folder}", "--cases", "tiny", "--rounds", "3",
              "--timings", "1", "--allow-same", "--deadline", "0.5", "--out", str(tmp_path)])
    assert r.returncode == 0, r.stderr[-2000:]
    order = [line.split(":")[0] for line in r.stdout.splitlines() if line.startswith("round")]
    assert order == ["round 0 a", "round 0 b"]
    assert "stopped after 1 of 3 rounds (--deadline 0.5 s)" in r.stdout
    assert "note: 1 rounds, so build a ran first once more than the others" in r.stdout
    data = json.loads((tmp_path / "ab_builds.json").read_text())
    assert data["rounds"] == 1 and all(len(data["results"][n]) == 1 for n in ("a", "b"))
    assert data["table"].count("| equal |") == 2 and data["table"] in r.stdout


def _common():
    sys.path.insert(0, BENCH)
    try:
        import _common
    finally:
        sys.path.remove(BENCH)
    return _common


def test_bench_alternating_interleaves_the_rounds_and_times_each_function():
    """benchmarks/_common.bench_alternating: every function compiled once, its rounds interleaved with the others'
    (A B, B A, A B: a drift in the process weighs on both), one median per function."""
    import jax
    import jax.numpy as jnp

    C = _common()
    log = []
    x = jnp.arange(64, dtype=jnp.float32)

    def traced(name, f):
        def fn(v):
            jax.debug.callback(lambda: log.append(name))  # once per call of the program's n chained calls
            return f(v)
        return fn

    got = C.bench_alternating({"a": (traced("a", lambda v: v * 2), [(x,)]), "b": (traced("b", jnp.sin), [(x,)])},
                              rounds=3, min_program_s=0.0)
    assert set(got) == {"a", "b"} and all(0 < t < 1 for t in got.values()), got
    runs = [name for i, name in enumerate(log) if i == 0 or log[i - 1] != name]  # one entry per program launch
    # two launches each to compile, warm and size n (a a, b b), then the rounds a b | b a | a b: the b b and a a at
    # the round boundaries merge, so the runs read a b a b a b (always a before b would read a b a b a b a b)
    assert runs == ["a", "b", "a", "b", "a", "b"] and log.count("a") == log.count("b") == 5 * 10, (runs, len(log))


def test_bench_device_loop_runs_every_input_set():
    """benchmarks/_common.bench: the timed program's n chained calls cover every one of its input sets, also more than
    the 10 calls it starts from (a benchmark that rotates weight sets past the L2 lists as many as it needs), and
    stay a multiple of their count when raised."""
    import jax
    import jax.numpy as jnp

    C = _common()
    used = []
    sets = [(jnp.full((8,), i, jnp.float32),) for i in range(12)]

    def fn(v):
        jax.debug.callback(lambda i: used.append(int(i)), v[0])
        return v * 2

    run, n = C._device_loop(fn, sets, None, 0.0, 200)  # min_program_s 0: n is not raised for time
    assert n >= len(sets), n
    used.clear()
    run()
    assert sorted(set(used)) == list(range(12)), used
    _, n = C._device_loop(fn, sets, None, 10.0, 30)  # raised for time, capped at max_n: still every set
    assert n >= len(sets), n


def _trace(spans):
    """A perfetto trace dict: kernels (stream, name, start, duration) on /device:GPU:0, plus one host event."""
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/device:GPU:0"}}]
    events = meta + [{"ph": "X", "pid": 7, "tid": t, "ts": ts, "dur": d, "name": n} for t, n, ts, d in spans[::-1]]
    return {"traceEvents": events + [{"ph": "X", "pid": 1, "tid": 3, "ts": 1, "dur": 99, "name": "a"}]}


def test_device_kernels_keeps_the_stream_threads_of_a_device_that_names_them():
    C = _common()
    trace = _trace([(3, "k", 0, 10), (4, "fusion.1", 0, 10), (5, "jit_step(1)", 0, 12)])
    trace["traceEvents"] += [{"ph": "M", "pid": 7, "tid": t, "name": "thread_name", "args": {"name": n}}
                             for t, n in ((3, "Stream #13(Kernel)"), (4, "XLA Ops"), (5, "XLA Modules"))]
    assert [k[1] for k in C.device_kernels(trace)] == ["k"]


def test_device_kernels_takes_one_device_when_asked():
    C = _common()
    trace = _trace([(3, "k0", 0, 10)])
    trace["traceEvents"] += [{"ph": "M", "pid": 8, "name": "process_name", "args": {"name": "/device:GPU:1"}},
                             {"ph": "M", "pid": 9, "name": "process_name", "args": {"name": "/device:GPU:10"}},
                             {"ph": "X", "pid": 8, "tid": 3, "ts": 0, "dur": 5, "name": "k1"},
                             {"ph": "X", "pid": 9, "tid": 3, "ts": 0, "dur": 5, "name": "k10"}]
    assert sorted(k[1] for k in C.device_kernels(trace)) == ["k0", "k1", "k10"]
    assert [k[1] for k in C.device_kernels(trace, device=0)] == ["k0"]
    assert [k[1] for k in C.device_kernels(trace, device=1)] == ["k1"]


def test_trace_summary_times_each_kernel_and_the_gap_after_it():
    C = _common()
    # stream 3: a (10 us), gap 2, b (5), gap 4, a (12), gap 1, a (14); stream 4: b (6) alone; a host event.
    kernels = C.device_kernels(_trace([(3, "a", 0, 10), (3, "b", 12, 5), (3, "a", 21, 12), (3, "a", 34, 14),
                                       (4, "b", 5, 6)]))
    assert [(k[1], k[2]) for k in kernels] == [("a", 0), ("b", 12), ("a", 21), ("a", 34), ("b", 5)]
    summary = C.summarize_kernels(kernels)
    assert summary["a"] == (3, 12, 1.5)  # durations 10 12 14; gaps 2 (to b) and 1 (to a); the last has none
    assert summary["b"] == (2, 5.5, 4)   # durations 5 and 6; only stream 3's b is followed


def test_kernel_family_names_kernels_by_their_short_name():
    C = _common()
    cases = {
        "void jax_w4a8::(anonymous namespace)::Fp8DecodeStagedKernel<1>(jax_w4a8::DecodeParams, Plan)":
            "Fp8DecodeStagedKernel",
        "loop_add_fusion_12": "loop_add_fusion",
        "input_reduce_fusion": "input_reduce_fusion",
        "void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<A<1>, B> >(P)": "GemmUniversal",
        "void (anonymous namespace)::QuantizeKernel<__nv_bfloat16, 4>(const X*)": "QuantizeKernel",
        "sm90_xmma_gemm_e4m3bf16_tn_n_kernel__5x_cublas": "sm90_xmma_gemm_e4m3bf16_tn_n_kernel__5x_cublas",
    }
    assert {name: C.kernel_family(name) for name in cases} == cases


def test_kernel_breakdown_sums_families_per_repeat_and_counts_overlap_once():
    C = _common()
    # Two repeats of a program: fusion_1 (10 us), Gemm<2> (30), fusion_2 (4, overlapping the Gemm on stream 4).
    spans = [(3, "loop_fusion_1", 0, 10), (3, "void ns::Gemm<2>(P)", 12, 30), (4, "loop_fusion_2", 20, 4),
             (3, "loop_fusion_1", 50, 10), (3, "void ns::Gemm<2>(P)", 61, 30), (4, "loop_fusion_2", 70, 4)]
    rows, busy, span = C.kernel_breakdown(C.device_kernels(_trace(spans)), repeats=2)
    assert [(r["family"], r["count"], r["us"], r["median_us"]) for r in rows] == [
        ("Gemm", 1, 30, 30), ("loop_fusion", 2, 14, 7)]
    assert busy == (10 + 30 + 10 + 30) / 2  # the overlapping fusion adds nothing
    assert span == 91 / 2                   # 0 .. 91
    assert C.kernel_breakdown([]) == ([], 0.0, 0.0)


def _nvcc():
    import glob
    import shutil

    found = shutil.which("nvcc") or next(iter(sorted(glob.glob("/usr/local/cuda*/bin/nvcc"))), None)
    return found


@pytest.mark.parametrize("probe", ["read_bandwidth.cu", "read_bandwidth_o_proj.cu", "graph_launch_probe.cu"])
def test_cuda_probes_build_with_their_documented_command(tmp_path, probe):
    """The standalone CUDA probes of benchmarks/ (run by hand on the GPU machine) build with the nvcc command in
    their header comment, run from the repository root; without a GPU the launch probe says so and fails."""
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found")
    header = pathlib.Path(BENCH, probe).read_text().splitlines()[:30]
    command = next(line for line in header if "nvcc " in line).split("//", 1)[1].split("&&")[0].split()
    assert command[0] == "nvcc" and command[-1] == f"benchmarks/{probe}", command
    exe = tmp_path / "probe"
    out = command.index("-o")
    command[0], command[out + 1] = nvcc, str(exe)
    r = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    if probe == "graph_launch_probe.cu":
        run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
        if run.returncode != 0:
            assert "no CUDA device" in run.stdout
        else:  # a GPU: each of the three shapes timed alone, then its chains (or why a capture failed)
            assert run.stdout.count("alone") == 3, run.stdout


def _step_inventory():
    sys.path.insert(0, BENCH)
    try:
        import step_inventory
    finally:
        sys.path.remove(BENCH)
    return step_inventory


def test_step_inventory_counts_custom_calls_of_both_texts():
    step_inventory = _step_inventory()
    hlo = ('%a = f32[2] custom-call(%x), custom_call_target="jax_w4a8_fp8_einsum"\n'
           '%b = f32[2] custom-call(%x), custom_call_target="jax_w4a8_fp8_einsum", api_version=4\n'
           '%c = f32[2] fusion(%a, %b), kind=kLoop, calls=%f\n'
           '%d = (f32[2], s32[2]) custom-call(%c), custom_call_target="TopK"\n')
    assert step_inventory.custom_calls(hlo) == {"jax_w4a8_fp8_einsum": 2, "TopK": 1}
    assert step_inventory.fusions(hlo) == 1
    assert step_inventory.fusion_kinds(hlo + '%gather_fusion.2.1 = f32[2] fusion(%c), kind=kInput, calls=%g\n') == {
        ("c", "kLoop"): 1, ("gather_fusion", "kInput"): 1}
    mlir = '%0:2 = stablehlo.custom_call @jax_w4a8_quantize_fp8_groups(%arg0) {api_version = 4 : i32}'
    assert step_inventory.custom_calls(mlir) == {"jax_w4a8_quantize_fp8_groups": 1}


def test_step_inventory_counts_multi_output_fusions():
    """A fusion with several outputs has a tuple type, spaces inside (XLA's reductions on a GPU often do): it is a
    fusion instruction like any other and must be counted (the regex once took the type for one token)."""
    step_inventory = _step_inventory()
    hlo = ('  %iota_reduce_fusion = (f32[1]{0}, s32[1]{0}) fusion(%dot.9), kind=kLoop, calls=%fused_computation.4\n'
           '  %input_reduce_fusion.3 = (bf16[1,7168]{1,0}, f32[1]{0}, f32[1]{0}) fusion(%a, %b), kind=kInput, '
           'calls=%fused_computation.7, metadata={op_name="jit(_decode)/reduce"}\n'
           '  %loop_add_fusion.2 = bf16[1,7168]{1,0} fusion(%input_reduce_fusion.3), kind=kLoop, calls=%f.2\n'
           '  %gte = f32[1]{0} get-tuple-element(%iota_reduce_fusion), index=0\n'
           '  %add = f32[1]{0} add(%gte, %gte), metadata={op_name="fusion(x)"}\n')
    assert step_inventory.fusions(hlo) == 3
    assert step_inventory.fusion_kinds(hlo) == {("iota_reduce_fusion", "kLoop"): 1,
                                                ("input_reduce_fusion", "kInput"): 1, ("loop_add_fusion", "kLoop"): 1}
    # the CPU compile of a decode step has one (the router's top-k index reduction): every fusion line counts
    _, compiled = step_inventory.decode_step_texts(1, False)
    lines = [ln for ln in compiled.splitlines() if " fusion(" in ln and "kind=k" in ln]
    assert any(" = (" in ln for ln in lines)
    assert step_inventory.fusions(compiled) == len(lines)


def test_step_inventory_lists_the_decode_steps_custom_calls():
    r = _run([os.path.join(BENCH, "step_inventory.py"), "--layers", "1"])
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line.split()[1:] for line in r.stdout.splitlines()[2:] if line.startswith("jax_w4a8_")}
    assert {"jax_w4a8_fp8_einsum", "jax_w4a8_quantize_fp8_groups", "jax_w4a8_w4a8_grouped_gemm"} <= set(rows)
    for target, (lowered, compiled, per_layer) in rows.items():
        assert 0 < int(compiled) <= int(lowered), (target, lowered, compiled)  # CSE only merges
    # the model's decode layer (list in layers.py): 7 einsums, 8 quantizer calls, 2 grouped GEMMs
    per_layer = {t: float(v[2]) for t, v in rows.items()}
    assert per_layer == {"jax_w4a8_fp8_einsum": 7.0, "jax_w4a8_quantize_fp8_groups": 8.0,
                         "jax_w4a8_w4a8_grouped_gemm": 2.0}, per_layer


def test_ue8m0_decode_step_has_no_more_xla_kernels_than_float32_scales():
    """UE8M0 scales are float32 powers of two: a UE8M0 model's decode step runs the same custom calls and XLA
    fusions as one with float32 scales. (Encoding them to 1-byte codes before every einsum added 14 fusions a
    layer, XLA kernels of their own on a GPU: the H100's 2-layer decode step took 2.52 ms at batch 16 against
    2.28 ms with float32 scales, fifty-seventh session.)"""
    step_inventory = _step_inventory()
    (low, comp), (low8, comp8) = (step_inventory.decode_step_texts(1, False, batch=4, ue8m0=u) for u in (False, True))
    assert step_inventory.custom_calls(low8) == step_inventory.custom_calls(low)
    assert step_inventory.fusion_kinds(comp8) == step_inventory.fusion_kinds(comp)


@pytest.mark.parametrize("probe", ["noepi", "nosilu", "nobarrier", "nostore"])
def test_fused_epilogue_probes_change_only_the_epilogue_of_this_checkout(probe):
    probes = _bench_module("experiments/fused_epilogue_probes.py")
    text = pathlib.Path(ROOT, probes.SOURCE).read_text()
    new = probes.probe_source(text, probe)
    begin, end = probes._epilogue_span(text)
    new_end = len(new) - (len(text) - end)
    assert new[:begin] == text[:begin] and new[new_end:] == text[end:]
    old_body, new_body = text[begin:end], new[begin:new_end]
    assert new_body != old_body and f"probe {probe}" in new_body
    assert new_body.count("{") == new_body.count("}")  # the function still closes where it did
    if probe == "nobarrier":
        assert "NamedBarrierSync" in old_body and "NamedBarrierSync" not in new_body
    if probe == "nostore":
        assert new_body.count("static_cast<uint8_t*>(p.out)") == 1 and "folded ==" in new_body
    if probe == "noepi":  # the accumulators stay live, else the compiler drops the MMAs
        assert "folded += gate[i] * up[i]" in new_body and "folded ==" in new_body
    patch = probes.probe_patch(probe)
    assert patch.startswith(f"--- a/{probes.SOURCE}\n+++ b/{probes.SOURCE}\n")


def test_fused_epilogue_probes_refuse_an_unknown_probe():
    probes = _bench_module("experiments/fused_epilogue_probes.py")
    with pytest.raises(ValueError, match="unknown probe"):
        probes.probe_source(pathlib.Path(ROOT, probes.SOURCE).read_text(), "nothing")
    result = _run([os.path.join(BENCH, "experiments", "fused_epilogue_probes.py"), "nothing"])
    assert result.returncode == 2 and "unknown probe(s) nothing" in result.stderr


def test_bench_ep_buffer_times_the_padded_buffer_with_and_without_the_hint(monkeypatch):
    """benchmarks/bench_ep_buffer.py (CPU handlers, small shapes): the real rows alone, in the padded buffer planned
    for the real rows (the model's way), and planned from the buffer; the real rows' outputs agree, and the hint
    changes the plan where the buffer would fold but the real rows per expert do not."""
    sys.path.insert(0, BENCH)
    try:
        import bench_ep_buffer as B
    finally:
        sys.path.remove(BENCH)
    assert B.buffer_rows(64, 8, 8) == 512 and B.buffer_rows(301, 4, 2) == 4 * 76 * 2  # gather; all_to_all
    timed = {}
    bench_alternating = B.C.bench_alternating

    def spy(fns, **kw):
        timed.update(fns)
        return bench_alternating(fns, **kw)

    monkeypatch.setattr(B.C, "bench_alternating", spy)
    (r,) = B.run(4, [300], experts=4, top_k=2, hidden=256, inter=128)
    assert (r["real_rows"], r["buffer_rows"], r["dispatch"]) == (150, 600, "all_to_all")
    # the weights (here 4 x 256 x 128 int8 and more) travel as arguments, not as constants compiled into every
    # timed program (closed over, R1's 700 MB of them made each case compile for minutes on the H100)
    for name, (fn, (args,)) in timed.items():
        assert len(fn.lower(*args).as_text()) < 100_000, name
    assert r["alone_plan"] == r["buffer_plan"] != r["buffer_unhinted_plan"], r
    assert r["buffer_unhinted_plan"].endswith("folded") and not r["buffer_plan"].endswith("folded"), r
    assert all(r[f"{c}_max_rel_diff"] < 1e-2 for c in ("buffer", "buffer_unhinted")), r
    assert all(r[f"{c}_us"] > 0 for c in ("alone", "buffer", "buffer_unhinted")), r
