"""Expert parallelism: the routed-expert part of a MoE layer inside ``jax.shard_map`` over ``"expert"``.

Each of the ``n`` devices of the expert axis holds ``E / n`` experts (their weights sharded on axis 0)
and runs its rows through ``experts_fn`` (the FFI grouped GEMM) on its local experts only. Two ways to
bring the token slots to their experts, chosen by the number of tokens (static, so no recompilation
with routing):

* ``"gather"`` (decode, few tokens): every device already holds all tokens (activations are replicated),
  keeps the slots routed to its own experts, computes them, and a ``psum`` adds the partial outputs.
  The grouped GEMM sees ``N * K`` rows of which about ``1/n`` are real; the rest are padding rows that
  the kernel zero-fills without reading weights.
* ``"all_to_all"`` (prefill, many tokens): each device takes ``1/n`` of the tokens, sends each slot to
  the device owning its expert, computes, sends the results back the same way, combines its tokens,
  and an ``all_gather`` restores the replicated activations. The exchange is a dense ``all_to_all``
  of fixed-capacity buffers by default (``exchange="dense"``: each device's chunks gathered straight from its
  tokens, the received chunks used in place as the experts' buffer, the results un-sorted by one gather; no
  scatter and no offsets exchanged), or ``jax.lax.ragged_all_to_all``
  (``exchange="ragged"``: only real rows travel; GPUs only, XLA:CPU has no ragged all-to-all and
  takes the dense path). Same layout and results either way. On two H200s (jax 0.11.2) the dense
  exchange of a 4096-token R1 prefill took 5.2 ms and the ragged one 88 ms, for half the bytes
  (``benchmarks/RESULTS.md``), hence the default; the dense one moves ``n`` times the rows needed
  in the worst case of routing, which grows with the expert axis.

No token is ever dropped: receive buffers are sized for the worst case (every slot to one device).
Results equal the single-device layer up to float32 summation order, with one documented exception:
W4A8 experts with *static* activation scales take the max ``input_scale`` over each device's *local*
experts (as SPEC section 3 and sglang do under EP), so those numbers depend on the mesh size.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from jax_w4a8 import moe
from jax_w4a8.moe import map_rows
from jax_w4a8.sharding import EXPERT_AXIS

__all__ = ["ExpertParallel", "moe_apply_ep", "buffer_rows", "DISPATCHES"]

DISPATCHES = ("auto", "gather", "all_to_all")
F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """How a MoE layer spreads its experts over ``mesh``'s ``"expert"`` axis.

    Attributes:
      mesh: a mesh with an ``"expert"`` axis (``jax_w4a8.sharding.make_mesh``).
      dispatch: ``"auto"`` (``"gather"`` up to ``gather_max_tokens`` tokens, else ``"all_to_all"``),
        ``"gather"`` or ``"all_to_all"``.
      gather_max_tokens: the ``"auto"`` threshold, in tokens of one forward call.
      exchange: how ``"all_to_all"`` moves rows: ``"dense"`` (default; ``jax.lax.all_to_all`` of
        fixed-capacity buffers) or ``"ragged"`` (``jax.lax.ragged_all_to_all`` on GPUs, only real rows
        travel; dense elsewhere). Two H200s, 4096-token prefill: 5.2 ms dense, 88 ms ragged (module
        docstring); ``benchmarks/bench_expert_parallel.py`` times both.
    """

    mesh: Mesh
    dispatch: str = "auto"
    gather_max_tokens: int = 256
    exchange: str = "dense"

    def __post_init__(self):
        if self.dispatch not in DISPATCHES:
            raise ValueError(f"ExpertParallel: argument 'dispatch' must be one of {DISPATCHES}, got {self.dispatch!r}")
        if self.exchange not in ("ragged", "dense"):
            raise ValueError(f"ExpertParallel: argument 'exchange' must be 'ragged' or 'dense', got {self.exchange!r}")
        if EXPERT_AXIS not in self.mesh.shape:
            raise ValueError(f"ExpertParallel: the mesh has no {EXPERT_AXIS!r} axis (axes {tuple(self.mesh.shape)})")

    @property
    def size(self) -> int:
        return int(self.mesh.shape[EXPERT_AXIS])

    def strategy(self, num_tokens: int) -> str:
        if self.dispatch != "auto":
            return self.dispatch
        return "gather" if num_tokens <= self.gather_max_tokens else "all_to_all"

    def buffer_rows(self, num_tokens: int, top_k: int) -> int:
        """The rows each device's ``experts_fn`` receives for ``num_tokens`` tokens routed to ``top_k`` experts
        (:func:`buffer_rows` with this mesh and dispatch). The model's MoE layer sizes each device's plans with it
        and the rows its experts expect (about ``num_tokens * top_k / n``: the grouped GEMMs'
        ``rows_per_expert``, and so the activation layout)."""
        return buffer_rows(num_tokens, top_k, self.size, self.strategy(num_tokens))


def buffer_rows(num_tokens: int, top_k: int, n: int, dispatch: str) -> int:
    """The rows each of ``n`` devices' ``experts_fn`` receives for ``num_tokens`` tokens routed to ``top_k``
    experts (static; the real ones first, the rest padding): all ``num_tokens * top_k`` slots under ``"gather"``,
    ``n`` chunks of ``ceil(num_tokens / n)`` whole tokens' slots under ``"all_to_all"`` (room for every slot to
    land on one device). Returns an int (static shapes in, rows out). Raises ValueError naming ``dispatch`` for
    anything but ``"gather"`` or ``"all_to_all"`` (``"auto"`` is :meth:`ExpertParallel.strategy`'s to resolve)."""
    if dispatch == "gather":
        return num_tokens * top_k
    if dispatch != "all_to_all":
        raise ValueError(f"buffer_rows: argument 'dispatch' must be 'gather' or 'all_to_all', got {dispatch!r}")
    return n * -(-num_tokens // n) * top_k


def _sort_local(expert_local, valid, e_local: int):
    """Rows sorted by local expert (invalid rows last): (order, inverse, group_sizes [e_local])."""
    key = jnp.where(valid, expert_local, e_local).astype(jnp.int32)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=jnp.int32))
    sizes = jnp.bincount(key, length=e_local + 1)[:e_local].astype(jnp.int32)
    return order, inverse, sizes


