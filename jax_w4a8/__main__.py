"""``python -m jax_w4a8``: the main job, text generation on the embedded default (see README).

Same as ``python -m jax_w4a8.generate`` (``--help`` lists the options); with no ``--checkpoint`` it runs a
tiny DeepSeek-V3-architecture model with random weights, quantized to W4A8. The op demo that used to be the
main job is ``python -m jax_w4a8.demo``.
"""

from jax_w4a8.generate import main

raise SystemExit(main())
