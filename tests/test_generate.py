"""generate(): prefill + decode over the MLA latent cache, batching, sampling, EOS, compilation, finiteness.

* fp32: the golden greedy continuations of transformers are reproduced through the cache, and greedy
  ``generate`` equals the argmax of teacher-forced forward passes over its own output (so it equals the
  teacher-forced rollout: the prefill -> decode handoff and every decode step are checked).
* a batch of prompts of different lengths gives each prompt's tokens alone; EOS stops a row; ``stream``
  sees every token; sampling is reproducible; top-k / top-p follow their definitions on known logits.
* compilation: a second call in the same bucket compiles nothing; the cache is bf16
  [B, T_max, kv_lora_rank + qk_rope_head_dim] per layer; ``check_finite`` names the step and sequence.
* the absorbed decode attention (bf16 einsums and ``ops.fp8_einsum``) equals the expanded one.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_w4a8 import quant
from jax_w4a8.models.deepseek import jit_forward, layers, load_checkpoint
from jax_w4a8.models.deepseek.generate import (Generator, MLACache, NonFiniteLogitsError, cache_bucket,
                                               filter_logits, generate, length_bucket, sample_tokens)
from test_deepseek_layers import FIXTURES, GOLDEN

DEFAULT = os.path.join(os.path.dirname(__file__), "..", "jax_w4a8", "models", "deepseek", "assets", "default")
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@pytest.fixture(scope="module")
def fp32_model():
    """The yarn_qlora golden model (vocab 256, 2 layers, YaRN, q_lora, 16 experts) in float32."""
    return load_checkpoint(os.path.join(GOLDEN, "yarn_qlora"), dtype=jnp.float32, progress=False)


@pytest.fixture(scope="module")
def default_bf16():
    """The embedded default checkpoint (dims multiples of 128), unquantized, bf16."""
    return load_checkpoint(DEFAULT, dtype=jnp.bfloat16, progress=False)


@pytest.fixture(scope="module")
def default_w4a8():
    """The embedded default quantized on load: W4A8 experts, FP8 blocks for the other linears."""
    return load_checkpoint(DEFAULT, quantize="w4a8", dtype=jnp.bfloat16, progress=False)


def teacher_forced_argmax(model, prompts, outputs):
    """Per row, the argmax of the logits of one full (no-cache) forward over prompt + output at the positions
    that chose the output tokens. One batched call: rows are right-padded, which a causal model ignores."""
    seqs = [list(p) + list(o) for p, o in zip(prompts, outputs)]
    n = max(map(len, seqs))
    ids = np.asarray([s + [0] * (n - len(s)) for s in seqs], np.int32)
    logits = np.asarray(jit_forward(model)(jnp.asarray(ids)).astype(jnp.float32))
    return [logits[i, len(p) - 1:len(s) - 1].argmax(-1).tolist() for i, (p, s) in enumerate(zip(prompts, seqs))]


class CompileCount:
    """Counts XLA backend compilations (jax.monitoring) inside a ``with`` block."""

    def __enter__(self):
        self.n = 0
        jax.monitoring.register_event_duration_secs_listener(self._on)
        return self

    def _on(self, event, duration, **_):
        if event == BACKEND_COMPILE:
            self.n += 1

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._on)


# ----------------------------------------------------------------------------------------------
# correctness of the cache path
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", FIXTURES)
def test_golden_greedy_through_cache(name, device):
    exp = np.load(os.path.join(GOLDEN, name, "expected.npz"))
    with jax.default_device(device):
        model = load_checkpoint(os.path.join(GOLDEN, name), dtype=jnp.float32, progress=False)
        tokens = generate(model, exp["input_ids"], exp["greedy_tokens"].shape[1])
    np.testing.assert_array_equal(np.asarray(tokens), exp["greedy_tokens"])
    np.testing.assert_array_equal(np.asarray(tokens), exp["hf_generate_tokens"])


RAGGED = [[0, 5, 77], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [0, 250, 251, 13, 14, 99, 100]]


def test_golden_greedy_expert_parallel():
    """generate() on a model whose experts are sharded over 4 (virtual CPU) devices: same golden tokens."""
    from jax_w4a8 import sharding
    from jax_w4a8.models.deepseek.parallel import shard_model

    if len(jax.devices("cpu")) < 4:
        pytest.skip("needs 4 CPU devices (tests/conftest.py sets XLA_FLAGS)")
    exp = np.load(os.path.join(GOLDEN, "yarn_qlora", "expected.npz"))
    model = load_checkpoint(os.path.join(GOLDEN, "yarn_qlora"), dtype=jnp.float32, progress=False)
    shard_model(model, sharding.make_mesh(4, jax.devices("cpu")[:4]))
    np.testing.assert_array_equal(np.asarray(generate(model, exp["input_ids"], 8)), exp["greedy_tokens"])


def test_greedy_equals_teacher_forced_rollout_fp32(fp32_model):
    out = generate(fp32_model, RAGGED, 8)
    assert [len(r) for r in out] == [8, 8, 8]
    assert teacher_forced_argmax(fp32_model, RAGGED, out) == out


def test_greedy_equals_teacher_forced_rollout_bf16(default_bf16):
    """bf16, head dims of 128, bf16 cache: the absorbed decode agrees with the expanded forward (CPU)."""
    prompts = [[0, 5, 9, 100, 200, 7], [0, 3]]
    out = generate(default_bf16, prompts, 16)
    assert teacher_forced_argmax(default_bf16, prompts, out) == out


def test_ragged_batch_equals_each_prompt_alone(fp32_model):
    """Left padding: in the batch (bucket 16) the short prompts sit behind 13 and 9 pad slots, alone (bucket 8)
    behind 5 and 1; the tokens are the same."""
    batch = generate(fp32_model, RAGGED, 8)
    alone = [generate(fp32_model, [p], 8)[0] for p in RAGGED]
    assert batch == alone


def _attention(model, b=2, s=9, seed=0):
    """Layer 0's attention on random inputs, jitted: (expanded output, absorbed output, absorbed weights,
    reference), the reference being the absorbed form in float32 with kv_b_proj's weights dequantized (no
    activation quantization in the two per-head products)."""
    cfg = model.cfg
    graphdef, state = nnx.split(model.model.layers[0].self_attn)

    @jax.jit
    def run(state):
        attn = nnx.merge(graphdef, state)
        x = jax.random.normal(jax.random.key(seed), (b, s, cfg.hidden_size), jnp.float32).astype(model.dtype)
        pos = jnp.broadcast_to(jnp.arange(s), (b, s))
        cos, sin = layers.rope_cos_sin(pos, cfg, model.dtype)
        q_nope, q_pe = attn.queries(x, cos, sin)
        c_kv, k_pe = attn.latents(x, cos, sin)
        mask = pos[:, :, None] >= pos[:, None, :]
        a = attn.absorbed_weights()
        lin = attn.kv_b_proj
        w = lin.weight[...].astype(jnp.float32)
        if lin.quant == "fp8":
            w = quant.dequantize_fp8_blocks(lin.weight[...], lin.weight_scale_inv[...], 128, jnp.float32)
        w = w.reshape(cfg.num_attention_heads, -1, cfg.kv_lora_rank)
        ref_w = {"w_kT": jnp.swapaxes(w[:, :cfg.qk_nope_head_dim], 1, 2), "w_v": w[:, cfg.qk_nope_head_dim:]}
        f32 = [v.astype(jnp.float32) for v in (q_nope, q_pe, c_kv, k_pe)]
        return (attn.attend(q_nope, q_pe, c_kv, k_pe, mask).astype(jnp.float32),
                attn.attend_absorbed(q_nope, q_pe, c_kv, k_pe, mask, a).astype(jnp.float32), a,
                attn.attend_absorbed(*f32, mask, ref_w).astype(jnp.float32))

    return run, state


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("which", ["default_bf16", "default_w4a8"])
def test_absorbed_attention_matches_expanded(which, request):
    """Absorbed MLA (q absorbed through W_k, attention over latents, then W_v) vs transformers' expanded form.
    FP8 kv_b_proj: both per-head products run through ops.fp8_einsum (dims are multiples of 128), with
    activations quantized per (token, head, 128 channels) instead of per token before kv_b_proj: against a
    float32 reference it is as accurate as the expanded FP8 form."""
    model = request.getfixturevalue(which)
    run, state = _attention(model)
    expanded, absorbed, a, ref = run(state)
    err_abs, err_exp = _rel(absorbed, ref), _rel(expanded, ref)
    print(f"{which}: vs float32 reference: absorbed {err_abs:.2e}, expanded {err_exp:.2e}; "
          f"absorbed vs expanded {_rel(absorbed, expanded):.2e}")
    if which == "default_w4a8":
        assert a["w_kT"].dtype == jnp.float8_e4m3fn and "w_kT_scale" in a
        text = run.lower(state).as_text()
        assert text.count("jax_w4a8_fp8_einsum") >= 2 + 5       # q absorb, v; + the five fp8 linears
        assert err_abs <= 1.5 * err_exp + 0.01 and err_abs < 0.08
    else:
        assert _rel(absorbed, expanded) < 0.01 and err_abs < 0.01


def test_fp8_fallback_for_small_head_dims():
    """FP8 kv_b_proj whose head dims are not multiples of 128: dequantized weights + plain einsum."""
    model = load_checkpoint(os.path.join(GOLDEN, "yarn_qlora"), quantize="fp8", dtype=jnp.float32, progress=False)
    run, state = _attention(model)
    expanded, absorbed, a, ref = run(state)
    assert "w_kT_scale" not in a and a["w_kT"].dtype == jnp.float32
    assert _rel(absorbed, ref) < 1e-5
    # the expanded form quantizes c_kv to fp8 before kv_b_proj; the fallback keeps it in float
    assert _rel(absorbed, expanded) < 0.06


# ----------------------------------------------------------------------------------------------
# EOS, streaming, sampling
# ----------------------------------------------------------------------------------------------
def test_eos_stops_each_row_and_stream_sees_every_token(fp32_model):
    prompts = [[0, 5, 77], [0, 1, 2, 3, 4, 5, 6]]
    free = generate(fp32_model, prompts, 8)
    eos = free[0][3]
    unused = next(t for t in range(2, 256) if t not in free[0] + free[1])
    calls = []
    out = generate(fp32_model, prompts, 8, eos_token_id=[unused, eos],
                   stream=lambda t, a: calls.append((t.copy(), a.copy())))
    for r, row in enumerate(free):
        want = row[:row.index(eos) + 1] if eos in row else row
        assert out[r] == want
    assert out[0][-1] == eos and len(out[0]) == free[0].index(eos) + 1 <= 4
    # stream: one call per step, the tokens of active rows make up the outputs
    assert all(t.shape == (2,) and a.dtype == bool for t, a in calls)
    for r in range(2):
        assert [int(t[r]) for t, a in calls if a[r]] == out[r]
    if len(out[0]) < len(out[1]):
        assert not calls[len(out[0])][1][0]     # row 0 inactive after its EOS


def test_all_rows_eos_ends_early(fp32_model):
    first = generate(fp32_model, [[0, 5, 77], [0, 5, 77]], 8)[0][0]
    calls = []
    out, st = generate(fp32_model, [[0, 5, 77], [0, 5, 77]], 8, eos_token_id=first,
                       stream=lambda t, a: calls.append(t), return_stats=True)
    assert out == [[first], [first]] and len(calls) == 1 and st.decode_steps == 0


def test_sampling_is_reproducible_with_a_seed(fp32_model):
    prompts = [[0, 5, 77], [0, 1, 2, 3, 4, 5, 6]]
    kw = dict(top_p=0.95, top_k=50)
    a = generate(fp32_model, prompts, 8, seed=1, temperature=1.0, **kw)
    b = generate(fp32_model, prompts, 8, seed=1, temperature=1.0, **kw)
    c = generate(fp32_model, prompts, 8, seed=2, temperature=1.0, **kw)
    assert a == b
    assert a != c
    greedy = generate(fp32_model, prompts, 8)
    assert generate(fp32_model, prompts, 8, temperature=1e-4, seed=3, **kw) == greedy   # T -> 0 is greedy


def test_top_k_definition():
    logits = jnp.asarray([[3.0, 1.0, 2.0, 2.0, 0.0], [0.0, 1.0, 2.0, 3.0, 4.0]])
    keep = np.isfinite(np.asarray(filter_logits(logits, top_k=2)))
    # ties with the k-th largest are kept (transformers' TopKLogitsWarper)
    np.testing.assert_array_equal(keep, [[1, 0, 1, 1, 0], [0, 0, 0, 1, 1]])
    np.testing.assert_array_equal(np.isfinite(np.asarray(filter_logits(logits, top_k=1))),
                                  [[1, 0, 0, 0, 0], [0, 0, 0, 0, 1]])
    assert np.isfinite(np.asarray(filter_logits(logits, top_k=99))).all()
    kept = np.asarray(filter_logits(logits, top_k=2))
    np.testing.assert_array_equal(kept[np.isfinite(kept)], np.asarray(logits)[keep])   # values unchanged


def test_top_p_definition():
    p = np.asarray([0.5, 0.3, 0.15, 0.05])
    logits = jnp.asarray(np.log(p)[None], jnp.float32)

    def kept(**kw):
        return np.isfinite(np.asarray(filter_logits(logits, **kw)))[0].astype(int).tolist()

    assert kept(top_p=0.4) == [1, 0, 0, 0]          # the most probable token is always kept
    assert kept(top_p=0.5) == [1, 0, 0, 0]          # cumulative 0.5 reaches 0.5
    assert kept(top_p=0.6) == [1, 1, 0, 0]
    assert kept(top_p=0.85) == [1, 1, 1, 0]
    assert kept(top_p=0.96) == [1, 1, 1, 1]
    assert kept(top_p=1.0) == [1, 1, 1, 1]
    # top-k first, then top-p on the renormalised top-k distribution: [.5, .3, .15] / .95, so the third
    # token starts at 0.842 > 0.83 (without renormalisation it would start at 0.8 < 0.83 and be kept)
    assert kept(top_k=3, top_p=0.83) == [1, 1, 0, 0]
    assert kept(top_k=3, top_p=0.9) == [1, 1, 1, 0]
    # permuted rows: the definition does not depend on the order of the vocabulary
    perm = np.asarray([2, 0, 3, 1])
    got = np.isfinite(np.asarray(filter_logits(logits[:, perm], top_p=0.6)))[0]
    np.testing.assert_array_equal(got, np.asarray([1, 1, 0, 0], bool)[perm])


def test_sampling_distribution_follows_temperature_and_filters():
    logits = jnp.log(jnp.asarray([0.4, 0.3, 0.2, 0.1]))
    n = 20000
    rows = jnp.broadcast_to(logits, (n, 4))
    toks = np.asarray(sample_tokens(rows, jax.random.key(0), temperature=1.0))
    np.testing.assert_allclose(np.bincount(toks, minlength=4) / n, [0.4, 0.3, 0.2, 0.1], atol=0.015)
    toks = np.asarray(sample_tokens(rows, jax.random.key(1), temperature=0.5))
    want = np.asarray([0.4, 0.3, 0.2, 0.1]) ** 2
    np.testing.assert_allclose(np.bincount(toks, minlength=4) / n, want / want.sum(), atol=0.015)
    toks = np.asarray(sample_tokens(rows, jax.random.key(2), temperature=1.0, top_k=2))
    np.testing.assert_allclose(np.bincount(toks, minlength=4) / n, [4 / 7, 3 / 7, 0, 0], atol=0.015)
    toks = np.asarray(sample_tokens(rows, jax.random.key(3), temperature=1.0, top_p=0.75))   # 0.7 < 0.75
    np.testing.assert_allclose(np.bincount(toks, minlength=4) / n, [4 / 9, 3 / 9, 2 / 9, 0], atol=0.015)
    toks = np.asarray(sample_tokens(rows, jax.random.key(4), temperature=1.0, top_p=0.65))   # 0.7 >= 0.65
    np.testing.assert_allclose(np.bincount(toks, minlength=4) / n, [4 / 7, 3 / 7, 0, 0], atol=0.015)


def test_token_ids_always_valid_for_non_finite_logits():
    v = 7
    logits = jnp.asarray([[np.nan] * v, [-np.inf] * v, [np.inf, 0, np.nan, 1, 2, 3, 4],
                          [1, 2, np.nan, 3, 4, 5, 6]], jnp.float32)
    for kw in [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.7, top_k=3, top_p=0.5)]:
        for seed in range(5):
            t = np.asarray(sample_tokens(logits, jax.random.key(seed), **kw))
            assert ((t >= 0) & (t < v)).all(), (kw, t)
    assert np.asarray(sample_tokens(logits, jax.random.key(0)))[3] == 6


# ----------------------------------------------------------------------------------------------
# compilation, cache, finiteness
# ----------------------------------------------------------------------------------------------
def test_same_bucket_compiles_nothing(fp32_model):
    assert length_bucket(5) == length_bucket(7) == 8 and length_bucket(9) == 16
    assert cache_bucket(100) == 128 and cache_bucket(1500) == 2048 and cache_bucket(3000) == 3072
    jax.clear_caches()  # other tests may have compiled the buckets below (jit's cache is process-wide)
    generate(fp32_model, [[0, 1, 2, 3, 4], [0, 9]], 8)                                       # warm
    with CompileCount() as cc:
        out, st = generate(fp32_model, [[0, 7, 7, 7, 8, 9, 10], [0, 3, 4]], 8, return_stats=True)
        generate(fp32_model, [[0, 2], [0, 3, 4, 5, 6, 7, 8]], 8, eos_token_id=[1, 2])   # other lengths, EOS
    assert cc.n == 0 and st.compilations == 0
    assert st.prefill_bucket == 8 and st.cache_len == 16 and st.decode_steps == 7
    # a new bucket compiles one prefill and one decode step (plus small helpers), then nothing
    with CompileCount() as cc:
        generate(fp32_model, [[0] + list(range(1, 12)), [0, 3, 4]], 8)
    assert 2 <= cc.n <= 4
    with CompileCount() as cc:
        generate(fp32_model, [[0] + list(range(1, 10)), [0, 3, 4, 5]], 8)
    assert cc.n == 0


def test_cache_is_bf16_latents(default_bf16):
    cfg = default_bf16.cfg
    gen = Generator(default_bf16)
    cache = gen.init_cache(3, 64)
    assert len(cache.kv) == cfg.num_hidden_layers
    for kv in cache.kv:
        assert kv.shape == (3, 64, cfg.kv_lora_rank + cfg.qk_rope_head_dim) and kv.dtype == jnp.bfloat16
        assert kv.nbytes // (3 * 64) == (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
    assert cache.bytes_per_token_per_layer == (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2 == 384


def test_decode_step_donates_the_cache(default_bf16):
    gen = Generator(default_bf16)
    mode, sampling, key = gen.mode(), gen.sampling(), jax.random.key(0)
    cache = gen.init_cache(2, 32, pad=[0, 6])
    ids = jnp.asarray([[0, 5, 6, 7, 8, 9, 10, 11], [0] * 6 + [0, 3]], jnp.int32)
    cache, state = gen.prefill(ids, cache, mode, key, sampling)
    old = cache.kv[0]
    cache, state = gen.decode(cache, state, mode, key, sampling)
    assert old.is_deleted()
    assert int(cache.length) == 9 and int(state.step) == 1


def test_check_finite_names_step_and_sequence(fp32_model):
    prompts = [[0, 5, 77], [0, 1, 2, 3, 4, 5, 6]]
    free = generate(fp32_model, prompts, 8)
    # a token row 1 emits at step 2 and that appears nowhere before step 3 in either row
    poison = free[1][2]
    seen = set(prompts[0]) | set(prompts[1]) | set(free[0][:4]) | set(free[1][:2])
    assert poison not in seen, "pick other prompts: the poisoned token is used earlier"
    graphdef, state = nnx.split(fp32_model)
    bad = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))
    w = bad.model.embed_tokens.weight
    w.value = w[...].at[poison].set(jnp.nan)
    with pytest.raises(NonFiniteLogitsError, match=r"step 3 .* sequence 1\b") as info:
        generate(bad, prompts, 8, check_finite=True)
    assert (info.value.step, info.value.sequence) == (3, 1)
    # without the check, tokens stay valid ids
    out = generate(bad, prompts, 8)
    assert out[0] == free[0]
    assert all(0 <= t < fp32_model.cfg.vocab_size for t in out[1])
    # NaN from the prompt itself: step 0
    with pytest.raises(NonFiniteLogitsError, match=r"step 0 .* sequence 0\b"):
        generate(bad, [[0, poison, 3], [0, 5]], 8, check_finite=True)


def test_bad_arguments(fp32_model):
    with pytest.raises(ValueError, match="outside"):
        generate(fp32_model, [[0, 256]], 2)
    with pytest.raises(ValueError, match="empty"):
        generate(fp32_model, [[0, 1], []], 2)
    with pytest.raises(ValueError, match="top_p"):
        generate(fp32_model, [[0, 1]], 2, temperature=1.0, top_p=0.0)
    for bad in (dict(temperature=float("nan")), dict(temperature=float("inf")), dict(temperature=-0.5),
                dict(temperature="1"), dict(top_p=float("nan")), dict(top_p=1.5), dict(top_k=0), dict(top_k=2.5),
                dict(top_k=True)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            generate(fp32_model, [[0, 1]], 2, **bad)
    with pytest.raises(TypeError, match="integer token ids"):
        generate(fp32_model, [[1.5, 2]], 2)
    with pytest.raises(TypeError, match="integer token ids"):
        generate(fp32_model, np.array([[1.0, 2.0]]), 2)
    assert generate(fp32_model, [[0, 1], [2]], 0) == [[], []]


def test_compile_time_counts_nested_traces_once():
    """A jit traced inside another reports its own trace event, which the outer event's duration already
    holds: the compile-time total is the union of the events' intervals, so the time subtracted from a
    phase never exceeds its wall time."""
    import importlib
    import time

    G = importlib.import_module("jax_w4a8.models.deepseek.generate")   # the module (the package exports a function)

    G.compile_counter()                                 # the listener is registered

    @jax.jit
    def inner(v):
        time.sleep(0.3)                                 # at trace time
        return v * 2

    @jax.jit
    def outer(v):
        time.sleep(0.3)
        return inner(v) + 1

    x = jnp.arange(3.0)                                 # the functions are new: nothing cached
    c0, _ = G.compile_counter()
    t0 = time.perf_counter()
    np.testing.assert_array_equal(np.asarray(outer(x)), np.asarray(x) * 2 + 1)
    wall = time.perf_counter() - t0
    spent = G.compile_counter()[0] - c0
    assert 0.6 <= spent <= wall + 1e-3, (spent, wall)   # both sleeps, once each; never more than the wall time
    # the interval union itself: nested and overlapping intervals count once, disjoint ones add up
    saved = (list(G._recent), G._compile_total[0])
    try:
        G._recent.clear()
        G._compile_total[0] = 0.0
        for s, e in ((0.0, 1.0), (2.0, 2.5), (2.6, 2.9), (1.5, 3.0), (2.8, 3.5), (5.0, 6.0)):
            G._count_interval(s, e)
        assert G._compile_total[0] == pytest.approx(1.0 + 2.0 + 1.0)
    finally:
        G._recent[:] = saved[0]
        G._compile_total[0] = saved[1]


# ----------------------------------------------------------------------------------------------
# the step API's cache bound, seeds, argument forms
# ----------------------------------------------------------------------------------------------
P8 = [0, 5, 77, 9, 10, 11, 12, 13]          # exactly the 8-slot bucket: no pad slots


def _steps(gen, cache, n, key, temperature=0.0):
    """Greedy (or sampled) prefill of P8 into ``cache``, then ``n`` decode steps: (tokens, cache, state)."""
    mode, sampling = gen.mode(temperature), gen.sampling(temperature)
    cache, state = gen.prefill(jnp.asarray([P8], jnp.int32), cache, mode, key, sampling)
    toks = [int(state.tokens[0])]
    for _ in range(n):
        cache, state = gen.decode(cache, state, mode, key, sampling)
        toks.append(int(state.tokens[0]))
    return toks, cache, state


def test_decode_past_the_end_of_the_cache_raises(fp32_model):
    """lax.dynamic_update_slice clamps: a decode step on a full cache would overwrite the last slot (wrong tokens,
    ``length`` past the slots). Generator.decode raises instead, before running; up to the last slot the tokens are
    those of a larger cache."""
    gen = Generator(fp32_model)
    key = jax.random.key(0)
    want, cache, _ = _steps(gen, gen.init_cache(1, 16), 4, key)
    assert int(cache.length) == 12 and want == generate(fp32_model, [P8], 5)[0]
    got, cache, state = _steps(gen, gen.init_cache(1, 10), 2, key)            # slots 8 and 9
    assert got == want[:3] and int(cache.length) == 10
    with pytest.raises(ValueError, match=r"all 10 slots .* filled"):
        gen.decode(cache, state, gen.mode(), key, gen.sampling())
    with pytest.raises(ValueError, match=r"all 8 slots .* filled"):
        _steps(gen, gen.init_cache(1, 8), 1, key)
    with pytest.raises(ValueError, match=r"8 tokens .* 4 slots"):
        _steps(gen, gen.init_cache(1, 4), 0, key)
    # a cache built by hand (not counted) stays uncounted after prefill: its length is the device's to know
    kv, pad, _ = gen.init_cache(1, 16)
    _, hand, _ = _steps(gen, MLACache(kv, pad, jnp.zeros((), jnp.int32)), 1, key)
    assert gen._check_room(hand, 100, "decode") is None


def test_seeds_beyond_32_bits_give_other_tokens(fp32_model):
    """A seed below 2**32 keeps jax.random.key(seed) (the tokens of earlier versions); above, the key is the one
    jax.random.key(seed) gives with 64-bit integers, so seed 2**32 + 5 is not seed 5. Seeds outside [0, 2**63)
    are refused."""
    gen = Generator(fp32_model)
    kw = dict(temperature=1.0)
    runs = {}
    for seed in (5, 2**32 - 1, 2**32 + 5, 2**62 + 5):
        runs[seed] = generate(fp32_model, [P8], 8, seed=seed, **kw)[0]
        if seed < 2**32:
            key = jax.random.key(seed)
        else:
            with jax.enable_x64(True):
                key = jax.random.key(seed)
        assert runs[seed] == _steps(gen, gen.init_cache(1, 16), 7, key, 1.0)[0], seed
    assert len({tuple(r) for r in runs.values()}) == 4, runs
    assert generate(fp32_model, [P8], 8, seed=np.uint64(2**32 + 5), **kw)[0] == runs[2**32 + 5]
    assert generate(fp32_model, [P8], 8, seed=jnp.int32(5), **kw)[0] == runs[5]  # a 0-d JAX integer
    for bad in (-1, 2**63, 1.5, True, "5"):
        with pytest.raises(ValueError, match="seed"):
            generate(fp32_model, [P8], 2, seed=bad, **kw)


def test_sampled_tokens_depend_on_the_batch(fp32_model):
    """The documented contract: the same seed gives the same tokens for the same prompts in the same order; a
    prompt's samples depend on the batch it runs in (one key per step draws the whole [B, V] block)."""
    q, p = [0, 9, 8, 7], [0, 3, 4]
    kw = dict(temperature=1.0, seed=5)
    alone = generate(fp32_model, [q], 8, **kw)[0]
    batch = generate(fp32_model, [p, q], 8, **kw)
    assert generate(fp32_model, [p, q], 8, **kw) == batch
    assert batch[1] != alone                                    # q in row 1, not row 0
    twice = generate(fp32_model, [q, q], 8, **kw)
    assert twice[0] != twice[1]                                 # the same prompt twice: two draws
    assert "same order" in generate.__doc__ and "batch it runs in" in generate.__doc__


