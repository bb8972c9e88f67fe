"""DeepSeek layers against independent float64 numpy references (and the golden RoPE tables).

The numpy helpers here (``np_fake_quant_fp8``, ``np_dequant_blocks``, ``np_unpack_int4``, ...) are also used by
test_deepseek_model.py and test_deepseek_checkpoint.py.
"""

import importlib.util
import math
import os
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jax_w4a8 import export_disabled_checks, ffi_available
from jax_w4a8.models.deepseek import layers
from jax_w4a8.models.deepseek.config import DeepseekConfig

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
FIXTURES = ["yarn_qlora", "plain_noqlora", "yarn_fused", "yarn_nomscale_nointerleave"]


def load_np_reference():
    """tests/golden/np_reference.py: transformers' forward in float64 numpy, written from SEMANTICS.md."""
    spec = importlib.util.spec_from_file_location("golden_np_reference", os.path.join(GOLDEN, "np_reference.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ----------------------------------------------------------------------------------------------
# float64 numpy references of the quantized formats (no jax_w4a8 code)
# ----------------------------------------------------------------------------------------------
def np_e4m3(y):
    """Saturating RNE cast to e4m3, returned as float64."""
    return np.clip(y, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def np_ceil_pow2(s):
    return np.exp2(np.ceil(np.log2(s)))


def np_fake_quant_fp8(x, ue8m0=False):
    """Per row and 128-channel group (last axis zero-padded to a multiple of 128): e4m3(x / s) * s.

    ``s = max(amax, 1e-4) / 448`` and ``x / s`` are evaluated in float32 (as SPEC's quantizer does), so a
    float32 input gets exactly the codes a float32 implementation must produce; the result is float64.
    """
    x = np.asarray(x, np.float32)
    k = x.shape[-1]
    pad = (-k) % 128
    xp = np.concatenate([x, np.zeros(x.shape[:-1] + (pad,), np.float32)], -1) if pad else x
    g = xp.reshape(*xp.shape[:-1], -1, 128)
    s = np.maximum(np.abs(g).max(-1, keepdims=True), np.float32(1e-4)) / np.float32(448.0)
    if ue8m0:
        s = np_ceil_pow2(s.astype(np.float64)).astype(np.float32)
    return (np_e4m3(g / s) * s.astype(np.float64)).reshape(xp.shape)[..., :k]


def np_fake_quant_tensor(x, s):
    """Static per-tensor: e4m3(clip(x / s)) * s with ``x / s`` in float32."""
    s = np.float32(s)
    return np_e4m3(np.asarray(x, np.float32) / s) * np.float64(s)


def np_dequant_blocks(q, s):
    """e4m3 [..., N, K] and [..., ceil(N/128), ceil(K/128)] scales -> float64."""
    q = np.asarray(q).astype(np.float64)
    n, k = q.shape[-2:]
    s = np.repeat(np.repeat(np.asarray(s, np.float64), 128, -2), 128, -1)[..., :n, :k]
    return q * s


def np_unpack_int4(p):
    b = np.asarray(p).view(np.uint8)
    lo, hi = (b & 0xF).astype(np.int64), (b >> 4).astype(np.int64)
    lo, hi = np.where(lo >= 8, lo - 16, lo), np.where(hi >= 8, hi - 16, hi)
    out = np.empty(b.shape[:-1] + (2 * b.shape[-1],), np.int64)
    out[..., 0::2], out[..., 1::2] = lo, hi
    return out


def np_pack_int4(q):
    q = np.asarray(q, np.int64) & 0xF
    return ((q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)).view(np.int8)


def np_dequant_w4(p, s):
    q = np_unpack_int4(p).astype(np.float64)
    return (q.reshape(*q.shape[:-1], s.shape[-1], 128) * np.asarray(s, np.float64)[..., None]).reshape(q.shape)


def np_silu(x):
    return x / (1.0 + np.exp(-x))


def f64(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


def rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


# ----------------------------------------------------------------------------------------------
# RMSNorm, RoPE
# ----------------------------------------------------------------------------------------------
def test_rms_norm(rng):
    x = (rng.standard_normal((3, 5, 64)) * 3).astype(np.float32)
    w = (1 + 0.2 * rng.standard_normal(64)).astype(np.float32)
    ref = w * (x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6))
    np.testing.assert_allclose(np.asarray(layers.rms_norm(jnp.asarray(x), jnp.asarray(w), 1e-6)), ref, rtol=2e-6,
                               atol=2e-6)
    # bf16: normalise in fp32, round to bf16, THEN multiply by the bf16 weight (transformers' order)
    xb, wb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    out = layers.rms_norm(xb, wb, 1e-6)
    assert out.dtype == jnp.bfloat16
    xf = f64(xb)
    normed = (xf / np.sqrt((xf ** 2).mean(-1, keepdims=True) + 1e-6)).astype(ml_dtypes.bfloat16)
    want = (normed.astype(np.float64) * f64(wb)).astype(ml_dtypes.bfloat16).astype(np.float64)
    got = f64(out)
    assert np.mean(got == want) > 0.99                      # exact but for fp32-vs-fp64 rounding ties
    # where the normalised value rounds the other way (one bf16 step, up to 2^-7 relative), the two products'
    # roundings (up to 2^-8 each) come on top: 2^-6 at most (one element in about 300 draws passed 2^-7, at 1.1e-2)
    np.testing.assert_allclose(got, want, rtol=2 ** -6)


@pytest.mark.parametrize("name", FIXTURES)
def test_rope_tables_match_transformers(name):
    cfg = DeepseekConfig.from_pretrained(os.path.join(GOLDEN, name))
    exp = np.load(os.path.join(GOLDEN, name, "expected.npz"))
    inv = layers.rope_inv_freq(cfg)
    assert inv.dtype == np.float32 and inv.shape == (cfg.qk_rope_head_dim // 2,)
    np.testing.assert_allclose(inv, exp["rope_inv_freq"], rtol=1e-6, atol=0)


def test_yarn_v3_correction_range():
    """V3 (d=64, base 1e4, original 4096, factor 40): indices 0..10 unchanged, 23..31 divided by 40."""
    yarn = DeepseekConfig.from_dict({"rope_scaling": {
        "type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1, "mscale_all_dim": 1}})
    plain = DeepseekConfig.from_dict({})
    ratio = layers.rope_inv_freq(yarn).astype(np.float64) / layers.rope_inv_freq(plain)
    np.testing.assert_allclose(ratio[:11], 1.0, rtol=1e-6)
    np.testing.assert_allclose(ratio[23:], 1 / 40, rtol=1e-6)
    assert np.all((ratio[11:23] < 1) & (ratio[11:23] > 1 / 40)) and np.all(np.diff(ratio) <= 1e-7)
    np.testing.assert_allclose(layers.rope_inv_freq(plain), 1e4 ** (-np.arange(0, 64, 2) / 64), rtol=1e-6)


def test_rope_cos_sin_scaling():
    cfg = DeepseekConfig.from_pretrained(os.path.join(GOLDEN, "yarn_nomscale_nointerleave"))
    pos = jnp.asarray([[0, 3, 7]], jnp.int32)
    cos, sin = layers.rope_cos_sin(pos, cfg, jnp.float32)
    ang = np.asarray([0, 3, 7])[:, None] * layers.rope_inv_freq(cfg).astype(np.float64)
    scale = 0.1 * math.log(4) + 1
    np.testing.assert_allclose(np.asarray(cos[0]), np.cos(ang) * scale, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(sin[0]), np.sin(ang) * scale, rtol=1e-6, atol=1e-6)
    cb, _ = layers.rope_cos_sin(pos, cfg, jnp.bfloat16)
    assert cb.dtype == jnp.bfloat16


def test_apply_rope_interleave_is_official_rotation_deinterleaved(rng):
    d = 8
    x = rng.standard_normal((4, 3, d)).astype(np.float32)       # [T, H, d]
    y = rng.standard_normal((4, d)).astype(np.float32)          # [T, d] (a key head)
    ang = rng.uniform(0, 6, (4, d // 2))
    cos, sin = np.cos(ang), np.sin(ang)
    got = np.asarray(layers.apply_rope(jnp.asarray(x), jnp.asarray(cos[:, None], jnp.float32),
                                       jnp.asarray(sin[:, None], jnp.float32), True))
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * (cos + 1j * sin)[:, None]    # DeepSeek's complex rotation
    official = np.empty_like(x, dtype=np.float64)
    official[..., 0::2], official[..., 1::2] = z.real, z.imag
    perm = np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])
    np.testing.assert_allclose(got, official[..., perm], rtol=1e-5, atol=1e-6)
    # q.k is the official one (same permutation on both sides)
    gy = np.asarray(layers.apply_rope(jnp.asarray(y), jnp.asarray(cos, jnp.float32), jnp.asarray(sin, jnp.float32),
                                      True))
    zy = (y[..., 0::2] + 1j * y[..., 1::2]) * (cos + 1j * sin)
    oy = np.empty_like(y, dtype=np.float64)
    oy[..., 0::2], oy[..., 1::2] = zy.real, zy.imag
    np.testing.assert_allclose(np.einsum("thd,sd->ths", got, gy), np.einsum("thd,sd->ths", official, oy),
                               rtol=1e-5, atol=1e-5)


def test_apply_rope_no_interleave_is_rotate_half(rng):
    d = 8
    x = rng.standard_normal((5, d)).astype(np.float32)
    ang = rng.uniform(0, 6, (5, d // 2))
    cos, sin = np.concatenate([np.cos(ang)] * 2, -1), np.concatenate([np.sin(ang)] * 2, -1)
    rot_half = np.concatenate([-x[:, d // 2:], x[:, :d // 2]], -1)
    got = layers.apply_rope(jnp.asarray(x), jnp.asarray(np.cos(ang), jnp.float32),
                            jnp.asarray(np.sin(ang), jnp.float32), False)
    np.testing.assert_allclose(np.asarray(got), x * cos + rot_half * sin, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# router
# ----------------------------------------------------------------------------------------------
def _np_router_margins(x, w, b, g, tg, k):
    """Smallest gaps that decide the group and expert choices (float64), per token."""
    s = 1 / (1 + np.exp(-(x @ w.T)))
    c = s + b
    n, e = c.shape
    grp = np.sort(c.reshape(n, g, e // g), -1)[..., -2:].sum(-1)
    gs = np.sort(grp, -1)[:, ::-1]
    gm = gs[:, tg - 1] - gs[:, tg] if tg < g else np.full(n, np.inf)
    keep = np.argsort(-grp, -1, kind="stable")[:, :tg]
    mask = np.zeros_like(grp, bool)
    np.put_along_axis(mask, keep, True, -1)
    cm = np.sort(np.where(np.repeat(mask, e // g, -1), c, -np.inf), -1)[:, ::-1]
    em = cm[:, k - 1] - cm[:, k] if k < e else np.full(n, np.inf)
    return np.minimum(gm, em)


@pytest.mark.parametrize("e,g,tg,k,norm,scale", [(16, 4, 2, 4, True, 2.5), (8, 1, 1, 2, True, 2.5),
                                                 (8, 4, 2, 3, False, 1.5), (32, 8, 4, 8, True, 2.5)])
def test_route_matches_numpy_reference(rng, e, g, tg, k, norm, scale):
    ref = load_np_reference()
    n, d = 64, 32
    x = rng.standard_normal((n, d)).astype(np.float32)
    w = (rng.standard_normal((e, d)) * 1.5 / math.sqrt(d)).astype(np.float32)
    b = (rng.standard_normal(e) * 0.15).astype(np.float32)
    c = {"n_routed_experts": e, "n_group": g, "topk_group": tg, "num_experts_per_tok": k, "norm_topk_prob": norm,
         "routed_scaling_factor": scale}
    params = {"mlp.gate.weight": w.astype(np.float64), "mlp.gate.e_score_correction_bias": b.astype(np.float64)}
    idx, wts = ref.router(c, params, "mlp.", x.astype(np.float64))
    ids, weights = layers.route(jnp.asarray(x), jnp.asarray(w), jnp.asarray(b), n_group=g, topk_group=tg, top_k=k,
                                norm_topk_prob=norm, routed_scaling_factor=scale)
    assert ids.dtype == jnp.int32 and weights.dtype == jnp.float32
    ids, weights = np.asarray(ids), np.asarray(weights)
    order = np.argsort(ids, -1)
    ids, weights = np.take_along_axis(ids, order, -1), np.take_along_axis(weights, order, -1)
    ok = _np_router_margins(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64), g, tg, k) > 1e-5
    assert ok.sum() >= n - 2, "random data with near-ties; rerun"
    np.testing.assert_array_equal(ids[ok], idx[ok])
    np.testing.assert_allclose(weights[ok], wts[ok], rtol=1e-5)


def test_route_masks_groups_with_minus_inf():
    """All biased scores negative: masking dropped groups with 0.0 (the old hub code) would pick them."""
    e, g = 8, 4
    x = np.eye(8, dtype=np.float32)[:4] * 3
    w = np.eye(8, dtype=np.float32)
    b = np.full(e, -2.0, np.float32)
    ids, weights = layers.route(jnp.asarray(x), jnp.asarray(w), jnp.asarray(b), n_group=g, topk_group=1, top_k=2,
                                norm_topk_prob=False, routed_scaling_factor=1.5)
    ids = np.asarray(ids)
    # token t has its large logit on expert t, so group t // 2 wins; both experts come from it
    np.testing.assert_array_equal(np.sort(ids, -1), [[0, 1], [0, 1], [2, 3], [2, 3]])
    s = 1 / (1 + np.exp(-(x @ w.T)))
    np.testing.assert_allclose(np.asarray(weights), np.take_along_axis(s, ids, -1) * 1.5, rtol=1e-6)


# ----------------------------------------------------------------------------------------------
# attention
# ----------------------------------------------------------------------------------------------
def test_mla_attention_matches_numpy(rng):
    b, t, s, h, dn, dr, dv = 2, 5, 7, 3, 4, 2, 6
    qn, qp = rng.standard_normal((b, t, h, dn)), rng.standard_normal((b, t, h, dr))
    kn, kp, v = rng.standard_normal((b, s, h, dn)), rng.standard_normal((b, s, dr)), rng.standard_normal((b, s, h, dv))
    mask = rng.random((b, t, s)) < 0.7
    mask[..., 0] = True
    scale = 0.37
    args = [jnp.asarray(a, jnp.float32) for a in (qn, qp, kn, kp, v)]
    got = np.asarray(layers.mla_attention(*args, jnp.asarray(mask), scale))
    sc = (np.einsum("bthd,bshd->bhts", qn, kn) + np.einsum("bthr,bsr->bhts", qp, kp)) * scale
    sc = np.where(mask[:, None], sc, -np.inf)
    p = np.exp(sc - sc.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(got, np.einsum("bhts,bshd->bthd", p, v), rtol=1e-5, atol=1e-5)


def _mla_attention_case(rng, b=2, t=6, s=9, h=3, dn=16, dr=8, dv=16, dtype=jnp.float32, pad=None):
    qn, qp = rng.standard_normal((b, t, h, dn)), rng.standard_normal((b, t, h, dr))
    kn, kp, v = rng.standard_normal((b, s, h, dn)), rng.standard_normal((b, s, dr)), rng.standard_normal((b, s, h, dv))
    pad = rng.integers(0, 3, b) if pad is None else np.asarray(pad)  # left padding, then causal over the last t keys
    keys, queries = np.arange(s), np.arange(s - t, s)
    mask = (keys[None, None] <= queries[None, :, None]) & (keys[None, None] >= pad[:, None, None])
    return [jnp.asarray(a, dtype) for a in (qn, qp, kn, kp, v)], jnp.asarray(mask)


def test_mla_attention_as_one_dot_product_attention(rng):
    """The fused path's operands (q = [q_nope | q_pe], k_pe broadcast to heads, v zero-padded to the qk head
    dim, mask per batch) through jax.nn.dot_product_attention's XLA reference equal the eager attention;
    queries whose mask allows no key (pad slots) come out as zeros."""
    args, mask = _mla_attention_case(rng)
    eager = np.asarray(layers.mla_attention(*args, mask, 0.29, implementation="eager"))
    fused = np.asarray(layers._sdpa(*args, mask, 0.29, "xla"))
    assert fused.shape == eager.shape == (2, 6, 3, 16)
    np.testing.assert_allclose(fused, eager, rtol=2e-5, atol=2e-5)
    if not layers._cudnn_attention_possible(jnp.bfloat16):     # no GPU: "auto" is the eager attention
        np.testing.assert_array_equal(np.asarray(layers.mla_attention(*args, mask, 0.29, implementation="auto")),
                                      eager)
    with pytest.raises(ValueError, match="implementation"):
        layers.mla_attention(*args, mask, 0.29, implementation="flash")
    with pytest.raises(ValueError, match="bf16"):
        layers.mla_attention(*args, mask, 0.29, implementation="cudnn")     # float32 activations
    # a prefill (S == T: left padding, then causal) with the causal promise the fused kernel uses
    args, mask = _mla_attention_case(rng, t=9, s=9, pad=(2, 0))
    eager = np.asarray(layers.mla_attention(*args, mask, 0.29, implementation="eager", causal=True))
    fused = np.asarray(layers._sdpa(*args, mask, 0.29, "xla", causal=True))
    real = np.asarray(mask).any(-1)                                  # query rows that attend something
    assert not real.all() and not fused[~real].any()
    np.testing.assert_allclose(fused[real], eager[real], rtol=2e-5, atol=2e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dims", [(128, 64, 128), (16, 8, 16)])
def test_mla_attention_cudnn_matches_eager_on_gpu(rng, dims):
    """cuDNN's fused attention (scores never in memory) against the eager one, bf16, MLA's head dims
    (qk 192, v 128) and a tiny model's: left padding, then a window of queries (T < S) or a prefill (T == S,
    causal: cuDNN skips the blocks above the diagonal; pad queries come out as zeros)."""
    dn, dr, dv = dims
    gpu = jax.devices("gpu")[0]

    def attend(args, mask, impl, causal=False):
        fn = jax.jit(lambda *a: layers.mla_attention(*a, 0.1, implementation=impl, causal=causal))
        return np.asarray(fn(*args, mask), np.float32), fn.lower(*args, mask).as_text()

    for t, s, causal in ((256, 384, False), (256, 256, True)):
        args, mask = jax.device_put(_mla_attention_case(rng, b=2, t=t, s=s, h=4, dn=dn, dr=dr, dv=dv,
                                                        dtype=jnp.bfloat16, pad=(5, 0)), gpu)
        real = np.asarray(mask).any(-1)
        e, _ = attend(args, mask, "eager")
        f, text = attend(args, mask, "cudnn", causal)
        assert "__cudnn$fmha" in text, "no cuDNN fused attention in the lowered program"
        assert np.isfinite(f).all() and not f[~real].any()
        assert rel(f64(f[real]), f64(e[real])) < 1e-2, (t, s, rel(f64(f[real]), f64(e[real])))
    auto, text = attend(args, mask, "auto", causal=True)             # the same inputs as the last cudnn call
    assert "__cudnn$fmha" in text, "auto did not take cuDNN's fused attention on this GPU"
    np.testing.assert_array_equal(auto, f)


@pytest.mark.parametrize("latent", [False, True])
def test_attention_in_query_blocks_is_the_same(rng, monkeypatch, latent):
    """Long prompts attend in query blocks (bounded score memory): forced here to blocks of 2 and 3 queries of
    T = 7 (a padded last block), against the one-block result and float64 numpy."""
    b, t, s, h, dn, dr, dv = 2, 7, 9, 3, 4, 2, 6
    qn, qp = rng.standard_normal((b, t, h, dn)), rng.standard_normal((b, t, h, dr))
    kn, kp, v = rng.standard_normal((b, s, h, dn)), rng.standard_normal((b, s, dr)), rng.standard_normal((b, s, h, dv))
    mask = rng.random((b, t, s)) < 0.7
    mask[..., 0] = True
    mask[1, 3] = False  # a query that may attend nothing: uniform weights, like the one-block path
    if latent:  # q_lat . c_kv with c_kv playing keys and values ([B, S, R], R = dn)
        args = [jnp.asarray(a, jnp.float32) for a in (qn, qp, kn[:, :, 0], kp)]
        fn = lambda *a: layers.mla_latent_attention(*a, jnp.asarray(mask), 0.37)  # noqa: E731
    else:
        args = [jnp.asarray(a, jnp.float32) for a in (qn, qp, kn, kp, v)]
        fn = lambda *a: layers.mla_attention(*a, jnp.asarray(mask), 0.37)  # noqa: E731
    def run():
        # jax.jit caches traces by function and argument types, not by the module global read at trace time:
        # drop the caches so each ATTENTION_SCORE_BYTES really gets its own trace.
        jax.clear_caches()
        jitted = jax.jit(lambda *a: fn(*a))
        return np.asarray(jitted(*args)), jitted.lower(*args).as_text()

    whole, whole_text = run()
    assert "stablehlo.while" not in whole_text, "the one-block attention already loops over query blocks"
    for queries in (2, 3):
        monkeypatch.setattr(layers, "ATTENTION_SCORE_BYTES", queries * b * h * s * 4)
        got, text = run()
        assert "stablehlo.while" in text, f"blocks of {queries} queries did not lower to a loop over query blocks"
        assert got.shape == whole.shape
        np.testing.assert_allclose(got, whole, rtol=1e-6, atol=1e-6)
    sc = np.einsum("bthd,bsd->bhts" if latent else "bthd,bshd->bhts", qn, kn[:, :, 0] if latent else kn)
    sc = (sc + np.einsum("bthr,bsr->bhts", qp, kp)) * 0.37
    sc = np.where(mask[:, None], sc, -1e300)
    p = np.exp(sc - sc.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ref = np.einsum("bhts,bsd->bthd", p, kn[:, :, 0]) if latent else np.einsum("bhts,bshd->bthd", p, v)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Linear formats
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k,n,ue8m0", [(256, 200, False), (64, 96, False), (384, 130, True), (16, 40, True)])
def test_linear_fp8_is_blockwise_fp8_math(rng, k, n, ue8m0):
    lin = layers.Linear(k, n, quant="fp8", dtype=jnp.float32, ue8m0=ue8m0, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    assert lin.weight.dtype == jnp.float8_e4m3fn and lin.weight_scale_inv.shape == (-(-n // 128), -(-k // 128))
    if ue8m0:
        s = np.asarray(lin.weight_scale_inv[...])
        np.testing.assert_array_equal(s, np_ceil_pow2(s))
    x = (rng.standard_normal((2, 3, k)) * rng.uniform(0.1, 10, (2, 3, 1))).astype(np.float32)
    got = np.asarray(lin(jnp.asarray(x)))
    ref = np_fake_quant_fp8(x, ue8m0) @ np_dequant_blocks(lin.weight[...], lin.weight_scale_inv[...]).T
    assert got.shape == (2, 3, n)
    # Exact codes: the activation quantizer (ops.quantize_fp8_groups) divides as IEEE float32 does, as numpy's
    # x / s here (XLA's jnp quantizer may not: it rewrites x / s as x * (1 / s)); what is left is float32 sums.
    row_rel = np.linalg.norm((got - ref).reshape(6, n), axis=1) / np.linalg.norm(ref.reshape(6, n), axis=1)
    assert row_rel.max() < 1e-5, row_rel
    lin_bf16 = layers.Linear(k, n, quant="fp8", dtype=jnp.bfloat16, ue8m0=ue8m0, rngs=nnx.Rngs(0))
    lin_bf16.weight[...], lin_bf16.weight_scale_inv[...] = lin.weight[...], lin.weight_scale_inv[...]
    xb = jnp.asarray(x, jnp.bfloat16)
    yb = lin_bf16(xb)
    xq = np_fake_quant_fp8(np.asarray(xb, np.float32).reshape(6, k), ue8m0)  # the bf16 inputs' exact codes
    ref_b = (xq @ np_dequant_blocks(lin.weight[...], lin.weight_scale_inv[...]).T).reshape(2, 3, n)
    assert yb.dtype == jnp.bfloat16 and rel(f64(yb), ref_b) < 4e-3      # one bf16 output rounding


def test_linear_dense_and_bias(rng):
    lin = layers.Linear(24, 10, use_bias=True, dtype=jnp.float32, rngs=nnx.Rngs(3))
    lin.bias[...] = jnp.asarray(rng.standard_normal(10), jnp.float32)
    x = rng.standard_normal((4, 24)).astype(np.float32)
    ref = x.astype(np.float64) @ f64(lin.weight[...]).T + f64(lin.bias[...])
    np.testing.assert_allclose(np.asarray(lin(jnp.asarray(x))), ref, rtol=1e-5, atol=1e-5)


def _small_config(**overrides):
    """A DeepSeek-V3-shaped config whose contracted dims are multiples of 128 (the ops' FP8 / W4A8 paths)."""
    return DeepseekConfig.from_dict(dict(dict(
        vocab_size=64, hidden_size=256, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=128, q_lora_rank=128, qk_rope_head_dim=64,
        v_head_dim=128, qk_nope_head_dim=128, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1), **overrides))


def custom_calls(text):
    """The jax_w4a8 custom-call targets of a lowered program's text, sorted (``jax_w4a8_`` prefix dropped)."""
    return sorted(re.findall(r"stablehlo\.custom_call @jax_w4a8_(\w+)", text))


def _calls(fn, *args):
    """Custom-call targets of ``fn``'s lowered program, counted (``jax_w4a8_`` prefix dropped)."""
    import collections
    return collections.Counter(custom_calls(jax.jit(fn).lower(*args).as_text()))


@pytest.mark.parametrize("rows,quant,ue8m0", [((128, 72), "fp8", False), ((256, 130), "fp8", True),
                                              ((40, 90), "fp8", False), ((40, 90), "none", False)])
def test_linear_parts_are_their_checkpoint_tensors_side_by_side(rng, rows, quant, ue8m0):
    """A fused Linear (``parts``) computes each part as that part's own Linear would: FP8 block rows per part
    (one product when the parts sit on the 128-row grid, one per part otherwise), against float64 numpy."""
    k, n = 256, sum(rows)
    seed = int(rng.integers(1 << 30))
    lin = layers.Linear(k, n, quant=quant, dtype=jnp.float32, ue8m0=ue8m0, use_bias=True,
                        parts=(("a_proj", rows[0]), ("b_proj", rows[1])), rngs=nnx.Rngs(seed))
    lin.bias[...] = jnp.asarray(rng.standard_normal(n), jnp.float32)
    x = (rng.standard_normal((5, k)) * rng.uniform(0.1, 10, (5, 1))).astype(np.float32)
    got = np.asarray(lin(jnp.asarray(x)))
    w = f64(lin.weight[...])
    if quant == "fp8":
        nb = [-(-r // 128) for r in rows]
        assert lin.weight_scale_inv.shape == (sum(nb), k // 128)
        assert lin.part_slices() == [(slice(0, rows[0]), slice(0, nb[0])),
                                     (slice(rows[0], n), slice(nb[0], nb[0] + nb[1]))]
        s = np.asarray(lin.weight_scale_inv[...])
        q = lin.weight[...]
        w = np.concatenate([np_dequant_blocks(q[:rows[0]], s[:nb[0]]), np_dequant_blocks(q[rows[0]:], s[nb[0]:])])
        x = np_fake_quant_fp8(x, ue8m0)
        aligned = rows[0] % 128 == 0
        assert lin.block_aligned == aligned
        assert _calls(lin, jnp.asarray(x, jnp.float32))["fp8_einsum"] == (1 if aligned else 2)
    ref = x.astype(np.float64) @ w.T + f64(lin.bias[...])
    row_rel = np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)
    assert got.shape == (5, n) and row_rel.max() < 1e-5, row_rel
    with pytest.raises(ValueError, match="parts"):
        layers.Linear(k, n + 1, parts=(("a_proj", rows[0]), ("b_proj", rows[1])), rngs=nnx.Rngs(0))
    if quant == "none":   # pre-quantized activations need FP8 weights
        with pytest.raises(ValueError, match="quant='fp8'"):
            lin.apply_quantized(*layers.quantize_act_groups(jnp.asarray(x, jnp.float32)))


@pytest.mark.parametrize("inter,ue8m0", [(256, False), (128, True), (96, False)])
def test_mlp_fp8_matches_float64_and_fuses_the_activation(rng, inter, ue8m0):
    """SwiGLU with FP8 linears: gate and up in one product, silu(gate) * up quantized for down by one kernel
    (I a multiple of 128), against float64 numpy over the stored weights."""
    d = 256
    m = layers.MLP(d, inter, quant="fp8", dtype=jnp.float32, ue8m0=ue8m0, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    x = (rng.standard_normal((7, d)) * rng.uniform(0.1, 10, (7, 1))).astype(np.float32)
    got = np.asarray(m(jnp.asarray(x)))
    nb = -(-inter // 128)
    s, q = np.asarray(m.gate_up_proj.weight_scale_inv[...]), m.gate_up_proj.weight[...]
    gate = np_dequant_blocks(q[:inter], s[:nb])
    up = np_dequant_blocks(q[inter:], s[nb:])
    down = np_dequant_blocks(m.down_proj.weight[...], m.down_proj.weight_scale_inv[...])
    xq = np_fake_quant_fp8(x, ue8m0).astype(np.float64)
    h = np_silu(xq @ gate.T) * (xq @ up.T)
    ref = np_fake_quant_fp8(h, ue8m0) @ down.T
    # float32 vs float64 h can round to a neighbouring e4m3 code (see test_experts_match_row_loop)
    row_rel = np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)
    assert rel(got, ref) < 2e-2 and np.mean(row_rel < 1e-4) > 0.5, row_rel
    calls = _calls(m, jnp.asarray(x))
    if inter % 128 == 0:
        assert calls["fp8_einsum"] == 2 and calls["quantize_fp8_groups"] == 2, calls
    else:  # gate and up off the 128-row grid: a product each; then silu_mul, a quantizer and down
        assert calls["fp8_einsum"] == 3 and calls["quantize_fp8_groups"] == 2, calls


def test_mla_project_is_queries_and_latents_from_one_product(rng):
    from jax_w4a8.models.deepseek import QuantConfig
    cfg = _small_config(num_hidden_layers=1, n_routed_experts=4)
    mla = layers.MLA(cfg, quant=QuantConfig(linear="fp8"), dtype=jnp.float32, rngs=nnx.Rngs(1))
    assert mla.qkv_a_proj.parts == (("q_a_proj", 128), ("kv_a_proj_with_mqa", 192))
    x = jnp.asarray(rng.standard_normal((1, 3, 256)), jnp.float32)
    cos, sin = layers.rope_cos_sin(jnp.arange(3)[None], cfg, jnp.float32)
    got = mla.project(x, cos, sin)
    for g, w_ in zip(got, (*mla.queries(x, cos, sin), *mla.latents(x, cos, sin)), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w_))
    # the HF computation with q_a_proj and kv_a_proj_with_mqa as separate linears (rows 0:128 and 128:320 of
    # the fused weight, block rows 0:1 and 1:3 of its scales)
    q_a, kv_a = (layers.Linear(256, n, quant="fp8", dtype=jnp.float32, rngs=nnx.Rngs(0)) for n in (128, 192))
    fused = mla.qkv_a_proj
    q_a.weight[...], q_a.weight_scale_inv[...] = fused.weight[...][:128], fused.weight_scale_inv[...][:1]
    kv_a.weight[...], kv_a.weight_scale_inv[...] = fused.weight[...][128:], fused.weight_scale_inv[...][1:]
    q = mla.q_b_proj(mla.q_a_layernorm(q_a(x))).reshape(1, 3, 2, 192)
    ckv = kv_a(x)
    want = (q[..., :128], layers.apply_rope(q[..., 128:], cos[..., None, :], sin[..., None, :], cfg.rope_interleave),
            mla.kv_a_layernorm(ckv[..., :128]), layers.apply_rope(ckv[..., 128:], cos, sin, cfg.rope_interleave))
    for g, w_ in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w_), rtol=1e-6, atol=1e-6)
    # q_a and kv_a are one einsum (then q_b), from one quantization of x
    calls = _calls(lambda v: mla.project(v, cos, sin), x)
    assert calls["fp8_einsum"] == 2 and calls["quantize_fp8_groups"] == 2, calls


# ----------------------------------------------------------------------------------------------
# experts
# ----------------------------------------------------------------------------------------------
def np_experts(m: layers.Experts, x, group_sizes, act="none", ue8m0=False, static=None):
    """Row loop in float64 over the *stored* formats. act: "none" | "fp8" (fake-quant per group) |
    "static" (fake-quant per tensor with scales ``static = (s_gate_up, s_down)``)."""
    e, i = m.num_experts, m.inter
    if m.quant == "none":
        gu, dn = f64(m.gate_up_proj[...]), f64(m.down_proj[...])
    elif m.quant == "fp8":
        nb = -(-i // 128)
        s = np.asarray(m.gate_up_proj_scale_inv[...])
        q = m.gate_up_proj[...]
        gu = np.concatenate([np_dequant_blocks(q[:, :i], s[:, :nb]), np_dequant_blocks(q[:, i:], s[:, nb:])], 1)
        dn = np_dequant_blocks(m.down_proj[...], m.down_proj_scale_inv[...])
    else:
        gu = np_dequant_w4(m.gate_up_proj[...], np.asarray(m.gate_up_proj_scale_inv[...]))
        dn = np_dequant_w4(m.down_proj[...], np.asarray(m.down_proj_scale_inv[...]))

    def q(v, which):
        if act == "fp8":
            return np_fake_quant_fp8(v, ue8m0)
        if act == "static":
            return np_fake_quant_tensor(v, static[which])
        return v

    out = np.zeros((x.shape[0], m.hidden))
    row = 0
    for j, size in enumerate(group_sizes):
        for r in range(row, row + size):
            a = q(x[r:r + 1].astype(np.float64), 0)[0]
            g = gu[j] @ a
            hh = q((np_silu(g[:i]) * g[i:])[None], 1)[0]
            out[r] = dn[j] @ hh
        row += size
    return out


@pytest.mark.parametrize("kind,act", [("none", "none"), ("fp8", "fp8"), ("w4a8", "fp8"), ("w4a8", "static")])
def test_experts_match_row_loop(rng, kind, act):
    e, d, i = 6, 256, 128
    static = act == "static"
    m = layers.Experts(e, d, i, quant=kind, dtype=jnp.float32, act_scale="static" if static else "dynamic",
                       input_scales=static, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    sizes = rng.multinomial(23, np.full(e, 1 / e))
    sizes[rng.integers(e)] = 0                                       # an expert without rows
    r = int(sizes.sum())
    x = rng.standard_normal((r, d)).astype(np.float32)
    scales = None
    if static:
        gis = rng.uniform(0.5, 1.5, (e, 2)) * np.abs(x).max() / 448
        dis = rng.uniform(0.5, 1.5, e) * 0.02
        m.gate_up_proj_input_scale[...] = jnp.asarray(gis, jnp.float32)
        m.down_proj_input_scale[...] = jnp.asarray(dis, jnp.float32)
        scales = (np.float32(gis.max()), np.float32(dis.max()))       # max over the layer's experts
    got = np.asarray(jax.jit(lambda a, b: m(a, b))(jnp.asarray(x), jnp.asarray(sizes, jnp.int32)))
    ref = np_experts(m, x, sizes, act, static=scales)
    assert got.shape == (r, d)
    if act == "none":
        assert rel(got, ref) < 1e-5
    else:
        # fp32 vs fp64 values of silu(gate) * up, and XLA's x * (1 / s) for SPEC's x / s, can round to
        # neighbouring fp8 codes: a flip in h moves one row by ~1e-3, one in x (through the gate's SiLU and the
        # second quantization) by up to ~3e-2, which alone took the whole-output error to 4.6e-3 (seed 199 of a
        # 1600-seed scan; worst 6.1e-3). Most rows are exact to fp32 accuracy (worst scan 94%): the real check.
        row_rel = np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)
        assert rel(got, ref) < 2e-2 and np.mean(row_rel < 1e-5) > 0.75, (rel(got, ref), row_rel)


@pytest.mark.parametrize("ue8m0", [False, True])
def test_w4a8_experts_take_rows_quantized_before_the_gather(rng, ue8m0):
    """Quantizing per row commutes with sorting rows by expert: MoE quantizes its tokens once (the shared
    expert's quantizer call too) and gathers codes and scales; the result is bit for bit the gathered-bf16 one."""
    from jax_w4a8 import moe
    m = layers.Experts(8, 256, 128, quant="w4a8", dtype=jnp.bfloat16, ue8m0=ue8m0, rngs=nnx.Rngs(2))
    assert m.quantizes_input
    x = jnp.asarray(rng.standard_normal((9, 256)) * 3, jnp.bfloat16)
    ids = jnp.asarray(rng.integers(0, 8, (9, 2)), jnp.int32)
    weights = jnp.asarray(rng.uniform(0.1, 1, (9, 2)), jnp.float32)
    after = jax.jit(lambda v: moe.moe_apply(v, ids, weights, m, 8))(x)
    before = jax.jit(lambda v: moe.moe_apply(m.quantize_input(v), ids, weights, m, 8))(x)
    np.testing.assert_array_equal(np.asarray(before), np.asarray(after))
    assert np.isfinite(np.asarray(after)).all() and np.abs(np.asarray(after)).max() > 0
    with pytest.raises(TypeError, match="quantized"):
        layers.Experts(8, 256, 128, quant="none", rngs=nnx.Rngs(0))(m.quantize_input(x), jnp.zeros(8, jnp.int32))


def _fusable_experts(seed, e=8, d=256, i=256, ue8m0=True):
    m = layers.Experts(e, d, i, quant="w4a8", dtype=jnp.bfloat16, ue8m0=ue8m0, rngs=nnx.Rngs(seed))
    assert m.can_fuse_up and m.moe_up == "auto"                      # the default
    return m


def _expert_rows(rng, m, rows):
    sizes = rng.multinomial(rows, np.full(m.num_experts, 1 / m.num_experts))
    sizes[rng.integers(m.num_experts)] = 0                           # an expert without rows
    x = jnp.asarray(rng.standard_normal((int(sizes.sum()), m.hidden)) * 2, jnp.bfloat16)
    return x, jnp.asarray(sizes, jnp.int32)


def _static_experts(rng, seed, e=8, d=256, i=256, dtype=jnp.bfloat16):
    """W4A8 experts with the checkpoint's per-expert input scales (random, as a W4AFP8 checkpoint has them)."""
    m = layers.Experts(e, d, i, quant="w4a8", dtype=dtype, act_scale="static", input_scales=True,
                       rngs=nnx.Rngs(seed))
    m.gate_up_proj_input_scale[...] = jnp.asarray(rng.uniform(0.5, 1.5, (e, 2)) * 6 / 448, jnp.float32)
    m.down_proj_input_scale[...] = jnp.asarray(rng.uniform(0.5, 1.5, e) * 0.05, jnp.float32)
    return m


def test_experts_can_fuse_up_w4a8_in_bf16_with_any_activation_scales():
    ok = dict(quant="w4a8", dtype=jnp.bfloat16, ue8m0=True)
    static = dict(ue8m0=False, act_scale="static", input_scales=True)
    for scales in (dict(), dict(ue8m0=False), static):
        assert layers.Experts(4, 256, 128, **{**ok, **scales}, rngs=nnx.Rngs(0)).can_fuse_up, scales
    for change in (dict(dtype=jnp.float32), dict(quant="fp8"), dict(quant="none"), dict(static, dtype=jnp.float32)):
        assert not layers.Experts(4, 256, 128, **{**ok, **change}, rngs=nnx.Rngs(0)).can_fuse_up, change


def _run_experts(m, x, sizes):
    """The experts jitted as a split model is (graphdef static: ``moe_up`` retraces): (output f32, HLO text)."""
    graphdef, state = nnx.split(m)
    fn = jax.jit(lambda st, a, g: nnx.merge(graphdef, st)(a, g))
    return np.asarray(fn(state, x, sizes), np.float32), fn.lower(state, x, sizes).as_text()


@pytest.mark.parametrize("ue8m0", [True, False])
@pytest.mark.parametrize("impl", ["fused", "auto"])
def test_experts_fused_up_off_hopper_is_the_unfused_sequence(rng, impl, ue8m0):
    """Off Hopper ``ops.w4a8_moe_up`` composes the ops the unfused path runs (the grouped GEMM to bf16, then
    SiLU-mul and the quantizer in one pass): the same weights, scales and rows give the same bits. (On the CPU,
    also on a GPU host; the GPU test below runs the fused kernel.)"""
    m = _fusable_experts(int(rng.integers(1 << 30)), ue8m0=ue8m0)
    x, sizes = _expert_rows(rng, m, 37)
    m.moe_up = "unfused"
    want, _ = _run_experts(m, x, sizes)
    m.moe_up = impl
    got, _ = _run_experts(m, x, sizes)
    assert np.isfinite(got).all() and np.abs(got).max() > 0
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("impl", ["fused", "auto"])
def test_experts_fused_up_with_static_scales_off_hopper(rng, impl):
    """Static scales: off Hopper the fused op composes the grouped GEMM with SiLU-mul and the per-tensor quantizer
    in float32 (the unfused path rounds h to bf16 first), so the two differ by a few e4m3 codes of h; both match
    the float64 row loop (whose h is not rounded either)."""
    m = _static_experts(rng, int(rng.integers(1 << 30)))
    x, sizes = _expert_rows(rng, m, 37)
    m.moe_up = "unfused"
    unfused, _ = _run_experts(m, x, sizes)
    m.moe_up = impl
    got, _ = _run_experts(m, x, sizes)
    _check_experts_against_row_loop(m, x, sizes, got)
    _check_experts_against_row_loop(m, x, sizes, unfused)
    assert 0 < rel(got, unfused) < 4e-2      # not the same program: h rounded to bf16 or not (60 seeds: 0.6-1.8%)


@pytest.mark.skipif(not ffi_available("cuda"), reason=ffi_available("cuda").reason)
def test_experts_moe_up_lowers_to_the_fused_kernel_for_cuda():
    """What each ``moe_up`` puts in the program XLA gets for a GPU (lowered for CUDA here, through jax.export):
    "fused" the fused up-projection; "auto" the same up to 64 expected rows per expert and the unfused pair
    above; "unfused" the grouped GEMM and the silu-mul quantizer, as experts that cannot fuse do whatever their
    ``moe_up`` (a float32 module here). Rows arrive quantized, as MoE passes them."""
    fusable = _fusable_experts(0, e=8)
    other = layers.Experts(8, 256, 256, quant="w4a8", dtype=jnp.float32, ue8m0=True, rngs=nnx.Rngs(0))
    static = _static_experts(np.random.default_rng(0), 0)           # x and h quantized per tensor, in XLA

    def targets(impl, rows, m=fusable):
        m.moe_up = impl
        graphdef, state = nnx.split(m)
        fn = jax.jit(lambda st, a, g: nnx.merge(graphdef, st)(a, g))
        x = jax.ShapeDtypeStruct((rows, m.hidden), jnp.bfloat16)
        if m.quantizes_input:  # (codes, scales), as MoE passes them
            x = (jax.ShapeDtypeStruct((rows, m.hidden), jnp.float8_e4m3fn),
                 jax.ShapeDtypeStruct((rows, m.hidden // 128), jnp.float32))
        text = jax.export.export(fn, platforms=["cuda"], disabled_checks=export_disabled_checks())(
            state, x, jax.ShapeDtypeStruct((8,), jnp.int32)).mlir_module()
        return custom_calls(text)

    fused = ["w4a8_grouped_gemm", "w4a8_moe_up"]                       # the down projection, the fused up
    unfused = ["quantize_fp8_groups", "w4a8_grouped_gemm", "w4a8_grouped_gemm"]
    assert targets("unfused", 64) == unfused
    assert targets("fused", 64) == fused and targets("fused", 8 * 128) == fused
    assert targets("auto", 8 * 64) == fused and targets("auto", 8 * 65) == unfused
    assert targets("fused", 64, other) == unfused and targets("auto", 64, other) == unfused

    def static_targets(impl, rows):
        return targets(impl, rows, static)

    assert static_targets("unfused", 64) == ["w4a8_grouped_gemm", "w4a8_grouped_gemm"]
    assert static_targets("auto", 64) == fused and static_targets("auto", 8 * 65) == ["w4a8_grouped_gemm"] * 2


def _check_experts_against_row_loop(m, x, sizes, got):
    """bf16 output (2^-9 relative per element), and e4m3 codes of x and h that flip to a neighbour where float32
    and float64 round differently (gate and up also rounded to bf16 when unfused; about ten of a row's 256 h codes
    move a step, about 2% of the row). CPU, 60 seeds of 37-40 rows: whole-output errors up to 2.0% (dynamic
    scales) and 2.2% (static, unfused and fused), row medians up to 1.5% and 1.3%; the bounds are about twice
    that (a wrong scale, row or expert is off by tens of percent)."""
    if m.act_scale == "static":
        scales = (np.float32(np.max(m.gate_up_proj_input_scale[...])), np.float32(np.max(m.down_proj_input_scale[...])))
        ref = np_experts(m, np.asarray(x, np.float32), np.asarray(sizes), "static", static=scales)
    else:
        ref = np_experts(m, np.asarray(x, np.float32), np.asarray(sizes), "fp8", ue8m0=m.ue8m0)
    assert got.shape == ref.shape and np.isfinite(got).all()
    row_rel = np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)
    assert rel(got, ref) < 4e-2 and np.median(row_rel) < 3e-2, (rel(got, ref), np.median(row_rel))


def test_experts_bf16_unfused_up_matches_the_float64_row_loop(rng):
    """The bound the GPU test below holds the fused kernel to, on the unfused bf16 path (runs everywhere)."""
    m = _fusable_experts(int(rng.integers(1 << 30)))
    x, sizes = _expert_rows(rng, m, 40)
    _check_experts_against_row_loop(m, x, sizes, _run_experts(m, x, sizes)[0])


@pytest.mark.gpu
@pytest.mark.parametrize("scales", ["ue8m0", "float32", "static"])
@pytest.mark.parametrize("rows", [40, 8 * 16, 8 * 64])
def test_experts_fused_up_matches_the_float64_row_loop_on_gpu(rng, rows, scales):
    """The fused up-projection inside the experts on a GPU (8-, 16- and 64-token tiles of the fused kernel; its
    dynamic scales of both kinds and its static one) against the float64 row loop over the stored formats, and
    near the unfused path on the same rows."""
    gpu = jax.devices("gpu")[0]
    seed = int(rng.integers(1 << 30))
    m = _static_experts(rng, seed) if scales == "static" else _fusable_experts(seed, ue8m0=scales == "ue8m0")
    x, sizes = jax.device_put(_expert_rows(rng, m, rows), gpu)
    m.moe_up = "unfused"
    unfused, _ = _run_experts(m, x, sizes)
    m.moe_up = "fused"
    got, text = _run_experts(m, x, sizes)
    # the fused kernel and the down projection (dynamic scales: after the input quantizer); no silu-mul quantizer
    want = ["w4a8_grouped_gemm", "w4a8_moe_up"] if scales == "static" else \
        ["quantize_fp8_groups", "w4a8_grouped_gemm", "w4a8_moe_up"]
    assert custom_calls(text) == want
    _check_experts_against_row_loop(m, x, sizes, got)
    _check_experts_against_row_loop(m, x, sizes, unfused)
    assert rel(got, unfused) < 4e-2


@pytest.mark.parametrize("rows", [40, 1024])
def test_experts_fold_activations_where_the_plan_does(rng, device, rows):
    """UE8M0 W4A8 experts hand the gate+up and down products folded activations (the quantizers' layout="folded":
    no preparation pass in the grouped GEMM) exactly where those products' plans fold anyway (many rows per
    expert); the output matches the float64 row loop and, on a GPU, the standard layout's bit for bit (the same
    128-token kernel on the same folded codes)."""
    m = _fusable_experts(int(rng.integers(1 << 30)), e=4)
    m.moe_up = "unfused"
    x, sizes = jax.device_put(_expert_rows(rng, m, rows), device)
    want = "folded" if rows == 1024 else "standard"
    assert m.input_layout(int(x.shape[0])) == want and m._down_layout(int(x.shape[0]), 4) == want
    graphdef, state = nnx.split(m)
    fn = jax.jit(lambda st, a, g, layout: nnx.merge(graphdef, st)(nnx.merge(graphdef, st).quantize_input(a, layout), g),
                 static_argnums=3)
    got = np.asarray(fn(state, x, sizes, want), np.float32)
    _check_experts_against_row_loop(m, x, sizes, got)
    if want == "folded":
        standard = np.asarray(fn(state, x, sizes, "standard"), np.float32)  # gate+up standard, down folded
        if device.platform == "gpu":
            np.testing.assert_array_equal(got, standard)
        else:
            assert rel(got, standard) < 1e-2


def test_moe_prefill_with_folded_activations_matches_small_batches(rng, device):
    """A UE8M0 W4A8 MoE layer over 512 tokens (1024 routed rows over 4 experts: the grouped GEMMs' plans fold, so
    the tokens and the SiLU-mul are quantized folded) against the same layer run over batches of 32 tokens (64
    rows, 16 per expert: standard layout, other tiles). Tokens are independent (no capacity, no dropping). Unfused
    up-projection in both (at 16 rows per expert "auto" fuses on Hopper, whose gate and up skip the bf16 rounding:
    about 1% apart from the unfused path, H100)."""
    from jax_w4a8.models.deepseek import QuantConfig
    cfg = _small_config(num_hidden_layers=2)
    layer = layers.MoE(cfg, quant=QuantConfig.w4a8(ue8m0=True), dtype=jnp.bfloat16, rngs=nnx.Rngs(3))
    layer.experts.moe_up = "unfused"
    assert layer.experts.input_layout(1024) == "folded" and layer.experts.input_layout(64) == "standard"
    graphdef, state = nnx.split(layer)
    fn = jax.jit(lambda st, v: nnx.merge(graphdef, st)(v))
    x = jax.device_put(jnp.asarray(rng.standard_normal((1, 512, 256)), jnp.bfloat16), device)
    state = jax.device_put(state, device)
    big = np.asarray(fn(state, x), np.float32)
    small = np.concatenate([np.asarray(fn(state, x[:, i:i + 32]), np.float32) for i in range(0, 512, 32)], axis=1)
    assert np.isfinite(big).all() and np.abs(big).max() > 0
    row_rel = np.linalg.norm(big - small, axis=-1) / np.linalg.norm(small, axis=-1)
    assert rel(big, small) < 1e-2 and np.median(row_rel) < 5e-3, (rel(big, small), np.median(row_rel))


def test_moe_quantizes_its_tokens_once(rng):
    """A W4A8 MoE layer with an FP8 shared expert: one quantizer call for the tokens (routed and shared),
    one fused silu-mul quantizer each for the routed and the shared down projection; no bf16 SiLU product."""
    from jax_w4a8.models.deepseek import QuantConfig
    cfg = _small_config(num_hidden_layers=2, n_routed_experts=8)
    moe_layer = layers.MoE(cfg, quant=QuantConfig.w4a8(), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(moe_layer)
    x = jnp.asarray(rng.standard_normal((1, 5, 256)), jnp.bfloat16)
    fn = lambda st, v: nnx.merge(graphdef, st)(v)  # noqa: E731
    text = jax.jit(fn).lower(state, x).compile().as_text()
    import re
    quantizers = re.findall(r'custom_call_target="jax_w4a8_quantize_fp8_groups"[^\n]*', text)
    assert len(quantizers) == 3, quantizers          # the tokens once; silu-mul for routed and shared down
    assert sum("silu_mul=true" in q.replace(" ", "") for q in quantizers) == 2, quantizers
    y = np.asarray(jax.jit(fn)(state, x), np.float32)
    assert y.shape == (1, 5, 256) and np.isfinite(y).all() and np.abs(y).max() > 0


def test_moe_takes_any_experts_module(rng):
    """Any ``experts_fn`` module (benchmarks swap in Pallas experts) gets float rows unless it says
    ``quantizes_input``."""
    from jax_w4a8.models.deepseek import QuantConfig

    class Doubling(nnx.Module):
        def __call__(self, x_sorted, group_sizes):
            return 2 * x_sorted

    cfg = _small_config(num_hidden_layers=2, n_routed_experts=8, n_shared_experts=0)
    m = layers.MoE(cfg, quant=QuantConfig.w4a8(), dtype=jnp.float32, rngs=nnx.Rngs(0))
    m.experts = Doubling()
    x = jnp.asarray(rng.standard_normal((1, 3, 256)), jnp.float32)
    _, w = m.gate(x.reshape(3, 256))
    np.testing.assert_allclose(np.asarray(m(x))[0], 2 * np.asarray(x)[0] * np.asarray(w).sum(-1, keepdims=True),
                               rtol=1e-5, atol=1e-6)


def test_experts_bf16_output_and_w4_dims():
    m = layers.Experts(4, 256, 128, quant="w4a8", dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    y = nnx.jit(lambda m, x, g: m(x, g))(m, jnp.ones((5, 256), jnp.bfloat16), jnp.asarray([2, 0, 3, 0], jnp.int32))
    assert y.dtype == jnp.bfloat16 and m.gate_up_proj.dtype == jnp.int8 and m.gate_up_proj.shape == (4, 256, 128)
    with pytest.raises(ValueError, match="multiple of 128"):
        layers.Experts(4, 64, 128, quant="w4a8", rngs=nnx.Rngs(0))


def test_fake_quant_fp8_groups(rng):
    x = (rng.standard_normal((3, 200)) * 5).astype(np.float32)
    for ue8m0 in (False, True):
        got = np.asarray(layers.fake_quant_fp8_groups(jnp.asarray(x), ue8m0))
        want = np_fake_quant_fp8(x, ue8m0)
        same = np.isclose(got, want, rtol=1e-6, atol=1e-7)
        assert same.sum() >= same.size - 1, np.nonzero(~same)   # (see the reciprocal note above)
        # that one a neighbouring e4m3 code: neighbours are up to 1/8 of the smaller apart (at a binade's start);
        # rtol 0.07 failed on a pair 10% apart (5.01 vs 5.57, numpy seed 430862208)
        np.testing.assert_allclose(got, want, rtol=0.126)


@pytest.mark.parametrize("shape", [(5, 384), (3, 2, 256)])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_quantize_act_groups_matches_numpy_and_takes_the_kernel(rng, shape, ue8m0):
    """The model's activation quantizer (the ops kernel): e4m3 codes times scales as float64 numpy's, and the
    kernel's custom call in the lowered program."""
    x = (rng.standard_normal(shape) * rng.choice([1e-3, 1.0, 300.0], shape[:-1] + (1,))).astype(np.float32)
    x[0, ..., :128] = 0.0  # an all-zero group: the 1e-4 floor, codes 0
    q, s = layers.quantize_act_groups(jnp.asarray(x), ue8m0)
    assert q.dtype == jnp.float8_e4m3fn and q.shape == shape and s.shape == shape[:-1] + (shape[-1] // 128,)
    deq = np.asarray(q, np.float64).reshape(*shape[:-1], -1, 128) * np.asarray(s, np.float64)[..., None]
    np.testing.assert_array_equal(deq.reshape(shape), np_fake_quant_fp8(x, ue8m0))  # IEEE x / s: exact codes
    assert not np.asarray(q, np.float32)[0, ..., :128].any()
    if ue8m0:
        assert np.all(np.frexp(np.asarray(s))[0] == 0.5)  # powers of two
    text = jax.jit(lambda v: layers.quantize_act_groups(v, ue8m0)).lower(jnp.asarray(x)).as_text()
    assert "jax_w4a8_quantize_fp8_groups" in text
    with pytest.raises(ValueError, match="argument 'x' must have its last axis"):
        layers.quantize_act_groups(jnp.asarray(x[..., :200]), ue8m0)


def test_linear_ue8m0_passes_float32_scales_without_host_check():
    """UE8M0 scales travel as float32 powers of two (no per-call encoding to codes) and without pack_ue8m0 (a
    host-syncing check) in a forward."""
    lin = layers.Linear(256, 128, quant="fp8", dtype=jnp.bfloat16, ue8m0=True, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(lin)
    x = jnp.ones((4, 256), jnp.bfloat16)
    text = jax.jit(lambda s, v: nnx.merge(graphdef, s)(v)).lower(state, x).as_text()
    assert "jax_w4a8_fp8_einsum" in text and "jax_w4a8_ue8m0_pack" not in text
    assert _einsum_scale_types(text) == [("f32", "f32")]


def _einsum_scale_types(text):
    """(x_scale, w_scale) element types of each fp8_einsum custom call in StableHLO text."""
    calls = [line for line in text.splitlines() if "custom_call @jax_w4a8_fp8_einsum" in line]
    return [tuple(re.findall(r"tensor<[\dx]*x(\w+)>", line.rsplit(": (", 1)[1])[1:4:2]) for line in calls]


def test_absorbed_decode_ue8m0_passes_float32_scales():
    """The absorbed MLA decode products take UE8M0 scales as float32 powers of two too: no encoding to codes, no
    host-checking pack_ue8m0 per step."""
    from jax_w4a8.models.deepseek import QuantConfig
    cfg = _small_config(num_hidden_layers=1, n_routed_experts=4)
    mla = layers.MLA(cfg, quant=QuantConfig(linear="fp8", ue8m0=True), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(mla)
    q_nope = jnp.ones((1, 1, 2, 128), jnp.bfloat16)
    q_pe = jnp.ones((1, 1, 2, 64), jnp.bfloat16)
    c_kv, k_pe = jnp.ones((1, 4, 128), jnp.bfloat16), jnp.ones((1, 4, 64), jnp.bfloat16)
    mask = jnp.ones((1, 1, 4), bool)
    fn = jax.jit(lambda s, *a: nnx.merge(graphdef, s).attend_absorbed(*a))
    text = fn.lower(state, q_nope, q_pe, c_kv, k_pe, mask).as_text()
    assert "jax_w4a8_fp8_einsum" in text and "jax_w4a8_ue8m0_pack" not in text
    assert _einsum_scale_types(text) == [("f32", "f32")] * 3  # the two absorbed products and o_proj
