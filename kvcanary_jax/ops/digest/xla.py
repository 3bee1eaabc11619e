"""The KV digest as plain XLA (``implementation="xla"``: CPU, TPU, GPU).

Semantics and bounds: :mod:`kvcanary_jax.ops.digest.base`; rows in entry order.

Shape of the computation. A slot's strip of a source is ``read_words`` consecutive words, so one
gather per source fetches ``[slots, read_words]`` words at once, from the buffer in its own dtype
(only the gathered words are reinterpreted as int64; see :func:`kvcanary_jax.ops._xla_lib.
source_words`); the terms and their sum are elementwise and one reduction.

* write: the slots in blocks of :class:`Config` ``block`` (0: all at once), then one scatter of
  the digests into ``digest_buf`` (slots outside ``[0, num_slots)`` dropped);
* verify: the selected entries compacted (:func:`~kvcanary_jax.ops.digest.base.compact`), their
  digests computed in blocks of ``block`` compacted entries by a loop that stops after the last
  selected one (the work follows the selection, not the capacity), then compared with the
  stored digests and appended to the ring in entry order (cumsum compaction, the ring guard of
  :mod:`kvcanary_jax.ops._xla_lib`).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import jax
import jax.numpy as jnp

from kvcanary_jax import hashing
from kvcanary_jax.context import DigestContext, SourceSpec
from kvcanary_jax.ops import _xla_lib
from kvcanary_jax.ops.digest import base

__all__ = ["Config", "heuristics", "run", "BLOCK_BYTES"]

# Bytes of KV one block may gather (its words live as one temporary): big enough to keep a
# device busy, small enough for any memory.
BLOCK_BYTES = 64 << 20


@dataclasses.dataclass(frozen=True)
class Config:
    """``block``: slots (write) or selected entries (verify) per step, a power of two; 0 (write
    only): all at once."""

    block: int = 0

    def __post_init__(self):
        if self.block < 0 or self.block & (self.block - 1):
            raise ValueError(f"kv-canary digest xla: block must be 0 or a power of two, got "
                             f"{self.block}")


def heuristics(shapes: Mapping[str, int]) -> Config:
    """Blocks whose gathered words take about :data:`BLOCK_BYTES`."""
    per_slot = max(8 * shapes["words"], 8)
    block = 1 << max((BLOCK_BYTES // per_slot).bit_length() - 1, 0)
    if not shapes["verify"] and block >= shapes["capacity"]:
        return Config(block=0)
    return Config(block=min(block, 1 << max(shapes["capacity"] - 1, 1).bit_length()))


def _strips(flat, spec: SourceSpec, slots, ok):
    """int64 ``[n, read_words]``: the slots' strips gathered from ``flat`` (a buffer in its own
    dtype, :func:`~kvcanary_jax.ops._xla_lib.source_words`), zero where ``ok`` is off or the row
    lies past the source's rows. A strip is one slice of ``read_words * 8`` bytes."""
    n, w = slots.shape[0], spec.read_words
    if spec.num_rows == 0:
        return jnp.zeros((n, w), jnp.int64)
    per = 8 // flat.dtype.itemsize
    s = jnp.where(ok, slots, 0).astype(jnp.int64)
    row = s // spec.page_size
    ok = ok & (row < spec.num_rows)
    base = spec.word_offset + row * spec.row_stride_words + (s % spec.page_size) * spec.nbpt_words
    start = jnp.where(ok, base, 0) * per
    # In bounds for every ok lane (the extent check of bind_sources); dynamic_slice clamps the
    # rest, which are zeroed below.
    elems = jax.vmap(lambda a: jax.lax.dynamic_slice(flat, (a,), (w * per,)))(start)
    if elems.dtype == jnp.bool_:
        elems = elems.astype(jnp.uint8)
    words = jax.lax.bitcast_convert_type(elems if per == 1 else elems.reshape(n, w, per),
                                         jnp.int64)
    return jnp.where(ok[:, None], words, 0)


def _digests(flats, sources: base.BoundSources, slots, ok):
    acc = jnp.zeros(slots.shape, jnp.int64)
    for j, (b, spec) in enumerate(sources.specs):
        strip = _strips(flats[b], spec, slots, ok)
        i = jnp.arange(spec.read_words, dtype=jnp.int64)[None, :]
        acc = acc + jnp.sum(hashing.digest_term(strip, j, i), axis=1)
    return acc


def _flats(sources: base.BoundSources):
    return [_xla_lib.source_words(b)[0] for b in sources.buffers]


def _blocked(fn, values, ok, block: int):
    """``fn(values, ok)`` over blocks of ``block`` lanes (the lanes padded with ``ok`` off)."""
    n = values.shape[0]
    if block == 0 or block >= n:
        return fn(values, ok)
    nb = -(-n // block)
    pad = nb * block - n
    v = jnp.pad(values, (0, pad)).reshape(nb, block)
    o = jnp.pad(ok, (0, pad)).reshape(nb, block)
    return jax.lax.map(lambda vo: fn(*vo), (v, o)).reshape(-1)[:n]


def write(digest_buf, slots, sources: base.BoundSources, *, config: Config):
    num_slots = digest_buf.shape[0]
    flats = _flats(sources)
    ok = (slots >= 0) & (slots < num_slots)
    d = _blocked(lambda s, o: _digests(flats, sources, s, o), slots, ok, config.block)
    return digest_buf.at[jnp.where(ok, slots, num_slots)].set(d, mode="drop")


def verify(context: DigestContext, slots, positions, num_valid, phase,
           sources: base.BoundSources, *, window: int, config: Config) -> DigestContext:
    num_slots = context.digest_buf.shape[0]
    cap = slots.shape[0]
    order, count = base.compact(base.selection(slots, num_valid, phase, window=window,
                                               num_slots=num_slots))
    flats = _flats(sources)
    block = min(config.block or cap, cap)
    # Blocks of compacted entries until the last selected one: the loop's trip count is the
    # selection's, so the KV read follows it. The last block's slice is clamped to the capacity
    # (it may start before its boundary: those entries are recomputed, to the same values).
    nblocks = (count[0] + block - 1) // block

    def trip(carry):
        b, out = carry
        start = jnp.minimum(b * block, cap - block)
        k = start + jnp.arange(block, dtype=jnp.int32)
        live = k < count[0]
        slot = _xla_lib.take(slots, jax.lax.dynamic_slice(order, (start,), (block,)), live)
        d = _digests(flats, sources, slot, live)
        return b + 1, jax.lax.dynamic_update_slice(out, d, (start,))

    _, digests = jax.lax.while_loop(lambda c: c[0] < nblocks, trip,
                                    (jnp.zeros((), jnp.int32), jnp.zeros((cap,), jnp.int64)))
    return base.finish_verify(context, slots, positions, order, count, digests)


_FUNCTIONS = {"write": write, "verify": verify}


def run(function: str, *args, config: Config, **kwargs):
    """``function`` (``"write"`` or ``"verify"``) of this implementation."""
    return _FUNCTIONS[function](*args, config=config, **kwargs)
