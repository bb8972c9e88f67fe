"""``python -m jax_w4a8``: the main job on its embedded default (see README)."""

from jax_w4a8.demo import main

raise SystemExit(main())