def test_flat_token_list_is_refused(fp32_model):
    """[0, 5, 77] is not three one-token prompts: a scalar where a prompt should be is an error, as for a 1-D
    array."""
    for bad in ([0, 5, 77], [[0, 5], 77], np.asarray([0, 5, 77])):
        with pytest.raises(ValueError, match="prompts"):
            generate(fp32_model, bad, 3)
    assert generate(fp32_model, [[0], [5], [77]], 1) == [generate(fp32_model, [[t]], 1)[0] for t in (0, 5, 77)]


def test_max_positions_warning_counts_the_positions_fed(fp32_model):
    """The last new token is never fed: 8 prompt tokens + 3 new ones use positions 0..9, 10 positions."""
    import dataclasses
    import warnings

    gen = Generator(fp32_model)
    gen.cfg = dataclasses.replace(fp32_model.cfg, max_position_embeddings=10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        want = gen.generate([P8], 3)
    gen.cfg = dataclasses.replace(fp32_model.cfg, max_position_embeddings=9)
    with pytest.warns(UserWarning, match=r"up to 10 positions, more than .* \(9\)"):
        assert gen.generate([P8], 3) == want


def test_eos_as_a_0d_array_and_out_of_range(fp32_model):
    prompts = [[0, 5, 77], [0, 1, 2, 3, 4, 5, 6]]
    free = generate(fp32_model, prompts, 6)
    eos = free[0][2]
    want = generate(fp32_model, prompts, 6, eos_token_id=eos)
    assert len(want[0]) == 3 and want[0][-1] == eos
    for e in (jnp.int32(eos), jnp.asarray(eos), np.asarray(eos), np.int64(eos), [jnp.int32(eos)]):
        assert generate(fp32_model, prompts, 6, eos_token_id=e) == want, e
    for bad in ([eos, 10**12], 2**31, -2**31 - 1, np.int64(2**40)):
        with pytest.raises(ValueError, match="eos_token_id"):
            generate(fp32_model, prompts, 6, eos_token_id=bad)
    for bad in (float(eos) + 0.7, np.float32(eos), jnp.float32(eos), [eos + 0.5], True):  # never truncated
        with pytest.raises(TypeError, match="eos_token_id"):
            generate(fp32_model, prompts, 6, eos_token_id=bad)


# ----------------------------------------------------------------------------------------------
# review: top_k beyond int32, arguments checked before anything runs, greedy ignores the filters
# ----------------------------------------------------------------------------------------------
def test_top_k_beyond_the_vocabulary_keeps_every_token(fp32_model, rng):
    """top_k >= V keeps every token (transformers clamps it to V), however large: a NumPy int64 2**33 was wrapped to
    int32 (0, clipped to 1: greedy) and a Python int >= 2**31 raised OverflowError."""
    v = 11
    x = rng.normal(size=(3, v)).astype(np.float32)
    for k in (v, v + 1, 2**31, 2**40, np.int64(2**32 + 1), np.int64(2**33)):
        np.testing.assert_array_equal(np.asarray(filter_logits(jnp.asarray(x), top_k=k)), x, err_msg=repr(k))
    # sampling through generate(): the same draws as with no top-k at all
    prompts = [[0] + rng.integers(1, 256, 2).tolist(), [0] + rng.integers(1, 256, 6).tolist()]
    kw = dict(temperature=1.0, seed=int(rng.integers(2**31)))
    want = generate(fp32_model, prompts, 8, **kw)
    for k in (256, 2**40, np.int64(2**33), np.int64(2**32 + 1)):
        assert generate(fp32_model, prompts, 8, top_k=k, **kw) == want, k


def test_arguments_are_checked_before_anything_runs(fp32_model, monkeypatch):
    """generate() promises ValueError / TypeError naming the argument before anything compiles: the model's
    jitted pieces (kv_b_proj's absorbed split included) are made to fail here, so a late check shows up as that
    failure. A float max_new_tokens ran the prefill and then failed in range(); bools were taken as ints."""
    import importlib

    G = importlib.import_module("jax_w4a8.models.deepseek.generate")

    def ran(*a, **k):
        raise AssertionError("the model ran before the arguments were checked")

    for name in ("_absorb", "_prefill", "_decode"):
        monkeypatch.setattr(G, name, ran)
    bad = [dict(max_new_tokens=2.5), dict(max_new_tokens=3.0), dict(max_new_tokens=None), dict(max_new_tokens="3"),
           dict(max_new_tokens=True), dict(max_new_tokens=-1), dict(temperature=float("nan")), dict(top_k=0),
           dict(top_p=2.0), dict(seed=-1), dict(eos_token_id=1.5), dict(pad_token_id=1.5), dict(pad_token_id=None),
           dict(pad_token_id=256), dict(prompts=[[0, 256]]), dict(stream=[])]
    for kw in bad:
        kw = dict(dict(prompts=[[0, 5, 77]], max_new_tokens=4), **kw)
        what = next(k for k in kw if k not in ("prompts", "max_new_tokens")) if len(kw) > 2 else None
        what = what or ("max_new_tokens" if kw["prompts"] == [[0, 5, 77]] else "prompt")
        with pytest.raises((ValueError, TypeError), match=what):
            generate(fp32_model, **kw)
    monkeypatch.undo()
    # integers of any kind still work, an iterator of prompts too (read once)
    want = generate(fp32_model, [[0, 5, 77]], 3)
    assert generate(fp32_model, iter([[0, 5, 77]]), np.int64(3), pad_token_id=np.int32(2)) == want


def test_greedy_ignores_top_k_top_p_without_compiling(fp32_model):
    """top_k / top_p play no part in greedy decoding: setting them (the CLI passes --top-k / --top-p through
    whatever the temperature) must neither change the tokens nor compile another prefill and decode step."""
    prompts = [[0, 5, 77], [0, 1, 2, 3, 4, 5, 6]]
    want = generate(fp32_model, prompts, 4)
    with CompileCount() as cc:
        got = generate(fp32_model, prompts, 4, top_k=5, top_p=0.5)
    assert got == want and cc.n == 0


def test_a_batch_inside_the_prompt_list_is_refused(fp32_model, rng):
    """Each prompt of a list is one sequence of ids: a [B, T] array (or nested lists) inside the list was flattened,
    B prompts silently run as one prompt of B * T tokens. It is an error naming the prompt, as a flat list is; the
    [B, T] array itself is the batch."""
    batch = np.concatenate([np.zeros((2, 1), np.int64), rng.integers(1, 256, (2, 4))], axis=1)
    for bad in ([batch], [batch.tolist()], [[0, 5], batch[:1]]):
        with pytest.raises(ValueError, match="prompt"):
            generate(fp32_model, bad, 2)
    assert generate(fp32_model, batch, 2) == generate(fp32_model, batch.tolist(), 2)
