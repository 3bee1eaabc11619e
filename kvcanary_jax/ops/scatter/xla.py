"""scatter_req_token_ids as plain XLA (``implementation="xla"``: CPU, TPU, GPU).

The semantics of :mod:`kvcanary_jax.ops.scatter.base`, byte for byte::

    pool_out[req_pool_indices[r], j] = int32(flat_in[offsets[r] + j])    for j in [0, write_len)

with ``write_len = min(offsets[r + 1] - offsets[r], max_context_len)``; a flat index outside
``[0, len(flat_in))``, a column at or past the pool's width and a row outside ``[0, max_reqs)``
are never touched. Requests are applied in order, so where two requests address the same row the
later one wins on the columns both write (SGLang's torch reference).

Shape of the computation: one ``[bs, span]`` tile of values, ``span = min(width, len(flat_in))``
columns per request starting at the request's first in-range column (a request never has more
than ``span`` writable columns), gathered from ``flat_in`` and stored by one masked scatter.
Requests that write the same row are ranked by request order; rank 0 (every request of a
well-formed batch) is stored by that scatter, and further ranks, if any, by one more masked
scatter each, in rank order. Requests that write nothing (padding rows with empty ranges) take no
rank.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import jax
import jax.numpy as jnp

from kvcanary_jax.ops.scatter.base import ScatterInputs

__all__ = ["Config", "heuristics", "run"]


@dataclasses.dataclass(frozen=True)
class Config:
    """The scatter has no tunable parameter."""


def heuristics(shapes: Mapping[str, int]) -> Config:
    del shapes
    return Config()


def run(inputs: ScatterInputs, *, max_cols: int, config: Config):
    """The updated pool (no validation; ``max_cols``: columns a row may receive)."""
    del config
    i64 = jnp.int64
    bs = inputs.req_pool_indices.shape[0]
    n = inputs.flat_in.shape[0]
    rows, width = inputs.pool_out.shape
    cols = min(max_cols, width)
    span = min(cols, n)
    if bs == 0 or span == 0:
        return inputs.pool_out
    start, end = inputs.offsets[:bs], inputs.offsets[1:]
    write_len = jnp.minimum(end - start, max_cols)
    rp = inputs.req_pool_indices
    row_ok = (rp >= 0) & (rp < rows)
    # Column j of request r reads flat_in[start + j]: the writable columns are
    # [lo, hi) = [max(0, -start), min(write_len, cols, n - start)).
    lo = jnp.maximum(-start, 0)
    hi = jnp.minimum(jnp.minimum(write_len, cols), n - start)
    writes = row_ok & (hi > lo)
    col = lo[:, None] + jnp.arange(span, dtype=i64)[None, :]
    ok = writes[:, None] & (col < hi[:, None])
    src = jnp.where(ok, start[:, None] + col, 0)
    vals = inputs.flat_in.at[src].get(mode="promise_in_bounds").astype(jnp.int32)  # low 32 bits

    # Rank of each writing request among the earlier writing requests of its row.
    key = jnp.where(writes, rp, -1)
    order = jnp.argsort(key, stable=True)
    skey = key[order]
    i = jnp.arange(bs)
    first = jnp.where((i == 0) | (skey != jnp.roll(skey, 1)), i, 0)
    rank = jnp.zeros((bs,), i64).at[order].set(i - jax.lax.cummax(first))
    rounds = jnp.max(jnp.where(writes, rank, -1)) + 1

    flat_pool = inputs.pool_out.reshape(-1)
    dest = jnp.where(ok, rp[:, None] * width + col, rows * width)

    def store(m, pool):
        return pool.at[jnp.where(rank[:, None] == m, dest, rows * width)].set(vals, mode="drop")

    flat_pool = store(0, flat_pool)
    _, flat_pool = jax.lax.while_loop(lambda c: c[0] < rounds, lambda c: (c[0] + 1, store(*c)),
                                      (jnp.ones((), i64), flat_pool))
    return flat_pool.reshape(rows, width)
