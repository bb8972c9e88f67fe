"""Public ops: validate at trace time, then run the XLA FFI custom call or the jnp reference.

Every op takes ``impl``:

* ``"auto"`` (default): the FFI handler of the platform the computation is lowered for when it is
  built (see :func:`jax_w4a8.ffi_available`), the reference otherwise.
* ``"ffi"``: always the custom call (XLA reports an error at compile time if the platform has none).
* ``"reference"``: the plain-``jnp`` oracle of :mod:`jax_w4a8.reference`.

Outputs are bfloat16 or float32, never float16 (a W4A8 GEMM's outputs can exceed 65504; sglang
issue 8493).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np

from jax_w4a8 import quant, reference, tiling
from jax_w4a8._ffi import TARGETS, ffi_available

__all__ = ["w4a8_grouped_gemm", "w4a8_moe_up", "fp8_einsum", "pack_ue8m0", "quantize_fp8_groups",
           "silu_mul_quantize_fp8_groups"]

_IMPLS = ("auto", "ffi", "reference")
# Activation layouts: "standard" (codes in the caller's K order with their scales) or "folded" (each token's UE8M0
# group scales folded into its codes, in the K order of the grouped GEMM's 128-token kernel, one float32
# multiplier per token: jax_w4a8.quant.fold_fp8_groups). The grouped GEMM reads folded activations without its
# preparation pass (a tenth of a prefill call's time).
LAYOUTS = ("standard", "folded")
_SCALE_CODE_DTYPES = (jnp.dtype(jnp.uint8), jnp.dtype(jnp.float8_e8m0fnu))


# ----------------------------------------------------------------------------------------------
# validation helpers
# ----------------------------------------------------------------------------------------------
def _fail(op: str, arg: str, msg: str, exc=ValueError):
    raise exc(f"{op}: argument '{arg}' {msg}")


def _check_dtype(op, arg, a, allowed):
    allowed = tuple(jnp.dtype(d) for d in allowed)
    if a.dtype not in allowed:
        names = " or ".join(str(d) for d in allowed)
        _fail(op, arg, f"must have dtype {names}, got {a.dtype}", TypeError)


def _check_shape(op, arg, a, expected, what):
    if tuple(a.shape) != tuple(expected):
        _fail(op, arg, f"must have shape {tuple(expected)} ({what}), got {tuple(a.shape)}")


def _group_sizes_array(op, group_sizes):
    """``group_sizes`` as a JAX array, refused (naming it) where ``jnp.asarray`` would change its values.

    An array of another integer width (NumPy's default int64, np.bincount's output) is refused before
    ``jnp.asarray`` narrows it to int32, which would wrap sizes past 2**31 silently (x64 off). A list or tuple
    (no dtype of its own) must hold values that fit int32 and not be ragged; it becomes int32 (with x64 on
    too). A list of traced scalars is stacked as it is (its dtype checked by the caller)."""
    dt = getattr(group_sizes, "dtype", None)
    if dt is None and isinstance(group_sizes, (list, tuple)):  # which jnp.asarray would overflow on or wrap
        if any(isinstance(v, jax.core.Tracer) for v in group_sizes):
            return jnp.asarray(group_sizes)
        try:
            a = np.asarray(group_sizes)
        except ValueError as exc:  # ragged
            _fail(op, "group_sizes", f"must be a 1-D int32 array [E], got a ragged list ({exc})")
        if a.dtype == object:      # Python ints past int64
            vals = [int(v) for v in a.ravel() if isinstance(v, (int, np.integer))]
        else:                      # (floats: a list past int64's range, or float sizes, refused below)
            vals = a.ravel().tolist() if a.dtype.kind in "iuf" else []
        bad = [v for v in vals if not -2**31 <= v < 2**31]
        if bad:
            _fail(op, "group_sizes", f"must hold int32 values (each in [-2**31, 2**31)), got {bad[0]}")
        return jnp.asarray(a, jnp.int32) if a.dtype.kind in "iu" else jnp.asarray(group_sizes)
    if dt is not None and jnp.dtype(dt) != jnp.int32:
        _fail(op, "group_sizes", f"must have dtype int32, got {jnp.dtype(dt)} (convert with .astype(int32) "
              "after checking the sizes fit)", TypeError)
    return jnp.asarray(group_sizes)


def _python_scalar_as_f32(v):
    """A Python float (or int) scale as float32, as with x64 off (x64 on would make it float64, refused)."""
    return np.float32(v) if isinstance(v, (float, int)) and not isinstance(v, bool) else v


def _check_out_dtype(op, out_dtype):
    try:
        dt = jnp.dtype(out_dtype) if out_dtype is not None else None
    except TypeError:
        dt = None
    if dt is None:
        _fail(op, "out_dtype", f"must be bfloat16 or float32, got {out_dtype!r}")
    if dt == jnp.float16:
        _fail(op, "out_dtype", "must be bfloat16 or float32; float16 is refused because W4A8/FP8 "
              "GEMM outputs can exceed 65504 and overflow to Inf (sglang issue 8493)")
    if dt not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        _fail(op, "out_dtype", f"must be bfloat16 or float32, got {dt}")
    return dt


def _check_flag(op, arg, value) -> bool:
    """A static bool option (Python or NumPy bool; not a traced value, not a string)."""
    if not isinstance(value, (bool, np.bool_)):
        _fail(op, arg, f"must be True or False (a static option), got {value!r}", TypeError)
    return bool(value)


def _check_layout(op, arg, layout, ue8m0=True):
    if layout not in LAYOUTS:
        _fail(op, arg, f"must be one of {LAYOUTS}, got {layout!r}")
    if layout == "folded" and not ue8m0:
        _fail(op, "ue8m0", f"must be True with {arg}='folded' (only power-of-two scales fold exactly)")
    return layout


def _check_impl(op, impl):
    if impl not in _IMPLS:
        _fail(op, "impl", f"must be one of {_IMPLS}, got {impl!r}")


def _is_concrete(a) -> bool:
    return not isinstance(a, jax.core.Tracer)


def _dispatch(impl, cpu_fn, cuda_fn, ref_fn, *args, default=None):
    """Runs the CPU or CUDA custom call, or the reference, by ``impl`` and the lowering platform.

    ``default`` serves platforms without handlers of ours (the reference unless given).
    """
    if impl == "reference":
        return ref_fn(*args)
    ffi = impl == "ffi"
    if ffi:  # other platforms get the custom call too, so XLA refuses it there at compile time
        default = cpu_fn
    return jax.lax.platform_dependent(
        *args,
        cpu=cpu_fn if ffi or ffi_available("cpu") else ref_fn,
        cuda=cuda_fn if ffi or ffi_available("cuda") else ref_fn,
        default=default or ref_fn,
    )


# ----------------------------------------------------------------------------------------------
# W4A8 grouped GEMM
# ----------------------------------------------------------------------------------------------
def w4a8_grouped_gemm(x, x_scale, w, w_scale, group_sizes, *, out_dtype=jnp.bfloat16, impl="auto",
                      rows_per_expert=None, tile_tokens=None, mma=None, kernel=None, x_layout="standard"):
    """MoE grouped GEMM with int4 weights and fp8 activations (SPEC 4.1).

    ``out[m, n] = sum_g sa(m, g) * sw(e(m), n, g) * sum_{k in g} x[m, k] * q[e(m), n, k]`` in float32,
    rounded once to ``out_dtype``. Rows are sorted by expert: expert ``e`` owns the ``group_sizes[e]``
    rows after those of expert ``e - 1``.

    Args:
      x: float8_e4m3fn [M, K], K a multiple of 128.
      x_scale: float32 activation dequant scale: a scalar (per tensor), [M] (per token) or
        [M, K // 128] (per token and 128-channel group).
      w: int8 (or uint8) packed int4 weights [E, N, K // 2] (see :func:`jax_w4a8.quant.pack_int4`).
      w_scale: float32 or bfloat16 [E, N, K // 128] weight dequant scales. Scales are not scanned (that would
        need a host sync): a NaN or infinite scale makes the outputs it multiplies NaN or Inf, as IEEE float32
        does; subnormal scales are applied as IEEE float32 on the CPU and CUDA handlers.
      group_sizes: int32 [E] rows per expert, device data (a Python list of ints is checked to fit int32).
        Negative entries count as 0 and the running total is cut at M: no row outside [0, M) is ever touched.
        Rows at or past the (clamped) total are padding and come back as 0.
      out_dtype: bfloat16 (default) or float32; float16 is refused.
      impl: "auto", "ffi" or "reference" (module docstring).
      rows_per_expert: optional hint of the expected rows per expert (default M / E) for the CUDA
        tile choice, where M counts padding rows too (expert parallelism: a device's buffer has room for every
        routed row); the plan is then that of E * rows_per_expert rows routed uniformly;
        tile_tokens: force a token tile (8 (f16 MMA only), 16, 32, 64, 128, or 0 for the
        plain CUDA-core kernel); mma: force the tensor-core operand format, "e4m3" or "f16" (any
        token tile but 0; the plan takes f16 up to 64-token tiles);
        kernel: None (the plan chooses), "native" (this library's kernels) or "cutlass" (prefill: the
        int4 weights of experts with rows converted to e4m3 once per call, exactly, then CUTLASS's
        grouped FP8 GEMM with per-row scales; bfloat16 output, N a multiple of 8; its scratch holds up
        to ``tiling.CUTLASS_WEIGHT_SCRATCH_BYTES`` of converted weights at a time) or "decode" (a few
        rows per expert: runs of at most ``tile_tokens`` = 8 or 16 rows of one expert (None: the plan
        picks) found from ``group_sizes`` on the device, warp-level f16 MMAs on weights read straight
        from memory, one launch and no scratch; at most 65535 such runs for any ``group_sizes``, i.e.
        M + (tile_tokens - 1) min(E, M) <= 65535 tile_tokens).
        See :mod:`jax_w4a8.tiling`. None of these changes the result beyond float32 summation order
        (and, on the f16 MMA with float32 group scales that are not powers of two, one more rounding
        of each activation, 2^-11 relative: the group's scale is folded into its f16 activations; on
        the e4m3 MMA at 128-token tiles, where every token's group scales differ by powers of two
        (UE8M0; per-token and per-tensor scales), the scale ratios are folded into the e4m3 codes: an
        activation they put below e4m3's smallest normal rounds to a multiple of 2^-9, moving it by
        less than 2^-16.8 of its token's largest |x * scale|; calls with other scales run unfolded. The
        folded and f16 paths sum the weight-scaled products before the activation scales: weight scales
        beyond about 1e30 could overflow float32 there where the unfolded sum would not).
      x_layout: "standard" (the default: ``x`` in the caller's K order with any ``x_scale`` above) or "folded":
        ``x`` in the folded K order with the token multipliers as ``x_scale`` ([M], or a scalar), as
        :func:`quantize_fp8_groups` / :func:`silu_mul_quantize_fp8_groups` write them with
        ``layout="folded"`` (:func:`jax_w4a8.quant.fold_fp8_groups`). Runs the 128-token e4m3 kernel (leave
        ``tile_tokens`` / ``mma`` / ``kernel`` None or 128 / "e4m3" / "native") without its preparation
        pass, whatever M is: meant for prefill, where the plan takes that kernel anyway
        (:func:`jax_w4a8.tiling.grouped_gemm_layout` says which layout a call's shapes take). The result is the
        one the standard layout's codes and UE8M0 group scales give at those tiles, bit for bit (except for a
        call whose activations hold an infinite value: the standard layout then runs unfolded, while the folded
        quantizer folds that token's other groups to zero under its 2**127 scale).
    Returns:
      out_dtype [M, N].
    Raises:
      TypeError / ValueError naming the argument, at trace time, before any kernel runs; for ``kernel``:
      an unknown value, or "cutlass" together with ``tile_tokens`` / ``mma``, float32 output, N not a
      multiple of 8, a library built without CUTLASS or a GPU other than sm_90; "decode" with a
      ``tile_tokens`` other than 8 or 16, ``mma`` other than "f16", or more rows than its grid provides for.
    """
    op = "w4a8_grouped_gemm"
    _check_impl(op, impl)
    x_layout = _check_layout(op, "x_layout", x_layout)
    out_dtype = _check_out_dtype(op, out_dtype)
    group_sizes = _group_sizes_array(op, group_sizes)
    x, x_scale, w, w_scale = map(jnp.asarray, (x, _python_scalar_as_f32(x_scale), w, w_scale))
    _check_dtype(op, "x", x, [jnp.float8_e4m3fn])
    if x.ndim != 2:
        _fail(op, "x", f"must be 2-D [M, K], got shape {x.shape}")
    m, k = x.shape
    if k == 0 or k % 128:
        _fail(op, "x", f"must have K (its last axis) a positive multiple of 128, got K={k}")
    _check_dtype(op, "w", w, [jnp.int8, jnp.uint8])
    if w.ndim != 3:
        _fail(op, "w", f"must be 3-D packed int4 [E, N, K/2], got shape {w.shape}")
    e, n, half_k = w.shape
    if half_k * 2 != k:
        _fail(op, "w", f"must have last axis K/2 = {k // 2} to match x (K={k}), got {half_k}")
    if e == 0 or n == 0:
        _fail(op, "w", f"must have at least one expert and one output column, got shape {w.shape}")
    _check_dtype(op, "w_scale", w_scale, [jnp.float32, jnp.bfloat16])
    _check_shape(op, "w_scale", w_scale, (e, n, k // 128), "[E, N, K/128]")
    _check_dtype(op, "group_sizes", group_sizes, [jnp.int32])
    _check_shape(op, "group_sizes", group_sizes, (e,), "[E], one entry per expert of w")
    _check_dtype(op, "x_scale", x_scale, [jnp.float32])
    folded = x_layout == "folded"
    if folded:
        if x_scale.size == 1 and x_scale.ndim <= 1:
            x_scale = jnp.broadcast_to(x_scale.reshape(()), (m,))
        elif x_scale.shape != (m,):
            _fail(op, "x_scale", f"must be the token multipliers [M]={(m,)} (or a scalar) with x_layout='folded', "
                  f"got shape {x_scale.shape}")
        if tile_tokens not in (None, 128) or mma not in (None, "e4m3") or kernel not in (None, "native"):
            _fail(op, "x_layout", "'folded' runs the native kernel's 128-token e4m3 tiles: leave 'tile_tokens', "
                  f"'mma' and 'kernel' None (or 128, 'e4m3', 'native'), got {tile_tokens!r}, {mma!r}, {kernel!r}")
        tile_tokens, mma, kernel = 128, "e4m3", "native"
    elif x_scale.size == 1 and x_scale.ndim <= 1:
        x_scale = x_scale.reshape(1)
    elif x_scale.shape not in ((m,), (m, k // 128)):
        _fail(op, "x_scale", f"must be a scalar, [M]={(m,)} or [M, K/128]={(m, k // 128)}, "
              f"got shape {x_scale.shape}")

    try:
        plan = tiling.plan_grouped_gemm(m, e, n, k, rows_per_expert=rows_per_expert, tile_tokens=tile_tokens,
                                        mma=mma, kernel=kernel, out_bf16=out_dtype == jnp.bfloat16,
                                        x_folded=folded)
    except ValueError as exc:
        raise ValueError(f"{op}: {exc}") from None
    out_type = jax.ShapeDtypeStruct((m, n), out_dtype)

    def cpu_fn(x, *args):  # the CPU handler reads the standard K order
        x = quant.from_folded_k_order(x) if folded else x
        return jax.ffi.ffi_call(TARGETS["w4a8_grouped_gemm"], out_type, vmap_method="sequential")(x, *args)

    def cuda_fn(*args):
        call = jax.ffi.ffi_call(TARGETS["w4a8_grouped_gemm"],
                                (out_type, jax.ShapeDtypeStruct((plan.scratch_bytes,), jnp.uint8)),
                                vmap_method="sequential")
        return call(*args, tile_tokens=np.int32(plan.tile_tokens), split_k=np.int32(plan.split_k),
                    mma=np.int32(tiling.MMAS.index(plan.mma)),
                    kernel=np.int32(tiling.GROUPED_KERNELS.index(plan.kernel)),
                    experts_per_chunk=np.int32(plan.experts_per_chunk), x_folded=folded)[0]

    def ref_fn(x, *args):
        x = quant.from_folded_k_order(x) if folded else x
        return reference.w4a8_grouped_gemm(x, *args, out_dtype=out_dtype)

    return _dispatch(impl, cpu_fn, cuda_fn, ref_fn, x, x_scale, w, w_scale, group_sizes)


# ----------------------------------------------------------------------------------------------
# UE8M0 scale packing
# ----------------------------------------------------------------------------------------------
def _raise_if_inexact(ok, arg):
    ok = np.asarray(ok)
    if not ok.all():
        bad = int(np.size(ok) - np.count_nonzero(ok))
        raise ValueError(f"pack_ue8m0: argument '{arg}' is declared UE8M0 but {bad} value(s) are not "
                         "positive powers of two in [2**-126, 2**127] (sign or mantissa bits set); "
                         "round with jax_w4a8.quant.ceil_to_ue8m0 *before* quantizing")


def pack_ue8m0(scale, *, arg: str = "scale", impl="auto"):
    """float32 scales that must be exact powers of two -> uint8 UE8M0 codes (masked exponent bytes).

    A value with its sign or any mantissa bit set, zero, a subnormal, Inf or NaN is an error, never a
    NaN code: eagerly a ``ValueError`` naming ``arg``; under ``jit`` the handler (or, on the
    reference path, a host callback) fails the computation with the same message.

    Args:
      scale: float32, any shape.
    Returns:
      uint8, same shape.
    """
    op = "pack_ue8m0"
    _check_impl(op, impl)
    if not isinstance(arg, str) or not arg:
        _fail(op, "arg", f"must be a non-empty str (the scale's name in error messages), got {arg!r}", TypeError)
    with jax.ensure_compile_time_eval():  # NumPy input stays concrete under jit (checked eagerly below)
        scale = jnp.asarray(scale)
    _check_dtype(op, arg, scale, [jnp.float32])
    if _is_concrete(scale):  # also a constant captured by jit: checked and encoded now, not traced
        with jax.ensure_compile_time_eval():
            _raise_if_inexact(quant.is_ue8m0_exact(scale), arg)
            return quant.encode_ue8m0(scale)

    def ffi_fn(s):
        return jax.ffi.ffi_call(TARGETS["ue8m0_pack"], jax.ShapeDtypeStruct(s.shape, jnp.uint8),
                                vmap_method="broadcast_all")(s, arg=arg)

    def ref_fn(s):
        jax.debug.callback(functools.partial(_raise_if_inexact, arg=arg), quant.is_ue8m0_exact(s))
        return quant.encode_ue8m0(s)

    # Other platforms (no handlers) encode without the check: a host callback there would make every
    # computation using this op effectful.
    return _dispatch(impl, ffi_fn, ffi_fn, ref_fn, scale, default=quant.encode_ue8m0)


# ----------------------------------------------------------------------------------------------
# FP8 block-scaled einsum
# ----------------------------------------------------------------------------------------------
_EQ = re.compile(r"^\s*([a-zA-Z]+)\s*,\s*([a-zA-Z]+)\s*->\s*([a-zA-Z]+)\s*$")


def _parse_equation(equation: str) -> int:
    """Returns 2 for the ``md,nd->mn`` structure and 3 for ``bhr,hdr->bhd`` (any letters)."""
    match = _EQ.match(equation) if isinstance(equation, str) else None
    if match:
        a, b, c = match.groups()
        distinct = len(set(a + b)) == len(a + b) - (1 if len(a) == 2 else 2)
        if len(a) == len(b) == len(c) == 2 and distinct and a[1] == b[1] and c == a[0] + b[0]:
            return 2
        if (len(a) == len(b) == len(c) == 3 and distinct and a[1] == b[0] and a[2] == b[2]
                and c == a[0] + a[1] + b[1]):
            return 3
    raise ValueError(f"fp8_einsum: argument 'equation' must have the structure 'md,nd->mn' (a linear "
                     f"layer) or 'bhr,hdr->bhd' (per-head batched; 'tgd,grd->tgr' is the same), "
                     f"got {equation!r}")


def _raise_if_nan_code(codes, op, arg):
    if (np.asarray(codes) == 0xFF).any():
        raise ValueError(f"{op}: argument '{arg}' holds UE8M0 code 0xFF, which is NaN")


def _scale_operand(op, arg, s, ue8m0, impl):
    if s.dtype in _SCALE_CODE_DTYPES:
        with jax.ensure_compile_time_eval():  # a constant (also one captured by jit) stays concrete: checked now
            codes = s if s.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(s, jnp.uint8)
        if _is_concrete(codes):
            _raise_if_nan_code(codes, op, arg)
        return codes
    _check_dtype(op, arg, s, [jnp.float32, jnp.uint8, jnp.float8_e8m0fnu])
    return pack_ue8m0(s, arg=arg, impl=impl) if ue8m0 else s


def fp8_einsum(equation, x, x_scale, w, w_scale, *, out_dtype=jnp.bfloat16, ue8m0=False, impl="auto",
               tile_tokens=None, kernel=None):
    """FP8 block-scaled einsum (DeepGEMM ``fp8_einsum`` contract, SPEC 4.2).

    ``D = sum_kb sx[., kb] * sw[., kb] * sum_{k in kb} x8 * w8`` in float32, rounded once.

    Equations (letters are free, the structure is fixed):

    * ``"md,nd->mn"``: x [M, K], x_scale [M, K/128]; w [N, K], w_scale [ceil(N/128), K/128]
      (recipe (1, 128, 128), DeepSeek-V3 weight blocks) or [N, K/128] (recipe (1, 1, 128)).
      Returns [M, N].
    * ``"bhr,hdr->bhd"``: x [B, H, R], x_scale [B, H, R/128]; w [H, D, R], w_scale
      [H, ceil(D/128), R/128] or [H, D, R/128]. Returns [B, H, D]. DeepSeek-V4 writes it
      ``"tgd,grd->tgr"``.

    The contracted size (K or R) must be a multiple of 128; M, N, B, H, D are free.

    Scales: float32 multipliers, or UE8M0 codes (uint8 / ``float8_e8m0fnu``) applied as exact powers
    of two; code 0 is 2**-127, a float32 subnormal, which the CPU and CUDA handlers apply as IEEE float32 does,
    while the ``jnp`` reference on XLA's CPU backend (which flushes subnormals) reads it as 0. Code 0xFF (the
    format's NaN) is rejected for concrete arrays, by the CPU handler and on the reference path (a host callback
    under ``jit``); under ``jit`` on a GPU codes are not scanned (that would need a host sync), so a 0xFF code
    there yields NaN like any NaN scale; this library's encoders never produce 0xFF. ``ue8m0=True`` declares
    float32 scales to be powers of two: they are packed into codes with a mask, and any value with sign or
    mantissa bits is rejected (never turned into NaN).

    Args:
      x, w: float8_e4m3fn operands; out_dtype: bfloat16 or float32; impl: "auto" | "ffi" | "reference";
      tile_tokens: force the CUDA token tile: 8 (the decode kernel, M <= 32), 16, 32, 64, 128, or 192
        with block-scaled weights (see :mod:`jax_w4a8.tiling`); 0 = plain CUDA-core kernel.
      kernel: the CUDA kernel family: None (the plan's choice), "native" (this library's kernels, tiles as
        ``tile_tokens``) or "cutlass" (CUTLASS's Hopper blockwise-scaled GEMM, 128 x 128 x 128 tiles: recipe
        (1, 128, 128), bfloat16 output, N a multiple of 8; the plan's choice where its tiles fill the GPU,
        see :func:`jax_w4a8.tiling.plan_fp8_einsum`, when the library was built with CUTLASS) or "cublas"
        (opt-in: cuBLASLt's own block-scaled FP8 GEMM, cuBLAS >= 12.9 on compute capability 9.0, loaded from
        JAX's CUDA plugin; recipe (1, 128, 128), bfloat16 output, ``"md,nd->mn"`` with M a multiple of 4 and N
        a multiple of 16).
    Raises:
      TypeError / ValueError naming the argument, at trace time, before any kernel runs; for ``kernel``:
      an unknown value, or "cutlass" with per-row weight scales, float32 output, N not a multiple of 8 or
      a library built without CUTLASS; "cublas" with those, more than one head, M not a multiple of 4, N not
      a multiple of 16, or no cuBLASLt 12.9+ to load.
    """
    op = "fp8_einsum"
    rank = _parse_equation(equation)
    _check_impl(op, impl)
    ue8m0 = _check_flag(op, "ue8m0", ue8m0)
    out_dtype = _check_out_dtype(op, out_dtype)
    x, w = jnp.asarray(x), jnp.asarray(w)
    with jax.ensure_compile_time_eval():  # NumPy scales stay concrete under jit: checked before tracing
        x_scale, w_scale = jnp.asarray(x_scale), jnp.asarray(w_scale)
    _check_dtype(op, "x", x, [jnp.float8_e4m3fn])
    _check_dtype(op, "w", w, [jnp.float8_e4m3fn])
    if x.ndim != rank:
        _fail(op, "x", f"must be {rank}-D for {equation!r}, got shape {x.shape}")
    if w.ndim != rank:
        _fail(op, "w", f"must be {rank}-D for {equation!r}, got shape {w.shape}")
    if rank == 2:
        (m, k), (n, kw), h = x.shape, w.shape, None
    else:
        (m, h, k), (hw, n, kw) = x.shape, w.shape
        if hw != h:
            _fail(op, "w", f"must have {h} heads on axis 0 to match x, got shape {w.shape}")
    if k == 0 or k % 128:
        _fail(op, "x", f"must have its contracted axis a positive multiple of 128, got {k}")
    if kw != k:
        _fail(op, "w", f"must have contracted size {k} (as x), got shape {w.shape}")
    if n == 0:
        _fail(op, "w", f"must have at least one output row, got shape {w.shape}")
    lead = () if h is None else (h,)
    g = k // 128
    x_scale_shape = (m, g) if h is None else (m, h, g)
    _check_dtype(op, "x_scale", x_scale, [jnp.float32, jnp.uint8, jnp.float8_e8m0fnu])
    _check_shape(op, "x_scale", x_scale, x_scale_shape, "one scale per row and 128-wide K block")
    _check_dtype(op, "w_scale", w_scale, [jnp.float32, jnp.uint8, jnp.float8_e8m0fnu])
    block_shape, row_shape = lead + (-(-n // 128), g), lead + (n, g)
    if tuple(w_scale.shape) not in (block_shape, row_shape):
        _fail(op, "w_scale", f"must have shape {block_shape} (128x128 blocks) or {row_shape} "
              f"(per row), got {tuple(w_scale.shape)}")
    x_scale = _scale_operand(op, "x_scale", x_scale, ue8m0, impl)
    w_scale = _scale_operand(op, "w_scale", w_scale, ue8m0, impl)

    # Canonical batched form: x [M, H, K], w [H, N, K].
    if h is None:
        x, x_scale, w, w_scale = x[:, None], x_scale[:, None], w[None], w_scale[None]
    hh = x.shape[1]

    block_scaled = w_scale.shape[-2] != n  # one weight scale per 128 rows (else per row)
    try:
        plan = tiling.plan_fp8_einsum(m, hh, n, k, block_scaled=block_scaled, tile_tokens=tile_tokens,
                                      kernel=kernel, out_bf16=out_dtype == jnp.bfloat16)
        algo = tiling.cublas_algo() if plan.kernel == "cublas" else 0  # $JAX_W4A8_CUBLAS_ALGO, for sweeps
    except ValueError as exc:
        raise ValueError(f"{op}: {exc}") from None
    out_type = jax.ShapeDtypeStruct((m, hh, n), out_dtype)

    def cpu_fn(*args):
        return jax.ffi.ffi_call(TARGETS["fp8_einsum"], out_type, vmap_method="sequential")(*args)

    def cuda_fn(*args):
        call = jax.ffi.ffi_call(TARGETS["fp8_einsum"],
                                (out_type, jax.ShapeDtypeStruct((plan.scratch_bytes,), jnp.uint8)),
                                vmap_method="sequential")
        return call(*args, tile_tokens=np.int32(plan.tile_tokens), split_k=np.int32(plan.split_k),
                    kernel=np.int32(tiling.EINSUM_KERNELS.index(plan.kernel)),
                    cublas_algo=np.int32(algo))[0]

    def ref_fn(xv, xs, wv, ws):
        # The reference path scans traced codes as the CPU handler does (a host callback, as pack_ue8m0's
        # reference path), so a 0xFF code is an error there too, not a silent NaN.
        for arg, sv in (("x_scale", xs), ("w_scale", ws)):
            if sv.dtype == jnp.uint8 and not _is_concrete(sv):
                jax.debug.callback(functools.partial(_raise_if_nan_code, op=op, arg=arg), sv)
        return reference.fp8_einsum(xv, xs, wv, ws, out_dtype=out_dtype)

    out = _dispatch(impl, cpu_fn, cuda_fn, ref_fn, x, x_scale, w, w_scale,
                    default=functools.partial(reference.fp8_einsum, out_dtype=out_dtype))
    return out[:, 0] if h is None else out


# ----------------------------------------------------------------------------------------------
# Activation quantizer
# ----------------------------------------------------------------------------------------------
def quantize_fp8_groups(x, group_size: int = 128, ue8m0: bool = False, *, layout="standard", impl="auto"):
    """Per-token, per-128-channel fp8 quantization in one pass (DeepSeek ``act_quant``), as a kernel.

    Same contract as :func:`jax_w4a8.quant.quantize_fp8_groups` (its reference):
    ``amax = max(|x| over the group, 1e-4)``, ``s = amax / 448`` (rounded up to a power of two first
    when ``ue8m0``), ``x8 = e4m3(x / s)`` saturating. The kernels divide correctly rounded (IEEE float32); the
    ``jnp`` reference goes through XLA, which turns a division by a constant or a broadcast divisor into a
    multiplication by its reciprocal (on the CPU backend about half of all scales come out one ulp off, and a
    code moves one step where that crosses an e4m3 rounding boundary).

    Args:
      x: bfloat16 or float32 [..., K], K a multiple of 128 (other group sizes use the reference).
      layout: "standard" (the codes and their group scales) or "folded" (``ue8m0=True`` and group_size 128
        only): the same codes with each token's group scales folded in, in the folded K order, and one float32
        multiplier per token (:func:`jax_w4a8.quant.fold_fp8_groups`, its reference), written by the same one
        pass; :func:`w4a8_grouped_gemm` takes it with ``x_layout="folded"``. Rows of more than 16384 channels
        are quantized, then folded in XLA.
    Returns:
      "standard": (float8_e4m3fn [..., K], float32 scales [..., K // group_size]);
      "folded": (float8_e4m3fn [..., K] in the folded K order, float32 token multipliers [...]).
    """
    op = "quantize_fp8_groups"
    _check_impl(op, impl)
    x = jnp.asarray(x)
    _check_dtype(op, "x", x, [jnp.bfloat16, jnp.float32])
    group_size = quant._check_size_arg(group_size, "group_size", op)
    ue8m0 = _check_flag(op, "ue8m0", ue8m0)
    layout = _check_layout(op, "layout", layout, ue8m0)
    if x.ndim < 1 or x.shape[-1] == 0 or x.shape[-1] % group_size:
        _fail(op, "x", f"must have its last axis a positive multiple of group_size={group_size}, got {x.shape}")
    if layout == "folded" and group_size != 128:
        _fail(op, "group_size", f"must be 128 with layout='folded', got {group_size}")
    ref_fn = functools.partial(quant.quantize_fp8_groups, group_size=group_size, ue8m0=ue8m0)
    if group_size != 128:
        return ref_fn(x)
    return _quantize_call(x, x.shape[-1], ue8m0, False, layout, impl, ref_fn)


def _quantize_call(x, k, ue8m0, silu_mul, layout, impl, ref_fn):
    """The quantizer's custom call (both layouts; ``k`` the output channels), by platform."""
    lead = x.shape[:-1]
    types = (jax.ShapeDtypeStruct(lead + (k,), jnp.float8_e4m3fn),
             jax.ShapeDtypeStruct(lead + (k // 128,), jnp.float32))

    def call(v, folded=None):
        attrs = dict(ue8m0=bool(ue8m0), silu_mul=silu_mul)
        out_types = types
        if folded is not None:  # the CUDA handler's attribute (the CPU handler has no folded layout)
            attrs["folded"] = folded
            if folded:
                out_types = (types[0], jax.ShapeDtypeStruct(lead, jnp.float32))
        return tuple(jax.ffi.ffi_call(TARGETS["quantize_fp8_groups"], out_types, vmap_method="broadcast_all")(
            v, **attrs))

    if layout == "standard":
        return _dispatch(impl, call, functools.partial(call, folded=False), ref_fn, x)

    def cuda_fn(v):  # one pass where the kernel holds the row (K <= 16384), else quantize, then fold
        if k // 128 <= _FOLDED_KERNEL_MAX_GROUPS:
            return call(v, folded=True)
        return quant.fold_fp8_groups(*call(v, folded=False))

    return _dispatch(impl, lambda v: quant.fold_fp8_groups(*call(v)), cuda_fn,
                     lambda v: quant.fold_fp8_groups(*ref_fn(v)), x)


_FOLDED_KERNEL_MAX_GROUPS = 128  # quantize_fp8_groups.cu: kFoldTeams * kFoldMaxHeld


def _silu_mul(x):
    """``silu(gate) * up`` in float32 for ``x = [gate, up]`` on the last axis."""
    inter = x.shape[-1] // 2
    x = x.astype(jnp.float32)
    return jax.nn.silu(x[..., :inter]) * x[..., inter:]


def _silu_mul_reference(x, ue8m0):
    return quant.quantize_fp8_groups(_silu_mul(x), ue8m0=ue8m0)


def silu_mul_quantize_fp8_groups(x, ue8m0: bool = False, *, layout="standard", impl="auto"):
    """The MoE activation and the down projection's input quantization in one pass: ``x = [gate, up]``,
    ``h = silu(gate) * up`` in float32, then :func:`quantize_fp8_groups` of ``h`` (per token and 128 channels).

    The kernel reads ``x`` once and writes the codes and scales: ``h`` never goes to memory (the unfused
    sequence writes it and reads it back). Its reference: ``jax.nn.silu`` and the quantizer in ``jnp``.

    Args:
      x: bfloat16 or float32 [..., 2I], gate channels [0, I), up channels [I, 2I); I a multiple of 128.
      ue8m0: scales rounded up to powers of two (UE8M0) before quantizing, as the down projection's
        activations of DeepSeek-V3.1 / V4 checkpoints and :func:`w4a8_moe_up` use.
      layout: "standard" or "folded" (``ue8m0=True``; :func:`quantize_fp8_groups`): the down projection's
        input for :func:`w4a8_grouped_gemm` with ``x_layout="folded"``.
    Returns:
      "standard": (float8_e4m3fn [..., I], float32 scales [..., I // 128]); "folded": (float8_e4m3fn [..., I]
      in the folded K order, float32 token multipliers [...]). A product past float32's range (finite gate and
      up of about 2e19 each) saturates like an infinite input of :func:`quantize_fp8_groups`: code +-448 under
      the largest scale, never NaN.
    Raises:
      TypeError / ValueError naming ``x`` for another dtype or a last axis that is not a positive multiple
      of 256.
    """
    op = "silu_mul_quantize_fp8_groups"
    _check_impl(op, impl)
    x = jnp.asarray(x)
    _check_dtype(op, "x", x, [jnp.bfloat16, jnp.float32])
    if x.ndim < 1 or x.shape[-1] == 0 or x.shape[-1] % 256:
        _fail(op, "x", f"must be [..., 2I] (gate, then up) with I a positive multiple of 128, got {x.shape}")
    ue8m0 = _check_flag(op, "ue8m0", ue8m0)
    layout = _check_layout(op, "layout", layout, ue8m0)
    return _quantize_call(x, x.shape[-1] // 2, ue8m0, True, layout, impl,
                          functools.partial(_silu_mul_reference, ue8m0=ue8m0))


# ----------------------------------------------------------------------------------------------
# Fused MoE up-projection
# ----------------------------------------------------------------------------------------------
def _fused_up_supported(num_experts: int) -> bool:
    """The fused kernel is Hopper-only (wgmma/TMA) and tables at most 1024 experts per call."""
    if not ffi_available("cuda") or num_experts > 1024:
        return False
    try:
        return str(getattr(jax.devices("gpu")[0], "compute_capability", "")) == "9.0"
    except RuntimeError:  # no GPU here: lowering for CUDA (export) assumes Hopper
        return True


def w4a8_moe_up(x, x_scale, w13, w13_scale, group_sizes, *, down_input_scale=None, ue8m0=True, impl="auto",
                rows_per_expert=None, tile_tokens=None, mma=None, fused=None):
    """MoE gate+up grouped GEMM fused with SiLU(gate) * up and fp8 quantization for the down projection.

    ``h = silu(gate) * up`` with gate and up the results of :func:`w4a8_grouped_gemm` on the rows [0, I) and
    [I, 2I) of ``w13`` (float32 in the fused kernel and the reference; rounded to bfloat16 in the composed ops
    below), then:

    * ``down_input_scale`` given (static, the checkpoint's per-tensor ``input_scale`` of w2):
      ``h8 = e4m3(clip(h / s))``, returned with ``s``;
    * ``down_input_scale=None`` (dynamic): per token and 128 channels, ``s = max(amax, 1e-4) / 448``, with
      ``ue8m0`` (the default) rounded up to a power of two *before* quantizing, ``h8 = e4m3(h / s)``.

    On Hopper the CUDA kernel does this in the GEMM epilogue, so the [M, 2I] intermediate never goes
    to memory, up to 64 expected rows per expert. Above (where its 64-token tiles lose to the grouped
    GEMM's 128-token ones: 1.5x slower at 128 rows per expert), and elsewhere, the ops are composed: the
    grouped GEMM with bfloat16 output (gate and up rounded to bfloat16, up to 2^-8 relative, as in the unfused
    sequence), then SiLU-mul and the quantizer in one pass (:func:`silu_mul_quantize_fp8_groups`; with a static
    scale: one XLA fusion). Dynamic scales need I a multiple of 128 (one scale per 128 channels).

    Args:
      x, x_scale, group_sizes: as :func:`w4a8_grouped_gemm`.
      w13: int8 packed int4 [E, 2I, K/2], gate rows first; w13_scale: float32/bfloat16 [E, 2I, K/128].
      down_input_scale: optional float32 scalar, positive and finite (checked where it is concrete).
      ue8m0: dynamic scales are powers of two (True, the default) or float32 (False).
      rows_per_expert, tile_tokens: the fused kernel's tile plan, as :func:`w4a8_grouped_gemm` (token
        tiles 8 (f16 only), 16, 32 or 64); mma: its tensor-core operand format, None (the plan: f16 up to
        64 rows per expert), "e4m3" (token tiles 16, 32, 64) or "f16" (all four); see
        :func:`jax_w4a8.tiling.plan_moe_up`.
      fused: None (the plan: the fused kernel up to ``tiling.FUSED_UP_MAX_ROWS`` expected rows per expert or
        when ``tile_tokens`` / ``mma`` is given, the composed ops above), True (the fused kernel wherever it
        runs) or False (the composed ops).
    Returns:
      (h8 float8_e4m3fn [M, I], scale): float32 [M, I // 128] (dynamic) or the scalar (static). Rows
      not owned by any expert give h = 0 (codes 0).
    Raises:
      TypeError / ValueError naming the argument, at trace time, before any kernel runs: bad shapes or
      dtypes (as :func:`w4a8_grouped_gemm`, named as here: ``w13``, ``w13_scale``), ``w13`` without gate and up
      halves or (dynamic scales) with I not a multiple of 128, a ``down_input_scale`` that is not a scalar or
      (concrete) not positive and finite, an unknown ``tile_tokens``, ``mma`` or ``fused``, ``mma="e4m3"`` with
      an 8-token tile, or ``tile_tokens`` / ``mma`` with ``fused=False``.
    """
    op = "w4a8_moe_up"
    _check_impl(op, impl)
    group_sizes = _group_sizes_array(op, group_sizes)
    x_scale = _python_scalar_as_f32(x_scale)
    ue8m0 = _check_flag(op, "ue8m0", ue8m0)
    w13 = jnp.asarray(w13)
    if w13.ndim != 3 or w13.shape[1] % 2 or w13.shape[1] == 0:
        _fail(op, "w13", f"must be [E, 2I, K/2] with gate rows then up rows, got shape {w13.shape}")
    static = down_input_scale is not None
    if static:
        # a Python or NumPy scalar, or an array captured by jit, stays concrete (checked) inside jit too
        with jax.ensure_compile_time_eval():
            try:
                down_input_scale = jnp.asarray(down_input_scale, jnp.float32)
            except (TypeError, ValueError):
                _fail(op, "down_input_scale", f"must be a float32 scalar, got {down_input_scale!r}", TypeError)
            if down_input_scale.size != 1:
                _fail(op, "down_input_scale", f"must be a scalar, got shape {down_input_scale.shape}")
            down_input_scale = down_input_scale.reshape(())
            if _is_concrete(down_input_scale):
                v = float(down_input_scale)
                if not (np.isfinite(v) and v > 0):
                    _fail(op, "down_input_scale", f"must be positive and finite (h / s is quantized), got {v}")
    inter = w13.shape[1] // 2
    if not static and inter % 128:
        _fail(op, "w13", f"must have I (half its rows) a multiple of 128 for dynamic scales (one per 128 "
              f"channels), got I = {inter}; pass down_input_scale for a static scale")

    def unfused(ffi_impl):
        y = w4a8_grouped_gemm(x, x_scale, w13, w13_scale, group_sizes, impl=ffi_impl,
                              rows_per_expert=rows_per_expert)
        if static:
            return quant.quantize_fp8_tensor(_silu_mul(y), down_input_scale), down_input_scale
        return silu_mul_quantize_fp8_groups(y, ue8m0=ue8m0, impl=ffi_impl)

    # Validation of every other argument happens here, at trace time (the grouped GEMM's errors renamed to this
    # op's arguments); the plan options are checked on every path, also where the fused kernel does not run.
    try:
        jax.eval_shape(lambda: unfused("reference"))
    except (TypeError, ValueError) as exc:
        msg = str(exc).replace("w4a8_grouped_gemm:", f"{op}:").replace("argument 'w_scale'", "argument 'w13_scale'")
        raise type(exc)(msg.replace("argument 'w'", "argument 'w13'")) from None
    m, k = x.shape
    e = w13.shape[0]
    try:
        plan = tiling.plan_moe_up(m, e, inter, k, rows_per_expert=rows_per_expert, tile_tokens=tile_tokens,
                                  mma=mma, fused=fused)
    except ValueError as exc:
        raise ValueError(f"{op}: {exc}") from None
    if impl == "reference":
        return reference.w4a8_moe_up(*map(jnp.asarray, (x, x_scale, w13, w13_scale, group_sizes)),
                                     down_input_scale=down_input_scale, ue8m0=ue8m0)
    if plan.kernel == "unfused" or inter % 128 or not _fused_up_supported(e):  # static scale, I % 128: composed
        return unfused(impl)
    x_scale = jnp.asarray(x_scale)
    if x_scale.size == 1 and x_scale.ndim <= 1:
        x_scale = x_scale.reshape(1)
    types = (jax.ShapeDtypeStruct((m, inter), jnp.float8_e4m3fn),
             jax.ShapeDtypeStruct((1,) if static else (m, inter // 128), jnp.float32),
             jax.ShapeDtypeStruct((plan.scratch_bytes,), jnp.uint8))
    scale_in = down_input_scale.reshape(1) if static else jnp.ones((1,), jnp.float32)

    def cuda_fn(*args):
        h8, hs, _ = jax.ffi.ffi_call(TARGETS["w4a8_moe_up"], types, vmap_method="sequential")(
            *args, tile_tokens=np.int32(plan.tile_tokens), static_scale=static,
            mma=np.int32(tiling.MMAS.index(plan.mma)), ue8m0=ue8m0)
        return (h8, hs.reshape(())) if static else (h8, hs)

    def other_fn(*args):
        return unfused(impl)

    args = (jnp.asarray(x), x_scale, w13, jnp.asarray(w13_scale), jnp.asarray(group_sizes), scale_in)
    return jax.lax.platform_dependent(*args, cuda=cuda_fn, default=other_fn)
