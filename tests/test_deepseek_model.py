"""The DeepSeek-V3 model against transformers' golden fixtures, dtype discipline, and quantized modes.

* fp32: logits within 1e-4 of transformers (relative to the largest logit), per-layer outputs, routing and
  greedy tokens (teacher-forced rollout) equal.
* bf16: per-token KL(fp32 transformers || ours) <= ``BF16_KL_MAX``; greedy tokens equal, or the first
  divergence is a near tie that the measured bf16 logit error explains (``check_greedy``).
* the jaxpr of a bf16 forward holds no float16 and the residual stream between decoder layers is bf16.
* fp8 / w4a8: KL against the fp32 reference, reported and bounded; and, for weights that are exactly
  representable in the quantized formats, the quantized model equals a float64 reference (transformers'
  semantics, ``tests/golden/np_reference.py``) whose activations are fake-quantized at the same points.
"""

import functools
import json
import os
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from jax_w4a8 import tiling
from jax_w4a8.models.deepseek import (DeepseekConfig, DeepseekV3ForCausalLM, QuantConfig, forward, jit_forward,
                                      layers, load_checkpoint, save_checkpoint)
from test_deepseek_layers import (FIXTURES, GOLDEN, _np_router_margins, custom_calls, load_np_reference,
                                  np_dequant_blocks, np_dequant_w4, np_e4m3, np_fake_quant_fp8, np_fake_quant_tensor)

# Bounds, measured on the four fixtures (transformers 5.17, CPU): see the report printed by each test.
FP32_REL_MAX = 1e-4           # SPEC 7: max |ours - hf| / max |hf|   (measured <= 8.1e-7)
BF16_KL_MAX = 5e-3            # per-token KL, bf16 model vs fp32 transformers   (measured <= 1.2e-3)
BF16_KL_MEAN = 1.5e-3         # (measured <= 3.6e-4)
BF16_KL_MAX_GPU = 0.08  # one near-tie routing flip allowed (see test_golden_bf16)


def golden(name):
    return os.path.join(GOLDEN, name), np.load(os.path.join(GOLDEN, name, "expected.npz"))


def log_softmax(x):
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def kl(ref_logits, logits):
    """Per-token KL(softmax(ref) || softmax(logits)) in float64: [...]."""
    lp, lq = log_softmax(ref_logits), log_softmax(logits)
    return (np.exp(lp) * (lp - lq)).sum(-1)


def f32(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32))


def check_greedy(logits, ref_logits, greedy, t0, tie_abs=0.25):
    """Teacher-forced greedy check over positions ``t0-1 .. t0+n-2`` of full-sequence logits [B, T+n, V].

    Token by token per row: equal to the reference's greedy token, or else this is the rollout's first
    divergence and it must be a near tie: the reference margin between its token and ours is at most
    ``tol = min(tie_abs, 2 * q90)``, where ``q90`` is the 90th percentile over all positions of our max
    absolute logit error (the error the model makes everywhere, not just here). Later tokens of that row
    are not compared (the rollout diverged there). Returns the list of ``(row, step, margin)`` near ties.
    """
    ours = logits[:, t0 - 1:-1].argmax(-1)
    per_pos_err = np.abs(logits.astype(np.float64) - ref_logits).max(-1)
    tol = min(tie_abs, 2 * float(np.quantile(per_pos_err, 0.9)))
    ties = []
    for b in range(greedy.shape[0]):
        bad = np.nonzero(ours[b] != greedy[b])[0]
        if not len(bad):
            continue
        j = bad[0]
        pos = t0 - 1 + j
        want, got = greedy[b, j], ours[b, j]
        r = ref_logits[b, pos].astype(np.float64)
        assert r.argmax() == want, "reference logits disagree with the reference greedy tokens"
        margin = r[want] - r[got]
        assert margin <= tol, (f"row {b} step {j}: greedy token {got} instead of {want}; the reference margin "
                               f"{margin:.4g} is not a near tie (tolerance {tol:.4g} from the logit error)")
        ties.append((b, int(j), float(margin)))
    return ties


# ----------------------------------------------------------------------------------------------
# golden: fp32
# ----------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnums=0)
def _attention_and_routing(graphdef, state, hidden, positions):
    """Per layer: attention output (after o_proj) and (for MoE layers) router choices, given layer inputs."""
    model = nnx.merge(graphdef, state)
    cfg = model.cfg
    cos, sin = layers.rope_cos_sin(positions, cfg, model.dtype)
    mask = positions[:, :, None] >= positions[:, None, :]
    out = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn(layer.input_layernorm(hidden[i]), cos, sin, mask)
        routing = None
        if cfg.is_moe_layer(i):
            routing = layer.mlp.gate(layer.post_attention_layernorm(hidden[i] + attn).reshape(-1, cfg.hidden_size))
        out.append((attn, routing))
    return out


