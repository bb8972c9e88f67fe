"""DeepSeek-V3/R1 (MLA + group-limited MoE) in Flax NNX, on the W4A8 and FP8 ops of :mod:`jax_w4a8.ops`.

    from jax_w4a8.models.deepseek import load_checkpoint
    model = load_checkpoint("/path/to/hf_dir", quantize="w4a8")     # bf16 activations
    logits = model(input_ids)                                         # [B, T] -> [B, T, V] bf16
"""

from jax_w4a8.models.deepseek.config import DeepseekConfig, QuantConfig, RopeParameters
from jax_w4a8.models.deepseek.model import DeepseekV3ForCausalLM, DeepseekV3Model, forward, jit_forward
from jax_w4a8.models.deepseek.checkpoint import load_checkpoint, save_checkpoint
from jax_w4a8.models.deepseek.parallel import shard_model
from jax_w4a8.models.deepseek.generate import NonFiniteLogitsError, generate

__all__ = ["DeepseekConfig", "QuantConfig", "RopeParameters", "DeepseekV3ForCausalLM", "DeepseekV3Model",
           "forward", "jit_forward", "load_checkpoint", "save_checkpoint", "shard_model", "generate",
           "NonFiniteLogitsError"]
