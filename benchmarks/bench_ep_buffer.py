"""What expert parallelism's padded buffers cost one device's experts, measured on one GPU.

    python benchmarks/bench_ep_buffer.py [--devices 8] [--tokens 64 256 4096 16384] [--out DIR]

Under expert parallelism (``jax_w4a8.expert_parallel``) each of the ``n`` devices runs its E / n experts on a
buffer with room for every routed row: ``tokens x top_k`` rows under the "gather" dispatch (decode, up to 256
tokens), ``n`` chunks of ``ceil(tokens / n)`` tokens' slots under "all_to_all" (``ExpertParallel.buffer_rows``),
of which about ``tokens x top_k / n`` are real (uniform routing); the rest are padding past ``sum(group_sizes)``.
One R1 EP shard's experts (32 local experts, top-8, hidden 7168, experts of 2048; W4A8, UE8M0 activation scales,
unfused: gate+up GEMM, SiLU-mul quantizer, down GEMM, each in the activation layout its plan takes,
``tiling.grouped_gemm_layout``) are timed, in interleaved rounds, on:

* ``alone``: the real rows only (what one device with those rows per expert runs);
* ``buffer``: the real rows in the padded buffer, the GEMMs planning for the real rows (``rows_per_expert``, as
  the model's experts do since the sixty-fourth session);
* ``buffer_unhinted``: the same buffer, the GEMMs planning from the buffer (the model before).

``buffer - alone`` is what the padding costs (zero-filled GEMM outputs, the quantizer's passes over padding rows);
``buffer_unhinted - buffer`` what planning for the expected rows saves. Outputs of the real rows are compared.
``--small``: 4 experts and small shapes, a CPU smoke run.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common as C  # noqa: E402

E, TOP_K, HIDDEN, INTER = 32, 8, 7168, 2048


def _ep(n: int):
    """The model's default ExpertParallel over an ``n``-device expert axis (an abstract mesh: no devices needed)."""
    import jax  # noqa: PLC0415

    from jax_w4a8.expert_parallel import ExpertParallel  # noqa: PLC0415
    from jax_w4a8.sharding import EXPERT_AXIS  # noqa: PLC0415
    return ExpertParallel(jax.sharding.AbstractMesh((n,), (EXPERT_AXIS,)))


def buffer_rows(tokens: int, n: int, top_k: int) -> int:
    """ExpertParallel.buffer_rows with the default dispatch ("auto")."""
    return _ep(n).buffer_rows(tokens, top_k)


def run(devices, token_counts, experts=E, top_k=TOP_K, hidden=HIDDEN, inter=INTER):
    import jax
    import jax.numpy as jnp

    from jax_w4a8 import ops, quant, tiling

    rng = np.random.default_rng(0)
    key = jax.random.key(0)
    w13 = jax.random.randint(jax.random.fold_in(key, 1), (experts, 2 * inter, hidden // 2), -128, 128,
                             jnp.int32).astype(jnp.int8)
    s13 = jax.random.uniform(jax.random.fold_in(key, 2), (experts, 2 * inter, hidden // 128), jnp.float32, 5e-3, 1.5e-2)
    w2 = jax.random.randint(jax.random.fold_in(key, 3), (experts, hidden, inter // 2), -128, 128,
                            jnp.int32).astype(jnp.int8)
    s2 = jax.random.uniform(jax.random.fold_in(key, 4), (experts, hidden, inter // 128), jnp.float32, 5e-3, 1.5e-2)

    def experts_fn(x8, xs, sizes, w13, s13, w2, s2, hint):
        """Experts._w4a8's unfused chain on quantized rows (folded where the gate+up plan folds). The weights come
        as arguments: closed over, they would be compiled into every timed program as constants (hundreds of MB;
        the first H100 run spent minutes per case compiling)."""
        m = x8.shape[0]
        up = ops.w4a8_grouped_gemm(x8, xs, w13, s13, sizes, rows_per_expert=hint,
                                   x_layout="folded" if xs.ndim == 1 else "standard")
        layout = tiling.grouped_gemm_layout(m, experts, hidden, inter, rows_per_expert=hint)
        h8, hs = ops.silu_mul_quantize_fp8_groups(up, True, layout=layout)
        return ops.w4a8_grouped_gemm(h8, hs, w2, s2, sizes, rows_per_expert=hint, x_layout=layout)

    rows = []
    for tokens in token_counts:
        real = -(-tokens * top_k // devices)
        buf = buffer_rows(tokens, devices, top_k)
        sizes = jnp.asarray(rng.multinomial(real, np.ones(experts) / experts).astype(np.int32))
        x = jax.random.normal(jax.random.fold_in(key, tokens), (buf, hidden), jnp.bfloat16)
        x = jnp.where(jnp.arange(buf)[:, None] < real, x, 0)  # padding rows: zeros, as the exchange sends them
        x8, xs = quant.quantize_fp8_groups(x, ue8m0=True)
        cases = {"alone": (real, None), "buffer": (buf, real / experts), "buffer_unhinted": (buf, None)}
        fns, args_of, plans = {}, {}, {}
        for name, (m, hint) in cases.items():
            layout = tiling.grouped_gemm_layout(m, experts, 2 * inter, hidden, rows_per_expert=hint)
            a = (x8[:m], xs[:m]) if layout == "standard" else quant.fold_fp8_groups(x8[:m], xs[:m])
            fns[name] = jax.jit(functools.partial(experts_fn, hint=hint))
            args_of[name] = (*a, sizes, w13, s13, w2, s2)
            p = tiling.plan_grouped_gemm(m, experts, 2 * inter, hidden, rows_per_expert=hint)
            plans[name] = f"{p.kernel} t{p.tile_tokens}/s{p.split_k}/{p.mma}" + (" folded" if layout == "folded" else "")
        t = C.bench_alternating({name: (fns[name], [args_of[name]]) for name in cases})
        outs = {name: np.asarray(fns[name](*args_of[name])[:real].astype(jnp.float32)) for name in cases}
        ref = outs["alone"]
        r = dict(tokens=tokens, devices=devices, dispatch=_ep(devices).strategy(tokens), real_rows=real, buffer_rows=buf)
        for name in cases:
            r[f"{name}_us"] = t[name] * 1e6
            r[f"{name}_plan"] = plans[name]
            r[f"{name}_max_rel_diff"] = float(np.abs(outs[name] - ref).max() / max(np.abs(ref).max(), 1e-30))
        r["padding_cost_us"] = r["buffer_us"] - r["alone_us"]
        r["hint_saves_us"] = r["buffer_unhinted_us"] - r["buffer_us"]
        rows.append(r)
        print(" ".join(f"{k_}={v:.1f}" if isinstance(v, float) and not k_.endswith("diff") else f"{k_}={v}"
                       for k_, v in r.items()), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=8, help="the expert axis's size n (E / n = 32 local experts)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 256, 4096, 16384])
    ap.add_argument("--out", default=None, help="folder for ep_buffer.json")
    ap.add_argument("--small", action="store_true", help="4 experts, top-2, hidden 256, experts of 128 (CPU)")
    args = ap.parse_args()
    if args.small:
        rows = run(args.devices, args.tokens, experts=4, top_k=2, hidden=256, inter=128)
    else:
        rows = run(args.devices, args.tokens)
    if args.out:
        C.save_json(C.out_dir(args.out) / "ep_buffer.json",
                    dict(rows=rows, command="python benchmarks/bench_ep_buffer.py " + " ".join(sys.argv[1:])))


if __name__ == "__main__":
    main()
