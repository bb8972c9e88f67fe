"""ops.fp8_einsum and ops.pack_ue8m0 (SPEC 4.2): FFI handlers and reference vs float64 numpy."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import np_ref
from conftest import poisoned_jit, run_in_command_buffer, run_poisoned
from jax_w4a8 import ops, quant

BF16_TOL = 4e-3
# Float32 outputs on a GPU: Hopper fp8 tensor cores accumulate a 128-K group with reduced precision.
F32_GPU_TOL = 2e-4


def make_operands(rng, m, h, n, k, recipe="block", ue8m0=False, spread=4.0):
    """x [M, H, K], w [H, N, K] and their scales, quantized with jax_w4a8.quant."""
    x = (rng.standard_normal((m, h, k)) * np.exp2(rng.uniform(-spread, spread, (m, h, 1)))).astype(np.float32)
    w = (rng.standard_normal((h, n, k)) * np.exp2(rng.uniform(-spread, spread, (h, n, 1)))).astype(np.float32)
    x8, sx = quant.quantize_fp8_groups(x, ue8m0=ue8m0)
    if recipe == "block":
        w8, sw = quant.quantize_fp8_blocks(w, ue8m0=ue8m0)
    else:
        w8, sw = quant.quantize_fp8_groups(w, ue8m0=ue8m0)
    return x8, sx, w8, sw


def encode(s, encoding):
    if encoding == "codes":
        return quant.encode_ue8m0(s)
    if encoding == "e8m0fnu":
        return jax.lax.bitcast_convert_type(quant.encode_ue8m0(s), jnp.float8_e8m0fnu)
    return s


def run(equation, args, device, out_shape, out_dtype=jnp.bfloat16, ue8m0=False):
    fn = functools.partial(ops.fp8_einsum, equation, out_dtype=out_dtype, ue8m0=ue8m0, impl="ffi")
    return run_poisoned(fn, out_shape, out_dtype, args, device)


@pytest.mark.parametrize("recipe", ["block", "row"])
@pytest.mark.parametrize("encoding", ["f32", "codes", "e8m0fnu", "declared"])
@pytest.mark.parametrize("m, n", [(1, 576), (37, 200), (130, 1)])
def test_linear_matches_float64(rng, device, recipe, encoding, m, n):
    ue = encoding != "f32"
    x8, sx, w8, sw = make_operands(rng, m, 1, n, 384, recipe, ue8m0=ue)
    ref = np_ref.fp8_einsum_mhk(x8, sx, w8, sw)[:, 0]
    args = (x8[:, 0], encode(sx[:, 0], encoding), w8[0], encode(sw[0], encoding))
    out = run("md,nd->mn", args, device, (m, n), ue8m0=encoding == "declared")
    assert np_ref.rel_err(out, ref) <= BF16_TOL
    ref_out = ops.fp8_einsum("md,nd->mn", *args, impl="reference", ue8m0=encoding == "declared",
                             out_dtype=jnp.float32)
    assert np_ref.rel_err(ref_out, ref) <= 1e-6


@pytest.mark.parametrize("equation", ["bhr,hdr->bhd", "tgd,grd->tgr"])
def test_per_head_b1_non_power_of_two_scales(rng, device, equation):
    """DeepSeek-V4 wo_a at batch 1 with plain fp32 scales (the DeepGEMM UE8M0 NaN case)."""
    b, h, r, d = 1, 16, 512, 256
    x8, sx, w8, sw = make_operands(rng, b, h, d, r, "block")
    assert not np.asarray(quant.is_ue8m0_exact(sx)).all()  # scales really are not powers of two
    out = run(equation, (x8, sx, w8, sw), device, (b, h, d))
    assert np_ref.rel_err(out, np_ref.fp8_einsum_mhk(x8, sx, w8, sw)) <= BF16_TOL


@pytest.mark.parametrize("b, recipe, encoding", [(3, "row", "codes"), (64, "block", "f32")])
def test_per_head_batched(rng, device, b, recipe, encoding):
    h, r, d = 4, 256, 130
    x8, sx, w8, sw = make_operands(rng, b, h, d, r, recipe, ue8m0=encoding != "f32")
    out = run("bhr,hdr->bhd", (x8, encode(sx, encoding), w8, encode(sw, encoding)), device, (b, h, d))
    assert np_ref.rel_err(out, np_ref.fp8_einsum_mhk(x8, sx, w8, sw)) <= BF16_TOL


def test_zero_rows_and_fp8_limits(rng, device):
    m, n, k = 9, 64, 256
    x8, sx, w8, sw = make_operands(rng, m, 1, n, k, spread=0)
    x8 = x8.at[3].set(0).at[5].set(448.0).at[6].set(-448.0)  # all-zero row, rows at the e4m3 limit
    w8 = w8.at[7].set(448.0)
    args = (x8[:, 0], sx[:, 0], w8[0], sw[0])
    out = run("md,nd->mn", args, device, (m, n), out_dtype=jnp.float32)
    ref = np_ref.fp8_einsum_mhk(x8, sx, w8, sw)[:, 0]
    assert np_ref.rel_err(out, ref) <= (F32_GPU_TOL if device.platform == "gpu" else 1e-6)
    assert (out[3] == 0).all()


def test_declared_ue8m0_with_mantissa_is_rejected(rng, device):
    x8, sx, w8, sw = make_operands(rng, 4, 1, 8, 128)
    args = (x8[:, 0], quant.ceil_to_ue8m0(sx[:, 0]), w8[0], sw[0])  # w_scale is not a power of two
    with pytest.raises(ValueError, match="'w_scale'.*UE8M0"):
        ops.fp8_einsum("md,nd->mn", *args, ue8m0=True)
    f = jax.jit(functools.partial(ops.fp8_einsum, "md,nd->mn", ue8m0=True))
    dev_args = [jax.device_put(a, device) for a in args]
    with pytest.raises(Exception, match="'w_scale' is declared UE8M0"):
        jax.block_until_ready(f(*dev_args))
    g = jax.jit(functools.partial(ops.fp8_einsum, "md,nd->mn", ue8m0=True, impl="reference"))
    with pytest.raises(Exception, match="UE8M0"):
        jax.block_until_ready(g(*dev_args))
    # Rounded scales pass and give the right answer (every element written: the output is poisoned).
    args = (args[0], args[1], args[2], quant.ceil_to_ue8m0(sw[0]))
    out = run_poisoned(f, (4, 8), jnp.bfloat16, args, device)
    ref = np_ref.fp8_einsum_mhk(x8, args[1][:, None], w8, args[3][None])[:, 0]
    assert np_ref.rel_err(out, ref) <= BF16_TOL


def test_pack_ue8m0(device):
    s = np.array([1.0, 0.5, 2.0 ** -126, 2.0 ** 127, 1024.0], np.float32)
    codes = run_poisoned(ops.pack_ue8m0, (5,), jnp.uint8, (s,), device)  # poisoned with 0xFF, the NaN code
    assert codes.tolist() == [127, 126, 1, 254, 137]
    for bad in (0.75, -1.0, 0.0, np.inf, np.nan, 2.0 ** -127):
        with pytest.raises(ValueError, match="'scale'"):
            ops.pack_ue8m0(np.array([1.0, bad], np.float32))
        with pytest.raises(Exception, match="declared UE8M0"):
            jax.block_until_ready(jax.jit(ops.pack_ue8m0)(jax.device_put(np.array([1.0, bad], np.float32), device)))


def test_nan_code_is_rejected(rng):
    x8, sx, w8, sw = make_operands(rng, 2, 1, 8, 128, ue8m0=True)
    codes = np.asarray(quant.encode_ue8m0(sw[0])).copy()
    codes[0, 0] = 0xFF
    with pytest.raises(ValueError, match="'w_scale'.*NaN"):
        ops.fp8_einsum("md,nd->mn", x8[:, 0], sx[:, 0], w8[0], codes)


@pytest.mark.gpu
def test_deepseek_shapes_on_gpu(rng, device):
    if device.platform != "gpu":
        pytest.skip("GPU-sized case")
    x8, sx, w8, sw = make_operands(rng, 64, 1, 1536, 7168)  # q_a_proj at 64 tokens
    out = run("md,nd->mn", (x8[:, 0], sx[:, 0], w8[0], sw[0]), device, (64, 1536))
    assert np_ref.rel_err(out, np_ref.fp8_einsum_mhk(x8, sx, w8, sw)[:, 0]) <= BF16_TOL
    x8, sx, w8, sw = make_operands(rng, 1, 16, 1024, 4096, ue8m0=True)  # V4-Pro wo_a, b = 1
    out = run("bhr,hdr->bhd", (x8, quant.encode_ue8m0(sx), w8, quant.encode_ue8m0(sw)), device, (1, 16, 1024))
    assert np_ref.rel_err(out, np_ref.fp8_einsum_mhk(x8, sx, w8, sw)) <= BF16_TOL


# ------------------------------------------------------------------------------------ bad input
def _good(rng):
    x8, sx, w8, sw = make_operands(rng, 4, 1, 8, 256)
    return {"x": x8[:, 0], "x_scale": sx[:, 0], "w": w8[0], "w_scale": sw[0]}


BAD = [
    ("x", lambda a: a["x"].astype(jnp.bfloat16), TypeError, "'x'"),
    ("x", lambda a: a["x"][:, :200], ValueError, "'x'"),
    ("w", lambda a: a["w"][:, :128], ValueError, "'w'"),
    ("w", lambda a: a["w"].astype(jnp.float8_e5m2), TypeError, "'w'"),
    ("x_scale", lambda a: a["x_scale"][:3], ValueError, "'x_scale'"),
    ("x_scale", lambda a: a["x_scale"].astype(jnp.bfloat16), TypeError, "'x_scale'"),
    ("w_scale", lambda a: a["w_scale"][:, :1], ValueError, "'w_scale'"),
    ("w_scale", lambda a: jnp.ones((5, 2), jnp.float32), ValueError, "'w_scale'"),
]


@pytest.mark.parametrize("arg, mutate, exc, text", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_inputs_name_the_argument(rng, arg, mutate, exc, text):
    a = _good(rng)
    a[arg] = mutate(a)
    with pytest.raises(exc, match=text):
        ops.fp8_einsum("md,nd->mn", a["x"], a["x_scale"], a["w"], a["w_scale"])


@pytest.mark.parametrize("equation", ["mk,kn->mn", "md,nd->nm", "bhr,hrd->bhd", "ab,cd->ac", "md,nd"])
def test_bad_equations(rng, equation):
    a = _good(rng)
    with pytest.raises(ValueError, match="'equation'"):
        ops.fp8_einsum(equation, a["x"], a["x_scale"], a["w"], a["w_scale"])


def test_float16_output_refused(rng):
    a = _good(rng)
    with pytest.raises(ValueError, match="float16"):
        ops.fp8_einsum("md,nd->mn", *a.values(), out_dtype=jnp.float16)
    assert np.isfinite(np.asarray(ops.fp8_einsum("md,nd->mn", *a.values()).astype(jnp.float32))).all()


def test_ue8m0_must_be_a_static_bool(rng):
    a = _good(rng)
    for bad in ("False", None, 1, np.array([True, False])):
        with pytest.raises(TypeError, match="argument 'ue8m0'"):
            ops.fp8_einsum("md,nd->mn", *a.values(), ue8m0=bad)


def test_pack_ue8m0_arg_must_be_a_name():
    for bad in (5, None, ""):
        with pytest.raises(TypeError, match="argument 'arg'"):
            ops.pack_ue8m0(jnp.array([2.0]), arg=bad)


def test_extreme_ue8m0_codes_match_float64_on_the_cpu_handler(rng):
    """Code 0 is 2**-127, a float32 subnormal, which XLA's CPU runtime flushes to zero: the CPU handler applies it
    as IEEE float32 does (as the CUDA kernels), so activation codes 0..20 against weight codes 234..254 (products
    2**-20 .. 2**20) match float64; once gave 0 wherever code 0 met code 254."""
    m, n, k = 5, 7, 256
    x8 = jnp.asarray(rng.uniform(-448, 448, (m, k)), jnp.float8_e4m3fn)
    w8 = jnp.asarray(rng.uniform(-448, 448, (n, k)), jnp.float8_e4m3fn)
    sx = rng.integers(0, 21, (m, k // 128)).astype(np.uint8)
    sx[0] = 0
    sw = rng.integers(234, 255, (1, k // 128)).astype(np.uint8)
    sw[0, 0] = 254
    ref = np_ref.fp8_einsum_mhk(x8[:, None], sx[:, None], w8[None], sw[None])[:, 0]
    assert np.abs(ref[0]).max() > 1e-3  # the row of code-0 scales holds normal numbers
    out = run("md,nd->mn", (x8, jnp.asarray(sx), w8, jnp.asarray(sw)), jax.devices("cpu")[0], (m, n),
              out_dtype=jnp.float32)
    assert np_ref.rel_err(out, ref) <= 1e-6


def test_e8m0fnu_dtype_scales_decode_exactly():
    s = np.array([0.25, 8.0], ml_dtypes.float8_e8m0fnu)
    from jax_w4a8 import reference
    np.testing.assert_array_equal(np.asarray(reference.scale_to_f32(jnp.asarray(s))), [0.25, 8.0])


@pytest.mark.gpu
@pytest.mark.parametrize("tile_tokens", [0, 16, 32, 64, 128])
@pytest.mark.parametrize("shape", [(1, 1, 576, 1024, "block"), (130, 1, 200, 384, "row"), (64, 16, 256, 512, "block"),
                                   (700, 1, 1536, 256, "block"), (5, 4, 128, 4096, "row"),
                                   (37, 2, 201, 256, "row")])
def test_every_tile_config_on_gpu(rng, device, tile_tokens, shape):
    if device.platform != "gpu":
        pytest.skip("tile configurations exist on the CUDA handler only")
    m, h, n, k, recipe = shape
    for encoding in ("f32", "codes"):
        x8, sx, w8, sw = make_operands(rng, m, h, n, k, recipe, ue8m0=encoding == "codes")
        args = (x8, encode(sx, encoding), w8, encode(sw, encoding))
        fn = functools.partial(ops.fp8_einsum, "bhr,hdr->bhd", impl="ffi", tile_tokens=tile_tokens)
        out = run_poisoned(fn, (m, h, n), jnp.bfloat16, args, device)
        assert np_ref.rel_err(out, np_ref.fp8_einsum_mhk(x8, sx, w8, sw)) <= BF16_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("tile_tokens", [128, 192])
@pytest.mark.parametrize("m, h, n, k, out_dtype", [
    (300, 1, 576, 1024, jnp.bfloat16),   # kv_a-like: few tiles, so the plan runs stream-K
    (300, 1, 257, 512, jnp.float32),     # odd N: a lone feature at the edge, float32 out, stream-K
    (1408, 1, 1409, 256, jnp.bfloat16),  # odd N, 132 tiles of 128 tokens: one whole wave on an H200
    (200, 3, 130, 384, jnp.float32),     # per-head, partial token and feature tiles
    (2000, 1, 640, 512, jnp.bfloat16),   # 11 tiles of 192 tokens, the last one with 80 rows
])
def test_block_scaled_token_row_tiles_on_gpu(rng, device, tile_tokens, m, h, n, k, out_dtype):
    """128- and 192-token tiles of the block recipe run with tokens on the MMA's A side (two or three
    consumer warpgroups of 64 tokens) and store pairs of adjacent features: odd and partial feature
    tiles, partial token tiles, both output types, stream-K and not."""
    if device.platform != "gpu":
        pytest.skip("the token-row tiles exist on the CUDA handler only")
    x8, sx, w8, sw = make_operands(rng, m, h, n, k, "block")
    fn = functools.partial(ops.fp8_einsum, "bhr,hdr->bhd", impl="ffi", tile_tokens=tile_tokens, out_dtype=out_dtype)
    out = run_poisoned(fn, (m, h, n), out_dtype, (x8, sx, w8, sw), device)
    assert np_ref.rel_err(out, np_ref.fp8_einsum_mhk(x8, sx, w8, sw)) <= BF16_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("tile_tokens", [16, 32, 64, 128, 192])
def test_repeated_calls_every_element_on_gpu(rng, device, tile_tokens):
    """Same inputs, 8 calls (stream-K: 24 tiles of 128 tokens): every element of every call near float64,
    and every call bitwise equal to the first.

    Guards stage hand-back races (a stage freed while its scale loads are in flight shows up as a few
    elements of one row off in some calls, not in the norm); benchmarks/repeat_check.py explains them.
    """
    if device.platform != "gpu":
        pytest.skip("tile configurations exist on the CUDA handler only")
    x8, sx, w8, sw = make_operands(rng, 384, 1, 1024, 7168, "block", spread=3.0)
    args = [jax.device_put(a, device) for a in (x8, sx, w8, sw)]
    ref = np_ref.fp8_einsum_mhk(x8, sx, w8, sw)
    bound = 2e-3 * np.abs(ref).max(axis=-1, keepdims=True)  # float32 output: typical errors are 1e-5 of it
    fn = functools.partial(ops.fp8_einsum, "bhr,hdr->bhd", impl="ffi", tile_tokens=tile_tokens, out_dtype=jnp.float32)
    jitted = poisoned_jit(fn)
    first = None
    for call in range(8):
        # A fresh NaN-poisoned output every call: from call 1 on the allocator may hand back the previous
        # call's buffer, whose correct values an element the kernel skipped would otherwise keep.
        out = run_poisoned(fn, (384, 1, 1024), jnp.float32, args, device, jitted=jitted).astype(np.float64)
        bad = ~(np.abs(out - ref) <= bound)
        assert not bad.any(), f"call {call}: {bad.sum()} elements off, rows {sorted(set(np.nonzero(bad)[0].tolist()))[:8]}"
        if first is None:
            first = out
        # Bitwise the same every call, stream-K too (partial tiles are summed in block order).
        np.testing.assert_array_equal(out, first, err_msg=f"call {call} differs from call 0")


@pytest.mark.gpu
@pytest.mark.parametrize("tile_tokens, m, n", [(16, 16, 576), (64, 64, 256), (192, 192, 384)])
def test_stream_k_with_fewer_blocks_than_resident_on_gpu(rng, device, tile_tokens, m, n, monkeypatch):
    """A plan made for 5 SMs holds partial-tile slots for 5 (or 10) blocks only: the kernel's grid is cut
    to them (below the H200's resident blocks) and stream-K deals every iteration over those blocks; near
    float64, no element left unwritten, two calls bitwise equal."""
    if device.platform != "gpu":
        pytest.skip("tile configurations exist on the CUDA handler only")
    from jax_w4a8 import tiling
    monkeypatch.setattr(tiling, "_num_sms", lambda: 5)
    x8, sx, w8, sw = make_operands(rng, m, 1, n, 2048, "block")
    plan = tiling.plan_fp8_einsum(m, 1, n, 2048, block_scaled=True, tile_tokens=tile_tokens)
    assert plan.split_k > 1  # 2 .. 5 units, 16 K groups each, over 5 .. 10 blocks: partial first and last pieces
    fn = functools.partial(ops.fp8_einsum, "bhr,hdr->bhd", impl="ffi", tile_tokens=tile_tokens,
                           out_dtype=jnp.float32)
    out = run_poisoned(fn, (m, 1, n), jnp.float32, (x8, sx, w8, sw), device)
    assert np_ref.rel_err(out, np_ref.fp8_einsum_mhk(x8, sx, w8, sw)) <= F32_GPU_TOL
    again = run_poisoned(fn, (m, 1, n), jnp.float32, (x8, sx, w8, sw), device)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(again))


@pytest.mark.gpu
@pytest.mark.parametrize("m, h, n, k, recipe, encoding, out_dtype", [
    (1, 1, 576, 7168, "block", "codes", jnp.bfloat16),   # kv_a at one token: a cluster of 8 blocks splits K
    (1, 1, 1536, 7168, "block", "codes", jnp.bfloat16),  # q_a at one token: a cluster of 4 (on 132 SMs)
    (3, 4, 130, 384, "row", "f32", jnp.float32),         # partial 16-row tile, per-row scales, 3 K groups
    (8, 1, 17, 128, "block", "e8m0fnu", jnp.bfloat16),   # one K group: one warp per block
    (9, 2, 200, 1024, "row", "codes", jnp.float32),      # two 8-token tiles, the second with one token
    (16, 128, 64, 512, "block", "f32", jnp.bfloat16),    # MLA-absorb-like: 128 heads
    (27, 3, 33, 640, "row", "f32", jnp.bfloat16),        # four token tiles, 5 K groups over 4 warps
    (32, 1, 1536, 2048, "block", "codes", jnp.float32),  # four full token tiles, a cluster of 4
    (1, 128, 512, 128, "block", "f32", jnp.bfloat16),    # MLA absorb_q: 4096 tiles of one K group, walked
                                                         # whole by each warp, loads running ahead across tiles
    (2, 160, 160, 640, "row", "codes", jnp.float32),     # 1600 tiles of 5 K groups over 4 warps: one takes two
    # the staged kernel (split K, >= 8 K groups per warp; plans on 132 SMs): 397 tiles, the last of 8 rows;
    # 4 warps of 8 groups (4 stages of 2 groups each)
    (5, 1, 6344, 4096, "block", "codes", jnp.bfloat16),
    (2, 1, 6344, 4352, "block", "f32", jnp.float32),     # 34 groups: runs of 8 and 9, a last stage of one group
    (7, 1, 3200, 8192, "block", "e8m0fnu", jnp.bfloat16),  # a cluster of 2: its sums through the stages' memory
    (8, 16, 1000, 2048, "row", "f32", jnp.float32),      # per-head (V4 wo_a-like), per-row scales, 2-warp blocks
    (6, 1, 570, 32768, "block", "codes", jnp.bfloat16),  # a cluster of 8, a last tile of 10 rows
    (4, 1, 1592, 16384, "row", "f32", jnp.float32),      # a cluster of 4, per-row scales
])
def test_decode_kernel_on_gpu(rng, device, m, h, n, k, recipe, encoding, out_dtype):
    """tile_tokens=8, the one-launch decode kernel (warp MMAs; whole tiles per warp, or K split over warps
    and a cluster): every element near float64 (no element left unwritten: the output is poisoned), two
    calls bitwise equal."""
    if device.platform != "gpu":
        pytest.skip("the decode kernel exists on the CUDA handler only")
    x8, sx, w8, sw = make_operands(rng, m, h, n, k, recipe, ue8m0=encoding != "f32", spread=3.0)
    args = (x8, encode(sx, encoding), w8, encode(sw, encoding))
    fn = functools.partial(ops.fp8_einsum, "bhr,hdr->bhd", impl="ffi", tile_tokens=8, out_dtype=out_dtype)
    out = run_poisoned(fn, (m, h, n), out_dtype, args, device)
    ref = np_ref.fp8_einsum_mhk(x8, sx, w8, sw)
    assert np_ref.rel_err(out, ref) <= (BF16_TOL if out_dtype == jnp.bfloat16 else F32_GPU_TOL)
    elem_tol = (8e-3 if out_dtype == jnp.bfloat16 else 2e-3) * np.abs(ref).max(axis=-1, keepdims=True)
    bad = ~(np.abs(out - ref) <= elem_tol)
    assert not bad.any(), f"{bad.sum()} elements off"
    np.testing.assert_array_equal(run_poisoned(fn, (m, h, n), out_dtype, args, device), out)


@pytest.mark.gpu
@pytest.mark.parametrize("m, h, n, k, encoding", [
    (300, 1, 576, 1024, "codes"),   # M past a 128-row tile, kv_a's partial weight block (N = 4.5 x 128)
    (257, 1, 1544, 512, "f32"),     # N not a multiple of 128 (12 blocks + 8 rows)
    (130, 3, 264, 256, "e8m0fnu"),  # per-head form: CUTLASS batch mode over 3 heads
    (1, 1, 128, 128, "f32"),        # one token, one K block
    (513, 2, 512, 384, "codes"),
    (1024, 1, 2048, 2048, "f32"),   # several K blocks per tile (128 tiles: one partial wave)
    (1100, 2, 1544, 512, "codes"),  # 9 x 13 x 2 = 234 tiles: blocks run several tiles, across heads
])
def test_cutlass_kernel_on_gpu(rng, device, m, h, n, k, encoding):
    """kernel='cutlass' (CUTLASS's Hopper blockwise-scaled GEMM): every element near float64 (the output is
    poisoned), the same bound as this library's 128-token kernel on the same data, two calls bitwise equal."""
    if device.platform != "gpu":
        pytest.skip("the CUTLASS kernel exists on the CUDA handler only")
    from jax_w4a8 import _ffi
    if not _ffi.built_with_cutlass():
        pytest.skip("built without CUTLASS")
    x8, sx, w8, sw = make_operands(rng, m, h, n, k, "block", ue8m0=encoding != "f32", spread=3.0)
    args = (x8, encode(sx, encoding), w8, encode(sw, encoding))
    fn = functools.partial(ops.fp8_einsum, "bhr,hdr->bhd", impl="ffi", kernel="cutlass")
    out = run_poisoned(fn, (m, h, n), jnp.bfloat16, args, device)
    ref = np_ref.fp8_einsum_mhk(x8, sx, w8, sw)
    assert np_ref.rel_err(out, ref) <= BF16_TOL
    elem_tol = 8e-3 * np.abs(ref).max(axis=-1, keepdims=True)
    bad = ~(np.abs(out - ref) <= elem_tol)
    assert not bad.any(), f"{bad.sum()} elements off"
    native = functools.partial(ops.fp8_einsum, "bhr,hdr->bhd", impl="ffi", kernel="native", tile_tokens=128)
    other = run_poisoned(native, (m, h, n), jnp.bfloat16, args, device)
    assert np.abs(out - ref).max() <= 2 * np.abs(other - ref).max() + 1e-30
    np.testing.assert_array_equal(run_poisoned(fn, (m, h, n), jnp.bfloat16, args, device), out)


@pytest.mark.gpu
def test_linear_plan_takes_cutlass_on_gpu(rng, device):
    """The default plan of a block-scaled bf16 linear with enough rows and tiles is CUTLASS's kernel."""
    if device.platform != "gpu":
        pytest.skip("the CUTLASS kernel exists on the CUDA handler only")
    from jax_w4a8 import _ffi, tiling
    if not _ffi.built_with_cutlass():
        pytest.skip("built without CUTLASS")
    m, n, k = 300, 4096, 512
    assert tiling.plan_fp8_einsum(m, 1, n, k, block_scaled=True).kernel == "cutlass"
    x8, sx, w8, sw = make_operands(rng, m, 1, n, k, "block", ue8m0=True)
    out = run("md,nd->mn", (x8[:, 0], quant.encode_ue8m0(sx[:, 0]), w8[0], quant.encode_ue8m0(sw[0])), device, (m, n))
    ref = np_ref.fp8_einsum_mhk(x8, sx, w8, sw)[:, 0]
    assert np_ref.rel_err(out, ref) <= BF16_TOL
    assert (np.abs(out - ref) <= 8e-3 * np.abs(ref).max(axis=-1, keepdims=True)).all()


def test_cutlass_kernel_refuses_what_it_cannot_run(rng):
    x8, sx, w8, sw = make_operands(rng, 300, 1, 256, 256, "row")
    with pytest.raises(ValueError, match="'kernel'='cutlass'"):
        ops.fp8_einsum("bhr,hdr->bhd", x8, sx, w8, sw, kernel="cutlass")
    x8, sx, w8, sw = make_operands(rng, 300, 1, 256, 256, "block")
    with pytest.raises(ValueError, match="'kernel'='cutlass'"):
        ops.fp8_einsum("bhr,hdr->bhd", x8, sx, w8, sw, kernel="cutlass", out_dtype=jnp.float32)
    with pytest.raises(ValueError, match="'kernel'"):
        ops.fp8_einsum("bhr,hdr->bhd", x8, sx, w8, sw, kernel="cudnn")


@pytest.mark.parametrize("m, h, n, recipe, out_dtype, text", [
    (300, 1, 256, "row", jnp.bfloat16, "recipe"),
    (300, 1, 256, "block", jnp.float32, "bfloat16"),
    (300, 2, 256, "block", jnp.bfloat16, "one head"),
    (301, 1, 256, "block", jnp.bfloat16, "multiple of 4"),
    (300, 1, 264, "block", jnp.bfloat16, "multiple of 16"),
])
def test_cublas_kernel_refuses_what_it_cannot_run(rng, m, h, n, recipe, out_dtype, text):
    """kernel='cublas' names what cuBLASLt's block-scaled GEMM cannot run, at trace time."""
    x8, sx, w8, sw = make_operands(rng, m, h, n, 256, recipe)
    with pytest.raises(ValueError, match=f"'kernel'='cublas' cannot run this einsum: .*{text}"):
        ops.fp8_einsum("bhr,hdr->bhd", x8, sx, w8, sw, kernel="cublas", out_dtype=out_dtype)


@pytest.mark.parametrize("value", ["-1", "16", "first", "1.5"])
def test_cublas_algo_variable_is_checked(rng, monkeypatch, value):
    """$JAX_W4A8_CUBLAS_ALGO (which of cuBLASLt's heuristic results to run, for sweeps) is checked at trace time,
    naming the variable; it does not concern the other kernels."""
    from jax_w4a8 import _ffi
    monkeypatch.setattr(_ffi, "_CUBLASLT", (130002, ""))  # the plan's other checks pass wherever this runs
    monkeypatch.setenv("JAX_W4A8_CUBLAS_ALGO", value)
    x8, sx, w8, sw = make_operands(rng, 8, 1, 256, 256)
    args = (x8[:, 0], sx[:, 0], w8[0], sw[0])
    with pytest.raises(ValueError, match=r"fp8_einsum: \$JAX_W4A8_CUBLAS_ALGO must be an int in \[0, 16\)"):
        jax.jit(lambda *a: ops.fp8_einsum("md,nd->mn", *a, kernel="cublas"))(*args)
    ops.fp8_einsum("md,nd->mn", *args, kernel="native")  # other kernels ignore it


def test_cublas_algo_defaults_to_the_first_choice(monkeypatch):
    from jax_w4a8 import tiling
    monkeypatch.delenv("JAX_W4A8_CUBLAS_ALGO", raising=False)
    assert tiling.cublas_algo() == 0
    monkeypatch.setenv("JAX_W4A8_CUBLAS_ALGO", " 3 ")
    assert tiling.cublas_algo() == 3


def test_cublas_kernel_takes_no_tile(rng):
    x8, sx, w8, sw = make_operands(rng, 300, 1, 256, 256)
    with pytest.raises(ValueError, match="'tile_tokens'"):
        ops.fp8_einsum("bhr,hdr->bhd", x8, sx, w8, sw, kernel="cublas", tile_tokens=128)


def test_cublas_kernel_refuses_without_cublaslt(rng, monkeypatch):
    """Without a cuBLASLt to load the plan says why, before anything compiles."""
    from jax_w4a8 import _ffi
    monkeypatch.setattr(_ffi, "_CUBLASLT", (0, "no cuBLASLt here"))
    x8, sx, w8, sw = make_operands(rng, 8, 1, 256, 256)
    with pytest.raises(ValueError, match="'kernel'='cublas' cannot run this einsum: no cuBLASLt here"):
        ops.fp8_einsum("md,nd->mn", x8[:, 0], sx[:, 0], w8[0], sw[0], kernel="cublas")


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k, encoding", [
    (4, 16, 128, "f32"),           # smallest: one K block, ceil4(G) pads 1 -> 4
    (132, 576, 640, "codes"),      # kv_a's N (a partial weight block), G = 5 (padded to 8)
    (260, 1536, 1536, "e8m0fnu"),  # q_a-like
    (1024, 2048, 2048, "f32"),
    (512, 7168, 7168, "codes"),    # DeepSeek-V3's square linear
])
def test_cublas_kernel_on_gpu(rng, device, m, n, k, encoding):
    """kernel='cublas' (cuBLASLt's block-scaled FP8 GEMM): every element near float64 (the output is poisoned),
    within twice the CUTLASS kernel's largest error on the same data, two calls bitwise equal."""
    if device.platform != "gpu" or str(getattr(device, "compute_capability", "")) != "9.0":
        pytest.skip("cuBLASLt's block scaling runs on compute capability 9.0 only (elsewhere the simple kernel)")
    from jax_w4a8 import _ffi
    version, why = _ffi.cublaslt()
    if not version:
        pytest.skip(why)
    x8, sx, w8, sw = make_operands(rng, m, 1, n, k, "block", ue8m0=encoding != "f32", spread=3.0)
    args = (x8[:, 0], encode(sx[:, 0], encoding), w8[0], encode(sw[0], encoding))
    fn = functools.partial(ops.fp8_einsum, "md,nd->mn", impl="ffi", kernel="cublas")
    out = run_poisoned(fn, (m, n), jnp.bfloat16, args, device)
    ref = np_ref.fp8_einsum_mhk(x8, sx, w8, sw)[:, 0]
    assert np_ref.rel_err(out, ref) <= BF16_TOL
    elem_tol = 8e-3 * np.abs(ref).max(axis=-1, keepdims=True)
    bad = ~(np.abs(out - ref) <= elem_tol)
    assert not bad.any(), f"{bad.sum()} elements off"
    if _ffi.built_with_cutlass():
        cutlass = functools.partial(ops.fp8_einsum, "md,nd->mn", impl="ffi", kernel="cutlass")
        other = run_poisoned(cutlass, (m, n), jnp.bfloat16, args, device)
        assert np.abs(out - ref).max() <= 2 * np.abs(other - ref).max() + 1e-30
    np.testing.assert_array_equal(run_poisoned(fn, (m, n), jnp.bfloat16, args, device), out)


