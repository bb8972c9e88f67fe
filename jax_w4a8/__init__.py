"""jax_w4a8: DeepSeek-style W4A8 / FP8 MoE inference for JAX on NVIDIA GPUs.

Layers, each importing only those before it: ``quant`` (number formats) -> ``reference`` (jnp oracle)
-> ``ops`` (XLA FFI custom calls) -> ``models.deepseek`` (Flax model, checkpoints, generate).
"""

from jax_w4a8._ffi import FfiAvailability, build_info, export_disabled_checks, ffi_available
from jax_w4a8 import quant, reference, ops

__version__ = "0.1.0"
__all__ = ["ffi_available", "FfiAvailability", "build_info", "export_disabled_checks", "quant", "reference", "ops", "__version__"]
