"""DeepSeek-V3/R1 building blocks as Flax NNX modules over small pure functions.

Everything reproduces transformers 5.17's ``DeepseekV3ForCausalLM`` (``tests/golden/SEMANTICS.md``). Weights
keep the HF layout ``[out, in]`` and HF names, so a module path *is* the checkpoint key
(``model.layers.3.self_attn.kv_b_proj.weight``), except where two linears that read the same input are one
product (:class:`Linear` ``parts``): ``self_attn.qkv_a_proj`` holds ``q_a_proj`` then ``kv_a_proj_with_mqa``
rows, ``mlp.gate_up_proj`` (dense and shared-expert MLPs) ``gate_proj`` then ``up_proj`` rows, each part
with its own FP8 blocks; the checkpoint code reads and writes them under their HF names.

Custom calls per decode layer (W4A8 model; ``benchmarks/step_inventory.py``): 7 ``fp8_einsum`` (qkv_a, q_b,
the two absorbed per-head products, o_proj, the shared expert's gate_up and down), 8 quantizer calls (the
attention input, q_a's norm, q_nope, the latent output, o_proj's input, the MoE tokens once for the routed
and shared experts, and ``silu(gate) * up`` fused into the routed and the shared down projection's
quantizer) and 2 ``w4a8_grouped_gemm``: 17, where separate q_a / kv_a and gate / up products, a bf16 SiLU
product and the routed rows quantized after the gather took 20.

Dtypes. Activations are ``dtype`` (bfloat16, or float32 for golden comparisons) between every module.
float32 is used only *inside* RMSNorm statistics, RoPE angles, the attention softmax (and its logits), the
router, SiLU(gate) * up, and the MoE combine; each of those rounds back to ``dtype`` once, except
SiLU(gate) * up ahead of an FP8 or W4A8 down projection: ``ops.silu_mul_quantize_fp8_groups`` quantizes
the float32 product to e4m3 directly (no bf16 rounding in between; until the thirty-seventh session's
build it was rounded to ``dtype`` and then quantized, as transformers' and DeepSeek's reference code do:
the codes can differ where the bf16 rounding crossed an e4m3 rounding boundary or moved a group's amax).
float16 never appears. Every float32 ``einsum`` runs at ``Precision.HIGHEST`` (no TF32 on GPUs).

Linear formats (``Linear.quant``):

* ``"none"``: ``weight`` [N, K] in ``dtype``; ``einsum("...k,nk->...n")``.
* ``"fp8"``: ``weight`` e4m3 [N, K] + ``weight_scale_inv`` fp32 [ceil(N/128), ceil(K/128)] (DeepSeek-V3
  blocks). Activations are quantized per token and 128-channel group (:func:`quantize_act_groups`: the
  ``ops.quantize_fp8_groups`` kernel; power-of-two scales when ``ue8m0``) and multiplied by
  ``ops.fp8_einsum("md,nd->mn")``. When K is not a multiple of 128 (only tiny test models; every DeepSeek
  dim is), activations and weights are zero-padded along K to the next multiple: exact, since padded
  channels contribute 0 and a partial group's amax is that of its real channels (the checkpoint rule "edge
  blocks are zero-padded before amax").

Routed experts (``Experts.quant``): ``"none"`` (``jax.lax.ragged_dot``), ``"fp8"`` (weights dequantized to
``dtype`` per call, activations fake-quantized per token-group, then ``ragged_dot``: a correct but slow
stand-in for a grouped FP8 GEMM), ``"w4a8"`` (``ops.w4a8_grouped_gemm``, K multiple of 128 required).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_w4a8 import expert_parallel, moe, ops, tiling
from jax_w4a8 import quant as qlib
from jax_w4a8.models.deepseek.config import DeepseekConfig, QuantConfig

__all__ = [
    "rms_norm", "rope_inv_freq", "rope_cos_sin", "apply_rope", "route", "mla_attention", "mla_latent_attention",
    "silu_mul",
    "fake_quant_fp8_groups", "quantize_act_groups",
    "RMSNorm", "Embed", "Linear", "TopkRouter", "Experts", "MLP", "MoE", "MLA", "DecoderLayer",
]

F32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST
BLOCK = 128


def _precision(dtype):
    """HIGHEST for float32 operands (no TF32), the default otherwise."""
    return HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _normal(rngs: nnx.Rngs, shape, std: float):
    return jax.random.normal(rngs.params(), shape, F32) * std


# random-init quantizers, jitted once (eager quantizers dispatch dozens of small ops)
_init_fp8_blocks = jax.jit(qlib.quantize_fp8_blocks, static_argnums=(1, 2))
_init_w4 = jax.jit(qlib.quantize_w4, static_argnums=1)


# ----------------------------------------------------------------------------------------------
# pure functions
# ----------------------------------------------------------------------------------------------
def rms_norm(x, weight, eps: float):
    """transformers' RMSNorm: statistics in fp32, cast back to ``x.dtype``, *then* times ``weight``.

    Args: x [..., D] (any float dtype); weight [D]. Returns x.dtype [..., D].
    """
    xf = x.astype(F32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * y.astype(x.dtype)


def rope_inv_freq(cfg: DeepseekConfig) -> np.ndarray:
    """float32 [qk_rope_head_dim / 2] inverse frequencies, YaRN-blended when ``rope_type == "yarn"``.

    transformers' ``_compute_default_rope_parameters`` / ``_compute_yarn_parameters`` in float32, with the
    rotary dim taken from ``qk_rope_head_dim`` (SEMANTICS.md 4.1). The table is static: YaRN applies at
    every position.
    """
    rp, d = cfg.rope, cfg.qk_rope_head_dim
    base = np.float32(rp.rope_theta)
    pos_freqs = base ** (np.arange(0, d, 2).astype(np.float32) / np.float32(d))
    inv_extra = (np.float32(1.0) / pos_freqs).astype(np.float32)
    if rp.rope_type == "default":
        return inv_extra
    factor = rp.factor
    beta_fast, beta_slow = rp.beta_fast or 32, rp.beta_slow or 1
    orig = rp.original_max_position_embeddings

    def correction_dim(n_rot):
        return d * math.log(orig / (n_rot * 2 * math.pi)) / (2 * math.log(rp.rope_theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rp.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(d // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extra = (np.float32(1) - ramp.astype(np.float32)).astype(np.float32)
    inv_inter = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)
    return (inv_inter * (np.float32(1) - extra) + inv_extra * extra).astype(np.float32)


def rope_cos_sin(positions, cfg: DeepseekConfig, dtype):
    """cos and sin of ``positions * inv_freq``, times YaRN's ``attention_scaling``, rounded to ``dtype``.

    Args:
      positions: int [B, T].
    Returns:
      (cos, sin), each ``dtype`` [B, T, qk_rope_head_dim / 2] (one angle per rotated pair).
    """
    inv = jnp.asarray(rope_inv_freq(cfg))
    ang = positions.astype(F32)[..., None] * inv
    s = cfg.rope.attention_scaling
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    if s != 1.0:
        cos, sin = cos * s, sin * s
    return cos.astype(dtype), sin.astype(dtype)


def apply_rope(x, cos, sin, interleave: bool):
    """Rotates the last axis of ``x`` as transformers does (SEMANTICS.md 4.3).

    Pairs are ``(x[2i], x[2i+1])`` when ``interleave`` (DeepSeek checkpoints), else ``(x[i], x[i+d/2])``;
    pair i turns by the angle of ``cos[..., i]``. The result is written ``[first of each pair | second of
    each pair]``: for ``interleave`` that is transformers' de-interleaved order. q and k get the same
    permutation, so their dot products are those of the official adjacent-pair rotation.

    Args:
      x: [..., d] (d = qk_rope_head_dim); cos, sin: broadcastable to [..., d / 2].
    Returns:
      x.dtype [..., d] (rotation computed in fp32).
    """
    xf, c, s = x.astype(F32), cos.astype(F32), sin.astype(F32)
    if interleave:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        h = x.shape[-1] // 2
        x1, x2 = xf[..., :h], xf[..., h:]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def route(x, weight, bias, *, n_group: int, topk_group: int, top_k: int, norm_topk_prob: bool,
          routed_scaling_factor: float):
    """DeepSeek-V3 group-limited sigmoid router (``noaux_tc``), entirely in float32.

    ``s = sigmoid(x W^T)``; choice scores ``s + bias``; each of ``n_group`` contiguous expert groups scores
    the sum of its top-2 choice scores; the best ``topk_group`` groups are kept and the rest masked with
    -inf; top-``top_k`` experts by choice score; weights are the *unbiased* ``s`` of those experts, divided
    by (their sum + 1e-20) only when ``norm_topk_prob``, then times ``routed_scaling_factor``.

    Args:
      x: float [N, D]; weight: [E, D]; bias: [E] (``e_score_correction_bias``).
    Returns:
      (ids int32 [N, top_k], weights float32 [N, top_k]); ids in descending choice-score order.
    """
    logits = jnp.einsum("nd,ed->ne", x.astype(F32), weight.astype(F32), precision=HIGHEST)
    scores = jax.nn.sigmoid(logits)
    choice = scores + bias.astype(F32)
    n, e = choice.shape
    if n_group > 1:
        group_scores = jax.lax.top_k(choice.reshape(n, n_group, e // n_group), 2)[0].sum(-1)  # [N, G]
        _, keep = jax.lax.top_k(group_scores, topk_group)                                    # [N, TG]
        group_mask = jnp.any(keep[..., None] == jnp.arange(n_group), axis=-2)                # [N, G]
        choice = jnp.where(jnp.repeat(group_mask, e // n_group, axis=-1), choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return ids.astype(jnp.int32), weights * routed_scaling_factor


# Long prompts are attended block by block over the queries so that one block's float32 scores
# (B x H x block x S) stay within this many bytes; each query row's softmax is whole either way, so the
# result is the same. 8 GiB keeps 4096-token prefill at DeepSeek-V3 widths (128 heads) in one block.
ATTENTION_SCORE_BYTES = 8 << 30


def _over_query_blocks(fn, queries, mask, heads: int):
    """``fn(*queries, mask)`` for queries [B, T, ...] and mask [B, T, S], T cut into blocks (``lax.map``, one
    block live at a time) when all of it would hold more than ``ATTENTION_SCORE_BYTES`` of float32 scores.
    Pad query rows (T rounded up to the block) attend nothing and are dropped."""
    b, t, s = mask.shape
    per_query = b * heads * s * 4
    block = max(1, ATTENTION_SCORE_BYTES // per_query)
    if block >= t:
        return fn(*queries, mask)
    nb = -(-t // block)
    pad = nb * block - t

    def split(a, fill):
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2), constant_values=fill)
        return jnp.moveaxis(a.reshape(b, nb, block, *a.shape[2:]), 1, 0)

    out = jax.lax.map(lambda xs: fn(*xs), tuple(split(q, 0) for q in queries) + (split(mask, False),))
    return jnp.moveaxis(out, 0, 1).reshape(b, nb * block, *out.shape[3:])[:, :t]


# How MLA's expanded (prefill) attention runs (``MLA.attention``, set by ``DeepseekV3ForCausalLM.set_attention``):
# "eager" (below: transformers' eager numerics, float32 scores in memory, query blocks), "cudnn" (cuDNN's fused
# flash attention through jax.nn.dot_product_attention: scores never in memory; bf16 / fp16 only) or "auto"
# (cudnn where the computation is lowered for CUDA on a GPU that cuDNN's flash attention supports and the
# activations are bf16 / fp16, eager otherwise).
ATTENTION_IMPLS = ("eager", "cudnn", "auto")


def _mla_qk(q_nope, q_pe, k_nope, k_pe):
    """MLA's queries and keys over [nope | rope] channels, as transformers concatenates them:
    q [B, T, H, dn + dr], k [B, S, H, dn + dr] (``k_pe`` [B, S, dr] is one head, broadcast to all)."""
    b, s, h, _ = k_nope.shape
    q = jnp.concatenate([q_nope, q_pe.astype(q_nope.dtype)], axis=-1)
    k_rope = jnp.broadcast_to(k_pe[:, :, None, :], (b, s, h, k_pe.shape[-1])).astype(k_nope.dtype)
    return q, jnp.concatenate([k_nope, k_rope], axis=-1)


def _sdpa(q_nope, q_pe, k_nope, k_pe, v, mask, scale: float, implementation: str, causal: bool = False):
    """:func:`mla_attention` through ``jax.nn.dot_product_attention(implementation=...)`` ("cudnn", or
    "xla" for its reference): v.dtype [B, T, H, dv]. That API takes one head dim for q, k and v: v is
    zero-padded to dn + dr and the output cut back to dv; the mask goes in as [B, 1, T, S]."""
    q, k = _mla_qk(q_nope, q_pe, k_nope, k_pe)
    pad = q.shape[-1] - v.shape[-1]
    vp = jnp.pad(v, [(0, 0)] * 3 + [(0, pad)]) if pad > 0 else v
    out = jax.nn.dot_product_attention(q.astype(v.dtype), k.astype(v.dtype), vp, mask=mask[:, None], scale=scale,
                                       is_causal=causal, implementation=implementation)[..., :v.shape[-1]]
    # A query whose mask allows no key (a pad slot) gets zeros: with ``causal`` cuDNN would attend its
    # diagonal key and eager every key uniformly, so neither is an answer to rely on.
    return jnp.where(mask.any(-1)[:, :, None, None], out, jnp.zeros((), out.dtype))


def _half_precision(dtype) -> bool:
    """cuDNN's fused attention takes bf16 / fp16 operands only."""
    return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _cudnn_attention_possible(dtype) -> bool:
    """Whether "auto" may choose cuDNN: bf16 / fp16 activations and a CUDA backend with a GPU of
    compute capability >= 8.0 (each lowering still picks eager for other platforms)."""
    if not _half_precision(dtype):
        return False
    try:
        gpu = jax.devices("gpu")[0]
        return tuple(int(v) for v in str(getattr(gpu, "compute_capability", "0.0")).split(".")) >= (8, 0)
    except (RuntimeError, ValueError):   # no GPU backend; a non-CUDA GPU ("gfx...")
        return False


