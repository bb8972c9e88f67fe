"""Shared benchmark plumbing: timing, ceilings, tables, JSON, RESULTS.md sections and plots.

Timing: median over rounds of the mean time of ``n`` back-to-back calls (async dispatch keeps the GPU
busy), rotating through several input sets so that weights come from HBM, not L2.

Traces: :func:`trace_kernels` runs a callable under the JAX profiler (CUPTI on a GPU) and returns the device's
kernels; :func:`summarize_kernels` and :func:`kernel_breakdown` say how long each kernel took, what idle
time followed it, and where a program's time goes by kernel family.
"""

from __future__ import annotations

import collections
import datetime
import glob
import gzip
import json
import os
import pathlib
import re
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"


def bench(fn, arg_sets, n=None, rounds=5, device_loop=True, min_program_s=5e-3, max_n=200):
    """Seconds per call of ``fn(*args)``: median over ``rounds`` of ``n`` calls over ``arg_sets``.

    With ``device_loop`` the ``n`` calls run inside one jitted program (unrolled, chained through
    optimization barriers so XLA can neither merge nor drop them), which measures device time even
    for ops shorter than Python's per-call dispatch (about 40-60 us here). Launching that program and
    waiting for it costs tens of microseconds once per round, which ``n`` calls share: with ``n=None``
    it is 10, raised (up to ``max_n``) until one program runs at least ``min_program_s``, so that
    fixed cost stays near 1 us per call for the shortest ops (H200, 128-element op: 12.2 us per call
    at n = 10, 6.9 at 50, 2.7 at 200). Otherwise each call is dispatched from Python.
    """
    if device_loop:
        run, n = _device_loop(fn, arg_sets, n, min_program_s, max_n)
        return statistics.median(run() / n for _ in range(rounds))
    for a in arg_sets[:2]:
        jax.block_until_ready(fn(*a))
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = None
        for i in range(n):
            out = fn(*arg_sets[i % len(arg_sets)])
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / n)
    return statistics.median(times)


def bench_alternating(fns, rounds=5, min_program_s=5e-3, max_n=200):
    """Seconds per call of each ``name: (fn, arg_sets)`` of ``fns``, as :func:`bench`'s device loop, but with the
    rounds of the different functions interleaved (A B B A A B ...), so that a drift of the clock or of the GPU's
    state during the process weighs on all of them alike: for comparisons in one process such as fused vs unfused.
    Returns {name: median seconds per call}."""
    loops = {name: _device_loop(fn, sets, None, min_program_s, max_n) for name, (fn, sets) in fns.items()}
    times = {name: [] for name in fns}
    order = list(fns)
    for r in range(rounds):
        for name in (order if r % 2 == 0 else order[::-1]):
            run, n = loops[name]
            times[name].append(run() / n)
    return {name: statistics.median(t) for name, t in times.items()}


def _device_loop(fn, arg_sets, n, min_program_s, max_n):
    """(run, n): ``run()`` times one launch of a jitted program of ``n`` chained calls of ``fn`` over ``arg_sets``
    (seconds for all n), compiled and warmed; ``n=None`` picks it (10 or one call per input set if more, raised up
    to ``max_n`` until one program runs at least ``min_program_s``; never below the number of sets, so that every
    set is used)."""
    flat = [a for s in arg_sets for a in s]
    adaptive = n is None
    n = max(10, len(arg_sets)) if adaptive else n
    many = jax.jit(_unrolled(fn, len(arg_sets), n))
    jax.block_until_ready(many(*flat))
    if adaptive:
        t0 = time.perf_counter()
        jax.block_until_ready(many(*flat))
        once = time.perf_counter() - t0
        if once < min_program_s:
            n = max(len(arg_sets), min(max_n, -(-int(n * min_program_s / max(once, 1e-6)) // len(arg_sets))
                                       * len(arg_sets)))
            many = jax.jit(_unrolled(fn, len(arg_sets), n))
            jax.block_until_ready(many(*flat))

    def run():
        t0 = time.perf_counter()
        jax.block_until_ready(many(*flat))
        return time.perf_counter() - t0

    return run, n


def _unrolled(fn, n_sets, n):
    def many(*flat):
        per = len(flat) // n_sets
        sets = [flat[i * per:(i + 1) * per] for i in range(n_sets)]
        acc = jnp.float32(0)
        for i in range(n):
            args, acc = jax.lax.optimization_barrier((sets[i % n_sets], acc))
            out = jax.lax.optimization_barrier(fn(*args))  # XLA may not shrink the op to what is read
            leaf = jax.tree_util.tree_leaves(out)[0]
            acc = acc + leaf.reshape(-1)[0].astype(jnp.float32)
        return acc

    return many


def torch_bench(fn, n=10, rounds=5):
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(rounds):
        start.record()
        for _ in range(n):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / n / 1e3)
    return statistics.median(times)