def test_decode_kernel_takes_at_most_32_tokens(rng):
    x8, sx, w8, sw = make_operands(rng, 33, 1, 64, 128)
    with pytest.raises(ValueError, match="tile_tokens"):
        ops.fp8_einsum("bhr,hdr->bhd", x8, sx, w8, sw, tile_tokens=8)


def test_192_token_tiles_need_block_scaled_weights(rng):
    x8, sx, w8, sw = make_operands(rng, 300, 1, 256, 256, "row")
    with pytest.raises(ValueError, match="tile_tokens"):
        ops.fp8_einsum("bhr,hdr->bhd", x8, sx, w8, sw, tile_tokens=192)


def test_nan_code_under_jit_is_rejected_by_the_cpu_handler(rng):
    x8, sx, w8, sw = make_operands(rng, 2, 1, 8, 128, ue8m0=True)
    codes = np.asarray(quant.encode_ue8m0(sw[0])).copy()
    codes[0, 0] = 0xFF
    f = jax.jit(functools.partial(ops.fp8_einsum, "md,nd->mn", impl="ffi"))
    args = [jax.device_put(a, jax.devices("cpu")[0]) for a in (x8[:, 0], quant.encode_ue8m0(sx[:, 0]), w8[0], codes)]
    with pytest.raises(Exception, match="w_scale holds UE8M0 code 0xFF"):
        jax.block_until_ready(f(*args))