def mla_attention(q_nope, q_pe, k_nope, k_pe, v, mask, scale: float, *, implementation: str = "eager",
                  causal: bool = False):
    """Multi-head attention over expanded MLA keys (transformers' eager path, not absorbed).

    ``score = (q_nope . k_nope + q_pe . k_pe) * scale`` in fp32 (``k_pe`` is one head shared by all
    heads), masked, softmax in fp32, rounded to ``v.dtype``, times ``v``. Long prompts run in query blocks
    (``ATTENTION_SCORE_BYTES``), the same result with bounded memory.

    Args:
      q_nope: [B, T, H, dn]; q_pe: [B, T, H, dr] (roped); k_nope: [B, S, H, dn]; k_pe: [B, S, dr] (roped);
      v: [B, S, H, dv]; mask: bool [B, T, S], True where query t may attend key s.
      implementation: ``"eager"``, ``"cudnn"`` or ``"auto"`` (:data:`ATTENTION_IMPLS`). cuDNN's fused kernel
        keeps the scores on chip (one head dim for q, k and v: v is zero-padded to dn + dr) and rounds the
        probabilities to ``v.dtype`` as this function does; its softmax runs in float32 blocks, so results
        differ from eager by rounding, not by the math; a query whose mask allows no key (a pad slot) gets
        zeros there (eager: the mean of v). bf16 / fp16 only. "auto" decides at trace time from this
        process's GPU; an export lowered for several platforms needs "eager" or "cudnn".
      causal: a promise that ``mask`` allows no key after its query (S == T, key s <= query t, as in a
        prefill): cuDNN then skips the blocks above the diagonal. The eager attention needs only ``mask``.
    Returns:
      v.dtype [B, T, H, dv].
    Raises:
      ValueError for an implementation not in :data:`ATTENTION_IMPLS`, or "cudnn" with float32 operands.
    """
    if implementation not in ATTENTION_IMPLS:
        raise ValueError(f"mla_attention: implementation must be one of {ATTENTION_IMPLS}, got {implementation!r}")
    causal = causal and q_nope.shape[1] == k_nope.shape[1]
    if implementation == "cudnn":
        if not _half_precision(v.dtype):
            raise ValueError(f"mla_attention: implementation='cudnn' needs bf16 / fp16 activations, got {v.dtype}; "
                             "use 'auto' (eager for float32) or 'eager'")
        return _sdpa(q_nope, q_pe, k_nope, k_pe, v, mask, scale, "cudnn", causal)
    if implementation == "auto" and _cudnn_attention_possible(v.dtype):
        args = (q_nope, q_pe, k_nope, k_pe, v, mask)
        try:
            return jax.lax.platform_dependent(
                *args, cuda=lambda *a: _sdpa(*a, scale, "cudnn", causal),
                default=lambda *a: mla_attention(*a, scale, implementation="eager"))
        except (NotImplementedError, RuntimeError, ValueError):   # cuDNN refused these shapes at trace time
            pass
    prec = _precision(v.dtype)
    # One product over [nope | rope] channels (k_pe broadcast to the heads), as transformers concatenates
    # them: the float32 scores are written once, not written by one product and rewritten by a second.
    q, k = _mla_qk(q_nope, q_pe, k_nope, k_pe)

    def block(qb, m):
        s = jnp.einsum("bthd,bshd->bhts", qb, k, preferred_element_type=F32, precision=prec)
        s = jnp.where(m[:, None], s * scale, jnp.finfo(F32).min)
        p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
        return jnp.einsum("bhts,bshd->bthd", p, v, preferred_element_type=F32, precision=prec).astype(v.dtype)

    return _over_query_blocks(block, (q,), mask, q_nope.shape[2])