@pytest.mark.parametrize("name", FIXTURES)
def test_golden_fp32(name, device):
    path, exp = golden(name)
    t0 = exp["input_ids"].shape[1]
    with jax.default_device(device):
        model = load_checkpoint(path, dtype=jnp.float32, progress=False)
        full, hidden = jit_forward(model)(jnp.asarray(exp["full_input_ids"]), return_hidden_states=True)
        # a causal model: the prompt's logits are the first T positions of the full sequence
        ids = jnp.asarray(exp["input_ids"])
        probes = _attention_and_routing(*nnx.split(model), [h[:, :t0] for h in hidden],
                                        jnp.broadcast_to(jnp.arange(t0), ids.shape))
    full = f32(full)
    np.testing.assert_array_equal(exp["full_input_ids"][:, :t0], exp["input_ids"])
    assert full.dtype == np.float32 and full.shape == exp["full_logits"].shape
    err = np.abs(full[:, :t0] - exp["logits"]).max() / np.abs(exp["logits"]).max()
    err_full = np.abs(full - exp["full_logits"]).max() / np.abs(exp["full_logits"]).max()
    print(f"{name}: fp32 max rel logit error {err:.2e} (prompt), {err_full:.2e} (prompt + greedy)")
    assert err <= FP32_REL_MAX and err_full <= FP32_REL_MAX
    np.testing.assert_array_equal(f32(hidden[0])[:, :t0], exp["embeds"])
    for i in range(len(hidden) - 1):
        ref = exp["layer_out"][i]
        assert np.abs(f32(hidden[i + 1])[:, :t0] - ref).max() / np.abs(ref).max() <= FP32_REL_MAX, f"layer {i}"
    np.testing.assert_array_equal(full[:, t0 - 1:-1].argmax(-1), exp["greedy_tokens"])
    np.testing.assert_array_equal(full[:, t0 - 1:-1].argmax(-1), exp["hf_generate_tokens"])
    # attention outputs and routing of every layer, through the modules themselves
    for i, (attn, routing) in enumerate(probes):
        ref = exp["attn_out"][i]
        assert np.abs(f32(attn) - ref).max() / np.abs(ref).max() <= FP32_REL_MAX, f"attention {i}"
        if routing is None:
            continue
        topk, weights = (np.asarray(a) for a in routing)
        order = np.argsort(topk, -1)
        np.testing.assert_array_equal(np.take_along_axis(topk, order, -1), exp[f"topk_idx_layer{i}"])
        np.testing.assert_allclose(np.take_along_axis(weights, order, -1), exp[f"topk_weight_layer{i}"],
                                   rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# golden: bf16
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", FIXTURES)
def test_golden_bf16(name, device):
    path, exp = golden(name)
    with jax.default_device(device):
        model = load_checkpoint(path, dtype=jnp.bfloat16, progress=False)
        full = jit_forward(model)(jnp.asarray(exp["full_input_ids"]))
    assert full.dtype == jnp.bfloat16
    full = f32(full)
    k = kl(exp["full_logits"], full)
    err = np.abs(full - exp["full_logits"]).max() / np.abs(exp["full_logits"]).max()
    print(f"{name}: bf16 KL max {k.max():.2e} mean {k.mean():.2e}; max rel logit error {err:.2e}")
    # On the GPU, bf16 sums in another order than on the CPU; a router choice that is a near tie can
    # then flip for a single token, raising that token's KL (seen: 0.039 on the H200 for one token of
    # yarn_qlora). The mean bound stays; the per-token bound allows such a flip there.
    kl_max = BF16_KL_MAX if device.platform == "cpu" else BF16_KL_MAX_GPU
    assert k.max() <= kl_max and k.mean() <= BF16_KL_MEAN
    ties = check_greedy(full, exp["full_logits"], exp["greedy_tokens"], exp["input_ids"].shape[1])
    print(f"{name}: near-tie greedy divergences: {ties}")


def test_bf16_model_keeps_the_router_weight_fp32(rng):
    """transformers keeps the router weight in float32 in a bf16 model (``_keep_in_fp32_modules_strict =
    ["e_score_correction_bias", "gate.weight"]`` in 5.25; 5.17 kept only the bias): a float32 checkpoint's
    ``mlp.gate.weight`` is used unrounded. This model rounded it to bf16, which moved the experts of 0.3-1% of
    tokens against transformers' bf16 model on the same bf16 router inputs (here about 0.3%; 0.95% at E=64,
    8 groups, top-8)."""
    ref = load_np_reference()
    path, _ = golden("yarn_qlora")                   # a float32 checkpoint
    with open(os.path.join(path, "config.json")) as f:
        c = ref.resolve_config(json.load(f))
    w = ref.load_weights(os.path.join(path, "model.safetensors"), c)
    model = load_checkpoint(path, dtype=jnp.bfloat16, progress=False)
    layer = next(i for i in range(c["num_hidden_layers"]) if i >= c["first_k_dense_replace"])
    gate = model.model.layers[layer].mlp.gate
    p = f"model.layers.{layer}.mlp."
    assert gate.weight[...].dtype == jnp.float32 and gate.e_score_correction_bias[...].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(gate.weight[...]), w[p + "gate.weight"].astype(np.float32))

    # bf16 router inputs (the post-attention norm's output in a bf16 model), routed in float64 with the weights
    x = rng.standard_normal((16384, c["hidden_size"])).astype(ml_dtypes.bfloat16).astype(np.float64)
    want_ids, want_w = ref.router(c, w, p, x)
    g, tg, k = c["n_group"], c["topk_group"], c["num_experts_per_tok"]
    ok = _np_router_margins(x, w[p + "gate.weight"], w[p + "gate.e_score_correction_bias"], g, tg, k) > 1e-5
    rounded = dict(w, **{p + "gate.weight": w[p + "gate.weight"].astype(ml_dtypes.bfloat16).astype(np.float64)})
    moved = (ref.router(c, rounded, p, x)[0] != want_ids).any(-1) & ok
    assert moved.sum() >= 5, "rounding the router weight to bf16 moves no token here: the test shows nothing"
    ids, weights = (np.asarray(a) for a in gate(jnp.asarray(x, jnp.bfloat16)))
    order = np.argsort(ids, -1)
    ids, weights = np.take_along_axis(ids, order, -1), np.take_along_axis(weights, order, -1)
    print(f"tokens the bf16-rounded router weight would move: {moved.sum()} of {len(x)}; "
          f"moved here: {(ids != want_ids).any(-1)[ok].sum()}")
    np.testing.assert_array_equal(ids[ok], want_ids[ok])
    np.testing.assert_allclose(weights[ok], want_w[ok], rtol=1e-5)


