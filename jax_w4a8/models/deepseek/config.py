"""``DeepseekConfig``: the DeepSeek-V3/R1 architecture as transformers 5.17 resolves a ``config.json``.

One frozen (hashable) dataclass, so it can sit in an NNX graphdef and be a static ``jit`` argument.
Resolution follows ``tests/golden/SEMANTICS.md`` section 1:

* defaults are the 671B values, except that a bare config has **no YaRN** (transformers' default
  ``rope_parameters`` is ``{"rope_type": "default", "rope_theta": 10000.0}``);
* the legacy ``rope_scaling`` dict wins over ``rope_parameters``; ``rope_theta`` inside the dict wins over a
  top-level ``rope_theta``; ``type`` is accepted for ``rope_type``; for YaRN a top-level
  ``original_max_position_embeddings`` wins over the dict's, and the dict's defaults to
  ``max_position_embeddings``;
* the rotary dimension is ``qk_rope_head_dim``. A ``head_dim`` key (transformers writes
  ``head_dim = qk_rope_head_dim``) is never used for RoPE; a different value only warns, because
  transformers would then build a broken model;
* unknown hub keys (``scoring_func``, ``topk_method``, ``moe_layer_freq``, ...) are ignored, as in
  transformers: layer ``i`` is MoE iff ``i >= first_k_dense_replace`` and scoring is always sigmoid.

``QuantConfig`` says which linears are quantized, and how (the model's in-memory formats).
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import warnings
from typing import Any

__all__ = ["RopeParameters", "DeepseekConfig", "QuantConfig"]

_ALIASES = {"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers"}
_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "n_shared_experts", "n_routed_experts", "kv_lora_rank",
               "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "n_group", "topk_group", "num_experts_per_tok",
               "first_k_dense_replace", "max_position_embeddings", "num_nextn_predict_layers")
_FLOAT_FIELDS = ("routed_scaling_factor", "rms_norm_eps")


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """``0.1 * mscale * ln(scale) + 1`` for ``scale > 1``, else 1 (transformers / DeepSeek)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True)
class RopeParameters:
    """Resolved RoPE parameters (transformers' ``config.rope_parameters`` after standardisation).

    ``rope_type`` is ``"default"`` or ``"yarn"``; ``factor`` and ``original_max_position_embeddings``
    are always set for YaRN. Optional YaRN keys stay ``None`` when the config does not give them,
    because their *presence* changes the maths (SEMANTICS.md 4.2).
    """

    rope_type: str = "default"
    rope_theta: float = 10000.0
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    @property
    def attention_scaling(self) -> float:
        """The factor transformers multiplies into cos and sin (``attention_factor``)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(self.factor, self.mscale_all_dim)
        return yarn_get_mscale(self.factor)

    def to_dict(self) -> dict[str, Any]:
        """The HF dict (only the keys that are set)."""
        d = {"rope_type": self.rope_type, "rope_theta": self.rope_theta}
        if self.rope_type == "yarn":
            d["type"] = "yarn"
            for k in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                      "mscale_all_dim", "attention_factor"):
                if getattr(self, k) is not None:
                    d[k] = getattr(self, k)
            if not self.truncate:
                d["truncate"] = False
        return d


@dataclasses.dataclass(frozen=True)
class DeepseekConfig:
    """DeepSeek-V3/R1 hyper-parameters, HF names. Defaults: DeepSeek-V3 671B (without YaRN, as transformers).

    Derived: ``qk_head_dim = qk_nope_head_dim + qk_rope_head_dim``; ``softmax_scale`` (including YaRN's
    ``mscale**2``); ``is_moe_layer(i)``.
    """

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    num_key_value_heads: int = 128
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    n_group: int = 8
    topk_group: int = 4
    num_experts_per_tok: int = 8
    first_k_dense_replace: int = 3
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_interleave: bool = True
    attention_bias: bool = False
    rope: RopeParameters = RopeParameters()
    num_nextn_predict_layers: int = 1
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    pad_token_id: int | None = None

    def __post_init__(self):
        def need(cond, msg):
            if not cond:
                raise ValueError(f"DeepseekConfig: {msg}")

        for f in _INT_FIELDS + _FLOAT_FIELDS:    # a config.json null: name it (not a TypeError further on)
            v = getattr(self, f)
            need(isinstance(v, numbers.Integral if f in _INT_FIELDS else numbers.Real) and not isinstance(v, bool),
                 f"{f} must be {'an integer' if f in _INT_FIELDS else 'a number'}, got {v!r}")
        need(self.hidden_act == "silu", f"hidden_act must be 'silu', got {self.hidden_act!r}")
        need(self.num_key_value_heads == self.num_attention_heads,
             f"num_key_value_heads ({self.num_key_value_heads}) must equal num_attention_heads "
             f"({self.num_attention_heads}); MLA has no grouped KV heads")
        need(self.n_group >= 1 and self.n_routed_experts % self.n_group == 0,
             f"n_routed_experts ({self.n_routed_experts}) must be a multiple of n_group ({self.n_group})")
        need(self.n_routed_experts // self.n_group >= 2 or self.n_group == 1,
             "each expert group needs at least 2 experts (the group score is a top-2 sum)")
        need(1 <= self.topk_group <= self.n_group, f"topk_group ({self.topk_group}) must be in [1, n_group]")
        need(1 <= self.num_experts_per_tok <= self.topk_group * self.n_routed_experts // self.n_group,
             f"num_experts_per_tok ({self.num_experts_per_tok}) must be in [1, topk_group * E / n_group]")
        need(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim must be even")
        need(self.rope.rope_type in ("default", "yarn"),
             f"rope_type {self.rope.rope_type!r} is not supported (only 'default' and 'yarn')")
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))

    # ------------------------------------------------------------------------------ derived
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """``qk_head_dim**-0.5``, times ``mscale(factor, mscale_all_dim)**2`` for YaRN with ``mscale_all_dim``."""
        scale = self.qk_head_dim ** -0.5
        if self.rope.rope_type != "default" and self.rope.mscale_all_dim:
            m = yarn_get_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale = scale * m * m
        return scale

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace

    # ------------------------------------------------------------------------------ I/O
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DeepseekConfig":
        """Builds the config from a ``config.json`` dict (legacy or transformers-5 keys)."""
        d = dict(d)
        for old, new in _ALIASES.items():
            if old in d and new not in d:
                d[new] = d[old]
        fields = {f.name for f in dataclasses.fields(cls)} - {"rope"}
        kw = {k: d[k] for k in fields if k in d}
        if kw.get("num_key_value_heads") is None and "num_attention_heads" in kw:
            kw["num_key_value_heads"] = kw["num_attention_heads"]
        elif kw.get("num_key_value_heads") is None:
            kw.pop("num_key_value_heads", None)
        kw["rope"] = _resolve_rope(d)
        qk_rope = kw.get("qk_rope_head_dim", cls.qk_rope_head_dim)
        if d.get("head_dim") is not None and d["head_dim"] != qk_rope:
            warnings.warn(f"config.json has head_dim={d['head_dim']} != qk_rope_head_dim={qk_rope}; "
                          "transformers would use head_dim as the rotary dimension (a broken model). "
                          "jax_w4a8 uses qk_rope_head_dim.", stacklevel=2)
        return cls(**kw)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "DeepseekConfig":
        """Reads ``<path>/config.json`` (or ``path`` itself when it is a file)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def to_dict(self) -> dict[str, Any]:
        """A hub-style ``config.json`` dict (legacy ``rope_scaling`` + ``rope_theta``; both transformers 4
        and 5 read it). ``head_dim`` is written as transformers writes it (= qk_rope_head_dim)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "rope"}
        if isinstance(d["eos_token_id"], tuple):
            d["eos_token_id"] = list(d["eos_token_id"])
        d["rope_theta"] = self.rope.rope_theta
        rope = self.rope.to_dict()
        rope.pop("rope_theta")
        d["rope_scaling"] = rope if self.rope.rope_type != "default" else None
        d["head_dim"] = self.qk_rope_head_dim
        d["qk_head_dim"] = self.qk_head_dim
        d["model_type"] = "deepseek_v3"
        d["architectures"] = ["DeepseekV3ForCausalLM"]
        return d


def _resolve_rope(d: dict[str, Any]) -> RopeParameters:
    """transformers' ``convert_rope_params_to_dict`` + ``standardize_rope_params`` (SEMANTICS.md 1.1)."""
    rp = dict(d.get("rope_scaling") or d.get("rope_parameters") or {"rope_type": "default"})
    rp.setdefault("rope_theta", d.get("rope_theta", 10000.0) if d.get("rope_theta") is not None else 10000.0)
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type != "yarn":
        return RopeParameters(rope_type=rope_type, rope_theta=float(rp["rope_theta"]))
    max_pos = d.get("max_position_embeddings", DeepseekConfig.max_position_embeddings)
    if d.get("original_max_position_embeddings") is not None:
        orig = d["original_max_position_embeddings"]
    else:
        orig = rp.get("original_max_position_embeddings", max_pos)
    factor = rp.get("factor")
    if factor is None:
        factor = max_pos / orig

    def opt(k):
        return None if rp.get(k) is None else float(rp[k])

    return RopeParameters(
        rope_type="yarn", rope_theta=float(rp["rope_theta"]), factor=float(factor),
        original_max_position_embeddings=int(orig), beta_fast=opt("beta_fast"), beta_slow=opt("beta_slow"),
        mscale=opt("mscale"), mscale_all_dim=opt("mscale_all_dim"), attention_factor=opt("attention_factor"),
        truncate=bool(rp.get("truncate", True)))