def copy_bandwidth():
    """Measured device-to-device copy bandwidth (bytes read + written per second): the larger of a
    torch copy and a jitted XLA ``x * 2`` on 4 GiB."""
    x = jax.random.normal(jax.random.key(0), (1 << 31,), jnp.bfloat16)
    t = bench(jax.jit(lambda v: v * 2), [(x,)], n=5)
    best = {"xla": 2 * x.nbytes / t}
    del x
    try:
        import torch

        a = torch.empty(1 << 31, dtype=torch.bfloat16, device="cuda")
        b = torch.empty_like(a)
        best["torch"] = 2 * a.nbytes / torch_bench(lambda: b.copy_(a), n=5)
        del a, b
        torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - torch is optional (peer baselines only)
        pass
    return max(best.values()), best


def harness_floor():
    """Seconds per call that the device loop of :func:`bench` costs by itself: a 128-element XLA op
    timed the same way (launches, the chaining barriers, the per-call accumulate and the program's
    share of its launch). Ops that take a few microseconds on the GPU measure about this much."""
    x = jnp.ones((128,), jnp.bfloat16)
    return bench(jax.jit(lambda v: v * 2), [(x,)])


def have_torch():
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def fmt_table(rows, cols):
    widths = [max(len(str(c)), *(len(str(r.get(c, ""))) for r in rows)) for c in cols]
    lines = ["  ".join(str(c).rjust(w) for c, w in zip(cols, widths))]
    for r in rows:
        lines.append("  ".join(str(r.get(c, "")).rjust(w) for c, w in zip(cols, widths)))
    return "\n".join(lines)


def md_table(rows, cols):
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    return "\n".join(out)


def out_dir(arg):
    d = pathlib.Path(arg or os.environ.get("OUT") or HERE / "out")
    d.mkdir(parents=True, exist_ok=True)
    return d


def library_build() -> dict:
    """The measured library: its version and the fingerprint of the ffi/ sources its modules were built from
    (``jax_w4a8.build_info``), so that a result names the kernels it ran. Warns when the loaded modules were
    built from other sources than this checkout's ``ffi/``."""
    import warnings

    import jax_w4a8

    info = jax_w4a8.build_info()
    stale = (info["checkout"] or {}).get("stale", [])
    if stale:
        warnings.warn(f"jax_w4a8's {stale} module(s) were built from other sources than {info['checkout']['ffi_dir']}"
                      " (rebuild before measuring)", stacklevel=2)
    return {"version": info["version"], "cuda_source_sha256": info["cuda"]["source_sha256"],
            "cpu_source_sha256": info["cpu"]["source_sha256"], "cutlass": info["cutlass"], "stale": stale}


def build_note(payload) -> str:
    """'; jax_w4a8 ffi sources 1a2b3c4d5e6f' for a report's first line ('' for payloads without a build)."""
    sha = (payload.get("build") or {}).get("cuda_source_sha256")
    return f"; jax_w4a8 ffi sources {sha[:12]}" if sha else ""


def save_json(path, payload):
    payload = dict(payload, date=datetime.date.today().isoformat(), jax=jax.__version__,
                   device=str(jax.devices()[0].device_kind), build=library_build())
    # written whole, then renamed over the file: a run killed mid-write (the benchmarks save after every row) leaves
    # the previous rows, not a truncated file
    path = pathlib.Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, path)


TARGET_CARD = "H200"  # BENCHMARKS.md's targets are the H200's


