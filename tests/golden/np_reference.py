#!/usr/bin/env python
"""Independent float64 NumPy re-implementation of transformers' DeepseekV3ForCausalLM forward pass.

Written from SEMANTICS.md (not from the torch code) and used to check that document: it reads a fixture
directory (config.json in either key style, model.safetensors in either expert layout) and must reproduce
expected.npz `logits` / `full_logits` / router choices.  Needs only numpy + safetensors (no torch).

    python tests/golden/np_reference.py               # all fixtures next to this file
    python tests/golden/np_reference.py yarn_qlora    # one fixture

RoPE is applied the way the *official* DeepSeek code does it (complex rotation of adjacent pairs) when
rope_interleave is true; transformers de-interleaves instead -- the logits agree because q and k are
permuted identically (see SEMANTICS.md section 4).
"""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
from safetensors.numpy import load_file

HERE = os.path.dirname(os.path.abspath(__file__))


# ----------------------------------------------------------------------------- config
def resolve_config(cfg: dict) -> dict:
    c = dict(cfg)
    # rope: legacy `rope_scaling` wins over `rope_parameters`; rope_theta may live outside (legacy) or inside.
    rp = dict(c.get("rope_scaling") or c.get("rope_parameters") or {})
    rp.setdefault("rope_theta", c.get("rope_theta", 10000.0))
    rp.setdefault("rope_type", rp.get("type", "default"))
    if rp["rope_type"] in ("yarn", "llama3", "longrope"):
        rp.setdefault("original_max_position_embeddings", c["max_position_embeddings"])
    c["rope"] = rp
    c.setdefault("rope_interleave", True)
    c.setdefault("norm_topk_prob", True)
    c.setdefault("routed_scaling_factor", 2.5)
    c.setdefault("rms_norm_eps", 1e-6)
    c.setdefault("q_lora_rank", 1536)
    # derived, whatever config.json says:
    c["qk_head_dim"] = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    c["rope_dim"] = c["qk_rope_head_dim"]  # == transformers' config.head_dim
    return c


