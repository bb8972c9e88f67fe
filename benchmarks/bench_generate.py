"""Prefill and decode of a DeepSeek-V3-width model: W4A8 vs bf16 (XLA ragged_dot, Pallas grouped GEMM).

    python benchmarks/bench_generate.py [--layers 3] [--out DIR] [--results]     # on one H200
    python benchmarks/bench_generate.py --tiny                                     # CPU smoke test
    python benchmarks/bench_generate.py --layers 2 --variants w4a8 --prefill --trace-steps 4
                                                         # + where a decode step's device time goes
    python benchmarks/bench_generate.py --layers 2 --variants w4a8 --prefill 4096 --batches --trace-prefill
    python benchmarks/bench_generate.py --layers 61 --variants w4a8 --expert-parallel 8 --batches 1 16 64 256
                                                         # R1-sized W4A8 model over 8 GPUs (issue #8)
    python benchmarks/bench_generate.py --layers 2 --variants w4a8 --moe-up unfused fused --prefill
                                                         # the routed up-projection unfused vs fused, same weights

The model has DeepSeek-V3's widths (vocab 129280, hidden 7168, 128 heads, q_lora 1536, kv_lora 512,
qk_nope 128, qk_rope 64, v_head 128, 256 routed experts of 2048 + 1 shared, top-8 of 8 groups / 4 kept,
YaRN as V3) and ``--layers`` decoder layers, all MoE (``--dense-layers`` makes the first ones dense).
Random weights are made on the device, tensor by tensor (never on the host), in three variants, one after
the other in the same process (each freed before the next is built, so the bf16 one fits):

* ``w4a8``: routed experts int4 (group 128) x fp8 activations (``ops.w4a8_grouped_gemm``), FP8 128x128
  blocks for every other linear (``ops.fp8_einsum``, also MLA's absorbed per-head products);
* ``bf16_ragged_dot``: everything bf16, experts on ``jax.lax.ragged_dot``;
* ``bf16_pallas``: the same bf16 model with its experts on JAX's Pallas Mosaic-GPU grouped GEMM
  (``jax.experimental.pallas.ops.gpu.ragged_dot_mgpu``, bf16 weights in [E, K, N], block_m 64, block_n 128,
  block_k 64, 4 concurrent steps, grid_block_n 1; GPU only).

Measured, through :class:`jax_w4a8.models.deepseek.generate.Generator` (the code ``generate()`` runs):

* prefill: one prompt of 1024 and of 4096 tokens (batch 1), tokens/s (median of a few calls);
* decode: one step at batch 1, 16 and 64 with a latent cache of ``--context`` filled slots, per-step latency
  (wall clock of a run of back-to-back steps, dispatched from Python as generate() does) and tokens/s.

With ``--trace-steps N``, N more decode steps per batch run under the JAX profiler (CUPTI; XLA's command
buffers kept on, as in the timed steps, unless ``--trace-op-by-op``) and a per-step breakdown of device 0 is
printed and kept in the JSON row: the time some kernel ran, first start to last end (the rest is
idle device time: launches, host dispatch), and per kernel family (``loop_add_fusion``, ``Fp8DecodeKernel``,
...) its kernels per step, their time and one kernel's median. ``--trace-prefill`` does the same for one
more prefill call per prompt length.

Prints a table; writes ``generate.json`` to ``--out`` (default ``$OUT``, else ``benchmarks/out``) after
every variant; ``--results`` also rewrites the ``generate`` section of benchmarks/RESULTS.md, and
``--report a.json b.json ...`` rewrites it from the JSON of several runs (one process per variant).

Seen on the H200 (2026-11-30, jax 0.11.2): one process per variant is the robust way. With three layers
in one process, the bf16 variants failed in XLA's autotuner (out of memory next to the 70 GB model); with
two layers XLA's ``ragged_dot`` prefill still asks its autotuner for 42 GiB (1024 tokens) and 112 GiB
(4096 tokens) and fails, while its decode runs. In an earlier session, compiling the Pallas variant in
the same process as the others crashed inside Mosaic GPU's LLVM lowering; run on its own it compiles.
On two GPUs, two variants can run at once: ``CUDA_VISIBLE_DEVICES=0 ... --variants w4a8 & CUDA_VISIBLE_DEVICES=1
... --variants bf16_ragged_dot``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common as C  # noqa: E402

PALLAS_CFG = dict(block_m=64, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1)
SECTION = "generate: prefill and decode, DeepSeek-V3 widths (W4A8 vs bf16)"


def v3_config(layers: int, dense: int, tiny: bool):
    from jax_w4a8.models.deepseek import DeepseekConfig

    d = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
             num_hidden_layers=layers, first_k_dense_replace=dense, num_attention_heads=128, num_key_value_heads=128,
             q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
             n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
             routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=163840, rope_theta=10000.0,
             rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                           "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
    if tiny:
        d.update(vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                 num_attention_heads=2, num_key_value_heads=2, q_lora_rank=128, kv_lora_rank=128,
                 n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, max_position_embeddings=4096,
                 rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 1024,
                               "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
    return DeepseekConfig.from_dict(d)


# ----------------------------------------------------------------------------------------------
# random weights on the device
# ----------------------------------------------------------------------------------------------
def _make_leaf(key, shape, dtype, kind: str, k_in: int):
    """One random variable (traced; runs on the device).

    Values: float matrices uniform with std 1/sqrt(K) (the embedding std 1); norm weights 1; the router bias
    N(0, 0.1); fp8 weights random finite e4m3 bit patterns with |w| < 2 (exponent bit 3 cleared) and
    scales 2/sqrt(K); packed int4 any byte, scales 1/(4.6 sqrt(K)). Timings do not depend on the values;
    routing over random router weights is near-uniform (as for a trained model on average).
    """
    import jax
    import jax.numpy as jnp

    if kind == "ones":
        return jnp.ones(shape, dtype)
    if kind == "bias":
        return (jax.random.normal(key, shape, jnp.float32) * 0.1).astype(dtype)
    if kind == "int4":                                    # packed int4 pairs: any byte is valid
        return jax.lax.bitcast_convert_type(jax.random.bits(key, shape, jnp.uint8), jnp.int8)
    if kind == "fp8":                                     # e4m3 bit patterns without exponent bit 3: no NaN
        bits = jax.random.bits(key, shape, jnp.uint8) & jnp.uint8(0xBF)
        return jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn)
    if kind == "scale_w4":                                # int4 in [-8, 7]: std ~4.6
        return jnp.full(shape, 1.0 / (4.6 * k_in ** 0.5), dtype)
    if kind == "scale_fp8":                               # |e4m3 w| < 2, rms ~0.5
        return jnp.full(shape, 2.0 / k_in ** 0.5, dtype)
    std = 1.0 if kind == "embed" else k_in ** -0.5
    u = jax.random.bits(key, shape, jnp.uint16).astype(jnp.float32) * (1.0 / 65536.0) - 0.5
    return (u * (std * 12 ** 0.5)).astype(dtype)


def _make_group_impl(key, specs):
    import jax

    return [_make_leaf(jax.random.fold_in(key, j), *spec) for j, spec in enumerate(specs)]


def _make_group(key, specs, shardings=None):
    """The variables ``specs`` ((shape, dtype, kind, K) each) in one jitted call, on the default device or
    made straight into ``shardings``; decoder layers of the same structure share one compilation (the key
    is an argument)."""
    import jax

    fn = _MAKE.get(shardings)
    if fn is None:
        fn = _MAKE[shardings] = jax.jit(_make_group_impl, static_argnums=1,
                                        out_shardings=None if shardings is None else list(shardings))
    return fn(key, specs)


_MAKE: dict = {}


def _spec(name, var, weights):
    import jax.numpy as jnp

    shape, dt = tuple(var.shape), jnp.dtype(var.dtype)
    if name.endswith("e_score_correction_bias"):
        return shape, dt, "bias", 0
    if len(shape) == 1:
        return shape, dt, "ones", 0
    if name.endswith("_scale_inv"):
        w = weights[name[:-len("_scale_inv")]]
        w4 = jnp.dtype(w.dtype) == jnp.int8
        return shape, dt, "scale_w4" if w4 else "scale_fp8", w.shape[-1] * (2 if w4 else 1)
    if dt == jnp.int8:
        return shape, dt, "int4", 0
    if dt == jnp.float8_e4m3fn:
        return shape, dt, "fp8", 0
    return shape, dt, "embed" if "embed_tokens" in name else "float", shape[-1]


def random_model(cfg, quant, dtype, mesh=None):
    """A DeepseekV3ForCausalLM with random weights made on the default device, or with ``mesh`` made on its
    devices already sharded (routed experts split over ``"expert"``, the rest replicated) and run expert-
    parallel: one jitted call per decoder layer (plus one for the embedding, final norm and lm_head),
    never a host array and never a whole model on one device."""
    import jax
    from flax import nnx

    from jax_w4a8.expert_parallel import ExpertParallel
    from jax_w4a8.models.deepseek import DeepseekV3ForCausalLM, parallel

    abstract = nnx.eval_shape(lambda: DeepseekV3ForCausalLM(cfg, quant=quant, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat_abs = list(nnx.to_flat_state(state))
    weights = {".".join(map(str, p)): v for p, v in flat_abs}
    groups: dict = {}
    for path, var in flat_abs:
        g = path[2] if len(path) > 2 and path[:2] == ("model", "layers") else -1
        groups.setdefault(g, []).append((path, var))
    flat = []
    for g, items in groups.items():
        specs = tuple(_spec(".".join(map(str, p)), v, weights) for p, v in items)
        shardings = None if mesh is None else tuple(
            parallel.placement(mesh, ".".join(map(str, p)), len(v.shape)) for p, v in items)
        arrays = _make_group(jax.random.fold_in(jax.random.key(0), g + 1), specs, shardings)
        flat += [(p, v.replace(a)) for (p, v), a in zip(items, arrays)]
        jax.block_until_ready(arrays)
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    if mesh is not None:
        parallel.check_divisible(cfg.n_routed_experts, mesh)
        parallel.set_expert_parallel(model, ExpertParallel(mesh))
    return model


class PallasExperts:
    """Drop-in ``experts_fn`` for :class:`layers.MoE`: bf16 [E, K, N] weights on the Pallas grouped GEMM."""

    def __init__(self, w13, w2, inter: int):
        self.w13, self.w2, self.inter = w13, w2, inter          # [E, D, 2I], [E, I, D] bf16

    def __call__(self, x_sorted, group_sizes):
        import jax.numpy as jnp
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu as pm

        from jax_w4a8.models.deepseek import layers

        x = x_sorted.astype(jnp.bfloat16)
        gu = pm.ragged_dot(x, self.w13, group_sizes=group_sizes, **PALLAS_CFG)
        h = layers.silu_mul(gu[:, :self.inter], gu[:, self.inter:], jnp.bfloat16)
        return pm.ragged_dot(h, self.w2, group_sizes=group_sizes, **PALLAS_CFG)


def to_pallas_experts(model):
    """Replaces every MoE layer's bf16 experts by :class:`PallasExperts` (new random [E, K, N] weights; the
    [E, N, K] ones are freed first). The module becomes an nnx.Module attribute holding nnx.Params."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jax_w4a8.models.deepseek import layers

    class _PallasModule(nnx.Module):
        def __init__(self, w13, w2, inter):
            self.w13, self.w2, self.inter = nnx.Param(w13), nnx.Param(w2), inter

        def __call__(self, x_sorted, group_sizes):
            return PallasExperts(self.w13[...], self.w2[...], self.inter)(x_sorted, group_sizes)

    for i, layer in enumerate(model.model.layers):
        if not isinstance(layer.mlp, layers.MoE):
            continue
        ex = layer.mlp.experts
        e, d, inter = ex.num_experts, ex.hidden, ex.inter
        for v in (ex.gate_up_proj, ex.down_proj):
            v[...].delete()
        w13, w2 = _make_group(jax.random.key(1000 + i), (((e, d, 2 * inter), jnp.dtype(jnp.bfloat16), "float", d),
                                                          ((e, inter, d), jnp.dtype(jnp.bfloat16), "float", inter)))
        layer.mlp.experts = _PallasModule(w13, w2, inter)
    return model


