"""ops.w4a8_grouped_gemm (SPEC 4.1): FFI handlers (CPU, CUDA) and the reference vs float64 numpy."""

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import np_ref
from conftest import poisoned_jit, run_in_command_buffer, run_poisoned
from jax_w4a8 import ops, quant, tiling

BF16_TOL = 4e-3  # SPEC section 7
F32_TOL = 2e-6
# Hopper's fp8 tensor cores accumulate the products of one 128-K group with fewer than float32's
# mantissa bits (the reason DeepSeek promotes to float32 every 128 K): float32 outputs of the
# tensor-core path are good to about 1e-4, not 1e-6.
F32_TOL_TENSOR_CORE = 2e-4


def make_case(rng, m, k, n, sizes, scale_kind="group", w_scale_dtype=jnp.float32):
    e = len(sizes)
    w = (rng.standard_normal((e, n, k)) * np.exp2(rng.uniform(-4, 2, (e, n, 1)))).astype(np.float32)
    w_packed, w_scale = quant.quantize_w4(w)
    x = (rng.standard_normal((m, k)) * np.exp2(rng.uniform(-3, 3, (m, 1)))).astype(np.float32)
    if scale_kind == "group":
        x8, x_scale = quant.quantize_fp8_groups(x)
    elif scale_kind == "token":
        x_scale = jnp.asarray(np.abs(x).max(-1) / 448, jnp.float32)
        x8 = quant.quantize_fp8_tensor(x / np.asarray(x_scale)[:, None], 1.0)
    else:
        x_scale = jnp.asarray(np.abs(x).max() / 448, jnp.float32)
        x8 = quant.quantize_fp8_tensor(x, x_scale)
    return x8, x_scale, w_packed, w_scale.astype(w_scale_dtype), jnp.asarray(sizes, jnp.int32)


def check(args, out, out_dtype, tensor_core=False):
    ref = np_ref.grouped_gemm(*args)
    tol = BF16_TOL if out_dtype == jnp.bfloat16 else F32_TOL_TENSOR_CORE if tensor_core else F32_TOL
    assert np_ref.rel_err(out, ref) <= tol
    return ref


def run_ffi(args, device, out_dtype=jnp.bfloat16):
    m, n = args[0].shape[0], args[2].shape[1]
    fn = functools.partial(ops.w4a8_grouped_gemm, out_dtype=out_dtype, impl="ffi")
    return run_poisoned(fn, (m, n), out_dtype, args, device)


