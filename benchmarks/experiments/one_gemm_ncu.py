"""One block-scaled FP8 GEMM, three calls, in a process of its own: for ``ncu`` to name and time the kernels that
torch's ``_scaled_mm`` (blockwise 1x128 x 128x128) or this library's einsum (``kernel="cublas"`` / ``"cutlass"`` /
``"native"``) launch for ``y [M, N] = x [M, K] . w [N, K]`` with bf16 output. torch and JAX in one process crash
``ncu`` (H100, sixty-first session), hence one framework per process. Random normal data cast to e4m3. On the
GPU machine, from the repository root:

    PYTHONPATH=$PWD ncu --clock-control none --metrics gpu__time_duration.sum,launch__grid_size,launch__cluster_dim_x \\
        python3 benchmarks/experiments/one_gemm_ncu.py torch|cublas|cutlass|native M N K
"""
import argparse
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("path", choices=["torch", "cublas", "cutlass", "native"])
    p.add_argument("m", type=int)
    p.add_argument("n", type=int)
    p.add_argument("k", type=int)
    a = p.parse_args()
    m, n, k = a.m, a.n, a.k
    if a.path == "torch":
        import torch

        fp8 = torch.float8_e4m3fn
        x = (torch.randn(m, k, device="cuda") * 2).clamp(-448, 448).to(fp8)
        w = (torch.randn(n, k, device="cuda") * 2).clamp(-448, 448).to(fp8)
        sx = torch.rand(m, k // 128, device="cuda") * 0.02 + 0.001
        sw = torch.rand(-(-n // 128), k // 128, device="cuda") * 0.02 + 0.001
        for _ in range(3):  # 1x128 scales M-major, 128x128 scales of w^T: cuBLASLt's VEC128 x BLK128x128
            torch._scaled_mm(x, w.t(), sx.t().contiguous().t(), sw.t(), out_dtype=torch.bfloat16)
        torch.cuda.synchronize()
        return
    import jax
    import jax.numpy as jnp

    from jax_w4a8 import ops

    kx, kw = jax.random.split(jax.random.key(0))
    x = jnp.clip(jax.random.normal(kx, (m, k)) * 2, -448, 448).astype(jnp.float8_e4m3fn)
    w = jnp.clip(jax.random.normal(kw, (n, k)) * 2, -448, 448).astype(jnp.float8_e4m3fn)
    sx = jnp.full((m, k // 128), 0.01, jnp.float32)
    sw = jnp.full((-(-n // 128), k // 128), 0.01, jnp.float32)
    f = jax.jit(lambda a_, sa, b, sb: ops.fp8_einsum("md,nd->mn", a_, sa, b, sb, kernel=a.path))
    for _ in range(3):
        y = f(x, sx, w, sw)
    jax.block_until_ready(y)


if __name__ == "__main__":
    main()
