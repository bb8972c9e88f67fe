"""Routing-independent MoE plumbing in plain ``jnp``: sort token slots by expert, group sizes, combine.

A token routed to ``K`` experts occupies ``K`` *slots* (rows ``n * K + k`` of the flattened top-k). The
experts see the slots sorted by expert id, so that expert ``e`` owns a contiguous run of
``group_sizes[e]`` rows (the layout of ``ops.w4a8_grouped_gemm`` and ``jax.lax.ragged_dot``)::

    routing = sort_by_expert(topk_ids, num_experts)          # order, group_sizes, inverse
    x_sorted = x[routing.token_of_row]                       # [N*K, D]
    y_sorted = experts_fn(x_sorted, routing.group_sizes)     # [N*K, D]
    y = combine(y_sorted, routing.inverse, topk_weights)     # [N, D], weighted sum in fp32

No token is dropped: every slot gets a row. A slot whose expert id lies outside [0, E) (a routing bug, or a
masked choice) is sorted after all the others and counted by no expert: it is a padding row of the grouped GEMM
and :func:`moe_apply` ignores its output, so it adds nothing to its token (the expert-parallel path treats such
ids the same way). ``experts_fn(x_sorted [R, D], group_sizes int32 [E]) -> [R, D]``
is the only part that touches expert weights, so it can be wrapped in ``jax.shard_map`` for expert
parallelism (each device applying its local experts to its rows) without changing this file.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Routing", "sort_by_expert", "permute", "combine", "moe_apply"]


class Routing(NamedTuple):
    """Where each token slot goes.

    Attributes:
      order: int32 [N*K]: sorted row r holds flat slot ``order[r]`` (= token ``order[r] // K``, choice
        ``order[r] % K``). A stable sort: slots of one expert keep token order.
      group_sizes: int32 [E]: rows per expert, ``sum == N*K`` less the slots with an id outside [0, E)
        (sorted last: padding rows).
      inverse: int32 [N*K]: flat slot s sits in sorted row ``inverse[s]`` (``order[inverse] == arange``).
      token_of_row: int32 [N*K]: the token each sorted row reads (``order // K``).
    """

    order: jax.Array
    group_sizes: jax.Array
    inverse: jax.Array
    token_of_row: jax.Array


def sort_by_expert(topk_ids, num_experts: int) -> Routing:
    """Sorts the token slots by expert.

    Args:
      topk_ids: integer [N, K] expert ids in [0, num_experts); a slot with any other id is sorted after every
        valid slot and counted by no expert (module docstring).
      num_experts: E >= 1.
    Returns:
      :class:`Routing` (all int32).
    Raises:
      TypeError / ValueError naming ``topk_ids`` (not a 2-D integer array) or ``num_experts``.
    """
    topk_ids = _check_ids(topk_ids, num_experts)
    n, k = topk_ids.shape
    flat = topk_ids.reshape(n * k).astype(jnp.int32)
    key = jnp.where(_valid(flat, num_experts), flat, num_experts)  # invalid ids: after every expert
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    group_sizes = jnp.bincount(key, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(n * k, dtype=jnp.int32))
    return Routing(order, group_sizes, inverse, order // k)


def check_moe_args(x, topk_ids, topk_weights, num_experts):
    """The checks of :func:`moe_apply` (shared with the expert-parallel path): ``x`` [N, D] (or a tuple of
    arrays of N rows), ``topk_ids`` integer [N, K], ``topk_weights`` [N, K], ``num_experts`` an int >= 1.
    Returns ``(topk_ids, topk_weights)`` as arrays; raises TypeError / ValueError naming ``topk_ids``,
    ``topk_weights``, ``x`` or ``num_experts``."""
    topk_ids = _check_ids(topk_ids, num_experts)
    topk_weights = jnp.asarray(topk_weights)
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"moe: argument 'topk_weights' must have the shape of topk_ids {topk_ids.shape}, "
                         f"got {topk_weights.shape}")
    for a in (x if isinstance(x, tuple) else (x,)):
        if jnp.ndim(a) < 1 or jnp.shape(a)[0] != topk_ids.shape[0]:
            raise ValueError(f"moe: argument 'x' must have one row per token of topk_ids ({topk_ids.shape[0]}), "
                             f"got shape {jnp.shape(a)}")
    return topk_ids, topk_weights


def _check_ids(topk_ids, num_experts):
    topk_ids = jnp.asarray(topk_ids)
    if not jnp.issubdtype(topk_ids.dtype, jnp.integer):
        raise TypeError(f"moe: argument 'topk_ids' must be an integer array, got dtype {topk_ids.dtype}")
    if topk_ids.ndim != 2:
        raise ValueError(f"moe: argument 'topk_ids' must be 2-D [N, K], got shape {topk_ids.shape}")
    if isinstance(num_experts, (bool, np.bool_)) or not isinstance(num_experts, (int, np.integer)) or num_experts < 1:
        raise ValueError(f"moe: argument 'num_experts' must be an int >= 1, got {num_experts!r}")
    return topk_ids


def _valid(ids, num_experts: int):
    """Whether each id names an expert (ids may be int64 under x64: compared before any narrowing)."""
    return (ids >= 0) & (ids < num_experts)


def map_rows(x, fn):
    """``fn`` on each array of ``x``: an array of token rows, or a tuple of arrays with the same rows (tokens
    already quantized: fp8 codes [N, D] and their scales [N, D/128]), which comes back a tuple."""
    return tuple(fn(a) for a in x) if isinstance(x, tuple) else fn(x)


def permute(x, routing: Routing):
    """Rows of ``x`` [N, D] in sorted-slot order: [N*K, D] (same dtype). ``x`` may be a tuple of arrays of N
    rows each (:func:`map_rows`): each is permuted the same way."""
    return map_rows(x, lambda a: jnp.take(a, routing.token_of_row, axis=0))


def combine(y_sorted, inverse, topk_weights, out_dtype=jnp.float32, *, valid=None):
    """Weighted sum of each token's expert outputs, in float32.

    ``out[n] = sum_k topk_weights[n, k] * y_sorted[inverse[n * K + k]]``.

    Args:
      y_sorted: float [N*K, D] expert outputs in sorted-slot order.
      inverse: int32 [N*K] (``Routing.inverse``).
      topk_weights: float [N, K] (float32 router weights).
      out_dtype: bfloat16 or float32 (the default): the dtype of the result (the sum is float32 either way; never
        float16, whose range a sum of expert outputs can pass).
      valid: optional bool [N, K]: slots to include (the others add exactly nothing, whatever their rows hold).
    Returns:
      out_dtype [N, D].
    """
    if out_dtype is None or jnp.dtype(out_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        shown = out_dtype if out_dtype is None else jnp.dtype(out_dtype)
        raise ValueError(f"moe: argument 'out_dtype' must be bfloat16 or float32, got {shown}")
    n, k = topk_weights.shape
    y = jnp.take(y_sorted, inverse, axis=0).reshape(n, k, y_sorted.shape[-1]).astype(jnp.float32)
    if valid is not None:
        y = jnp.where(valid[..., None], y, 0.0)  # not multiplied: a padding row's NaN or Inf stays out
    out = jnp.einsum("nkd,nk->nd", y, topk_weights.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return out.astype(out_dtype)


def moe_apply(x, topk_ids, topk_weights, experts_fn: Callable, num_experts: int, out_dtype=jnp.float32):
    """Routed-expert output of every token (no dropping).

    Args:
      x: [N, D] expert inputs (bf16, or fp32 in fp32 mode), or a tuple of arrays of N rows (tokens already
        quantized: fp8 codes and scales), each gathered into sorted-slot order for ``experts_fn``.
      topk_ids: int [N, K]; topk_weights: float32 [N, K].
      experts_fn: ``(x_sorted [N*K, D] (or the tuple, sorted), group_sizes int32 [E]) -> [N*K, D]``.
      num_experts: E (the length of ``group_sizes``).
      out_dtype: bfloat16 or float32 (the default, so callers can add more in fp32): the combined result's dtype.
    Returns:
      out_dtype [N, D].
    Raises:
      TypeError / ValueError naming ``topk_ids``, ``topk_weights``, ``x``, ``num_experts`` or ``out_dtype``.
    """
    topk_ids, topk_weights = check_moe_args(x, topk_ids, topk_weights, num_experts)
    routing = sort_by_expert(topk_ids, num_experts)
    y_sorted = experts_fn(permute(x, routing), routing.group_sizes)
    return combine(y_sorted, routing.inverse, topk_weights, out_dtype, valid=_valid(topk_ids, num_experts))