def yarn_get_mscale(scale, mscale=1.0):
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_tables(c):
    """inv_freq [d/2] (float32 as in HF), attention_scaling (cos/sin multiplier), softmax scale."""
    rp, d = c["rope"], c["rope_dim"]
    base = float(rp["rope_theta"])
    pos_freqs = base ** (np.arange(0, d, 2).astype(np.float32) / np.float32(d))  # float32 like torch
    attn_scaling = 1.0
    if rp["rope_type"] == "default":
        inv_freq = (1.0 / pos_freqs).astype(np.float32)
    elif rp["rope_type"] == "yarn":
        factor = rp.get("factor") or c["max_position_embeddings"] / rp["original_max_position_embeddings"]
        af = rp.get("attention_factor")
        ms, msa = rp.get("mscale"), rp.get("mscale_all_dim")
        if af is None:
            af = yarn_get_mscale(factor, ms) / yarn_get_mscale(factor, msa) if (ms and msa) else yarn_get_mscale(factor)
        attn_scaling = float(af)
        beta_fast = rp.get("beta_fast") or 32
        beta_slow = rp.get("beta_slow") or 1
        L = rp["original_max_position_embeddings"]

        def corr_dim(rot):
            return (d * math.log(L / (rot * 2 * math.pi))) / (2 * math.log(base))

        low, high = corr_dim(beta_fast), corr_dim(beta_slow)
        if rp.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(d // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
        extra = (1 - ramp).astype(np.float32)
        inv_extra = (1.0 / pos_freqs).astype(np.float32)
        inv_inter = (1.0 / (np.float32(factor) * pos_freqs)).astype(np.float32)
        inv_freq = (inv_inter * (1 - extra) + inv_extra * extra).astype(np.float32)
    else:
        raise NotImplementedError(rp["rope_type"])
    scale = c["qk_head_dim"] ** -0.5
    if rp["rope_type"] != "default" and rp.get("mscale_all_dim", 0):
        m = yarn_get_mscale(rp["factor"], rp["mscale_all_dim"])
        scale = scale * m * m
    return inv_freq, attn_scaling, scale


# ----------------------------------------------------------------------------- weights
def load_weights(path, c):
    w = {k: v.astype(np.float64) for k, v in load_file(path).items()}
    E = c["n_routed_experts"]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts."
        if p + "gate_up_proj" in w:  # transformers-5 fused: [E, 2I, D] gate rows first; down [E, D, I]
            gu = w.pop(p + "gate_up_proj")
            I = gu.shape[1] // 2
            w[p + "gate"], w[p + "up"], w[p + "down"] = gu[:, :I], gu[:, I:], w.pop(p + "down_proj")
        elif p + "0.gate_proj.weight" in w:  # hub per-expert [out, in]
            w[p + "gate"] = np.stack([w.pop(f"{p}{j}.gate_proj.weight") for j in range(E)])
            w[p + "up"] = np.stack([w.pop(f"{p}{j}.up_proj.weight") for j in range(E)])
            w[p + "down"] = np.stack([w.pop(f"{p}{j}.down_proj.weight") for j in range(E)])
    return w


# ----------------------------------------------------------------------------- model
def rmsnorm(x, weight, eps):
    return weight * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def silu(x):
    return x / (1.0 + np.exp(-x))


def rope(x, cos, sin, interleave):
    """x [..., T, d]; cos/sin [T, d/2] (already multiplied by attention_scaling)."""
    if interleave:  # official DeepSeek: complex rotation of adjacent pairs (x0,x1),(x2,x3),...
        z = x[..., 0::2] + 1j * x[..., 1::2]
        z = z * (cos + 1j * sin)
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = z.real, z.imag
        return out
    h = x.shape[-1] // 2  # rotate_half on the raw layout: pairs (x_i, x_{i+d/2})
    x1, x2 = x[..., :h], x[..., h:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def router(c, w, pre, x):
    E, G, TG, K = c["n_routed_experts"], c["n_group"], c["topk_group"], c["num_experts_per_tok"]
    s = 1.0 / (1.0 + np.exp(-(x @ w[pre + "gate.weight"].T)))  # [N, E]
    choice = s + w[pre + "gate.e_score_correction_bias"]
    grp = np.sort(choice.reshape(-1, G, E // G), axis=-1)[..., -2:].sum(-1)  # sum of top-2 per group
    keep_g = np.argsort(-grp, axis=-1, kind="stable")[:, :TG]
    gmask = np.zeros_like(grp, dtype=bool)
    np.put_along_axis(gmask, keep_g, True, axis=-1)
    masked = np.where(np.repeat(gmask, E // G, axis=-1), choice, -np.inf)
    idx = np.sort(np.argsort(-masked, axis=-1, kind="stable")[:, :K], axis=-1)
    wts = np.take_along_axis(s, idx, axis=-1)
    if c["norm_topk_prob"]:
        wts = wts / (wts.sum(-1, keepdims=True) + 1e-20)
    return idx, wts * c["routed_scaling_factor"]


def forward(c, w, ids, record=None):
    B, T = ids.shape
    H, dn, dr, dv, R = (c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"],
                        c["v_head_dim"], c["kv_lora_rank"])
    eps = c["rms_norm_eps"]
    inv_freq, attn_scaling, scale = rope_tables(c)
    ang = np.arange(T, dtype=np.float32)[:, None] * inv_freq[None, :]  # fp32 angles like HF
    cos, sin = np.cos(ang).astype(np.float64) * attn_scaling, np.sin(ang).astype(np.float64) * attn_scaling
    causal = np.triu(np.full((T, T), -np.inf), 1)

    h = w["model.embed_tokens.weight"][ids]  # [B, T, D]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        x = rmsnorm(h, w[p + "input_layernorm.weight"], eps)
        if c["q_lora_rank"] is None:
            q = x @ w[a + "q_proj.weight"].T
        else:
            q = rmsnorm(x @ w[a + "q_a_proj.weight"].T, w[a + "q_a_layernorm.weight"], 1e-6) @ w[a + "q_b_proj.weight"].T
        q = q.reshape(B, T, H, dn + dr).transpose(0, 2, 1, 3)  # [B, H, T, dn+dr]
        q_nope, q_pe = q[..., :dn], q[..., dn:]
        ckv = x @ w[a + "kv_a_proj_with_mqa.weight"].T  # [B, T, R + dr]
        c_kv = rmsnorm(ckv[..., :R], w[a + "kv_a_layernorm.weight"], 1e-6)
        k_pe = ckv[..., R:][:, None]  # [B, 1, T, dr], one head shared by all heads
        q_pe = rope(q_pe, cos, sin, c["rope_interleave"])
        k_pe = rope(k_pe, cos, sin, c["rope_interleave"])
        kv = (c_kv @ w[a + "kv_b_proj.weight"].T).reshape(B, T, H, dn + dv).transpose(0, 2, 1, 3)
        k_nope, v = kv[..., :dn], kv[..., dn:]
        scores = (q_nope @ k_nope.transpose(0, 1, 3, 2) + q_pe @ k_pe.transpose(0, 1, 3, 2)) * scale + causal
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        probs = scores / scores.sum(-1, keepdims=True)
        o = (probs @ v).transpose(0, 2, 1, 3).reshape(B, T, H * dv)
        attn = o @ w[a + "o_proj.weight"].T
        if record is not None:
            record[("attn", i)] = attn
        h = h + attn

        x = rmsnorm(h, w[p + "post_attention_layernorm.weight"], eps)
        m = p + "mlp."
        if i < c["first_k_dense_replace"]:
            y = (silu(x @ w[m + "gate_proj.weight"].T) * (x @ w[m + "up_proj.weight"].T)) @ w[m + "down_proj.weight"].T
        else:
            xf = x.reshape(B * T, -1)
            idx, wts = router(c, w, m, xf)
            if record is not None:
                record[("router", i)] = (idx, wts)
            y = np.zeros_like(xf)
            e = m + "experts."
            for n in range(B * T):
                for j, wt in zip(idx[n], wts[n]):
                    g = silu(w[e + "gate"][j] @ xf[n]) * (w[e + "up"][j] @ xf[n])
                    y[n] += wt * (w[e + "down"][j] @ g)
            s = m + "shared_experts."
            y = y + (silu(xf @ w[s + "gate_proj.weight"].T) * (xf @ w[s + "up_proj.weight"].T)) @ w[s + "down_proj.weight"].T
            y = y.reshape(B, T, -1)
        h = h + y
        if record is not None:
            record[("layer", i)] = h
    h = rmsnorm(h, w["model.norm.weight"], eps)
    return h @ w["lm_head.weight"].T


def check(name) -> bool:
    d = os.path.join(HERE, name)
    with open(os.path.join(d, "config.json")) as f:
        c = resolve_config(json.load(f))
    w = load_weights(os.path.join(d, "model.safetensors"), c)
    exp = np.load(os.path.join(d, "expected.npz"))
    rec = {}
    logits = forward(c, w, exp["input_ids"].astype(np.int64), rec)
    rel = np.linalg.norm(logits - exp["logits"]) / np.linalg.norm(exp["logits"])
    full = forward(c, w, exp["full_input_ids"].astype(np.int64))
    rel_full = np.linalg.norm(full - exp["full_logits"]) / np.linalg.norm(exp["full_logits"])
    T = exp["input_ids"].shape[1]
    greedy_ok = np.array_equal(full[:, T - 1:-1].argmax(-1), exp["greedy_tokens"])
    routers = [k[1] for k in rec if k[0] == "router"]
    route_ok = all(np.array_equal(rec["router", i][0], exp[f"topk_idx_layer{i}"]) for i in routers)
    w_rel = max(np.abs(rec["router", i][1] - exp[f"topk_weight_layer{i}"]).max() for i in routers)
    nl = c["num_hidden_layers"]

    def rel_of(a, b):
        return np.linalg.norm(a - b) / np.linalg.norm(b)

    act_rel = max(max(rel_of(rec["attn", i], exp["attn_out"][i]), rel_of(rec["layer", i], exp["layer_out"][i]))
                  for i in range(nl))
    inv_freq, attn_scaling, scale = rope_tables(c)
    rope_ok = np.allclose(inv_freq, exp["rope_inv_freq"], rtol=1e-6, atol=0) and np.isclose(attn_scaling, exp["rope_attention_scaling"]) \
        and np.isclose(scale, exp["softmax_scale"])
    ok = rel < 1e-5 and rel_full < 1e-5 and greedy_ok and route_ok and w_rel < 1e-5 and rope_ok and act_rel < 1e-5
    print(f"{name:28s} logits rel {rel:.2e}  full rel {rel_full:.2e}  greedy {greedy_ok}  routing {route_ok}  "
          f"router-weight maxabs {w_rel:.1e}  attn/layer outs rel {act_rel:.1e}  rope tables {rope_ok}  -> {'OK' if ok else 'FAIL'}")
    return ok


if __name__ == "__main__":
    names = sys.argv[1:] or [e["name"] for e in json.load(open(os.path.join(HERE, "manifest.json")))["fixtures"]]
    sys.exit(0 if all([check(n) for n in names]) else 1)