def _einsum_f32(equation, a, b, dtype):
    """``einsum`` with float32 accumulation (HIGHEST for float32). XLA:CPU has no bf16 x bf16 -> f32 dot for
    some layouts ("Unsupported element type for DotThunk"), so on CPU bf16 operands are widened to float32
    first: the same result (bf16 products are exact in float32), computed with a float32 dot."""
    prec = _precision(dtype)

    def native():
        return jnp.einsum(equation, a, b, preferred_element_type=F32, precision=prec)

    if a.dtype == F32 and b.dtype == F32:
        return native()
    return jax.lax.platform_dependent(
        cpu=lambda: jnp.einsum(equation, a.astype(F32), b.astype(F32), precision=HIGHEST), default=native)


def mla_latent_attention(q_lat, q_pe, c_kv, k_pe, mask, scale: float):
    """Attention in MLA's latent space (the absorbed form used for decoding over a latent cache).

    ``score = (q_lat . c_kv + q_pe . k_pe) * scale`` in fp32, where ``q_lat = q_nope W_k`` is the no-RoPE
    query already absorbed into the latent space through the k part of ``kv_b_proj``; masked; softmax
    in fp32 rounded to ``q_lat.dtype``; the output ``sum_s p * c_kv`` stays latent (the caller applies
    the v part of ``kv_b_proj``). Equal to :func:`mla_attention` up to rounding.

    Args:
      q_lat: [B, T, H, R]; q_pe: [B, T, H, dr] (roped); c_kv: [B, S, R] (normed latents); k_pe: [B, S, dr]
        (roped); mask: bool [B, T, S], True where query t may attend key s. ``c_kv``/``k_pe`` are cast to
        ``q_lat.dtype`` (a bf16 cache read by an fp32 model).
    Returns:
      q_lat.dtype [B, T, H, R].
    """
    dtype = q_lat.dtype
    r = q_lat.shape[-1]
    # One product over the [latent | rope] channels of each key: the cache's own layout (generate passes its
    # two slices; XLA folds their concatenation back into the cache), so neither product reads a slice.
    kv = jnp.concatenate([c_kv, k_pe], axis=-1).astype(dtype)
    q = jnp.concatenate([q_lat, q_pe.astype(dtype)], axis=-1)

    def block(qb, m):
        s = _einsum_f32("bthr,bsr->bhts", qb, kv, dtype)
        s = jnp.where(m[:, None], s * scale, jnp.finfo(F32).min)
        p = jax.nn.softmax(s, axis=-1).astype(dtype)
        o = _einsum_f32("bhts,bsr->bhtr", p, kv, dtype)[..., :r]   # the rope channels' sums are dropped
        return jnp.swapaxes(o.astype(dtype), 1, 2)

    return _over_query_blocks(block, (q,), mask, q_lat.shape[2])


def silu_mul(gate, up, dtype):
    """``silu(gate) * up`` in fp32, rounded once to ``dtype``. gate, up: [..., I]. (Ahead of an FP8 or W4A8
    down projection the model calls ``ops.silu_mul_quantize_fp8_groups`` instead: module docstring.)"""
    return (jax.nn.silu(gate.astype(F32)) * up.astype(F32)).astype(dtype)


def _pad_last(x, multiple: int = BLOCK):
    pad = (-x.shape[-1]) % multiple
    return x if not pad else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])


def fake_quant_fp8_groups(x, ue8m0: bool = False, dtype=None):
    """Quantize-dequantize per token and 128-channel group: ``e4m3(x / s) * s`` (fp32 math).

    The last axis is zero-padded to a multiple of 128 for the amax (exact, see module docstring).
    Args: x bf16 / fp32 [..., K]. Returns ``dtype`` (default x.dtype) [..., K].
    """
    k = x.shape[-1]
    xp = _pad_last(x)
    x8, s = quantize_act_groups(xp, ue8m0)
    deq = x8.astype(F32).reshape(*xp.shape[:-1], -1, BLOCK) * s[..., None]
    return deq.reshape(xp.shape)[..., :k].astype(dtype or x.dtype)


def quantize_act_groups(x, ue8m0: bool = False):
    """Activations to e4m3 per token and 128-channel group: :func:`jax_w4a8.ops.quantize_fp8_groups`, one kernel
    pass that divides by the scale as IEEE float32 does (SPEC's recipe; the ``jnp`` reference
    :func:`jax_w4a8.quant.quantize_fp8_groups` may differ by one code or one scale ulp where XLA rewrites
    ``x / s`` as ``x * (1 / s)``).

    Args: x bf16 / fp32 [..., K], K a multiple of 128 (callers zero-pad first, :func:`_pad_last`).
    Returns: (e4m3 [..., K], fp32 scales [..., K / 128]; powers of two when ``ue8m0``).
    Raises: TypeError / ValueError naming ``x`` (the op's checks) for another dtype or K."""
    return ops.quantize_fp8_groups(x, BLOCK, ue8m0)


def _check_w4_dims(k: int, what: str):
    if k % BLOCK:
        raise ValueError(f"W4A8 experts need {what} ({k}) to be a multiple of 128 (int4 group size and the "
                         f"grouped GEMM's K block); keep these experts in bf16 or FP8")


# ----------------------------------------------------------------------------------------------
# modules
# ----------------------------------------------------------------------------------------------
class RMSNorm(nnx.Module):
    """``weight`` [D] in ``dtype``; ``__call__(x [..., D]) -> x.dtype [..., D]`` (see :func:`rms_norm`)."""

    def __init__(self, dim: int, *, eps: float = 1e-6, dtype=jnp.bfloat16):
        self.eps = float(eps)
        self.weight = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, x):
        return rms_norm(x, self.weight[...], self.eps)


class Embed(nnx.Module):
    """``weight`` [V, D] in ``dtype``. ``__call__(ids int [B, T]) -> dtype [B, T, D]``;
    ``attend(h [B, T, D]) -> [B, T, V]`` is the tied lm_head."""

    def __init__(self, vocab_size: int, dim: int, *, dtype=jnp.bfloat16, rngs: nnx.Rngs):
        self.weight = nnx.Param(_normal(rngs, (vocab_size, dim), 1.0).astype(dtype))

    def __call__(self, ids):
        return jnp.take(self.weight[...], ids, axis=0)

    def attend(self, h):
        w = self.weight[...]
        return jnp.einsum("btd,vd->btv", h, w, precision=_precision(w.dtype)).astype(h.dtype)


