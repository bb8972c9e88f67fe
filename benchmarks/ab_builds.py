"""Same-machine A/B of library builds: one process per build and round, rounds in ABBA order, fingerprints checked.

    python benchmarks/ab_builds.py main=. new=/path/with/jax_w4a8 [--cases decode einsum] [--rounds 2]

Each build is a folder that holds a `jax_w4a8` package with its compiled `_lib` modules: `.` for a checkout built in
place (`cmake --install build` with `CMAKE_INSTALL_PREFIX=.`; an editable install keeps the modules elsewhere), or a
copy of the package with a variant's modules in its `_lib`. Timings of one build move 5-17% between processes on the
H200 (NOTEBOOK.md, twenty-third session), so every build runs in `--rounds` fresh processes, alternating (A B, then
B A, ...; use an even number so that every build runs first equally often), each timing its cases `--timings` times;
the summary gives each process's median, their median per build, each build's over the first build's (starred where
no process of one build overlaps the other's), and whether the outputs' checksums equal the first build's (if not,
by how much: a summation order moves them by 1e-7 to 1e-3). `--deadline SECONDS` bounds the whole run's wall clock
from its start (give it a device call's limit less a margin): the first round always runs (`--timeout` bounds its
workers), a later round starts only if the slowest process so far says it ends in time (an even round only if its
odd partner does too, so that every build runs first equally often), its workers get at most the time left, and one
that runs past it ends the run with the summary of the complete rounds (a run killed from outside prints nothing:
the thirty-third session lost a 400 s A/B that way).

`--kernel-time` also runs each case's loop once more under the JAX profiler (CUPTI; XLA's command buffers kept) and
adds a second table of the time per call in which some kernel ran: the kernels' own time, without the gaps and
launches between them. Where builds differ in the first table but not in the second, the difference is not in the
kernels (the fifty-fourth session's H100 A/B timed one kernel, identical in two builds, 8% apart between processes,
while three `ncu` times of one kernel alone, in three calls, were 186.4-188.4 us).

Guards against timing the wrong library: each worker checks that `jax_w4a8` and its compiled modules were
imported from its folder (an editable install's import redirect is bypassed), that a source checkout's build
is not stale, and reports the fingerprint of the ffi/ sources its modules were built from
(`jax_w4a8.build_info()`); two builds with the same fingerprint stop the run unless `--allow-same` (which
measures the same-build spread on purpose).

Case sets: decode (grouped GEMM gate+up / down at 64, 256 and 512 routed rows over 32 experts, fused up-projection
at 64 and 512), fused (the fused up-projection at 64, 128, 256, 512 and 1024 rows over 32 experts: its 8-, 8-, 16-,
32- and 64-token f16 tiles), batch1 (a batch-1 decode step's routed experts: one row on each of 8 of 256 experts,
gate+up and down at DeepSeek-V3 widths, the other experts' weights zeros), einsum (DeepSeek-V3 linears at 1 and 64
tokens, UE8M0 codes), einsum1 (a decode step's one-token linears: q_a + kv_a in one product, q_b, kv_a, the shared
expert's gate+up and down, o_proj), prefill (grouped GEMM at 4096 rows with float32, UE8M0 and per-tensor activation
scales, einsum 4096 x 7168 x 7168), quantize (the bf16 activation quantizer at 4096 and 16384 x 7168 and the
SiLU-mul one at 512 and 4096 x 2 x 2048, UE8M0 scales), tiny (small shapes that also run on the CPU, for tests).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
CASE_SETS = ("decode", "fused", "batch1", "einsum", "einsum1", "prefill", "quantize", "tiny")


# ----------------------------------------------------------------------------------------------- worker
def _cases(names):
    """(label, fn, arg sets) for the named case sets; data from fixed keys, the same in every process."""
    import jax
    import jax.numpy as jnp

    from jax_w4a8 import ops, quant
    from probe_kernels import _grouped_case  # the same data as the probes, any expert count
    from profile_case import _top8_case  # ... and as the profiler's batch-1 cases

    def grouped(key, m, e, n, k, i):
        return _grouped_case(jax.random.fold_in(key, i), m, n, k, i, e=e)

    def linear(key, m, n, k, i):
        kk = jax.random.fold_in(key, i)
        x = jax.random.normal(kk, (m, k), jnp.float32)
        w = jax.random.normal(jax.random.fold_in(kk, 1), (n, k), jnp.float32) * 0.05
        x8, xs = quant.quantize_fp8_groups(x, ue8m0=True)
        w8, wsb = quant.quantize_fp8_blocks(w, ue8m0=True)
        return x8, quant.encode_ue8m0(xs), w8, quant.encode_ue8m0(wsb)

    gemm = ops.w4a8_grouped_gemm
    fused = lambda *a: ops.w4a8_moe_up(*a, fused=True)[0]  # noqa: E731
    einsum = lambda *a: ops.fp8_einsum("md,nd->mn", *a)  # noqa: E731
    key = jax.random.key(0)
    out = []

    def have(label):  # decode and fused share the fused op at 64 and 512 rows: its data is built and timed once
        return any(case[0] == label for case in out)

    for name in dict.fromkeys(names):  # a set named twice is built and timed once
        if name == "decode":
            for m in (64, 256, 512):
                for shape, n, k in (("gate_up", 4096, 7168), ("down", 7168, 2048)):
                    out.append((f"{shape} M={m}", gemm, [grouped(key, m, 32, n, k, i) for i in range(2)]))
                if m != 256 and not have(f"fused M={m}"):
                    out.append((f"fused M={m}", fused, [grouped(key, m, 32, 4096, 7168, i) for i in range(2)]))
        elif name == "fused":  # the fused up-projection at each of its f16 tiles (8, 8, 16, 32, 64 tokens)
            for m in (64, 128, 256, 512, 1024):
                if not have(f"fused M={m}"):
                    out.append((f"fused M={m}", fused, [grouped(key, m, 32, 4096, 7168, i) for i in range(2)]))
        elif name == "batch1":
            for shape, n, k in (("gate_up", 4096, 7168), ("down", 7168, 2048)):
                sets = [_top8_case(jax.random.fold_in(key, i), n, k) for i in range(2)]
                out.append((f"top8 {shape} M=8", gemm, sets))
        elif name == "einsum":
            for shape, n, k in (("q_a", 1536, 7168), ("kv_a", 576, 7168), ("o_proj", 7168, 16384),
                                ("square", 7168, 7168)):
                for m in (1, 64):
                    out.append((f"einsum {shape} M={m}", einsum, [linear(key, m, n, k, i) for i in range(2)]))
        elif name == "einsum1":  # a decode step's one-token linears (the einsum decode kernel's plans)
            for shape, n, k in (("qkv_a", 2112, 7168), ("q_b", 24576, 1536), ("kv_a", 576, 7168),
                                ("shared_up", 4096, 7168), ("shared_down", 7168, 2048), ("o_proj", 7168, 16384)):
                out.append((f"einsum {shape} M=1", einsum, [linear(key, 1, n, k, i) for i in range(2)]))
        elif name == "prefill":
            for shape, n, k in (("gate_up", 4096, 7168), ("down", 7168, 2048)):
                sets = [grouped(key, 4096, 32, n, k, i) for i in range(2)]
                out.append((f"{shape} M=4096", gemm, sets))
                # activation scales the e4m3 128-token kernel folds into the codes: UE8M0, one per tensor
                out.append((f"{shape} M=4096 ue8m0", gemm, [(a, quant.ceil_to_ue8m0(s), *r) for a, s, *r in sets]))
                out.append((f"{shape} M=4096 tensor", gemm,
                            [(a, jnp.asarray(0.8, jnp.float32), *r) for a, s, *r in sets]))
            out.append(("einsum square M=4096", einsum, [linear(key, 4096, 7168, 7168, i) for i in range(2)]))
        elif name == "quantize":  # the activation quantizers (memory-bound: bytes moved over time)
            def act(m, k, i):
                return (jax.random.normal(jax.random.fold_in(key, 100 + i), (m, k), jnp.bfloat16),)
            quantize = lambda x: ops.quantize_fp8_groups(x, ue8m0=True)[0]  # noqa: E731
            silu_mul = lambda x: ops.silu_mul_quantize_fp8_groups(x, ue8m0=True)[0]  # noqa: E731
            for m in (4096, 16384):
                out.append((f"quantize {m}x7168", quantize, [act(m, 7168, i) for i in range(2)]))
            for m in (512, 4096):
                out.append((f"silu_mul quantize {m}x4096", silu_mul, [act(m, 4096, i) for i in range(2)]))
        elif name == "tiny":
            out.append(("tiny grouped M=16", gemm, [grouped(key, 16, 2, 256, 256, i) for i in range(2)]))
            out.append(("tiny einsum M=8", einsum, [linear(key, 8, 256, 256, i) for i in range(2)]))
        else:
            raise ValueError(f"unknown case set {name!r}; known: {', '.join(CASE_SETS)}")
    return out


def worker(folder, names, timings, build_only=False, kernel_time=False):
    """Runs in a fresh process with `folder` first on sys.path; prints one JSON object per line. With
    `kernel_time`, each case's row also holds `kernel_us`: the device time per call in which some kernel ran, from
    one more run of its timing loop under the JAX profiler (None where it records no device kernels: the CPU)."""
    import importlib

    # An editable install (scikit-build-core) redirects `import jax_w4a8` to its checkout ahead of sys.path.
    sys.meta_path[:] = [f for f in sys.meta_path if "ScikitBuild" not in type(f).__name__]
    sys.path.insert(0, str(pathlib.Path(folder).resolve()))
    import jax
    import numpy as np

    sys.path.insert(1, str(HERE))
    import _common as C

    import jax_w4a8

    if kernel_time:  # trace the CUDA graphs the timed loop runs, not their ops one by one (before the backend starts)
        C.keep_command_buffers_while_profiling()

    home = pathlib.Path(folder).resolve()
    jax.devices()  # the platform modules register on import; the backend decides which one this worker runs
    platform = "cuda" if jax.default_backend() == "gpu" else "cpu"
    module = importlib.import_module(f"jax_w4a8._lib._ffi_{platform}")
    for name, path in (("jax_w4a8", jax_w4a8.__file__), (module.__name__, module.__file__)):
        if not pathlib.Path(path).resolve().is_relative_to(home):
            raise SystemExit(f"{name} was imported from {path}, not from the build folder {folder}")
    info = jax_w4a8.build_info()
    if info["checkout"] and info["checkout"]["stale"]:
        raise SystemExit(f"{folder}: its {info['checkout']['stale']} module(s) were built from other sources than "
                         f"{info['checkout']['ffi_dir']} (rebuild first)")
    print(json.dumps({"build": {"module": str(pathlib.Path(module.__file__).resolve()), "platform": platform,
                                "source_sha256": info[platform]["source_sha256"]}}), flush=True)
    if build_only:
        return 0
    for label, fn, sets in _cases(names):
        times = [C.bench(fn, sets) * 1e6 for _ in range(timings)]
        out = np.asarray(jax.jit(fn)(*sets[0]), np.float32)
        row = {"case": label, "us": times, "checksum": float(np.abs(out).sum())}
        if kernel_time:
            families, busy, _ = C.loop_kernel_breakdown(fn, sets)
            row["kernel_us"] = busy if families else None
        print(json.dumps(row), flush=True)
    return 0


# ----------------------------------------------------------------------------------------- orchestrator
class WorkerTimeout(SystemExit):
    """A worker ran past its time (--timeout, or what --deadline left)."""


def run_build(folder, names, timings, timeout, kernel_time=False):
    """One worker process on `folder`'s library: (its build line, one row per case). No names: the build only."""
    path = [str(folder)] + [p for p in [os.environ.get("PYTHONPATH")] if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--worker", str(folder),
           "--timings", str(timings)] + (["--cases", *names] if names else ["--build-only"]) \
        + (["--kernel-time"] if kernel_time else [])
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise WorkerTimeout(f"build {folder}: worker ran past {timeout:.0f} s\n{(exc.stderr or b'')[-2000:]}") from None
    rows = []
    for line in proc.stdout.splitlines():
        if line.startswith('{"build"') or line.startswith('{"case"'):
            rows.append(json.loads(line))
    if proc.returncode != 0 or not rows or "build" not in rows[0]:
        raise SystemExit(f"build {folder}: worker failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return rows[0]["build"], rows[1:]


def _spread(sums):
    """The checksums' largest difference relative to the largest of them: about 1e-7 to 1e-3 where a build only
    sums in another order (a K split, another tile), about 1 or more where it computes something else."""
    every = [c for cs in sums.values() for c in cs]
    if not all(math.isfinite(c) for c in every):  # a NaN or Inf output: no relative size
        return math.inf
    scale = max(abs(c) for c in every)
    return (max(every) - min(every)) / scale if scale else math.inf


def summarize(builds, results):
    """Markdown table: per case and build, the median of its processes' medians (each process's median in
    parentheses, in run order), the ratio to the first build's (starred where the two builds' processes do not
    overlap), and whether the checksums equal the first build's (if not, by how much relative to the largest: see
    _spread). Where the rows hold traced kernel times (--kernel-time), a second table gives those the same way."""
    table = _table(builds, results, lambda r: statistics.median(r["us"]), "us")
    names = list(builds)
    if all(r.get("kernel_us") is not None for n in names for rows in results[n] for r in rows) and results[names[0]]:
        table += ("\n\nKernel time per call (the device busy with some kernel, from a profiled run of the same "
                  "loop):\n\n" + _table(builds, results, lambda r: r["kernel_us"], "kernel us"))
    elif any("kernel_us" in r for n in names for rows in results[n] for r in rows):
        table += "\n\nKernel time per call: no device kernels traced (a CPU run, or a profiler without CUPTI)."
    return table


def _table(builds, results, value, unit):
    names = list(builds)
    cases = list(dict.fromkeys(r["case"] for rows in results[names[0]] for r in rows))
    lines = ["| case | " + " | ".join(f"{n} {unit}" for n in names) + " | "
             + " | ".join(f"{n} / {names[0]}" for n in names[1:]) + " | outputs |",
             "|---" * (1 + 2 * len(names)) + "|"]
    for case in cases:
        per = {n: [value(r) for rows in results[n] for r in rows if r["case"] == case] for n in names}
        sums = {n: {r["checksum"] for rows in results[n] for r in rows if r["case"] == case} for n in names}
        med = {n: statistics.median(per[n]) for n in names}
        cells = [f"{med[n]:.1f} ({', '.join(f'{t:.1f}' for t in per[n])})" for n in names]
        ratios = [f"{med[n] / med[names[0]]:.3f}" + ("*" if _apart(per[n], per[names[0]]) else "")
                  for n in names[1:]]
        same = all(sums[n] == sums[names[0]] and len(sums[n]) == 1 for n in names)
        lines.append(f"| {case} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " | "
                     + ("equal" if same else f"DIFFER by {_spread(sums):.1e}") + " |")
    lines.append("")
    lines.append(f"Ratios with a star: every process of that build was faster (or every one slower) than every "
                 f"process of {names[0]}; the others are within the processes' spread.")
    return "\n".join(lines)


def _apart(times, base):
    """Whether two builds' process medians do not overlap (more than one process each)."""
    return len(times) > 1 and len(base) > 1 and (max(times) < min(base) or min(times) > max(base))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("builds", nargs="*", metavar="NAME=FOLDER", help="two or more builds, the first is the baseline")
    p.add_argument("--cases", nargs="+", default=["decode"], choices=CASE_SETS)
    p.add_argument("--rounds", type=int, default=2, help="processes per build (alternating, ABBA)")
    p.add_argument("--timings", type=int, default=2, help="timings per case in each process")
    p.add_argument("--allow-same", action="store_true", help="run even if two builds have the same fingerprint")
    p.add_argument("--timeout", type=float, default=600, help="seconds per worker process")
    p.add_argument("--deadline", type=float, help="seconds for the whole run from its start: the first round "
                   "always runs, no later one starts that would end past it (judged by the slowest process so "
                   "far), workers get at most the time left; the summary covers the complete rounds")
    p.add_argument("--kernel-time", action="store_true",
                   help="also trace one more run of each case's loop (JAX profiler, CUPTI) and summarize the time "
                        "per call in which kernels ran, without the gaps between them")
    p.add_argument("--out", help="folder for ab_builds.json")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    start = time.monotonic()
    if args.worker:
        return worker(args.worker, args.cases, args.timings, args.build_only, args.kernel_time)
    builds = {}
    for spec in args.builds:
        name, sep, folder = spec.partition("=")
        if not sep or not name or not (pathlib.Path(folder) / "jax_w4a8" / "__init__.py").is_file():
            p.error(f"{spec!r}: expected NAME=FOLDER with FOLDER/jax_w4a8/__init__.py")
        if name in builds:
            p.error(f"build name {name!r} given twice")
        builds[name] = pathlib.Path(folder)
    if len(builds) < 2:
        p.error("give at least two builds (NAME=FOLDER)")
    # Which library each folder really loads, before any timing.
    seen = {n: run_build(folder, [], 1, args.timeout)[0] for n, folder in builds.items()}
    shas = {}
    for n, info in seen.items():
        print(f"{n}: {info['platform']} module {info['module']}, ffi sources {info['source_sha256']}", flush=True)
        shas.setdefault(info["source_sha256"], []).append(n)
    unknown = shas.pop("unknown", []) + shas.pop(None, [])
    if unknown:
        print(f"warning: builds {unknown} carry no fingerprint and cannot be told apart from the others", flush=True)
    dup = [bs for bs in shas.values() if len(bs) > 1]
    if dup and not args.allow_same:
        raise SystemExit(f"builds {dup} run the same library (same ffi sources fingerprint): nothing to compare "
                         "(--allow-same measures the same-build spread)")
    results = {n: [] for n in builds}
    slowest, rounds = 0.0, 0

    def time_left():
        return None if args.deadline is None else args.deadline - (time.monotonic() - start)

    for r in range(args.rounds):
        # a later round only if it (and, from an even round, its odd partner) ends in time
        need = slowest * len(builds) * (2 if r % 2 == 0 and r + 1 < args.rounds else 1)
        if r > 0 and time_left() is not None and need > time_left():
            print(f"stopped after {r} of {args.rounds} rounds (--deadline {args.deadline:g} s)", flush=True)
            break
        order = list(builds) if r % 2 == 0 else list(reversed(builds))
        try:
            for n in order:
                t0 = time.monotonic()
                left = time_left() if r > 0 else None  # the first round always runs (--timeout bounds it)
                timeout = args.timeout if left is None else max(1.0, min(args.timeout, left))
                info, rows = run_build(builds[n], args.cases, args.timings, timeout, args.kernel_time)
                slowest = max(slowest, time.monotonic() - t0)
                if info["source_sha256"] != seen[n]["source_sha256"]:
                    raise SystemExit(f"build {n} changed during the run: {info['source_sha256']}")
                print(f"round {r} {n}: {len(rows)} cases", flush=True)
                results[n].append(rows)
        except WorkerTimeout as exc:
            if rounds == 0:
                raise
            print(f"{exc}\nstopped in round {r}: the summary covers the {rounds} complete round(s)", flush=True)
            for n in builds:
                del results[n][rounds:]
            break
        rounds = r + 1
    if rounds % 2 and len(builds) > 1 and rounds < args.rounds:
        print(f"note: {rounds} rounds, so build {list(builds)[0]} ran first once more than the others", flush=True)
    table = summarize(builds, results)
    print(table)
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "ab_builds.json").write_text(json.dumps(
            {"builds": {n: dict(seen[n], folder=str(builds[n])) for n in builds}, "cases": args.cases,
             "rounds": rounds, "timings": args.timings, "results": results, "table": table}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
