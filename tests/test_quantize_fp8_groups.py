"""ops.quantize_fp8_groups (the kernel) against jax_w4a8.quant and a float64 numpy recipe."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import np_ref
from conftest import run_poisoned
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
    f = functools.partial(ops.quantize_fp8_groups, ue8m0=ue8m0, impl="ffi")
    # Both outputs NaN-poisoned (codes: e4m3's 0x7F NaN), so a code or scale left unwritten fails below.
    q, s = run_poisoned(f, ((3, 37, 512), (3, 37, 4)), (jnp.float8_e4m3fn, jnp.float32), (x,), device)
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
    f = functools.partial(ops.silu_mul_quantize_fp8_groups, ue8m0=ue8m0, impl="ffi")
    # Both outputs NaN-poisoned (codes: e4m3's 0x7F NaN), so a code or scale left unwritten fails below.
    q, s = run_poisoned(f, ((3, 37, 384), (3, 37, 3)), (jnp.float8_e4m3fn, jnp.float32), (x,), device)
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


@pytest.mark.parametrize("ue8m0", [False, True])
def test_non_finite_inputs_match_the_reference(rng, ue8m0):
    """NaN and Inf inputs: the CPU kernel and the jnp reference agree bit for bit (NaN left out of the amax, Inf
    making its group's scale Inf), on groups with and without them."""
    x = rng.standard_normal((4, 512)).astype(np.float32)
    x[0, 3], x[1, 200], x[2, 260], x[2, 261], x[3, 400] = np.nan, np.inf, -np.inf, np.nan, np.nan
    x[3, 384:512] = np.nan  # a whole group of NaN: the amax floor's scale, NaN codes
    for dtype in (jnp.float32, jnp.bfloat16):
        xs = jnp.asarray(x, dtype)
        got = ops.quantize_fp8_groups(xs, ue8m0=ue8m0, impl="ffi")
        want = ops.quantize_fp8_groups(xs, ue8m0=ue8m0, impl="reference")
        codes = [np.asarray(c[0]).view(np.uint8) for c in (got, want)]
        codes = [np.where(c & 0x7F == 0x7F, 0x7F, c) for c in codes]  # e4m3 NaN either sign: one NaN
        if ue8m0:  # the same power-of-two scale: the same codes
            np.testing.assert_array_equal(codes[0], codes[1])
        else:  # scales 1 ulp apart may move a code across a rounding boundary: one step at most, NaN where NaN
            np.testing.assert_array_equal(codes[0] == 0x7F, codes[1] == 0x7F)
            vals = [np.asarray(c[0].astype(jnp.float32)) for c in (got, want)]
            ok = codes[0] != 0x7F
            np.testing.assert_allclose(vals[0][ok], vals[1][ok], rtol=0.13, atol=2.0**-9)
        # the reference's float32 division may be 1 ulp off the kernels' correctly rounded amax / 448 (codes equal)
        np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=0 if ue8m0 else 1.2e-7)
        assert (codes[0][3, 384:] == 0x7F).all() and (codes[0][0, 3] == 0x7F)
        # Inf: saturated to +-448 under the largest scale (float32's largest / 448; UE8M0's 2**127), never NaN
        assert codes[0][1, 200] == 0x7E and codes[0][2, 260] == 0xFE
    assert np.isfinite(np.asarray(got[1])[3, 3])
    flt_max = np.finfo(np.float32).max
    assert np.asarray(got[1])[1, 1] == (np.float32(2.0**127) if ue8m0 else np.float32(flt_max) / np.float32(448))


@pytest.mark.parametrize("ue8m0", [False, True])
def test_silu_mul_product_past_float32_saturates(rng, device, ue8m0):
    """Finite gate and up whose product passes float32's range (about 2e19 each in bfloat16) make h Inf: its
    group's scale is the largest there is and its code +-448, never NaN (an Inf scale made Inf / Inf a NaN code
    and 0 * Inf NaN in every dequantized value of the group), on the kernels and the reference alike."""
    x = rng.standard_normal((4, 512)).astype(np.float32)
    x[1, 5], x[1, 256 + 5] = 3e19, 2e19       # gate and up of channel 5 in row 1: h = 6e38 > float32's max
    x[2, 130], x[2, 256 + 130] = 3e19, -2e19  # -6e38: -448
    x = jnp.asarray(x, jnp.bfloat16)
    f = functools.partial(ops.silu_mul_quantize_fp8_groups, ue8m0=ue8m0, impl="ffi")
    q, s = run_poisoned(f, ((4, 256), (4, 2)), (jnp.float8_e4m3fn, jnp.float32), (x,), device)
    codes = np.asarray(q).view(np.uint8)
    assert not ((codes & 0x7F) == 0x7F).any() and np.isfinite(s).all()
    assert codes[1, 5] == 0x7E and codes[2, 130] == 0xFE
    top = np.float32(2.0**127) if ue8m0 else np.float32(np.finfo(np.float32).max) / np.float32(448)
    assert s[1, 0] == top and s[2, 1] == top
    # the other codes of those groups are 0 or -0 (tiny against the scale); the untouched groups are ordinary
    assert (codes[1, :128][np.arange(128) != 5] & 0x7F == 0).all()
    assert (codes[2, 128:][np.arange(128) != 2] & 0x7F == 0).all()
    assert s[0, 0] < 1 and s[3, 1] < 1
    q_ref, s_ref = ops.silu_mul_quantize_fp8_groups(x, ue8m0=ue8m0, impl="reference")
    s_ref, c_ref = np.asarray(s_ref), np.asarray(q_ref).view(np.uint8)
    assert s_ref[1, 0] == top and s_ref[2, 1] == top  # (ordinary groups: the reference's division 1 ulp off)
    np.testing.assert_array_equal(c_ref[1, :128], codes[1, :128])
    np.testing.assert_array_equal(c_ref[2, 128:], codes[2, 128:])


