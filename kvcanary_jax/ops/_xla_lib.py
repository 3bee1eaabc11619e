"""Array-level building blocks of the vectorised XLA implementations (plain ``jnp`` / ``lax``).

Everything here runs on any XLA backend (CPU, GPU, TPU) and is jittable; nothing here validates.

* :func:`take` — a masked gather that never reads outside its array, empty arrays included
  (XLA refuses a gather from a zero-sized operand at trace time, so that case is static).
* :func:`canary_fields` / :func:`canary_store` — fields 0-3 of canary slots, read from and
  written to the uint8 buffer row by row;
* :func:`source_words` / :func:`source_word` / :func:`source_arrays` — 8-byte words of a
  real-KV source, gathered from its own dtype (no conversion of the whole buffer either);
* :func:`count_below` — ``searchsorted`` without a loop;
* :func:`record_of` — cumsum compaction: which item, and which of its records, a record index is;
* :func:`overwrite` — an output replacing every element of an input, in the input's buffer;
* :func:`maybe` — work behind a conditional, or unconditionally (GPUs);
* :func:`ring_fill` / :func:`ring_append` / :func:`ring_index` — the violation ring's append
  with the ring guard every backend shares:
  with ``w0 = violation_write_index[0]`` at the start of a launch and ``n`` records found, a
  negative ``w0`` writes no row and leaves the index as it is; otherwise record ``j`` (launch
  order) lands in row ``w0 + j`` iff ``w0 + j < ring_capacity`` (computed in int64, no
  wraparound), and the new index is ``min(w0 + n, VIOLATION_WRITE_INDEX_MAX)`` (2**31 - 1:
  saturating). The Pallas kernels and the jnp references apply the same guard
  (:mod:`kvcanary_jax.ops._kernel_lib`).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from kvcanary_jax import consts
from kvcanary_jax.context import check_extent

__all__ = ["take", "canary_fields", "canary_store", "source_words", "source_word",
           "source_arrays", "count_below", "record_of", "ring_index", "ring_fill", "ring_append",
           "overwrite", "maybe"]


def take(arr: jax.Array, idx: jax.Array, ok: jax.Array | bool, fill=0) -> jax.Array:
    """``arr[idx]`` where ``ok`` (along axis 0), ``fill`` elsewhere; masked lanes never read."""
    ok = jnp.broadcast_to(jnp.asarray(ok), idx.shape)
    shape = idx.shape + arr.shape[1:]
    if arr.shape[0] == 0:
        return jnp.full(shape, fill, arr.dtype)
    safe = jnp.where(ok, idx, 0)
    vals = arr.at[safe].get(mode="promise_in_bounds")
    okb = ok.reshape(ok.shape + (1,) * (arr.ndim - 1))
    return jnp.where(okb, vals, jnp.asarray(fill, arr.dtype))


def canary_fields(canary_buf: jax.Array, slot: jax.Array, ok: jax.Array):
    """(token, position, prev_hash, real_kv_hash) of canary slots: int64 vectors shaped like
    ``slot``, zero where ``ok`` is off. Gathers the slots' uint8 rows and reinterprets only
    those (reinterpreting the whole buffer would cost a pass over it on CPU)."""
    rows = take(canary_buf, slot, ok)[..., : consts.CANARY_SLOT_BYTES]
    words = jax.lax.bitcast_convert_type(
        rows.reshape(slot.shape + (consts.CANARY_FIELDS_PER_SLOT, 8)), jnp.int64)
    return tuple(words[..., f] for f in range(consts.CANARY_FIELDS_PER_SLOT))


def canary_store(canary_buf: jax.Array, slot: jax.Array, fields: jax.Array,
                 ok: jax.Array) -> jax.Array:
    """Stores ``fields [m, 4]`` (int64) as bytes ``[0, 32)`` of rows ``slot`` where ``ok``
    (slots distinct among those lanes); the rows' other bytes and every other row are kept."""
    num_slots = canary_buf.shape[0]
    rows = jax.lax.bitcast_convert_type(fields.astype(jnp.int64), jnp.uint8).reshape(
        fields.shape[0], consts.CANARY_SLOT_BYTES)
    return canary_buf.at[jnp.where(ok, slot, num_slots), : consts.CANARY_SLOT_BYTES].set(
        rows, mode="drop")