def _gather_body(x, ids, weights, params, *, experts_fn, num_experts, n):
    d = jax.lax.axis_index(EXPERT_AXIS)
    e_local = num_experts // n
    tokens, k = ids.shape
    raw_ids = ids.reshape(-1)
    flat = raw_ids.astype(jnp.int32)
    # ids outside [0, E) are ignored, checked before int32 (int64 ids must not wrap)
    local = (raw_ids >= 0) & (raw_ids < num_experts) & ((flat // e_local) == d)
    order, inverse, sizes = _sort_local(flat % e_local, local, e_local)
    y = experts_fn(params, map_rows(x, lambda a: jnp.take(a, order // k, axis=0)), sizes)
    y = jnp.take(y, inverse, axis=0).astype(F32)
    y = jnp.where(local[:, None], y, 0.0).reshape(tokens, k, y.shape[-1])  # non-local rows ignored, not multiplied
    out = jnp.einsum("nkd,nk->nd", y, weights.astype(F32), precision=jax.lax.Precision.HIGHEST)
    return jax.lax.psum(out, EXPERT_AXIS)


def _take_rows(a, idx, ok):
    """Rows ``idx`` of ``a`` (any index shape), zero where not ``ok``. Rows not ``ok`` are read as row 0, which
    stays in cache, instead of from wherever ``idx`` points: the dense exchange's buffers are mostly padding (``n``
    times the rows a device expects), and a masked gather otherwise still reads every row it masks."""
    rows = jnp.take(a, jnp.where(ok, idx, 0), axis=0)
    return jnp.where(ok.reshape(ok.shape + (1,) * (a.ndim - 1)), rows, jnp.zeros((), a.dtype))


def _as_bytes(fn, a):
    """``fn(a)``, fp8 codes as their bytes (uint8: every collective moves those, exactly)."""
    if jnp.dtype(a.dtype).itemsize == 1 and jnp.issubdtype(a.dtype, jnp.floating):
        return jax.lax.bitcast_convert_type(fn(jax.lax.bitcast_convert_type(a, jnp.uint8)), a.dtype)
    return fn(a)


def _exchange_rows(x, **kw):
    """:func:`_exchange` of each array of ``x`` (:func:`_as_bytes`)."""
    return map_rows(x, lambda a: _as_bytes(lambda b: _exchange(b, **kw), a))


def _exchange(rows, send_offsets, send_sizes, out_offsets, recv_sizes, out_rows, cap, n, exchange="ragged"):
    """Chunk j of ``rows`` (rows send_offsets[j] .. + send_sizes[j]) goes to device j, landing at
    out_offsets[j] of its output [out_rows, ...]; recv_sizes[i] rows come from device i.

    Ragged all-to-all on GPUs; on other platforms a dense all-to-all of [n, cap] buffers, which needs
    the fixed layout ``out_offsets[j] == my_index * cap`` (forward) or the scatter below (return).
    """
    def ragged(rows, send_offsets, send_sizes, out_offsets, recv_sizes):
        out = jnp.zeros((out_rows,) + rows.shape[1:], rows.dtype)
        return jax.lax.ragged_all_to_all(rows, out, send_offsets, send_sizes, out_offsets, recv_sizes,
                                         axis_name=EXPERT_AXIS)

    def dense(rows, send_offsets, send_sizes, out_offsets, recv_sizes):
        idx = send_offsets[:, None] + jnp.arange(cap, dtype=jnp.int32)[None]           # [n, cap]
        ok = jnp.arange(cap, dtype=jnp.int32)[None] < send_sizes[:, None]
        chunks = jnp.take(rows, jnp.clip(idx, 0, rows.shape[0] - 1), axis=0)
        chunks = jnp.where(ok.reshape(ok.shape + (1,) * (rows.ndim - 1)), chunks, 0)
        got = jax.lax.all_to_all(chunks, EXPERT_AXIS, 0, 0, tiled=False)             # [n, cap, ...]
        # My chunk from device i must land at out_offsets_i (what device i chose for me): ask for them.
        where = jax.lax.all_to_all(out_offsets.reshape(n, 1), EXPERT_AXIS, 0, 0, tiled=False).reshape(n)
        dst = where[:, None] + jnp.arange(cap, dtype=jnp.int32)[None]
        valid = jnp.arange(cap, dtype=jnp.int32)[None] < recv_sizes[:, None]
        dst = jnp.where(valid, dst, out_rows)  # out of range: dropped by the scatter
        out = jnp.zeros((out_rows,) + rows.shape[1:], rows.dtype)
        return out.at[dst.reshape(-1)].set(got.reshape((n * cap,) + rows.shape[1:]), mode="drop")

    if exchange == "dense":
        return dense(rows, send_offsets, send_sizes, out_offsets, recv_sizes)
    return jax.lax.platform_dependent(rows, send_offsets, send_sizes, out_offsets, recv_sizes,
                                      cuda=ragged, default=dense)


def _all_to_all_body(x, ids, weights, params, *, experts_fn, num_experts, n, exchange="dense"):
    d = jax.lax.axis_index(EXPERT_AXIS)
    e_local = num_experts // n
    tokens, k = ids.shape
    t_local = -(-tokens // n)
    pad = t_local * n - tokens
    if pad:  # (x's arrays: [N, D] rows, or [N] folded-layout token multipliers)
        x = map_rows(x, lambda a: jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1)))
        ids = jnp.pad(ids, ((0, pad), (0, 0)))
        weights = jnp.pad(weights, ((0, pad), (0, 0)))
    start = d * t_local
    my_x = map_rows(x, lambda a: jax.lax.dynamic_slice_in_dim(a, start, t_local))
    raw_ids = jax.lax.dynamic_slice_in_dim(ids, start, t_local).reshape(-1)
    my_ids = raw_ids.astype(jnp.int32)
    my_w = jax.lax.dynamic_slice_in_dim(weights, start, t_local)
    tok_valid = (start + jnp.arange(t_local)) < tokens
    # ids outside [0, E) are ignored, as moe_apply does (a negative one was sent to device 0's experts)
    slot_valid = jnp.repeat(tok_valid, k) & (raw_ids >= 0) & (raw_ids < num_experts)
    slots = t_local * k

    # Sort my slots by destination device (then local expert); exchange sizes and offsets.
    dest = my_ids // e_local
    order, inverse, _ = _sort_local(my_ids, slot_valid, num_experts)
    send_sizes = jnp.bincount(jnp.where(slot_valid, dest, n), length=n + 1)[:n].astype(jnp.int32)
    send_offsets = (jnp.cumsum(send_sizes) - send_sizes).astype(jnp.int32)
    recv_sizes = jax.lax.all_to_all(send_sizes.reshape(n, 1), EXPERT_AXIS, 0, 0, tiled=False).reshape(n)
    cap = slots

    send_e = jnp.take(my_ids, order) % e_local
    recv_valid = (jnp.arange(n * cap) % cap) < jnp.repeat(recv_sizes, cap)
    if exchange == "dense":
        # Fixed layout: my chunk for device j (my sorted slots send_offsets[j] .. + send_sizes[j], zero-padded to
        # cap rows) lands at j's rows [my_index * cap, + cap): one gather from my tokens builds every chunk and the
        # received [n, cap] chunks are the buffer as they come (no scatter, no offsets to exchange).
        lane = jnp.arange(cap, dtype=jnp.int32)[None]
        sent = lane < send_sizes[:, None]                                            # [n, cap]
        pos = jnp.where(sent, send_offsets[:, None] + lane, 0)                      # my sorted slot of each row
        tok = jnp.take(order, pos) // k

        def chunked(a, idx, ok):  # rows idx [n, cap] of a (zero where not ok) through the all_to_all: [n * cap, ...]
            def move(b):
                rows = _take_rows(b, idx, ok)
                return jax.lax.all_to_all(rows, EXPERT_AXIS, 0, 0, tiled=False).reshape((n * cap,) + b.shape[1:])
            return _as_bytes(move, a)

        recv_x = map_rows(my_x, lambda a: chunked(a, tok, sent))
        recv_e = chunked(send_e, pos, sent)
    else:
        send_x = map_rows(my_x, lambda a: jnp.take(a, order // k, axis=0))
        fwd = dict(send_offsets=send_offsets, send_sizes=send_sizes, out_offsets=jnp.full((n,), d * cap, jnp.int32),
                   recv_sizes=recv_sizes, out_rows=n * cap, cap=cap, n=n, exchange=exchange)
        recv_x = _exchange_rows(send_x, **fwd)
        recv_e = _exchange(send_e, **fwd)

    # Compute on my experts.
    order2, inverse2, sizes = _sort_local(recv_e, recv_valid, e_local)
    if exchange == "dense":
        # Sorted rows past the real ones (sum(sizes), about 1/n of the buffer) are padding, zero as before, but
        # without reading the received zero rows from memory
        real = jnp.arange(n * cap) < jnp.sum(sizes)
        y = experts_fn(params, map_rows(recv_x, lambda a: _as_bytes(lambda b: _take_rows(b, order2, real), a)),
                       sizes)
    else:
        y = experts_fn(params, map_rows(recv_x, lambda a: jnp.take(a, order2, axis=0)), sizes)

    # Send results back to where each slot came from, un-sort, combine my tokens.
    if exchange == "dense":
        # Row j of device i's chunk back is my sorted slot send_offsets[i] + j: one gather un-sorts my slots.
        back = chunked(y, inverse2.reshape(n, cap), recv_valid.reshape(n, cap))     # [n * cap, D]
        dest_ok = jnp.clip(dest, 0, n - 1)  # my slot's device (sorted position inverse: row inverse - offset)
        src = dest_ok * cap + inverse - jnp.take(send_offsets, dest_ok)
        y_slots = jnp.take(back, jnp.where(slot_valid, src, 0), axis=0).astype(F32)
    else:
        src_offsets = jax.lax.all_to_all(send_offsets.reshape(n, 1), EXPERT_AXIS, 0, 0, tiled=False).reshape(n)
        arange_n = jnp.arange(n, dtype=jnp.int32)
        y = jnp.where(recv_valid[:, None], jnp.take(y, inverse2, axis=0), 0)
        back = _exchange(y, send_offsets=arange_n * cap, send_sizes=recv_sizes, out_offsets=src_offsets,
                         recv_sizes=send_sizes, out_rows=slots, cap=cap, n=n, exchange=exchange)
        y_slots = jnp.take(back, inverse, axis=0).astype(F32)
    y_slots = jnp.where(slot_valid[:, None], y_slots, 0.0).reshape(t_local, k, y_slots.shape[-1])
    out = jnp.einsum("nkd,nk->nd", y_slots, my_w.astype(F32), precision=jax.lax.Precision.HIGHEST)
    return jax.lax.all_gather(out, EXPERT_AXIS, axis=0, tiled=True)[:tokens]


def moe_apply_ep(x, topk_ids, topk_weights, expert_params: Any, experts_fn: Callable, num_experts: int,
                 ep: ExpertParallel, out_dtype=F32):
    """Expert-parallel :func:`jax_w4a8.moe.moe_apply`.

    Args:
      x: [N, D] expert inputs, replicated over the mesh; or a tuple of arrays of N rows (tokens already
        quantized: fp8 codes [N, D] and scales [N, D/128], or in the folded layout codes [N, D] and token
        multipliers [N]), gathered and exchanged alike (fp8 rows move half the bytes of bf16 ones).
      topk_ids: int [N, K]; topk_weights: float32 [N, K] (replicated).
      expert_params: a pytree whose every leaf has the expert axis first ([E, ...]), sharded over
        ``"expert"`` (or placeable so).
      experts_fn: ``(local_params, x_sorted [R, D] (or the tuple), group_sizes int32 [E/n]) -> [R, D]``; rows past
        ``sum(group_sizes)`` are padding (their outputs are ignored).
      num_experts: E, a multiple of the expert-axis size.
      ep: :class:`ExpertParallel`.
    Returns:
      out_dtype [N, D], replicated.
    """
    n = ep.size
    topk_ids, topk_weights = moe.check_moe_args(x, topk_ids, topk_weights, num_experts)
    if num_experts % n:
        raise ValueError(f"moe_apply_ep: argument 'num_experts' ({num_experts}) must divide over the expert axis "
                         f"of size {n}")
    rows = x[0] if isinstance(x, tuple) else x
    if rows.shape[0] == 0 or topk_ids.shape[1] == 0:  # nothing to route (collectives reject empty operands)
        return jnp.zeros(rows.shape, out_dtype)
    if ep.strategy(rows.shape[0]) == "gather":
        body = _gather_body
    else:
        body = functools.partial(_all_to_all_body, exchange=ep.exchange)
    fn = jax.shard_map(
        lambda a, b, c, p: body(a, b, c, p, experts_fn=experts_fn, num_experts=num_experts, n=n),
        mesh=ep.mesh, in_specs=(P(), P(), P(), P(EXPERT_AXIS)), out_specs=P(), check_vma=False)
    return fn(x, topk_ids, topk_weights, expert_params).astype(out_dtype)
