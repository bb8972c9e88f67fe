"""HF checkpoints <-> model: the formats of SPEC section 6, quantize-on-load, save round trips, and errors."""

import json
import os
import warnings

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from jax_w4a8 import quant
from jax_w4a8.models.deepseek import (DeepseekConfig, QuantConfig, checkpoint, jit_forward, load_checkpoint,
                                      save_checkpoint)
from jax_w4a8.models.deepseek.checkpoint import CheckpointError
from test_deepseek_layers import GOLDEN, np_dequant_blocks, np_dequant_w4, np_pack_int4, np_unpack_int4
from test_deepseek_model import TINY128, _header_keys, _linear_keys, random_weights, write_checkpoint

CK = dict(TINY128, num_hidden_layers=2, vocab_size=256)


def flat_state(model):
    return {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}


def assert_same_state(a, b):
    sa, sb = flat_state(a), flat_state(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and sa[k].shape == sb[k].shape, k
        np.testing.assert_array_equal(sa[k].view(np.uint8), sb[k].view(np.uint8), err_msg=k)


def logits(model, ids):
    return np.asarray(jit_forward(model)(jnp.asarray(ids)).astype(jnp.float32))


@pytest.fixture
def fp32_ckpt(tmp_path, rng):
    cfg = DeepseekConfig.from_dict(CK)
    w = random_weights(cfg, rng)
    path = str(tmp_path / "fp32")
    write_checkpoint(path, CK, w)
    return path, cfg, w


def fp8_weights(cfg, w, ue8m0=False):
    """The DeepSeek-V3 FP8 layout: every linear e4m3 + fp32 weight_scale_inv; the rest as is."""
    out = dict(w)
    for key, _, _ in _linear_keys(cfg):
        q, s = quant.quantize_fp8_blocks(w[key], 128, ue8m0)
        out[key], out[key + "_scale_inv"] = np.asarray(q), np.asarray(s)
    return out


def np_quantize_w4(w):
    """TensorRT-LLM's W4 group-128 recipe in numpy: s = absmax / 7, q = clip(rint(w / s), -8, 7)."""
    g = w.astype(np.float32).reshape(*w.shape[:-1], -1, 128)
    s = np.abs(g).max(-1) / np.float32(7)
    q = np.clip(np.rint(g / np.where(s > 0, s, 1)[..., None]), -8, 7).astype(np.int64).reshape(w.shape)
    return np_pack_int4(q), s.astype(np.float32)


def w4afp8_weights(cfg, w, rng):
    """The DeepSeek-R1-W4AFP8 layout: experts packed int4 + scales + per-expert w1/w2/w3 input_scale."""
    out = fp8_weights(cfg, w)
    for key, _, expert in _linear_keys(cfg):
        if expert:
            out[key], out[key + "_scale_inv"] = np_quantize_w4(w[key])
    for i in range(cfg.num_hidden_layers):
        if cfg.is_moe_layer(i):
            for j in range(cfg.n_routed_experts):
                for nm in ("w1", "w2", "w3"):
                    out[f"model.layers.{i}.mlp.experts.{j}.{nm}.input_scale"] = \
                        np.asarray([rng.uniform(0.005, 0.02)], np.float32)
    return out


# ----------------------------------------------------------------------------------------------
# formats
# ----------------------------------------------------------------------------------------------
def test_fp32_checkpoint_in_bf16_and_fp32(fp32_ckpt):
    path, cfg, w = fp32_ckpt
    m16 = load_checkpoint(path, progress=False)
    assert m16.quant == QuantConfig() and m16.dtype == jnp.bfloat16
    qkv = m16.model.layers[1].self_attn.qkv_a_proj.weight[...]      # q_a_proj rows, then kv_a_proj_with_mqa
    assert qkv.dtype == jnp.bfloat16
    a = "model.layers.1.self_attn."
    np.testing.assert_array_equal(np.asarray(qkv), np.concatenate(
        [w[a + "q_a_proj.weight"], w[a + "kv_a_proj_with_mqa.weight"]]).astype(ml_dtypes.bfloat16))
    gu = m16.model.layers[0].mlp.gate_up_proj.weight[...]             # gate_proj rows, then up_proj
    np.testing.assert_array_equal(np.asarray(gu), np.concatenate(
        [w["model.layers.0.mlp.gate_proj.weight"], w["model.layers.0.mlp.up_proj.weight"]]).astype(ml_dtypes.bfloat16))
    bias = m16.model.layers[1].mlp.gate.e_score_correction_bias[...]
    assert bias.dtype == jnp.float32                                   # the router bias stays fp32
    np.testing.assert_array_equal(np.asarray(bias), w["model.layers.1.mlp.gate.e_score_correction_bias"])
    gu = np.asarray(m16.model.layers[1].mlp.experts.gate_up_proj[...].astype(jnp.float32))
    np.testing.assert_array_equal(gu[5, cfg.moe_intermediate_size:],
                                  w["model.layers.1.mlp.experts.5.up_proj.weight"].astype(ml_dtypes.bfloat16))
    m32 = load_checkpoint(path, dtype=jnp.float32, progress=False)
    assert m32.model.embed_tokens.weight.dtype == jnp.float32


def test_fp8_checkpoint(tmp_path, fp32_ckpt):
    path, cfg, w = fp32_ckpt
    fp8 = str(tmp_path / "fp8")
    ckpt = fp8_weights(cfg, w)
    write_checkpoint(fp8, CK, ckpt, n_shards=3,   # round-robin shards: weights and scales in different files
                     quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "weight_block_size": [128, 128]})
    model = load_checkpoint(fp8, progress=False)
    assert model.quant == QuantConfig.fp8()
    other = str(tmp_path / "fp8_64")  # another block size: refused by name (it once failed on a scale's shape)
    write_checkpoint(other, CK, ckpt, quantization_config={"quant_method": "fp8", "weight_block_size": [64, 64]})
    with pytest.raises(CheckpointError, match=r"weight_block_size is \[64, 64\]: only FP8 blocks of \[128, 128\]"):
        load_checkpoint(other, progress=False)
    lin = model.model.layers[0].self_attn.qkv_a_proj    # q_a (128 rows), then kv_a (N = 192: an edge block row)
    a = "model.layers.0.self_attn."
    for part in ("q_a_proj", "kv_a_proj_with_mqa"):     # each part bit-exact, weights and scales, in row order
        assert ckpt[a + part + ".weight"].shape[0] == dict(lin.parts)[part]
    np.testing.assert_array_equal(np.asarray(lin.weight[...]).view(np.uint8), np.concatenate(
        [ckpt[a + "q_a_proj.weight"], ckpt[a + "kv_a_proj_with_mqa.weight"]]).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(lin.weight_scale_inv[...]), np.concatenate(
        [ckpt[a + "q_a_proj.weight_scale_inv"], ckpt[a + "kv_a_proj_with_mqa.weight_scale_inv"]]))
    ex = model.model.layers[1].mlp.experts
    i = cfg.moe_intermediate_size
    np.testing.assert_array_equal(
        np_dequant_blocks(ex.gate_up_proj[...][6, i:], np.asarray(ex.gate_up_proj_scale_inv[...])[6, 1:]),
        np_dequant_blocks(ckpt["model.layers.1.mlp.experts.6.up_proj.weight"],
                          ckpt["model.layers.1.mlp.experts.6.up_proj.weight_scale_inv"]))
    # quantizing the fp32 checkpoint on load gives the same model and logits
    same = load_checkpoint(path, quantize="fp8", progress=False)
    assert_same_state(model, same)
    ids = np.arange(12).reshape(2, 6)
    np.testing.assert_array_equal(logits(model, ids), logits(same, ids))
    # an FP8 checkpoint re-quantized to W4A8 experts (linears kept)
    w4 = load_checkpoint(fp8, quantize="w4a8", progress=False)
    assert w4.quant == QuantConfig.w4a8()
    assert np.isfinite(logits(w4, ids)).all()


