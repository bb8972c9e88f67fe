"""DeepSeek-V3/R1 causal LM (HF ``DeepseekV3ForCausalLM``) as an NNX module, plus jit helpers.

Module tree = checkpoint keys: ``model.embed_tokens``, ``model.layers.{i}``, ``model.norm``, ``lm_head``.

    model = DeepseekV3ForCausalLM(cfg, quant=QuantConfig(), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    logits = model(input_ids)                       # [B, T] int32 -> [B, T, V] in dtype
    fwd = jit_forward(model)                        # graphdef/state split once, state passed as an argument
    logits = fwd(input_ids)

Each decoder layer runs through :func:`decoder_layer`, a ``jax.jit`` of ``(graphdef, state, h, cos, sin,
mask) -> h``. Inside an outer ``jit`` it is inlined, but it (1) lets JAX reuse one trace for all layers
of the same structure, (2) makes the residual stream between layers visible in the jaxpr as the inputs
and outputs of ``pjit[name=decoder_layer]`` equations (the dtype test walks them), and (3) is the
seam where a later pipeline / expert-parallel wrapper can go.

Positions and a latent cache: ``__call__(input_ids, positions=None, attention_mask=None)`` takes explicit
positions (they rotate; the mask is causal in token order, over real keys), and
attention is split into ``MLA.latents`` / ``MLA.attend`` (see ``layers.MLA``), so a generate loop can
store ``(c_kv, k_pe)`` per layer ([B, T_max, kv_lora_rank + qk_rope_head_dim]) and attend over it
without changing the layers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jax_w4a8.models.deepseek import layers
from jax_w4a8.models.deepseek.config import DeepseekConfig, QuantConfig

__all__ = ["DeepseekV3Model", "DeepseekV3ForCausalLM", "decoder_layer", "forward", "jit_forward",
           "causal_mask", "default_positions"]


@functools.partial(jax.jit, static_argnums=0, static_argnames="causal")
def decoder_layer(graphdef, state, h, cos, sin, mask, causal: bool = False):
    """One decoder layer as a pure function: ``h [B, T, D] -> [B, T, D]`` (same dtype). ``causal``: the mask
    allows no key after its query (lets a fused attention skip the blocks above the diagonal)."""
    return nnx.merge(graphdef, state)(h, cos, sin, mask, causal)


def default_positions(input_ids):
    """``arange(T)`` for every row: int32 [B, T]."""
    b, t = input_ids.shape
    return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


def causal_mask(input_ids, *, attention_mask=None):
    """bool [B, T, T]: query t may attend key s iff ``s <= t`` (token order, as transformers: not the positions,
    which only rotate) and key s is a real token (``attention_mask[b, s]``, when given). A padding query whose
    mask allows no key gets a meaningless output (:func:`layers.mla_attention`: zeros under cuDNN, the mean of
    the values eagerly), as in transformers."""
    b, t = input_ids.shape
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    return mask if attention_mask is None else mask & attention_mask.astype(bool)[:, None, :]


def _check_like_ids(name: str, value, input_ids):
    if value is not None and tuple(value.shape) != tuple(input_ids.shape):
        raise ValueError(f"DeepseekV3ForCausalLM: {name} must have input_ids' shape {tuple(input_ids.shape)} "
                         f"[B, T], got {tuple(value.shape)}")


class DeepseekV3Model(nnx.Module):
    """Embedding, decoder layers, final norm. ``__call__(input_ids [B, T], positions=None, attention_mask=None)``
    returns ``(h [B, T, D] after the final norm, hidden_states)`` where ``hidden_states`` is ``None`` or, with
    ``return_hidden_states``, ``[embeds, out_0, ..., out_{L-1}]`` (residual stream before the final norm,
    like the golden fixtures' ``layer_out``). Attention is causal in token order (:func:`causal_mask`)."""

    def __init__(self, cfg: DeepseekConfig, *, quant: QuantConfig = QuantConfig(), dtype=jnp.bfloat16,
                 rngs: nnx.Rngs):
        self.cfg, self.dtype = cfg, jnp.dtype(dtype)
        self.embed_tokens = layers.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([layers.DecoderLayer(cfg, i, quant=quant, dtype=dtype, rngs=rngs)
                                for i in range(cfg.num_hidden_layers)])
        self.norm = layers.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)

    def __call__(self, input_ids, positions=None, attention_mask=None, *, return_hidden_states: bool = False):
        _check_like_ids("positions", positions, input_ids)
        _check_like_ids("attention_mask", attention_mask, input_ids)
        if positions is None:
            positions = default_positions(input_ids)
        positions = positions.astype(jnp.int32)
        h = self.embed_tokens(input_ids)
        cos, sin = layers.rope_cos_sin(positions, self.cfg, self.dtype)
        mask = causal_mask(input_ids, attention_mask=attention_mask)
        hidden = [h] if return_hidden_states else None
        for layer in self.layers:
            graphdef, state = nnx.split(layer)
            # the mask never allows a key after its query: a fused attention may skip the blocks above the diagonal
            h = decoder_layer(graphdef, state, h, cos, sin, mask, causal=True)
            if hidden is not None:
                hidden.append(h)
        return self.norm(h), hidden


