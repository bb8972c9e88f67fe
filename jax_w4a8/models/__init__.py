"""Model implementations built on :mod:`jax_w4a8.ops` (currently DeepSeek-V3/R1: :mod:`.deepseek`)."""
