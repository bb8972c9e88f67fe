"""One DeepSeek-R1 MoE layer (routed experts only) on one GPU vs expert-parallel over the visible GPUs.

    python benchmarks/bench_expert_parallel.py [--experts 256] [--out DIR]

Hidden 7168, experts of 2048 (W4A8, per-token-group fp8 activations), top-8 over random routing. As in
the model, the tokens are quantized once before dispatch, so e4m3 rows and their scales travel
(``--tokens bf16``: bf16 rows travel and the experts quantize them, as before the thirty-seventh session).
Decode (64 tokens, "gather" dispatch: psum of partial outputs) and prefill (4096 tokens, "all_to_all":
ragged all-to-all both ways). For each: time of the layer on one GPU, on the n-GPU mesh, and of the
same n-GPU layer with identity experts (the dispatch, collectives and combine alone); compute on the
mesh is the difference. Weights are made on the devices, sharded from the start.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common as C  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--inter", type=int, default=2048)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--out")
    p.add_argument("--tokens", choices=("fp8", "bf16"), default="fp8",
                   help="what the dispatch moves: quantized tokens (the model's way) or bf16 rows")
    p.add_argument("--tiny", action="store_true", help="small shapes on CPU devices (smoke test)")
    args = p.parse_args()

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jax_w4a8 import moe, ops, sharding
    from jax_w4a8.expert_parallel import ExpertParallel, moe_apply_ep

    e, d, i, k = args.experts, args.hidden, args.inter, args.top_k
    if args.tiny:  # a CPU smoke test of the script (8 virtual devices)
        e, d, i, k = 8, 256, 128, 2
    gpus = jax.devices("cpu") if args.tiny else jax.devices("gpu")
    n = len(gpus)
    mesh = sharding.make_mesh(n, gpus)
    single = sharding.make_mesh(1, gpus)

    def weights(mesh_):
        def make(key):
            ks = jax.random.split(key, 4)
            return {
                "w13": jax.random.randint(ks[0], (e, 2 * i, d // 2), -128, 128, jnp.int32).astype(jnp.int8),
                "s13": jax.random.uniform(ks[1], (e, 2 * i, d // 128), jnp.float32, 1e-3, 2e-3),
                "w2": jax.random.randint(ks[2], (e, d, i // 2), -128, 128, jnp.int32).astype(jnp.int8),
                "s2": jax.random.uniform(ks[3], (e, d, i // 128), jnp.float32, 1e-3, 2e-3),
            }
        shard = NamedSharding(mesh_, P(sharding.EXPERT_AXIS))
        return jax.jit(make, out_shardings={nm: shard for nm in ("w13", "s13", "w2", "s2")})(jax.random.key(0))

    def experts_for(expected_rows=None):
        """The experts; under EP (``expected_rows``: the rows a device expects, its buffer holding every routed
        row) the GEMMs plan for those, as the model's experts do (``rows_per_expert``)."""
        def experts_fn(prm, x, gs):
            hint = None if expected_rows is None else expected_rows / prm["w13"].shape[0]
            x8, xs = x if isinstance(x, tuple) else ops.quantize_fp8_groups(x)
            y = ops.w4a8_grouped_gemm(x8, xs, prm["w13"], prm["s13"], gs, rows_per_expert=hint)
            h8, hs = ops.silu_mul_quantize_fp8_groups(y)
            return ops.w4a8_grouped_gemm(h8, hs, prm["w2"], prm["s2"], gs, rows_per_expert=hint)
        return experts_fn

    def tokens_in(x):   # what moe_apply(_ep) dispatches
        return ops.quantize_fp8_groups(x) if args.tokens == "fp8" else x

    def identity(prm, xs, gs):
        return (xs[0] if isinstance(xs, tuple) else xs).astype(jnp.bfloat16)

    rows = []
    w_mesh = weights(mesh)
    w_one = weights(single)
    cases = (("decode", 64, "gather", "ragged"), ("prefill", 4096, "all_to_all", "ragged"),
             ("prefill", 4096, "all_to_all", "dense"))
    if args.tiny:
        cases = (("decode", 8, "gather", "ragged"), ("prefill", 64, "all_to_all", "ragged"),
                 ("prefill", 64, "all_to_all", "dense"))
    for name, tokens, dispatch, exchange in cases:
        key = jax.random.key(tokens)
        rep = NamedSharding(mesh, P())
        x = jax.device_put(jax.random.normal(key, (tokens, d), jnp.bfloat16), rep)
        ids = jax.device_put(jax.random.randint(jax.random.fold_in(key, 1), (tokens, k), 0, e, jnp.int32), rep)
        tw = jax.device_put(jax.random.uniform(jax.random.fold_in(key, 2), (tokens, k), jnp.float32), rep)
        ep = ExpertParallel(mesh, dispatch, exchange=exchange)
        experts_ep = experts_for(-(-tokens * k // n))
        f_mesh = jax.jit(lambda a, b, c, w: moe_apply_ep(tokens_in(a), b, c, w, experts_ep, e, ep))
        f_comm = jax.jit(lambda a, b, c, w: moe_apply_ep(tokens_in(a), b, c, w, identity, e, ep))
        one = NamedSharding(single, P())
        x1, ids1, tw1 = (jax.device_put(v, one) for v in (x, ids, tw))
        experts_one = experts_for()
        f_one = jax.jit(lambda a, b, c, w: moe.moe_apply(tokens_in(a), b, c, lambda xs, gs: experts_one(w, xs, gs), e))
        t_one = C.bench(f_one, [(x1, ids1, tw1, w_one)], n=5, rounds=5)
        t_mesh = C.bench(f_mesh, [(x, ids, tw, w_mesh)], n=5, rounds=5)
        t_comm = C.bench(f_comm, [(x, ids, tw, w_mesh)], n=5, rounds=5)
        err = float(jnp.abs(f_mesh(x, ids, tw, w_mesh).astype(jnp.float32) -
                            jax.device_put(f_one(x1, ids1, tw1, w_one), rep).astype(jnp.float32)).max())
        r = dict(case=name, tokens=tokens, moved=args.tokens, dispatch=dispatch if dispatch == "gather" else f"{dispatch}/{exchange}", gpus=n, one_gpu_us=t_one * 1e6, mesh_us=t_mesh * 1e6,
                 dispatch_collectives_us=t_comm * 1e6, compute_us=(t_mesh - t_comm) * 1e6, speedup=t_one / t_mesh,
                 max_abs_diff=err)
        rows.append(r)
        print({kk: (round(v, 1) if isinstance(v, float) else v) for kk, v in r.items()}, flush=True)
    out = C.out_dir(args.out)
    C.save_json(out / "expert_parallel.json", dict(rows=rows, experts=e, hidden=d, inter=i, top_k=k,
                                                   tokens=args.tokens))
    print(C.fmt_table([{kk: (f"{v:.1f}" if isinstance(v, float) else v) for kk, v in r.items()} for r in rows],
                      list(rows[0])))


if __name__ == "__main__":
    main()