class DeepseekV3ForCausalLM(nnx.Module):
    """``model`` (:class:`DeepseekV3Model`) + untied ``lm_head`` (never quantized; tied to the embedding
    only when ``cfg.tie_word_embeddings``).

    Args:
      cfg: architecture. quant: weight formats (:class:`QuantConfig`). dtype: activation and unquantized
        weight dtype (bfloat16, or float32 for golden comparisons). rngs: random init.
    Call:
      ``model(input_ids int [B, T], positions int [B, T] | None = None, attention_mask [B, T] | None = None)
      -> logits dtype [B, T, V]``; with ``return_hidden_states=True``: ``(logits, [embeds, out_0, ...,
      out_{L-1}])``. As transformers: ``positions`` (default ``0 .. T - 1``) only rotate queries and keys;
      attention is causal in token order, over the keys ``attention_mask`` marks real (1 / True; 0 / False for
      padding). A left-padded batch therefore takes ``attention_mask`` and positions counting real tokens;
      padding rows' logits are meaningless. :func:`jax_w4a8.models.deepseek.generate` does this itself.
    """

    def __init__(self, cfg: DeepseekConfig, *, quant: QuantConfig = QuantConfig(), dtype=jnp.bfloat16,
                 rngs: nnx.Rngs | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
            raise ValueError(f"DeepseekV3ForCausalLM: dtype must be bfloat16 or float32, got {jnp.dtype(dtype)}")
        self.cfg, self.quant, self.dtype = cfg, quant, jnp.dtype(dtype)
        self.model = DeepseekV3Model(cfg, quant=quant, dtype=dtype, rngs=rngs)
        self.lm_head = (None if cfg.tie_word_embeddings else
                        layers.Linear(cfg.hidden_size, cfg.vocab_size, quant="none", dtype=dtype, rngs=rngs))

    def set_attention(self, implementation: str) -> DeepseekV3ForCausalLM:
        """How prefill attention runs in every layer: ``"auto"`` (the default: cudnn for a bf16 model on a
        GPU, else eager), ``"eager"`` (transformers' numerics, float32 scores in memory) or ``"cudnn"`` (cuDNN's
        fused flash attention, bf16 models on a GPU); see :func:`layers.mla_attention`. A static part of
        the model (jitted functions retrace for it). Returns the model.

        Raises: ValueError for another name, or "cudnn" on a float32 model."""
        if implementation not in layers.ATTENTION_IMPLS:
            raise ValueError(f"set_attention: implementation must be one of {layers.ATTENTION_IMPLS}, "
                             f"got {implementation!r}")
        if implementation == "cudnn" and self.dtype == jnp.float32:
            raise ValueError("set_attention: 'cudnn' needs a bf16 model (cuDNN's fused attention has no float32); "
                             "'auto' keeps eager attention for float32")
        for layer in self.model.layers:
            layer.self_attn.attention = implementation
        return self

    def set_moe_up(self, implementation: str) -> DeepseekV3ForCausalLM:
        """How every MoE layer's W4A8 routed experts form the down projection's input ``silu(gate) * up``:
        ``"unfused"`` (the gate+up grouped GEMM writes bf16, then one kernel does SiLU-mul and the down
        projection's fp8 quantization), ``"fused"`` (``ops.w4a8_moe_up``: all of it in the GEMM's epilogue on
        Hopper, gate and up never in memory nor rounded to bf16) or ``"auto"``, the default (fused from one to
        ``tiling.FUSED_UP_MAX_ROWS`` expected rows per expert, except where the unfused gate+up GEMM runs its wide
        8-token kernel: :func:`jax_w4a8.tiling.moe_up_fuses`, measured on an H100; unfused elsewhere, and in layers
        whose experts cannot fuse). Fusing needs W4A8 experts in a bf16 model
        (:attr:`layers.Experts.can_fuse_up`). A static part of the model (jitted functions retrace for it).
        Returns the model.

        Raises: ValueError for another name, or "fused" on a model whose experts cannot fuse."""
        if implementation not in layers.MOE_UP_IMPLS:
            raise ValueError(f"set_moe_up: implementation must be one of {layers.MOE_UP_IMPLS}, got {implementation!r}")
        experts = [layer.mlp.experts for layer in self.model.layers if isinstance(layer.mlp, layers.MoE)]
        if implementation == "fused" and not all(getattr(e, "can_fuse_up", False) for e in experts):
            raise ValueError(f"set_moe_up: 'fused' needs W4A8 routed experts in a bf16 model; this model has "
                             f"{self.quant} in {self.dtype}. 'auto' leaves such experts unfused")
        for e in experts:
            if hasattr(e, "moe_up"):
                e.moe_up = implementation
        return self

    def __call__(self, input_ids, positions=None, attention_mask=None, *, return_hidden_states: bool = False):
        h, hidden = self.model(input_ids, positions, attention_mask, return_hidden_states=return_hidden_states)
        logits = self.model.embed_tokens.attend(h) if self.lm_head is None else self.lm_head(h)
        return (logits, hidden) if return_hidden_states else logits


@functools.partial(jax.jit, static_argnums=(0, 5))
def forward(graphdef, state, input_ids, positions=None, attention_mask=None, return_hidden_states: bool = False):
    """Pure, jitted forward of a split model: ``nnx.merge(graphdef, state)(input_ids, positions,
    attention_mask)``."""
    return nnx.merge(graphdef, state)(input_ids, positions, attention_mask, return_hidden_states=return_hidden_states)


def jit_forward(model: DeepseekV3ForCausalLM):
    """Splits ``model`` once and returns ``fn(input_ids, positions=None, attention_mask=None,
    return_hidden_states=False)``
    running :func:`forward` (weights are jit arguments, not constants).

    ``input_ids``: int32 [B, T]; ``positions``: optional int32 [B, T] (default ``0 .. T - 1``; they rotate, the
    mask is causal in token order); ``attention_mask``: optional [B, T], 1 / True for real tokens (keys of 0 are
    not attended); returns the logits [B, T, vocab] in the model's dtype, and with ``return_hidden_states`` also
    the hidden states after the embedding and every layer, each [B, T, hidden]."""
    graphdef, state = nnx.split(model)

    def fn(input_ids, positions=None, attention_mask=None, return_hidden_states: bool = False):
        return forward(graphdef, state, input_ids, positions, attention_mask, return_hidden_states)

    return fn
