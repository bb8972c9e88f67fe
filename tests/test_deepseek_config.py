"""DeepseekConfig / QuantConfig: transformers 5.17's config resolution (tests/golden/SEMANTICS.md section 1)."""

import json
import math
import os
import warnings

import numpy as np
import pytest

from jax_w4a8.models.deepseek.config import DeepseekConfig, QuantConfig, RopeParameters

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
FIXTURES = ["yarn_qlora", "plain_noqlora", "yarn_fused", "yarn_nomscale_nointerleave"]

# DeepSeek-V3's hub config.json (the keys that matter + a few ignored hub keys).
HUB_V3 = {
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True, "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6, "rope_theta": 10000, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
    "moe_layer_freq": 1, "ep_size": 1, "num_nextn_predict_layers": 1,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
}


def _fixture_config(name):
    with open(os.path.join(GOLDEN, name, "config.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_configs_resolve_like_the_manifest(name):
    manifest = json.load(open(os.path.join(GOLDEN, "manifest.json")))
    fx = next(f for f in manifest["fixtures"] if f["name"] == name)
    cfg = DeepseekConfig.from_pretrained(os.path.join(GOLDEN, name))
    for k, v in fx["hf_config"].items():
        assert getattr(cfg, k) == v, k
    rope = fx["rope"]
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    assert cfg.rope.rope_type == rope_type
    assert cfg.rope.rope_theta == rope["rope_theta"]
    if rope_type == "yarn":
        assert cfg.rope.factor == rope["factor"]
        assert cfg.rope.original_max_position_embeddings == rope["original_max_position_embeddings"]
        assert cfg.rope.mscale == rope.get("mscale") and cfg.rope.mscale_all_dim == rope.get("mscale_all_dim")
    exp = np.load(os.path.join(GOLDEN, name, "expected.npz"))
    np.testing.assert_allclose(cfg.softmax_scale, float(exp["softmax_scale"]), rtol=1e-6)
    np.testing.assert_allclose(cfg.rope.attention_scaling, float(exp["rope_attention_scaling"]), rtol=1e-6)


def test_hub_v3_config():
    cfg = DeepseekConfig.from_dict(HUB_V3)
    assert cfg.rope == RopeParameters(rope_type="yarn", rope_theta=10000.0, factor=40.0,
                                      original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                                      mscale=1.0, mscale_all_dim=1.0)
    mscale = 0.1 * math.log(40) + 1
    assert math.isclose(cfg.softmax_scale, 0.1352337788608801, rel_tol=1e-12)
    assert math.isclose(cfg.softmax_scale, 192 ** -0.5 * mscale ** 2, rel_tol=1e-12)
    assert cfg.rope.attention_scaling == 1.0
    assert cfg.qk_head_dim == 192
    assert [cfg.is_moe_layer(i) for i in (0, 2, 3, 60)] == [False, False, True, True]


def test_defaults_are_671b_without_yarn():
    cfg = DeepseekConfig.from_dict({})
    assert cfg.rope == RopeParameters("default", 10000.0)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.n_routed_experts, cfg.q_lora_rank) == (7168, 61, 256, 1536)
    assert cfg.max_position_embeddings == 4096 and cfg.rope_interleave and cfg.norm_topk_prob
    assert cfg.softmax_scale == 192 ** -0.5


def test_legacy_rope_scaling_wins_and_theta_rules():
    base = {"max_position_embeddings": 64, "rope_theta": 500.0}
    both = DeepseekConfig.from_dict({**base, "rope_scaling": {"type": "yarn", "factor": 4.0},
                                     "rope_parameters": {"rope_type": "default", "rope_theta": 7.0}})
    assert both.rope.rope_type == "yarn" and both.rope.rope_theta == 500.0
    inside = DeepseekConfig.from_dict({**base, "rope_scaling": {"type": "yarn", "factor": 4.0, "rope_theta": 9.0}})
    assert inside.rope.rope_theta == 9.0                      # a rope_theta inside the dict wins
    # original_max_position_embeddings: the top-level key wins, else the dict's, else max_position_embeddings
    assert inside.rope.original_max_position_embeddings == 64
    top = DeepseekConfig.from_dict({**base, "original_max_position_embeddings": 8,
                                    "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": 16}})
    assert top.rope.original_max_position_embeddings == 8
    nofactor = DeepseekConfig.from_dict({**base, "rope_scaling": {"rope_type": "yarn",
                                                                  "original_max_position_embeddings": 16}})
    assert nofactor.rope.factor == 4.0
    v5 = DeepseekConfig.from_dict({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 3.0,
                                                       "original_max_position_embeddings": 8}})
    assert (v5.rope.rope_type, v5.rope.factor, v5.rope.rope_theta) == ("yarn", 2.0, 3.0)


