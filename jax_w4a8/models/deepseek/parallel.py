"""Expert parallelism for the DeepSeek model: put a model on a mesh with its routed experts sharded.

    mesh = jax_w4a8.sharding.make_mesh(8)                 # one host, 8 GPUs (axis "expert")
    model = load_checkpoint(path, quantize="w4a8", mesh=mesh)   # each tensor straight to its devices
    # or, for a model built in code:
    shard_model(model, mesh)

Routed-expert weights and scales are split over ``"expert"`` (each device holds ``E / n`` experts),
everything else is replicated (the table in :mod:`jax_w4a8.sharding`), and every MoE layer runs its
experts inside ``jax.shard_map`` (:mod:`jax_w4a8.expert_parallel`). ``model(ids)``, ``jit_forward``
and ``generate`` work unchanged.
"""

from __future__ import annotations

import jax
from flax import nnx

from jax_w4a8 import sharding
from jax_w4a8.expert_parallel import ExpertParallel
from jax_w4a8.models.deepseek import layers

__all__ = ["shard_model", "check_divisible", "placement", "set_expert_parallel"]


def check_divisible(num_experts: int, mesh) -> None:
    """Raises ValueError when the experts do not split evenly over the mesh's expert axis."""
    n = int(mesh.shape[sharding.EXPERT_AXIS])
    if num_experts % n:
        raise ValueError(f"n_routed_experts={num_experts} does not divide over the mesh axis "
                         f"'{sharding.EXPERT_AXIS}' of size {n}: choose an axis size that divides it")


def placement(mesh, name: str, ndim: int):
    """The sharding of the model variable or checkpoint tensor ``name`` of rank ``ndim``."""
    return sharding.expert_sharding(mesh, ndim) if sharding.is_expert_tensor(name) else sharding.replicated(mesh)


def set_expert_parallel(model, ep: ExpertParallel | None) -> None:
    """Switches every MoE layer of ``model`` to expert-parallel execution (``None``: single device)."""
    for _, mod in nnx.iter_modules(model):
        if isinstance(mod, layers.MoE):
            mod.expert_parallel = ep


def shard_model(model, mesh, *, dispatch: str = "auto", gather_max_tokens: int = 256, exchange: str = "dense"):
    """Places ``model``'s variables on ``mesh`` (experts sharded, the rest replicated) and enables EP.

    Args:
      model: a DeepseekV3ForCausalLM.
      mesh: a mesh with an ``"expert"`` axis whose size divides ``n_routed_experts``.
      dispatch, gather_max_tokens, exchange: see :class:`jax_w4a8.expert_parallel.ExpertParallel`.
    Returns:
      the same model, modified in place.
    """
    check_divisible(model.cfg.n_routed_experts, mesh)
    ep = ExpertParallel(mesh, dispatch, gather_max_tokens, exchange)
    graphdef, state = nnx.split(model)
    flat = [(path, leaf.replace(jax.device_put(leaf[...], placement(mesh, ".".join(map(str, path)), leaf.ndim))))
            for path, leaf in nnx.to_flat_state(state)]
    nnx.update(model, nnx.from_flat_state(flat))
    set_expert_parallel(model, ep)
    return model