def test_check_greedy_accepts_only_near_ties():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((2, 7, 10)) * 3
    noise = rng.uniform(-0.05, 0.05, ref.shape)             # the "model error" everywhere
    t0 = 3
    greedy = ref[:, t0 - 1:-1].argmax(-1)
    assert check_greedy(ref + 0 * noise, ref, greedy, t0) == []
    # reference near tie (margin 0.03) at row 1, step 1, flipped by an error like the others: accepted,
    # and the steps after the divergence are not compared
    top = np.argsort(ref[1, t0])[-2:]
    ref[1, t0, top[0]] = ref[1, t0, top[1]] - 0.03
    greedy = ref[:, t0 - 1:-1].argmax(-1)
    ours = ref + noise
    ours[1, t0, top[0]], ours[1, t0, top[1]] = ref[1, t0, top[1]] + 0.01, ref[1, t0, top[1]] - 0.01
    ours[1, t0 + 1:] = -ours[1, t0 + 1:]
    assert check_greedy(ours, ref, greedy, t0) == [(1, 1, pytest.approx(0.03))]
    # a divergence at a clear margin (same flip mechanics, margin 1.0): rejected
    ref2 = ref.copy()
    ref2[1, t0, top[0]] = ref[1, t0, top[1]] - 1.0
    ours2 = ref2 + noise
    ours2[1, t0, top[0]] = ref2[1, t0, top[1]] + 0.5
    with pytest.raises(AssertionError, match="not a near tie"):
        check_greedy(ours2, ref2, ref2[:, t0 - 1:-1].argmax(-1), t0)


def test_positions_reach_rope():
    """RoPE scores depend on position differences only: shifting every position leaves the logits unchanged,
    stretching them does not (so explicit positions really drive the rotation)."""
    path, exp = golden("yarn_qlora")
    model = load_checkpoint(path, dtype=jnp.float32, progress=False)
    ids = jnp.asarray(exp["input_ids"])
    pos = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
    fwd = jit_forward(model)
    base = f32(fwd(ids, pos))
    np.testing.assert_allclose(base, exp["logits"], rtol=0, atol=1e-4 * np.abs(exp["logits"]).max())
    shifted = f32(fwd(ids, pos + 7))
    np.testing.assert_allclose(shifted, base, rtol=0, atol=1e-4 * np.abs(base).max())
    stretched = f32(fwd(ids, pos * 2))
    assert np.abs(stretched - base).max() > 1e-2 * np.abs(base).max()


def test_left_padded_rows_with_attention_mask_match_the_unpadded_sequence():
    """As transformers: a row left-padded with ``attention_mask`` 0 and positions counting real tokens gives its
    real tokens the logits of the unpadded sequence (the pads are never attended), whatever the pad ids; the
    mask once came from the positions, so real tokens attended pads at positions 0 and 1 (relative error 0.4-0.7
    against transformers' left-padded forward)."""
    path, exp = golden("yarn_qlora")
    model = load_checkpoint(path, dtype=jnp.float32, progress=False)
    fwd = jit_forward(model)
    ids = np.asarray(exp["input_ids"])[:1]
    t, pad = ids.shape[1], 3
    want = f32(fwd(jnp.asarray(ids)))[0]
    got = []
    for pad_id in (0, 7):
        padded = np.concatenate([np.full((1, pad), pad_id, ids.dtype), ids], axis=1)
        mask = np.concatenate([np.zeros((1, pad), np.int32), np.ones((1, t), np.int32)], axis=1)
        positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)  # transformers' position_ids
        got.append(f32(fwd(jnp.asarray(padded), jnp.asarray(positions), jnp.asarray(mask)))[0, pad:])
        assert np.isfinite(got[-1]).all()
    for g in got:
        np.testing.assert_allclose(g, want, rtol=0, atol=1e-4 * np.abs(want).max())
    with pytest.raises(ValueError, match="attention_mask must have input_ids' shape"):
        fwd(jnp.asarray(ids), None, jnp.ones((1, t + 1), jnp.int32))


def test_packed_sequences_never_attend_later_tokens():
    """Two sequences packed in one row, positions restarting at 0: the first sequence's logits are those of it
    alone (the mask is causal in token order; it once came from the positions, and a token attended the later
    tokens of the second sequence at the same or a smaller position)."""
    path, exp = golden("yarn_qlora")
    model = load_checkpoint(path, dtype=jnp.float32, progress=False)
    fwd = jit_forward(model)
    ids = np.asarray(exp["input_ids"])
    first, second = ids[:1], ids[1:] if ids.shape[0] > 1 else ids[:1, ::-1]
    packed = np.concatenate([first, second], axis=1)
    positions = np.concatenate([np.arange(first.shape[1]), np.arange(second.shape[1])])[None].astype(np.int32)
    want = f32(fwd(jnp.asarray(first)))[0]
    got = f32(fwd(jnp.asarray(packed), jnp.asarray(positions)))[0, :first.shape[1]]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_set_attention_reaches_every_prefill_with_the_causal_promise(monkeypatch):
    """``set_attention`` is a static part of the model: each layer's expanded attention gets it (a jitted forward
    retraces), with ``causal`` on every prefill (the mask is causal in token order whatever the positions, and in
    generate's prefill); decode steps use the latent attention."""
    from jax_w4a8.models.deepseek import generate
    from jax_w4a8.models.deepseek.model import default_positions
    jax.clear_caches()        # traces of the same model from other tests would skip the recorder
    path, exp = golden("yarn_qlora")
    model = load_checkpoint(path, progress=False)
    seen = []
    real = layers.mla_attention

    def recorder(*a, implementation="eager", causal=False, **kw):
        seen.append((implementation, causal))
        return real(*a, implementation="eager", causal=causal, **kw)

    monkeypatch.setattr(layers, "mla_attention", recorder)
    ids = jnp.asarray(exp["input_ids"])
    layers_n = model.cfg.num_hidden_layers
    jit_forward(model)(ids)
    assert seen == [("auto", True)] * layers_n                       # the default
    seen.clear()
    assert model.set_attention("eager") is model
    jit_forward(model)(ids, default_positions(ids) + 3)   # causal in token order whatever the positions
    assert seen == [("eager", True)] * layers_n
    seen.clear()
    generate(model, [[1, 2, 3], [4]], 3)
    assert seen == [("eager", True)] * layers_n                     # prefill only: the decode steps are latent
    with pytest.raises(ValueError, match="implementation"):
        model.set_attention("flash")
    f32_model = load_checkpoint(path, dtype=jnp.float32, progress=False)
    with pytest.raises(ValueError, match="bf16"):
        f32_model.set_attention("cudnn")