def test_fp8_ue8m0_checkpoint(tmp_path, fp32_ckpt):
    path, cfg, w = fp32_ckpt
    qc = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}
    good = str(tmp_path / "ue8m0")
    write_checkpoint(good, CK, fp8_weights(cfg, w, ue8m0=True), quantization_config=qc)
    model = load_checkpoint(good, progress=False)
    assert model.quant == QuantConfig.fp8(ue8m0=True)
    s = np.asarray(model.model.layers[0].mlp.down_proj.weight_scale_inv[...])
    np.testing.assert_array_equal(s, np.exp2(np.round(np.log2(s))))
    ids = np.arange(12).reshape(2, 6) * 7
    out = logits(model, ids)
    assert np.isfinite(out).all()
    # the activations take power-of-two scales too: forcing fp32 scales changes the logits
    plain = load_checkpoint(good, ue8m0=False, progress=False)
    assert not np.array_equal(out, logits(plain, ids))
    bad = str(tmp_path / "bad")
    write_checkpoint(bad, CK, fp8_weights(cfg, w, ue8m0=False), quantization_config=qc)
    with pytest.raises(CheckpointError, match="power of two"):
        load_checkpoint(bad, progress=False)


def test_fp8_scales_stored_as_e8m0_codes(tmp_path, fp32_ckpt):
    """Block scales stored as ``F8_E8M0`` (one byte, 2**(code - 127), as DeepSeek-V4's checkpoints store them) load
    as the float32 powers of two they encode: the model equals the one loaded from float32 scales, and is UE8M0
    without a ``scale_fmt``. Code 255 (NaN) is refused by name."""
    path, cfg, w = fp32_ckpt
    f32 = fp8_weights(cfg, w, ue8m0=True)
    codes = {k: (v.astype(ml_dtypes.float8_e8m0fnu) if k.endswith("_scale_inv") else v) for k, v in f32.items()}
    key = next(k for k in codes if k.endswith("_scale_inv"))
    assert codes[key].dtype == ml_dtypes.float8_e8m0fnu
    np.testing.assert_array_equal(codes[key].astype(np.float32), f32[key])  # powers of two: exact in one byte
    ref_dir, e8_dir = str(tmp_path / "f32"), str(tmp_path / "e8m0")
    qc = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    write_checkpoint(ref_dir, CK, f32, quantization_config=dict(qc, scale_fmt="ue8m0"))
    write_checkpoint(e8_dir, CK, codes, quantization_config=qc)
    ref, got = load_checkpoint(ref_dir, progress=False), load_checkpoint(e8_dir, progress=False)
    assert got.quant == ref.quant == QuantConfig.fp8(ue8m0=True)
    for (p1, a), (p2, b) in zip(nnx.to_flat_state(nnx.state(ref)), nnx.to_flat_state(nnx.state(got))):
        assert p1 == p2
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(p1))
    ids = np.arange(12).reshape(2, 6) * 7
    np.testing.assert_array_equal(logits(got, ids), logits(ref, ids))
    bad = dict(codes)
    bad[key] = bad[key].copy()
    bad[key].view(np.uint8)[0, 0] = 255
    write_checkpoint(str(tmp_path / "nan"), CK, bad, quantization_config=qc)
    with pytest.raises(CheckpointError, match=f"{key[:-len('.weight_scale_inv')]}.*nan"):
        load_checkpoint(str(tmp_path / "nan"), progress=False)


