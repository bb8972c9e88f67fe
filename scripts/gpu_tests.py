"""Runs pytest in several processes that share one GPU, and reports them as one run.

    python scripts/gpu_tests.py                       # the GPU tests (-m gpu tests/) in 4 processes
    python scripts/gpu_tests.py --shards 8 tests/test_fp8_einsum.py -m gpu
    python scripts/gpu_tests.py --logs out/ -- -k "decode or every_tile" -m gpu tests/

The GPU tests spend much of their time compiling and in float64 references on the host, so one GPU can
run several pytest processes at once (this project's sessions ran 6-8 on the H200: 165 einsum GPU tests in
about 70-120 s).
The selected tests are collected once and dealt round-robin to the processes; each process may take
``--mem-fraction`` of the GPU's memory (XLA_PYTHON_CLIENT_MEM_FRACTION; default 0.9 / shards, with fewer
processes where that share of the GPU, as ``nvidia-smi`` reports it, is under ``--min-gib``). Tests marked
``alone`` (compute-sanitizer's runs, which slow every kernel many times over and take memory of their own) run
after the others, in one process with 0.9 of the GPU to themselves. Prints each
process's pytest summary, then every failed or errored test; exits 0 only if every process passed (or
had nothing to run). Uses the interpreter it runs under: run it where the package imports (the set-up of
``scripts/test.sh``, or a GPU machine's own environment with ``PYTHONPATH`` at the checkout).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

DEFAULT_SELECTION = ["-m", "gpu", "tests/"]
_SUMMARY = re.compile(r"^=*\s*(no tests ran|\d+ (passed|failed|skipped|deselected|error|errors)).*$")
_FAILED = re.compile(r"^(FAILED|ERROR) ")


def collect(pytest_args: list[str], cwd: str) -> list[str]:
    """Node ids that ``pytest pytest_args`` would run (an error if collection fails)."""
    r = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider", *pytest_args],
                       capture_output=True, text=True, cwd=cwd)
    ids = [ln.strip() for ln in r.stdout.splitlines() if "::" in ln and not ln.startswith(" ")]
    if r.returncode not in (0, 5):  # 5: no tests collected
        raise SystemExit(f"gpu_tests: collecting {' '.join(pytest_args)} failed (exit {r.returncode}):\n"
                         f"{(r.stdout + r.stderr)[-3000:]}")
    return ids


def marked_alone(ids: list[str], cwd: str) -> set[str]:
    """Those of ``ids`` marked ``alone`` (``@pytest.mark.alone``: they want the GPU to themselves)."""
    if not ids:
        return set()
    r = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider", "-m", "alone", *ids],
                       capture_output=True, text=True, cwd=cwd)
    if r.returncode not in (0, 5):
        raise SystemExit(f"gpu_tests: collecting the tests marked alone failed (exit {r.returncode}):\n"
                         f"{(r.stdout + r.stderr)[-3000:]}")
    return {ln.strip() for ln in r.stdout.splitlines() if "::" in ln and not ln.startswith(" ")}


def deal(ids: list[str], shards: int) -> list[list[str]]:
    """Round-robin: neighbouring (often similarly slow) parametrizations go to different processes."""
    return [part for part in (ids[i::shards] for i in range(shards)) if part]


def gpu_memory_gib() -> float | None:
    """The first GPU's memory in GiB as ``nvidia-smi`` reports it; None where it cannot say."""
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=30)
        return float(r.stdout.split()[0]) / 1024 if r.returncode == 0 else None  # MiB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def fit_shards(shards: int, gpu_gib: float | None, min_gib: float) -> int:
    """At most ``shards`` processes, and no more than give each ``min_gib`` of 0.9 of the GPU (at least one)."""
    if gpu_gib is None or min_gib <= 0:
        return shards
    return max(1, min(shards, int(0.9 * gpu_gib // min_gib)))


def summary_line(log: str) -> str:
    lines = [ln for ln in log.splitlines() if _SUMMARY.match(ln.strip())]
    return lines[-1].strip("= ") if lines else "(no pytest summary: see the log)"


def failures(log: str) -> list[str]:
    return [ln for ln in log.splitlines() if _FAILED.match(ln)]


def error_lines(log: str, limit: int = 40) -> list[str]:
    """pytest's ``E`` lines (each failure's assertion and message), at most ``limit``: the console keeps why a
    test failed, since the logs stay on the machine that ran them."""
    lines = [ln for ln in log.splitlines() if ln.startswith("E ")]
    return lines[:limit] + ([f"... {len(lines) - limit} more E lines in the log"] if len(lines) > limit else [])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=4, help="pytest processes (default 4)")
    ap.add_argument("--mem-fraction", type=float, default=None,
                    help="GPU memory per process for XLA (default 0.9 / shards)")
    ap.add_argument("--min-gib", type=float, default=12.0,
                    help="without --mem-fraction: fewer processes where 0.9 / shards of the GPU is under this many "
                         "GiB (default 12: the batch-1 routing tests hold 256 experts' weights, 3.5 GiB, and XLA "
                         "asks for twice that; 8 processes on an 80 GB H100 ran out of memory there); 0 turns it off")
    ap.add_argument("--logs", default=None, help="folder for each process's log (default: a temporary one)")
    ap.add_argument("--cwd", default=None, help="where pytest runs (default: the checkout holding this script)")
    args, pytest_args = ap.parse_known_args(argv)
    pytest_args = [a for a in pytest_args if a != "--"] or DEFAULT_SELECTION
    if args.shards < 1:
        ap.error("--shards must be at least 1")
    if args.mem_fraction is not None:
        shards, fraction = args.shards, args.mem_fraction
    else:
        shards = fit_shards(args.shards, gpu_memory_gib(), args.min_gib)
        fraction = 0.9 / shards
    if not 0.0 < fraction <= 1.0:
        ap.error("--mem-fraction must be in (0, 1]")
    cwd = args.cwd or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    logs = args.logs or tempfile.mkdtemp(prefix="gpu_tests_")
    os.makedirs(logs, exist_ok=True)

    ids = collect(pytest_args, cwd)
    alone = marked_alone(ids, cwd)
    parts = deal([i for i in ids if i not in alone], shards)
    print(f"gpu_tests: {len(ids)} tests" + (f", {len(ids) - len(alone)}" if alone else "")
          + f" in {len(parts)} processes, {fraction:.2f} of GPU memory each"
          + (f", then {len(alone)} alone with 0.90" if alone else "") + f"; logs in {logs}", flush=True)

    def start(name, part, frac):
        path = os.path.join(logs, f"{name}.log")
        env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION=f"{frac:.3f}")
        with open(path, "w") as log:
            return path, subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *part],
                                          stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=env)

    ok = True
    failed = []

    def finish(label, path, proc):
        nonlocal ok, failed
        rc = proc.wait()
        with open(path) as f:
            log = f.read()
        print(f"{label}: {summary_line(log)} (exit {rc})", flush=True)
        if rc not in (0, 5):  # why: the E lines, or the log's end where there are none (a crash)
            for ln in error_lines(log) or log.splitlines()[-15:]:
                print(f"  {ln}")
        failed += failures(log)
        ok &= rc in (0, 5)

    procs = [start(f"shard_{i}", part, fraction) for i, part in enumerate(parts)]
    for i, (path, proc) in enumerate(procs):
        finish(f"shard {i}", path, proc)
    if alone:  # after the shards: the GPU to themselves
        finish("alone", *start("alone", [i for i in ids if i in alone], 0.9))
    for ln in failed:
        print(ln)
    print("gpu_tests: passed" if ok else "gpu_tests: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