def _forward_targets(model, ids):
    """The jax_w4a8 custom calls of the model's jitted forward, as lowered for the default device."""
    graphdef, state = nnx.split(model)
    return custom_calls(forward.lower(graphdef, state, ids).as_text())


def test_set_moe_up_reaches_every_moe_layer_and_refuses_experts_that_cannot_fuse(rng, device):
    """``set_moe_up`` sets each MoE layer's routed experts (static: a jitted forward retraces). On the CPU the
    fused op composes the unfused ops, so the logits keep their bits; on a GPU the fused kernel runs and the
    logits stay close (gate and up are no longer rounded to bf16 before SiLU-mul). Static activation scales (a
    W4AFP8 checkpoint's ``input_scale``) fuse too."""
    on_gpu = device.platform == "gpu"
    # one dense layer, then one MoE layer, the last: no routing decision sees the difference between fused and
    # unfused (with a MoE layer after it, a top-k choice that flipped moved the logits by up to 25%; here 0.3-0.7%)
    cfg = DeepseekConfig.from_dict(dict(TINY128, num_hidden_layers=2))
    with jax.default_device(device):
        model = DeepseekV3ForCausalLM(cfg, quant=QuantConfig.w4a8(ue8m0=True), dtype=jnp.bfloat16,
                                      rngs=nnx.Rngs(int(rng.integers(1 << 30))))
        experts = [layer.mlp.experts for layer in model.model.layers if isinstance(layer.mlp, layers.MoE)]
        assert len(experts) == cfg.num_hidden_layers - cfg.first_k_dense_replace
        assert all(e.moe_up == "auto" and e.can_fuse_up for e in experts)
        ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 5)), jnp.int32)
        # "auto" fuses here (10 tokens x top-2 = 20 rows over 8 experts, K split on a GPU): the default
        assert tiling.moe_up_fuses(20, 8, 128, 256) and ("w4a8_moe_up" in _forward_targets(model, ids)) == on_gpu
        want = np.asarray(jit_forward(model.set_moe_up("unfused"))(ids), np.float32)
        assert "w4a8_moe_up" not in _forward_targets(model, ids)
        for impl in ("fused", "auto"):
            assert model.set_moe_up(impl) is model
            assert [e.moe_up for e in experts] == [impl] * len(experts)
            got = np.asarray(jit_forward(model)(ids), np.float32)
            assert ("w4a8_moe_up" in _forward_targets(model, ids)) == on_gpu
            if on_gpu:
                assert np.isfinite(got).all() and np.linalg.norm(got - want) < 3e-2 * np.linalg.norm(want)
            else:
                np.testing.assert_array_equal(got, want)
        with pytest.raises(ValueError, match="implementation"):
            model.set_moe_up("fast")
        f32 = DeepseekV3ForCausalLM(cfg, quant=QuantConfig.w4a8(), dtype=jnp.float32, rngs=nnx.Rngs(0))
        with pytest.raises(ValueError, match="bf16"):
            f32.set_moe_up("fused")
        assert f32.set_moe_up("auto") is f32          # its experts stay unfused
        assert "w4a8_moe_up" not in _forward_targets(f32, ids)
        # float32 dynamic scales (the W4AFP8 checkpoint's default) fuse too
        plain = DeepseekV3ForCausalLM(cfg, quant=QuantConfig.w4a8(), dtype=jnp.bfloat16, rngs=nnx.Rngs(2))
        want = np.asarray(jit_forward(plain.set_moe_up("unfused"))(ids), np.float32)
        got = np.asarray(jit_forward(plain.set_moe_up("fused"))(ids), np.float32)
        assert ("w4a8_moe_up" in _forward_targets(plain, ids)) == on_gpu
        if on_gpu:
            assert np.isfinite(got).all() and np.linalg.norm(got - want) < 3e-2 * np.linalg.norm(want)
        else:
            np.testing.assert_array_equal(got, want)
        static = DeepseekV3ForCausalLM(cfg, quant=QuantConfig.w4a8(act_scale="static", input_scales=True),
                                       dtype=jnp.bfloat16, rngs=nnx.Rngs(1))
        want = np.asarray(jit_forward(static.set_moe_up("unfused"))(ids), np.float32)
        got = np.asarray(jit_forward(static.set_moe_up("fused"))(ids), np.float32)
        assert ("w4a8_moe_up" in _forward_targets(static, ids)) == on_gpu
        # h no longer rounded to bf16 (on the CPU too: the composed static path quantizes float32 h)
        assert np.isfinite(got).all() and 0 < np.linalg.norm(got - want) < 3e-2 * np.linalg.norm(want)