def card_of(payload) -> str | None:
    """A payload's card: "H100" or "H200" where its device names one (a GH200 is not an H200), its device's name
    otherwise, None where it names none (JSON written before devices were recorded)."""
    device = str(payload.get("device") or "")
    card = next((c for c in ("H200", "H100") if re.search(rf"(?<![A-Za-z0-9]){c}(?![0-9])", device)), None)
    return card or device or None


def results_section(name, payload) -> str:
    """RESULTS.md's section for a run: ``name`` on the targets' card (or an unnamed device), ``name on an H100``
    (``name on <device>``) on any other, so another card's run never overwrites the H200's table."""
    card = card_of(payload)
    return name if card in (None, TARGET_CARD) else f"{name} on {'an H100' if card == 'H100' else card}"


def card_note(payload) -> str:
    """'' on the targets' card, else the report's sentence saying so, with the run's copy bandwidth."""
    card = card_of(payload)
    if card in (None, TARGET_CARD):
        return ""
    return (f" The targets are the {TARGET_CARD}'s; this {card} run has about {payload['copy_bw'] / 1e12:.2f} TB/s "
            "of copy bandwidth to the H200's 4.3.")


def results_suffix(payload) -> str:
    """'' on the targets' card, else '_h100' and the like: for the files a report writes next to RESULTS.md."""
    card = card_of(payload)
    return "" if card in (None, TARGET_CARD) else "_" + (re.sub(r"[^a-z0-9]+", "_", card.lower()).strip("_") or "other")


def update_results_section(name, body):
    """Replaces (or appends) the section ``## name`` of benchmarks/RESULTS.md."""
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    head = f"## {name}\n"
    if head in text:
        start = text.index(head)
        nxt = text.find("\n## ", start + len(head))
        text = text[:start] + head + body.rstrip() + "\n" + (text[nxt:] if nxt >= 0 else "")
    else:
        text = text.rstrip() + "\n\n" + head + body.rstrip() + "\n"
    RESULTS.write_text(text)


def device_kernels(trace, device=None):
    """The kernel events of a perfetto trace (a dict) on its devices: [(stream, name, start_us, duration_us)],
    sorted by stream and start. A device's events are those of processes named like ``/device:GPU:0`` (only
    device number ``device`` when given), on its stream threads (named ``Stream #13(Kernel)`` and the like)
    where it names them: the profiler's derived lines of a device (``XLA Ops``, ``XLA Modules``, ``Steps``)
    repeat the kernels' spans and are left out."""
    events = trace["traceEvents"]
    meta = [e for e in events if e.get("ph") == "M"]
    wanted = re.compile(r"/device:[A-Za-z_]+:" + (r"\d+" if device is None else str(int(device))) + r"\b")
    devices = {e["pid"] for e in meta if e.get("name") == "process_name" and wanted.search(e["args"].get("name", ""))}
    named = collections.defaultdict(dict)
    for e in meta:
        if e.get("name") == "thread_name" and e.get("pid") in devices:
            named[e["pid"]][e.get("tid")] = e["args"].get("name", "")

    def on_stream(e):
        threads = named.get(e["pid"])
        return not threads or threads.get(e.get("tid"), "").startswith("Stream")

    kernels = [((e["pid"], e["tid"]), e["name"], float(e["ts"]), float(e["dur"])) for e in events
               if e.get("ph") == "X" and e.get("pid") in devices and "dur" in e and on_stream(e)]
    return sorted(kernels, key=lambda ev: (ev[0], ev[2]))


PROFILE_GRAPHS_FLAG = "--xla_enable_command_buffers_during_profiling=true"