@pytest.mark.parametrize("keys,cos_factor,softmax_mult", [
    ({"mscale": 1.0, "mscale_all_dim": 1.0}, 1.0, (0.1 * math.log(40) + 1) ** 2),
    ({}, 0.1 * math.log(40) + 1, 1.0),
    ({"mscale_all_dim": 1.0}, 0.1 * math.log(40) + 1, (0.1 * math.log(40) + 1) ** 2),
    ({"mscale": 0.707, "mscale_all_dim": 0.5}, (0.0707 * math.log(40) + 1) / (0.05 * math.log(40) + 1),
     (0.05 * math.log(40) + 1) ** 2),
])
def test_mscale_table(keys, cos_factor, softmax_mult):
    """SEMANTICS.md 4.2: the cos/sin factor and the softmax mscale**2 are independent."""
    cfg = DeepseekConfig.from_dict({"rope_scaling": {"type": "yarn", "factor": 40.0,
                                                     "original_max_position_embeddings": 4096, **keys}})
    assert math.isclose(cfg.rope.attention_scaling, cos_factor, rel_tol=1e-12)
    assert math.isclose(cfg.softmax_scale, 192 ** -0.5 * softmax_mult, rel_tol=1e-12)
    explicit = DeepseekConfig.from_dict({"rope_scaling": {"type": "yarn", "factor": 40.0, "attention_factor": 0.5,
                                                          **keys}})
    assert explicit.rope.attention_scaling == 0.5
    default = DeepseekConfig.from_dict({"rope_scaling": None, **({"x": 1} if keys else {})})
    assert default.rope.attention_scaling == 1.0 and default.softmax_scale == 192 ** -0.5


def test_head_dim_is_never_the_rope_dim():
    d = _fixture_config("yarn_fused")
    assert d["head_dim"] == d["qk_rope_head_dim"] == 8
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DeepseekConfig.from_dict(d)                                   # head_dim == qk_rope_head_dim: silent
    with pytest.warns(UserWarning, match="head_dim=16"):
        cfg = DeepseekConfig.from_dict({**d, "head_dim": 16})
    assert cfg.qk_rope_head_dim == 8 and cfg.qk_head_dim == 24


def test_aliases_nulls_and_ignored_keys():
    cfg = DeepseekConfig.from_dict({"num_local_experts": 16, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 4,
                                    "num_mtp_layers": 2, "q_lora_rank": None, "num_key_value_heads": None,
                                    "num_attention_heads": 4, "scoring_func": "sigmoid", "moe_layer_freq": 3})
    assert cfg.n_routed_experts == 16 and cfg.num_nextn_predict_layers == 2
    assert cfg.q_lora_rank is None and cfg.num_key_value_heads == 4


@pytest.mark.parametrize("bad,match", [
    ({"num_key_value_heads": 64}, "num_key_value_heads"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"n_routed_experts": 10, "n_group": 4}, "multiple of n_group"),
    ({"topk_group": 9}, "topk_group"),
    ({"num_experts_per_tok": 200}, "num_experts_per_tok"),
    ({"rope_scaling": {"type": "longrope", "factor": 2.0}}, "rope_type"),
])
def test_invalid_configs_raise(bad, match):
    with pytest.raises(ValueError, match=match):
        DeepseekConfig.from_dict(bad)


@pytest.mark.parametrize("name", FIXTURES)
def test_to_dict_round_trip_and_hashable(name):
    cfg = DeepseekConfig.from_pretrained(os.path.join(GOLDEN, name))
    again = DeepseekConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg and hash(again) == hash(cfg)
    with pytest.raises(AttributeError):
        cfg.hidden_size = 1


def test_quant_config():
    assert QuantConfig().to_hf() is None
    assert QuantConfig.fp8().to_hf()["quant_method"] == "fp8"
    hf = QuantConfig.w4a8(ue8m0=True).to_hf()
    assert hf["quant_method"] == "w4afp8" and hf["scale_fmt"] == "ue8m0" and hf["weight_block_size"] == [128, 128]
    with pytest.raises(ValueError, match="input_scale"):
        QuantConfig.w4a8(act_scale="static")
    QuantConfig.w4a8(act_scale="static", input_scales=True)
    with pytest.raises(ValueError, match="experts"):
        QuantConfig(experts="int4")
    with pytest.raises(ValueError, match="input_scales"):
        QuantConfig(experts="fp8", input_scales=True)


@pytest.mark.parametrize("field", ["n_group", "topk_group", "num_experts_per_tok", "first_k_dense_replace",
                                   "num_nextn_predict_layers", "v_head_dim", "n_shared_experts", "rms_norm_eps",
                                   "routed_scaling_factor"])
def test_null_fields_are_named(field):
    """A ``null`` in config.json for a field that has no 'absent' meaning is a ValueError naming the field (it was a
    TypeError naming nothing, here or while the model was built or loaded). ``q_lora_rank: null`` stays valid."""
    with pytest.raises(ValueError, match=field):
        DeepseekConfig.from_dict({**HUB_V3, field: None})
    assert DeepseekConfig.from_dict({**HUB_V3, "q_lora_rank": None}).q_lora_rank is None
