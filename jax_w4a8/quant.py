"""Number formats and quantizers of DeepSeek W4A8 / FP8 checkpoints, in plain ``jnp``.

Every function here is jit-able and works on any leading batch axes. Formats (SPEC section 2):

* int4 codes: signed two's complement in [-8, 7].
* packed int4: two codes per int8 byte along the last axis, element ``2i`` in the **low** nibble and
  ``2i + 1`` in the high nibble (TensorRT-LLM / sglang W4AFP8 layout).
* fp8: ``float8_e4m3fn``, largest finite value 448, no Inf; every conversion here saturates.
* UE8M0: one byte ``e`` meaning ``2**(e - 127)``; ``0xFF`` is NaN. These helpers never produce
  ``0x00`` or ``0xFF``.

Scales are always *dequantization multipliers*: ``value ~= code * scale``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "FP8_MAX",
    "INT4_MAX",
    "INT4_MIN",
    "pack_int4",
    "unpack_int4",
    "quantize_w4",
    "dequantize_w4",
    "ceil_to_ue8m0",
    "encode_ue8m0",
    "decode_ue8m0",
    "is_ue8m0_exact",
    "quantize_fp8_groups",
    "FOLD_MAX_LIFT",
    "to_folded_k_order",
    "from_folded_k_order",
    "fold_fp8_groups",
    "unfold_fp8_groups",
    "quantize_fp8_folded",
    "quantize_fp8_blocks",
    "dequantize_fp8_blocks",
    "quantize_fp8_tensor",
]

FP8_MAX = 448.0
INT4_MIN, INT4_MAX = -8, 7
AMAX_FLOOR = 1e-4
_FP8 = jnp.float8_e4m3fn


def _require(cond: bool, exc: type[Exception], msg: str) -> None:
    if not cond:
        raise exc(msg)


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


# ----------------------------------------------------------------------------------------------
# int4
# ----------------------------------------------------------------------------------------------
def pack_int4(q):
    """Packs int4 codes two per byte.

    Args:
      q: integer array [..., K] with values in [-8, 7]; K even.
    Returns:
      int8 [..., K // 2]; element ``2i`` in the low nibble, ``2i + 1`` in the high nibble.
    Raises:
      TypeError: ``q`` is not an integer array.
      ValueError: K is odd, or (for concrete arrays) a value lies outside [-8, 7].
    """
    with jax.ensure_compile_time_eval():  # NumPy input stays concrete under jit: its range checked below
        q = jnp.asarray(q)
    _require(jnp.issubdtype(q.dtype, jnp.integer), TypeError,
             f"pack_int4: q must be an integer array of int4 codes, got dtype {q.dtype}")
    _require(q.ndim >= 1 and q.shape[-1] % 2 == 0, ValueError,
             f"pack_int4: the last axis of q must have even length, got shape {q.shape}")
    if _is_concrete(q) and q.size:  # also a constant captured by jit
        with jax.ensure_compile_time_eval():
            lo, hi = int(jnp.min(q)), int(jnp.max(q))
        _require(INT4_MIN <= lo and hi <= INT4_MAX, ValueError,
                 f"pack_int4: q holds values in [{lo}, {hi}], outside the int4 range [-8, 7]")
    q = q.astype(jnp.int32)
    low = q[..., 0::2] & 0xF
    high = (q[..., 1::2] & 0xF) << 4
    return jax.lax.convert_element_type((low | high) - (((low | high) & 0x80) << 1), jnp.int8)


def unpack_int4(p):
    """Unpacks bytes of two int4 codes (the inverse of :func:`pack_int4`).

    Args:
      p: int8 or uint8 [..., K // 2].
    Returns:
      int8 [..., K] codes in [-8, 7].
    """
    p = jnp.asarray(p)
    _require(p.dtype in (jnp.int8, jnp.uint8), TypeError,
             f"unpack_int4: p must be int8 or uint8 packed bytes, got dtype {p.dtype}")
    _require(p.ndim >= 1, ValueError, "unpack_int4: p must have at least one axis (the packed K // 2)")
    b = p.astype(jnp.int32) & 0xFF
    low = ((b & 0xF) ^ 8) - 8
    high = ((b >> 4) ^ 8) - 8
    out = jnp.stack([low, high], axis=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)
    return out.astype(jnp.int8)


def _check_size_arg(value, name: str, fn: str) -> int:
    ok = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)) and value > 0
    _require(ok, ValueError, f"{fn}: argument '{name}' must be a positive int, got {value!r}")
    return int(value)


def _split_groups(x, group_size: int, name: str, fn: str):
    group_size = _check_size_arg(group_size, "group_size", fn)
    _require(x.ndim >= 1, ValueError, f"{fn}: {name} must have at least one axis")
    k = x.shape[-1]
    _require(group_size > 0 and k % group_size == 0, ValueError,
             f"{fn}: the last axis of {name} ({k}) must be a multiple of group_size={group_size}")
    return x.reshape(*x.shape[:-1], k // group_size, group_size)


def quantize_w4(w, group_size: int = 128):
    """Quantizes weights to int4 with one scale per output row and ``group_size`` inputs.

    TensorRT-LLM recipe: ``s = absmax / 7``, ``q = clip(round_half_even(w / s), -8, 7)``. An
    all-zero group gets scale 0 and codes 0 (never NaN).

    Args:
      w: float [..., N, K]; K a multiple of ``group_size``.
    Returns:
      (packed int8 [..., N, K // 2], scales float32 [..., N, K // group_size]).
    """
    w = jnp.asarray(w)
    _require(jnp.issubdtype(w.dtype, jnp.floating), TypeError,
             f"quantize_w4: w must be a float array, got dtype {w.dtype}")
    _require(w.ndim >= 2, ValueError, f"quantize_w4: w must be [..., N, K], got shape {w.shape}")
    _require(w.shape[-1] % 2 == 0, ValueError,
             f"quantize_w4: w must have an even K (two int4 codes per byte), got K = {w.shape[-1]}")
    g = _split_groups(w.astype(jnp.float32), group_size, "w", "quantize_w4")
    s = jnp.max(jnp.abs(g), axis=-1) / INT4_MAX
    safe = jnp.where(s > 0, s, 1.0)
    q = jnp.clip(jnp.round(g / safe[..., None]), INT4_MIN, INT4_MAX).astype(jnp.int8)
    return pack_int4(q.reshape(w.shape)), s


def dequantize_w4(packed, scales, dtype=jnp.float32):
    """``unpack_int4(packed) * scales`` per group: [..., N, K//2], [..., N, G] -> dtype [..., N, K] (G divides K).

    Raises:
      ValueError naming ``scales`` when its shape is not ``packed``'s leading axes plus G groups of K.
    """
    q = unpack_int4(packed).astype(jnp.float32)
    scales = jnp.asarray(scales)
    k = q.shape[-1]
    ok = (scales.ndim == q.ndim and tuple(scales.shape[:-1]) == tuple(q.shape[:-1]) and scales.shape[-1] > 0
          and k % scales.shape[-1] == 0)
    _require(ok, ValueError, f"dequantize_w4: argument 'scales' must have shape {tuple(q.shape[:-1])} + (G,) with "
             f"G dividing K = {k} (one scale per row and group), got {tuple(scales.shape)}")
    g = q.reshape(*q.shape[:-1], scales.shape[-1], -1)
    return (g * scales.astype(jnp.float32)[..., None]).reshape(q.shape).astype(dtype)


# ----------------------------------------------------------------------------------------------
# UE8M0
# ----------------------------------------------------------------------------------------------
def _f32_bits(x):
    return jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.uint32)


def _ceil_exponent(x):
    """The biased exponent of 2**ceil(log2|x|), clamped to [1, 254] (uint32)."""
    b = _f32_bits(jnp.abs(jnp.asarray(x, jnp.float32)))
    exp = (b >> 23) & 0xFF
    e = exp + ((b & 0x7FFFFF) != 0).astype(jnp.uint32)
    # Inf and NaN (exponent 255) map to the largest code, 0 and subnormals to the smallest.
    e = jnp.where(exp == 0xFF, jnp.uint32(254), e)
    return jnp.clip(e, 1, 254).astype(jnp.uint32)


def ceil_to_ue8m0(x):
    """Rounds ``|x|`` up to a power of two, bit-exactly (SPEC section 2); elementwise, any shape.

    ``2**ceil(log2|x|)`` as float32; 0 and subnormals give ``2**-126``, Inf and NaN ``2**127``.
    Exact powers of two are returned unchanged.
    """
    return jax.lax.bitcast_convert_type(_ceil_exponent(x) << 23, jnp.float32)


def encode_ue8m0(x):
    """float32 -> uint8 UE8M0 codes of ``ceil_to_ue8m0(x)``: the masked exponent byte (elementwise, same shape).

    The code never is 0x00 or 0xFF. Non-powers of two round *up*, so quantize with
    ``ceil_to_ue8m0(scale)`` before encoding to keep the quantization and dequantization scales equal.
    """
    return _ceil_exponent(x).astype(jnp.uint8)


def decode_ue8m0(codes):
    """uint8 or ``float8_e8m0fnu`` codes -> float32 ``2**(code - 127)``, same shape; code 0xFF gives NaN."""
    codes = jnp.asarray(codes)
    if codes.dtype == jnp.float8_e8m0fnu:
        codes = jax.lax.bitcast_convert_type(codes, jnp.uint8)
    _require(codes.dtype == jnp.uint8, TypeError,
             f"decode_ue8m0: codes must be uint8 or float8_e8m0fnu, got dtype {codes.dtype}")
    c = codes.astype(jnp.uint32)
    bits = jnp.where(c == 0, jnp.uint32(0x00400000), c << 23)  # 2**-127 is an fp32 subnormal
    bits = jnp.where(c == 0xFF, jnp.uint32(0x7FC00000), bits)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def is_ue8m0_exact(x):
    """bool, same shape: True where float32 ``x`` is exactly a UE8M0 value, a positive power of two in
    [2**-126, 2**127]."""
    b = _f32_bits(x)
    exp = (b >> 23) & 0xFF
    return ((b & jnp.uint32(0x807FFFFF)) == 0) & (exp >= 1) & (exp <= 254)


# ----------------------------------------------------------------------------------------------
# FP8
# ----------------------------------------------------------------------------------------------
def _to_fp8(y):
    """Saturating round-to-nearest-even cast of float32 to e4m3 (NaN stays NaN).

    The e4m3 array goes through an optimization barrier: XLA's GPU compiler otherwise removes a
    ``f32 -> e4m3 -> f32`` round trip inside one jit (its ``simplify-fp-conversions`` pass, on while
    ``xla_allow_excess_precision`` is, the default), so a quantize-dequantize would silently not quantize.
    """
    return jax.lax.optimization_barrier(jnp.clip(y, -FP8_MAX, FP8_MAX).astype(_FP8))


def _fp8_scale(amax, ue8m0: bool):
    """``max(amax, 1e-4) / 448``, rounded up to a power of two when ``ue8m0`` (2**127 for an infinite amax);
    float32 scales cap the amax at float32's largest value, so that an infinite one saturates (no Inf scale)."""
    if ue8m0:
        return ceil_to_ue8m0(jnp.maximum(amax, AMAX_FLOOR) / FP8_MAX)
    return jnp.minimum(jnp.maximum(amax, AMAX_FLOOR), np.finfo(np.float32).max) / FP8_MAX


def quantize_fp8_groups(x, group_size: int = 128, ue8m0: bool = False):
    """Per-token, per-``group_size``-channel fp8 quantization (DeepSeek ``act_quant``).

    ``amax = max(|x| over the group, 1e-4)``, ``s = amax / 448`` (rounded up to a power of two first
    when ``ue8m0``), then ``x8 = e4m3(x / s)`` saturating. Non-finite inputs, as the CUDA and CPU kernels
    take them: a NaN element is left out of its group's amax (the kernels' max ignores NaN) and becomes a NaN
    code (so the GEMM rows that read it come out NaN). An infinite element saturates: its group's scale is the
    largest there is (float32's largest value / 448 without ``ue8m0``, 2**127 with it), its code is +-448 and the
    group's others are 0, which is finite: check activations upstream where that matters
    (``generate(check_finite=True)`` checks the logits).

    Args:
      x: float [..., K]; K a multiple of ``group_size``.
    Returns:
      (float8_e4m3fn [..., K], float32 scales [..., K // group_size]).
    """
    x = jnp.asarray(x)
    _require(jnp.issubdtype(x.dtype, jnp.floating), TypeError,
             f"quantize_fp8_groups: x must be a float array, got dtype {x.dtype}")
    g = _split_groups(x.astype(jnp.float32), group_size, "x", "quantize_fp8_groups")
    a = jnp.abs(g)
    s = _fp8_scale(jnp.max(jnp.where(jnp.isnan(a), 0.0, a), axis=-1), ue8m0)  # NaN ignored, as fmaxf
    y = g / s[..., None]
    # Inf / a finite scale is Inf (then +-448) in IEEE division; XLA's CPU division uses a flushed reciprocal
    y = jnp.where(jnp.isinf(g) & jnp.isfinite(s)[..., None], g, y)
    return _to_fp8(y).reshape(x.shape), s


# ----------------------------------------------------------------------------------------------
# Folded fp8 activations (the W4A8 grouped GEMM's prefill input)
# ----------------------------------------------------------------------------------------------
# The 128-token e4m3 kernel of ops.w4a8_grouped_gemm reads each token's codes with its group scales already
# folded in (one float32 multiplier per token) and in a K order of its own. Given UE8M0 group scales, folding is
# exact but for codes it puts below e4m3's smallest normal (SPEC: "folded activations"; hopper_gemm.cu,
# FoldTokenActivations, does the same on the device where it is handed the ordinary layout).
FOLD_MAX_LIFT = 15  # the lift j of a token's codes is at most 2**15 (the kernels build the ratios as float16)


def _check_k(x, fn: str, arg: str):
    _require(x.ndim >= 1 and x.shape[-1] > 0 and x.shape[-1] % 128 == 0, ValueError,
             f"{fn}: argument '{arg}' must be [..., K] with K a positive multiple of 128, got shape {x.shape}")


def _transpose_words(codes, fn: str, rows: int):
    """Each 128-code group of [..., K] codes seen as a [rows, 32 / rows] grid of four-byte words, transposed."""
    codes = jnp.asarray(codes)
    _check_k(codes, fn, "codes")
    lead, k = codes.shape[:-1], codes.shape[-1]
    v = codes.reshape(lead + (k // 128, rows, 32 // rows, 4))
    return jnp.swapaxes(v, -3, -2).reshape(codes.shape)


def to_folded_k_order(codes):
    """The folded K order of [..., K] codes (K a multiple of 128; any dtype of one byte): within each 128-code
    group, viewed as 32 four-byte words, word ``c + 8 i`` moves to ``4 c + i`` (c < 8, i < 4): a transpose of
    the words' [4, 8] grid, so that each 16-byte chunk ``c`` holds the words the MMA thread ``c`` needs.
    Same shape and dtype out. Inverse: :func:`from_folded_k_order`. Raises ValueError naming ``codes`` for a
    last axis that is not a positive multiple of 128."""
    return _transpose_words(codes, "to_folded_k_order", 4)


def from_folded_k_order(codes):
    """Inverse of :func:`to_folded_k_order`: [..., K] in the folded K order -> the caller's K order (same shape and
    dtype). Raises ValueError naming ``codes`` for a last axis that is not a positive multiple of 128."""
    return _transpose_words(codes, "from_folded_k_order", 8)


def _pow2(d):
    """float32 2**d for int32 d <= 127; 0 below 2**-126 (a code times it is below e4m3's range there)."""
    d = jnp.asarray(d, jnp.int32)
    bits = (jnp.clip(d, -126, 127) + 127).astype(jnp.uint32) << 23
    return jnp.where(d >= -126, jax.lax.bitcast_convert_type(bits, jnp.float32), 0.0)


def _exponent(x):
    """The unbiased exponent of a positive normal float32 power of two (int32)."""
    return ((_f32_bits(x) >> 23) & 0xFF).astype(jnp.int32) - 127


def fold_fp8_groups(codes, scales):
    """Folds UE8M0 group scales into e4m3 codes: [..., K] e4m3 and [..., K/128] scales -> (e4m3 [..., K] in the
    folded K order, float32 [...] token multipliers), with ``codes[k] * scales[k // 128] == folded * token`` up
    to the rounding below.

    Per token (the last axis): ``s_max`` = its largest scale, ``t`` = its largest ``|code| * scale`` (NaN codes
    left out), the lift ``j = clip(floor(log2(448 s_max / t)) - 1, 0, 15)`` (0 where ``t`` is 0), so that the
    token's largest folded code lands in [112, 448] (lift 0 for the quantizer's codes of a token whose largest
    |x| reaches its 1e-4 floor: its largest-scale group's largest code is at least 224); each code is multiplied
    by ``2**(e_g - e_max + j)`` (exact in float32) and rounded to e4m3 once, nearest even, and the token's
    multiplier is ``s_max * 2**-j``. A folded code below e4m3's smallest normal (2**-6) rounds to a multiple of
    2**-9: each activation moves by at most 2**-10 of its token's multiplier, which is under 2**-16.8 of the
    token's largest ``|x * scale|`` except for tokens whose lift the cap of 15 cuts (their largest code times its
    scale below ``448 s_max 2**-17``: quantized activations below about 2**-30). NaN codes stay NaN.

    Args:
      codes: float8_e4m3fn [..., K], K a multiple of 128.
      scales: float32 [..., K / 128], each a UE8M0 value (a power of two in [2**-126, 2**127]) as
        :func:`quantize_fp8_groups` with ``ue8m0=True`` makes them; other values fold inexactly (not checked:
        that would need the values).
    Returns:
      (float8_e4m3fn [..., K] in the folded K order (:func:`to_folded_k_order`), float32 [...]).
    Raises:
      TypeError naming ``codes`` (not float8_e4m3fn); ValueError naming ``codes`` (K not a positive multiple of
      128) or ``scales`` (not [..., K / 128]).
    """
    codes, scales = jnp.asarray(codes), jnp.asarray(scales, jnp.float32)
    _require(codes.dtype == _FP8, TypeError, f"fold_fp8_groups: codes must be float8_e4m3fn, got dtype {codes.dtype}")
    _check_k(codes, "fold_fp8_groups", "codes")
    g = codes.shape[-1] // 128
    _require(scales.shape == codes.shape[:-1] + (g,), ValueError,
             f"fold_fp8_groups: argument 'scales' must have shape {codes.shape[:-1] + (g,)}, got {scales.shape}")
    c = codes.reshape(codes.shape[:-1] + (g, 128)).astype(jnp.float32)
    e = _exponent(scales)  # [..., G]
    e_max = jnp.max(e, axis=-1)
    mag = jnp.max(jnp.where(jnp.isnan(c), 0.0, jnp.abs(c)), axis=-1)  # [..., G] largest |code| per group
    # rel = t / s_max = max_g |code| 2**(e_g - e_max): exact where it matters (a code times a power of two at
    # most 1; a group 2**-126 below the largest gives 0 here, and can be the largest only if all codes are that
    # small, where the lift is capped anyway).
    rel = jnp.max(mag * _pow2(e - e_max[..., None]), axis=-1)
    # floor(log2(448 / rel)) for rel = m 2**p (m in [1, 1.875], an e4m3 mantissa): 8 - p, 7 - p where m > 1.75
    bits = _f32_bits(rel)
    p = ((bits >> 23) & 0xFF).astype(jnp.int32) - 127  # -127 for a subnormal rel: the cap applies
    above = (bits & 0x7FFFFF) > 0x600000
    lift = jnp.where(rel > 0, 7 - p - above.astype(jnp.int32), 0)
    j = jnp.clip(lift, 0, FOLD_MAX_LIFT)
    d = e - e_max[..., None] + j[..., None]  # the group's ratio 2**d, d <= 15
    folded = _to_fp8(c * _pow2(d)[..., None])
    token = _pow2(e_max - j)
    return to_folded_k_order(folded.reshape(codes.shape)), token


def unfold_fp8_groups(folded, token):
    """Dequantizes folded activations: e4m3 [..., K] in the folded K order and float32 [...] multipliers ->
    float32 [..., K] in the caller's K order (``code * token``; float32 arithmetic: ``448 * 2**127`` overflows to
    Inf). Raises ValueError (from :func:`from_folded_k_order`, naming its ``codes``: here ``folded``) for a last
    axis that is not a positive multiple of 128."""
    folded, token = jnp.asarray(folded), jnp.asarray(token, jnp.float32)
    return from_folded_k_order(folded).astype(jnp.float32) * token[..., None]


def quantize_fp8_folded(x):
    """:func:`quantize_fp8_groups` with UE8M0 scales, then :func:`fold_fp8_groups`: float [..., K] ->
    (float8_e4m3fn [..., K] in the folded K order, float32 [...] token multipliers). The W4A8 grouped GEMM's
    128-token kernel reads this without a preparation pass (``ops.w4a8_grouped_gemm(..., x_layout="folded")``).
    Raises as :func:`quantize_fp8_groups` (``x`` not float, K not a multiple of 128)."""
    return fold_fp8_groups(*quantize_fp8_groups(x, 128, ue8m0=True))


def _pad_to(x, axis: int, multiple: int):
    pad = (-x.shape[axis]) % multiple
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def quantize_fp8_blocks(w, block: int = 128, ue8m0: bool = False):
    """fp8 weights with one scale per ``block x block`` tile (DeepSeek-V3 checkpoints).

    Edge tiles are zero-padded before the amax; ``amax`` is floored at 1e-4 so an all-zero block gets a
    finite scale and zero codes.

    Args:
      w: float [..., N, K].
    Returns:
      (float8_e4m3fn [..., N, K], float32 [..., ceil(N / block), ceil(K / block)]).
    """
    w = jnp.asarray(w)
    _require(jnp.issubdtype(w.dtype, jnp.floating), TypeError,
             f"quantize_fp8_blocks: w must be a float array, got dtype {w.dtype}")
    _require(w.ndim >= 2, ValueError, f"quantize_fp8_blocks: w must be [..., N, K], got {w.shape}")
    block = _check_size_arg(block, "block", "quantize_fp8_blocks")
    n, k = w.shape[-2:]
    p = _pad_to(_pad_to(w.astype(jnp.float32), -1, block), -2, block)
    nb, kb = p.shape[-2] // block, p.shape[-1] // block
    t = p.reshape(*p.shape[:-2], nb, block, kb, block)
    s = _fp8_scale(jnp.max(jnp.abs(t), axis=(-3, -1)), ue8m0)
    q = _to_fp8(t / s[..., :, None, :, None]).reshape(p.shape)[..., :n, :k]
    return q, s


def dequantize_fp8_blocks(q, scales, block: int = 128, dtype=jnp.float32):
    """Inverse of :func:`quantize_fp8_blocks`: [..., N, K] e4m3 and [..., ceil(N / block), ceil(K / block)] ->
    dtype [..., N, K]. Raises ValueError naming ``scales`` (or ``block``) when they do not fit ``q``."""
    q, scales = jnp.asarray(q), jnp.asarray(scales)
    block = _check_size_arg(block, "block", "dequantize_fp8_blocks")
    _require(q.ndim >= 2, ValueError, f"dequantize_fp8_blocks: q must be [..., N, K], got {q.shape}")
    n, k = q.shape[-2:]
    want = tuple(q.shape[:-2]) + (-(-n // block), -(-k // block))
    _require(tuple(scales.shape) == want, ValueError,
             f"dequantize_fp8_blocks: argument 'scales' must have shape {want} (one per {block} x {block} block of "
             f"q {tuple(q.shape)}), got {tuple(scales.shape)}")
    s = jnp.repeat(jnp.repeat(scales.astype(jnp.float32), block, axis=-2), block, axis=-1)
    return (q.astype(jnp.float32) * s[..., :n, :k]).astype(dtype)


def quantize_fp8_tensor(x, scale):
    """Static per-tensor fp8: ``e4m3(clip(x / scale, -448, 448))``: float [...] -> float8_e4m3fn [...], same shape;
    ``scale`` a float32 scalar."""
    x = jnp.asarray(x)
    scale = jnp.asarray(scale, jnp.float32)
    _require(scale.size == 1, ValueError,
             f"quantize_fp8_tensor: scale must be a scalar, got shape {scale.shape}")
    return _to_fp8(x.astype(jnp.float32) / scale.reshape(()))
