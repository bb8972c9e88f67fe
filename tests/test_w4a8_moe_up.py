"""ops.w4a8_moe_up: the fused gate+up GEMM, SiLU-mul and fp8 re-quantization vs float64 numpy."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import np_ref
from conftest import run_poisoned
from jax_w4a8 import ops, quant
from test_w4a8_grouped_gemm import half_tile_sizes, make_case


def np_moe_up(args, y=None):
    """float64: h = silu(gate) * up from the exact grouped GEMM (``y``: that GEMM's result, if already made)."""
    y = np_ref.grouped_gemm(*args) if y is None else y
    inter = y.shape[1] // 2
    g, u = y[:, :inter], y[:, inter:]
    return g * np.exp(-np.logaddexp(0.0, -g)) * u  # silu(g) = g * sigmoid(g), no overflow for g << 0


def run_up(fn, args, device, static):
    """``fn(*args)`` -> (h8, scale) into NaN-poisoned outputs (codes: e4m3's 0x7F NaN), so that neither a code
    nor a scale left unwritten passes, the zero padding rows included (zeroed memory would)."""
    m, inter = args[0].shape[0], args[2].shape[1] // 2
    return run_poisoned(fn, ((m, inter), () if static else (m, inter // 128)), (jnp.float8_e4m3fn, jnp.float32),
                        args, device)


SCALES = ["ue8m0", "float32", "static"]  # the down projection's input scales: dynamic (two kinds) or per tensor


def scale_args(kind, args, divisor=448):
    """(ops.w4a8_moe_up's scale keywords, the static scale or None) for a kind of SCALES; the static scale is
    float64 h's maximum over ``divisor`` (below 448: some values saturate)."""
    s = np.float32(np.abs(np_moe_up(args)).max() / divisor) if kind == "static" else None
    return dict(down_input_scale=s, ue8m0=kind != "float32"), s


def check(h8, scale, args, static_scale=None, covered=None, ue8m0=True):
    h = np_moe_up(args)
    codes = np.asarray(h8).astype(np.float64)
    s = np.asarray(scale, np.float64)
    if static_scale is not None:
        assert np.all(s == np.float64(static_scale))
    elif not ue8m0:  # max(amax, 1e-4) / 448 of the op's own h (float32 sums; bfloat16 gate and up when composed)
        amax = np.maximum(np.abs(h).reshape(h.shape[0], -1, 128).max(-1), 1e-4)
        assert not np.asarray(quant.is_ue8m0_exact(scale)).all()
        assert np.all(np.abs(s - amax / 448) <= 2.0**-6 * amax / 448)
    else:
        assert np.asarray(quant.is_ue8m0_exact(scale)).all()
        amax = np.maximum(np.abs(h).reshape(h.shape[0], -1, 128).max(-1), 1e-4)
        # the scale covers the group (rounded up, never down; the composed ops round gate and up to bfloat16
        # first: up to 2^-8 relative each, about 2.3 * 2^-8 in the group maximum through SiLU's slope), and is
        # the smallest power of two that does
        assert np.all(s >= amax / 448 * (1 - 2.0**-6)) and np.all(s <= 2 * amax / 448 * (1 + 2.0**-6))
    per_elem = s if static_scale is not None else np.repeat(s, 128, axis=1)
    deq = codes * per_elem
    assert np.isfinite(deq).all()
    # Against the best e4m3 codes for these scales (float64 h, rounded to nearest): e4m3's 3 mantissa bits cost
    # 2-4% relative here, with a spread over fresh data that a fixed bound does not cover (0.043 once against
    # 0.04); the op's codes differ from the best only where float32 sums or bfloat16 gate / up cross a rounding
    # boundary (120 CPU cases: at most 1.037x the best, 0.0011 above it).
    best = np.clip(h / per_elem, -448, 448).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    best_err = np_ref.rel_err(best * per_elem, h)
    assert np_ref.rel_err(deq, h) <= 1.1 * best_err + 0.002 and best_err <= 0.07
    if covered is not None:
        assert (codes[covered:] == 0).all()


@pytest.mark.parametrize("scales", SCALES)
def test_matches_float64(rng, device, scales):
    m, k, inter = 50, 256, 128
    args = make_case(rng, m, k, 2 * inter, [20, 0, 25])  # 5 padding rows
    kw, s = scale_args(scales, args)
    f = functools.partial(ops.w4a8_moe_up, **kw)
    assert jax.eval_shape(f, *args)[0] == jax.ShapeDtypeStruct((m, inter), jnp.float8_e4m3fn)
    h8, scale = run_up(f, args, device, s is not None)
    check(h8, scale, args, s, covered=45, ue8m0=kw["ue8m0"])
    r8, rs = ops.w4a8_moe_up(*args, **kw, impl="reference")
    same = np.mean(np.asarray(r8).view(np.uint8) == np.asarray(h8).view(np.uint8))
    # codes differ only where float32 summation order (the fused kernel) or, in the composed ops (the CPU), the
    # bfloat16 rounding of gate and up crosses an e4m3 rounding boundary: about 2% of them there
    assert same > 0.95


@pytest.mark.gpu
@pytest.mark.parametrize("tile_tokens, mma", [(16, "e4m3"), (32, "e4m3"), (64, "e4m3"), (8, "f16"), (16, "f16"),
                                             (32, "f16"), (64, "f16")])
@pytest.mark.parametrize("scales", SCALES)
def test_fused_kernel_every_tile(rng, device, tile_tokens, mma, scales):
    if device.platform != "gpu":
        pytest.skip("the fused kernel is CUDA only")
    m, k, inter = 300, 1024, 256
    args = make_case(rng, m, k, 2 * inter, [120, 0, 90, 3, 60, -2])
    kw, s = scale_args(scales, args, divisor=300)  # static: some values saturate
    fn = functools.partial(ops.w4a8_moe_up, **kw, tile_tokens=tile_tokens, mma=mma)
    text = jax.jit(fn).lower(*args).as_text()
    assert "jax_w4a8_w4a8_moe_up" in text
    h8, scale = run_up(fn, args, device, s is not None)
    if s is not None:
        assert np.isfinite(np.asarray(h8).astype(np.float32)).all()
        h = np_moe_up(args)
        deq = np.asarray(h8).astype(np.float64) * s
        clipped = np.clip(h, -448 * s, 448 * s)
        assert np_ref.rel_err(deq, clipped) <= 0.04
    else:
        check(h8, scale, args, covered=273, ue8m0=kw["ue8m0"])


@pytest.mark.gpu
@pytest.mark.parametrize("tile_tokens, mma", [(16, "f16"), (32, "e4m3"), (64, "f16")])
@pytest.mark.parametrize("scales", SCALES)
def test_fused_kernel_many_units_per_block(rng, device, tile_tokens, mma, scales):
    """Hundreds of units over the resident blocks, every code of the routed rows checked: within half an e4m3
    step of float64's h (plus half a subnormal step) and the summation error the kernel's float32 / f16-operand
    sums can make, bounded through h = silu(g) u by 2^-12 of the |terms| sums of g and u; the padding rows zero.
    A code from another unit or a stale one would be off by a sizeable part of its token's group maximum."""
    if device.platform != "gpu":
        pytest.skip("the fused kernel is CUDA only")
    m, k, inter = 4096, 256, 1024
    sizes = list(rng.multinomial(m - 40, np.full(32, 1 / 32)))  # 40 padding rows
    args = make_case(rng, m, k, 2 * inter, sizes)
    kw, s = scale_args(scales, args)  # static: one per-tensor scale, nothing saturates
    fn = functools.partial(ops.w4a8_moe_up, **kw, tile_tokens=tile_tokens, mma=mma)
    h8, scale = run_up(fn, args, device, s is not None)
    check(h8, scale, args, s, covered=m - 40, ue8m0=kw["ue8m0"])
    check_every_code(h8, scale, args, s, m - 40)


@pytest.mark.gpu
@pytest.mark.parametrize("tile_tokens", [8, 16, 32, 64])
def test_fused_f16_tiles_at_deepseek_hidden_size(rng, device, tile_tokens):
    """The fused f16 tiles at K = 7168, where the weight scales' 224-byte rows make the kernels take fewer
    shared-memory stages than at the other tests' K (hopper_gemm.cu's SmemForScaleLines): every code checked."""
    if device.platform != "gpu":
        pytest.skip("the fused kernel is CUDA only")
    m, k, inter = 200, 7168, 256
    args = make_case(rng, m, k, 2 * inter, [90, 0, 40, 7, 33])  # 30 padding rows
    fn = functools.partial(ops.w4a8_moe_up, tile_tokens=tile_tokens, mma="f16")
    h8, scale = run_up(fn, args, device, False)
    check(h8, scale, args, covered=170)
    check_every_code(h8, scale, args, None, 170)


def check_every_code(h8, scale, args, static_scale, routed):
    """Every code of the first ``routed`` rows within half an e4m3 step of float64's h (plus half a subnormal
    step) and the summation error of float32 / f16-operand sums, bounded through h = silu(g) u by 2^-12 of the
    |terms| sums of g and u."""
    y, a = np_ref.grouped_gemm(*args), np_ref.grouped_gemm(*args, absolute=True)
    h = np_moe_up(args, y)
    inter = h.shape[1]
    g, u, ag, au = y[:, :inter], y[:, inter:], a[:, :inter], a[:, inter:]
    sig = 0.5 * (1.0 + np.tanh(0.5 * g))  # sigmoid without overflow
    dh = 2.0**-12 * (np.abs(sig * (1.0 + g * (1.0 - sig)) * u) * ag + np.abs(g * sig) * au)
    sc = (np.float64(static_scale) if static_scale is not None
          else np.repeat(np.asarray(scale, np.float64), 128, axis=1))
    got = np.asarray(h8).astype(np.float64) * sc
    bound = 0.0625 * np.abs(h) + 2.0**-10 * sc + 1.0625 * dh  # (the half step of the kernel's h, not h)
    bad = (np.abs(got - h) > bound)[:routed]
    assert not bad.any(), f"{bad.sum()} codes off, rows {sorted(set(np.nonzero(bad)[0].tolist()))[:8]}"


@pytest.mark.gpu
@pytest.mark.parametrize("tile_tokens", [16, 32, 64])
@pytest.mark.parametrize("static", [False, True])
def test_fused_f16_tiles_units_around_half_a_tile(rng, device, tile_tokens, static):
    """The fused kernel's f16 tiles at experts of half a tile, one row more and one less, a whole tile, one row,
    none, one and a half tiles and 3 rows whose tile runs past the 8 padding rows and M (the grouped GEMM's test of
    the same name): every code of the routed rows near float64, the padding rows zero. K = 384: a pair of
    groups and an odd last one."""
    if device.platform != "gpu":
        pytest.skip("the fused kernel is CUDA only")
    sizes = half_tile_sizes(tile_tokens)
    routed = sum(sizes)
    args = make_case(rng, routed + 8, 384, 2 * 512, sizes)
    s = np.float32(np.abs(np_moe_up(args)).max() / 448) if static else None
    fn = functools.partial(ops.w4a8_moe_up, down_input_scale=s, tile_tokens=tile_tokens, mma="f16")
    h8, scale = run_up(fn, args, device, static)
    check(h8, scale, args, s, covered=routed)
    check_every_code(h8, scale, args, s, routed)


def test_bad_inputs(rng):
    args = make_case(rng, 8, 128, 256, [8])
    with pytest.raises(ValueError, match="'w13'"):
        ops.w4a8_moe_up(args[0], args[1], args[2][:, :3], args[3], args[4])
    with pytest.raises(ValueError, match="'down_input_scale'"):
        ops.w4a8_moe_up(*args, down_input_scale=np.ones(3, np.float32))
    with pytest.raises(TypeError, match="'x'"):
        ops.w4a8_moe_up(args[0].astype(jnp.bfloat16), *args[1:])
    with pytest.raises(ValueError, match="'tile_tokens'"):  # checked on every path, fused kernel or not
        ops.w4a8_moe_up(*args, tile_tokens=128)
    with pytest.raises(ValueError, match="'tile_tokens'"):
        ops.w4a8_moe_up(*args, tile_tokens=128, impl="reference")
    with pytest.raises(ValueError, match="'mma'"):
        ops.w4a8_moe_up(*args, mma="bf16", impl="reference")
    with pytest.raises(ValueError, match="'fused'"):
        ops.w4a8_moe_up(*args, fused="yes")
    with pytest.raises(TypeError, match="argument 'ue8m0'"):
        ops.w4a8_moe_up(*args, ue8m0="yes")
    with pytest.raises(ValueError, match="'tile_tokens' and 'mma'.*fused=False"):
        ops.w4a8_moe_up(*args, tile_tokens=16, fused=False)
    # a static scale must be positive and finite where it is known (h / s is quantized); traced, it is data
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="argument 'down_input_scale' must be positive and finite"):
            ops.w4a8_moe_up(*args, down_input_scale=bad)
        # a constant inside jit too (Python or NumPy scalar, captured array): once NaN or saturated codes
        for const in (bad, np.float32(bad), jnp.float32(bad)):
            with pytest.raises(ValueError, match="argument 'down_input_scale' must be positive and finite"):
                jax.jit(lambda c=const: ops.w4a8_moe_up(*args, down_input_scale=c))()
    with pytest.raises(TypeError, match="argument 'down_input_scale' must be a float32 scalar"):
        ops.w4a8_moe_up(*args, down_input_scale="a")
    # errors of the grouped GEMM inside name this op's arguments
    with pytest.raises(ValueError, match="w4a8_moe_up: argument 'w13_scale'"):
        ops.w4a8_moe_up(*args[:3], args[3][:, :, :0], args[4])
    with pytest.raises(TypeError, match="w4a8_moe_up: argument 'group_sizes' must have dtype int32"):
        ops.w4a8_moe_up(*args[:4], np.asarray(args[4], np.int64))
    with pytest.raises(ValueError, match="w4a8_moe_up: argument 'rows_per_expert'"):
        ops.w4a8_moe_up(*args, rows_per_expert=-2)


def test_dynamic_scales_need_i_a_multiple_of_128(rng):
    """One UE8M0 scale per 128 channels of h: I = 64 is refused naming w13 (it used to fail inside the quantizer,
    naming an argument the caller never passed); a static scale takes any I and matches float64."""
    args = make_case(rng, 8, 128, 128, [8])  # 2I = 128
    with pytest.raises(ValueError, match="w4a8_moe_up: argument 'w13' must have I .* a multiple of 128"):
        ops.w4a8_moe_up(*args)
    h8, s = ops.w4a8_moe_up(*args, down_input_scale=0.05)
    assert h8.shape == (8, 64) and float(s) == np.float32(0.05)
    y = np_ref.grouped_gemm(*args)
    g, u = y[:, :64], y[:, 64:]
    sig = 0.5 * (1.0 + np.tanh(0.5 * g))  # sigmoid without overflow
    want = g * sig * u / np.float32(0.05)
    got = np.asarray(h8.astype(jnp.float32), np.float64)
    # Within half an e4m3 step (1/16 relative, plus half the subnormal step) of float64's h / s, and what the
    # composed ops' bfloat16 rounding of gate and up (2^-9 relative each) moves h by: through SiLU's slope that is
    # |g| times more for g << 0 (numpy seed 4286530266: g = -8.5 gave a code 8% above a 2.08 that rtol 0.07 took
    # as wrong).
    dh = 1.1 * 2.0**-9 * (np.abs(sig * (1.0 + g * (1.0 - sig)) * g * u) + np.abs(g * sig * u)) / np.float32(0.05)
    bad = np.abs(got - np.clip(want, -448, 448)) > 0.0625 * np.abs(want) + 2.0**-10 * 8 + dh
    assert not bad.any(), (np.argwhere(bad)[:4], got[bad][:4], want[bad][:4])
    assert np.mean(np.abs(got - np.clip(want, -448, 448)) <= 0.0625 * np.abs(want) + 2.0**-10 * 8) > 0.95


@pytest.mark.parametrize("scales", SCALES)
def test_many_rows_per_expert_take_the_composed_ops(rng, device, scales):
    """Above FUSED_UP_MAX_ROWS expected rows per expert the op composes the grouped GEMM (bfloat16 out) and
    silu_mul_quantize_fp8_groups (the fused kernel's 64-token tiles lose there): checked against float64 and, on
    the GPU, against the fused kernel forced on the same inputs (codes equal but where the bfloat16 rounding of
    gate and up, up to 2^-8 relative, or the float32 summation order crosses an e4m3 rounding boundary). On the
    CPU fused=True lowers to the same composed ops, so there the comparison is with impl="reference" (float32
    gate and up) instead."""
    from jax_w4a8 import tiling
    m, k, inter, sizes = 420, 256, 128, [200, 0, 130, 80]  # 105 expected rows per expert; 10 padding rows
    assert tiling.plan_moe_up(m, len(sizes), inter, k).kernel == "unfused"
    args = make_case(rng, m, k, 2 * inter, sizes)
    kw, s = scale_args(scales, args)
    static = s is not None
    composed = functools.partial(ops.w4a8_moe_up, **kw)
    assert "jax_w4a8_w4a8_moe_up" not in jax.jit(composed).lower(*args).as_text()
    h8, scale = run_up(composed, args, device, static)
    check(h8, scale, args, s, covered=410, ue8m0=kw["ue8m0"])
    if device.platform == "gpu":
        other = functools.partial(ops.w4a8_moe_up, **kw, fused=True)
        assert "jax_w4a8_w4a8_moe_up" in jax.jit(other).lower(*args).as_text()
    else:  # fused=True is the composed ops again here: compare with the float32 reference instead
        other = functools.partial(ops.w4a8_moe_up, **kw, impl="reference")
    f8, _ = run_up(other, args, device, static)
    same = np.mean(np.asarray(f8).view(np.uint8) == np.asarray(h8).view(np.uint8))
    assert 0.95 < same  # about 0.98 (bfloat16 gate and up in the composed ops)


def test_reference_path_takes_what_the_other_paths_take(rng):
    """Python lists and scalars (a plain group_sizes list, a float x_scale): the reference path converts them as the
    kernels' paths do (it once passed them on raw and failed with AttributeError)."""
    x8, _, w13, s13, _ = make_case(rng, 8, 128, 256, [4, 4])
    x_scale, sizes = 0.5, [4, 4]
    args = (x8, jnp.float32(x_scale), w13, s13, jnp.asarray(sizes, jnp.int32))
    for kind in SCALES:
        kw, s = scale_args(kind, args)
        h8, scale = ops.w4a8_moe_up(x8, x_scale, w13, s13, sizes, impl="reference", **kw)
        check(h8, scale, args, s, ue8m0=kw["ue8m0"])


@pytest.mark.parametrize("plan", [{}, dict(tile_tokens=8, mma="f16"), dict(tile_tokens=32, mma="e4m3"),
                                  dict(fused=False)])
@pytest.mark.parametrize("ue8m0", [True, False])
def test_h_past_float32_saturates(rng, device, plan, ue8m0):
    """Gate and up past 1e30 (weight scales 2**100 on expert 0) make silu(gate) * up Inf in float32: the token's
    scale is the largest there is (UE8M0 2**127, float32's largest / 448) and the code +-448, never NaN (an Inf
    scale made Inf / Inf a NaN code and every other value of the group 0 * Inf = NaN in the down projection),
    in the fused kernel's epilogue and in the composed ops alike. The other expert's rows are untouched."""
    if plan.get("tile_tokens") and device.platform != "gpu":
        pytest.skip("the fused kernel's tiles are CUDA only")
    m, k, inter = 40, 256, 128
    args = make_case(rng, m, k, 2 * inter, [20, 15])  # 5 padding rows
    huge = (args[0], args[1], args[2], args[3].at[0].multiply(2.0**100), args[4])
    fn = functools.partial(ops.w4a8_moe_up, ue8m0=ue8m0, **plan)
    h8, scale = run_up(fn, huge, device, False)
    b8, bscale = run_up(fn, args, device, False)
    codes = np.asarray(h8).view(np.uint8)
    assert not ((codes & 0x7F) == 0x7F).any() and np.isfinite(scale).all()
    y = np_ref.grouped_gemm(*huge)[:20]
    g, u = y[:, :inter], y[:, inter:]
    inf = (g > 0) & (np.abs(g * u) > 2.0 * float(np.finfo(np.float32).max))  # Inf in float32, with a margin
    assert inf.sum() > 100
    assert (codes[:20][inf] == np.where(u[inf] > 0, 0x7E, 0xFE)).all()
    top = np.float32(2.0**127) if ue8m0 else np.float32(np.finfo(np.float32).max) / np.float32(448)
    assert (scale[:20] == top).all()
    np.testing.assert_array_equal(codes[20:], np.asarray(b8).view(np.uint8)[20:])  # the other expert, padding
    np.testing.assert_array_equal(scale[20:], bscale[20:])
    assert (codes[35:] == 0).all()
