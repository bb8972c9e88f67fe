"""Independent float64 numpy references (they share no code with jax_w4a8.reference)."""

import ml_dtypes
import numpy as np


def unpack_int4(p):
    b = np.asarray(p).astype(np.uint8)
    lo = (b & 0xF).astype(np.int64)
    hi = (b >> 4).astype(np.int64)
    lo = np.where(lo >= 8, lo - 16, lo)
    hi = np.where(hi >= 8, hi - 16, hi)
    out = np.empty(b.shape[:-1] + (b.shape[-1] * 2,), np.int64)
    out[..., 0::2], out[..., 1::2] = lo, hi
    return out


def f64(a):
    a = np.asarray(a)
    if a.dtype == np.uint8 or a.dtype == ml_dtypes.float8_e8m0fnu:
        codes = a.view(np.uint8).astype(np.float64)
        return np.where(codes == 255, np.nan, np.exp2(codes - 127.0))
    return a.astype(np.float64)


def grouped_gemm(x, x_scale, w, w_scale, group_sizes, absolute=False):
    """out[m, n] = sum_g sa * sw * sum_k x * q, float64; rows by clamped group sizes. absolute: the same sum of
    |terms| (the scale of float32 / reduced-precision summation errors)."""
    if absolute:
        x, x_scale, w_scale = np.abs(f64(x)), np.abs(f64(x_scale)), np.abs(f64(w_scale))
    x = f64(x)
    m, k = x.shape
    q = unpack_int4(w).astype(np.float64)
    if absolute:
        q = np.abs(q)
    e, n, _ = q.shape
    g = k // 128
    sa = f64(x_scale)
    if sa.size == 1:
        sa = np.full((m, g), sa.item())
    elif sa.ndim == 1:
        sa = np.repeat(sa[:, None], g, axis=1)
    sw = f64(w_scale)
    out = np.zeros((m, n))
    start = 0
    for i, size in enumerate(np.asarray(group_sizes)):
        end = min(start + max(int(size), 0), m)
        for r in range(start, end):
            part = (x[r].reshape(g, 128)[None] * q[i].reshape(n, g, 128)).sum(-1)  # [n, g]
            out[r] = (part * sa[r][None] * sw[i]).sum(-1)
        start = end
    return out


def fp8_einsum_mhk(x, x_scale, w, w_scale):
    """x [M, H, K], w [H, N, K]; w_scale [H, ceil(N/128), G] (blocks) or [H, N, G] (rows)."""
    x, w = f64(x), f64(w)
    m, h, k = x.shape
    n = w.shape[1]
    g = k // 128
    sa, sb = f64(x_scale), f64(w_scale)
    if sb.shape[1] != n:
        sb = np.repeat(sb, 128, axis=1)[:, :n]
    part = np.einsum("mhgk,hngk->mhng", x.reshape(m, h, g, 128), w.reshape(h, n, g, 128))
    return np.einsum("mhng,mhg,hng->mhn", part, sa, sb)


def rel_err(out, ref):
    out = np.asarray(out, np.float64)
    assert np.isfinite(out).all(), "output holds NaN or Inf"
    denom = np.linalg.norm(ref)
    return np.linalg.norm(out - ref) / (denom if denom else 1.0)


def fold_groups(codes, scales):
    """The folded activations (jax_w4a8.quant.fold_fp8_groups) in float64 from their definition: per token the
    largest scale s_max, rel = max_g max|code_g| s_g / s_max (NaN codes left out), the lift j in [0, 15] with
    rel 2^(j+1) <= 448 < rel 2^(j+2) (0 where rel is 0), each code times s_g / s_max 2^j rounded once to e4m3,
    then the K order's word c + 8 i of each 128-code group moved to 4 c + i. Returns (e4m3 codes, float32 [...])."""
    c = np.asarray(codes).astype(np.float64)
    s = np.asarray(scales, np.float64)
    g = c.reshape(c.shape[:-1] + (-1, 128))
    s_max = s.max(-1)
    ratio = s / s_max[..., None]
    rel = np.max(np.nan_to_num(np.abs(g), nan=0.0).max(-1) * ratio, axis=-1)
    j = np.zeros(rel.shape, np.int64)
    for idx in np.ndindex(rel.shape):
        if rel[idx] > 0:
            lift = next(t for t in range(-300, 300) if rel[idx] * 2.0 ** (t + 1) <= 448 < rel[idx] * 2.0 ** (t + 2))
            j[idx] = min(max(lift, 0), 15)
    folded = (g * (ratio * np.exp2(j)[..., None])[..., None]).astype(ml_dtypes.float8_e4m3fn).reshape(c.shape)
    words = folded.view(np.uint8).reshape(c.shape[:-1] + (-1, 4, 8, 4))
    order = np.ascontiguousarray(np.swapaxes(words, -3, -2)).reshape(c.shape).view(ml_dtypes.float8_e4m3fn)
    return order, (s_max * np.exp2(-j)).astype(np.float32)
