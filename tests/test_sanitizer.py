"""compute-sanitizer over tests/sanitizer_case.py, which runs every CUDA handler on edge tiles, padding rows and
hostile group sizes and checks the values: memcheck finds no out-of-bounds or misaligned access, racecheck no
shared-memory hazard, synccheck no barrier misuse, and the case's results are right under each tool.

The GPU tests also skip where compute-sanitizer is not installed. The case runs once without the sanitizer
first, filling a JAX persistent compilation cache that the sanitized run then loads its XLA executables from
(compiled_case_env): on the H200 compute-sanitizer segfaulted while XLA compiled under it (racecheck and
synccheck five times in a row in the eighteenth session, on this build and the one before; with the cache both
ran clean). A run the tool itself still crashed in before reporting anything is run once more
(crashed_before_any_report). The verdict on a sanitizer's output is tested
on the CPU against outputs recorded on the H200 (fifteenth session), including the one that found CUTLASS's
blockwise kernel stopping racecheck at 1 x 2 clusters.
"""

import glob
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASE = os.path.join(ROOT, "tests", "sanitizer_case.py")
TOOLS = {"memcheck": [], "racecheck": ["--racecheck-report", "hazard"], "synccheck": []}


def find_sanitizer():
    """The compute-sanitizer executable on PATH or in a CUDA toolkit under /usr/local, or None."""
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    candidates = sorted(glob.glob("/usr/local/cuda*/bin/compute-sanitizer"))
    return candidates[-1] if candidates else None


def sanitizer_verdict(tool, output):
    """None when ``output`` (compute-sanitizer's and the case's, together) is clean, else why it is not."""
    if stop := re.search(r"Internal Sanitizer Error.*", output):
        return f"{tool} stopped: {stop.group(0).strip()}"
    if tool == "racecheck":
        m = re.search(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)", output)
        if m is None:
            return "racecheck printed no summary"
        if int(m.group(1)) or int(m.group(2)) or int(m.group(3)):
            return f"racecheck: {m.group(0)}"
    else:
        m = re.search(r"ERROR SUMMARY: (\d+) errors?", output)
        if m is None:
            return f"{tool} printed no summary"
        if int(m.group(1)):
            return f"{tool}: {m.group(0)}"
    if "sanitizer case: ok" not in output:
        return "the sanitizer case did not finish with correct results"
    return None


_NOT_A_REPORT = ("COMPUTE-SANITIZER", "SUMMARY", "Target application returned", "Host Frame", "Saved host backtrace",
                 "errors were not printed")


def first_reports(output, count=4):
    """The first ``count`` reports of compute-sanitizer's output (a hazard, an invalid access, a barrier error: the
    line that opens it and its indented lines), without their host backtraces, which fill the output's tail."""
    reports = []
    for line in output.splitlines():
        if not line.startswith("=========") or any(word in line for word in _NOT_A_REPORT):
            continue
        body = line[len("========="):]
        if body.startswith(" ") and body.strip() and not body.startswith("  "):  # a report's first line
            if len(reports) == count:
                break
            reports.append([line])
        elif reports and body.startswith("  ") and body.strip():
            reports[-1].append(line)
    return "\n".join("\n".join(r) for r in reports)


