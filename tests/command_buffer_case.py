"""A case for tests that run in a fresh process: ``op`` (einsum or grouped_gemm) called four times on fresh
activations in one jitted program that XLA records as a command buffer (a CUDA graph), so that the kernel's first
call of the process (cuBLASLt's handle and plan, CUTLASS's set-up) happens while XLA captures the stream. Prints
one JSON line: the custom calls of XLA's final thunk sequence (all of them, and those inside command buffers), and
the sum's relative error against float64 (np_ref).

    python tests/command_buffer_case.py einsum|grouped_gemm plan|KERNEL SEED
"""
import atexit
import glob
import json
import os
import pathlib
import re
import shutil
import sys
import tempfile

DUMP = tempfile.mkdtemp(prefix="command_buffer_case_")
atexit.register(shutil.rmtree, DUMP, True)
# command buffers of fusions and custom calls, however short; XLA's thunk sequence of the program dumped
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL"
                           f" --xla_gpu_graph_min_graph_size=1 --xla_dump_to={DUMP} --xla_dump_hlo_module_re=jit_chain")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import np_ref  # noqa: E402
from jax_w4a8 import ops, quant  # noqa: E402

M, N, K, CALLS, EXPERTS = 256, 512, 512, 4, 8


def case(op, kernel, rng):
    """(one call of the op on (x8, sx) and the constants, its float64 reference on (x8, sx), the constants)."""
    if op == "einsum":
        w8, sw = quant.quantize_fp8_blocks(rng.standard_normal((N, K)).astype(np.float32))
        return (lambda x8, sx, w8, sw: ops.fp8_einsum("md,nd->mn", x8, sx, w8, sw, kernel=kernel),
                lambda x8, sx: np_ref.fp8_einsum_mhk(x8[:, None], sx[:, None], w8[None], sw[None])[:, 0], (w8, sw))
    sizes = rng.multinomial(M - 8, np.ones(EXPERTS) / EXPERTS)  # 8 padding rows at the end
    wq, ws = quant.quantize_w4(rng.standard_normal((EXPERTS, N, K)).astype(np.float32))
    return (lambda x8, sx, wq, ws, gs: ops.w4a8_grouped_gemm(x8, sx, wq, ws, gs, kernel=kernel),
            lambda x8, sx: np_ref.grouped_gemm(x8, sx, wq, ws, sizes), (wq, ws, jnp.asarray(sizes, jnp.int32)))


def custom_calls():
    """(all, inside): the custom calls of XLA's final thunk sequence of the program, and those it runs inside
    command buffers (the indented lines under a ``kCommandBuffer`` line) in the dumped
    ``*jit_chain*.thunk_sequence_after_thunk_passes.txt``; (None, None) without the dump (no GPU)."""
    files = glob.glob(os.path.join(DUMP, "*jit_chain*thunk_sequence_after_thunk_passes.txt"))
    if not files:
        return None, None
    total = inside = 0
    in_buffer = False
    for line in pathlib.Path(files[0]).read_text().splitlines():
        if not line.startswith(" "):
            in_buffer = "kCommandBuffer" in line
        if re.match(r"\s*\d+: kCustomCall\b", line):
            total += 1
            inside += in_buffer and line.startswith(" ")
    return total, inside


def main(op, kernel, seed):
    rng = np.random.default_rng(seed)
    one, ref_one, consts = case(op, None if kernel == "plan" else kernel, rng)
    xs = [quant.quantize_fp8_groups(rng.standard_normal((M, K)).astype(np.float32)) for _ in range(CALLS)]

    def chain(xs, *consts):  # the calls, each scaled apart, summed: a fusion after the custom calls
        return sum(one(x8, sx, *consts).astype(jnp.float32) * (i + 1) for i, (x8, sx) in enumerate(xs))

    f = jax.jit(chain)
    out = np.asarray(f(xs, *consts))  # the first call of the op in this process
    ref = sum((i + 1) * ref_one(x8, sx) for i, (x8, sx) in enumerate(xs))
    total, inside = custom_calls()
    print(json.dumps({"calls": CALLS, "custom_calls": total, "custom_calls_in_command_buffers": inside,
                      "rel_err": float(np.linalg.norm(out - ref) / np.linalg.norm(ref)),
                      "finite": bool(np.isfinite(out).all())}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
