"""Mesh axis names and the one table mapping logical axes to mesh axes.

Expert parallelism (EP) splits the routed experts of every MoE layer over the mesh axis ``"expert"``;
everything else (attention, dense and shared-expert MLPs, embeddings, norms, the router) is
replicated. Activations outside the MoE layers are replicated too, so ``generate`` runs unchanged on a
mesh: inside each MoE layer a ``jax.shard_map`` over ``"expert"`` dispatches token slots to the devices
that own their experts (see :mod:`jax_w4a8.expert_parallel`).

===================  ===========  ===================================================================
logical axis         mesh axis    arrays
===================  ===========  ===================================================================
``"experts"``        ``"expert"`` axis 0 of every routed-expert weight, scale and input scale
anything else        (replicated) all other weights and all activations
===================  ===========  ===================================================================

One host: ``make_mesh(8)`` over the visible GPUs. Several hosts: call
``jax.distributed.initialize()`` in every process first; ``jax.devices()`` then lists every host's GPUs
and ``make_mesh`` spans them (NCCL carries the collectives).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

__all__ = ["EXPERT_AXIS", "LOGICAL_AXIS_RULES", "make_mesh", "logical_sharding", "expert_sharding",
           "replicated", "is_expert_tensor"]

EXPERT_AXIS = "expert"
LOGICAL_AXIS_RULES = {"experts": EXPERT_AXIS}  # logical axis -> mesh axis; unlisted axes replicate


def make_mesh(num_devices: int | None = None, devices=None) -> Mesh:
    """A 1-D mesh over ``num_devices`` devices (default: all) with the axis ``"expert"``.

    Axes are ``Auto`` so that jitted code may pass replicated activations into the expert
    ``shard_map`` (JAX reshards them).
    """
    devices = list(devices if devices is not None else jax.devices())
    n = len(devices) if num_devices is None else int(num_devices)
    if not 1 <= n <= len(devices):
        raise ValueError(f"make_mesh: argument 'num_devices' must be in [1, {len(devices)}], got {num_devices}")
    return Mesh(np.asarray(devices[:n]), (EXPERT_AXIS,), axis_types=(jax.sharding.AxisType.Auto,))


def logical_sharding(mesh: Mesh, logical_axes: tuple) -> NamedSharding:
    """The sharding of an array whose axes carry these logical names (None: replicated axis)."""
    return NamedSharding(mesh, P(*(LOGICAL_AXIS_RULES.get(a) if a else None for a in logical_axes)))


def expert_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Sharding of a routed-expert tensor [E, ...] of rank ``ndim``: experts over ``"expert"``."""
    return logical_sharding(mesh, ("experts",) + (None,) * (ndim - 1))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def is_expert_tensor(name: str) -> bool:
    """Whether a model variable path / checkpoint key names a routed-expert tensor (leading axis E)."""
    return ".mlp.experts." in f".{name}." and ".shared_experts." not in f".{name}."
