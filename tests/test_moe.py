"""jax_w4a8.moe: sorting token slots by expert, group sizes, permutation, fp32 combine (numpy references)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_w4a8 import moe


def _topk_ids(rng, n, k, e, skew=False):
    """Distinct expert ids per token (like a top-k), optionally concentrated on few experts."""
    p = None
    if skew:
        p = rng.dirichlet(np.full(e, 0.2))
        p = np.maximum(p, 1e-3)
        p /= p.sum()
    return np.stack([rng.choice(e, size=k, replace=False, p=p) for _ in range(n)]).astype(np.int32)


@pytest.mark.parametrize("n,k,e,skew", [(1, 1, 1, False), (7, 2, 8, False), (33, 4, 16, True), (64, 8, 32, True)])
def test_sort_by_expert_matches_numpy(rng, n, k, e, skew):
    ids = _topk_ids(rng, n, k, e, skew)
    r = moe.sort_by_expert(jnp.asarray(ids), e)
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    np.testing.assert_array_equal(np.asarray(r.order), order)
    np.testing.assert_array_equal(np.asarray(r.group_sizes), np.bincount(flat, minlength=e))
    assert r.group_sizes.dtype == jnp.int32 and r.order.dtype == jnp.int32 and r.inverse.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(r.order)[np.asarray(r.inverse)], np.arange(n * k))
    np.testing.assert_array_equal(np.asarray(r.token_of_row), order // k)
    # sorted rows are grouped by expert, in expert order, each run the size group_sizes says
    np.testing.assert_array_equal(flat[order], np.repeat(np.arange(e), np.bincount(flat, minlength=e)))


def test_permute_and_combine_match_loop(rng):
    n, k, e, d = 21, 3, 6, 5
    ids = _topk_ids(rng, n, k, e)
    x = rng.standard_normal((n, d)).astype(np.float32)
    w = rng.random((n, k)).astype(np.float32)
    r = moe.sort_by_expert(jnp.asarray(ids), e)
    xs = np.asarray(moe.permute(jnp.asarray(x), r))
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    np.testing.assert_array_equal(xs, x[order // k])
    # expert e maps a row to (e + 1) * row + e: fresh per-expert functions, then weighted combine
    expert_of_row = flat[order]
    ys = xs * (expert_of_row[:, None] + 1) + expert_of_row[:, None]
    out = np.asarray(moe.combine(jnp.asarray(ys), r.inverse, jnp.asarray(w)))
    ref = np.zeros((n, d))
    for t in range(n):
        for j in range(k):
            ref[t] += w[t, j] * (x[t] * (ids[t, j] + 1) + ids[t, j])
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)
    assert out.dtype == np.float32


def test_permute_takes_quantized_tokens_as_a_tuple(rng):
    """``map_rows`` / ``permute`` on (codes, scales): each array gathered by the same rows as numpy's."""
    n, k, e = 9, 2, 4
    ids = _topk_ids(rng, n, k, e)
    codes = rng.integers(0, 256, (n, 256)).astype(np.uint8)
    scales = rng.random((n, 2)).astype(np.float32)
    r = moe.sort_by_expert(jnp.asarray(ids), e)
    got = moe.permute((jnp.asarray(codes), jnp.asarray(scales)), r)
    rows = np.argsort(ids.reshape(-1), kind="stable") // k
    assert isinstance(got, tuple) and len(got) == 2
    np.testing.assert_array_equal(np.asarray(got[0]), codes[rows])
    np.testing.assert_array_equal(np.asarray(got[1]), scales[rows])
    np.testing.assert_array_equal(np.asarray(moe.map_rows(jnp.asarray(scales), lambda a: a * 2)), scales * 2)


def test_combine_is_fp32_then_cast():
    # bf16 expert outputs whose bf16 sum would lose the small term; the fp32 sum keeps it until the cast.
    y = jnp.asarray([[256.0], [1.0], [1.0]], jnp.bfloat16)           # rows of token 0: k = 3
    inverse = jnp.arange(3, dtype=jnp.int32)
    w = jnp.ones((1, 3), jnp.float32)
    out32 = moe.combine(y, inverse, w, out_dtype=jnp.float32)
    assert float(out32[0, 0]) == 258.0
    outbf = moe.combine(y, inverse, w, out_dtype=jnp.bfloat16)
    assert outbf.dtype == jnp.bfloat16 and float(outbf[0, 0]) == 258.0   # bf16(256 + 1) + 1 would give 256


def test_moe_apply_with_ragged_dot_experts(rng):
    n, k, e, d, h = 40, 2, 8, 16, 12
    ids = _topk_ids(rng, n, k, e, skew=True)
    x = rng.standard_normal((n, d)).astype(np.float32)
    w = rng.random((n, k)).astype(np.float32)
    weights = rng.standard_normal((e, h, d)).astype(np.float32)
    seen = {}

    def experts_fn(x_sorted, group_sizes):
        seen["gs"] = group_sizes
        dn = jax.lax.RaggedDotDimensionNumbers((([1], [2]), ([], [])), [0], [0])
        return jax.lax.ragged_dot_general(x_sorted, jnp.asarray(weights), group_sizes, dn,
                                          precision=jax.lax.Precision.HIGHEST)

    out = np.asarray(jax.jit(lambda *a: moe.moe_apply(*a, experts_fn, e))(jnp.asarray(x), jnp.asarray(ids),
                                                                             jnp.asarray(w)))
    ref = np.einsum("nk,nkh->nh", w.astype(np.float64),
                    np.einsum("nkhd,nd->nkh", weights[ids].astype(np.float64), x))
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    assert seen["gs"].shape == (e,) and seen["gs"].dtype == jnp.int32


