"""The custom calls as XLA sees them: lowering for CUDA on a CPU-only machine through jax.export."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_w4a8 import export_disabled_checks, ffi_available, ops, quant, tiling

needs_cuda_build = pytest.mark.skipif(not ffi_available("cuda"), reason=ffi_available("cuda").reason)


def _grouped_args():
    rng = np.random.default_rng(0)
    w, ws = quant.quantize_w4(rng.standard_normal((4, 64, 256)).astype(np.float32))
    x8, xs = quant.quantize_fp8_groups(rng.standard_normal((32, 256)).astype(np.float32))
    return x8, xs, w, ws, jnp.array([8, 8, 8, 8], jnp.int32)


@needs_cuda_build
def test_export_for_cuda_shows_custom_calls():
    args = _grouped_args()
    exp = jax.export.export(jax.jit(ops.w4a8_grouped_gemm), platforms=["cuda"], disabled_checks=export_disabled_checks())(*args)
    text = exp.mlir_module()
    assert "stablehlo.custom_call @jax_w4a8_w4a8_grouped_gemm" in text
    plan = tiling.plan_grouped_gemm(32, 4, 64, 256)
    # typed XLA FFI attributes: the static tile plan chosen from the shapes (jax_w4a8.tiling)
    assert f"split_k = {plan.split_k} : i32, tile_tokens = {plan.tile_tokens} : i32" in text
    assert f"(tensor<32x64xbf16>, tensor<{plan.scratch_bytes}xui8>)" in text  # out + scratch
    assert exp.platforms == ("cuda",)


@needs_cuda_build
def test_export_shows_attributes_and_scale_packing():
    rng = np.random.default_rng(1)
    x8, sx = quant.quantize_fp8_groups(rng.standard_normal((4, 256)).astype(np.float32), ue8m0=True)
    w8, sw = quant.quantize_fp8_blocks(rng.standard_normal((130, 256)).astype(np.float32), ue8m0=True)
    fn = jax.jit(functools.partial(ops.fp8_einsum, "md,nd->mn", ue8m0=True))
    text = jax.export.export(fn, platforms=["cuda"], disabled_checks=export_disabled_checks())(x8, sx, w8, sw).mlir_module()
    assert text.count("stablehlo.custom_call @jax_w4a8_ue8m0_pack") == 2
    assert 'arg = "x_scale"' in text and 'arg = "w_scale"' in text
    assert "stablehlo.custom_call @jax_w4a8_fp8_einsum" in text
    assert "tensor<1x2x2xui8>" in text  # w scales travel as one byte each


@needs_cuda_build
def test_multi_platform_export_runs_on_cpu():
    args = _grouped_args()
    exp = jax.export.export(jax.jit(ops.w4a8_grouped_gemm), platforms=["cpu", "cuda"],
                                 disabled_checks=export_disabled_checks())(*args)
    np.testing.assert_array_equal(np.asarray(exp.call(*args)), np.asarray(ops.w4a8_grouped_gemm(*args)))


def test_reference_impl_has_no_custom_call():
    text = jax.jit(functools.partial(ops.w4a8_grouped_gemm, impl="reference")).lower(*_grouped_args()).as_text()
    assert "custom_call" not in text