class Linear(nnx.Module):
    """``y = x W^T (+ b)``, ``W`` [out, in] (HF layout), in one of two formats (module docstring).

    Variables: ``weight`` ([N, K] ``dtype``, or e4m3 for ``quant="fp8"``), ``weight_scale_inv``
    (fp32 [ceil(N/128), ceil(K/128)], fp8 only), ``bias`` ([N] ``dtype``, only when ``use_bias``).
    ``__call__(x [..., K] dtype) -> dtype [..., N]``.

    ``parts``: several checkpoint tensors fused along N (:attr:`MLA.qkv_a_proj`, :attr:`MLP.gate_up_proj`), as
    ``((name, rows), ...)`` in row order, ``sum(rows) == out_features``; ``name`` is the tensor's HF module
    name beside this one (``"q_a_proj"``). One product then reads every part's weights. FP8 scales keep
    each part's own blocks: ``weight_scale_inv`` has ``ceil(rows / 128)`` block rows per part, which is
    the plain [ceil(N/128), ceil(K/128)] grid when every part but the last is a multiple of 128 rows (all of
    DeepSeek-V3's); otherwise (tiny test models) each part is its own ``fp8_einsum``.
    """

    def __init__(self, in_features: int, out_features: int, *, quant: str = "none", dtype=jnp.bfloat16,
                 ue8m0: bool = False, use_bias: bool = False, parts: tuple[tuple[str, int], ...] | None = None,
                 rngs: nnx.Rngs):
        if quant not in ("none", "fp8"):
            raise ValueError(f"Linear: quant must be 'none' or 'fp8', got {quant!r}")
        if parts is not None:
            parts = tuple((str(name), int(rows)) for name, rows in parts)
            if not parts or any(rows <= 0 for _, rows in parts) or sum(r for _, r in parts) != out_features:
                raise ValueError(f"Linear: parts {parts} must be positive row counts summing to out_features "
                                 f"({out_features})")
        self.in_features, self.out_features, self.parts = in_features, out_features, parts
        self.quant, self.dtype, self.ue8m0 = quant, jnp.dtype(dtype), bool(ue8m0)
        w = _normal(rngs, (out_features, in_features), in_features ** -0.5)
        if quant == "none":
            self.weight = nnx.Param(w.astype(dtype))
            self.weight_scale_inv = None
        else:
            qs = [_init_fp8_blocks(w[r0:r0 + rows], BLOCK, ue8m0) for r0, rows in self._row_ranges()]
            self.weight = nnx.Param(jnp.concatenate([q for q, _ in qs]))
            self.weight_scale_inv = nnx.Param(jnp.concatenate([s for _, s in qs]))
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if use_bias else None

    def _row_ranges(self) -> list[tuple[int, int]]:
        """(first row, rows) of each part (one part: the whole weight)."""
        rows = [r for _, r in self.parts] if self.parts else [self.out_features]
        return [(sum(rows[:j]), n) for j, n in enumerate(rows)]

    def part_slices(self) -> list[tuple[slice, slice]]:
        """Per part (one part: the whole weight), its rows of ``weight`` and its block rows of
        ``weight_scale_inv`` (``ceil(rows / 128)`` each: every part keeps its checkpoint tensor's FP8 blocks)."""
        out, b0 = [], 0
        for r0, rows in self._row_ranges():
            nb = -(-rows // BLOCK)
            out.append((slice(r0, r0 + rows), slice(b0, b0 + nb)))
            b0 += nb
        return out

    @property
    def block_aligned(self) -> bool:
        """Whether the parts' FP8 scale blocks form one [ceil(N/128), ceil(K/128)] grid (one product)."""
        return all(r0 % BLOCK == 0 for r0, _ in self._row_ranges())

    def quantize_input(self, x):
        """x [..., K] -> (e4m3 [M, K'], fp32 scales [M, K'/128]) for :meth:`apply_quantized`: rows flattened,
        K zero-padded to K' (a multiple of 128), :func:`quantize_act_groups` (UE8M0 with the weights')."""
        return quantize_act_groups(_pad_last(x.reshape(-1, x.shape[-1])), self.ue8m0)

    def apply_quantized(self, x8, x_scale):
        """The FP8 product of activations already quantized per token and 128 channels.

        Args: x8 e4m3 [M, K'] and x_scale fp32 [M, K'/128] (:meth:`quantize_input`, or
          ``ops.silu_mul_quantize_fp8_groups``; powers of two when ``ue8m0``); K' = K rounded up to 128.
        Returns: ``dtype`` [M, N], bias added.
        Raises: ValueError when the weights are not FP8 (``quant="none"``); the op's TypeError / ValueError
          naming ``x`` or ``x_scale`` for codes or scales of another dtype or width.
        """
        if self.quant != "fp8":
            raise ValueError(f"Linear.apply_quantized needs quant='fp8' weights, this one has {self.quant!r}")
        w, ws = _pad_last(self.weight[...]), self.weight_scale_inv[...]
        # UE8M0 scales (``ue8m0``) are float32 powers of two by construction (the quantizer rounds them, the
        # loader checks the checkpoint's), so the op takes them as float32 multipliers: the same products as
        # 1-byte codes, without encoding them in every call (two XLA kernels per linear per step, 14 a layer; with
        # them a 2-layer UE8M0 decode step took 2.52 ms at batch 16 on an H100, 2.28 ms with float32 scales).
        if self.block_aligned:
            y = ops.fp8_einsum("md,nd->mn", x8, x_scale, w, ws, out_dtype=self.dtype)
        else:   # parts off the 128-row grid (tiny test models): one product per part, each on its blocks
            y = jnp.concatenate([ops.fp8_einsum("md,nd->mn", x8, x_scale, w[rows], ws[blocks], out_dtype=self.dtype)
                                 for rows, blocks in self.part_slices()], axis=-1)
        return y if self.bias is None else y + self.bias[...].astype(self.dtype)

    def __call__(self, x):
        lead = x.shape[:-1]
        if self.quant == "fp8":
            return self.apply_quantized(*self.quantize_input(x)).reshape(*lead, self.out_features)
        y = jnp.einsum("...k,nk->...n", x, self.weight[...], precision=_precision(self.dtype),
                       preferred_element_type=F32).astype(self.dtype)
        return y if self.bias is None else y + self.bias[...].astype(self.dtype)


class TopkRouter(nnx.Module):
    """HF ``DeepseekV3TopkRouter`` (checkpoint ``mlp.gate``): ``weight`` fp32 [E, D] and
    ``e_score_correction_bias`` fp32 [E], whatever ``dtype``: transformers 5.25 keeps both in float32
    (``_keep_in_fp32_modules_strict``; 5.17 kept only the bias), so a float32 checkpoint's router weight is not
    rounded to bf16. ``__call__(x [N, D]) -> (ids int32 [N, K], weights fp32 [N, K])`` (see :func:`route`)."""

    def __init__(self, cfg: DeepseekConfig, *, dtype=jnp.bfloat16, rngs: nnx.Rngs):
        e, d = cfg.n_routed_experts, cfg.hidden_size
        self.cfg = cfg
        self.weight = nnx.Param(_normal(rngs, (e, d), 1.5 * d ** -0.5))     # fp32 in a bf16 model too
        self.e_score_correction_bias = nnx.Param(_normal(rngs, (e,), 0.1))

    def __call__(self, x):
        c = self.cfg
        return route(x, self.weight[...], self.e_score_correction_bias[...], n_group=c.n_group,
                     topk_group=c.topk_group, top_k=c.num_experts_per_tok, norm_topk_prob=c.norm_topk_prob,
                     routed_scaling_factor=c.routed_scaling_factor)


# ragged_dot_general: lhs [R, K] . rhs [E, N, K] -> [R, N] (contract lhs 1 with rhs 2, rows grouped).
_RAGGED_NK = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


def _ragged_nk(x, w, group_sizes, dtype):
    """x [R, K] rows sorted by expert, w [E, N, K], group_sizes int32 [E] -> dtype [R, N] (fp32 accumulate)."""
    y = jax.lax.ragged_dot_general(x, w, group_sizes, _RAGGED_NK, precision=_precision(dtype),
                                   preferred_element_type=F32)
    return y.astype(dtype)


# How W4A8 routed experts compute ``silu(gate) * up`` for the down projection (:attr:`Experts.moe_up`,
# ``DeepseekV3ForCausalLM.set_moe_up``): "unfused" (the gate+up grouped GEMM to bf16, then SiLU-mul and the
# quantizer in one kernel: ``ops.silu_mul_quantize_fp8_groups``), "fused" (``ops.w4a8_moe_up``'s fused kernel:
# SiLU-mul and the quantizer in the GEMM's epilogue, gate and up never in memory, whatever the rows per expert)
# or "auto", the default (fused where ``tiling.moe_up_fuses``: from one to ``tiling.FUSED_UP_MAX_ROWS`` expected rows
# per expert, except where the unfused gate+up GEMM runs its wide 8-token kernel; unfused elsewhere, and for experts
# that cannot fuse: :attr:`Experts.can_fuse_up`).
MOE_UP_IMPLS = ("unfused", "fused", "auto")


def _per_expert(expected_rows: int | None, experts: int) -> float | None:
    """The grouped GEMMs' ``rows_per_expert`` hint for ``expected_rows`` routed over ``experts`` (None: none)."""
    return None if expected_rows is None else expected_rows / experts


class Experts(nnx.Module):
    """The routed experts of one MoE layer: ``__call__(x_sorted [R, D], group_sizes int32 [E]) -> [R, D]``.

    This is the ``experts_fn`` of :func:`jax_w4a8.moe.moe_apply`: rows arrive sorted by expert, and the
    module could be wrapped in ``shard_map`` over an expert axis. Gate and up are fused, gate rows first
    (transformers-5 ``gate_up_proj``). Variables by ``quant``:

    * ``"none"``: ``gate_up_proj`` [E, 2I, D], ``down_proj`` [E, D, I] in ``dtype``.
    * ``"fp8"``: ``gate_up_proj`` e4m3 [E, 2I, D] + ``gate_up_proj_scale_inv`` fp32 [E, 2*ceil(I/128),
      ceil(D/128)] (gate blocks, then up blocks); ``down_proj`` e4m3 [E, D, I] + ``down_proj_scale_inv``
      [E, ceil(D/128), ceil(I/128)]. Computed by dequantizing the weights to ``dtype`` and fake-quantizing
      activations per token-group, then ``jax.lax.ragged_dot`` (slow stand-in for a grouped FP8 GEMM).
    * ``"w4a8"``: ``gate_up_proj`` int8 [E, 2I, D/2] (packed int4) + ``gate_up_proj_scale_inv`` fp32
      [E, 2I, D/128]; ``down_proj`` int8 [E, D, I/2] + ``down_proj_scale_inv`` [E, D, I/128]; with
      ``input_scales``: ``gate_up_proj_input_scale`` fp32 [E, 2] (w1 = gate, w3 = up) and
      ``down_proj_input_scale`` fp32 [E] (w2). Activations fp8 per token-group (``act_scale="dynamic"``)
      or per tensor with the max ``input_scale`` of the layer (``"static"``); ``ops.w4a8_grouped_gemm``
      for gate+up and for down; ``silu(gate) * up`` in fp32 and re-quantized for down (dynamic:
      ``ops.silu_mul_quantize_fp8_groups`` quantizes the fp32 product; static: rounded to ``dtype`` first),
      or, per :attr:`moe_up`, all three in ``ops.w4a8_moe_up``'s fused kernel (gate, up and h then stay
      float32: not rounded to ``dtype``).

    ``moe_up`` (static, :data:`MOE_UP_IMPLS`, default "auto"): how W4A8 experts that :attr:`can_fuse_up` form
    the down projection's input; others always run unfused.
    """

    def __init__(self, num_experts: int, hidden: int, inter: int, *, quant: str = "none", dtype=jnp.bfloat16,
                 ue8m0: bool = False, act_scale: str = "dynamic", input_scales: bool = False, rngs: nnx.Rngs):
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        self.quant, self.dtype, self.ue8m0, self.act_scale = quant, jnp.dtype(dtype), bool(ue8m0), act_scale
        e, d, i = num_experts, hidden, inter
        gate_up = _normal(rngs, (e, 2 * i, d), d ** -0.5)
        down = _normal(rngs, (e, d, i), i ** -0.5)
        # optional variables: nnx.data so that a later assignment of a Param is allowed
        self.gate_up_proj_scale_inv = self.down_proj_scale_inv = nnx.data(None)
        self.gate_up_proj_input_scale = self.down_proj_input_scale = nnx.data(None)
        if quant == "none":
            self.gate_up_proj = nnx.Param(gate_up.astype(dtype))
            self.down_proj = nnx.Param(down.astype(dtype))
        elif quant == "fp8":
            (gq, gs), (uq, us) = _init_fp8_blocks(gate_up[:, :i], BLOCK, ue8m0), \
                _init_fp8_blocks(gate_up[:, i:], BLOCK, ue8m0)
            dq, ds = _init_fp8_blocks(down, BLOCK, ue8m0)
            self.gate_up_proj = nnx.Param(jnp.concatenate([gq, uq], axis=1))
            self.gate_up_proj_scale_inv = nnx.Param(jnp.concatenate([gs, us], axis=1))
            self.down_proj, self.down_proj_scale_inv = nnx.Param(dq), nnx.Param(ds)
        elif quant == "w4a8":
            _check_w4_dims(d, "hidden_size")
            _check_w4_dims(i, "moe_intermediate_size")
            gq, gs = _init_w4(gate_up, BLOCK)
            dq, ds = _init_w4(down, BLOCK)
            self.gate_up_proj, self.gate_up_proj_scale_inv = nnx.Param(gq), nnx.Param(gs)
            self.down_proj, self.down_proj_scale_inv = nnx.Param(dq), nnx.Param(ds)
            if input_scales:
                self.gate_up_proj_input_scale = nnx.Param(jnp.full((e, 2), 4.0 / qlib.FP8_MAX, F32))
                self.down_proj_input_scale = nnx.Param(jnp.full((e,), 4.0 / qlib.FP8_MAX, F32))
        else:
            raise ValueError(f"Experts: quant must be 'none', 'fp8' or 'w4a8', got {quant!r}")
        if act_scale == "static" and (quant != "w4a8" or not input_scales):
            raise ValueError("Experts: act_scale='static' needs W4A8 experts with input_scales")
        self.moe_up = "auto"

    # -- weights as [E, N, K] in dtype (the "none" and "fp8" paths)
    def _dense_weights(self):
        gu, dn = self.gate_up_proj[...], self.down_proj[...]
        if self.quant == "none":
            return gu, dn
        nb = -(-self.inter // BLOCK)
        s = self.gate_up_proj_scale_inv[...]
        deq = functools.partial(qlib.dequantize_fp8_blocks, block=BLOCK, dtype=self.dtype)
        gu = jnp.concatenate([deq(gu[:, :self.inter], s[:, :nb]), deq(gu[:, self.inter:], s[:, nb:])], axis=1)
        return gu, deq(dn, self.down_proj_scale_inv[...])

    @property
    def quantizes_input(self) -> bool:
        """Whether :meth:`__call__` takes its rows quantized (:meth:`quantize_input`): W4A8 with dynamic
        per-token-group activation scales. Quantizing per row commutes with the gather that sorts rows by
        expert, so :class:`MoE` quantizes its N tokens once instead of their N * top_k rows (the same
        quantizer call as the shared expert's, which XLA then computes once)."""
        return self.quant == "w4a8" and self.act_scale == "dynamic"

    @property
    def can_fuse_up(self) -> bool:
        """Whether ``ops.w4a8_moe_up`` can compute this module's down-projection input (:attr:`moe_up`): W4A8
        experts in a bf16 module (the op's composed ops, its path off Hopper, round gate and up to bf16), with
        static activation scales (the checkpoint's ``input_scale``, sglang's W4AFP8 recipe) or dynamic ones
        (float32 or UE8M0, as ``ue8m0``)."""
        return self.quant == "w4a8" and self.dtype == jnp.dtype(jnp.bfloat16)

    def _fuses_up(self, rows: int, experts: int, expected_rows: int | None) -> bool:
        if self.moe_up == "unfused" or not self.can_fuse_up:
            return False
        return self.moe_up == "fused" or tiling.moe_up_fuses(rows, experts, self.inter, self.hidden,
                                                              expected_rows=expected_rows)

    def input_layout(self, rows: int, experts: int | None = None, expected_rows: int | None = None) -> str:
        """The activation layout (``ops.LAYOUTS``) in which :meth:`quantize_input` hands ``rows`` routed rows to
        the gate+up product: "folded" (UE8M0 scales folded into the codes by the quantizer, a multiplier per
        token: the grouped GEMM then skips its preparation pass) where the product's plan runs the 128-token e4m3
        kernel that folds anyway (``tiling.grouped_gemm_layout``: prefill, many rows per expert) and the fused
        up-projection does not take the rows; "standard" otherwise. ``experts``: the experts the rows meet (default
        all; under expert parallelism a device's); ``expected_rows``: the real rows among ``rows`` (default all), as
        :meth:`__call__` takes them."""
        experts = experts or self.num_experts
        if not (self.quantizes_input and self.ue8m0) or self._fuses_up(rows, experts, expected_rows):
            return "standard"  # (only UE8M0 folds: no fusion decision, hence no plan, for float32 scales)
        return self._layout_for(rows, experts, 2 * self.inter, self.hidden, expected_rows)

    def quantize_input(self, x, layout: str = "standard"):
        """x [R, D] -> (e4m3 [R, D], fp32 scales [R, D/128]) as the W4A8 gate+up product takes them
        (:func:`quantize_act_groups`; powers of two when ``ue8m0``), or with ``layout="folded"`` (``ue8m0``
        only; :meth:`input_layout`) (e4m3 [R, D] folded, fp32 token multipliers [R])."""
        if layout == "folded":
            if not self.ue8m0:
                raise ValueError("Experts.quantize_input: layout='folded' needs UE8M0 activation scales (ue8m0=True)")
            return ops.quantize_fp8_groups(x.astype(self.dtype), BLOCK, True, layout="folded")
        return quantize_act_groups(x.astype(self.dtype), self.ue8m0)

    def _down_layout(self, rows: int, experts: int, expected_rows: int | None = None) -> str:
        """The down projection's input layout: folded where its plan folds (UE8M0 scales; as :meth:`input_layout`)."""
        return self._layout_for(rows, experts, self.hidden, self.inter, expected_rows)

    def _layout_for(self, rows: int, experts: int, n: int, k: int, expected_rows: int | None) -> str:
        """"folded" where UE8M0 activations meet a grouped GEMM [rows, k] x [experts, n, k] whose plan folds."""
        if not self.ue8m0:
            return "standard"
        return tiling.grouped_gemm_layout(rows, experts, n, k, rows_per_expert=_per_expert(expected_rows, experts),
                                          out_bf16=self.dtype == jnp.dtype(jnp.bfloat16))

    def _w4a8(self, x_sorted, group_sizes, expected_rows):
        w13, w13_s, w2, w2_s = (self.gate_up_proj[...], self.gate_up_proj_scale_inv[...], self.down_proj[...],
                                self.down_proj_scale_inv[...])
        # the GEMMs plan for the rows each expert expects (under EP the buffer R counts padding; w13: local experts)
        hint = _per_expert(expected_rows, w13.shape[0])
        if self.act_scale == "static":   # one scale per tensor: the max over the layer's (local) experts
            s13 = jnp.max(self.gate_up_proj_input_scale[...]).astype(F32)
            s2 = jnp.max(self.down_proj_input_scale[...]).astype(F32)
            x8 = qlib.quantize_fp8_tensor(x_sorted.astype(self.dtype), s13)
            if self._fuses_up(x8.shape[0], w13.shape[0], expected_rows):
                h8, _ = ops.w4a8_moe_up(x8, s13, w13, w13_s, group_sizes, down_input_scale=s2, fused=True,
                                        rows_per_expert=hint)
            else:
                gu = ops.w4a8_grouped_gemm(x8, s13, w13, w13_s, group_sizes, out_dtype=self.dtype,
                                           rows_per_expert=hint)
                h8 = qlib.quantize_fp8_tensor(silu_mul(gu[:, :self.inter], gu[:, self.inter:], self.dtype), s2)
            return ops.w4a8_grouped_gemm(h8, s2, w2, w2_s, group_sizes, out_dtype=self.dtype, rows_per_expert=hint)
        x8, xs = x_sorted if isinstance(x_sorted, tuple) else self.quantize_input(x_sorted)
        # (codes, one multiplier per row): folded by quantize_input (input_layout); its group scales are always
        # 2-D ([R, D/128], also for D = 128), and standard per-token scales never reach the experts
        x_layout = "folded" if xs.ndim == 1 else "standard"
        if x_layout == "standard" and self._fuses_up(x8.shape[0], w13.shape[0], expected_rows):
            h8, hs = ops.w4a8_moe_up(x8, xs, w13, w13_s, group_sizes, ue8m0=self.ue8m0, fused=True,
                                     rows_per_expert=hint)
            h_layout = "standard"
        else:
            gu = ops.w4a8_grouped_gemm(x8, xs, w13, w13_s, group_sizes, out_dtype=self.dtype, x_layout=x_layout,
                                       rows_per_expert=hint)
            # silu(gate) * up in float32 and the down projection's quantization: one kernel, h never in memory
            h_layout = self._down_layout(x8.shape[0], w2.shape[0], expected_rows)
            h8, hs = ops.silu_mul_quantize_fp8_groups(gu, self.ue8m0, layout=h_layout)
        return ops.w4a8_grouped_gemm(h8, hs, w2, w2_s, group_sizes, out_dtype=self.dtype, x_layout=h_layout,
                                     rows_per_expert=hint)

    def __call__(self, x_sorted, group_sizes, *, expected_rows: int | None = None):
        """x_sorted [R, D] rows sorted by expert (or, when :attr:`quantizes_input`, the pair
        :meth:`quantize_input` makes of them); group_sizes int32 [E] -> ``dtype`` [R, D].

        ``expected_rows`` (static): the routed rows that :attr:`moe_up` "auto" decides for and the grouped GEMMs
        plan their tiles for (``rows_per_expert``), where R counts padding too (default R; :class:`MoE` passes them
        under expert parallelism, whose buffers have room for every routed row)."""
        if self.quant == "w4a8":
            return self._w4a8(x_sorted, group_sizes, expected_rows)
        if isinstance(x_sorted, tuple):
            raise TypeError(f"Experts({self.quant!r}) takes float rows, not quantized (codes, scales)")
        x = x_sorted.astype(self.dtype)
        w_gu, w_dn = self._dense_weights()
        if self.quant == "fp8":
            x = fake_quant_fp8_groups(x, self.ue8m0)
        gu = _ragged_nk(x, w_gu, group_sizes, self.dtype)
        h = silu_mul(gu[:, :self.inter], gu[:, self.inter:], self.dtype)
        if self.quant == "fp8":
            h = fake_quant_fp8_groups(h, self.ue8m0)
        return _ragged_nk(h, w_dn, group_sizes, self.dtype)


class MLP(nnx.Module):
    """SwiGLU ``down(silu(gate x) * up x)`` (dense layers and shared experts); [..., D] -> [..., D].

    ``gate_up_proj`` holds HF's ``gate_proj`` then ``up_proj`` rows ([2I, D], :class:`Linear` ``parts``), so
    one product computes both. With FP8 weights and I a multiple of 128, ``silu(gate) * up`` and the down
    projection's activation quantization are one kernel (``ops.silu_mul_quantize_fp8_groups``: the product
    in float32, quantized without a bf16 rounding in between), so the [..., I] activation never goes to memory.
    """

    def __init__(self, hidden: int, inter: int, *, quant: str = "none", dtype=jnp.bfloat16, ue8m0: bool = False,
                 rngs: nnx.Rngs):
        lin = functools.partial(Linear, quant=quant, dtype=dtype, ue8m0=ue8m0, rngs=rngs)
        self.dtype, self.inter = jnp.dtype(dtype), inter
        self.gate_up_proj = lin(hidden, 2 * inter, parts=(("gate_proj", inter), ("up_proj", inter)))
        self.down_proj = lin(inter, hidden)

    def __call__(self, x):
        i = self.inter
        gu = self.gate_up_proj(x)
        if self.down_proj.quant == "fp8" and i % BLOCK == 0:
            h8, hs = ops.silu_mul_quantize_fp8_groups(gu.reshape(-1, 2 * i), self.down_proj.ue8m0)
            return self.down_proj.apply_quantized(h8, hs).reshape(*x.shape[:-1], -1)
        return self.down_proj(silu_mul(gu[..., :i], gu[..., i:], self.dtype))


class MoE(nnx.Module):
    """HF ``DeepseekV3MoE``: router (``gate``), routed ``experts``, ``shared_experts`` (one MLP of width
    ``moe_intermediate_size * n_shared_experts``). ``__call__(x [B, T, D]) -> [B, T, D]`` in x.dtype; the
    routed combine and the shared-expert add are one fp32 sum, rounded once."""

    def __init__(self, cfg: DeepseekConfig, *, quant: QuantConfig = QuantConfig(), dtype=jnp.bfloat16,
                 rngs: nnx.Rngs):
        d, i = cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts = cfg.n_routed_experts
        self.gate = TopkRouter(cfg, dtype=dtype, rngs=rngs)
        self.experts = Experts(cfg.n_routed_experts, d, i, quant=quant.experts, dtype=dtype, ue8m0=quant.ue8m0,
                               act_scale=quant.act_scale, input_scales=quant.input_scales, rngs=rngs)
        self.shared_experts = (MLP(d, i * cfg.n_shared_experts, quant=quant.linear, dtype=dtype, ue8m0=quant.ue8m0,
                                   rngs=rngs) if cfg.n_shared_experts else None)

    # Set by jax_w4a8.models.deepseek.parallel.shard_model (a static, hashable ExpertParallel): the routed
    # experts then run inside a shard_map over the mesh's "expert" axis.
    expert_parallel = None

    def __call__(self, x):
        xf = x.reshape(-1, x.shape[-1])
        ids, weights = self.gate(xf)
        # W4A8 experts take their rows quantized: the N tokens once, not their N * top_k gathered rows (in the
        # standard layout the shared expert's quantizer call is the same one, merged by XLA; folded, a call of
        # its own); under EP fp8 rows travel.
        ep = self.expert_parallel
        # under EP each device's buffer has room for all N * top_k rows (ep.buffer_rows); its experts expect 1 / n
        expected = None if ep is None else -(-ids.size // ep.size)
        if getattr(self.experts, "quantizes_input", False):
            # folded at prefill sizes (Experts.input_layout), as each device's gate+up product plans its rows
            layout = (self.experts.input_layout(ids.size) if ep is None else
                      self.experts.input_layout(ep.buffer_rows(*ids.shape), self.num_experts // ep.size, expected))
            rows = self.experts.quantize_input(xf, layout)
        else:
            rows = xf
        if ep is None:
            y = moe.moe_apply(rows, ids, weights, self.experts, self.num_experts, out_dtype=F32)
        else:
            graphdef, state = nnx.split(self.experts)
            y = expert_parallel.moe_apply_ep(
                rows, ids, weights, state,
                lambda st, xs, gs: nnx.merge(graphdef, st)(xs, gs, expected_rows=expected), self.num_experts,
                self.expert_parallel, out_dtype=F32)
        if self.shared_experts is not None:
            y = y + self.shared_experts(xf).astype(F32)
        return y.astype(x.dtype).reshape(x.shape)


class MLA(nnx.Module):
    """Multi-head latent attention (HF ``DeepseekV3Attention``), split for a latent cache:

    * :meth:`queries` ``x -> (q_nope [B,T,H,dn], q_pe [B,T,H,dr] roped)``;
    * :meth:`latents` ``x -> (c_kv [B,T,R] normed, k_pe [B,T,dr] roped)``: exactly what an MLA cache
      stores per token (``R + dr`` values);
    * :meth:`attend` ``(q_nope, q_pe, c_kv [B,S,R], k_pe [B,S,dr], mask [B,T,S]) -> [B,T,D]``: expands the
      latents with ``kv_b_proj`` (transformers' non-absorbed form) and applies ``o_proj``;
    * :meth:`attend_absorbed` (same arguments, plus :meth:`absorbed_weights`): the absorbed form, attention
      in the latent space without expanding the cache (what decoding uses).

    ``__call__(x, cos, sin, mask)`` chains them over the same tokens (:meth:`project` gives the first two
    from one product). ``qkv_a_proj`` holds HF's ``q_a_proj`` then ``kv_a_proj_with_mqa`` rows (:class:`Linear`
    ``parts``: one product reads both, as sglang's ``fused_qkv_a_proj_with_mqa``); ``q_lora_rank=None`` gives
    a plain ``q_proj`` and a ``kv_a_proj_with_mqa`` of its own. ``q_a_layernorm``/``kv_a_layernorm`` use eps
    1e-6 whatever ``rms_norm_eps`` is.
    """

    def __init__(self, cfg: DeepseekConfig, *, quant: QuantConfig = QuantConfig(), dtype=jnp.bfloat16,
                 rngs: nnx.Rngs):
        self.cfg = cfg
        d, h = cfg.hidden_size, cfg.num_attention_heads
        dn, dr, dv, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        lin = functools.partial(Linear, quant=quant.linear, dtype=dtype, ue8m0=quant.ue8m0, rngs=rngs)
        bias = cfg.attention_bias
        self.q_proj = self.q_a_layernorm = self.q_b_proj = nnx.data(None)
        self.qkv_a_proj = self.kv_a_proj_with_mqa = nnx.data(None)
        if cfg.q_lora_rank is None:
            self.q_proj = lin(d, h * (dn + dr))
            self.kv_a_proj_with_mqa = lin(d, r + dr, use_bias=bias)
        else:
            self.qkv_a_proj = lin(d, cfg.q_lora_rank + r + dr, use_bias=bias,
                                  parts=(("q_a_proj", cfg.q_lora_rank), ("kv_a_proj_with_mqa", r + dr)))
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, eps=1e-6, dtype=dtype)
            self.q_b_proj = lin(cfg.q_lora_rank, h * (dn + dr))
        self.kv_a_layernorm = RMSNorm(r, eps=1e-6, dtype=dtype)
        self.kv_b_proj = lin(r, h * (dn + dv))
        self.attention = "auto"     # the expanded attention's implementation (ATTENTION_IMPLS): static
        self.o_proj = lin(h * dv, d, use_bias=bias)

    def _first_projections(self, x):
        """x [B, T, D] -> (q_a [B, T, q_lora_rank] or None, kv_a [B, T, R + dr]), from one product when
        ``qkv_a_proj`` holds both."""
        if self.qkv_a_proj is None:
            return None, self.kv_a_proj_with_mqa(x)
        y = self.qkv_a_proj(x)
        q = self.cfg.q_lora_rank
        return y[..., :q], y[..., q:]

    def _queries(self, x, q_a, cos, sin):
        c = self.cfg
        q = self.q_proj(x) if q_a is None else self.q_b_proj(self.q_a_layernorm(q_a))
        q = q.reshape(*x.shape[:-1], c.num_attention_heads, c.qk_head_dim)
        q_nope, q_pe = q[..., :c.qk_nope_head_dim], q[..., c.qk_nope_head_dim:]
        return q_nope, apply_rope(q_pe, cos[..., None, :], sin[..., None, :], c.rope_interleave)

    def _latents(self, kv_a, cos, sin):
        c = self.cfg
        c_kv = self.kv_a_layernorm(kv_a[..., :c.kv_lora_rank])
        return c_kv, apply_rope(kv_a[..., c.kv_lora_rank:], cos, sin, c.rope_interleave)

    def project(self, x, cos, sin):
        """x [B, T, D]; cos, sin [B, T, dr/2] -> (q_nope, q_pe, c_kv, k_pe): :meth:`queries` and :meth:`latents`
        with ``qkv_a_proj`` computed once (what the model and generate() call)."""
        q_a, kv_a = self._first_projections(x)
        return (*self._queries(x, q_a, cos, sin), *self._latents(kv_a, cos, sin))

    def queries(self, x, cos, sin):
        """x [B, T, D]; cos, sin [B, T, dr/2] -> (q_nope [B, T, H, dn], q_pe [B, T, H, dr] roped)."""
        return self._queries(x, self._first_projections(x)[0], cos, sin)

    def latents(self, x, cos, sin):
        """x [B, T, D]; cos, sin [B, T, dr/2] -> (c_kv [B, T, R] normed, k_pe [B, T, dr] roped)."""
        return self._latents(self._first_projections(x)[1], cos, sin)

    def attend(self, q_nope, q_pe, c_kv, k_pe, mask, causal: bool = False):
        """Attention of T queries over S latents; returns ``o_proj`` output [B, T, D]. ``causal``: the mask
        is within the causal one (:func:`mla_attention`)."""
        c = self.cfg
        b, s = c_kv.shape[:2]
        kv = self.kv_b_proj(c_kv).reshape(b, s, c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim)
        k_nope, v = kv[..., :c.qk_nope_head_dim], kv[..., c.qk_nope_head_dim:]
        o = mla_attention(q_nope, q_pe, k_nope, k_pe, v, mask, c.softmax_scale, implementation=self.attention,
                          causal=causal)
        return self.o_proj(o.reshape(*o.shape[:2], -1))

    # -- absorbed form (decoding over a latent cache) -----------------------------------------
    def absorbed_weights(self) -> dict:
        """``kv_b_proj`` split per head for :meth:`attend_absorbed` (compute once per generate call).

        ``kv_b_proj.weight`` [H*(dn+dv), R] holds, per head, dn rows of ``W_k`` then dv rows of ``W_v``.
        Returns a dict of arrays:

        * FP8 weights whose per-head parts are whole 128x128 blocks (``dn``, ``dv``, ``R`` multiples of
          128, as in DeepSeek-V3): ``w_kT`` e4m3 [H, R, dn] (``W_k`` transposed per head) + ``w_kT_scale``
          fp32 [H, R/128, dn/128] and ``w_v`` e4m3 [H, dv, R] + ``w_v_scale`` fp32 [H, dv/128, R/128], for
          ``ops.fp8_einsum`` (``"bhd,hrd->bhr"`` and ``"bhr,hdr->bhd"``);
        * otherwise ``w_kT`` [H, R, dn] and ``w_v`` [H, dv, R] in ``dtype`` (FP8 weights of a tiny test
          model whose dims are not multiples of 128 are dequantized: ``fp8_einsum`` needs its contracted
          axis to be a multiple of 128, so those products fall back to a plain einsum).
        """
        c, lin = self.cfg, self.kv_b_proj
        h, dn, dv, r = c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank
        w = lin.weight[...]
        if lin.quant == "fp8" and not (dn % BLOCK or dv % BLOCK or r % BLOCK):
            w = w.reshape(h, dn + dv, r)
            s = lin.weight_scale_inv[...].reshape(h, (dn + dv) // BLOCK, r // BLOCK)
            return {"w_kT": jnp.swapaxes(w[:, :dn], 1, 2), "w_kT_scale": jnp.swapaxes(s[:, :dn // BLOCK], 1, 2),
                    "w_v": w[:, dn:], "w_v_scale": s[:, dn // BLOCK:]}
        if lin.quant == "fp8":
            w = qlib.dequantize_fp8_blocks(w, lin.weight_scale_inv[...], BLOCK, lin.dtype)
        w = w.reshape(h, dn + dv, r)
        return {"w_kT": jnp.swapaxes(w[:, :dn], 1, 2), "w_v": w[:, dn:]}

    def attend_absorbed(self, q_nope, q_pe, c_kv, k_pe, mask, absorbed: dict | None = None):
        """Same result as :meth:`attend` (up to rounding) without expanding the latents (decode path).

        ``q_lat = q_nope W_k`` ("bhd,hdr->bhr" per head), attention over the latents
        (:func:`mla_latent_attention`), then ``o = o_lat W_v^T`` ("bhr,hdr->bhd") and ``o_proj``. With FP8
        ``kv_b_proj`` blocks both per-head products run through ``ops.fp8_einsum`` on activations quantized
        per (token, head, 128 channels).

        Args:
          q_nope [B, T, H, dn], q_pe [B, T, H, dr]; c_kv [B, S, R], k_pe [B, S, dr] (a cache, any float
          dtype); mask bool [B, T, S]; absorbed: :meth:`absorbed_weights` (computed here when None).
        Returns:
          [B, T, D] in the activation dtype.
        """
        c = self.cfg
        a = self.absorbed_weights() if absorbed is None else absorbed
        dtype = q_nope.dtype
        b, t, h, dn = q_nope.shape
        ue8m0 = self.kv_b_proj.ue8m0  # scales powers of two, passed as float32 (see Linear.apply_quantized)
        fp8 = "w_kT_scale" in a
        if fp8:
            q8, qs = quantize_act_groups(q_nope.reshape(b * t, h, dn), ue8m0)
            q_lat = ops.fp8_einsum("bhd,hrd->bhr", q8, qs, a["w_kT"], a["w_kT_scale"], out_dtype=dtype)
            q_lat = q_lat.reshape(b, t, h, -1)
        else:
            q_lat = _einsum_f32("bthd,hrd->bthr", q_nope, a["w_kT"].astype(dtype), dtype).astype(dtype)
        o_lat = mla_latent_attention(q_lat, q_pe, c_kv, k_pe, mask, c.softmax_scale)
        if fp8:
            o8, os_ = quantize_act_groups(o_lat.reshape(b * t, h, -1), ue8m0)
            o = ops.fp8_einsum("bhr,hdr->bhd", o8, os_, a["w_v"], a["w_v_scale"], out_dtype=dtype)
        else:
            o = _einsum_f32("bthr,hdr->bthd", o_lat, a["w_v"].astype(dtype), dtype).astype(dtype)
        return self.o_proj(o.reshape(b, t, h * c.v_head_dim))

    def __call__(self, x, cos, sin, mask, causal: bool = False):
        """x [B, T, D] (normed), cos/sin [B, T, dr/2], mask bool [B, T, T] -> [B, T, D]."""
        return self.attend(*self.project(x, cos, sin), mask, causal)


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: ``h += self_attn(input_layernorm(h)); h += mlp(post_attention_layernorm(h))``.
    ``mlp`` is :class:`MLP` for ``layer_idx < first_k_dense_replace``, else :class:`MoE`.
    ``__call__(h [B, T, D], cos, sin, mask) -> [B, T, D]`` in h.dtype."""

    def __init__(self, cfg: DeepseekConfig, layer_idx: int, *, quant: QuantConfig = QuantConfig(),
                 dtype=jnp.bfloat16, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.input_layernorm = RMSNorm(d, eps=cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = MLA(cfg, quant=quant, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(d, eps=cfg.rms_norm_eps, dtype=dtype)
        if cfg.is_moe_layer(layer_idx):
            self.mlp = MoE(cfg, quant=quant, dtype=dtype, rngs=rngs)
        else:
            self.mlp = MLP(d, cfg.intermediate_size, quant=quant.linear, dtype=dtype, ue8m0=quant.ue8m0, rngs=rngs)

    def __call__(self, h, cos, sin, mask, causal: bool = False):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, mask, causal)
        return h + self.mlp(self.post_attention_layernorm(h))