def test_no_token_dropping_when_one_expert_takes_all(rng):
    n, e, d = 50, 4, 3
    ids = np.zeros((n, 1), np.int32)
    x = rng.standard_normal((n, d)).astype(np.float32)
    out = moe.moe_apply(jnp.asarray(x), jnp.asarray(ids), jnp.ones((n, 1), jnp.float32),
                        lambda xs, gs: xs * 2.0, e)
    np.testing.assert_allclose(np.asarray(out), 2 * x, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(moe.sort_by_expert(jnp.asarray(ids), e).group_sizes), [n, 0, 0, 0])


def test_ids_outside_the_experts_are_padding_and_add_nothing(rng):
    """A slot whose id is outside [0, E) (negative, E, far past E) is sorted after every valid slot, counted by no
    expert, and moe_apply ignores its row (even a NaN one): each token gets exactly its valid slots' sum."""
    n, k, e, d = 12, 3, 5, 4
    ids = _topk_ids(rng, n, k, e)
    ids[0, 1], ids[3, 0], ids[7, 2], ids[8, 1] = -1, e, 1000, -(2**31)
    valid = (ids >= 0) & (ids < e)
    r = moe.sort_by_expert(jnp.asarray(ids), e)
    sizes = np.asarray(r.group_sizes)
    np.testing.assert_array_equal(sizes, np.bincount(ids[valid], minlength=e))
    flat = ids.reshape(-1)
    tail = np.asarray(r.order)[sizes.sum():]
    assert sorted(tail.tolist()) == sorted(np.flatnonzero(~valid.reshape(-1)).tolist())
    np.testing.assert_array_equal(flat[np.asarray(r.order)[:sizes.sum()]], np.repeat(np.arange(e), sizes))

    x = rng.standard_normal((n, d)).astype(np.float32)
    w = rng.random((n, k)).astype(np.float32)

    def experts_fn(xs, group_sizes):  # expert j scales its rows by j + 1; padding rows come out NaN
        row_expert = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(xs.shape[0]), side="right")
        return jnp.where((row_expert < e)[:, None], xs * (row_expert[:, None] + 1.0), jnp.nan)

    out = np.asarray(jax.jit(lambda *a: moe.moe_apply(*a, experts_fn, e))(jnp.asarray(x), jnp.asarray(ids),
                                                                          jnp.asarray(w)))
    ref = np.zeros((n, d))
    for t in range(n):
        for j in range(k):
            if valid[t, j]:
                ref[t] += np.float64(w[t, j]) * x[t] * (ids[t, j] + 1)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)


def test_bad_arguments_name_themselves(rng):
    ids = jnp.asarray(_topk_ids(rng, 4, 2, 6))
    x, w = jnp.ones((4, 8)), jnp.ones((4, 2))
    fn = lambda xs, g: xs  # noqa: E731
    with pytest.raises(TypeError, match="'topk_ids'"):
        moe.sort_by_expert(ids.astype(jnp.float32), 6)
    with pytest.raises(ValueError, match="'topk_ids'"):
        moe.sort_by_expert(ids.reshape(-1), 6)
    for bad in (0, -2, 2.0, True, np.bool_(True), np.int64(0)):
        with pytest.raises(ValueError, match="'num_experts'"):
            moe.sort_by_expert(ids, bad)
    np.testing.assert_array_equal(moe.sort_by_expert(ids, np.int64(6)).group_sizes,  # a NumPy int is an int
                                  moe.sort_by_expert(ids, 6).group_sizes)
    with pytest.raises(ValueError, match="'topk_weights'"):
        moe.moe_apply(x, ids, jnp.ones((4, 3)), fn, 6)
    with pytest.raises(ValueError, match="'x'"):
        moe.moe_apply(jnp.ones((5, 8)), ids, w, fn, 6)
    with pytest.raises(ValueError, match="'x'"):
        moe.moe_apply((jnp.ones((4, 8)), jnp.ones((3, 1))), ids, w, lambda xs, g: xs[0], 6)
    with pytest.raises(ValueError, match="'out_dtype'"):
        moe.moe_apply(x, ids, w, fn, 6, out_dtype=jnp.float16)
    with pytest.raises(ValueError, match="'out_dtype' must be bfloat16 or float32, got None"):  # not "float64"
        moe.moe_apply(x, ids, w, fn, 6, out_dtype=None)
    assert moe.moe_apply(x, ids, w, fn, 6, out_dtype=jnp.bfloat16).dtype == jnp.bfloat16
