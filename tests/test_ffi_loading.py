"""Loading the compiled handlers once, and falling back to the reference when they are missing."""

import json
import os
import subprocess
import sys
import textwrap

import jax_w4a8
from jax_w4a8 import ffi_available
from jax_w4a8._ffi import TARGETS


def test_cpu_handlers_are_built():
    status = ffi_available("cpu")
    assert status and status.reason == "", status.reason


def test_unknown_platform_has_a_reason():
    status = ffi_available("tpu")
    assert not status and "tpu" in status.reason


def test_cuda_status_is_explained():
    status = ffi_available("gpu")
    assert bool(status) or status.reason


def test_without_handlers_the_reference_serves():
    code = textwrap.dedent("""
        import numpy as np, jax, jax.numpy as jnp
        from jax_w4a8 import ffi_available, ops, quant
        st = ffi_available("cpu")
        assert not st and "JAX_W4A8_DISABLE_FFI" in st.reason, st
        rng = np.random.default_rng(0)
        w, ws = quant.quantize_w4(rng.standard_normal((2, 8, 128)).astype(np.float32))
        x8, xs = quant.quantize_fp8_groups(rng.standard_normal((6, 128)).astype(np.float32))
        args = (x8, xs, w, ws, jnp.array([3, 3], jnp.int32))
        assert "custom_call" not in jax.jit(ops.w4a8_grouped_gemm).lower(*args).as_text()
        out = ops.w4a8_grouped_gemm(*args)
        ref = ops.w4a8_grouped_gemm(*args, impl="reference")
        assert np.array_equal(np.asarray(out), np.asarray(ref))
        print("ok")
    """)
    env = dict(os.environ, JAX_W4A8_DISABLE_FFI="cpu,cuda", JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


# Counts every jax.ffi.register_ffi_target call from before the package's first import, through the imports a
# user makes, a reload of the package and one op call: each registered target of each platform exactly once.
REGISTER_ONCE = textwrap.dedent("""
    import collections, importlib, json
    import jax, jax.ffi
    calls = collections.Counter()
    real = jax.ffi.register_ffi_target
    def counting(name, fn, platform="cpu", *args, **kwargs):
        calls[(name, platform)] += 1
        return real(name, fn, platform, *args, **kwargs)
    jax.ffi.register_ffi_target = counting
    import jax_w4a8
    import jax_w4a8.ops
    import jax_w4a8.models.deepseek
    importlib.reload(jax_w4a8)
    import numpy as np
    codes = jax.jit(jax_w4a8.ops.pack_ue8m0)(np.array([1.0, 0.5], np.float32))
    assert np.asarray(codes).tolist() == [127, 126], codes
    from jax_w4a8 import _ffi
    want = {}
    for platform, (module, xla_platform) in _ffi._MODULES.items():
        if _ffi.ffi_available(platform):
            mod = importlib.import_module("jax_w4a8._lib." + module)
            want[xla_platform] = sorted(mod.registrations())
    print(json.dumps({"calls": [[n, p, c] for (n, p), c in calls.items()], "want": want}))
    """)


def _registrations(code=REGISTER_ONCE):
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_handlers_register_once():
    got = _registrations()
    want = got["want"]
    assert "cpu" in want and set(want["cpu"]) >= set(TARGETS.values()) - {TARGETS["w4a8_moe_up"]}, want
    counts = {(n, p): c for n, p, c in got["calls"]}
    assert {k: c for k, c in counts.items() if c != 1} == {}, "targets registered more than once"
    assert set(counts) == {(n, p) for p, names in want.items() for n in names}


def test_built_with_cutlass_follows_the_cuda_module(monkeypatch):
    # True only with the CUDA handlers loaded and CUTLASS compiled in (test_sass.py checks the kernel is
    # really in the library then); a missing or disabled CUDA module means False.
    import jax_w4a8._ffi as ffi
    got = ffi.built_with_cutlass()
    assert isinstance(got, bool)
    monkeypatch.setitem(ffi._STATUS, "cuda", ffi.FfiAvailability("cuda", False, "disabled for the test"))
    assert ffi.built_with_cutlass() is False


def test_cublaslt_says_its_version_or_why_not(monkeypatch):
    # (version, "") with a cuBLASLt that has block scaling (12.9+: its header's version numbering, 120900), else
    # (0, a reason); a missing or disabled CUDA module is a reason, asked afresh once the cache is cleared.
    import jax_w4a8._ffi as ffi
    version, why = ffi.cublaslt()
    assert (version >= 120900 and why == "") or (version == 0 and why), (version, why)
    assert ffi.cublaslt() == (version, why)  # cached
    monkeypatch.setattr(ffi, "_CUBLASLT", None)
    monkeypatch.setitem(ffi._STATUS, "cuda", ffi.FfiAvailability("cuda", False, "disabled for the test"))
    assert ffi.cublaslt() == (0, "the CUDA handlers are not available: disabled for the test")


def test_source_fingerprint_follows_every_file(tmp_path):
    """The fingerprint recipe (CMakeLists.txt compiles the same into the modules): sha256sum lines, sorted."""
    import hashlib

    from jax_w4a8._ffi import source_fingerprint

    root = tmp_path / "ffi"
    (root / "cuda").mkdir(parents=True)
    (root / "module.cc").write_bytes(b"int main() {}\n")
    (root / "cuda" / "k.cu").write_bytes(b"__global__ void k() {}\n")
    lines = "".join(f"{hashlib.sha256(b).hexdigest()}  {p}\n" for p, b in
                    [("ffi/cuda/k.cu", b"__global__ void k() {}\n"), ("ffi/module.cc", b"int main() {}\n")])
    first = source_fingerprint(root)
    assert first == hashlib.sha256(lines.encode()).hexdigest()
    (root / "cuda" / "k.cu").write_bytes(b"__global__ void k() { }\n")
    assert source_fingerprint(root) != first
    (root / "cuda" / "k.cu").write_bytes(b"__global__ void k() {}\n")
    (root / "notes.txt").write_bytes(b"not a source")   # other files and dangling links do not count
    (root / ".#k.cu").symlink_to(root / "missing")
    assert source_fingerprint(root) == first
    (root / "extra.h").write_bytes(b"")
    assert source_fingerprint(root) != first


def test_build_info_names_the_sources_of_the_loaded_modules():
    """Every loaded module says which ffi/ sources it was built from; in a source checkout they must be the
    checkout's (a failure here means the library is stale: cmake --build build && cmake --install build)."""
    info = jax_w4a8.build_info()
    assert info["version"] == jax_w4a8.__version__
    assert info["cpu"]["available"], info["cpu"]["reason"]
    for plat in ("cpu", "cuda"):
        if info[plat]["available"]:
            sha = info[plat]["source_sha256"]
            assert sha == "unknown" or (len(sha) == 64 and int(sha, 16) >= 0), sha
        else:
            assert info[plat]["source_sha256"] is None and info[plat]["reason"]
    if info["checkout"] is not None:
        assert info["checkout"]["stale"] == [], (
            f"modules {info['checkout']['stale']} were built from other sources than {info['checkout']['ffi_dir']}")
        if info["cpu"]["source_sha256"] != "unknown":  # a build without the fingerprint (Bazel) cannot tell
            assert info["cpu"]["source_sha256"] == info["checkout"]["source_sha256"]
