"""What one compiled decode step of the DeepSeek model is made of: this library's custom calls by target, per
layer, before and after XLA's optimizations (CSE merges identical calls), and the compiled step's fusions.

    python benchmarks/step_inventory.py                 # 2 layers, small widths (seconds, CPU or GPU)
    python benchmarks/step_inventory.py --v3 --layers 1 # DeepSeek-V3 widths (weights made on the device)

Every custom call is a node of XLA's command buffer of its own (a child graph: see benchmarks/NOTEBOOK.md,
thirty-sixth session), so their number per layer is what fusing ops reduces: 20 per layer before the
thirty-seventh session, 17 since (one einsum for q_a and kv_a and one for a shared expert's gate and up, the
SiLU product fused into the down projections' quantizer, the MoE tokens quantized once; the list is in
``jax_w4a8/models/deepseek/layers.py``). The small widths keep every contracted size a multiple of 128, so
the step runs the same ops as at DeepSeek-V3's widths.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

TARGET = re.compile(r'custom_call_target\s*=\s*"([^"]+)"|stablehlo\.custom_call @(\w+)')


def custom_calls(hlo_text: str) -> collections.Counter:
    """Custom-call targets in HLO or StableHLO text, counted."""
    return collections.Counter(a or b for a, b in TARGET.findall(hlo_text))


def fusions(hlo_text: str) -> int:
    """Fusion instructions in compiled HLO text (kernels XLA generates; a CPU compile fuses differently)."""
    return sum(fusion_kinds(hlo_text).values())


# the type is one token, or a tuple of them for a fusion of several outputs: "(f32[1]{0}, s32[1]{0})"
FUSION = re.compile(r"%?([\w.-]+)\s*=\s*(?:\([^=\n]*?\)|\S+)\s+fusion\(.*?kind=(k\w+)")


def fusion_kinds(hlo_text: str) -> collections.Counter:
    """Fusions in compiled HLO text by (name without its numeric suffix, kind), counted: what XLA's own kernels
    in the step are (gathers, reductions, GEMMs it fused, ...)."""
    return collections.Counter((re.sub(r"(\.\d+)+$", "", name), kind) for name, kind in FUSION.findall(hlo_text))


def decode_step_texts(layers: int, v3: bool, batch: int = 1, cache_len: int = 64, ue8m0: bool = False):
    """(lowered StableHLO, compiled HLO) of one decode step of a W4A8 model with random weights (UE8M0 activation
    scales with ``ue8m0``)."""
    import jax
    import jax.numpy as jnp

    import bench_generate as B
    from jax_w4a8.models.deepseek import QuantConfig
    from jax_w4a8.models.deepseek.generate import Generator

    # the module: the package exports a function of the same name
    gen_mod = importlib.import_module("jax_w4a8.models.deepseek.generate")
    cfg = B.v3_config(layers, 0, tiny=not v3)
    gen = Generator(B.random_model(cfg, QuantConfig.w4a8(ue8m0=ue8m0), jnp.bfloat16))
    cache, state = B.decode_inputs(gen, cfg, batch, cache_len // 2, cache_len)
    lowered = gen_mod._decode.lower(gen.structure, gen.mode(), gen.leaves, gen.absorbed, cache, state,
                                    jax.random.key(0), gen.sampling())
    return lowered.as_text(), lowered.compile().as_text()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2, help="decoder layers, all MoE (default 2)")
    ap.add_argument("--v3", action="store_true", help="DeepSeek-V3 widths (default: small widths)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--fusions", action="store_true", help="list the compiled step's fusions by name and kind")
    ap.add_argument("--ue8m0", action="store_true", help="UE8M0 activation scales (QuantConfig.w4a8(ue8m0=True))")
    args = ap.parse_args(argv)
    import jax

    lowered, compiled = decode_step_texts(args.layers, args.v3, args.batch, ue8m0=args.ue8m0)
    before, after = custom_calls(lowered), custom_calls(compiled)
    print(f"{jax.devices()[0].device_kind}: one decode step, {args.layers} layers, batch {args.batch}, "
          f"{'V3' if args.v3 else 'small'} widths{', UE8M0 scales' if args.ue8m0 else ''}")
    print(f"{'custom call':40s} {'lowered':>8s} {'compiled':>9s} {'per layer':>10s}")
    for target in sorted(set(before) | set(after)):
        print(f"{target:40s} {before[target]:8d} {after[target]:9d} {after[target] / args.layers:10.1f}")
    ours = sum(n for t, n in after.items() if t.startswith("jax_w4a8_"))
    print(f"{'this library, compiled':40s} {'':8s} {ours:9d} {ours / args.layers:10.1f}")
    print(f"fusions in the compiled step: {fusions(compiled)}")
    if args.fusions:
        for (name, kind), n in sorted(fusion_kinds(compiled).items(), key=lambda kv: (-kv[1], kv[0])):
            print(f"  {n:4d}  {kind:8s} {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