@pytest.mark.parametrize("scale_kind", ["tensor", "token", "group"])
@pytest.mark.parametrize("w_scale_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_ffi_matches_float64(rng, device, scale_kind, w_scale_dtype, out_dtype):
    m, e = 70, 5
    sizes = rng.multinomial(m - 6, np.ones(e) / e)  # 6 padding rows at the end
    sizes[rng.integers(e)] = 0  # at least one empty expert
    sizes = np.append(sizes[:-1], m - 6 - sizes[:-1].sum())
    args = make_case(rng, m, 384, 136, sizes, scale_kind, w_scale_dtype)
    out = run_ffi(args, device, out_dtype)
    check(args, out, out_dtype, tensor_core=device.platform == "gpu")
    assert (out[m - 6:] == 0).all(), "padding rows must be exactly zero"


@pytest.mark.parametrize("scale_kind", ["tensor", "token", "group"])
def test_reference_matches_float64(rng, scale_kind):
    args = make_case(rng, 33, 256, 40, [10, 0, 20, 1], scale_kind)
    out = ops.w4a8_grouped_gemm(*args, impl="reference", out_dtype=jnp.float32)
    check(args, np.asarray(out), jnp.float32)


def test_auto_uses_ffi_and_agrees(rng):
    args = make_case(rng, 20, 128, 24, [5, 15])
    auto = jax.jit(ops.w4a8_grouped_gemm)(*args)
    assert "jax_w4a8_w4a8_grouped_gemm" in jax.jit(ops.w4a8_grouped_gemm).lower(*args).as_text()
    check(args, np.asarray(auto.astype(jnp.float32)), jnp.bfloat16)


@pytest.mark.parametrize("sizes", [[0, 48, 0, 0], [48], [0, 0, 0], [1] * 48])
def test_empty_and_single_expert(rng, device, sizes):
    args = make_case(rng, 48, 256, 64, sizes)
    out = run_ffi(args, device)
    check(args, out, jnp.bfloat16)
    if sum(sizes) == 0:
        assert (out == 0).all()


@pytest.mark.parametrize("sizes", [
    [-5, 40, 30],               # negative entry counts as 0; the sum runs past M
    [2**31 - 1, 2**31 - 1, 7],  # int32 extremes: the running end is cut at M
    [-2**31, 3, -1, 4],         # most negative int32
    [50, 60],                   # all rows in the first expert, the rest cut
])
def test_hostile_group_sizes_are_clamped(rng, device, sizes):
    m = 37
    args = make_case(rng, m, 128, 40, sizes)
    out = run_ffi(args, device)
    check(args, out, jnp.bfloat16)  # np_ref applies the documented clamping rule
    covered = min(sum(max(s, 0) for s in sizes), m)
    assert (out[covered:] == 0).all() and np.abs(out[:covered]).max() > 0


def test_group_sizes_change_without_recompiling(rng):
    args = list(make_case(rng, 32, 128, 16, [16, 16]))
    fn = functools.partial(ops.w4a8_grouped_gemm, impl="ffi", out_dtype=jnp.float32)
    f = poisoned_jit(fn)
    for sizes in ([16, 16], [0, 32], [5, 3]):
        args[4] = jnp.asarray(sizes, jnp.int32)
        out = run_poisoned(fn, (32, 16), jnp.float32, args, jax.devices("cpu")[0], jitted=f)
        check(args, out, jnp.float32)
        assert (out[sum(sizes):] == 0).all()
    assert f._cache_size() == 1


def test_fp16_overflow_regression(device):
    """sglang issue 8493: true outputs beyond 65504 must come back finite and right (bf16 out)."""
    m, k, n = 8, 256, 16
    x8 = jnp.full((m, k), 448.0, jnp.float8_e4m3fn)
    q = np.full((2, n, k), 7, np.int8)
    q[1, ::2] = -8
    w = quant.pack_int4(q)
    w_scale = jnp.full((2, n, k // 128), 0.5, jnp.float32)
    x_scale = jnp.full((m, k // 128), 2.0, jnp.float32)
    args = (x8, x_scale, w, w_scale, jnp.array([4, 4], jnp.int32))
    out = run_ffi(args, device)
    ref = check(args, out, jnp.bfloat16)
    assert np.abs(ref).max() > 65504 * 10 and np.isfinite(out).all()
    assert np.asarray(ops.w4a8_grouped_gemm(*args, impl="reference").astype(jnp.float32)).max() > 65504
    with pytest.raises(ValueError, match="float16"):
        ops.w4a8_grouped_gemm(*args, out_dtype=jnp.float16)


@pytest.mark.gpu
def test_deepseek_shape_on_gpu(rng, device):
    """A slice of DeepSeek-R1 gate+up (K = 7168) with skewed routing, on the CUDA handler."""
    if device.platform != "gpu":
        pytest.skip("GPU-sized case")
    args = make_case(rng, 256, 7168, 512, [200, 0, 40, 1, 15, 0, 0, 0])
    check(args, run_ffi(args, device), jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel, tile_tokens", [(None, None), ("native", None), ("decode", 8), ("decode", 16)])
@pytest.mark.parametrize("n, k", [(4096, 7168), (7168, 2048)], ids=["gate_up", "down"])
def test_batch1_decode_routing_on_gpu(rng, device, n, k, kernel, tile_tokens):
    """A batch-1 decode step's routed experts at DeepSeek-V3 widths: one token on 8 of 256 experts, one row
    each (the plan's choice, the 8-token tile over mostly empty experts, and the decode kernel's 8- and 16-row
    units). The other experts' weights are zeros; the reference is the same 8 rows on just their 8 experts."""
    if device.platform != "gpu":
        pytest.skip("GPU-sized case")
    e, busy = 256, np.sort(rng.choice(256, 8, replace=False))
    x8, xs, w8, ws8, _ = make_case(rng, 8, k, n, [1] * 8)
    with jax.default_device(device):
        w = jnp.zeros((e, n, k // 2), w8.dtype).at[busy].set(jnp.asarray(w8))
        ws = jnp.ones((e, n, k // 128), ws8.dtype).at[busy].set(jnp.asarray(ws8))
        sizes = jnp.zeros((e,), jnp.int32).at[busy].set(1)
    fn = functools.partial(ops.w4a8_grouped_gemm, impl="ffi", kernel=kernel, tile_tokens=tile_tokens)
    out = run_poisoned(fn, (8, n), jnp.bfloat16, (x8, xs, w, ws, sizes), device)
    check((x8, xs, w8, ws8, jnp.ones((8,), jnp.int32)), out, jnp.bfloat16)


# ------------------------------------------------------------------------------------ bad input
def _good(rng):
    return dict(zip(["x", "x_scale", "w", "w_scale", "group_sizes"], make_case(rng, 16, 256, 8, [8, 8])))


BAD = [
    ("x", lambda a: a["x"].astype(jnp.bfloat16), TypeError, "'x'"),
    ("x", lambda a: a["x"][:, :200], ValueError, "'x'"),
    ("x", lambda a: a["x"][None], ValueError, "'x'"),
    ("w", lambda a: a["w"].astype(jnp.int32), TypeError, "'w'"),
    ("w", lambda a: a["w"][:, :, :64], ValueError, "'w'"),
    ("w_scale", lambda a: a["w_scale"].astype(jnp.float16), TypeError, "'w_scale'"),
    ("w_scale", lambda a: a["w_scale"][:, :4], ValueError, "'w_scale'"),
    ("x_scale", lambda a: a["x_scale"][:, :1], ValueError, "'x_scale'"),
    ("x_scale", lambda a: a["x_scale"].astype(jnp.bfloat16), TypeError, "'x_scale'"),
    ("group_sizes", lambda a: a["group_sizes"].astype(jnp.int64 if jax.config.x64_enabled else jnp.uint32), TypeError, "'group_sizes'"),
    ("group_sizes", lambda a: jnp.array([16], jnp.int32), ValueError, "'group_sizes'"),
]


@pytest.mark.parametrize("arg, mutate, exc, text", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_inputs_name_the_argument(rng, arg, mutate, exc, text):
    a = _good(rng)
    a[arg] = mutate(a)
    with pytest.raises(exc, match=text):
        ops.w4a8_grouped_gemm(**a)
    with pytest.raises(exc, match=text):  # also at trace time under jit
        jax.jit(ops.w4a8_grouped_gemm)(**a)


def test_group_sizes_of_another_int_width_are_refused_before_narrowing(rng):
    """NumPy's default int64 (np.bincount's output) would be narrowed to int32 by jnp.asarray with x64 off, wrapping
    2**32 - 1 to -1 silently: refused by dtype, naming the argument; a plain list is fine."""
    a = _good(rng)
    for bad in (np.array([8, 8], np.int64), np.array([2**32 - 1, 16], np.int64), np.array([8, 8], np.uint32)):
        with pytest.raises(TypeError, match="argument 'group_sizes' must have dtype int32"):
            ops.w4a8_grouped_gemm(**{**a, "group_sizes": bad})
    out = ops.w4a8_grouped_gemm(**{**a, "group_sizes": [8, 8]})
    check(tuple(a.values()), np.asarray(out.astype(jnp.float32)), jnp.bfloat16)


def test_python_int_group_sizes_past_int32_are_refused(rng):
    """A list of Python ints is converted to int32 by jnp.asarray, which overflows (OverflowError) past 2**31."""
    a = _good(rng)
    for bad in ([2**31, 0], [0, -2**31 - 1], [2**70, 0], [np.asarray(2**31 + 8), 0], [np.int64(2**40), 0]):
        with pytest.raises(ValueError, match="argument 'group_sizes' must hold int32 values"):
            ops.w4a8_grouped_gemm(**{**a, "group_sizes": bad})
    with pytest.raises(ValueError, match="argument 'group_sizes' must be a 1-D int32 array"):
        ops.w4a8_grouped_gemm(**{**a, "group_sizes": [[8], [4, 4]]})
    with pytest.raises(ValueError, match="argument 'group_sizes' must hold int32 values"):
        ops.w4a8_grouped_gemm(**{**a, "group_sizes": [2**63, 1]})  # NumPy makes this list float64
    out = ops.w4a8_grouped_gemm(**{**a, "group_sizes": [2**31 - 1, -2**31]})  # in range: clamped to M
    check((*tuple(a.values())[:4], jnp.asarray([2**31 - 1, -2**31], jnp.int32)), np.asarray(out.astype(jnp.float32)),
          jnp.bfloat16)


def test_subnormal_activation_scale_on_the_cpu_handler(rng):
    """A float32 subnormal scale (1e-39) is applied as IEEE float32 does, not flushed to zero as XLA's CPU runtime
    would (the outputs, about 1e-37, are normal numbers; once all 0). The product of the two scales is itself
    subnormal, so it keeps fewer mantissa bits (IEEE float32, as on the GPU): 1e-3 against float64."""
    x8, _, w, ws, gs = make_case(rng, 16, 256, 8, [8, 8])
    args = (x8, jnp.float32(1e-39), w, ws, gs)
    out = run_poisoned(functools.partial(ops.w4a8_grouped_gemm, out_dtype=jnp.float32, impl="ffi"), (16, 8),
                       jnp.float32, args, jax.devices("cpu")[0])
    ref = np_ref.grouped_gemm(*args)
    assert np.abs(ref).max() > 1e-38
    assert np_ref.rel_err(out, ref) <= 1e-3


def test_bad_options(rng):
    a = _good(rng)
    with pytest.raises(ValueError, match="'impl'"):
        ops.w4a8_grouped_gemm(**a, impl="fast")
    for bad in (jnp.int32, None, "foo"):
        with pytest.raises(ValueError, match="'out_dtype'"):
            ops.w4a8_grouped_gemm(**a, out_dtype=bad)
    for bad in (-1, float("nan"), float("inf"), "a"):
        with pytest.raises(ValueError, match="argument 'rows_per_expert' must be None or a finite number"):
            ops.w4a8_grouped_gemm(**a, rows_per_expert=bad)
    with pytest.raises(ValueError, match="w4a8_grouped_gemm: kernel='decode' runs 8- or 16-row units"):
        ops.w4a8_grouped_gemm(**a, kernel="decode", tile_tokens=32)
    # The process survives and the op still works afterwards (the decode kernel's plan on any handler).
    check(tuple(a.values()), np.asarray(ops.w4a8_grouped_gemm(**a).astype(jnp.float32)), jnp.bfloat16)
    for unit_rows in (8, 16):
        out = ops.w4a8_grouped_gemm(**a, kernel="decode", tile_tokens=unit_rows)
        check(tuple(a.values()), np.asarray(out.astype(jnp.float32)), jnp.bfloat16)


SCENARIOS = {
    "decode-even": (64, 7168, 512, [2] * 32),
    "skewed": (300, 1024, 384, [250, 0, 30, 0, 1, 19]),
    "padding-hostile": (100, 512, 136, [-3, 40, 2**31 - 1, 5]),
    "prefill": (1024, 2048, 256, [400, 300, 200, 100]),
    "empty": (40, 256, 128, [0, 0]),
}


def _check_scenario_on_gpu(rng, device, scenario, scenarios=None, **options):
    """Both scale kinds and output dtypes of a scenario through the CUDA handler vs float64; padding rows 0."""
    m, k, n, sizes = (scenarios or SCENARIOS)[scenario]
    for scale_kind, w_scale_dtype, out_dtype in (("group", jnp.float32, jnp.bfloat16),
                                                 ("tensor", jnp.bfloat16, jnp.float32)):
        args = make_case(rng, m, k, n, sizes, scale_kind, w_scale_dtype)
        fn = functools.partial(ops.w4a8_grouped_gemm, out_dtype=out_dtype, impl="ffi", **options)
        out = run_poisoned(fn, (m, n), out_dtype, args, device)
        check(args, out, out_dtype, tensor_core=options.get("tile_tokens") != 0)
        assert np.isfinite(out).all()
        covered = min(sum(max(s, 0) for s in sizes), m)
        assert (out[covered:] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("tile_tokens", [0, 8, 16, 32, 64, 128])
def test_every_tile_config_on_gpu(rng, device, scenario, tile_tokens):
    """The tensor-core kernel at every token tile (0 = simple kernel), split-K and not, vs float64."""
    if device.platform != "gpu":
        pytest.skip("tile configurations exist on the CUDA handler only")
    _check_scenario_on_gpu(rng, device, scenario, tile_tokens=tile_tokens)


DECODE_SCENARIOS = {  # the decode kernel's units: runs of at most 8 or 16 rows of one expert
    "top8-of-64": (8, 1024, 384, [0] * 10 + [1] + [0] * 20 + [1] * 7 + [0] * 26),
    "partial-units": (61, 1024, 200, [7, 8, 9, 0, 16, 17, 1, 3]),  # units of 1 .. 16 rows, 200 columns (12.5 tiles)
    "long-experts": (150, 512, 96, [33, 15, 0, 47, 55]),  # several full units per expert, partial last ones
    "one-expert-all-rows": (96, 512, 64, [0, 0, 96]),  # 12 units of one expert
    "more-experts-than-rows": (5, 256, 48, [0, 1, 0, 2, 0, 0, 1, 0, 1] + [0] * 23),
    "sizes-past-m": (40, 384, 136, [30, -7, 2**31 - 1, 6]),  # the running end cut at M: expert 2 gets 10 rows
    "all-padding": (24, 256, 32, [0, -1, 0]),
}


@pytest.mark.gpu
@pytest.mark.parametrize("scenario", sorted(SCENARIOS) + sorted(DECODE_SCENARIOS))
@pytest.mark.parametrize("unit_rows", [8, 16])
def test_decode_kernel_on_gpu(rng, device, scenario, unit_rows):
    """The grouped decode kernel (kernel='decode': 8- or 16-row units found on the device, warp-level f16 MMAs,
    split K over warps and clusters) vs float64, both scale kinds and output dtypes, padding rows 0."""
    if device.platform != "gpu":
        pytest.skip("the decode kernel exists on the CUDA handler only")
    _check_scenario_on_gpu(rng, device, scenario, scenarios={**SCENARIOS, **DECODE_SCENARIOS}, kernel="decode",
                           tile_tokens=unit_rows)


def _check_bf16_every_element(rng, device, m, k, n, sizes, routed, tile_tokens, mma, scale_kind):
    """One tile and MMA format, bf16 output (NaN-poisoned): every element of the first ``routed`` rows within
    8e-3 of its float64 value plus 2e-3 of its row's largest, the rows after them zero."""
    args = make_case(rng, m, k, n, sizes, scale_kind)
    fn = functools.partial(ops.w4a8_grouped_gemm, impl="ffi", tile_tokens=tile_tokens, mma=mma)
    out = run_poisoned(fn, (m, n), jnp.bfloat16, args, device)
    ref = np_ref.grouped_gemm(*args)
    bound = 8e-3 * np.abs(ref) + 2e-3 * np.abs(ref).max(axis=1, keepdims=True)
    assert (np.abs(out[:routed] - ref[:routed]) <= bound[:routed]).all()
    assert (out[routed:] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("n", [131, 136, 1000])
@pytest.mark.parametrize("tile_tokens, mma", [(16, "e4m3"), (16, "f16"), (32, "e4m3"), (32, "f16"), (64, "e4m3"),
                                             (64, "f16"), (128, "e4m3"), (128, "f16")])
@pytest.mark.parametrize("scale_kind", ["group", "token"])
def test_staged_and_element_epilogues_every_element_on_gpu(rng, device, n, tile_tokens, mma, scale_kind):
    """The wgmma kernels write bf16 tiles through shared memory and 16-byte row stores when N is a multiple of 8
    (136: a partial feature tile of 8; 1000: of 104), element by element otherwise (131): every element of the
    routed rows near float64, the padding rows zero, nothing left unwritten (NaN poison). Per-token activation
    scales: the 128-token e4m3 kernel folds them and, like the f16 kernels, multiplies each token's in at the
    epilogue (the staged one reads them from its staging rows)."""
    if device.platform != "gpu":
        pytest.skip("tile configurations exist on the CUDA handler only")
    # rows 300.. are padding; experts end inside token tiles: units of 128, 122, 30, 15 and 5 rows
    _check_bf16_every_element(rng, device, 320, 256, n, [250, 0, 30, 15, 5], 300, tile_tokens, mma, scale_kind)


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(512, 7168), (512, 2048)], ids=["gate_up", "down"])
@pytest.mark.parametrize("tile_tokens", [8, 16, 32, 64])
def test_f16_tiles_at_deepseek_widths_every_element_on_gpu(rng, device, n, k, tile_tokens):
    """The f16 decode tiles at DeepSeek's K: how many shared-memory stages a kernel takes depends on K there (the
    weight scales' L1 lines: 224-byte rows at K = 7168, 64-byte at 2048, hopper_gemm.cu's SmemForScaleLines), so
    the smaller K of the other tests runs other stage counts. Every element of the routed rows near float64."""
    if device.platform != "gpu":
        pytest.skip("tile configurations exist on the CUDA handler only")
    _check_bf16_every_element(rng, device, 200, k, n, [90, 0, 40, 7, 33], 170, tile_tokens, "f16", "group")


@pytest.mark.gpu
@pytest.mark.parametrize("sizes", ["random", "whole-units"])
@pytest.mark.parametrize("tile_tokens, mma", [(16, "f16"), (32, "e4m3"), (32, "f16"), (64, "f16"), (128, "e4m3"),
                                             (128, "f16")])
@pytest.mark.parametrize("scale_kind", ["group", "token"])
def test_staged_epilogue_many_units_per_block_on_gpu(rng, device, sizes, tile_tokens, mma, scale_kind):
    """Hundreds of units over the resident blocks: each warpgroup's staging rows are rewritten once every thread
    has read the previous unit's back (the warpgroup's barrier); at f16 16 and 32 tokens four warpgroups of one
    256-row block (whole units, N = 1024). Random group sizes (most units partial) or
    128-row groups (whole units); every element near float64, the padding rows zero. Per-token scales (folded
    at 128 e4m3 tokens) or per-group: the token multipliers go through the staging rows' padding."""
    if device.platform != "gpu":
        pytest.skip("tile configurations exist on the CUDA handler only")
    m = 4096
    if sizes == "random":
        groups = list(rng.multinomial(m - 40, np.full(32, 1 / 32)))  # 40 padding rows
    else:
        groups = [128] * 31 + [m - 40 - 31 * 128]
    _check_bf16_every_element(rng, device, m, 256, 1024, groups, m - 40, tile_tokens, mma, scale_kind)


@pytest.mark.gpu
@pytest.mark.parametrize("tile_tokens", [16, 32, 64, 128])
@pytest.mark.parametrize("n, split", [(256, True), (8064, False), (8192, False)],
                         ids=["split-k", "whole-k-128-rows", "whole-k-256-rows"])
@pytest.mark.parametrize("scale_kind", ["group", "token"])
def test_f16_tiles_units_around_half_a_tile_every_element_on_gpu(rng, device, tile_tokens, n, split, scale_kind):
    """Experts of half a tile, one row more and one less, a whole tile, one row, none, one and a half tiles
    (a whole unit, then half of one) and 3 rows whose token tile runs past the 8 padding rows and M: every f16
    wgmma tile, split-K and not, 128-row blocks (N = 8064) and 256 (N = 8192, the 16- and 32-token tiles).
    Where the f16 kernels give units of at most half a tile less work, it must be exactly those units; every
    element of the routed rows near float64, the padding rows zero (NaN poison). K = 384: a pair of groups
    and an odd last one."""
    if device.platform != "gpu":
        pytest.skip("tile configurations exist on the CUDA handler only")
    sizes = half_tile_sizes(tile_tokens)
    routed = sum(sizes)
    plan = tiling.plan_grouped_gemm(routed + 8, len(sizes), n, 384, tile_tokens=tile_tokens, mma="f16")
    assert (plan.split_k > 1) == split, plan
    _check_bf16_every_element(rng, device, routed + 8, 384, n, sizes, routed, tile_tokens, "f16", scale_kind)


def half_tile_sizes(t):
    """Rows per expert around half a token tile t: t / 2, one more and one less, t, 1, 0, 3 t / 2 (a whole unit,
    then half of one) and 3 (the last, whose tile runs past the padding rows after it)."""
    return [t // 2, t // 2 + 1, t // 2 - 1, t, 1, 0, t + t // 2, 3]


@pytest.mark.gpu
@pytest.mark.parametrize("tile_tokens, mma, kernel", [(8, "f16", None), (16, "e4m3", None), (16, "f16", None),
                                                     (32, "e4m3", None), (32, "f16", None), (64, "e4m3", None),
                                                     (64, "f16", None), (128, "e4m3", None), (128, "f16", None),
                                                     (8, "f16", "decode"), (16, "f16", "decode")])
def test_repeated_calls_every_element_on_gpu(rng, device, tile_tokens, mma, kernel):
    """Same inputs, 16 calls: every element of every call near float64, not just the norm.

    Guards the stage hand-back race (a consumer freeing a stage while its activation-scale loads were
    still in flight): on the H200 it hit 2 to 11 of 16 calls at tile 32 / f16 16, each time one token's
    scale of one K group taken from a later group, a few dozen elements off by up to 50% while the
    norm-wise error stayed near the tolerance.
    """
    if device.platform != "gpu":
        pytest.skip("tile configurations exist on the CUDA handler only")
    m, k, n, sizes = SCENARIOS["decode-even"]
    args = [jax.device_put(a, device) for a in make_case(rng, m, k, n, sizes)]
    ref = np_ref.grouped_gemm(*args)
    bound = 2e-3 * np.abs(ref).max(axis=1, keepdims=True)  # float32 output: typical errors are 1e-5 of it
    fn = functools.partial(ops.w4a8_grouped_gemm, out_dtype=jnp.float32, impl="ffi", tile_tokens=tile_tokens,
                           mma=mma, kernel=kernel)
    jitted = poisoned_jit(fn)
    first = None
    for call in range(16):
        # A fresh NaN-poisoned output every call: from call 1 on the allocator may hand back the previous
        # call's buffer, whose correct values an element the kernel skipped would otherwise keep.
        out = run_poisoned(fn, (m, n), jnp.float32, args, device, jitted=jitted).astype(np.float64)
        bad = np.abs(out - ref) > bound
        assert not bad.any(), f"call {call}: {bad.sum()} elements off, rows {sorted(set(np.nonzero(bad)[0].tolist()))[:8]}"
        if first is None:
            first = out
        # Bitwise the same every call, under a stream-K plan too (partial tiles summed in block order).
        np.testing.assert_array_equal(out, first, err_msg=f"call {call} differs from call 0")


def _assert_rows_close(out, ref):
    """Every element within 2e-3 of its float64 row's largest magnitude (float32 output)."""
    bound = 2e-3 * np.abs(ref).max(axis=1, keepdims=True) + 1e-30
    bad = np.abs(out - ref) > bound
    assert not bad.any(), f"{bad.sum()} elements off, rows {sorted(set(np.nonzero(bad)[0].tolist()))[:8]}"


@pytest.mark.gpu
@pytest.mark.parametrize("tile_tokens, mma, kernel", [(8, "f16", None), (16, "f16", None), (32, "f16", None),
                                                     (64, "f16", None), (128, "f16", None), (16, "e4m3", None),
                                                     (32, "e4m3", None), (128, "e4m3", None), (8, "f16", "decode"),
                                                     (16, "f16", "decode")])
def test_activation_scale_extremes_on_gpu(rng, device, tile_tokens, mma, kernel):
    """Group scales far apart within a token, zero, negative and NaN, on the tensor-core kernels vs float64.

    The f16 path folds each group's scale into its f16 activations as a ratio to the token's largest scale
    and applies that largest scale after the K loop: spreads of 2^-28 (powers of two) and 2^-20 (float32)
    must still match, a token with all scales 0 gives exact zeros (not NaN), and a NaN scale makes its own
    token's row NaN and no other.
    """
    if device.platform != "gpu":
        pytest.skip("tile configurations exist on the CUDA handler only")
    _check_activation_scale_extremes(rng, device, tile_tokens=tile_tokens, mma=mma, kernel=kernel)


def test_activation_scale_extremes_on_cpu(rng):
    """The same scale extremes through the CPU handler (no tile options there)."""
    _check_activation_scale_extremes(rng, jax.devices("cpu")[0])


def _check_activation_scale_extremes(rng, device, **options):
    m, k, n, sizes = 48, 1024, 256, [20, 0, 28]
    x8, x_scale, w, w_scale, gs = make_case(rng, m, k, n, sizes)
    s = np.array(x_scale)  # [m, 8] float32
    s[0] *= np.exp2(-4.0 * np.arange(8))            # 1 .. 2^-28, powers of two
    s[1] = 0.0                                      # the whole token: zeros out
    s[2, 3] = np.nan                                # its row NaN, no other
    s[3, 1] *= -1.0                                 # a negative scale keeps its sign
    s[4] *= np.exp2(rng.uniform(-20, 0, 8))         # float32 ratios
    s[25] *= np.exp2(-4.0 * np.arange(8)[::-1])     # the largest scale in the last group (second expert)
    args = (x8, jnp.asarray(s), w, w_scale, gs)
    fn = functools.partial(ops.w4a8_grouped_gemm, out_dtype=jnp.float32, impl="ffi", **options)
    # A finite poison: NaN would itself pass the NaN row's check; 1e30 fails every check of an unwritten element.
    out = run_poisoned(fn, (m, n), jnp.float32, args, device, fill=1e30)
    ref = np_ref.grouped_gemm(*args)
    assert np.isnan(out[2]).all()
    ok = np.ones(m, bool)
    ok[2] = False
    assert np.isfinite(out[ok]).all()
    assert (out[1] == 0).all()
    _assert_rows_close(out[ok], ref[ok])


@pytest.mark.gpu
@pytest.mark.parametrize("tile_tokens, mma, kernel", [(8, "f16", None), (16, "f16", None), (32, "f16", None),
                                                     (64, "f16", None), (128, "f16", None), (16, "e4m3", None),
                                                     (32, "e4m3", None), (128, "e4m3", None), (8, "f16", "decode"),
                                                     (16, "f16", "decode")])
@pytest.mark.parametrize("n, split", [(256, True), (32768, False)], ids=["split-k", "whole-k"])
def test_zero_and_infinite_activation_scales_on_gpu(rng, device, tile_tokens, mma, kernel, n, split):
    """A token whose scales are all 0 gives exact zeros even where its unscaled sums overflow float32 (codes
    of 448 under weight scales near 1e35: never Inf * 0 = NaN), and a token with an infinite scale gives
    float64's +-Inf in every column (never NaN from Inf / Inf or from 0 * Inf in a split-K piece that misses
    the infinite group, never a silently finite row); the other tokens match float64. Under split-K (256
    columns) and without it (32768 columns).
    """
    if device.platform != "gpu":
        pytest.skip("tile configurations exist on the CUDA handler only")
    plan = tiling.plan_grouped_gemm(40, 2, n, 512, tile_tokens=tile_tokens, mma=mma, kernel=kernel)
    assert (plan.split_k > 1) == split or kernel == "decode"  # the decode kernel splits K within each tile
    _check_zero_and_infinite_activation_scales(rng, device, n, tile_tokens=tile_tokens, mma=mma, kernel=kernel)


@pytest.mark.parametrize("n", [256, 2048])
def test_zero_and_infinite_activation_scales_on_cpu(rng, n):
    """The same zero and infinite scales through the CPU handler (no tile options there)."""
    _check_zero_and_infinite_activation_scales(rng, jax.devices("cpu")[0], n)


def _check_zero_and_infinite_activation_scales(rng, device, n, **options):
    m, k, sizes = 40, 512, [24, 16]
    _, _, w, w_scale, gs = make_case(rng, m, k, n, sizes)
    x = rng.uniform(-1, 1, (m, k)).astype(np.float32)
    x[[3, 30]] = 448.0                                            # second expert too
    x8 = jnp.asarray(x, jnp.float8_e4m3fn)
    s = (rng.uniform(1, 2, (m, k // 128)) * 1e-35).astype(np.float32)
    ws = (rng.uniform(1, 2, np.shape(w_scale)) * 1e35).astype(np.float32)
    s[[3, 30]] = 0.0
    s[7, 2] = -np.inf
    s[33, 0] = np.inf
    args = (x8, jnp.asarray(s), w, jnp.asarray(ws), gs)
    fn = functools.partial(ops.w4a8_grouped_gemm, out_dtype=jnp.float32, impl="ffi", **options)
    # A finite poison: the infinite rows' right values include NaN, which a NaN poison would match unwritten.
    out = run_poisoned(fn, (m, n), jnp.float32, args, device, fill=1e30)
    assert (out[3] == 0).all() and (out[30] == 0).all()
    ref = np_ref.grouped_gemm(*args)
    # +-Inf, or NaN where the infinite group's partial sum is exactly 0 (exact in float32 too: e4m3 x int4
    # products over 128 K need 19 bits); assert_array_equal counts NaN as equal to NaN (never the poison)
    assert not np.isfinite(ref[[7, 33]]).any()
    np.testing.assert_array_equal(out[[7, 33]], ref[[7, 33]])
    ok = np.ones(m, bool)
    ok[[3, 7, 30, 33]] = False
    assert np.isfinite(out[ok]).all()
    _assert_rows_close(out[ok], ref[ok])


def _ue8m0_case(rng, m, k, n, sizes, spread):
    """Activations quantized per token and 128-channel group with power-of-two (UE8M0) scales, each group's
    values multiplied by 2^-u, u uniform in [0, spread), so that a token's scales differ by powers of two."""
    x8, _, w, w_scale, gs = make_case(rng, m, k, n, sizes)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x *= np.repeat(np.exp2(-rng.integers(0, spread + 1, (m, k // 128))), 128, axis=1).astype(np.float32)
    x8, x_scale = quant.quantize_fp8_groups(x, ue8m0=True)
    return [x8, np.array(x_scale), w, w_scale, gs]


def _fold_flag(args, device):
    """Whether the e4m3 128-token call on ``args`` ran unfolded (1) or folded (0): the int the preparation sets
    (hopper_gemm.cu FoldTokenActivations), after the scale planes and the token multipliers in the scratch."""
    x8, x_scale, w, w_scale, gs = [jax.device_put(jnp.asarray(a), device) for a in args]
    x_scale = x_scale.reshape(1) if x_scale.ndim == 0 else x_scale  # the handler takes a per-tensor scale as [1]
    (m, k), (e, n, _) = x8.shape, w.shape
    plan = tiling.plan_grouped_gemm(m, e, n, k, tile_tokens=128, mma="e4m3")
    call = jax.ffi.ffi_call(ops.TARGETS["w4a8_grouped_gemm"],
                            (jax.ShapeDtypeStruct((m, n), jnp.float32),
                             jax.ShapeDtypeStruct((plan.scratch_bytes,), jnp.uint8)))
    _, scratch = jax.jit(lambda *a: call(*a, tile_tokens=np.int32(128), split_k=np.int32(plan.split_k),
                                         mma=np.int32(0), kernel=np.int32(0), experts_per_chunk=np.int32(0),
                                         x_folded=False))(
        x8, x_scale, w, w_scale, gs)
    mp = -(-m // 4) * 4
    at = -(-(k // 128 * mp * 4) // 256) * 256 + mp * 4
    return int(np.asarray(scratch)[at:at + 4].view(np.int32)[0])


@pytest.mark.gpu
@pytest.mark.parametrize("groups", [1, 5, 9, 12, 16, 17, 56, 64, 65])
@pytest.mark.parametrize("scale_kind", ["ue8m0", "tensor"])
def test_folded_activations_any_group_count_on_gpu(rng, device, groups, scale_kind):
    """The preparation writes the folding kernel's activations a warp and eight K groups at a time (hopper_gemm.cu
    StoreFoldedKOrder): K group counts that are not multiples of four or eight, per-group UE8M0 scales (folded codes)
    and one per-tensor scale (the codes only reordered), against the unfolded kernel (e4m3 at 64-token tiles) on the
    same data, where folding is exact, and against float64. 5 experts, 3 padding rows (not read). Per-group scales
    fold a row held in registers up to 16 groups (PrepareFoldHeldKernel<4>) and up to 64 (<16>), past 64 in the loop
    that reads the codes twice (FoldTokenActivations)."""
    if device.platform != "gpu":
        pytest.skip("tile configurations exist on the CUDA handler only")
    m, k, n, sizes = 203, 128 * groups, 136, [70, 0, 57, 1, 72]
    if scale_kind == "ue8m0":
        args = _ue8m0_case(rng, m, k, n, sizes, 6)
        x = np.asarray(args[0].astype(jnp.float32))  # codes at least 2^-3 of their group's largest: exact folding
        args[0] = jnp.asarray(np.where(np.abs(x) < 2.0 ** -3 * 448, np.sign(x) * 56.0, x), jnp.float8_e4m3fn)
    else:  # rows of one magnitude (a per-tensor scale would leave small rows few code levels)
        args = list(make_case(rng, m, k, n, sizes, "tensor"))
        x = rng.standard_normal((m, k)).astype(np.float32)
        args[1] = jnp.asarray(np.abs(x).max() / 448, jnp.float32)
        args[0] = quant.quantize_fp8_tensor(x, args[1])
    fn = functools.partial(ops.w4a8_grouped_gemm, out_dtype=jnp.float32, impl="ffi", mma="e4m3")
    out = run_poisoned(functools.partial(fn, tile_tokens=128), (m, n), jnp.float32, args, device)
    assert _fold_flag(args, device) == 0
    rows = sum(sizes)
    _assert_rows_close(out[:rows], np_ref.grouped_gemm(*args)[:rows])
    base = np.asarray(jax.jit(functools.partial(fn, tile_tokens=64))(*[jax.device_put(jnp.asarray(a), device)
                                                                      for a in args]))
    # UE8M0: the same sums up to float32 order. Per tensor the folding kernel's K order within a group differs from
    # the caller's, and the tensor cores' fp8 sums keep about 14 bits, so the order shows: by up to 1.1e-4 of the
    # sum of the terms' magnitudes (H100, 80 draws), bounded here by 2^-11 of it. (A bound of 3e-4 of the largest
    # output failed once in about 800 draws: one element near the largest, 3.8e-4 of its own value off.) A wrong K
    # order would be off by about the outputs' own size, 1 / sqrt(K) of that sum.
    if scale_kind == "ue8m0":
        atol = 2e-5 * np.abs(base[:rows]).max()
    else:
        atol = 2.0 ** -11 * np_ref.grouped_gemm(*args, absolute=True)[:rows]
    bad = np.abs(out[:rows] - base[:rows]) > atol
    assert not bad.any(), f"{bad.sum()} elements off the 64-token kernel's, first at {np.argwhere(bad)[0]}"


@pytest.mark.gpu
@pytest.mark.parametrize("n, split, k", [(256, True, 512), (8192, False, 512), (256, True, 2560), (256, True, 8448)],
                         ids=["split-k", "whole-k", "split-k-20-groups", "split-k-66-groups"])
def test_folded_activation_scales_on_gpu(rng, device, n, split, k):
    """e4m3 at 128-token tiles folds each token's power-of-two scale ratios into its e4m3 codes and multiplies
    the token's largest scale in after the K loop (hopper_gemm.cu FoldTokenActivations); a call with any token
    it cannot fold runs the unfolded kernel. Every row vs float64 (2e-3 of the row's largest), and against the
    unfolded kernel (e4m3 at 64-token tiles) where folding is exact (scale spreads up to 2^-6, every group's
    codes at least 2^-3 of its largest). Folded: UE8M0 spreads down to 2^-28 (codes into e4m3 subnormals and to
    zero); a group of zero codes under a scale 2^12 above the others (the lift, j = 11, keeps the others' codes
    in e4m3's range; without it they would round to a few subnormals); per-token scales, one negative. Not
    folded (each in a call of its own): float32 ratios in one token, a zero per-token scale. Which kernel ran
    is read from the scratch's flag; padding rows past the routed ones (with zero scales) are not checked. K of
    4 groups and 20 groups (the preparation folds a row held in registers: PrepareFoldHeldKernel<4> and <16>) and
    66 (past 64: FoldTokenActivations' loop).
    """
    if device.platform != "gpu":
        pytest.skip("tile configurations exist on the CUDA handler only")
    m, sizes = 300, [140, 0, 100, 60]
    plan = tiling.plan_grouped_gemm(m, len(sizes), n, k, tile_tokens=128, mma="e4m3")
    assert (plan.split_k > 1) == split
    fn = functools.partial(ops.w4a8_grouped_gemm, out_dtype=jnp.float32, impl="ffi", tile_tokens=128, mma="e4m3")
    unfolded = functools.partial(ops.w4a8_grouped_gemm, out_dtype=jnp.float32, impl="ffi", tile_tokens=64,
                                 mma="e4m3")

    def run(args, folded=True):
        out = run_poisoned(fn, (m, n), jnp.float32, args, device)
        assert np.isfinite(out).all()
        _assert_rows_close(out, np_ref.grouped_gemm(*args))
        assert _fold_flag(args, device) == (0 if folded else 1)
        return out

    # exact folding: the same sums as the unfolded kernel, up to float32 order
    args = _ue8m0_case(rng, m, k, n, sizes, 6)
    x = np.asarray(args[0].astype(jnp.float32))
    args[0] = jnp.asarray(np.where(np.abs(x) < 2.0 ** -3 * 448, np.sign(x) * 56.0, x), jnp.float8_e4m3fn)
    out = run(args)
    base = np.asarray(jax.jit(unfolded)(*[jax.device_put(a, device) for a in args]))
    np.testing.assert_allclose(out, base, rtol=0, atol=2e-5 * np.abs(base).max())
    # float32 group scales that are powers of two, some negative and one -0.0: folded (the ratio's sign and zero
    # come from the scale's bits, hopper_gemm.cu FoldChunk)
    signed = np.array(args[1], np.float32)
    signed[::7, 1] *= -1.0
    signed[5, 2] = -0.0
    run([args[0], jnp.asarray(signed)] + list(args[2:]))

    spread = _ue8m0_case(rng, m, k, n, sizes, 28)
    run(spread)
    x = np.array(spread[0].astype(jnp.float32))
    s = spread[1].copy()

    def top_code(r):  # the largest code of token r's largest-scale group past group 0
        g = 1 + int(np.argmax(s[r, 1:]))
        return np.abs(x[r, 128 * g:128 * (g + 1)]).max()

    # a token whose groups past 0 are not all at the quantizer's scale floor with tiny codes (spread 28 puts
    # them there now and then: the lift would exceed 2^15, and the token is rightly not folded)
    r = next(r for r in range(m) if top_code(r) >= 224)
    x[r, :128] = 0.0
    s[r, 0] = s[r, 1:].max() * 2.0 ** 12
    run([jnp.asarray(x, jnp.float8_e4m3fn), jnp.asarray(s)] + spread[2:])
    s = spread[1].copy()
    s[130] *= rng.uniform(0.5, 1.5, s.shape[1]).astype(np.float32)
    run([spread[0], jnp.asarray(s)] + spread[2:], folded=False)
    s = spread[1].copy()
    s[40] = 0.0  # a token with all scales 0: folded (its codes to 0)
    run([spread[0], jnp.asarray(s)] + spread[2:])
    padded = list(spread)
    padded[4] = jnp.asarray([140, 0, 100, 40], jnp.int32)  # 20 padding rows, their scales 0 and float32
    s = spread[1].copy()
    s[285:] = 0.0
    s[281:285] *= rng.uniform(0.5, 1.5, (4, s.shape[1])).astype(np.float32)
    padded[1] = jnp.asarray(s)
    out = run(padded)
    assert (out[280:] == 0).all()

    x8, _, w, w_scale, gs = make_case(rng, m, k, n, sizes, "token")
    st = np.exp2(rng.integers(-8, 8, m)).astype(np.float32) * rng.uniform(1, 2, m).astype(np.float32)
    st[170] *= -1.0
    run((x8, jnp.asarray(st), w, w_scale, gs))
    st[171] = 0.0
    run((x8, jnp.asarray(st), w, w_scale, gs), folded=False)


@pytest.mark.gpu
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("tile_tokens", [16, 32, 64, 128])
@pytest.mark.parametrize("mma", ["e4m3", "f16"])
def test_both_mma_formats_on_gpu(rng, device, scenario, tile_tokens, mma):
    """Both tensor-core operand formats for int4 weights at the wgmma token tiles vs float64."""
    if device.platform != "gpu":
        pytest.skip("the MMA formats exist on the CUDA handler only")
    _check_scenario_on_gpu(rng, device, scenario, tile_tokens=tile_tokens, mma=mma)


def test_mma_option_is_checked(rng):
    a = _good(rng)
    with pytest.raises(ValueError, match="'mma'"):
        ops.w4a8_grouped_gemm(**a, mma="int8")
    with pytest.raises(ValueError, match="'mma'"):  # the plain CUDA-core kernel has no MMA
        ops.w4a8_grouped_gemm(**a, mma="f16", tile_tokens=0)
    with pytest.raises(ValueError, match="'tile_tokens'=8"):  # the 8-token tile exists for the f16 MMA only
        ops.w4a8_grouped_gemm(**a, mma="e4m3", tile_tokens=8)


# ------------------------------------------------------------------------------------ CUTLASS path
def _need_cutlass_gpu(device):
    if device.platform != "gpu":
        pytest.skip("the CUTLASS path exists on the CUDA handler only")
    from jax_w4a8 import _ffi
    if not _ffi.built_with_cutlass():
        pytest.skip("built without CUTLASS")


CUTLASS_CASES = dict(SCENARIOS, **{
    "hostile": (37, 128, 40, [2**31 - 1, -2**31, 7]),
    "multi-tile": (1500, 1024, 520, [700, 0, 1, 129, 300, 0, 250]),  # partial M and N tiles, one-row expert
})


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [None, 1, 2])
@pytest.mark.parametrize("scenario", sorted(CUTLASS_CASES))
def test_cutlass_kernel_on_gpu(rng, device, scenario, chunk, monkeypatch):
    """kernel='cutlass' (int4 weights converted to e4m3, CUTLASS's grouped FP8 GEMM): every scale encoding,
    every element near float64 (the output is poisoned), padding rows 0, no worse than this library's
    128-token kernel on the same data, two calls bitwise equal; chunk = experts per weight conversion
    (None: the plan's, usually all)."""
    _need_cutlass_gpu(device)
    from jax_w4a8 import tiling
    m, k, n, sizes = CUTLASS_CASES[scenario]
    if chunk is not None:
        monkeypatch.setattr(tiling, "CUTLASS_WEIGHT_SCRATCH_BYTES", chunk * n * k)
        assert tiling.plan_grouped_gemm(m, len(sizes), n, k, kernel="cutlass").experts_per_chunk == min(chunk, len(sizes))
    for scale_kind, w_scale_dtype in (("group", jnp.float32), ("token", jnp.bfloat16), ("tensor", jnp.float32)):
        args = make_case(rng, m, k, n, sizes, scale_kind, w_scale_dtype)
        fn = functools.partial(ops.w4a8_grouped_gemm, impl="ffi", kernel="cutlass")
        out = run_poisoned(fn, (m, n), jnp.bfloat16, args, device)
        ref = check(args, out, jnp.bfloat16)
        bad = ~(np.abs(out - ref) <= 8e-3 * np.abs(ref).max(axis=-1, keepdims=True))
        assert not bad.any(), f"{scale_kind}: {bad.sum()} elements off"
        covered = min(sum(max(s, 0) for s in sizes), m)
        assert (out[covered:] == 0).all()
        native = functools.partial(ops.w4a8_grouped_gemm, impl="ffi", kernel="native", tile_tokens=128)
        other = run_poisoned(native, (m, n), jnp.bfloat16, args, device)
        assert np.abs(out - ref).max() <= 2 * np.abs(other - ref).max() + 1e-30
        np.testing.assert_array_equal(run_poisoned(fn, (m, n), jnp.bfloat16, args, device), out)


@pytest.mark.gpu
def test_cutlass_fp16_overflow_regression(device):
    """sglang issue 8493 through the CUTLASS path: outputs far beyond 65504 come back finite and right."""
    _need_cutlass_gpu(device)
    m, k, n = 8, 256, 16
    q = np.full((2, n, k), 7, np.int8)
    q[1, ::2] = -8
    args = (jnp.full((m, k), 448.0, jnp.float8_e4m3fn), jnp.full((m, k // 128), 2.0, jnp.float32), quant.pack_int4(q),
            jnp.full((2, n, k // 128), 0.5, jnp.float32), jnp.array([4, 4], jnp.int32))
    fn = functools.partial(ops.w4a8_grouped_gemm, impl="ffi", kernel="cutlass")
    out = run_poisoned(fn, (m, n), jnp.bfloat16, args, device)
    ref = check(args, out, jnp.bfloat16)
    assert np.abs(ref).max() > 65504 * 10 and np.isfinite(out).all()


@pytest.mark.gpu
def test_prefill_plan_takes_cutlass_on_gpu(rng, device):
    """The default plan at prefill (>= CUTLASS_GROUPED_MIN_ROWS rows per expert) is the CUTLASS path, and
    group sizes change without recompiling."""
    _need_cutlass_gpu(device)
    from jax_w4a8 import tiling
    m, k, n, e = 2560, 512, 256, 4
    assert tiling.plan_grouped_gemm(m, e, n, k).kernel == "cutlass"
    args = list(make_case(rng, m, k, n, [640] * e))
    args = [jax.device_put(a, device) for a in args]
    fn = functools.partial(ops.w4a8_grouped_gemm, impl="ffi")
    f = poisoned_jit(fn)
    for sizes in ([640] * e, [2560, 0, 0, 0], [0, 2500, 3, 0]):
        args[4] = jax.device_put(jnp.asarray(sizes, jnp.int32), device)
        out = run_poisoned(fn, (m, n), jnp.bfloat16, args, device, jitted=f)
        check(args, out, jnp.bfloat16)
        covered = min(sum(sizes), m)
        assert (out[covered:] == 0).all()
    assert f._cache_size() == 1


def test_cutlass_option_is_checked(rng):
    a = _good(rng)
    with pytest.raises(ValueError, match="'kernel'"):
        ops.w4a8_grouped_gemm(**a, kernel="triton")
    with pytest.raises(ValueError, match="'kernel'='cutlass'"):
        ops.w4a8_grouped_gemm(**a, kernel="cutlass", out_dtype=jnp.float32)
    with pytest.raises(ValueError, match="'tile_tokens'"):
        ops.w4a8_grouped_gemm(**a, kernel="cutlass", tile_tokens=128)


def test_group_sizes_as_a_list_of_traced_scalars(rng):
    """A list of traced sizes (jit arguments) is stacked as jnp.asarray would (the range check of lists once
    converted them with NumPy and failed with TracerArrayConversionError)."""
    a = _good(rng)
    f = jax.jit(lambda s0, s1: ops.w4a8_grouped_gemm(**{**a, "group_sizes": [s0, s1]}))
    out = f(jnp.int32(8), jnp.int32(8))
    want = ops.w4a8_grouped_gemm(**{**a, "group_sizes": jnp.asarray([8, 8], jnp.int32)})
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))


def test_python_lists_and_floats_with_x64():
    """With jax_enable_x64 a Python list of sizes and a Python float scale (documented as accepted) would become
    int64 / float64 and be refused; they are converted to int32 / float32 as with x64 off (a subprocess: x64 is
    process-wide)."""
    code = """
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_enable_x64", True)
from jax_w4a8 import ops, quant
rng = np.random.default_rng(0)
x8, _ = quant.quantize_fp8_groups(rng.standard_normal((16, 128)).astype(np.float32))
w, ws = quant.quantize_w4(rng.standard_normal((2, 8, 128)).astype(np.float32))
out = ops.w4a8_grouped_gemm(x8, 0.5, w, ws, [8, 8])
want = ops.w4a8_grouped_gemm(x8, jnp.float32(0.5), w, ws, jnp.asarray([8, 8], jnp.int32))
assert out.dtype == jnp.bfloat16 and (np.asarray(out, np.float32) == np.asarray(want, np.float32)).all()
w13, s13 = quant.quantize_w4(rng.standard_normal((2, 256, 128)).astype(np.float32))
h8, s = ops.w4a8_moe_up(x8, 0.5, w13, s13, [8, 8])
assert h8.shape == (16, 128) and s.dtype == jnp.float32
print("ok")
"""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-2000:]



@pytest.mark.gpu
def test_simple_kernel_refuses_more_column_tiles_than_its_grid(device):
    """The CUDA-core kernel (tile_tokens=0) has one grid row per 64 columns, at most 65535: past that the handler
    names the limit (the launch failed with "invalid configuration argument")."""
    if device.platform != "gpu":
        pytest.skip("the CUDA simple kernel")
    n = 65535 * 64 + 64
    x8 = jnp.zeros((1, 128), jnp.float8_e4m3fn)
    w = jnp.zeros((1, n, 64), jnp.int8)
    ws = jnp.ones((1, n, 1), jnp.float32)
    with pytest.raises(Exception, match="at most 65535 column tiles"):
        jax.block_until_ready(ops.w4a8_grouped_gemm(x8, jnp.float32(1.0), w, ws, jnp.asarray([1], jnp.int32),
                                                    tile_tokens=0, impl="ffi"))


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["plan", "decode", "cutlass"])
def test_first_call_inside_a_command_buffer_on_gpu(rng, kernel):
    """Four chained grouped GEMMs (8 experts, 248 rows and 8 padding rows) in one jitted program that XLA records
    as a command buffer, in a fresh process: the kernel's first call of the process is recorded into the graph;
    the sum is near float64."""
    from jax_w4a8 import _ffi
    if kernel == "cutlass" and not _ffi.built_with_cutlass():
        pytest.skip("built without CUTLASS")
    got = run_in_command_buffer("grouped_gemm", kernel, int(rng.integers(1 << 30)))
    assert got["finite"] and got["rel_err"] <= BF16_TOL, got


@pytest.mark.parametrize("m, k, n, sizes", [
    (203, 896, 136, [70, 0, 57, 1, 72]),   # 3 padding rows, an empty expert
    (300, 512, 256, [140, 0, 100, 60]),     # the plan splits K (stream-K)
    (64, 2048, 8192, [30, 34]),             # wide N
    (1, 256, 40, [1, 0]),                   # one token (its multiplier passed as [1])
    (37, 128, 40, [-5, 2**31 - 1, 7]),      # hostile group sizes: clamped, the rest padding
])
def test_folded_layout_matches_float64(rng, device, m, k, n, sizes):
    """x_layout="folded": activations quantized with layout="folded" (codes in the folded K order, one multiplier
    per token) against float64 on the standard codes and UE8M0 scales of the same activations; on the GPU, bit
    for bit the standard layout's result at the same 128-token e4m3 tiles (whose preparation folds them the same
    way), and its padding rows exactly zero."""
    x8, _, w, w_scale, gs = make_case(rng, m, k, n, sizes)
    x = (rng.standard_normal((m, k)) * np.repeat(np.exp2(rng.integers(-8, 8, (m, k // 128))), 128, 1))
    x = jnp.asarray(x, jnp.bfloat16)
    codes, scales = ops.quantize_fp8_groups(x, ue8m0=True)
    folded, token = ops.quantize_fp8_groups(x, ue8m0=True, layout="folded")
    fn = functools.partial(ops.w4a8_grouped_gemm, out_dtype=jnp.float32, impl="ffi", x_layout="folded")
    out = run_poisoned(fn, (m, n), jnp.float32, (folded, token, w, w_scale, gs), device)
    ref = np_ref.grouped_gemm(codes, scales, w, w_scale, gs)
    rows = min(sum(max(s, 0) for s in sizes), m)
    _assert_rows_close(out[:rows], ref[:rows])
    assert (out[rows:] == 0).all(), "padding rows must be exactly zero"
    if device.platform == "gpu":
        std = functools.partial(ops.w4a8_grouped_gemm, out_dtype=jnp.float32, impl="ffi", tile_tokens=128,
                                mma="e4m3")
        base = run_poisoned(std, (m, n), jnp.float32, (codes, scales, w, w_scale, gs), device)
        np.testing.assert_array_equal(out, base)


def test_folded_layout_errors(rng):
    x8, x_scale, w, w_scale, gs = make_case(rng, 8, 256, 16, [4, 4])
    folded, token = quant.fold_fp8_groups(*quant.quantize_fp8_groups(np.ones((8, 256), np.float32), ue8m0=True))
    with pytest.raises(ValueError, match="'x_scale'"):
        ops.w4a8_grouped_gemm(folded, x_scale, w, w_scale, gs, x_layout="folded")
    for kw in ({"tile_tokens": 64}, {"mma": "f16"}, {"kernel": "cutlass"}, {"kernel": "decode"}):
        with pytest.raises(ValueError, match="'x_layout'"):
            ops.w4a8_grouped_gemm(folded, token, w, w_scale, gs, x_layout="folded", **kw)
    with pytest.raises(ValueError, match="'x_layout'"):
        ops.w4a8_grouped_gemm(folded, token, w, w_scale, gs, x_layout="rows")
    # a scalar multiplier is every token's; the reference reads the folded K order too
    a = ops.w4a8_grouped_gemm(folded, jnp.float32(0.5), w, w_scale, gs, x_layout="folded", out_dtype=jnp.float32)
    b = ops.w4a8_grouped_gemm(folded, jnp.full((8,), 0.5), w, w_scale, gs, x_layout="folded", out_dtype=jnp.float32,
                              impl="reference")
    # float32 sums in another order: within 1e-6 of the largest output (a near-cancelled one is not 1e-6 of itself)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6 * np.abs(np.asarray(b)).max())