def test_option_types(rng):
    x = jnp.asarray(rng.standard_normal((4, 256)), jnp.bfloat16)
    assert ops.quantize_fp8_groups(x, group_size=np.int64(128))[1].shape == (4, 2)
    for bad in (True, 128.0, "128"):
        with pytest.raises(ValueError, match="'group_size'"):
            ops.quantize_fp8_groups(x, group_size=bad)
    for fn in (ops.quantize_fp8_groups, ops.silu_mul_quantize_fp8_groups):
        with pytest.raises(TypeError, match="'ue8m0' must be True or False"):
            fn(x, ue8m0="no")
        with pytest.raises(TypeError, match="'ue8m0' must be True or False"):
            jax.jit(lambda v, u: fn(v, ue8m0=u))(x, True)


def _same_codes(a, b):
    """e4m3 codes equal bit for bit, any NaN code matching any other."""
    a, b = np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)
    return ((a == b) | (((a & 0x7F) == 0x7F) & ((b & 0x7F) == 0x7F))).all()


def _fold_inputs(rng, lead, k):
    x = (rng.standard_normal(lead + (k,)) * np.exp2(rng.integers(-12, 12, lead + (k // 128,))).repeat(128, -1))
    x = x.astype(np.float32).reshape(-1, k)
    x[0] = 0.0                                # all zero
    x[1] = np.sign(x[1]) * 2.0 ** -31         # codes 2^-9 under the floor scale: the lift capped at 15
    x[2, 3] = np.nan                          # a NaN code (left out of the lift)
    x[3, -1] = np.inf                         # an infinite input: scale 2^127, the token's other groups fold to 0
    x[4, :128] *= 2.0 ** -40                  # one group far below the others
    return x.reshape(lead + (k,))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("groups", [1, 16, 17, 56, 128, 129])
def test_folded_layout_matches_float64(rng, device, dtype, groups):
    """layout="folded": the UE8M0 codes of each token with its group scales folded in, in the folded K order, and
    one multiplier per token (the CUDA kernel holds a row of up to 16, 32, 64 or 128 groups; 129 is quantized,
    then folded in XLA), bit for bit the float64 fold (tests/np_ref.py fold_groups) of the quantizer's codes."""
    k = 128 * groups
    x = jnp.asarray(_fold_inputs(rng, (2, 9), k), dtype)
    f = functools.partial(ops.quantize_fp8_groups, ue8m0=True, layout="folded", impl="ffi")
    if device.platform == "gpu" and groups <= 128:  # the kernel's own outputs, NaN-poisoned
        q, t = run_poisoned(f, ((2, 9, k), (2, 9)), (jnp.float8_e4m3fn, jnp.float32), (x,), device)
    else:
        q, t = (np.asarray(a) for a in jax.jit(f)(jax.device_put(x, device)))
    assert q.dtype == jnp.float8_e4m3fn and q.shape == (2, 9, k) and t.shape == (2, 9)
    ref_q, ref_t = np_ref.fold_groups(*quant.quantize_fp8_groups(x, ue8m0=True))
    assert _same_codes(q, ref_q)
    np.testing.assert_array_equal(t, ref_t)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("rows, groups", [(37, 3), (37, 16), (37, 56), (3, 128), (2500, 16)])
def test_silu_mul_folded_layout_is_the_fold_of_its_codes(rng, device, dtype, rows, groups):
    """silu_mul_quantize_fp8_groups(layout="folded") (the down projection's input, folded): the float64 fold of the
    same call's standard codes and scales, bit for bit. The CUDA kernel's largest rows (128 groups held in
    registers, float32 gate and up) and more rows than its grid has blocks (8 per SM: each block then folds rows
    one after another, reusing its shared memory)."""
    inter = 128 * groups
    x = (rng.standard_normal((rows, 2 * inter)) * np.exp2(rng.uniform(-6, 6, (rows, 1)))).astype(np.float32)
    x[0] = 0.0
    x[1, :inter] = -1e4  # silu of a large negative gate: -0 codes
    x = jnp.asarray(x, dtype)
    f = functools.partial(ops.silu_mul_quantize_fp8_groups, ue8m0=True, layout="folded", impl="ffi")
    if device.platform == "gpu":
        q, t = run_poisoned(f, ((rows, inter), (rows,)), (jnp.float8_e4m3fn, jnp.float32), (x,), device)
    else:
        q, t = (np.asarray(a) for a in jax.jit(f)(jax.device_put(x, device)))
    std = jax.jit(functools.partial(ops.silu_mul_quantize_fp8_groups, ue8m0=True, impl="ffi"))(
        jax.device_put(x, device))
    ref_q, ref_t = np_ref.fold_groups(*(np.asarray(a) for a in std))
    assert _same_codes(q, ref_q)
    np.testing.assert_array_equal(t, ref_t)


def test_folded_layout_errors(rng):
    x = jnp.asarray(rng.standard_normal((4, 256)), jnp.bfloat16)
    with pytest.raises(ValueError, match="'layout'"):
        ops.quantize_fp8_groups(x, ue8m0=True, layout="tiled")
    with pytest.raises(ValueError, match="'ue8m0'"):
        ops.quantize_fp8_groups(x, layout="folded")
    with pytest.raises(ValueError, match="'group_size'"):
        ops.quantize_fp8_groups(x, 64, ue8m0=True, layout="folded")
    with pytest.raises(ValueError, match="'ue8m0'"):
        ops.silu_mul_quantize_fp8_groups(x, layout="folded")
    q, t = ops.quantize_fp8_groups(x, ue8m0=True, layout="folded", impl="reference")
    assert q.shape == (4, 256) and t.shape == (4,)
