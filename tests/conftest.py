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


@pytest.fixture(autouse=True)
def _cpu_unless_gpu(request):
    """Tests without the ``gpu`` keyword (the marker, or the ``device`` fixture's gpu param) run with the CPU as
    JAX's default device, so on a GPU host they still run the CPU handlers their tolerances were set for.
    gpu tests keep JAX's default; explicit placements (``device_put``, meshes over ``jax.devices("cpu")``,
    ``jax.default_device`` inside a test) take precedence either way. Where the CPU is JAX's default backend
    already, nothing is set (a set default device is part of jit's cache key: setting it would change which
    compilations tests share, not where they run)."""
    if "gpu" in request.keywords or jax.default_backend() == "cpu":
        yield
        return
    with jax.default_device(jax.devices("cpu")[0]):
        yield


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


def poisoned_jit(fn):
    """``jax.jit`` of ``fn(*args)`` that takes the poisoned output buffer(s) first, donated (see
    :func:`run_poisoned`). Build it once to call :func:`run_poisoned` repeatedly without recompiling."""
    return jax.jit(lambda p, *a: fn(*a), donate_argnums=0, keep_unused=True)


def _poison(shape, dtype, fill, device):
    import jax.numpy as jnp

    dtype = jnp.dtype(dtype)
    if fill is None:
        # NaN for floating outputs (e4m3: the 0x7F NaN code), the largest code for integer ones (uint8: 0xFF,
        # the UE8M0 NaN code, which the scale kernels never write).
        fill = np.nan if jnp.issubdtype(dtype, jnp.inexact) else np.iinfo(dtype).max
    return jnp.full(shape, fill, dtype, device=device).block_until_ready()


def run_poisoned(fn, out_shape, out_dtype, args, device, fill=None, jitted=None):
    """Runs ``fn(*args)`` under jit on ``device`` writing into poisoned output buffers.

    Each poisoned buffer is donated and aliased to its output, so any element the kernel leaves unwritten
    keeps the poison: NaN by default (the largest code for integer outputs), or ``fill`` (one value, or one
    per output), a finite sentinel for outputs whose right value is NaN itself. Asserts the aliasing really
    happened. ``out_shape`` / ``out_dtype``: one shape and dtype, or tuples of them for an ``fn`` returning a
    tuple. ``jitted``: :func:`poisoned_jit` ``(fn)`` built once, for repeated calls. Returns the output as
    float32 numpy, or for tuple outputs a tuple of numpy arrays in their own dtypes.
    """
    multi = isinstance(out_dtype, (tuple, list))
    shapes, dtypes = (tuple(out_shape), tuple(out_dtype)) if multi else ((out_shape,), (out_dtype,))
    assert len(shapes) == len(dtypes), "one shape per output dtype"
    fills = tuple(fill) if isinstance(fill, (tuple, list)) else (fill,) * len(dtypes)
    args = [jax.device_put(a, device) for a in args]
    poison = tuple(_poison(s, d, f, device) for s, d, f in zip(shapes, dtypes, fills))
    ptrs = [p.unsafe_buffer_pointer() for p in poison]
    out = (jitted or poisoned_jit(fn))(poison if multi else poison[0], *args)
    outs = tuple(out) if multi else (out,)
    assert len(outs) == len(poison), f"{len(outs)} outputs, {len(poison)} poisoned buffers"
    for i, (o, ptr) in enumerate(zip(outs, ptrs)):
        assert o.unsafe_buffer_pointer() == ptr, f"output {i} did not land in its poisoned buffer"
    if multi:
        return tuple(np.asarray(o) for o in outs)
    return np.asarray(out.astype(np.float32))


def run_in_command_buffer(op, kernel, seed):
    """``tests/command_buffer_case.py``'s JSON for ``op`` / ``kernel`` ("plan" for the plan's choice), run in a
    fresh process that imports the package this process runs; fails unless XLA put every custom call of the
    program in a command buffer (else the case would test nothing)."""
    import json
    import subprocess

    import jax_w4a8

    home = os.path.dirname(os.path.dirname(jax_w4a8.__file__))
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
           "PYTHONPATH": os.pathsep.join(p for p in (home, os.environ.get("PYTHONPATH")) if p)}
    case = os.path.join(os.path.dirname(__file__), "command_buffer_case.py")
    r = subprocess.run([sys.executable, case, op, kernel, str(seed)], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    # every custom call of the program inside a command buffer, the first call of the op included
    assert got["custom_calls"] and got["custom_calls"] >= got["calls"], f"no custom calls in the thunk dump: {got}"
    assert got["custom_calls_in_command_buffers"] == got["custom_calls"], f"a custom call outside the graph: {got}"
    return got