def test_w4afp8_checkpoint(tmp_path, fp32_ckpt, rng):
    path, cfg, w = fp32_ckpt
    ckpt = w4afp8_weights(cfg, w, rng)
    w4 = str(tmp_path / "w4afp8")
    write_checkpoint(w4, CK, ckpt, quantization_config={"quant_method": "w4afp8", "fmt": "e4m3",
                                                        "weight_block_size": [128, 128]})
    model = load_checkpoint(w4, progress=False)
    assert model.quant == QuantConfig.w4a8(input_scales=True)
    ex = model.model.layers[1].mlp.experts
    i = cfg.moe_intermediate_size
    np.testing.assert_array_equal(np.asarray(ex.gate_up_proj[...])[2, :i],
                                  ckpt["model.layers.1.mlp.experts.2.gate_proj.weight"])
    np.testing.assert_array_equal(np.asarray(ex.down_proj_scale_inv[...])[7],
                                  ckpt["model.layers.1.mlp.experts.7.down_proj.weight_scale_inv"])
    np.testing.assert_array_equal(np.asarray(ex.gate_up_proj_input_scale[...])[3],
                                  [ckpt[f"model.layers.1.mlp.experts.3.{n}.input_scale"][0] for n in ("w1", "w3")])
    deq = np_dequant_w4(np.asarray(ex.down_proj[...])[1], np.asarray(ex.down_proj_scale_inv[...])[1])
    assert np.abs(deq - w["model.layers.1.mlp.experts.1.down_proj.weight"]).max() <= \
        np.abs(w["model.layers.1.mlp.experts.1.down_proj.weight"]).max() / 7 / 2 * 1.0001
    # quantize="w4a8" on the float checkpoint reproduces the TensorRT-LLM recipe. Not bit for bit: XLA
    # evaluates absmax / 7 as absmax * (1/7) (1 ulp off for about half the scales), which can move a
    # w / s sitting within an ulp of a .5 tie to the neighbouring code.
    onload = load_checkpoint(path, quantize="w4a8", progress=False).model.layers[1].mlp.experts
    for name in ("gate_up_proj", "down_proj"):
        np.testing.assert_allclose(np.asarray(getattr(onload, name + "_scale_inv")[...]),
                                   np.asarray(getattr(ex, name + "_scale_inv")[...]), rtol=2.5e-7, atol=0)
        a = np_unpack_int4(np.asarray(getattr(onload, name)[...]))
        b = np_unpack_int4(np.asarray(getattr(ex, name)[...]))
        assert np.abs(a - b).max() <= 1 and np.mean(a != b) < 1e-4
    # static activation scales: the max input_scale of the layer
    static = load_checkpoint(w4, act_scale="static", progress=False)
    assert static.quant.act_scale == "static"
    ids = np.arange(12).reshape(2, 6)
    a, b = logits(model, ids), logits(static, ids)
    assert np.isfinite(a).all() and np.isfinite(b).all() and not np.array_equal(a, b)
    with pytest.raises(ValueError, match="re-quantize int4"):
        load_checkpoint(w4, quantize="fp8", progress=False)
    partial = str(tmp_path / "partial")
    write_checkpoint(partial, CK, {k: v for k, v in ckpt.items() if k != "model.layers.1.mlp.experts.5.w2.input_scale"})
    with pytest.raises(CheckpointError, match="missing tensor 'model.layers.1.mlp.experts.5.w2.input_scale'"):
        load_checkpoint(partial, progress=False)
    with pytest.raises(ValueError, match="static"):
        load_checkpoint(path, quantize="w4a8", act_scale="static", progress=False)


# ----------------------------------------------------------------------------------------------
# save round trips
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("quantize,layout,shard_bytes", [
    (None, "per_expert", 1 << 40), (None, "fused", 300_000), ("fp8", "per_expert", 1 << 40),
    ("w4a8", "per_expert", 200_000)])
