"""jax_w4a8.quant: formats and quantizers against independent numpy implementations."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import np_ref
from jax_w4a8 import quant

F32_MAX = np.finfo(np.float32).max
TINY = np.finfo(np.float32).tiny  # 2**-126


# ------------------------------------------------------------------------------------------ int4
def test_pack_nibble_order():
    # element 2i in the low nibble, 2i+1 in the high nibble: [1, -2] -> 0xE1
    p = quant.pack_int4(jnp.array([[1, -2, -8, 7]], jnp.int8))
    assert p.dtype == jnp.int8
    assert np.asarray(p).view(np.uint8).tolist() == [[0xE1, 0x78]]


def test_pack_unpack_round_trip(rng):
    q = rng.integers(-8, 8, size=(3, 5, 256)).astype(np.int8)
    p = quant.pack_int4(q)
    assert p.shape == (3, 5, 128)
    np.testing.assert_array_equal(np.asarray(quant.unpack_int4(p)), q)
    np.testing.assert_array_equal(np_ref.unpack_int4(np.asarray(p)), q)  # independent unpacker
    np.testing.assert_array_equal(np.asarray(quant.unpack_int4(np.asarray(p).view(np.uint8))), q)


def test_pack_under_jit(rng):
    q = rng.integers(-8, 8, size=(4, 64)).astype(np.int8)
    np.testing.assert_array_equal(np.asarray(jax.jit(quant.pack_int4)(q)), np.asarray(quant.pack_int4(q)))


@pytest.mark.parametrize("bad, exc, text", [
    (np.array([[1, 2, 3]], np.int8), ValueError, "even"),
    (np.array([[8, 0]], np.int8), ValueError, "outside the int4 range"),
    (np.array([[-9, 0]], np.int32), ValueError, "outside the int4 range"),
    (np.array([[1.0, 2.0]], np.float32), TypeError, "integer"),
])
def test_pack_rejects(bad, exc, text):
    with pytest.raises(exc, match=text):
        quant.pack_int4(bad)
    if exc is ValueError and "int4" in text:  # a constant inside jit is checked too (it once wrapped silently)
        with pytest.raises(exc, match=text):
            jax.jit(lambda: quant.pack_int4(bad))()
        captured = jnp.asarray(bad)  # a JAX array made outside the jitted function
        with pytest.raises(exc, match=text):
            jax.jit(lambda: quant.pack_int4(captured))()


def _np_quantize_w4(w, g=128):
    w = w.astype(np.float64).reshape(*w.shape[:-1], -1, g)
    s = np.abs(w).max(-1) / 7.0
    q = np.clip(np.rint(w / np.where(s > 0, s, 1.0)[..., None]), -8, 7)
    return q.reshape(*w.shape[:-2], -1).astype(np.int64), s


def test_quantize_w4_matches_trtllm_recipe(rng):
    w = rng.standard_normal((2, 16, 384)).astype(np.float32) * 0.05
    packed, s = quant.quantize_w4(w)
    assert packed.shape == (2, 16, 192) and packed.dtype == jnp.int8
    assert s.shape == (2, 16, 3) and s.dtype == jnp.float32
    q_ref, s_ref = _np_quantize_w4(w)
    np.testing.assert_allclose(np.asarray(s), s_ref, rtol=1e-6)
    q = np_ref.unpack_int4(np.asarray(packed))
    # Codes equal except where float32 vs float64 division lands within rounding of a .5 tie.
    ratio = w.astype(np.float64).reshape(2, 16, 3, 128) / s_ref[..., None]
    near_tie = np.abs(np.abs(ratio - np.floor(ratio)) - 0.5).reshape(q.shape) < 1e-5
    assert np.array_equal(q[~near_tie], q_ref[~near_tie])
    assert q.min() >= -8 and q.max() <= 7 and (np.abs(q) == 7).any()
    deq = np.asarray(quant.dequantize_w4(packed, s))
    bound = np.repeat(np.asarray(s), 128, axis=-1) * 0.5 * (1 + 1e-6)
    assert (np.abs(deq - w) <= bound + 1e-12).all()


def test_quantize_w4_zero_group_is_finite():
    w = np.zeros((2, 256), np.float32)
    w[1, 128:] = np.linspace(-1, 1, 128)
    packed, s = quant.quantize_w4(w)
    assert np.isfinite(np.asarray(s)).all()
    assert np.asarray(s)[0].tolist() == [0.0, 0.0] and np.asarray(s)[1, 0] == 0.0
    q = np_ref.unpack_int4(np.asarray(packed))
    assert (q[0] == 0).all() and (q[1, :128] == 0).all()
    assert np.isfinite(np.asarray(quant.dequantize_w4(packed, s))).all()


def test_quantize_w4_rejects_bad_group():
    with pytest.raises(ValueError, match="multiple of group_size"):
        quant.quantize_w4(np.zeros((4, 100), np.float32))


# ----------------------------------------------------------------------------------------- UE8M0
def _np_ceil_ue8m0(x):
    """2**ceil(log2|x|) through frexp, clamped to [2**-126, 2**127]; Inf/NaN -> 2**127."""
    x = np.abs(np.asarray(x, np.float64))
    out = np.empty_like(x)
    for i, v in np.ndenumerate(x):
        if not np.isfinite(v):
            out[i] = 2.0 ** 127
            continue
        if v == 0:
            out[i] = 2.0 ** -126
            continue
        m, e = np.frexp(v)  # v = m * 2**e, m in [0.5, 1)
        p = e - 1 if m == 0.5 else e
        out[i] = 2.0 ** min(max(p, -126), 127)
    return out


SPECIALS = np.array([
    0.0, -0.0, 1e-45, TINY / 2, TINY, TINY * 1.5, 2.0 ** -127,
    1.0, np.nextafter(np.float32(1), np.float32(2)), np.nextafter(np.float32(1), np.float32(0)),
    0.75, 3.0, -3.0, 448.0, 1e-4 / 448, 2.0 ** 127, np.nextafter(np.float32(2.0 ** 127), np.float32(0)),
    F32_MAX, np.inf, -np.inf, np.nan,
], np.float32)


def test_ceil_to_ue8m0_specials():
    got = np.asarray(quant.ceil_to_ue8m0(SPECIALS)).astype(np.float64)
    np.testing.assert_array_equal(got, _np_ceil_ue8m0(SPECIALS))
    # Spot checks written out by hand.
    assert got[0] == 2.0 ** -126 and got[2] == 2.0 ** -126  # 0, subnormal
    assert got[7] == 1.0 and got[8] == 2.0 and got[9] == 1.0  # 1 exact, neighbours
    assert got[12] == 4.0  # sign dropped
    assert got[17] == 2.0 ** 127 and got[18] == 2.0 ** 127 and got[20] == 2.0 ** 127  # max, Inf, NaN


def test_ceil_to_ue8m0_powers_of_two_unchanged():
    p = np.exp2(np.arange(-126, 128, dtype=np.float64)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(quant.ceil_to_ue8m0(p)), p)
    up = np.nextafter(p[:-1], np.float32(np.inf))
    np.testing.assert_array_equal(np.asarray(quant.ceil_to_ue8m0(up)), p[1:])


def test_ceil_to_ue8m0_random(rng):
    x = (rng.standard_normal(4096) * np.exp2(rng.uniform(-140, 126, 4096))).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(quant.ceil_to_ue8m0(x)).astype(np.float64), _np_ceil_ue8m0(x))


def test_encode_decode_ue8m0(rng):
    x = np.concatenate([SPECIALS, (rng.standard_normal(2048) * np.exp2(rng.uniform(-130, 126, 2048))).astype(np.float32)])
    codes = np.asarray(quant.encode_ue8m0(x))
    assert codes.dtype == np.uint8
    assert codes.min() >= 1 and codes.max() <= 254, "codes 0x00 and 0xFF must never be produced"
    np.testing.assert_array_equal(np.asarray(quant.decode_ue8m0(codes)).astype(np.float64), _np_ceil_ue8m0(x))
    # The mantissa of a non-power-of-two never leaks into the byte (the DeepGEMM packing bug).
    v = np.float32(0.0123)
    assert int(np.asarray(quant.encode_ue8m0(v))) == 127 - 6  # 2**-6 = 0.015625 >= 0.0123


def test_decode_ue8m0_codes():
    got = np.asarray(quant.decode_ue8m0(np.array([0, 1, 127, 128, 254, 255], np.uint8)))
    assert got[0] == np.float32(2.0 ** -127) and got[1] == np.float32(2.0 ** -126)
    assert got[2] == 1.0 and got[3] == 2.0 and got[4] == np.float32(2.0 ** 127) and np.isnan(got[5])
    e8 = np.array([0.5, 4.0], ml_dtypes.float8_e8m0fnu)
    np.testing.assert_array_equal(np.asarray(quant.decode_ue8m0(e8)), [0.5, 4.0])


def test_is_ue8m0_exact():
    vals = np.array([1.0, 0.5, 2.0 ** -126, 2.0 ** 127, 0.75, -1.0, 0.0, TINY / 2, np.inf, np.nan], np.float32)
    assert np.asarray(quant.is_ue8m0_exact(vals)).tolist() == [True] * 4 + [False] * 6


# ------------------------------------------------------------------------------------------- FP8
def _e4m3(x64):
    """Reference saturating e4m3 cast (round to nearest even)."""
    return np.clip(x64, -448, 448).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)


@pytest.mark.parametrize("ue8m0", [False, True])
def test_quantize_fp8_groups(rng, ue8m0):
    x = (rng.standard_normal((5, 384)) * np.exp2(rng.uniform(-8, 8, (5, 1)))).astype(np.float32)
    x[0, :128] = 0.0  # all-zero group: amax floored at 1e-4
    x8, s = quant.quantize_fp8_groups(x, ue8m0=ue8m0)
    assert x8.dtype == jnp.float8_e4m3fn and x8.shape == x.shape
    assert s.dtype == jnp.float32 and s.shape == (5, 3)
    amax = np.maximum(np.abs(x.astype(np.float64)).reshape(5, 3, 128).max(-1), 1e-4)
    s_ref = np.float32(amax.astype(np.float32) / np.float32(448))
    if ue8m0:
        s_ref = _np_ceil_ue8m0(s_ref).astype(np.float32)
        assert np.asarray(quant.is_ue8m0_exact(s)).all()
    # amax / 448 may differ from float64 by one float32 ulp (XLA may multiply by the reciprocal).
    np.testing.assert_allclose(np.asarray(s), s_ref, rtol=0 if ue8m0 else 3e-7)
    # Round the scale first, then quantize with it: the dequant scale is the quant scale.
    q_ref = _e4m3(x.reshape(5, 3, 128) / np.asarray(s)[..., None]).reshape(x.shape)
    np.testing.assert_array_equal(np.asarray(x8).view(np.uint8), q_ref.view(np.uint8))
    assert np.asarray(s)[0, 0] == pytest.approx(s_ref[0, 0], rel=3e-7) and (np.asarray(x8)[0, :128].astype(np.float32) == 0).all()
    deq = np.asarray(x8).astype(np.float64).reshape(5, 3, 128) * np.asarray(s)[..., None]
    assert np.isfinite(deq).all()
    # e4m3 keeps 3 mantissa bits: relative error <= 2**-4 on normal values.
    mask = np.abs(x.reshape(5, 3, 128)) > np.asarray(s)[..., None] * 2.0 ** -6
    assert (np.abs(deq - x.reshape(5, 3, 128))[mask] <= np.abs(x.reshape(5, 3, 128))[mask] * 2.0 ** -4 + 1e-30).all()


def test_quantize_dequantize_inside_jit_really_quantizes(rng, device):
    """A quantize-dequantize round trip in one jit keeps the e4m3 rounding on every backend (XLA's GPU
    compiler drops f32 -> e4m3 -> f32 conversion pairs unless the quantizer stops it)."""
    x = (rng.standard_normal((4, 256)) * 3).astype(np.float32)

    def round_trip(a):
        x8, s = quant.quantize_fp8_groups(a)
        return (x8.astype(jnp.float32).reshape(4, 2, 128) * s[..., None]).reshape(a.shape), s

    got, s = jax.jit(round_trip)(jax.device_put(x, device))
    s = np.asarray(s)
    ref = (_e4m3(x.reshape(4, 2, 128) / s[..., None]).astype(np.float32) * s[..., None]).reshape(x.shape)
    np.testing.assert_array_equal(np.asarray(got), ref)
    assert not np.array_equal(np.asarray(got), x)  # it did round


def test_fp8_saturates_never_nan():
    x = np.array([1e6, -1e6, 447.9, 448.0, 464.0, 1e-9], np.float32)
    q = np.asarray(quant.quantize_fp8_tensor(x, np.float32(1.0))).astype(np.float32)
    assert q.tolist()[:4] == [448.0, -448.0, 448.0, 448.0] and q[4] == 448.0
    x8, s = quant.quantize_fp8_groups(np.full((1, 128), 3e38, np.float32))
    assert np.isfinite(np.asarray(x8).astype(np.float32)).all() and np.isfinite(np.asarray(s)).all()


def test_quantize_fp8_tensor_static(rng):
    x = rng.standard_normal((7, 33)).astype(np.float32) * 10
    s = np.float32(np.abs(x).max() / 448 * 0.5)  # half the range: some values saturate
    got = np.asarray(quant.quantize_fp8_tensor(x, s)).view(np.uint8)
    # XLA may divide by the broadcast scalar through its reciprocal (one ulp off), which moves a value that
    # x / s puts just past an e4m3 rounding tie onto it now and then (seed 1012505674: 400.00003 vs 400.0,
    # codes 125 vs 124): each code is e4m3(x / s) or e4m3(x * (1 / s)), nearly all the first.
    exact = _e4m3(x.astype(np.float32) / s).view(np.uint8)
    recip = _e4m3(x.astype(np.float32) * (np.float32(1) / s)).view(np.uint8)
    assert ((got == exact) | (got == recip)).all()
    assert np.mean(got == exact) > 0.98
    with pytest.raises(ValueError, match="scalar"):
        quant.quantize_fp8_tensor(x, np.ones(2, np.float32))


@pytest.mark.parametrize("ue8m0", [False, True])
def test_quantize_fp8_blocks_edges(rng, ue8m0):
    n, k = 200, 300  # partial blocks on both axes
    w = rng.standard_normal((n, k)).astype(np.float32)
    w[128:, 256:] *= 1e-3  # the corner edge block: its amax must come from its own values
    q, s = quant.quantize_fp8_blocks(w, ue8m0=ue8m0)
    assert q.shape == (n, k) and s.shape == (2, 3)
    padded = np.zeros((256, 384))
    padded[:n, :k] = w
    amax = np.maximum(np.abs(padded).reshape(2, 128, 3, 128).max(axis=(1, 3)), 1e-4)
    s_ref = (amax.astype(np.float32) / np.float32(448)).astype(np.float32)
    if ue8m0:
        s_ref = _np_ceil_ue8m0(s_ref).astype(np.float32)
    np.testing.assert_allclose(np.asarray(s), s_ref, rtol=0 if ue8m0 else 3e-7)
    deq = np.asarray(quant.dequantize_fp8_blocks(q, s))
    big = np.repeat(np.repeat(np.asarray(s), 128, 0), 128, 1)[:n, :k]
    assert (np.abs(deq - w) <= np.abs(w) * 2.0 ** -4 + big * 2.0 ** -9 + 1e-30).all()


def test_quantize_fp8_groups_non_finite_inputs_as_the_kernels_take_them(rng):
    """NaN is left out of its group's amax (the CUDA / CPU kernels' max ignores it) and stays a NaN code; Inf makes
    its group's scale the largest there is (float32's largest / 448; with UE8M0 2**127), its own code +-448 and
    the others 0 (no NaN: an Inf scale once made Inf / Inf a NaN code); the other groups are untouched (float64
    statement)."""
    x = rng.standard_normal((3, 384)).astype(np.float32)
    x[0, 5], x[1, 130], x[2, 300] = np.nan, np.inf, -np.inf
    codes, scales = quant.quantize_fp8_groups(jnp.asarray(x))
    codes = np.asarray(codes.astype(jnp.float32))
    scales = np.asarray(scales)
    g = np.abs(x.astype(np.float64)).reshape(3, 3, 128)
    amax = np.maximum(np.where(np.isnan(g), 0.0, g).max(-1), 1e-4)
    amax = np.minimum(amax, float(np.finfo(np.float32).max))
    np.testing.assert_allclose(scales, amax / 448, rtol=2e-7)
    assert np.isnan(codes[0, 5]) and np.isfinite(np.delete(codes[0], 5)).all()
    top = np.float32(np.finfo(np.float32).max) / np.float32(448)
    assert scales[1, 1] == top and scales[2, 2] == top and np.isfinite(scales).all()
    assert codes[1, 130] == 448 and (np.delete(codes[1, 128:256], 2) == 0).all()
    assert codes[2, 300] == -448 and (np.delete(codes[2, 256:], 44) == 0).all()
    c8, s8 = quant.quantize_fp8_groups(jnp.asarray(x), ue8m0=True)
    c8 = np.asarray(c8.astype(jnp.float32))
    assert np.asarray(s8)[1, 1] == np.float32(2.0**127) and c8[1, 130] == 448 and c8[2, 300] == -448
    assert (np.delete(c8[1, 128:256], 2) == 0).all() and np.isnan(c8[0, 5])
    for r, gi in ((0, 1), (0, 2), (1, 0), (2, 0), (2, 1)):  # untouched groups: the plain recipe
        s = np.float32(np.maximum(np.abs(x[r, 128 * gi:128 * gi + 128]).max(), 1e-4) / 448)
        ref = np.asarray(jnp.asarray(x[r, 128 * gi:128 * gi + 128] / s, jnp.float8_e4m3fn).astype(jnp.float32))
        np.testing.assert_array_equal(codes[r, 128 * gi:128 * gi + 128], ref)


@pytest.mark.parametrize("fn, kw, name", [(quant.quantize_w4, dict(group_size=0), "group_size"),
                                          (quant.quantize_w4, dict(group_size=128.0), "group_size"),
                                          (quant.quantize_w4, dict(group_size=True), "group_size"),
                                          (quant.quantize_fp8_groups, dict(group_size=None), "group_size"),
                                          (quant.quantize_fp8_blocks, dict(block=0), "block"),
                                          (quant.quantize_fp8_blocks, dict(block=64.0), "block")])
def test_size_arguments_are_positive_ints(fn, kw, name):
    with pytest.raises(ValueError, match=f"argument '{name}' must be a positive int"):
        fn(jnp.ones((4, 256)), **kw)


def test_dequantize_w4_checks_the_scales_shape(rng):
    w = rng.standard_normal((2, 4, 256)).astype(np.float32)
    packed, scales = quant.quantize_w4(w)
    np.testing.assert_allclose(np.asarray(quant.dequantize_w4(packed, scales)), w, atol=np.abs(w).max() / 7)
    for bad in (scales[..., :0], scales[:1], scales[..., None], jnp.ones((2, 4, 3))):
        with pytest.raises(ValueError, match="argument 'scales'"):
            quant.dequantize_w4(packed, bad)
    with pytest.raises(ValueError, match="even K"):
        quant.quantize_w4(w[..., :9], group_size=3)


def test_dequantize_fp8_blocks_checks_its_arguments(rng):
    w = rng.standard_normal((200, 300)).astype(np.float32)
    q, s = quant.quantize_fp8_blocks(w)
    np.testing.assert_allclose(np.asarray(quant.dequantize_fp8_blocks(q, s)), w, rtol=0.07, atol=np.abs(w).max() / 448)
    for bad in (s[:1], s[:, :2], s[None], jnp.ones((3, 3))):
        with pytest.raises(ValueError, match="argument 'scales'"):
            quant.dequantize_fp8_blocks(q, bad)
    with pytest.raises(ValueError, match="argument 'block'"):
        quant.dequantize_fp8_blocks(q, s, block=0)
    with pytest.raises(ValueError, match="at least one axis"):
        quant.unpack_int4(jnp.int8(1))


# ----------------------------------------------------------------------------------------------
# folded fp8 activations
# ----------------------------------------------------------------------------------------------
def test_folded_k_order_moves_word_c_plus_8i_to_4c_plus_i(rng):
    codes = rng.integers(0, 256, (3, 384), dtype=np.uint8)
    folded = np.asarray(quant.to_folded_k_order(codes))
    for r in range(3):
        for g in range(3):
            for c in range(8):
                for i in range(4):
                    src = codes[r, 128 * g + 4 * (c + 8 * i):][:4]
                    np.testing.assert_array_equal(folded[r, 128 * g + 4 * (4 * c + i):][:4], src)
    np.testing.assert_array_equal(np.asarray(quant.from_folded_k_order(folded)), codes)
    with pytest.raises(ValueError, match="codes"):
        quant.to_folded_k_order(np.zeros((2, 100), np.uint8))


def _fold_case(rng, rows=40, groups=7):
    x = (rng.standard_normal((rows, 128 * groups)) * np.exp2(rng.integers(-20, 20, (rows, groups))).repeat(128, 1))
    x = x.astype(np.float32)
    x[0] = 0.0                # all zero: lift 0, multiplier the floor scale
    x[1] = np.sign(x[1]) * 2.0 ** -31  # codes 2^-9 under the floor scale 2^-22: the lift (16) is capped at 15
    x[2, :128] = np.nan       # NaN codes stay NaN and are left out of the lift
    x[3, 5] = np.inf          # an infinite input: scale 2^127 saturates, the other groups fold to zero
    x[4, :128] *= 1e-30       # one group far below the rest: its codes fold to zero
    x[5, 128:256] *= 2.0 ** 40
    return x


def _same_codes(a, b):
    a, b = np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)
    nan = lambda v: (v & 0x7F) == 0x7F  # noqa: E731
    return (a == b) | (nan(a) & nan(b))


def test_fold_fp8_groups_matches_float64(rng):
    x = _fold_case(rng)
    codes, scales = quant.quantize_fp8_groups(x, ue8m0=True)
    folded, token = quant.fold_fp8_groups(codes, scales)
    ref_codes, ref_token = np_ref.fold_groups(codes, scales)
    assert folded.dtype == jnp.float8_e4m3fn and token.shape == (x.shape[0],)
    assert _same_codes(folded, ref_codes).all()
    np.testing.assert_array_equal(np.asarray(token), ref_token)
    # the values: within 2^-10 of the token's multiplier of code * scale (exact where the folded code is normal)
    back = np.asarray(quant.from_folded_k_order(folded), np.float64) * np.asarray(token, np.float64)[:, None]
    small = np.isfinite(back).all(-1) & (np.abs(back).max(-1) < 1e30)  # float32 holds these: unfold agrees
    np.testing.assert_array_equal(np.asarray(quant.unfold_fp8_groups(folded, token))[small], back[small])
    want = np.asarray(codes, np.float64) * np.repeat(np.asarray(scales, np.float64), 128, -1)
    ok = np.isfinite(want)
    err = np.abs(back - want)[ok]
    assert (err <= np.broadcast_to(2.0 ** -10 * np.asarray(token, np.float64)[:, None], want.shape)[ok]).all()
    big = np.abs(want) >= 2.0 ** -6 * np.asarray(token, np.float64)[:, None]  # the folded value is an e4m3 normal
    np.testing.assert_array_equal(back[big & ok], want[big & ok])
    # each token's largest folded code in [112, 448] unless its lift is capped or it is all zero
    top = np.nanmax(np.abs(np.asarray(folded, np.float32)), axis=-1)
    assert ((top >= 112) & (top <= 448))[5:].all() and top[0] == 0 and top[1] < 112
    assert np.isnan(np.asarray(folded, np.float32)[2]).sum() == np.isnan(np.asarray(codes, np.float32)[2]).sum()


def test_quantize_fp8_folded_is_quantize_then_fold(rng):
    x = jnp.asarray(_fold_case(rng, 9, 3)[5:], jnp.bfloat16)
    a, t = quant.quantize_fp8_folded(x)
    b, u = quant.fold_fp8_groups(*quant.quantize_fp8_groups(x, ue8m0=True))
    assert _same_codes(a, b).all() and (np.asarray(t) == np.asarray(u)).all()
    with pytest.raises(ValueError, match="scales"):
        quant.fold_fp8_groups(a, t)
    with pytest.raises(TypeError, match="codes"):
        quant.fold_fp8_groups(x, u)