@pytest.mark.parametrize("arg", ["x_scale", "w_scale"])
def test_nan_code_under_jit_is_rejected_on_the_reference_path(rng, arg):
    """impl="reference" (and "auto" where the CPU handler is missing) scans traced codes with a host callback, as
    the CPU handler does: a 0xFF code fails the call naming the argument instead of giving NaN rows."""
    x8, sx, w8, sw = make_operands(rng, 2, 1, 8, 128, ue8m0=True)
    good = {"x_scale": np.asarray(quant.encode_ue8m0(sx[:, 0])), "w_scale": np.asarray(quant.encode_ue8m0(sw[0]))}
    f = jax.jit(functools.partial(ops.fp8_einsum, "md,nd->mn", impl="reference"))
    out = np.asarray(f(x8[:, 0], good["x_scale"], w8[0], good["w_scale"]).astype(jnp.float32))
    assert np.isfinite(out).all()
    bad = dict(good)
    bad[arg] = bad[arg].copy()
    bad[arg].reshape(-1)[-1] = 0xFF
    with pytest.raises(Exception, match=f"argument '{arg}' holds UE8M0 code 0xFF"):
        jax.block_until_ready(f(x8[:, 0], bad["x_scale"], w8[0], bad["w_scale"]))


def test_constant_scales_captured_by_jit(rng):
    """Scales closed over by a jitted function (NumPy arrays, or JAX arrays captured as constants) are checked and
    encoded at trace time as eagerly: valid ones give the eager result (a bitcast or encoding of them once failed
    with TracerArrayConversionError), a 0xFF code or an inexact UE8M0 scale the eager ValueError."""
    x8, sx, w8, sw = make_operands(rng, 2, 1, 8, 128, ue8m0=True)
    x, xs, w = x8[:, 0], sx[:, 0], w8[0]
    want = np.asarray(ops.fp8_einsum("md,nd->mn", x, xs, w, sw[0], ue8m0=True).astype(jnp.float32))
    codes = np.asarray(quant.encode_ue8m0(sw[0]))
    as_e8m0 = jax.lax.bitcast_convert_type(jnp.asarray(codes), jnp.float8_e8m0fnu)
    for ws, kw in ((np.asarray(sw[0]), dict(ue8m0=True)), (jnp.asarray(sw[0]), dict(ue8m0=True)), (codes, {}),
                   (as_e8m0, {})):
        got = jax.jit(lambda v, ws=ws, kw=kw: ops.fp8_einsum("md,nd->mn", x, v, w, ws, **kw))(xs)
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), want)
    for ws in (np.asarray(sw[0]), jnp.asarray(sw[0])):  # made outside the jitted function: encoded at trace time
        np.testing.assert_array_equal(np.asarray(jax.jit(lambda ws=ws: ops.pack_ue8m0(ws))()), codes)
    bad = codes.copy()
    bad[0, 0] = 0xFF
    with pytest.raises(ValueError, match="'w_scale' holds UE8M0 code 0xFF"):
        jax.jit(lambda v: ops.fp8_einsum("md,nd->mn", x, v, w, bad))(xs)
    inexact = np.asarray(sw[0]).copy()
    inexact[0, 0] *= 0.75
    with pytest.raises(ValueError, match="'w_scale'"):
        jax.jit(lambda v: ops.fp8_einsum("md,nd->mn", x, v, w, inexact, ue8m0=True))(xs)
    with pytest.raises(ValueError, match="'scale'"):
        jax.jit(lambda: ops.pack_ue8m0(inexact))()


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["cublas", "cutlass", "native"])
def test_first_call_inside_a_command_buffer_on_gpu(rng, kernel):
    """Four chained einsums in one jitted program that XLA records as a command buffer, in a fresh process: the
    kernel's first call of the process is recorded into the graph (cuBLASLt's handle and plan made while XLA
    captures the stream); the sum is near float64."""
    from jax_w4a8 import _ffi
    if kernel == "cublas" and not _ffi.cublaslt()[0]:
        pytest.skip(_ffi.cublaslt()[1])
    if kernel == "cutlass" and not _ffi.built_with_cutlass():
        pytest.skip("built without CUTLASS")
    if kernel in ("cublas", "cutlass") and str(getattr(jax.devices("gpu")[0], "compute_capability", "")) != "9.0":
        pytest.skip("the block-scaled library kernels run on compute capability 9.0")
    got = run_in_command_buffer("einsum", kernel, int(rng.integers(1 << 30)))
    assert got["finite"] and got["rel_err"] <= BF16_TOL, got
