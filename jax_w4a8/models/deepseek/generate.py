"""Text generation for :class:`DeepseekV3ForCausalLM`: prefill and decode over an MLA latent cache.

    from jax_w4a8.models.deepseek.generate import generate
    new_tokens = generate(model, [[0, 17, 52], [0, 9]], 32, temperature=0.7, top_p=0.9, eos_token_id=1)
    # -> [[...up to 32 ids...], [...]]: the new tokens of each prompt, ending with its EOS if one was emitted

The cache (:class:`MLACache`) holds, per layer, one array [B, T_max, kv_lora_rank + qk_rope_head_dim]: the
normed latent ``c_kv`` and the roped shared key ``k_pe`` of every token (576 values per token and layer for
DeepSeek-V3, 1152 bytes in bf16, instead of 32,832 values for expanded keys and values).

Batching. Prompts of different lengths are **left-padded** to a common length ``T_b``, the power-of-two
bucket of the longest prompt (:func:`length_bucket`): row ``b`` starts with ``pad[b] = T_b - len_b`` pad
slots, and slot ``s`` of row ``b`` holds position ``s - pad[b]`` (RoPE uses that position). Pad slots hold
zeros and are masked out of every attention, so a row's tokens do not depend on the other rows (up to the order of
floating-point sums). Every row writes its next token into the same slot, so one decode step serves the
whole batch.

Compilation. Prefill (one forward over ``[B, T_b]``, expanded attention as ``model.set_attention`` says,
latents written into the cache, first token sampled) and the decode step (one token per row, absorbed
attention over the cache, next token sampled) are each one ``jax.jit`` with the cache donated. They compile once per
(model structure, batch, ``T_b``, cache length, sampling mode); calling :func:`generate` again with prompts
in the same bucket compiles nothing. The cache length is ``T_b + max_new_tokens - 1`` rounded up by
:func:`cache_bucket`.

Decode uses MLA's absorbed form (:meth:`layers.MLA.attend_absorbed`): ``q_nope`` is absorbed into the latent
space through the k part of ``kv_b_proj`` (``"bhd,hrd->bhr"``), attention runs over the cached latents, then
the v part (``"bhr,hdr->bhd"``) and ``o_proj``; with FP8 ``kv_b_proj`` blocks both per-head products are
``ops.fp8_einsum`` calls (a tiny model whose head dims are not multiples of 128 falls back to a plain
einsum of the dequantized weights).

Sampling (:func:`filter_logits`, :func:`sample_tokens`): greedy when ``temperature == 0``; otherwise the
logits are divided by the temperature, then top-k, then top-p (nucleus) filtering, then a categorical draw
with the key ``fold_in(key(seed), step)`` (:func:`seed_key`), one draw over the whole ``[B, V]`` block: the same
seed gives the same tokens for the same prompts in the same order, and a prompt's samples depend on the batch it
runs in (its row, the other prompts). Token ids are always in
``[0, vocab_size)``: non-finite logits are sanitised before the choice (NaN -> -inf), and the id is clipped.
``check_finite=True`` adds one reduction per step and raises :class:`NonFiniteLogitsError` naming the first
step and sequence whose logits held a NaN or an infinity.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import time
import warnings
import weakref
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_w4a8.models.deepseek import layers
from jax_w4a8.models.deepseek.model import DeepseekV3ForCausalLM

__all__ = ["generate", "Generator", "MLACache", "DecodeState", "GenerateStats", "NonFiniteLogitsError",
           "filter_logits", "sample_tokens", "length_bucket", "cache_bucket", "forward_cached",
           "absorbed_weights", "compile_counter", "seed_key"]

F32 = jnp.float32


class NonFiniteLogitsError(FloatingPointError):
    """Logits with a NaN or an infinity (``check_finite=True``): ``step`` is the index of the new token
    being chosen (0 = from the prefill logits), ``sequence`` the row of the batch."""

    def __init__(self, step: int, sequence: int, n_bad: int = 1):
        self.step, self.sequence = step, sequence
        more = f" (and {n_bad - 1} more sequence(s))" if n_bad > 1 else ""
        super().__init__(f"generate: non-finite logits at step {step} (choosing new token {step}) in "
                         f"sequence {sequence}{more}")


# ----------------------------------------------------------------------------------------------
# buckets
# ----------------------------------------------------------------------------------------------
def length_bucket(n: int, minimum: int = 8) -> int:
    """The prompt-length bucket of a prompt of ``n`` tokens: the next power of two >= max(n, minimum)."""
    n = max(int(n), int(minimum), 1)
    return 1 << (n - 1).bit_length()


def cache_bucket(n: int) -> int:
    """Cache length for ``n`` slots: the next power of two up to 1024, then the next multiple of 1024."""
    n = max(int(n), 1)
    return length_bucket(n, 1) if n <= 1024 else -(-n // 1024) * 1024


# ----------------------------------------------------------------------------------------------
# cache and per-step state
# ----------------------------------------------------------------------------------------------
class MLACache(NamedTuple):
    """The MLA latent cache of a batch (a pytree; donated to every step).

    Attributes:
      kv: per layer, [B, T_max, kv_lora_rank + qk_rope_head_dim] (bf16 by default): slot ``s`` holds
        ``[c_kv (normed latent) | k_pe (roped shared key)]`` of the token at position ``s - pad[b]``.
      pad: int32 [B]: leading pad slots of each row (left padding), masked out of attention.
      length: int32 []: slots filled so far (the same for every row); the next token goes to slot ``length``.
    """

    kv: tuple
    pad: jax.Array
    length: jax.Array

    @property
    def bytes_per_token_per_layer(self) -> int:
        return int(self.kv[0].shape[-1] * self.kv[0].dtype.itemsize)


class DecodeState(NamedTuple):
    """Per-row state between steps (device arrays).

    Attributes:
      tokens: int32 [B]: the token chosen at the last step (fed to the next step).
      active: bool [B]: ``tokens[b]`` is a real new token of row b (False once the row had finished).
      done: bool [B]: row b has emitted an EOS (at this step or before).
      bad_step: int32 [B]: first step whose logits were not finite (``check_finite``), -1 if none.
      step: int32 []: index of the last chosen token (0 = chosen from the prefill logits).
    """

    tokens: jax.Array
    active: jax.Array
    done: jax.Array
    bad_step: jax.Array
    step: jax.Array


@dataclasses.dataclass(frozen=True)
class _Mode:
    """The static (compile-time) part of the sampling configuration."""

    greedy: bool
    top_k: bool
    top_p: bool
    check_finite: bool


# ----------------------------------------------------------------------------------------------
# sampling
# ----------------------------------------------------------------------------------------------
def filter_logits(logits, top_k=None, top_p=None):
    """Top-k, then top-p (nucleus) filtering: removed entries become ``-inf``.

    * top-k keeps the tokens whose logit is >= the k-th largest logit of the row (ties with the k-th are
      kept, as in transformers' ``TopKLogitsWarper``); ``k`` is clipped to [1, V].
    * top-p keeps the smallest set of most probable tokens (probabilities from the softmax of the row
      *after* top-k) whose cumulative probability reaches ``top_p``: sorted by decreasing probability,
      token i is kept iff the probability of the tokens before it is < ``top_p``; the most probable token is
      always kept, tokens tied with the last kept one are kept too, and ``top_p >= 1`` keeps everything.

    Args:
      logits: float [B, V] (already divided by the temperature).
      top_k: None, or an int (Python or a traced int32 scalar).
      top_p: None, or a float in (0, 1] (Python or a traced float32 scalar).
    Returns:
      float32 [B, V].
    """
    logits = jnp.asarray(logits, F32)
    if top_k is None and top_p is None:
        return logits
    v = logits.shape[-1]
    srt = -jnp.sort(-logits, axis=-1)                                       # descending
    if top_k is not None:
        if isinstance(top_k, (int, np.integer)):   # clipped on the host: as int32, 2**33 would wrap to 0
            top_k = min(int(top_k), v)
        k = jnp.clip(jnp.asarray(top_k, jnp.int32), 1, v)
        kth = jax.lax.dynamic_index_in_dim(srt, k - 1, axis=-1, keepdims=True)   # [B, 1]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
        srt = jnp.where(srt < kth, -jnp.inf, srt)
    if top_p is not None:
        p = jnp.asarray(top_p, F32)
        probs = jax.nn.softmax(srt, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs
        keep = (before < p) | (jnp.arange(v) == 0) | (p >= 1)
        thresh = jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < thresh, -jnp.inf, logits)
    return logits


def sample_tokens(logits, key, *, temperature=0.0, top_k=None, top_p=None, greedy: bool | None = None):
    """Chooses one token per row. ``logits`` float [B, V] -> int32 [B] in [0, V).

    Greedy (argmax; the lowest id among exact ties) when ``greedy`` (default: ``temperature == 0``, which
    then must be a Python number); else ``categorical(key, filter_logits(logits / temperature, top_k,
    top_p))``. NaN logits count as ``-inf`` and +inf as the largest float, so the id is always valid.
    """
    v = logits.shape[-1]
    logits = jnp.nan_to_num(jnp.asarray(logits, F32), nan=-jnp.inf, posinf=jnp.finfo(F32).max,
                            neginf=-jnp.inf)
    if greedy is None:
        greedy = float(temperature) == 0.0
    if greedy:
        tok = jnp.argmax(logits, axis=-1)
    else:
        x = filter_logits(logits / jnp.asarray(temperature, F32), top_k, top_p)
        tok = jax.random.categorical(key, x, axis=-1)
    return jnp.clip(tok, 0, v - 1).astype(jnp.int32)


SEED_LIMIT = 2**63     # seeds are ints in [0, SEED_LIMIT) (the CLI's --seed too)


def _integer(v) -> int | None:
    """``v`` as an int when it is one: a Python or NumPy integer, or a 0-d NumPy / JAX integer array (not a
    bool); None otherwise (floats are not truncated)."""
    if isinstance(v, (bool, np.bool_)):
        return None
    if isinstance(v, (int, np.integer)):
        return int(v)
    dt = getattr(v, "dtype", None)
    if getattr(v, "ndim", None) == 0 and dt is not None and np.issubdtype(dt, np.integer):
        return int(v)
    return None


def seed_key(seed) -> jax.Array:
    """The sampling key of ``seed``, an int in ``[0, 2**63)``: ``jax.random.key(seed)`` as with 64-bit ints on,
    so distinct seeds give distinct keys (with them off, ``key`` keeps only the low 32 bits: ``2**32 + 5`` would be
    ``5``). Seeds below ``2**32`` get the key they always had. A NumPy or 0-d JAX integer works as its value.
    Returns a scalar typed key (``jax.random.key``'s, shape ``()``). Raises ValueError naming ``seed`` otherwise (a
    bool, a float, a negative int: ``-1`` would be ``2**32 - 1``)."""
    value = _integer(seed)
    if value is None or not 0 <= value < SEED_LIMIT:
        raise ValueError(f"generate: seed must be an int in [0, 2**63), got {seed!r}")
    if value < 2**32:
        return jax.random.key(value)
    with jax.enable_x64(True):                 # key data [value >> 32, value & 0xFFFFFFFF]
        return jax.random.key(value)


def _choose(mode: _Mode, logits, key, sampling, step, prev: DecodeState | None):
    """Sampling + EOS + finiteness bookkeeping for one step: logits [B, V] -> DecodeState."""
    b = logits.shape[0]
    temperature, top_k, top_p, eos = sampling
    tok = sample_tokens(logits, jax.random.fold_in(key, step), temperature=temperature,
                        top_k=top_k if mode.top_k else None, top_p=top_p if mode.top_p else None,
                        greedy=mode.greedy)
    was_done = jnp.zeros((b,), bool) if prev is None else prev.done
    bad_step = jnp.full((b,), -1, jnp.int32) if prev is None else prev.bad_step
    if mode.check_finite:
        bad = ~jnp.isfinite(logits).all(axis=-1)                              # the one reduction
        bad_step = jnp.where((bad_step < 0) & bad & ~was_done, step, bad_step)
    is_eos = (tok[:, None] == eos[None, :]).any(axis=-1)         # eos: int32 [n], padded with -1
    return DecodeState(tok, ~was_done, was_done | is_eos, bad_step, jnp.asarray(step, jnp.int32))


# ----------------------------------------------------------------------------------------------
# the cached forward
# ----------------------------------------------------------------------------------------------
def absorbed_weights(model: DeepseekV3ForCausalLM) -> list[dict]:
    """Per layer :meth:`layers.MLA.absorbed_weights` (``kv_b_proj`` split per head for decoding)."""
    return [layer.self_attn.absorbed_weights() for layer in model.model.layers]


def forward_cached(model: DeepseekV3ForCausalLM, input_ids, cache: MLACache, absorbed=None, *,
                   prefill: bool = False):
    """Runs ``input_ids`` [B, T] at slots ``cache.length .. cache.length + T - 1``; returns the float32
    logits [B, V] of the **last** slot and the cache with those T slots written and ``length += T``.

    ``prefill=True`` (the cache must be empty, ``length == 0``): attention over the T new tokens only, in
    transformers' expanded form (:meth:`layers.MLA.attend`). Otherwise: absorbed attention over the whole
    cache (:meth:`layers.MLA.attend_absorbed`, ``absorbed`` from :func:`absorbed_weights`). Pad slots
    (``s < pad[b]``) are masked out and hold zeros; query t sees slots up to its own.

    The T slots must lie inside the cache (``length + T <= T_max``): ``lax.dynamic_update_slice`` clamps the start,
    so a write past the end would silently overwrite the last slots. Nothing here checks it (the length is on the
    device); :meth:`Generator.prefill` and :meth:`Generator.decode` do.
    """
    cfg, dtype = model.cfg, model.dtype
    b, t = input_ids.shape
    r = cfg.kv_lora_rank
    start = cache.length
    slots = start + jnp.arange(t, dtype=jnp.int32)                                     # [T]
    real = slots[None, :] >= cache.pad[:, None]                                       # [B, T] not a pad slot
    positions = jnp.maximum(slots[None, :] - cache.pad[:, None], 0)                  # [B, T]
    cos, sin = layers.rope_cos_sin(positions, cfg, dtype)
    if prefill:
        keys = jnp.arange(t, dtype=jnp.int32)
    else:
        keys = jnp.arange(cache.kv[0].shape[1], dtype=jnp.int32)
    mask = (keys[None, None, :] <= slots[None, :, None]) & (keys[None, None, :] >= cache.pad[:, None, None])
    h = model.model.embed_tokens(input_ids)
    new_kv = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q_nope, q_pe, c_kv, k_pe = attn.project(x, cos, sin)
        # pad slots hold zeros: masked keys get probability 0, and 0 * (non-finite pad latent) would be NaN
        c_kv, k_pe = jnp.where(real[..., None], c_kv, 0), jnp.where(real[..., None], k_pe, 0)
        kv_dtype = cache.kv[i].dtype
        entry = jnp.concatenate([c_kv.astype(kv_dtype), k_pe.astype(kv_dtype)], axis=-1)
        kv = jax.lax.dynamic_update_slice(cache.kv[i], entry, (jnp.int32(0), start, jnp.int32(0)))
        new_kv.append(kv)
        if prefill:
            a = attn.attend(q_nope, q_pe, c_kv, k_pe, mask, causal=True)   # left padding, then causal
        else:
            a = attn.attend_absorbed(q_nope, q_pe, kv[..., :r], kv[..., r:], mask,
                                     None if absorbed is None else absorbed[i])
        h = h + a
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    h = model.model.norm(h[:, -1:])
    logits = model.model.embed_tokens.attend(h) if model.lm_head is None else model.lm_head(h)
    return logits[:, 0].astype(F32), MLACache(tuple(new_kv), cache.pad, start + t)


class _Structure:
    """The static half of a split model (graphdef + state treedef) as one jit static argument whose hash is
    computed once: hashing a 61-layer nnx GraphDef takes milliseconds, too slow for every decode step."""

    __slots__ = ("graphdef", "treedef", "_hash")

    def __init__(self, graphdef, treedef):
        self.graphdef, self.treedef = graphdef, treedef
        self._hash = hash((graphdef, treedef))

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return (self is other or isinstance(other, _Structure) and self._hash == other._hash
                and self.treedef == other.treedef and self.graphdef == other.graphdef)

    def merge(self, leaves):
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, leaves))


@functools.partial(jax.jit, static_argnums=0)
def _absorb(structure: _Structure, leaves):
    return absorbed_weights(structure.merge(leaves))


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(4,))
def _prefill(structure: _Structure, mode: _Mode, leaves, input_ids, cache, key, sampling):
    logits, cache = forward_cached(structure.merge(leaves), input_ids, cache, prefill=True)
    return cache, _choose(mode, logits, key, sampling, jnp.int32(0), None)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(4,))
def _decode(structure: _Structure, mode: _Mode, leaves, absorbed, cache, state: DecodeState, key, sampling):
    logits, cache = forward_cached(structure.merge(leaves), state.tokens[:, None], cache, absorbed)
    return cache, _choose(mode, logits, key, sampling, state.step + 1, state)


# ----------------------------------------------------------------------------------------------
# compile-time accounting (for the stats; jax.monitoring listeners are process-wide)
# ----------------------------------------------------------------------------------------------
_COMPILE_EVENTS = ("/jax/core/compile/backend_compile_duration", "/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration")
_compile_lock = threading.Lock()
_compile_total = [0.0, 0]           # seconds, backend compilations
_listening = [False]
_recent: list[list[float]] = []     # [start, end] of the latest compile events, disjoint, in time order


def _count_interval(start: float, end: float) -> None:
    """Adds the part of [start, end] not yet counted to ``_compile_total[0]``. JAX reports a jit traced inside
    another one (every ``jnp`` function that is itself a jit) with its own event, and the outer trace's
    duration includes it: counted as a union of intervals, nested time counts once (summed, it made the
    subtracted compile time exceed the wall time of a short prefill)."""
    while _recent and _recent[-1][1] > start:          # overlaps (a nested event ended inside this one)
        s, e = _recent.pop()
        _compile_total[0] -= e - s
        start = min(start, s)
        end = max(end, e)
    _recent.append([start, end])
    _compile_total[0] += end - start
    del _recent[:-64]                                  # older events end before any new one starts


def _on_event(event: str, duration: float, **_):
    if event in _COMPILE_EVENTS:
        end = time.perf_counter()
        with _compile_lock:
            _count_interval(end - duration, end)
            if event == _COMPILE_EVENTS[0]:
                _compile_total[1] += 1


def compile_counter() -> tuple[float, int]:
    """(seconds spent tracing, lowering and compiling, number of backend compilations) in this process since
    the first call (a jax.monitoring listener, registered on first use)."""
    if not _listening[0]:
        with _compile_lock:
            if not _listening[0]:
                jax.monitoring.register_event_duration_secs_listener(_on_event)
                _listening[0] = True
    with _compile_lock:
        return _compile_total[0], _compile_total[1]


# ----------------------------------------------------------------------------------------------
# driver
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class GenerateStats:
    """Timings of one :func:`generate` call (seconds; compile time is measured through jax.monitoring and
    subtracted from the phase it happened in)."""

    batch: int = 0
    prompt_tokens: int = 0          # real (unpadded) prompt tokens
    prefill_bucket: int = 0         # T_b
    cache_len: int = 0              # T_max
    prefill_s: float = 0.0
    decode_steps: int = 0           # decode steps run (tokens after the first, per row)
    decode_tokens: int = 0          # real new tokens produced by the decode steps (all rows)
    decode_s: float = 0.0
    compile_s: float = 0.0
    compilations: int = 0
    new_tokens: int = 0             # all real new tokens (incl. the one from the prefill logits)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("nan")

    @property
    def decode_step_s(self) -> float:
        return self.decode_s / self.decode_steps if self.decode_steps else float("nan")


def _token_ids(r, what: str) -> np.ndarray:
    a = np.asarray(r)
    if a.size and not np.issubdtype(a.dtype, np.integer):  # 1.5 is no token id: never truncated silently
        raise TypeError(f"generate: {what} must hold integer token ids, got dtype {a.dtype}")
    return a


def _as_rows(prompts, vocab: int) -> list[list[int]]:
    if isinstance(prompts, (np.ndarray, jax.Array)):
        arr = _token_ids(prompts, "prompts")
        if arr.ndim != 2:
            raise ValueError(f"generate: prompts must be a [B, T] array or a list of token lists, got shape "
                             f"{arr.shape}")
        rows = [list(map(int, r)) for r in arr]
    else:
        rows = []
        for i, r in enumerate(prompts):
            a = _token_ids(r, f"prompt {i}")
            if a.ndim == 0:      # [0, 5, 77] is one prompt written flat, not three one-token prompts
                raise ValueError(f"generate: prompts must be a [B, T] array or a list of token lists; prompt {i} "
                                 f"is the single id {r!r} (one prompt is [[...]])")
            if a.ndim > 1:       # a [B, T] batch inside the list: flattened, B prompts would run as one
                raise ValueError(f"generate: prompts must be a [B, T] array or a list of token lists; prompt {i} "
                                 f"has shape {a.shape} (a [B, T] array is passed as prompts itself)")
            rows.append(list(map(int, a)))
    if not rows:
        raise ValueError("generate: no prompts")
    for i, r in enumerate(rows):
        if not r:
            raise ValueError(f"generate: prompt {i} is empty (needs at least one token, e.g. BOS)")
        bad = [x for x in r if not 0 <= x < vocab]
        if bad:
            raise ValueError(f"generate: prompt {i} holds token id {bad[0]} outside [0, {vocab})")
    return rows


def _check_args(vocab: int, prompts, max_new_tokens, temperature, top_k, top_p, eos_token_id, seed, stream,
                pad_token_id):
    """:func:`generate`'s arguments checked, before anything compiles (ValueError / TypeError naming the bad
    one): ``(rows, max_new_tokens, pad_token_id, key, eos ids)``."""
    rows = _as_rows(prompts, vocab)
    n = _integer(max_new_tokens)          # 2.5 is no count, nor True: neither is truncated
    if n is None or n < 0:
        raise ValueError(f"generate: max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if not (isinstance(temperature, (int, float, np.integer, np.floating)) and math.isfinite(temperature)
            and temperature >= 0):
        raise ValueError(f"generate: temperature must be a finite number >= 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1):
        raise ValueError(f"generate: top_k must be an int >= 1 or None, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float, np.integer, np.floating)) and 0 < top_p <= 1):
        raise ValueError(f"generate: top_p must be in (0, 1] or None, got {top_p!r}")  # NaN fails the test
    pad = _integer(pad_token_id)
    if pad is None or not 0 <= pad < vocab:
        raise ValueError(f"generate: pad_token_id must be an int in [0, {vocab}), got {pad_token_id!r}")
    if stream is not None and not callable(stream):
        raise TypeError(f"generate: stream must be a function stream(tokens, active) or None, got {stream!r}")
    eos = _eos_tuple(eos_token_id)
    return rows, n, pad, seed_key(seed), eos


def _eos_tuple(eos) -> tuple:
    """``eos_token_id`` (None, an int, a numpy or 0-d jax integer, or a sequence of them) as a tuple of ints;
    TypeError for a value that is not an integer (a float is not truncated), ValueError for an id outside int32
    (the ids are compared as int32)."""
    if eos is None:
        return ()
    one = getattr(eos, "ndim", None) == 0 or not hasattr(eos, "__iter__")
    ids = tuple(_integer(e) for e in ((eos,) if one else eos))
    if None in ids:
        raise TypeError(f"generate: eos_token_id must be an integer id or a sequence of them, got {eos!r}")
    bad = [e for e in ids if not -2**31 <= e < 2**31]
    if bad:
        raise ValueError(f"generate: eos_token_id {bad[0]} is outside the int32 range")
    return ids


class Generator:
    """A model split once for repeated prefill / decode calls; :func:`generate` makes one per call.

    The weights (and ``kv_b_proj``'s absorbed per-head split) are read when the Generator is made: make a
    new one after changing the model's weights.

    The Generator counts on the host the slots filled in each cache it made (:meth:`init_cache`) or returned
    (:meth:`prefill`, :meth:`decode`), so those refuse to write past the end of such a cache without reading
    the device's ``cache.length``. A cache made otherwise (an ``MLACache`` built by hand) is not checked.

    Args:
      model: :class:`DeepseekV3ForCausalLM`.
      cache_dtype: dtype of the latent cache; default bfloat16, or float32 for a float32 model (golden
        comparisons).
    """

    def __init__(self, model: DeepseekV3ForCausalLM, *, cache_dtype=None):
        self.model, self.cfg = model, model.cfg
        self.cache_dtype = jnp.dtype(cache_dtype if cache_dtype is not None else
                                     (jnp.float32 if model.dtype == jnp.float32 else jnp.bfloat16))
        graphdef, state = nnx.split(model)
        self.leaves, treedef = jax.tree.flatten(state)
        self.structure = _Structure(graphdef, treedef)
        self.absorbed = _absorb(self.structure, self.leaves)
        self._filled: dict[int, tuple] = {}      # id(cache.length) -> (weakref to it, slots filled)

    def _note(self, cache: MLACache, filled: int) -> MLACache:
        """Records on the host that ``cache`` has ``filled`` slots (forgotten when its length array is freed)."""
        k, filled_ = id(cache.length), self._filled
        filled_[k] = (weakref.ref(cache.length, lambda _: filled_.pop(k, None)), filled)
        return cache

    def _check_room(self, cache: MLACache, n: int, what: str) -> int | None:
        """Slots filled in ``cache`` if this Generator knows it (else None); ValueError when ``n`` more slots do
        not fit."""
        entry = self._filled.get(id(cache.length))
        if entry is None or entry[0]() is not cache.length:
            return None
        filled, cap = entry[1], cache.kv[0].shape[1]
        if filled + n > cap:
            if filled == cap:
                raise ValueError(f"Generator.{what}: the cache is full: all {cap} slots are filled (init_cache("
                                 f"batch, cache_len) needs cache_len >= prompt bucket + new tokens - 1)")
            raise ValueError(f"Generator.{what}: {n} tokens do not fit a cache of {cap} slots with {filled} "
                             f"filled")
        return filled

    # -- pieces ----------------------------------------------------------------------------------
    def init_cache(self, batch: int, cache_len: int, pad=None) -> MLACache:
        """An empty cache: per layer zeros [batch, cache_len, kv_lora_rank + qk_rope_head_dim]."""
        c = self.cfg
        width = c.kv_lora_rank + c.qk_rope_head_dim
        pad = jnp.zeros((batch,), jnp.int32) if pad is None else jnp.asarray(pad, jnp.int32)
        kv = tuple(jnp.zeros((batch, cache_len, width), self.cache_dtype) for _ in range(c.num_hidden_layers))
        return self._note(MLACache(kv, pad, jnp.zeros((), jnp.int32)), 0)

    @staticmethod
    def mode(temperature=0.0, top_k=None, top_p=None, check_finite=False) -> _Mode:
        """The static sampling configuration (one compilation each): greedy or not, which filters are on (none
        when greedy, which ignores them), whether the finiteness reduction runs."""
        greedy = float(temperature) == 0.0
        return _Mode(greedy, top_k is not None and not greedy, top_p is not None and not greedy, bool(check_finite))

    @staticmethod
    def sampling(temperature=0.0, top_k=None, top_p=None, eos_token_id=None):
        """The traced sampling parameters (changing them compiles nothing): temperature, top_k, top_p and the
        EOS ids (int32, padded with -1 to a multiple of 4). A top_k past int32 is cut to its largest value
        (:func:`filter_logits` clips it to the vocabulary), never wrapped."""
        eos = _eos_tuple(eos_token_id)
        n = max(4, -(-len(eos) // 4) * 4)
        top_k = 0 if top_k is None else min(int(top_k), 2**31 - 1)
        return (jnp.asarray(max(float(temperature), 1e-6), F32), jnp.asarray(top_k, jnp.int32),
                jnp.asarray(1.0 if top_p is None else top_p, F32),
                jnp.asarray(list(eos) + [-1] * (n - len(eos)), jnp.int32))

    def prefill(self, input_ids, cache: MLACache, mode: _Mode, key, sampling):
        """``input_ids`` int32 [B, T] (left-padded, ``cache.pad``) into an empty cache; chooses token 0.
        Returns ``(cache, DecodeState)``; the cache argument is donated. Raises ValueError, before running,
        when the T tokens do not fit the cache or it is not empty (for a cache this Generator counts)."""
        t = input_ids.shape[1]
        filled = self._check_room(cache, t, "prefill")
        if filled:
            raise ValueError(f"Generator.prefill: the cache must be empty, {filled} slots are filled")
        cache, state = _prefill(self.structure, mode, self.leaves, input_ids, cache, key, sampling)
        return (cache, state) if filled is None else (self._note(cache, t), state)  # a cache it counts stays counted

    def decode(self, cache: MLACache, state: DecodeState, mode: _Mode, key, sampling):
        """One decode step: feeds ``state.tokens`` into slot ``cache.length``, chooses the next token. Returns
        ``(cache, DecodeState)``; the cache argument is donated. Raises ValueError, before running, when every
        slot of the cache is filled (for a cache this Generator counts: the write would overwrite the last slot)."""
        filled = self._check_room(cache, 1, "decode")
        cache, state = _decode(self.structure, mode, self.leaves, self.absorbed, cache, state, key, sampling)
        return (cache, state) if filled is None else (self._note(cache, filled + 1), state)

    # -- the loop --------------------------------------------------------------------------------
    def generate(self, prompts, max_new_tokens: int, *, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, eos_token_id=None, seed: int = 0,
                 stream: Callable[[np.ndarray, np.ndarray], None] | None = None, check_finite: bool = False,
                 pad_token_id: int = 0, sync_every: int = 16, return_stats: bool = False):
        """See :func:`generate`."""
        rows, max_new_tokens, pad_token_id, key, eos = _check_args(
            self.cfg.vocab_size, prompts, max_new_tokens, temperature, top_k, top_p, eos_token_id, seed, stream,
            pad_token_id)
        b = len(rows)
        lens = [len(r) for r in rows]
        positions = max(lens) + max(max_new_tokens, 1) - 1      # the last new token is never fed
        if positions > self.cfg.max_position_embeddings:
            warnings.warn(f"generate: up to {positions} positions, more than the model's "
                          f"max_position_embeddings ({self.cfg.max_position_embeddings})", stacklevel=3)
        t_b = length_bucket(max(lens))
        cache_len = cache_bucket(t_b + max(max_new_tokens, 1) - 1)
        stats = GenerateStats(batch=b, prompt_tokens=sum(lens), prefill_bucket=t_b, cache_len=cache_len)
        out: list[list[int]] = [[] for _ in range(b)]
        if max_new_tokens == 0:
            return (out, stats) if return_stats else out

        ids = np.full((b, t_b), pad_token_id, np.int32)
        for i, r in enumerate(rows):
            ids[i, t_b - len(r):] = r
        pad = np.asarray([t_b - n for n in lens], np.int32)
        mode = self.mode(temperature, top_k, top_p, check_finite)
        sampling = self.sampling(temperature, top_k, top_p, eos)

        c0, n0 = compile_counter()
        t0 = time.perf_counter()
        cache = self.init_cache(b, cache_len, pad)
        cache, state = self.prefill(jnp.asarray(ids), cache, mode, key, sampling)
        jax.block_until_ready(state.tokens)
        c1, n1 = compile_counter()
        t1 = time.perf_counter()
        stats.prefill_s = max(t1 - t0 - (c1 - c0), 0.0)

        steps = [state]
        pending = [state]                 # states not yet handed to the host

        def sync() -> bool:
            """Copies pending states to the host (stream, finiteness); True when every row is done."""
            host = jax.device_get([(s.tokens, s.active, s.done, s.bad_step) for s in pending])
            pending.clear()
            for tok, act, done, bad in host:
                if check_finite and (bad >= 0).any():
                    rows_bad = np.nonzero(bad >= 0)[0]
                    first = rows_bad[np.argmin(bad[rows_bad])]
                    raise NonFiniteLogitsError(int(bad[first]), int(first), len(rows_bad))
                if stream is not None:
                    stream(np.asarray(tok), np.asarray(act))
            return bool(host[-1][2].all()) if host else False

        finished = sync() if (stream is not None or check_finite or max_new_tokens == 1) else False
        for i in range(1, max_new_tokens):
            if finished:
                break
            cache, state = self.decode(cache, state, mode, key, sampling)
            steps.append(state)
            pending.append(state)
            if stream is not None or i % sync_every == 0 or i == max_new_tokens - 1:
                finished = sync()
        if pending:
            sync()
        host = jax.device_get([(s.tokens, s.active) for s in steps])
        t2 = time.perf_counter()
        c2, n2 = compile_counter()
        stats.decode_s = max(t2 - t1 - (c2 - c1), 0.0)
        stats.compile_s, stats.compilations = c2 - c0, n2 - n0
        stats.decode_steps = len(steps) - 1
        for j, (tok, act) in enumerate(host):
            for r in np.nonzero(act)[0]:
                out[r].append(int(tok[r]))
                stats.new_tokens += 1
                if j:
                    stats.decode_tokens += 1
        return (out, stats) if return_stats else out


def generate(model: DeepseekV3ForCausalLM, prompts, max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, eos_token_id=None, seed: int = 0,
             stream: Callable[[np.ndarray, np.ndarray], None] | None = None, check_finite: bool = False,
             pad_token_id: int = 0, cache_dtype=None, return_stats: bool = False):
    """Generates up to ``max_new_tokens`` new tokens for each prompt.

    Args:
      model: :class:`DeepseekV3ForCausalLM` (any :class:`QuantConfig`, bf16 or fp32 activations).
      prompts: an int [B, T] array, or a list of B token-id lists of any (non-zero) lengths; ids in
        ``[0, vocab_size)``. Batched with left padding (module docstring).
      max_new_tokens: the most new tokens per prompt.
      temperature: 0 = greedy (argmax); > 0 samples from ``softmax(logits / temperature)`` after top-k and
        top-p filtering (:func:`filter_logits`).
      top_k, top_p: None (off), or the usual filters (only used when sampling).
      eos_token_id: None (never stop early), an id (an int, a numpy or 0-d jax integer), or a sequence of ids:
        a row stops after emitting one.
      seed: the sampling seed, an int in ``[0, 2**63)`` (:func:`seed_key`; distinct seeds, distinct keys). The
        same seed, settings and batch of prompts **in the same order** give the same tokens. One key per step
        draws the whole ``[B, V]`` block, so a prompt's samples depend on the batch it runs in: its row, and
        the other prompts (alone, or in another row, it gets other samples).
      stream: called after every step as ``stream(tokens, active)``: ``tokens`` int32 numpy [B] are the
        tokens chosen at this step, ``active`` bool numpy [B] says which of them are real new tokens (False
        for rows that had already finished). The first call carries the token chosen from the prefill.
      check_finite: raise :class:`NonFiniteLogitsError` (naming the step and the sequence) when a row's
        logits hold a NaN or an infinity; one extra reduction per step. Without it, non-finite logits still
        give valid ids (NaN counts as -inf).
      pad_token_id: the id placed in pad slots (masked, so any valid id works).
      cache_dtype: latent cache dtype (default bf16; fp32 for an fp32 model).
      return_stats: also return a :class:`GenerateStats`.
    Returns:
      ``list[list[int]]``: for each prompt, its new tokens (not the prompt), in order; a row that emitted an
      EOS ends with that EOS id; every id is in ``[0, vocab_size)``. With ``return_stats``:
      ``(tokens, GenerateStats)``.
    Raises:
      ValueError (before anything compiles): a bad setting (max_new_tokens not an int >= 0, temperature,
      top_k, top_p, pad_token_id, a seed outside ``[0, 2**63)``, an ``eos_token_id`` outside int32), an empty
      prompt, an id outside the vocabulary, or a flat list of ids (``[0, 5, 77]``: one prompt is
      ``[[0, 5, 77]]``), or a [B, T] array inside the list. TypeError: non-integer token ids or EOS ids, a
      ``stream`` that is not callable. Warns when the prompt and new tokens need more than
      ``max_position_embeddings`` positions (``len(prompt) + max_new_tokens - 1``).
    """
    rows = _check_args(model.cfg.vocab_size, prompts, max_new_tokens, temperature, top_k, top_p, eos_token_id, seed,
                       stream, pad_token_id)[0]   # before the Generator, which compiles (kv_b_proj's absorbed split)
    gen = Generator(model, cache_dtype=cache_dtype)
    return gen.generate(rows, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                        eos_token_id=eos_token_id, seed=seed, stream=stream, check_finite=check_finite,
                        pad_token_id=pad_token_id, return_stats=return_stats)