def compilation_cache_env(cache_dir):
    """Environment that makes JAX keep every compiled executable in ``cache_dir`` and load it from there."""
    return {"JAX_COMPILATION_CACHE_DIR": str(cache_dir), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def crashed_before_any_report(returncode, output):
    """Whether a sanitizer run died by a signal before reporting anything and before the case finished: on
    the H200 compute-sanitizer now and then segfaults while XLA compiles a module under it (twice in the
    seventeenth session, once under synccheck and once under memcheck; the same case passed under the same
    tools in the other runs). Such a run says nothing about the kernels, so the test runs it once more."""
    died = returncode < 0 or returncode >= 128
    reported = [ln for ln in output.splitlines() if ln.startswith("=========") and "COMPUTE-SANITIZER" not in ln]
    return died and not reported and "sanitizer case:" not in output


CLEAN_RACECHECK = """========= COMPUTE-SANITIZER
sanitizer case: ok
========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)
"""
# Recorded on the H200 (main's build before ClusterShape 1 x 1; abridged: the traceback's middle left out).
STOPPED_RACECHECK = """========= COMPUTE-SANITIZER
cutlass einsum 150 1 264 256
========= Internal Sanitizer Error: The Sanitizer failed to handle a hardware exception.
=========
jax.errors.JaxRuntimeError: INTERNAL: CUDA error: [0] Failed to load in-memory CUBIN (compiled for a different GPU?).: CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access was encountered [executable_name='jit_convert_element_type']
========= Target application returned an error
========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)
"""
CLEAN_MEMCHECK = """========= COMPUTE-SANITIZER
sanitizer case: ok
========= ERROR SUMMARY: 0 errors
"""


def test_verdict_accepts_clean_outputs():
    assert sanitizer_verdict("racecheck", CLEAN_RACECHECK) is None
    assert sanitizer_verdict("memcheck", CLEAN_MEMCHECK) is None
    assert sanitizer_verdict("synccheck", CLEAN_MEMCHECK) is None


def test_verdict_rejects_a_stopped_sanitizer_hazards_errors_and_missing_summaries():
    assert "stopped: Internal Sanitizer Error: The Sanitizer failed to handle a hardware exception" in (
        sanitizer_verdict("racecheck", STOPPED_RACECHECK))
    hazard = CLEAN_RACECHECK.replace("0 hazards displayed (0 errors, 0 warnings)", "2 hazards displayed (0 errors, 2 warnings)")
    assert sanitizer_verdict("racecheck", hazard) == "racecheck: RACECHECK SUMMARY: 2 hazards displayed (0 errors, 2 warnings)"
    one = CLEAN_RACECHECK.replace("0 hazards displayed (0 errors, 0 warnings)", "1 hazard displayed (1 error, 0 warnings)")
    assert sanitizer_verdict("racecheck", one).startswith("racecheck: RACECHECK SUMMARY: 1 hazard")
    assert sanitizer_verdict("memcheck", CLEAN_MEMCHECK.replace("0 errors", "3 errors")) == "memcheck: ERROR SUMMARY: 3 errors"
    assert sanitizer_verdict("memcheck", CLEAN_MEMCHECK.replace("ERROR SUMMARY: 0 errors", "")) == "memcheck printed no summary"
    assert sanitizer_verdict("racecheck", CLEAN_MEMCHECK) == "racecheck printed no summary"
    wrong = CLEAN_MEMCHECK.replace("sanitizer case: ok", "sanitizer case: WRONG RESULTS")
    assert sanitizer_verdict("memcheck", wrong) == "the sanitizer case did not finish with correct results"


# The shape of racecheck's hazard reports and synccheck's barrier errors (compute-sanitizer's documentation), with
# the host backtrace a JAX process prints after each (abridged).
HAZARDS = """========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at 0x1f30 in hopper_gemm.cu:611:HandFusedEpilogue
=========     and Read access at 0x2c80 in hopper_gemm.cu:640:AsyncFusedEpilogue [256 hazards]
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame: cuLaunchKernelEx [0x3b1c2] in libcuda.so.1
=========         Host Frame: main in sanitizer_case.py:140
=========
========= Barrier error detected. Divergent thread(s) in warp
=========     at 0x4410 in hopper_gemm.cu:655:AsyncFusedEpilogue
=========     by thread (40,0,0) in block (3,0,0)
=========         Host Frame: main in sanitizer_case.py:140
=========
========= Error: Race reported between Read access at 0x2c80 in hopper_gemm.cu:640:AsyncFusedEpilogue
=========     and Write access at 0x1f30 in hopper_gemm.cu:611:HandFusedEpilogue [32 hazards]
=========
sanitizer case: ok
========= RACECHECK SUMMARY: 3 hazards displayed (3 errors, 0 warnings)
"""


def test_first_reports_keep_each_report_and_drop_the_backtraces():
    two = first_reports(HAZARDS, count=2).splitlines()
    assert two == [
        "========= Error: Race reported between Write access at 0x1f30 in hopper_gemm.cu:611:HandFusedEpilogue",
        "=========     and Read access at 0x2c80 in hopper_gemm.cu:640:AsyncFusedEpilogue [256 hazards]",
        "========= Barrier error detected. Divergent thread(s) in warp",
        "=========     at 0x4410 in hopper_gemm.cu:655:AsyncFusedEpilogue",
        "=========     by thread (40,0,0) in block (3,0,0)"]
    assert first_reports(HAZARDS).count("Race reported") == 2
    assert first_reports(CLEAN_RACECHECK) == "" and first_reports(STOPPED_RACECHECK).startswith(
        "========= Internal Sanitizer Error")


# Recorded on the H200 (seventeenth session, memcheck, exit by SIGSEGV; the XLA warning abridged).
CRASHED_MEMCHECK = """========= COMPUTE-SANITIZER
E1201 14:06:45.774741    1169 slow_operation_alarm.cc:73]
[Compiling module jit__lambda for GPU] Very slow compile? If you want to file a bug, run with envvar XLA_FLAGS=...
"""


def test_only_a_crash_before_any_report_is_run_again():
    assert crashed_before_any_report(-11, CRASHED_MEMCHECK)
    assert crashed_before_any_report(139, CRASHED_MEMCHECK)
    assert not crashed_before_any_report(0, CRASHED_MEMCHECK)  # no signal: judged as it is (no summary: fails)
    assert not crashed_before_any_report(-11, STOPPED_RACECHECK)  # the tool reported: judged as it is
    assert not crashed_before_any_report(1, CLEAN_MEMCHECK.replace("0 errors", "3 errors"))
    assert not crashed_before_any_report(-11, "========= COMPUTE-SANITIZER\nsanitizer case: ok\n")


def test_compilation_cache_env_really_caches(tmp_path):
    """The environment above makes a fresh JAX process write its compiled executables to the directory (CPU)."""
    env = {**os.environ, **compilation_cache_env(tmp_path), "JAX_PLATFORMS": "cpu"}
    code = "import jax, jax.numpy as jnp; print(float(jax.jit(lambda x: jnp.sin(x) * 3)(jnp.ones(4)).sum()))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert any("jit__lambda" in name for name in os.listdir(tmp_path)), os.listdir(tmp_path)


@pytest.fixture(scope="module")
def compiled_case_env(tmp_path_factory):
    """Environment for the sanitized runs: the case run once without a sanitizer, its executables cached."""
    if find_sanitizer() is None:
        pytest.skip("compute-sanitizer not found (PATH, /usr/local/cuda*/bin)")
    # The child allocates on demand: this process's JAX client may already hold most of the GPU's memory.
    env = {**os.environ, "PYTHONPATH": ROOT, "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
           **compilation_cache_env(tmp_path_factory.mktemp("jax_cache"))}
    r = subprocess.run([sys.executable, CASE], capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert r.returncode == 0 and "sanitizer case: ok" in r.stdout, (r.stdout + r.stderr)[-4000:]
    return env


@pytest.mark.gpu
@pytest.mark.alone  # compute-sanitizer slows the GPU's every kernel: scripts/gpu_tests.py runs it by itself
@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_sanitizer_case_is_clean(tool, compiled_case_env):
    env = compiled_case_env
    cmd = [find_sanitizer(), "--tool", tool, *TOOLS[tool], "--kernel-name", "kns=jax_w4a8", sys.executable, CASE]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    if crashed_before_any_report(r.returncode, r.stdout + r.stderr):  # the tool's own crash: once more
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    output = r.stdout + r.stderr
    why = sanitizer_verdict(tool, output)
    assert why is None and r.returncode == 0, (
        f"{why or f'exit status {r.returncode}'}\n{first_reports(output)}\n...\n{output[-1500:]}")