# ----------------------------------------------------------------------------------------------
# dtypes of a bf16 forward
# ----------------------------------------------------------------------------------------------
TINY128 = dict(vocab_size=512, hidden_size=256, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=3,
               num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=8, kv_lora_rank=128,
               q_lora_rank=128, qk_rope_head_dim=64, v_head_dim=64, qk_nope_head_dim=64, n_group=2, topk_group=1,
               num_experts_per_tok=2, first_k_dense_replace=1, routed_scaling_factor=2.5, max_position_embeddings=64,
               rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32,
                             "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
"""Every dim that an FP8 / W4A8 op contracts is a multiple of 128 (hidden 256, ranks 128, H*dv 128, I 128)."""


def _sub_jaxprs(eqn):
    for p in eqn.params.values():
        for v in (p if isinstance(p, (list, tuple)) else (p,)):
            if isinstance(v, jax.extend.core.ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, jax.extend.core.Jaxpr):
                yield v


def _walk(jaxpr, visit):
    for eqn in jaxpr.eqns:
        visit(eqn)
        for sub in _sub_jaxprs(eqn):
            _walk(sub, visit)


@pytest.mark.parametrize("quant", [QuantConfig(), QuantConfig.fp8(), QuantConfig.w4a8(),
                                   QuantConfig.w4a8(act_scale="static", input_scales=True, ue8m0=True)],
                         ids=["bf16", "fp8", "w4a8", "w4a8-static-ue8m0"])
def test_bf16_forward_jaxpr_dtypes(quant):
    cfg = DeepseekConfig.from_dict(TINY128)
    model = DeepseekV3ForCausalLM(cfg, quant=quant, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    b, t, d = 2, 5, cfg.hidden_size
    closed = jax.make_jaxpr(forward, static_argnums=0)(graphdef, state, jnp.zeros((b, t), jnp.int32))
    seen = {"vars": 0, "ffi": []}
    layers_eqns = []

    def visit(eqn):
        for v in list(eqn.invars) + list(eqn.outvars):
            aval = getattr(v, "aval", None)
            if aval is not None and hasattr(aval, "dtype"):
                seen["vars"] += 1
                assert aval.dtype != jnp.float16, f"float16 in {eqn.primitive.name}: {eqn}"
        if eqn.primitive.name == "ffi_call":
            for a in eqn.params["result_avals"]:
                assert a.dtype != jnp.float16
            seen["ffi"].append((eqn.params["target_name"], [str(a.dtype) for a in eqn.params["result_avals"]]))
        if eqn.primitive.name in ("jit", "pjit") and eqn.params.get("name") == "decoder_layer":
            layers_eqns.append(eqn)

    _walk(closed.jaxpr, visit)
    assert seen["vars"] > 100
    for v in list(closed.jaxpr.invars) + list(closed.jaxpr.constvars):
        assert v.aval.dtype != jnp.float16
    assert len(layers_eqns) == cfg.num_hidden_layers
    for i, eqn in enumerate(layers_eqns):
        (out,) = eqn.outvars
        assert out.aval.dtype == jnp.bfloat16 and out.aval.shape == (b, t, d), f"layer {i} output {out.aval}"
        h_in = [v for v in eqn.invars if getattr(v, "aval", None) is not None and v.aval.shape == (b, t, d)]
        assert len(h_in) == 1 and h_in[0].aval.dtype == jnp.bfloat16, f"layer {i} input {h_in}"
        if i:
            assert h_in[0] is layers_eqns[i - 1].outvars[0], "layer input is not the previous layer's output"
    assert closed.jaxpr.outvars[0].aval.dtype == jnp.bfloat16
    targets = {name for name, _ in seen["ffi"]}
    if quant.linear == "fp8":
        assert any(n.endswith("fp8_einsum") for n in targets)
    if quant.experts == "w4a8":
        assert any(n.endswith("w4a8_grouped_gemm") for n in targets)
    for name, dts in seen["ffi"]:
        if name.endswith(("fp8_einsum", "w4a8_grouped_gemm")):
            assert dts[0] == "bfloat16", (name, dts)           # the GEMM output (a uint8 workspace may follow)


# ----------------------------------------------------------------------------------------------
# tiny checkpoints whose dims suit the FP8 / W4A8 ops
# ----------------------------------------------------------------------------------------------
def _linear_keys(cfg: DeepseekConfig):
    """(key, [out, in]) of every linear of the HF hub layout, plus whether it is a routed expert."""
    d, h = cfg.hidden_size, cfg.num_attention_heads
    dn, dr, dv, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    out = []
    for i in range(cfg.num_hidden_layers):
        a = f"model.layers.{i}.self_attn."
        if cfg.q_lora_rank is None:
            out.append((a + "q_proj.weight", (h * (dn + dr), d), False))
        else:
            out += [(a + "q_a_proj.weight", (cfg.q_lora_rank, d), False),
                    (a + "q_b_proj.weight", (h * (dn + dr), cfg.q_lora_rank), False)]
        out += [(a + "kv_a_proj_with_mqa.weight", (r + dr, d), False),
                (a + "kv_b_proj.weight", (h * (dn + dv), r), False), (a + "o_proj.weight", (d, h * dv), False)]
        m = f"model.layers.{i}.mlp."
        mlps = [(m, cfg.intermediate_size, False)] if not cfg.is_moe_layer(i) else (
            [(m + "shared_experts.", cfg.moe_intermediate_size * cfg.n_shared_experts, False)] +
            [(f"{m}experts.{j}.", cfg.moe_intermediate_size, True) for j in range(cfg.n_routed_experts)])
        for p, inter, expert in mlps:
            out += [(p + "gate_proj.weight", (inter, d), expert), (p + "up_proj.weight", (inter, d), expert),
                    (p + "down_proj.weight", (d, inter), expert)]
    return out


def _pow2_near(x, rng):
    return np.exp2(np.round(np.log2(x)) + rng.integers(-1, 2))


def fp8_representable(rng, shape, std):
    """float32 [N, K] = e4m3 codes * power-of-two 128x128 block scale, with a +-448 code in every block."""
    n, k = shape
    w = np.empty(shape, np.float32)
    for r0 in range(0, n, 128):
        for c0 in range(0, k, 128):
            blk = w[r0:r0 + 128, c0:c0 + 128]
            s = _pow2_near(3 * std / 448, rng)
            codes = np_e4m3(rng.standard_normal(blk.shape) * std / s)
            codes.flat[rng.integers(codes.size)] = 448.0 * rng.choice([-1, 1])
            blk[...] = codes * s
    return w


def int4_representable(rng, shape, std):
    """float32 [N, K] = int4 codes * power-of-two scale per 128x128 block, with a +-7 code in every row's
    128-group: exactly W4 group-128 (s = amax / 7) AND exactly FP8-block (scale s / 64, codes 64 q)."""
    n, k = shape
    w = np.empty(shape, np.float32)
    for r0 in range(0, n, 128):
        for c0 in range(0, k, 128):
            blk = w[r0:r0 + 128, c0:c0 + 128]
            s = _pow2_near(2.5 * std / 7, rng)
            q = np.clip(np.round(rng.standard_normal(blk.shape) * std / s), -7, 7)
            q[np.arange(q.shape[0]), rng.integers(q.shape[1], size=q.shape[0])] = 7 * rng.choice([-1, 1], q.shape[0])
            blk[...] = q * s
    return w


def random_weights(cfg: DeepseekConfig, rng, representable=False):
    """A float32 state dict in the hub layout (SEMANTICS.md section 10), distributions as the golden fixtures."""
    d, v = cfg.hidden_size, cfg.vocab_size
    w = {"model.embed_tokens.weight": rng.standard_normal((v, d)).astype(np.float32),
         "model.norm.weight": (1 + 0.2 * rng.standard_normal(d)).astype(np.float32),
         "lm_head.weight": (rng.standard_normal((v, d)) * 2 / np.sqrt(d)).astype(np.float32)}
    for key, shape, expert in _linear_keys(cfg):
        std = 1 / np.sqrt(shape[1])
        if not representable:
            w[key] = (rng.standard_normal(shape) * std).astype(np.float32)
        else:
            w[key] = (int4_representable if expert else fp8_representable)(rng, shape, std)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        norms = [("input_layernorm", d), ("post_attention_layernorm", d),
                 ("self_attn.kv_a_layernorm", cfg.kv_lora_rank)]
        if cfg.q_lora_rank is not None:
            norms.append(("self_attn.q_a_layernorm", cfg.q_lora_rank))
        for name, n in norms:
            w[p + name + ".weight"] = (1 + 0.2 * rng.standard_normal(n)).astype(np.float32)
        if cfg.is_moe_layer(i):
            e = cfg.n_routed_experts
            w[p + "mlp.gate.weight"] = (rng.standard_normal((e, d)) * 1.5 / np.sqrt(d)).astype(np.float32)
            w[p + "mlp.gate.e_score_correction_bias"] = (rng.standard_normal(e) * 0.15).astype(np.float32)
    return w


def write_checkpoint(path, config: dict, weights: dict, n_shards=1, quantization_config=None):
    """config.json + model.safetensors (or an index over ``n_shards`` files, keys dealt round-robin)."""
    os.makedirs(path, exist_ok=True)
    config = dict(config)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    keys = list(weights)
    if n_shards == 1:
        save_file({k: weights[k] for k in keys}, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for s in range(n_shards):
        fn = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {k: weights[k] for k in keys[s::n_shards]}
        save_file(part, os.path.join(path, fn), metadata={"format": "pt"})
        weight_map.update({k: fn for k in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


# ----------------------------------------------------------------------------------------------
# the float64 reference with fake-quantized activations
# ----------------------------------------------------------------------------------------------
class _QW:
    """A weight [N, K] (or stacked [E, N, K]) whose products fake-quantize the activation operand:
    ``x @ QW.T == fq(x) @ W.T`` and ``QW[j] @ x == W[j] @ fq(x)`` (np_reference's two product forms)."""
    __array_ufunc__ = None

    def __init__(self, w, fq, record=None, key=None):
        self.w, self.fq, self.record, self.key = w, fq, record, key

    def _q(self, x):
        if self.record is not None:
            self.record[self.key] = max(self.record.get(self.key, 0.0), float(np.abs(x).max()))
        return self.fq(x)

    @property
    def T(self):
        return _QWT(self)

    def __getitem__(self, j):
        return _QW(self.w[j], self.fq, self.record, None if self.key is None else self.key + (j,))

    def __matmul__(self, x):
        return self.w @ self._q(x)


def _recorder(store, key):
    def f(x):
        store[key] = x
        return x
    return f


class _QWT:
    __array_ufunc__ = None

    def __init__(self, q):
        self.q = q

    def __rmatmul__(self, x):
        return self.q._q(x) @ self.q.w.T


def np_reference_forward(path, ids, linear_fq=None, expert_fq=None, record=None):
    """tests/golden/np_reference.py forward (float64) with activation fake-quant hooks.

    ``linear_fq(x)`` is applied to the input of every attention / dense / shared-expert linear,
    ``expert_fq(layer, which, x)`` (which: "gate_up" | "down") to the routed experts' inputs. ``record``
    collects max |input| per (layer, which, expert) and the router inputs per layer (``"router_inputs"``).
    """
    ref = load_np_reference()
    with open(os.path.join(path, "config.json")) as f:
        c = ref.resolve_config(json.load(f))
    w = ref.load_weights(os.path.join(path, "model.safetensors"), c)
    for key in list(w):
        layer = int(key.split(".")[2]) if key.startswith("model.layers.") else None
        if key.endswith(("experts.gate", "experts.up", "experts.down")):
            which = "down" if key.endswith("down") else "gate_up"
            fq = (lambda x: x) if expert_fq is None else (lambda x, l=layer, wh=which: expert_fq(l, wh, x))
            w[key] = _QW(w[key], fq, record, (layer, which))
        elif key.endswith(("proj.weight", "proj_with_mqa.weight")):
            w[key] = _QW(w[key], linear_fq or (lambda x: x))
        elif key.endswith("mlp.gate.weight") and record is not None:
            w[key] = _QW(w[key], _recorder(record.setdefault("router_inputs", {}), layer))
    return ref.forward(c, w, np.asarray(ids, np.int64))


_E4M3 = ml_dtypes.float8_e4m3fn


def rounding_margin(y):
    """Smallest relative distance ``d / |y|`` of the values ``y`` (= x / s, float32) from an e4m3 rounding
    boundary (midpoint of two neighbouring codes); values that round to 0 or saturate are exempt."""
    y = np.abs(np.asarray(y, np.float64)).ravel()
    y = y[(y > 0) & (y < 448)]
    if not y.size:
        return np.inf
    q = y.astype(_E4M3)
    b = q.view(np.uint8)
    qf = q.astype(np.float64)
    up = np.where(qf >= 448, np.inf, (b + 1).view(_E4M3).astype(np.float64))
    dn = np.where(b == 0, -np.inf, (b - np.uint8(1)).view(_E4M3).astype(np.float64))   # b == 0: no code below
    d = np.minimum(np.abs(y - (qf + up) / 2), np.abs(y - (qf + dn) / 2))
    return float((d / y).min())


class FakeQuant:
    """Activation fake-quantizers for the reference that remember how close any value came to an e4m3
    rounding boundary (``margin``): a float32 model and this float64 reference can only disagree on a
    code (and then diverge chaotically) if the margin is below their relative difference (~1e-6)."""

    def __init__(self):
        self.margin = np.inf

    def groups(self, x):
        x32 = np.asarray(x, np.float32)
        k = x32.shape[-1]
        xp = np.concatenate([x32, np.zeros(x32.shape[:-1] + ((-k) % 128,), np.float32)], -1)
        g = xp.reshape(*xp.shape[:-1], -1, 128)
        s = np.maximum(np.abs(g).max(-1, keepdims=True), np.float32(1e-4)) / np.float32(448)
        self.margin = min(self.margin, rounding_margin(g / s))
        return np_fake_quant_fp8(x)

    def tensor(self, x, s):
        self.margin = min(self.margin, rounding_margin(np.asarray(x, np.float32) / np.float32(s)))
        return np_fake_quant_tensor(x, s)


def _header_keys(file):
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return [k for k in json.loads(f.read(n)) if k != "__metadata__"]


def add_shard(path, extra: dict):
    """Turns a single-file checkpoint into two shards + index, the second holding ``extra``."""
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    os.replace(os.path.join(path, "model.safetensors"), os.path.join(path, first))
    save_file(extra, os.path.join(path, second), metadata={"format": "pt"})
    weight_map = {k: first for k in _header_keys(os.path.join(path, first))} | {k: second for k in extra}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


# ----------------------------------------------------------------------------------------------
# quantized modes
# ----------------------------------------------------------------------------------------------
# bf16-activation FP8 / W4A8 models against transformers' fp32 logits on the golden fixtures. The fixtures'
# hidden size (64) is not a multiple of 128, so "w4a8" keeps the experts in bf16 there (FP8 linears
# zero-pad K); random tiny MoEs flip routing decisions under quantization noise, which dominates these KLs.
# Measured (CPU): fp8 KL mean 0.022-0.090, max 0.23-0.71; w4a8 mean 0.020-0.105, max 0.23-1.32.
GOLDEN_QUANT_KL_MEAN, GOLDEN_QUANT_KL_MAX = 0.25, 2.5


@pytest.mark.parametrize("mode", ["fp8", "w4a8"])
@pytest.mark.parametrize("name", FIXTURES)
def test_golden_quantized_kl(name, mode, device):
    path, exp = golden(name)
    with jax.default_device(device), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load_checkpoint(path, quantize=mode, dtype=jnp.bfloat16, progress=False)
        full = f32(jit_forward(model)(jnp.asarray(exp["full_input_ids"])))
    assert any("not a multiple of 128" in str(c.message) for c in caught) == (mode == "w4a8")
    assert model.quant.linear == "fp8" and model.quant.experts == ("fp8" if mode == "fp8" else "none")
    k = kl(exp["full_logits"], full)
    print(f"{name} {mode}: KL vs transformers fp32: max {k.max():.3g} mean {k.mean():.3g}")
    assert k.mean() <= GOLDEN_QUANT_KL_MEAN and k.max() <= GOLDEN_QUANT_KL_MAX


# Every token uses every expert (top-k = E, one group): no discrete routing choice, so the KL measures the
# quantization error itself. Measured over 30 random models (bf16 activations vs the fp32 model):
# fp8 KL mean <= 0.037, max <= 0.10; w4a8 mean <= 0.077, max <= 0.18 (bf16 alone: mean <= 5e-4).
ROUTE_ALL = dict(TINY128, n_routed_experts=4, num_experts_per_tok=4, n_group=1, topk_group=1)
QUANT_KL_BOUNDS = {"fp8": (0.07, 0.25), "w4a8": (0.15, 0.4)}


@pytest.mark.parametrize("mode", ["fp8", "w4a8"])
def test_quantized_kl_routing_stable(tmp_path, rng, device, mode):
    cfg = DeepseekConfig.from_dict(ROUTE_ALL)
    write_checkpoint(tmp_path, ROUTE_ALL, random_weights(cfg, rng))
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 8)))
    with jax.default_device(device):
        ref = f32(jit_forward(load_checkpoint(tmp_path, dtype=jnp.float32, progress=False))(ids))
        model = load_checkpoint(tmp_path, quantize=mode, dtype=jnp.bfloat16, progress=False)
        out = f32(jit_forward(model)(ids))
    assert model.quant.experts == mode and model.quant.linear == "fp8"
    k = kl(ref, out)
    print(f"{mode}: KL vs fp32 model: max {k.max():.3g} mean {k.mean():.3g}")
    mean_bound, max_bound = QUANT_KL_BOUNDS[mode]
    assert k.mean() <= mean_bound and k.max() <= max_bound


EXACT = dict(TINY128, num_hidden_layers=2)
EXACT_TOL = 1e-4        # measured 4e-7 .. 1.5e-6 (max |ours - ref| / max |ref|) when no code flips


def _draw_prompt(rng, cfg, reference, router, tries=100):
    """A prompt on which the reference's router margins are >= 1e-4 and no activation lies within 2e-6
    (relative) of an e4m3 rounding boundary, so fp32-vs-fp64 rounding cannot flip a discrete choice.

    ``reference(ids, fq, record) -> logits``; ``router[layer] = (weight, bias)``.
    """
    for _ in range(tries):
        ids = rng.integers(0, cfg.vocab_size, (2, 6))
        fq, record = FakeQuant(), {}
        logits = reference(ids, fq, record)
        margin = min(_np_router_margins(x, *router[layer], cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok).min()
                     for layer, x in record["router_inputs"].items())
        if fq.margin >= 2e-6 and margin >= 1e-4:
            return ids, logits
    raise AssertionError("no prompt without near-ties found")


@pytest.mark.parametrize("mode", ["fp8", "w4a8", "w4a8-static"])
def test_exact_weights_leave_only_activation_quantization(tmp_path, rng, device, mode):
    """Weights built as (int4 or e4m3 codes) x power-of-two scales survive quantize-on-load bit-exactly, so
    the quantized fp32-activation model must equal the float64 reference run on the same weights with its
    activations fake-quantized per token and 128-group (or per tensor with the static input scale).

    CPU handlers only: Hopper's fp8 tensor cores accumulate each 128-K group with fewer bits than
    float32 (about 1e-4 relative), and re-quantizing activations to fp8 after every layer turns such
    differences into whole-code flips, so bit-level agreement with a float64 reference is not a property
    of the GPU path (seen on the H200: 5% relative). The GPU path is held to the op tests' tolerances
    and to the golden KL bounds instead."""
    if device.platform != "cpu":
        pytest.skip("bit-level agreement is a property of the CPU handlers (see docstring)")
    cfg = DeepseekConfig.from_dict(EXACT)
    w = random_weights(cfg, rng, representable=True)
    src = str(tmp_path / "fp32")
    write_checkpoint(src, EXACT, w)
    with jax.default_device(device):
        model = load_checkpoint(src, quantize="fp8" if mode == "fp8" else "w4a8", dtype=jnp.float32, progress=False)

    # the codes and scales reproduce the checkpoint weights exactly
    attn = model.model.layers[1].self_attn.q_b_proj
    np.testing.assert_array_equal(np_dequant_blocks(attn.weight[...], attn.weight_scale_inv[...]),
                                  w["model.layers.1.self_attn.q_b_proj.weight"])
    ex = model.model.layers[1].mlp.experts
    i = cfg.moe_intermediate_size
    if mode == "fp8":
        nb = -(-i // 128)
        deq = np_dequant_blocks(ex.gate_up_proj[...][:, :i], np.asarray(ex.gate_up_proj_scale_inv[...])[:, :nb])
    else:
        deq = np_dequant_w4(ex.gate_up_proj[...], np.asarray(ex.gate_up_proj_scale_inv[...]))[:, :i]
    np.testing.assert_array_equal(deq[3], w["model.layers.1.mlp.experts.3.gate_proj.weight"])

    def reference(ids, fq, record, static=None):
        def expert_fq(layer, which, x):
            return fq.groups(x) if static is None else fq.tensor(x, static[layer, which])
        return np_reference_forward(src, ids, fq.groups, expert_fq, record)

    router = {l: (w[f"model.layers.{l}.mlp.gate.weight"].astype(np.float64),
                  w[f"model.layers.{l}.mlp.gate.e_score_correction_bias"].astype(np.float64))
              for l in range(cfg.num_hidden_layers) if cfg.is_moe_layer(l)}

    static = None
    if mode == "w4a8-static":
        # calibrate per-expert input scales (amax / 448, with some slack) on one prompt, store them as a
        # W4AFP8 checkpoint (second shard), and reload with act_scale="static"
        record = {}
        np_reference_forward(src, rng.integers(0, cfg.vocab_size, (4, 6)), None, None, record)
        extra, static = {}, {}
        for layer in range(cfg.num_hidden_layers):
            if not cfg.is_moe_layer(layer):
                continue
            for which, names in (("gate_up", ("w1", "w3")), ("down", ("w2",))):
                amax = [record.get((layer, which, j), 0.0) for j in range(cfg.n_routed_experts)]
                fallback = max(amax)
                scales = [np.float32((a or fallback) / 448 * rng.uniform(1.0, 1.25)) for a in amax for _ in names]
                for j in range(cfg.n_routed_experts):
                    for n_idx, nm in enumerate(names):
                        extra[f"model.layers.{layer}.mlp.experts.{j}.{nm}.input_scale"] = \
                            np.asarray([scales[j * len(names) + n_idx]], np.float32)
                static[layer, which] = max(scales)
        w4afp8 = str(tmp_path / "w4afp8")
        save_checkpoint(model, w4afp8)
        add_shard(w4afp8, extra)
        with jax.default_device(device):
            model = load_checkpoint(w4afp8, act_scale="static", dtype=jnp.float32, progress=False)
        assert model.quant == QuantConfig.w4a8(act_scale="static", input_scales=True)

    fwd = jit_forward(model)
    errors = []
    for attempt in range(3):     # a code flip despite the prompt filter (rare) gets two more prompts
        ids, ref = _draw_prompt(rng, cfg, lambda ids, fq, record: reference(ids, fq, record, static), router)
        with jax.default_device(device):
            out = f32(fwd(jnp.asarray(ids)))
        errors.append(float(np.abs(out - ref).max() / np.abs(ref).max()))
        if errors[-1] <= EXACT_TOL:
            break
    plain = np_reference_forward(src, ids)                           # no activation quantization
    err_plain = float(np.abs(out - plain).max() / np.abs(plain).max())
    print(f"{mode}: max rel logit error vs fake-quant reference {errors}; vs unquantized reference {err_plain:.3g}")
    assert errors[-1] <= EXACT_TOL, errors
    assert err_plain > 100 * EXACT_TOL          # activation quantization is really there and really matched