# ----------------------------------------------------------------------------------------------
# measurements
# ----------------------------------------------------------------------------------------------
def bench_prefill(gen, cfg, t: int, reps: int, trace: bool = False):
    """(median seconds, first call's seconds, trace): ``trace`` is None, or the :func:`_common.kernel_breakdown`
    of one more prefill run under the JAX profiler (device 0), or the error that tracing raised."""
    import jax
    import jax.numpy as jnp

    mode, sampling, key = gen.mode(), gen.sampling(), jax.random.key(0)
    ids = jax.random.randint(jax.random.key(t), (1, t), 2, cfg.vocab_size, jnp.int32)

    def once():
        cache = gen.init_cache(1, t)
        t0 = time.perf_counter()
        cache, state = gen.prefill(ids, cache, mode, key, sampling)
        jax.block_until_ready(state.tokens)
        return time.perf_counter() - t0

    t_first = once()                                     # compile
    times = [once() for _ in range(reps)]
    breakdown = None
    if trace:
        cache = gen.init_cache(1, t)
        breakdown = _trace_breakdown(lambda: gen.prefill(ids, cache, mode, key, sampling)[1].tokens)
    return statistics.median(times), t_first, breakdown


def decode_inputs(gen, cfg, batch: int, context: int, cache_len: int):
    """(MLACache, DecodeState) for decode steps: per layer a random latent cache [batch, cache_len, kv_lora_rank +
    qk_rope_head_dim] in ``gen.cache_dtype`` with ``context`` slots filled, and random next tokens."""
    import jax
    import jax.numpy as jnp

    from jax_w4a8.models.deepseek.generate import DecodeState, MLACache

    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    mk = jax.jit(lambda k: jax.random.normal(k, (batch, cache_len, width), jnp.float32).astype(gen.cache_dtype))
    kv = tuple(mk(jax.random.key(100 + i)) for i in range(cfg.num_hidden_layers))
    cache = MLACache(kv, jnp.zeros((batch,), jnp.int32), jnp.asarray(context, jnp.int32))
    state = DecodeState(jax.random.randint(jax.random.key(batch), (batch,), 2, cfg.vocab_size, jnp.int32),
                        jnp.ones((batch,), bool), jnp.zeros((batch,), bool), jnp.full((batch,), -1, jnp.int32),
                        jnp.asarray(0, jnp.int32))
    return cache, state


