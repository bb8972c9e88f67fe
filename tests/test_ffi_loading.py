"""Loading the compiled handlers once, and falling back to the reference when they are missing."""

import os
import subprocess
import sys
import textwrap

import jax_w4a8
from jax_w4a8 import ffi_available


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


def test_handlers_register_once():
    import jax_w4a8._ffi as ffi
    before = dict(ffi._STATUS)
    import importlib
    importlib.reload(jax_w4a8)  # a re-import must not re-register or change anything
    assert ffi._STATUS == before


def test_built_with_cutlass_follows_the_cuda_module(monkeypatch):
    # True only with the CUDA handlers loaded and CUTLASS compiled in (test_sass.py checks the kernel is
    # really in the library then); a missing or disabled CUDA module means False.
    import jax_w4a8._ffi as ffi
    got = ffi.built_with_cutlass()
    assert isinstance(got, bool)
    monkeypatch.setitem(ffi._STATUS, "cuda", ffi.FfiAvailability("cuda", False, "disabled for the test"))
    assert ffi.built_with_cutlass() is False
