"""The oracle: the ops in plain ``jnp`` with float32 math and one output rounding.

The same math as :mod:`jax_w4a8.ops` (which validates its arguments before calling here);
:func:`fp8_einsum` takes only the canonical batched form (x [M, H, K], w [H, N, K]; no equation). These are
written for clarity, not speed: use them to check kernels, or where no FFI build exists. On XLA's CPU backend
subnormal float32 values (a scale below 2**-126, UE8M0 code 0) are flushed to zero here, where the kernels and
the CPU handlers keep them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_w4a8 import quant

__all__ = ["expert_of_rows", "w4a8_grouped_gemm", "w4a8_moe_up", "fp8_einsum", "scale_to_f32"]

_HI = jax.lax.Precision.HIGHEST


def expert_of_rows(group_sizes, m: int):
    """Which expert owns each of ``m`` rows, with the kernels' clamping rule.

    Negative sizes count as 0 and the running end is cut at ``m``: expert ``e`` owns rows
    ``[min(S_e, m), min(S_{e+1}, m))`` with ``S_e = sum(max(group_sizes[:e], 0))``. Rows at or past
    ``min(S_E, m)`` belong to no expert and produce zeros.

    Returns:
      (expert int32 [m] (clipped into [0, E)), valid bool [m]).
    """
    sizes = jnp.clip(group_sizes.astype(jnp.int32), 0, m)
    # A saturating running sum (associative, never overflows): ends[e] = min(S_{e+1}, m).
    ends = jax.lax.associative_scan(lambda a, b: jnp.minimum(a + b, m), sizes)
    rows = jnp.arange(m, dtype=ends.dtype)
    expert = jnp.searchsorted(ends, rows, side="right")
    valid = rows < ends[-1]
    return jnp.minimum(expert, group_sizes.shape[0] - 1).astype(jnp.int32), valid


def _x_scale_per_group(x_scale, m: int, groups: int):
    """Expands a scalar / [M] / [M, G] activation scale to float32 [M, G]."""
    s = x_scale.astype(jnp.float32)
    if s.ndim == 2:
        return s
    if s.size == 1:
        return jnp.full((m, groups), s.reshape(()))
    return jnp.broadcast_to(s[:, None], (m, groups))


def w4a8_grouped_gemm(x, x_scale, w, w_scale, group_sizes, *, out_dtype=jnp.bfloat16):
    """SPEC 4.1 in fp32: x e4m3 [M, K], x_scale scalar / [M] / [M, K/128], w packed int4 [E, N, K/2], w_scale
    [E, N, K/128], group_sizes int32 [E] -> out_dtype [M, N] (details: :func:`jax_w4a8.ops.w4a8_grouped_gemm`)."""
    m, k = x.shape
    e, n, _ = w.shape
    groups = k // 128
    expert, valid = expert_of_rows(group_sizes, m)
    xg = x.astype(jnp.float32).reshape(m, groups, 128)
    sa = _x_scale_per_group(x_scale, m, groups)
    q = quant.unpack_int4(w).astype(jnp.float32).reshape(e, n, groups, 128)
    sw = w_scale.astype(jnp.float32)

    def one_expert(acc, args):
        q_e, sw_e, idx = args
        part = jnp.einsum("mgk,ngk->mng", xg, q_e, precision=_HI)  # exact partial sums per group
        y = jnp.einsum("mng,mg,ng->mn", part, sa, sw_e, precision=_HI)
        return acc + jnp.where((expert == idx)[:, None], y, 0.0), None

    out, _ = jax.lax.scan(one_expert, jnp.zeros((m, n), jnp.float32),
                          (q, sw, jnp.arange(e, dtype=jnp.int32)))
    return jnp.where(valid[:, None], out, 0.0).astype(out_dtype)


def scale_to_f32(s):
    """Scales of any shape as float32, same shape: float32 passes through; uint8 / float8_e8m0fnu UE8M0 codes are
    decoded exactly."""
    if s.dtype in (jnp.uint8, jnp.float8_e8m0fnu):
        return quant.decode_ue8m0(s)
    return s.astype(jnp.float32)


def fp8_einsum(x, x_scale, w, w_scale, *, out_dtype=jnp.bfloat16):
    """SPEC 4.2 in its batched canonical form (see :func:`jax_w4a8.ops.fp8_einsum`).

    Args:
      x: e4m3 [M, H, K]; x_scale [M, H, K/128].
      w: e4m3 [H, N, K]; w_scale [H, ceil(N/128), K/128] (128x128 blocks) or [H, N, K/128] (per row).
    Returns:
      out_dtype [M, H, N].
    """
    m, h, k = x.shape
    n = w.shape[1]
    groups = k // 128
    sa = scale_to_f32(x_scale)
    sb = scale_to_f32(w_scale)
    if sb.shape[1] != n:  # 128-row blocks -> per row
        sb = jnp.repeat(sb, 128, axis=1)[:, :n]
    xg = x.astype(jnp.float32).reshape(m, h, groups, 128)
    wg = w.astype(jnp.float32).reshape(h, n, groups, 128)
    part = jnp.einsum("mhgk,hngk->mhng", xg, wg, precision=_HI)
    out = jnp.einsum("mhng,mhg,hng->mhn", part, sa, sb, precision=_HI)
    return out.astype(out_dtype)


def w4a8_moe_up(x, x_scale, w13, w13_scale, group_sizes, *, down_input_scale=None, ue8m0=True):
    """The fused MoE up-projection, unfused in fp32 (see :func:`jax_w4a8.ops.w4a8_moe_up`): x e4m3 [M, K] with
    its scale, w13 packed int4 [E, 2I, K/2] (gate rows, then up rows) with w13_scale [E, 2I, K/128], group_sizes
    int32 [E] -> (e4m3 [M, I], float32 [M, I/128] scales, or the static scalar ``down_input_scale``).

    ``h = silu(gate) * up`` from the float32 grouped GEMM (gate rows [0, I), up rows [I, 2I) of w13),
    then fp8 codes: per tensor with ``down_input_scale``, else per token and 128 channels with UE8M0
    (``ue8m0``) or float32 scales. Rows not owned by any expert have h = 0.
    """
    y = w4a8_grouped_gemm(x, x_scale, w13, w13_scale, group_sizes, out_dtype=jnp.float32)
    inter = y.shape[-1] // 2
    h = jax.nn.silu(y[:, :inter]) * y[:, inter:]
    if down_input_scale is not None:
        s = jnp.asarray(down_input_scale, jnp.float32).reshape(())
        return quant.quantize_fp8_tensor(h, s), s
    return quant.quantize_fp8_groups(h, ue8m0=ue8m0)
