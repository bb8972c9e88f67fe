"""Shared fixtures: fresh random data, device selection, poisoned outputs, float64 references."""

import os
import sys

# Eight virtual CPU devices for the expert-parallel tests (set before JAX initialises its backends).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from jax_w4a8 import ffi_available  # noqa: E402


def _gpu_devices():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


HAVE_GPU = bool(_gpu_devices()) and bool(ffi_available("cuda"))


def pytest_collection_modifyitems(config, items):
    if HAVE_GPU:
        return
    why = "no GPU" if not _gpu_devices() else f"CUDA handlers unavailable: {ffi_available('cuda').reason}"
    skip = pytest.mark.skip(reason=why)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng():
    """Fresh random data each run (the seed is printed on failure through the test id)."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"numpy seed {seed}")
    return np.random.default_rng(seed)


BACKENDS = [
    pytest.param("cpu", id="cpu"),
    pytest.param("gpu", id="gpu", marks=pytest.mark.gpu),
]


@pytest.fixture(params=BACKENDS)
def device(request):
    """The device an op runs on: the CPU FFI handler, or the CUDA one on the first GPU."""
    return _gpu_devices()[0] if request.param == "gpu" else jax.devices("cpu")[0]


def run_poisoned(fn, out_shape, out_dtype, args, device):
    """Runs ``fn(*args)`` under jit on ``device`` writing into a NaN-filled output buffer.

    The poisoned buffer is donated and aliased to the output, so any element the kernel leaves
    unwritten stays NaN. Asserts the aliasing really happened, returns the output as float32 numpy.
    """
    import jax.numpy as jnp

    args = [jax.device_put(a, device) for a in args]
    poison = jnp.full(out_shape, jnp.nan, out_dtype, device=device).block_until_ready()
    ptr = poison.unsafe_buffer_pointer()
    out = jax.jit(lambda p, *a: fn(*a), donate_argnums=0, keep_unused=True)(poison, *args)
    assert out.unsafe_buffer_pointer() == ptr, "the output did not land in the poisoned buffer"
    return np.asarray(out.astype(jnp.float32))