# ----------------------------------------------------------------------------------------------
# quantization
# ----------------------------------------------------------------------------------------------
_LINEAR_KINDS = ("none", "fp8")
_EXPERT_KINDS = ("none", "fp8", "w4a8")


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """In-memory weight formats of a model.

    Attributes:
      linear: ``"none"`` (weights in the activation dtype) or ``"fp8"`` (e4m3 + fp32 128x128 block
        scales, ``ops.fp8_einsum``) for attention, dense-MLP and shared-expert linears. Embedding,
        lm_head, router and norms are never quantized.
      experts: routed experts: ``"none"``, ``"fp8"`` (128x128 blocks; computed by dequantizing to the
        activation dtype and ``jax.lax.ragged_dot``) or ``"w4a8"`` (packed int4, group-128 scales,
        ``ops.w4a8_grouped_gemm``).
      ue8m0: FP8 scales are powers of two (checkpoint ``scale_fmt: "ue8m0"``, DeepSeek-V3.1): activation
        scales are rounded up to powers of two and ``fp8_einsum`` takes them as UE8M0.
      act_scale: activations of W4A8 experts: ``"dynamic"`` (per token and 128-channel group) or
        ``"static"`` (per tensor: the max over the layer's experts of the checkpoint ``input_scale``).
      input_scales: the W4A8 experts hold the checkpoint's per-expert ``input_scale`` tensors.
    """

    linear: str = "none"
    experts: str = "none"
    ue8m0: bool = False
    act_scale: str = "dynamic"
    input_scales: bool = False

    def __post_init__(self):
        if self.linear not in _LINEAR_KINDS:
            raise ValueError(f"QuantConfig: linear must be one of {_LINEAR_KINDS}, got {self.linear!r}")
        if self.experts not in _EXPERT_KINDS:
            raise ValueError(f"QuantConfig: experts must be one of {_EXPERT_KINDS}, got {self.experts!r}")
        if self.act_scale not in ("dynamic", "static"):
            raise ValueError(f"QuantConfig: act_scale must be 'dynamic' or 'static', got {self.act_scale!r}")
        if self.input_scales and self.experts != "w4a8":
            raise ValueError("QuantConfig: input_scales only exist for W4A8 experts")
        if self.act_scale == "static" and not self.input_scales:
            raise ValueError("QuantConfig: act_scale='static' needs the checkpoint's per-expert input_scale "
                             "(input_scales=True); a model quantized on load has none, use 'dynamic'")

    @classmethod
    def fp8(cls, ue8m0: bool = False) -> "QuantConfig":
        """FP8 128x128 blocks everywhere (the DeepSeek-V3 FP8 checkpoint)."""
        return cls(linear="fp8", experts="fp8", ue8m0=ue8m0)

    @classmethod
    def w4a8(cls, ue8m0: bool = False, act_scale: str = "dynamic", input_scales: bool = False) -> "QuantConfig":
        """W4A8 routed experts + FP8 blocks elsewhere (the DeepSeek-R1-W4AFP8 recipe)."""
        return cls(linear="fp8", experts="w4a8", ue8m0=ue8m0, act_scale=act_scale, input_scales=input_scales)

    def to_hf(self) -> dict[str, Any] | None:
        """The ``quantization_config`` a checkpoint of this format carries (None for unquantized)."""
        if self.linear == "none" and self.experts == "none":
            return None
        d = {"quant_method": "w4afp8" if self.experts == "w4a8" else "fp8", "fmt": "e4m3",
             "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
        if self.experts == "w4a8":
            d["group_size"] = 128
        if self.ue8m0:
            d["scale_fmt"] = "ue8m0"
        return d
