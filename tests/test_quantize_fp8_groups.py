"""ops.quantize_fp8_groups (the kernel) against jax_w4a8.quant and a float64 numpy recipe."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_w4a8 import ops, quant


def np_quantize(x, ue8m0):
    """numpy recipe with IEEE float32 division: amax floored at 1e-4, scale amax / 448 (rounded up to
    2^n), then one saturating round-to-nearest-even cast of x / s."""
    g = x.astype(np.float32).reshape(*x.shape[:-1], -1, 128)
    s = np.maximum(np.abs(g).max(-1), np.float32(1e-4)) / np.float32(448)
    if ue8m0:
        s = np.exp2(np.ceil(np.log2(s.astype(np.float64)))).astype(np.float32)
    q = np.clip(g / s[..., None], -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return q.reshape(x.shape), s


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_kernel_matches_reference(rng, device, dtype, ue8m0):
    x = (rng.standard_normal((3, 37, 512)) * np.exp2(rng.uniform(-10, 10, (3, 37, 1)))).astype(np.float32)
    x[0, 0, :128] = 0.0                 # all-zero group
    x[1, 2, 5] = 1e30                   # one huge value: the rest of its group rounds to zero, no NaN
    x = jnp.asarray(x, dtype)
    f = jax.jit(functools.partial(ops.quantize_fp8_groups, ue8m0=ue8m0, impl="ffi"))
    q, s = f(jax.device_put(x, device))
    q_ref, s_ref = quant.quantize_fp8_groups(x, ue8m0=ue8m0)
    assert q.dtype == jnp.float8_e4m3fn and s.shape == (3, 37, 4)
    np.testing.assert_allclose(np.asarray(s), np.asarray(s_ref), rtol=3e-7)
    codes, codes_ref = np.asarray(q).view(np.uint8), np.asarray(q_ref).view(np.uint8)
    # The kernel divides exactly (IEEE float32), as numpy does: codes equal bit for bit.
    q_np, s_np = np_quantize(np.asarray(x, np.float32), ue8m0)
    np.testing.assert_array_equal(np.asarray(s), s_np)
    np.testing.assert_array_equal(codes, q_np.view(np.uint8))
    # XLA's jnp reference may divide through a reciprocal (one ulp off), which moves a value across
    # an e4m3 rounding boundary rarely; UE8M0 scales divide exactly everywhere.
    mismatch = np.mean(codes != codes_ref)
    assert mismatch == 0 if ue8m0 else mismatch < 5e-3
    assert np.isfinite(np.asarray(q).astype(np.float32)).all()
    if ue8m0:
        assert np.asarray(quant.is_ue8m0_exact(s)).all()


def test_auto_dispatch_and_errors(rng):
    x = jnp.asarray(rng.standard_normal((4, 256)), jnp.bfloat16)
    assert "jax_w4a8_quantize_fp8_groups" in jax.jit(ops.quantize_fp8_groups).lower(x).as_text()
    with pytest.raises(ValueError, match="'x'"):
        ops.quantize_fp8_groups(x[:, :200])
    with pytest.raises(TypeError, match="'x'"):
        ops.quantize_fp8_groups(x.astype(jnp.int32))
    with pytest.raises(ValueError, match="'group_size'"):
        ops.quantize_fp8_groups(x, group_size=0)
    q, s = ops.quantize_fp8_groups(x, group_size=64)  # other group sizes: the reference
    assert s.shape == (4, 4)


def np_silu_mul(x):
    """float64: silu(gate) * up for x = [gate, up] on the last axis."""
    x = np.asarray(x, np.float64)
    g, u = np.split(x, 2, axis=-1)
    return g * np.exp(-np.logaddexp(0.0, -g)) * u  # g * sigmoid(g), no overflow for g << 0


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_silu_mul_kernel_matches_float64(rng, device, dtype, ue8m0):
    """ops.silu_mul_quantize_fp8_groups: every code within e4m3's rounding of float64 silu(gate) * up (half a
    step: 2^-4 relative, 2^-10 of the scale among subnormals), every scale the float64 group maximum / 448
    (rounded up to a power of two with ue8m0), against the jnp reference too."""
    x = (rng.standard_normal((3, 37, 768)) * np.exp2(rng.uniform(-6, 6, (3, 37, 1)))).astype(np.float32)
    x[0, 0, :128] = 0.0           # an all-zero gate group: h = 0 there, scale from the 1e-4 floor
    x[1, 2, 384:512] = 0.0        # an all-zero up group (up channels are [384, 768))
    x[2, 3, 10] = -1e4            # silu of a large negative gate: -0 (exp(-g) is Inf), not NaN
    x = jnp.asarray(x, dtype)
    f = jax.jit(functools.partial(ops.silu_mul_quantize_fp8_groups, ue8m0=ue8m0, impl="ffi"))
    q, s = f(jax.device_put(x, device))
    assert q.dtype == jnp.float8_e4m3fn and q.shape == (3, 37, 384) and s.shape == (3, 37, 3)
    h = np_silu_mul(np.asarray(x, np.float32))
    s64 = np.asarray(s, np.float64)
    amax = np.maximum(np.abs(h).reshape(3, 37, 3, 128).max(-1), 1e-4)
    want = amax / 448 if not ue8m0 else np.exp2(np.ceil(np.log2(amax / 448)))
    np.testing.assert_allclose(s64, want, rtol=2e-6)
    deq = np.asarray(q).astype(np.float64) * np.repeat(s64, 128, axis=-1)
    assert np.isfinite(deq).all()
    bound = 2.0**-4 * np.abs(h) * (1 + 1e-5) + 2.0**-10 * np.repeat(s64, 128, axis=-1)
    assert (np.abs(deq - h) <= bound).all()
    q_ref, s_ref = ops.silu_mul_quantize_fp8_groups(x, ue8m0=ue8m0, impl="reference")
    assert np.mean(np.asarray(q).view(np.uint8) == np.asarray(q_ref).view(np.uint8)) > 0.995


def test_silu_mul_errors(rng):
    x = jnp.asarray(rng.standard_normal((4, 512)), jnp.bfloat16)
    text = jax.jit(ops.silu_mul_quantize_fp8_groups).lower(x).as_text()
    assert "jax_w4a8_quantize_fp8_groups" in text
    with pytest.raises(ValueError, match="'x'.*2I"):
        ops.silu_mul_quantize_fp8_groups(x[:, :384])
    with pytest.raises(TypeError, match="'x'"):
        ops.silu_mul_quantize_fp8_groups(x.astype(jnp.int32))