def _trace_breakdown(thunk, repeats=1):
    """:func:`_common.kernel_breakdown` of ``thunk()`` traced on device 0, per repeat, or the error tracing raised
    (a failed trace keeps the timing)."""
    try:
        return C.kernel_breakdown(C.trace_kernels(thunk, device=0), repeats)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {str(exc)[:200]}"


def bench_decode(gen, cfg, batch: int, context: int, steps: int, trace_steps: int = 0):
    """(seconds per step, warm-up seconds, trace): ``trace`` is None, or with ``trace_steps`` the
    :func:`_common.kernel_breakdown` of that many more steps run under the JAX profiler (per step, device 0),
    or the error that tracing raised."""
    import jax

    mode, sampling, key = gen.mode(), gen.sampling(), jax.random.key(0)
    # room for the warm-up, timed and traced steps after the context
    cache, state = decode_inputs(gen, cfg, batch, context, context + steps + 8 + trace_steps)
    t0 = time.perf_counter()
    for _ in range(3):                                   # compile + warm up
        cache, state = gen.decode(cache, state, mode, key, sampling)
    jax.block_until_ready(state.tokens)
    t_warm = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(steps):
        cache, state = gen.decode(cache, state, mode, key, sampling)
    jax.block_until_ready(state.tokens)
    dt = (time.perf_counter() - t0) / steps
    trace = None
    if trace_steps:
        def run():
            nonlocal cache, state
            for _ in range(trace_steps):
                cache, state = gen.decode(cache, state, mode, key, sampling)
            return state.tokens

        trace = _trace_breakdown(run, trace_steps)
    del cache
    return dt, t_warm, trace