def keep_command_buffers_while_profiling():
    """While the profiler runs, XLA executes its command buffers op by op ("disabled for profiling") unless
    ``--xla_enable_command_buffers_during_profiling=true``: adds that flag to ``XLA_FLAGS``, so that a trace
    shows the CUDA graphs that a timed run executes. Effective only before JAX's backend starts (the first
    device use); returns whether the flag is set now."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_enable_command_buffers_during_profiling" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " " + PROFILE_GRAPHS_FLAG).strip()
    return PROFILE_GRAPHS_FLAG in os.environ["XLA_FLAGS"]


def trace_kernels(thunk, device=None):
    """Run ``thunk()`` (compile it first: compilation would be traced too) once under the JAX profiler and wait
    for its outputs; the device kernels it ran (:func:`device_kernels`), or [] where the profiler records none
    (a CPU backend has no device events). Unless :func:`keep_command_buffers_while_profiling` ran before the
    backend started, XLA runs its command buffers op by op while tracing: kernel times then hold, gaps do not."""
    with tempfile.TemporaryDirectory() as logdir:
        with jax.profiler.trace(logdir, create_perfetto_trace=True):
            jax.block_until_ready(thunk())
        files = glob.glob(f"{logdir}/**/perfetto_trace.json.gz", recursive=True)
        if not files:
            return []
        with gzip.open(files[0]) as f:
            return device_kernels(json.load(f), device)


def loop_kernel_breakdown(fn, arg_sets, min_program_s=5e-3, max_n=200):
    """:func:`kernel_breakdown` per call of ``fn`` in :func:`bench`'s device loop over ``arg_sets`` (its program of
    chained calls traced once with :func:`trace_kernels`): (rows, busy_us, span_us) per call, ([], 0.0, 0.0) on a
    backend without device events."""
    run, n = _device_loop(fn, arg_sets, None, min_program_s, max_n)
    return kernel_breakdown(trace_kernels(run), repeats=n)


def summarize_kernels(kernels):
    """Per kernel name: (count, median duration, median gap to the next kernel on its stream), in microseconds;
    the gap is None for a kernel that is never followed on its stream."""
    durations, gaps = collections.defaultdict(list), collections.defaultdict(list)
    for (stream, name, start, dur), nxt in zip(kernels, kernels[1:] + [None]):
        durations[name].append(dur)
        if nxt is not None and nxt[0] == stream:
            gaps[name].append(nxt[2] - (start + dur))
    return {name: (len(d), statistics.median(d), statistics.median(gaps[name]) if gaps[name] else None)
            for name, d in durations.items()}


def kernel_family(name):
    """A kernel's short name: no return type, namespaces, template arguments or parameters, and no trailing
    ``_N`` instance number (XLA's ``loop_add_fusion_12`` -> ``loop_add_fusion``); CUTLASS's
    ``device_kernel<...GemmUniversal<...>>`` is named by its kernel type (``GemmUniversal``)."""
    name = re.sub(r"^void\s+", "", name.strip()).replace("(anonymous namespace)", "")
    depth, out, inner = 0, [], []
    for ch in name:  # keep depth 0 up to the first "(": no template arguments or parameters
        if ch == "(" and depth == 0:
            break
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif depth == 0:
            out.append(ch)
        if depth > 0 and not (ch == "<" and depth == 1):
            inner.append(ch)
    short = "".join(out).rsplit("::", 1)[-1].strip()
    if short == "device_kernel" and inner:
        return kernel_family("".join(inner))
    return re.sub(r"_\d+$", "", short) or name


def kernel_breakdown(kernels, repeats=1):
    """Where a traced program's device time goes: (rows, busy_us, span_us), per repeat of the program.

    rows: per :func:`kernel_family`, highest time first, dicts of ``family``, ``count`` and ``us`` (kernels and
    their summed time per repeat) and ``median_us`` (one kernel's median). busy_us: the time at least one kernel
    ran (overlapping kernels count once); span_us: first start to last end; the difference is idle device time.
    """
    if not kernels:
        return [], 0.0, 0.0
    fam = collections.defaultdict(list)
    for _, name, _, dur in kernels:
        fam[kernel_family(name)].append(dur)
    rows = [dict(family=f, count=len(d) / repeats, us=sum(d) / repeats, median_us=statistics.median(d))
            for f, d in fam.items()]
    rows.sort(key=lambda r: -r["us"])
    spans = sorted((start, start + dur) for _, _, start, dur in kernels)
    busy, (lo, hi) = 0.0, spans[0]
    for start, end in spans[1:]:
        if start > hi:
            busy, lo, hi = busy + hi - lo, start, end
        else:
            hi = max(hi, end)
    busy += hi - lo
    span = max(end for _, end in spans) - spans[0][0]
    return rows, busy / repeats, span / repeats
