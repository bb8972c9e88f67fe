"""Routing-independent MoE plumbing in plain ``jnp``: sort token slots by expert, group sizes, combine.

A token routed to ``K`` experts occupies ``K`` *slots* (rows ``n * K + k`` of the flattened top-k). The
experts see the slots sorted by expert id, so that expert ``e`` owns a contiguous run of
``group_sizes[e]`` rows (the layout of ``ops.w4a8_grouped_gemm`` and ``jax.lax.ragged_dot``)::

    routing = sort_by_expert(topk_ids, num_experts)          # order, group_sizes, inverse
    x_sorted = x[routing.token_of_row]                       # [N*K, D]
    y_sorted = experts_fn(x_sorted, routing.group_sizes)     # [N*K, D]
    y = combine(y_sorted, routing.inverse, topk_weights)     # [N, D], weighted sum in fp32

No token is dropped: every slot gets a row. ``experts_fn(x_sorted [R, D], group_sizes int32 [E]) -> [R, D]``
is the only part that touches expert weights, so it can be wrapped in ``jax.shard_map`` for expert
parallelism (each device applying its local experts to its rows) without changing this file.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["Routing", "sort_by_expert", "permute", "combine", "moe_apply"]


class Routing(NamedTuple):
    """Where each token slot goes.

    Attributes:
      order: int32 [N*K]: sorted row r holds flat slot ``order[r]`` (= token ``order[r] // K``, choice
        ``order[r] % K``). A stable sort: slots of one expert keep token order.
      group_sizes: int32 [E]: rows per expert, ``sum == N*K``.
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
      topk_ids: integer [N, K] expert ids in [0, num_experts).
      num_experts: E.
    Returns:
      :class:`Routing` (all int32).
    """
    n, k = topk_ids.shape
    flat = topk_ids.reshape(n * k).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(n * k, dtype=jnp.int32))
    return Routing(order, group_sizes, inverse, order // k)


def map_rows(x, fn):
    """``fn`` on each array of ``x``: an array of token rows, or a tuple of arrays with the same rows (tokens
    already quantized: fp8 codes [N, D] and their scales [N, D/128]), which comes back a tuple."""
    return tuple(fn(a) for a in x) if isinstance(x, tuple) else fn(x)


def permute(x, routing: Routing):
    """Rows of ``x`` [N, D] in sorted-slot order: [N*K, D] (same dtype). ``x`` may be a tuple of arrays of N
    rows each (:func:`map_rows`): each is permuted the same way."""
    return map_rows(x, lambda a: jnp.take(a, routing.token_of_row, axis=0))


def combine(y_sorted, inverse, topk_weights, out_dtype=jnp.float32):
    """Weighted sum of each token's expert outputs, in float32.

    ``out[n] = sum_k topk_weights[n, k] * y_sorted[inverse[n * K + k]]``.

    Args:
      y_sorted: float [N*K, D] expert outputs in sorted-slot order.
      inverse: int32 [N*K] (``Routing.inverse``).
      topk_weights: float [N, K] (float32 router weights).
      out_dtype: dtype of the result (the sum is float32 either way).
    Returns:
      out_dtype [N, D].
    """
    n, k = topk_weights.shape
    y = jnp.take(y_sorted, inverse, axis=0).reshape(n, k, y_sorted.shape[-1]).astype(jnp.float32)
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
      out_dtype: dtype of the combined result (float32 by default, so callers can add more in fp32).
    Returns:
      out_dtype [N, D].
    """
    routing = sort_by_expert(topk_ids, num_experts)
    y_sorted = experts_fn(permute(x, routing), routing.group_sizes)
    return combine(y_sorted, routing.inverse, topk_weights, out_dtype)