def _report_trace(row, label, step_us, trace):
    """Prints a phase's trace (or why it failed) and keeps its top 20 kernel families in the JSON row."""
    if isinstance(trace, str):
        print(f"  {label}: trace failed: {trace}", flush=True)
        row["trace"] = dict(error=trace)
    elif trace is not None:
        print_breakdown(label, step_us, trace)
        kernels, busy, span = trace
        row["trace"] = dict(busy_us=round(busy, 1), span_us=round(span, 1),
                            kernels=[{k: round(v, 2) if isinstance(v, float) else v for k, v in t.items()}
                                     for t in kernels[:20]])


def print_breakdown(label, step_us, trace, top=14):
    """A traced prefill call's or decode step's kernel breakdown (:func:`_trace_breakdown`), as a few lines."""
    rows, busy, span = trace
    if not rows:
        print(f"  {label}: no device kernel events in the trace (a CPU run, or a profiler without CUPTI)", flush=True)
        return
    print(f"  {label}: {step_us:.1f} us per call (timed run); traced: kernels busy {busy:.1f} us per call, "
          f"first start to last end {span:.1f} us, {sum(r['count'] for r in rows):.0f} kernels per call", flush=True)
    for r in rows[:top]:
        print(f"    {r['us']:8.1f} us {100 * r['us'] / busy:5.1f}%  {r['count']:6.1f} x {r['median_us']:7.2f} us  "
              f"{r['family'][:70]}", flush=True)