def test_save_load_round_trip(tmp_path, fp32_ckpt, quantize, layout, shard_bytes):
    path, cfg, _ = fp32_ckpt
    model = load_checkpoint(path, quantize=quantize, progress=False)
    out = str(tmp_path / "saved")
    save_checkpoint(model, out, expert_layout=layout, max_shard_bytes=shard_bytes)
    files = sorted(os.listdir(out))
    if shard_bytes < 1 << 30:
        index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
        shards = sorted(set(index["weight_map"].values()))
        assert len(shards) > 1 and all(f in files for f in shards) and "model.safetensors" not in files
        for f in shards:
            assert all(index["weight_map"][k] == f for k in _header_keys(os.path.join(out, f)))
    else:
        assert "model.safetensors" in files and "model.safetensors.index.json" not in files
    keys = set()
    for f in files:
        if f.endswith(".safetensors"):
            keys |= set(_header_keys(os.path.join(out, f)))
    fused = any(k.endswith("experts.gate_up_proj") for k in keys)
    assert fused == (layout == "fused")
    assert ("model.layers.1.mlp.experts.7.down_proj.weight" in keys) == (layout == "per_expert")
    assert any(k.endswith("weight_scale_inv") for k in keys) == (quantize is not None)
    saved_cfg = json.load(open(os.path.join(out, "config.json")))
    assert DeepseekConfig.from_dict(saved_cfg) == cfg
    assert saved_cfg.get("quantization_config") == model.quant.to_hf()
    again = load_checkpoint(out, progress=False)
    assert again.quant == model.quant
    assert_same_state(model, again)
    ids = np.arange(16).reshape(2, 8) * 5
    np.testing.assert_array_equal(logits(model, ids), logits(again, ids))


@pytest.mark.parametrize("quantize", [None, "fp8"])
def test_fused_projections_keep_hf_tensors_with_biases(tmp_path, rng, quantize):
    """q_a + kv_a and gate + up live in one Linear each; with attention biases, a checkpoint goes in and comes
    back out under exactly its HF keys, every part's weight, scales and bias in its own rows."""
    cfg_dict = dict(CK, attention_bias=True)
    cfg = DeepseekConfig.from_dict(cfg_dict)
    w = random_weights(cfg, rng)
    for i in range(cfg.num_hidden_layers):
        for name, n in (("q_a_proj", cfg.q_lora_rank), ("kv_a_proj_with_mqa", cfg.kv_lora_rank + cfg.qk_rope_head_dim),
                        ("o_proj", cfg.hidden_size)):
            w[f"model.layers.{i}.self_attn.{name}.bias"] = rng.standard_normal(n).astype(np.float32)
    src = str(tmp_path / "src")
    write_checkpoint(src, cfg_dict, w)
    model = load_checkpoint(src, quantize=quantize, dtype=jnp.float32, progress=False)
    lin = model.model.layers[1].self_attn.qkv_a_proj
    a = "model.layers.1.self_attn."
    np.testing.assert_array_equal(np.asarray(lin.bias[...]),
                                  np.concatenate([w[a + "q_a_proj.bias"], w[a + "kv_a_proj_with_mqa.bias"]]))
    out = str(tmp_path / "saved")
    save_checkpoint(model, out)
    saved = set(_header_keys(os.path.join(out, "model.safetensors")))
    want = set(w) - {"lm_head.weight"} if cfg.tie_word_embeddings else set(w)
    if quantize == "fp8":   # every linear but the router and lm_head gains its block scales
        want |= {k.replace(".weight", ".weight_scale_inv") for k, _, _ in _linear_keys(cfg)}
    assert saved == want, (saved ^ want)
    again = load_checkpoint(out, dtype=jnp.float32, progress=False)
    assert_same_state(model, again)
    if quantize is None:    # float32 in, float32 model: the same bytes come back out
        from safetensors.numpy import load_file
        back = load_file(os.path.join(out, "model.safetensors"))
        for k in (a + "q_a_proj.weight", a + "kv_a_proj_with_mqa.bias", "model.layers.0.mlp.up_proj.weight",
                  "model.layers.1.mlp.shared_experts.gate_proj.weight"):
            np.testing.assert_array_equal(back[k], w[k])


def test_save_w4afp8_with_input_scales(tmp_path, fp32_ckpt, rng):
    path, cfg, w = fp32_ckpt
    src = str(tmp_path / "w4afp8")
    write_checkpoint(src, CK, w4afp8_weights(cfg, w, rng), quantization_config={"quant_method": "w4afp8"})
    model = load_checkpoint(src, act_scale="static", progress=False)
    out = str(tmp_path / "saved")
    save_checkpoint(model, out)
    keys = set(_header_keys(os.path.join(out, "model.safetensors")))
    assert "model.layers.1.mlp.experts.0.w3.input_scale" in keys
    again = load_checkpoint(out, act_scale="static", progress=False)
    assert_same_state(model, again)
    ids = np.arange(8).reshape(2, 4)
    np.testing.assert_array_equal(logits(model, ids), logits(again, ids))
    with pytest.raises(ValueError, match="fused"):
        save_checkpoint(model, str(tmp_path / "x"), expert_layout="fused")