def source_words(buf: jax.Array) -> tuple[jax.Array, int]:
    """A real-KV source buffer as a flat array of its own dtype (a free reshape) and its length
    in 8-byte words; :func:`source_word` reads words from it. Raises the error of
    :func:`kvcanary_jax.context.as_words` for a buffer that is not whole words."""
    flat = buf.reshape(-1)
    k = flat.dtype.itemsize
    if not (k == 8 or (8 % k == 0 and flat.shape[0] % (8 // k) == 0)):
        raise ValueError(
            f"kv-canary: a real-KV source buffer must hold a whole number of 8-byte words, "
            f"got shape {tuple(buf.shape)} dtype {buf.dtype}")
    if not (jnp.issubdtype(flat.dtype, jnp.integer) or flat.dtype == jnp.bool_):
        # Floats move as integers of their width (a free bitcast): a compiler may carry a float
        # through f32 on its way (XLA's CPU elemental emitters do for bf16) and change a NaN's
        # payload there, while the fingerprint is of the stored bytes, NaNs and corruption included.
        flat = jax.lax.bitcast_convert_type(flat, _INT_OF_WIDTH[k])
    return flat, flat.shape[0] * k // 8


_INT_OF_WIDTH = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.int64}


def source_word(flat: jax.Array, idx: jax.Array, ok: jax.Array) -> jax.Array:
    """Word ``idx`` (int64 reading of 8 bytes) of a buffer from :func:`source_words`, zero where
    ``ok`` is off. Gathers only the words asked for (the ``gather`` of
    :func:`kvcanary_jax.hashing.fold_real_kv`)."""
    k = flat.dtype.itemsize
    per = 8 // k
    if flat.shape[0] == 0:
        return jnp.zeros(idx.shape, jnp.int64)
    start = jnp.where(ok, idx, 0).astype(jnp.int64) * per
    elems = jax.vmap(lambda s: jax.lax.dynamic_slice(flat, (s,), (per,)))(start.reshape(-1))
    if elems.dtype == jnp.bool_:
        elems = elems.astype(jnp.uint8)
    words = jax.lax.bitcast_convert_type(elems[:, 0] if per == 1 else elems, jnp.int64)
    return jnp.where(ok, words.reshape(idx.shape), 0)


def source_arrays(source_bufs, specs) -> list[jax.Array]:
    """The sources as flat arrays of their own dtype (:func:`source_words`), each checked to
    hold the rows its spec addresses (:func:`kvcanary_jax.context.check_extent`)."""
    out = []
    for i, (b, spec) in enumerate(zip(source_bufs, specs)):
        flat, nwords = source_words(b)
        check_extent(jax.ShapeDtypeStruct((nwords,), jnp.int64), spec, i)
        out.append(flat)
    return out


def count_below(sorted_arr: jax.Array, q: jax.Array, *, inclusive: bool = False) -> jax.Array:
    """How many elements of the ascending ``sorted_arr`` are ``< q`` (``<= q`` with
    ``inclusive``), for every element of ``q`` (int64): ``jnp.searchsorted`` left (right), as a
    binary search unrolled over the static length (no loop: one gather per halving, fused)."""
    n = sorted_arr.shape[0]
    count = jnp.zeros(q.shape, jnp.int64)
    step = 1 << max(n.bit_length() - 1, 0) if n else 0
    while step:
        cand = count + step
        probe = sorted_arr.at[jnp.clip(cand - 1, 0, n - 1)].get(mode="promise_in_bounds")
        below = (probe <= q) if inclusive else (probe < q)
        count = jnp.where((cand <= n) & below, cand, count)
        step //= 2
    return count


def record_of(incl: jax.Array, j: jax.Array):
    """Cumsum compaction. ``incl`` is the inclusive prefix sum of each item's record count
    (items in launch order); returns ``(item, k)``: record ``j`` is record ``k`` of ``item``.
    Only meaningful for ``0 <= j < incl[-1]``."""
    item = jnp.minimum(count_below(incl, j, inclusive=True), incl.shape[0] - 1)
    before = jnp.where(item > 0, incl[jnp.maximum(item - 1, 0)], 0)
    return item, j - before


def ring_index(widx: jax.Array, count: jax.Array) -> jax.Array:
    """The write index after a launch that found ``count`` records (the ring guard)."""
    w0 = widx[0].astype(jnp.int64)
    top = consts.VIOLATION_WRITE_INDEX_MAX
    new = jnp.minimum(w0 + count.astype(jnp.int64), top).astype(jnp.int32)
    return jnp.where(w0 < 0, widx[0], new).reshape(1)


def ring_fill(ring: jax.Array, w0: jax.Array, first: jax.Array, count: jax.Array,
              rows: Callable[[jax.Array, jax.Array], jax.Array], *, branch: bool) -> jax.Array:
    """Writes the launch's records ``[first, first + count)`` (launch-relative indices) into
    their rows ``w0 + j`` under the ring guard. ``rows(j, ok)`` returns the int64 ``[len(j),
    8]`` rows of records ``j`` (only lanes under ``ok`` are used). ``branch``: skip the work
    behind a conditional when no record lands in the ring."""
    cap = ring.shape[0]
    if cap == 0:
        return ring
    w0 = w0.astype(jnp.int64)
    first = jnp.asarray(first, jnp.int64)
    end = first + count.astype(jnp.int64)

    def fill():
        j = jnp.arange(cap, dtype=jnp.int64) - w0
        ok = (w0 >= 0) & (j >= first) & (j < end)
        vals = rows(jnp.where(ok, j, 0), ok).astype(ring.dtype)
        return jnp.where(ok[:, None], vals, ring)

    lands = (w0 >= 0) & (end > first) & (w0 + first < cap)
    return maybe(branch, lands, fill, lambda: ring)


def ring_append(ring: jax.Array, widx: jax.Array, count: jax.Array,
                rows: Callable[[jax.Array, jax.Array], jax.Array], *, branch: bool):
    """Appends a launch's ``count`` records (launch order) to ``ring [capacity, 8]``; returns
    ``(ring, violation_write_index)``. See :func:`ring_fill`."""
    return (ring_fill(ring, widx[0], 0, count, rows, branch=branch),
            ring_index(widx, count))


def overwrite(buf: jax.Array, value) -> jax.Array:
    """``value`` (broadcast to ``buf``'s shape and dtype) as an update of ``buf``: an output that
    replaces every element of an input still takes the input's buffer when it is donated (an
    output computed from the input's shape alone would get a fresh one)."""
    value = jnp.broadcast_to(jnp.asarray(value, buf.dtype), buf.shape)
    return jax.lax.dynamic_update_slice(buf, value, (0,) * buf.ndim)


def maybe(branch: bool, pred: jax.Array, work: Callable, skip: Callable):
    """``work()`` where ``pred`` holds, else ``skip()`` (same structure). With ``branch`` a
    ``lax.cond`` that runs one of them; without, ``work()`` always runs and ``skip()`` is
    dead code: correct only where ``work()`` equals ``skip()`` whenever ``pred`` is false."""
    if branch:
        return jax.lax.cond(pred, work, skip)
    return work()