def run_variant(name, model, cfg, args, rows):
    import gc

    from jax_w4a8.models.deepseek.generate import Generator

    # packages from before set_attention (7a90c83 and older) had only eager attention: --attention eager skips the call
    gen = Generator(model if args.attention == "eager" and not hasattr(model, "set_attention")
                    else model.set_attention(args.attention))
    for t in args.prefill:
        try:
            s, first, trace = bench_prefill(gen, cfg, t, args.prefill_reps, args.trace_prefill)
            r = dict(model=name, phase="prefill", batch=1, tokens=t, ms=round(s * 1e3, 2),
                     tokens_per_s=round(t / s, 1), compile_s=round(first - s, 1))
        except Exception as exc:  # noqa: BLE001 - report and go on (e.g. out of memory)
            r, trace = dict(model=name, phase="prefill", batch=1, tokens=t,
                            error=f"{type(exc).__name__}: {str(exc)[:200]}"), None
        rows.append(r)
        print(C.fmt_table([r], list(r)), flush=True)
        _report_trace(r, f"{name} prefill {t}", s * 1e6 if "ms" in r else 0.0, trace)
        gc.collect()
    for b in args.batches:
        try:
            s, warm, trace = bench_decode(gen, cfg, b, args.context, args.steps, args.trace_steps)
            r = dict(model=name, phase="decode", batch=b, tokens=args.context, ms=round(s * 1e3, 3),
                     tokens_per_s=round(b / s, 1), compile_s=round(warm - 3 * s, 1))
        except Exception as exc:  # noqa: BLE001
            r, trace = dict(model=name, phase="decode", batch=b, tokens=args.context,
                            error=f"{type(exc).__name__}: {str(exc)[:200]}"), None
        rows.append(r)
        print(C.fmt_table([r], list(r)), flush=True)
        _report_trace(r, f"{name} decode batch {b}", s * 1e6 if "ms" in r else 0.0, trace)
        gc.collect()
    del gen


def _free(model):
    import jax
    from flax import nnx

    for leaf in jax.tree.leaves(nnx.state(model)):
        if hasattr(leaf, "delete") and not leaf.is_deleted():
            leaf.delete()


def _command(a) -> str:
    parts = [f"--layers {a['layers']}", "--variants " + " ".join(a["variants"])]
    if a.get("expert_parallel", 1) > 1:
        parts.append(f"--expert-parallel {a['expert_parallel']}")
    if a.get("prefill") != [1024, 4096]:
        parts.append("--prefill " + " ".join(map(str, a.get("prefill") or [])))
    if a.get("batches") != [1, 16, 64]:
        parts.append("--batches " + " ".join(map(str, a.get("batches") or [])))
    return "python benchmarks/bench_generate.py " + " ".join(parts)


def report(payloads):
    """Merges the rows of several runs (same model config) into the RESULTS.md section."""
    cfgs = {json.dumps(p["config"], sort_keys=True) for p in payloads}
    if len(cfgs) != 1:
        raise SystemExit("--report: the runs used different model configs")
    rows = [r for p in payloads for r in p["rows"]]
    summary = summarize(rows)
    cols = []
    for s in summary:
        cols += [c for c in s if c not in cols]
    first = payloads[0]
    cfg = first["config"]
    errors = sorted({(r["model"], r["phase"], r["error"].split("\n")[0][:120]) for r in rows if "error" in r})
    body = (f"Measured {first.get('date')} on {first.get('device')} (jax {first.get('jax')}), one process per "
            f"run: " + "; ".join(f"`{_command(p['args'])}`" for p in payloads) + ". DeepSeek-V3 widths, "
            f"{cfg['num_hidden_layers']} MoE layers (256 experts of 2048, top-8), random weights; prefill at "
            f"batch 1, decode with {first['args']['context']} cached tokens, {first['args']['steps']} timed steps "
            f"dispatched from Python as generate() does. Pallas: {json.dumps(first.get('pallas', PALLAS_CFG))}."
            "\n\n" + C.md_table(summary, cols) + "\n")
    if errors:
        body += "\nFailed cells:\n" + "".join(f"* {m} {ph}: {e}\n" for m, ph, e in errors)
    C.update_results_section(SECTION, body)
    print(C.fmt_table(summary, cols))
    return 0