@pytest.mark.parametrize("quantize", ["w4a8", "fp8"])
def test_fused_experts_convert_one_expert_at_a_time(tmp_path, fp32_ckpt, quantize, monkeypatch):
    """transformers-5's fused ``experts.gate_up_proj`` [E, 2I, D] quantizes on load expert by expert (a whole
    DeepSeek-V3 layer's float32 copy is 30 GB), to the same tensors as the per-expert layout."""
    from jax_w4a8.models.deepseek import checkpoint as ck

    path, cfg, _ = fp32_ckpt
    fused, per_expert = str(tmp_path / "fused"), str(tmp_path / "per_expert")
    model = load_checkpoint(path, progress=False)
    save_checkpoint(model, fused, expert_layout="fused")
    save_checkpoint(model, per_expert, expert_layout="per_expert")
    largest = []
    real = ck._convert
    monkeypatch.setattr(ck, "_convert", lambda src, *a: largest.append(src.w.size) or real(src, *a))
    got = load_checkpoint(fused, quantize=quantize, progress=False)
    d, i = cfg.hidden_size, cfg.moe_intermediate_size
    assert max(largest) <= max(d * i, d * d, cfg.vocab_size * d, d * cfg.intermediate_size), max(largest)
    monkeypatch.undo()
    assert_same_state(load_checkpoint(per_expert, quantize=quantize, progress=False), got)


@pytest.mark.parametrize("name", ["yarn_fused", "plain_noqlora"])
def test_golden_layouts_round_trip(tmp_path, name):
    """transformers-5 fused experts and hub per-expert experts load to the same tensors after a save."""
    model = load_checkpoint(os.path.join(GOLDEN, name), dtype=jnp.float32, progress=False)
    for layout in ("per_expert", "fused"):
        out = str(tmp_path / layout)
        save_checkpoint(model, out, expert_layout=layout)
        assert_same_state(model, load_checkpoint(out, dtype=jnp.float32, progress=False))


# ----------------------------------------------------------------------------------------------
# errors and skipped tensors
# ----------------------------------------------------------------------------------------------
def _rewrite(path, w, **kw):
    for f in os.listdir(path):
        if f.endswith(".safetensors") or f.endswith(".json"):
            os.remove(os.path.join(path, f))
    write_checkpoint(path, CK, w, **kw)


def test_missing_unexpected_misshaped_tensors(fp32_ckpt):
    path, cfg, w = fp32_ckpt
    key = "model.layers.1.mlp.experts.4.down_proj.weight"
    _rewrite(path, {k: v for k, v in w.items() if k != key})
    with pytest.raises(CheckpointError, match=f"missing tensor '{key}'.*model.safetensors"):
        load_checkpoint(path, progress=False)
    _rewrite(path, {**w, "model.layers.0.self_attn.extra.weight": np.zeros(3, np.float32)})
    with pytest.raises(CheckpointError,
                       match="unexpected tensor 'model.layers.0.self_attn.extra.weight' in .*model.safetensors"):
        load_checkpoint(path, progress=False)
    _rewrite(path, {**w, "model.norm.weight": np.ones(7, np.float32)}, n_shards=2)
    with pytest.raises(CheckpointError,
                       match=r"tensor 'model.norm.weight' in .*model-0000[12]-of-00002.safetensors has shape \[7\]"):
        load_checkpoint(path, progress=False)
    _rewrite(path, {**w, key: w[key].astype(np.int32)})
    with pytest.raises(CheckpointError, match=f"tensor '{key}' in .*has dtype I32"):
        load_checkpoint(path, progress=False)
    fp8 = fp8_weights(cfg, w)
    fp8.pop("model.layers.0.mlp.up_proj.weight_scale_inv")
    _rewrite(path, fp8)
    with pytest.raises(CheckpointError, match="missing tensor 'model.layers.0.mlp.up_proj.weight_scale_inv'"):
        load_checkpoint(path, progress=False)
    # a missing FP8 weight whose scale is there is named as missing (its format comes from the scale; the
    # experts' from any expert weight present), not its scale as unexpected
    qc = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    for key in ("model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.experts.0.gate_proj.weight"):
        _rewrite(path, {k: v for k, v in fp8_weights(cfg, w).items() if k != key}, quantization_config=qc)
        with pytest.raises(CheckpointError, match=f"missing tensor '{key}'"):
            load_checkpoint(path, progress=False)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -1.0])
def test_non_finite_or_negative_weight_scales_are_refused(fp32_ckpt, rng, bad):
    """A checkpoint scale that is NaN, infinite or negative is a CheckpointError naming the tensor (it would make the
    layer's outputs NaN or flip their sign, silently): FP8 linears and W4AFP8 experts."""
    path, cfg, w = fp32_ckpt
    fp8 = fp8_weights(cfg, w)
    key = "model.layers.0.self_attn.o_proj.weight"
    fp8[key + "_scale_inv"] = fp8[key + "_scale_inv"].copy()
    fp8[key + "_scale_inv"][0, -1] = bad * np.abs(fp8[key + "_scale_inv"][0, -1])
    _rewrite(path, fp8, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]})
    with pytest.raises(CheckpointError, match=rf"tensor '{key}': weight_scale_inv holds .* at index \(0, \d+\)"):
        load_checkpoint(path, progress=False)
    w4 = w4afp8_weights(cfg, w, rng)
    key = "model.layers.1.mlp.experts.2.down_proj.weight"
    w4[key + "_scale_inv"] = w4[key + "_scale_inv"].copy()
    w4[key + "_scale_inv"].flat[5] = bad * np.abs(w4[key + "_scale_inv"].flat[5])
    _rewrite(path, w4, quantization_config={"quant_method": "w4afp8"})
    with pytest.raises(CheckpointError, match=r"weight_scale_inv holds .*scales must be finite and >= 0"):
        load_checkpoint(path, progress=False)