def summarize(rows):
    """Per phase and size: each model's tokens/s and W4A8's speed-up over the faster bf16 variant."""
    out = []
    keys = sorted({(r["phase"], r["batch"], r["tokens"]) for r in rows}, key=lambda k: (k[0] != "prefill", k[1], k[2]))
    for phase, b, t in keys:
        got = {r["model"]: r for r in rows if (r["phase"], r["batch"], r["tokens"]) == (phase, b, t)}
        s = dict(phase=phase, batch=b, tokens=t)
        for m, r in got.items():
            s[f"{m} tok/s"] = r.get("tokens_per_s", "error")
            if phase == "decode" and "ms" in r:
                s[f"{m} ms/step"] = r["ms"]
        bf = [r["tokens_per_s"] for m, r in got.items() if m.startswith("bf16") and "tokens_per_s" in r]
        w4 = [r["tokens_per_s"] for m, r in got.items() if m.startswith("w4a8") and "tokens_per_s" in r]
        if bf and len(w4) == 1:
            s["w4a8 / best bf16"] = f"{w4[0] / max(bf):.2f}x"
        out.append(s)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=3, help="decoder layers (default 3: bf16 ~70 GB)")
    p.add_argument("--dense-layers", type=int, default=0, help="first_k_dense_replace (default 0: all MoE)")
    p.add_argument("--prefill", type=int, nargs="*", default=[1024, 4096], help="prompt lengths")
    p.add_argument("--prefill-reps", type=int, default=3)
    p.add_argument("--batches", type=int, nargs="*", default=[1, 16, 64], help="decode batch sizes")
    p.add_argument("--context", type=int, default=1024, help="filled cache slots during decode")
    p.add_argument("--steps", type=int, default=16, help="timed decode steps")
    p.add_argument("--trace-steps", type=int, default=0, metavar="N",
                   help="after timing, trace N more decode steps (JAX profiler) and print where a step's device "
                        "time goes, by kernel family")
    p.add_argument("--trace-prefill", action="store_true",
                   help="after timing each prefill, trace one more and print where its device time goes")
    p.add_argument("--trace-op-by-op", action="store_true",
                   help="with --trace-steps / --trace-prefill: let XLA run its command buffers op by op while "
                        "profiling (its default)")
    p.add_argument("--variants", nargs="*", default=["w4a8", "bf16_ragged_dot", "bf16_pallas"])
    p.add_argument("--attention", choices=("eager", "cudnn", "auto"), default="auto",
                   help="prefill attention of every variant (DeepseekV3ForCausalLM.set_attention; default auto, "
                        "the model's)")
    p.add_argument("--moe-up", nargs="+", choices=("unfused", "fused", "auto"), default=["auto"],
                   help="the w4a8 variant's routed up-projection (DeepseekV3ForCausalLM.set_moe_up; default auto, "
                        "the model's), one run per name on the same weights, e.g. --moe-up unfused fused (with "
                        "float32 activation scales, or UE8M0 ones with --ue8m0); rows of a setting other than auto "
                        "are named w4a8-SETTING-up (before the fifty-seventh session plain w4a8 rows were unfused)")
    p.add_argument("--ue8m0", action="store_true",
                   help="the w4a8 variant with UE8M0 (power-of-two) activation scales, QuantConfig.w4a8(ue8m0=True)")
    p.add_argument("--tiny", action="store_true", help="small widths, CPU smoke test")
    p.add_argument("--expert-parallel", type=int, default=1, metavar="N",
                   help="split the routed experts over the first N devices (weights made sharded; w4a8 only)")
    p.add_argument("--out")
    p.add_argument("--results", action="store_true", help="rewrite the section in benchmarks/RESULTS.md")
    p.add_argument("--report", nargs="+", metavar="JSON",
                   help="rewrite the RESULTS.md section from generate.json files of separate runs, then exit")
    args = p.parse_args(argv)
    if args.report:
        return report([json.loads(pathlib.Path(f).read_text()) for f in args.report])
    if (args.trace_steps or args.trace_prefill) and not args.trace_op_by_op:
        C.keep_command_buffers_while_profiling()  # before the backend starts

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jax_w4a8.models.deepseek import QuantConfig

    print(f"prefill attention: {args.attention}", flush=True)
    if args.tiny:
        args.layers = min(args.layers, 2)
        args.prefill = [16, 64][:len(args.prefill)]
        args.batches = [min(b, 4) for b in args.batches][:2] or [1]
        args.context, args.steps, args.prefill_reps = min(args.context, 32), min(args.steps, 3), 1
    cfg = v3_config(args.layers, args.dense_layers, args.tiny)
    on_gpu = jax.default_backend() == "gpu"
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; {cfg.num_hidden_layers} layers "
          f"({cfg.num_hidden_layers - cfg.first_k_dense_replace} MoE), hidden {cfg.hidden_size}, "
          f"{cfg.n_routed_experts} experts of {cfg.moe_intermediate_size}, top-{cfg.num_experts_per_tok}", flush=True)
    rows = []
    t_start = time.perf_counter()
    out = C.out_dir(args.out)

    def save_partial():  # after every variant: a later crash (see the module docstring) keeps these rows
        C.save_json(out / "generate.json", dict(config=cfg.to_dict(), args=dict(vars(args)), rows=rows,
                                                partial=True, pallas=PALLAS_CFG))

    variants = [v for v in args.variants if v != "bf16_pallas" or on_gpu]
    if "bf16_pallas" in args.variants and not on_gpu:
        print("bf16_pallas skipped: the Pallas Mosaic-GPU kernel needs a GPU", flush=True)
    mesh, tag = None, ""
    if args.expert_parallel > 1:
        from jax_w4a8 import sharding

        mesh, tag = sharding.make_mesh(args.expert_parallel), f"@ep{args.expert_parallel}"
        if "bf16_pallas" in variants:
            raise SystemExit("--expert-parallel: the bf16_pallas variant runs on one device only")
    if "w4a8" in variants:
        t0 = time.perf_counter()
        model = random_model(cfg, QuantConfig.w4a8(ue8m0=args.ue8m0), jnp.bfloat16, mesh)
        jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
        print(f"w4a8 model{' (UE8M0 activation scales)' if args.ue8m0 else ''} made in {time.perf_counter() - t0:.1f} s",
              flush=True)
        for impl in args.moe_up:  # the same weights under each implementation, in this one process
            if impl != "auto" or len(args.moe_up) > 1:  # (packages from before set_moe_up: its default alone)
                model.set_moe_up(impl)
            name = "w4a8" + ("-ue8m0" if args.ue8m0 else "") + ("" if impl == "auto" else f"-{impl}-up")
            run_variant(name + tag, model, cfg, args, rows)
            save_partial()
        _free(model)
        del model
    if "bf16_ragged_dot" in variants or "bf16_pallas" in variants:
        t0 = time.perf_counter()
        model = random_model(cfg, QuantConfig(), jnp.bfloat16, mesh)
        jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
        print(f"bf16 model made in {time.perf_counter() - t0:.1f} s", flush=True)
        if "bf16_ragged_dot" in variants:
            run_variant("bf16_ragged_dot" + tag, model, cfg, args, rows)
            save_partial()
        if "bf16_pallas" in variants:
            to_pallas_experts(model)
            run_variant("bf16_pallas", model, cfg, args, rows)
        _free(model)
        del model
    total = time.perf_counter() - t_start
    summary = summarize(rows)
    cols = []
    for s in summary:
        cols += [c for c in s if c not in cols]
    print("\n" + C.fmt_table(summary, cols))
    print(f"\ntotal {total:.0f} s")
    payload = dict(config=cfg.to_dict(), args={k: v for k, v in vars(args).items()}, rows=rows, summary=summary,
                   total_s=total, pallas=PALLAS_CFG)
    C.save_json(out / "generate.json", payload)
    print(f"wrote {out / 'generate.json'}")
    if args.results and not args.tiny:
        body = (f"Measured {time.strftime('%Y-%m-%d')} on {jax.devices()[0].device_kind} (jax {jax.__version__}), "
                f"`python benchmarks/bench_generate.py --layers {args.layers}`: DeepSeek-V3 widths, "
                f"{cfg.num_hidden_layers} MoE layers, random weights; prefill at batch 1, decode with "
                f"{args.context} cached tokens, {args.steps} timed steps dispatched from Python. "
                f"Pallas: {json.dumps(PALLAS_CFG)}.\n\n" + C.md_table(summary, cols) + "\n")
        C.update_results_section(SECTION, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