def test_mtp_layers_and_rotary_buffers_are_ignored(fp32_ckpt):
    path, cfg, w = fp32_ckpt
    ids = np.arange(10).reshape(2, 5)
    ref = logits(load_checkpoint(path, progress=False), ids)
    extra = {f"model.layers.{cfg.num_hidden_layers}.eh_proj.weight": np.ones((4, 4), np.float32),
             f"model.layers.{cfg.num_hidden_layers}.mlp.experts.0.gate_proj.weight": np.ones((2, 2), np.int8),
             "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32)}
    _rewrite(path, {**w, **extra}, n_shards=2)
    np.testing.assert_array_equal(logits(load_checkpoint(path, progress=False), ids), ref)


def test_bad_arguments_and_files(tmp_path, fp32_ckpt):
    path, cfg, w = fp32_ckpt
    with pytest.raises(ValueError, match="quantize"):
        load_checkpoint(path, quantize="int4", progress=False)
    with pytest.raises(FileNotFoundError):
        os.makedirs(tmp_path / "empty")
        with open(tmp_path / "empty" / "config.json", "w") as f:
            json.dump(CK, f)
        load_checkpoint(str(tmp_path / "empty"), progress=False)
    # a shard holding a tensor that the index does not list (a copy of one it places in the other shard is
    # ignored: test_the_index_picks_between_copies_of_a_tensor)
    _rewrite(path, w, n_shards=2)
    first = os.path.join(path, "model-00001-of-00002.safetensors")
    second = os.path.join(path, "model-00002-of-00002.safetensors")
    stray = _header_keys(first)[0]
    save_file({k: w[k] for k in _header_keys(first) if k != stray}, first)
    save_file({stray: w[stray], **{k: w[k] for k in _header_keys(second)}}, second)
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
    del index["weight_map"][stray]
    json.dump(index, open(os.path.join(path, "model.safetensors.index.json"), "w"))
    with pytest.raises(CheckpointError,
                       match=f"'{stray}' in .*model-00002-of-00002.safetensors.*not listed in the index"):
        load_checkpoint(path, progress=False)
    # an index entry whose file lacks the tensor
    _rewrite(path, w, n_shards=2)
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
    index["weight_map"][stray] = "model-00002-of-00002.safetensors"
    json.dump(index, open(os.path.join(path, "model.safetensors.index.json"), "w"))
    with pytest.raises(CheckpointError, match=f"'{stray}'.*model-00002-of-00002.safetensors"):
        load_checkpoint(path, progress=False)


def test_every_tensor_goes_through_place(fp32_ckpt, monkeypatch):
    path, cfg, w = fp32_ckpt
    seen = []
    real = checkpoint.place

    def spy(array, name, mesh=None):
        seen.append(name)
        assert isinstance(array, np.ndarray)
        return real(array, name, mesh)

    monkeypatch.setattr(checkpoint, "place", spy)
    model = load_checkpoint(path, quantize="w4a8", progress=False)
    assert sorted(seen) == sorted(flat_state(model))
    assert "model.layers.1.mlp.experts.gate_up_proj_scale_inv" in seen


def test_progress_bar(fp32_ckpt, capsys):
    path, _, _ = fp32_ckpt
    load_checkpoint(path, progress=True)
    assert "loading fp32" in capsys.readouterr().err


def test_tied_embeddings(tmp_path, rng):
    cfg_dict = dict(CK, tie_word_embeddings=True)
    cfg = DeepseekConfig.from_dict(cfg_dict)
    w = random_weights(cfg, rng)
    path = str(tmp_path / "tied")
    w["lm_head.weight"] = w["model.embed_tokens.weight"].copy()     # present and equal: the tied embedding
    write_checkpoint(path, cfg_dict, w)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = load_checkpoint(path, dtype=jnp.float32, progress=False)
    assert model.lm_head is None
    ids = np.arange(6).reshape(1, 6)
    out, hidden = jit_forward(model)(jnp.asarray(ids), return_hidden_states=True)
    h = np.asarray(model.model.norm(hidden[-1]), np.float64)
    np.testing.assert_allclose(np.asarray(out), h @ w["model.embed_tokens.weight"].T.astype(np.float64),
                               rtol=1e-5, atol=1e-4)
    out_dir = str(tmp_path / "saved")
    save_checkpoint(model, out_dir)
    assert "lm_head.weight" not in _header_keys(os.path.join(out_dir, "model.safetensors"))
    assert_same_state(model, load_checkpoint(out_dir, dtype=jnp.float32, progress=False))


def test_tied_config_with_a_different_lm_head_loads_it_untied(tmp_path, rng):
    """tie_word_embeddings with a checkpoint lm_head.weight unlike the embedding: transformers warns that it will
    not tie them and uses the checkpoint's head; so does the loader (it once dropped the head silently and tied:
    every logit wrong)."""
    cfg_dict = dict(CK, tie_word_embeddings=True)
    cfg = DeepseekConfig.from_dict(cfg_dict)
    w = random_weights(cfg, rng)
    path = str(tmp_path / "untied")
    write_checkpoint(path, cfg_dict, w)
    with pytest.warns(UserWarning, match="lm_head.weight differs from model.embed_tokens.weight"):
        model = load_checkpoint(path, dtype=jnp.float32, progress=False)
    assert model.lm_head is not None and not model.cfg.tie_word_embeddings
    np.testing.assert_array_equal(np.asarray(model.lm_head.weight[...]), w["lm_head.weight"])
    ids = np.arange(6).reshape(1, 6)
    out, hidden = jit_forward(model)(jnp.asarray(ids), return_hidden_states=True)
    h = np.asarray(model.model.norm(hidden[-1]), np.float64)
    np.testing.assert_allclose(np.asarray(out), h @ w["lm_head.weight"].T.astype(np.float64), rtol=1e-5, atol=1e-4)


def test_layers_past_the_mtp_layers_are_unexpected(tmp_path, rng):
    """The multi-token-prediction layers (num_hidden_layers .. + num_nextn_predict_layers - 1) are skipped, as
    transformers does; a layer past them is an unexpected tensor (a config with fewer layers than its checkpoint
    once loaded as a shallower model, silently)."""
    cfg = DeepseekConfig.from_dict(CK)
    w = random_weights(cfg, rng)
    last = cfg.num_hidden_layers - 1
    extra = {k.replace(f"model.layers.{last}.", f"model.layers.{last + 1}."): v
             for k, v in w.items() if k.startswith(f"model.layers.{last}.")}
    path = str(tmp_path / "mtp")
    write_checkpoint(path, dict(CK, num_nextn_predict_layers=1), {**w, **extra})
    load_checkpoint(path, dtype=jnp.float32, progress=False)  # layer L: the MTP layer, skipped
    path = str(tmp_path / "deeper")
    write_checkpoint(path, dict(CK, num_nextn_predict_layers=0), {**w, **extra})
    with pytest.raises(CheckpointError, match=f"unexpected tensor 'model.layers.{last + 1}\\."):
        load_checkpoint(path, dtype=jnp.float32, progress=False)



def test_no_shared_experts_ignores_the_empty_tensors_transformers_saves(tmp_path, rng):
    """``n_shared_experts: 0``: transformers' save_pretrained writes the layer's ``shared_experts`` projections as
    empty [0, D] / [D, 0] tensors; they hold nothing and load as nothing (they were unexpected tensors)."""
    cfg_d = dict(CK, n_shared_experts=0)
    cfg = DeepseekConfig.from_dict(cfg_d)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # the empty tensors' 1 / sqrt(0) init scale
        w = {k: v for k, v in random_weights(cfg, rng).items() if ".shared_experts." not in k}
    plain, hf = str(tmp_path / "plain"), str(tmp_path / "hf")
    write_checkpoint(plain, cfg_d, w)
    d = cfg.hidden_size
    empty = {f"model.layers.1.mlp.shared_experts.{p}.weight": np.zeros(s, np.float32)
             for p, s in (("gate_proj", (0, d)), ("up_proj", (0, d)), ("down_proj", (d, 0)))}
    write_checkpoint(hf, cfg_d, {**w, **empty})
    ids = np.arange(10).reshape(2, 5) * 3
    np.testing.assert_array_equal(logits(load_checkpoint(hf, progress=False), ids),
                                  logits(load_checkpoint(plain, progress=False), ids))
    # a non-empty one is still unexpected
    write_checkpoint(hf, cfg_d, {**w, "model.layers.1.mlp.shared_experts.up_proj.weight": np.zeros((1, d))})
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.1.mlp.shared_experts.up_proj"):
        load_checkpoint(hf, progress=False)


def test_a_file_that_is_not_safetensors_is_named(tmp_path, fp32_ckpt):
    """A Git LFS pointer (a repository cloned without ``git lfs pull``: the shard is ~130 bytes of text) or a
    truncated header is a CheckpointError naming the file (the pointer's first 8 bytes, read as the header length,
    once asked for exabytes: a bare MemoryError; a cut header a JSONDecodeError naming no file)."""
    path, cfg, w = fp32_ckpt
    _rewrite(path, w, n_shards=2)
    shard = os.path.join(path, "model-00002-of-00002.safetensors")
    with open(shard, "w") as f:
        f.write("version https://git-lfs.github.com/spec/v1\noid sha256:" + "0" * 64 + "\nsize 123456\n")
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors.*not a safetensors file"):
        load_checkpoint(path, progress=False)
    with open(shard, "wb") as f:
        f.write((40).to_bytes(8, "little") + b'{"model.norm.weight": {"dtype": "F32", "sh')
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors.*not a safetensors file"):
        load_checkpoint(path, progress=False)
    # a header entry without its offsets (a hand-edited or foreign writer's file): named, not a KeyError
    header = json.dumps({"model.norm.weight": {"dtype": "F32", "shape": [4]}}).encode()
    with open(shard, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header + bytes(16))
    with pytest.raises(CheckpointError, match="'model.norm.weight' in .*model-00002-of-00002.safetensors.*lacks"):
        load_checkpoint(path, progress=False)


def test_index_entries_of_skipped_layers_need_no_data(tmp_path, rng):
    """The index may list multi-token-prediction tensors that no shard holds: TensorRT-LLM's W4AFP8 producer
    (``quantize_mixed_precision_moe.py``, SPEC 6) maps layer ``num_hidden_layers`` into the last shard but saves
    only layers below it (or, with one part, into a shard it never writes), and users drop the MTP-only shards.
    Those tensors are never loaded, so the model loads (it once failed on the index); a needed tensor that the
    index misplaces is still an error."""
    cfg = DeepseekConfig.from_dict(CK)
    w = random_weights(cfg, rng)
    path = str(tmp_path / "ckpt")
    write_checkpoint(path, CK, w, n_shards=2)
    ids = np.arange(10).reshape(2, 5)
    ref = logits(load_checkpoint(path, progress=False), ids)
    index_file = os.path.join(path, "model.safetensors.index.json")
    index = json.load(open(index_file))
    mtp = f"model.layers.{cfg.num_hidden_layers}"
    index["weight_map"][mtp + ".mlp.experts.0.gate_proj.weight"] = "model-00002-of-00002.safetensors"
    index["weight_map"][mtp + ".eh_proj.weight"] = "model-00003-of-00003.safetensors"      # no such file
    json.dump(index, open(index_file, "w"))
    np.testing.assert_array_equal(logits(load_checkpoint(path, progress=False), ids), ref)
    index["weight_map"]["model.layers.0.self_attn.o_proj.weight"] = "model-00003-of-00003.safetensors"
    json.dump(index, open(index_file, "w"))
    with pytest.raises(FileNotFoundError, match="model-00003-of-00003.safetensors"):
        load_checkpoint(path, progress=False)


@pytest.mark.parametrize("quantize,act_scale", [(None, "static"), ("fp8", "static"), (None, "Static"),
                                                ("fp8", "per_tensor")])
def test_act_scale_is_never_dropped_silently(fp32_ckpt, quantize, act_scale):
    """``act_scale`` only exists for W4A8 experts: 'static' on a model without them, or a misspelt value, is a
    ValueError (both were dropped silently unless the experts were W4A8: the model ran dynamic scales)."""
    path, _, _ = fp32_ckpt
    with pytest.raises(ValueError, match="act_scale"):
        load_checkpoint(path, quantize=quantize, act_scale=act_scale, progress=False)


def test_the_index_picks_between_copies_of_a_tensor(tmp_path, fp32_ckpt, rng):
    """TensorRT-LLM's W4AFP8 producer writes the input_scale tensors into its first shard *and* copies their
    calibration file beside it, and its index names that file. The index says where each tensor is: the copy it
    names is loaded (as transformers and sglang load such a checkpoint; it once failed). A tensor that the index
    does not list at all is still an error."""
    path, cfg, w = fp32_ckpt
    ckpt = w4afp8_weights(cfg, w, rng)
    scales = {k: v for k, v in ckpt.items() if k.endswith(".input_scale")}
    out = str(tmp_path / "w4afp8")
    write_checkpoint(out, CK, {k: v for k, v in ckpt.items() if k not in scales}, n_shards=2)
    first = os.path.join(out, "model-00001-of-00002.safetensors")
    head = checkpoint.SafetensorsFile(first)
    stale = {k: (v * 3).astype(np.float32) for k, v in scales.items()}      # another value: must not be loaded
    save_file({**{k: head.read_tensor(k) for k in head.tensors}, **stale}, first)
    save_file(scales, os.path.join(out, "input_scales.safetensors"))
    index_file = os.path.join(out, "model.safetensors.index.json")
    index = json.load(open(index_file))
    index["weight_map"].update({k: "input_scales.safetensors" for k in scales})
    json.dump(index, open(index_file, "w"))
    model = load_checkpoint(out, act_scale="static", progress=False)
    ex = model.model.layers[1].mlp.experts
    want = [[scales[f"model.layers.1.mlp.experts.{j}.{n}.input_scale"][0] for n in ("w1", "w3")]
            for j in range(cfg.n_routed_experts)]
    np.testing.assert_array_equal(np.asarray(ex.gate_up_proj_input_scale[...]), want)
    np.testing.assert_array_equal(np.asarray(ex.down_proj_input_scale[...]),
                                  [scales[f"model.layers.1.mlp.experts.{j}.w2.input_scale"][0]
                                   for j in range(cfg.n_routed_experts)])
    key = "model.layers.1.mlp.experts.3.w2.input_scale"
    del index["weight_map"][key]                                            # in two files, listed for neither
    json.dump(index, open(index_file, "w"))
    with pytest.raises(CheckpointError, match=f"'{key}' in .*is not listed in the index"):
        load_checkpoint(out, progress=False)
