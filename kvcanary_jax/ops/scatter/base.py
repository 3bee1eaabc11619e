"""scatter_req_token_ids: copy each request's int64 token ids into its row of an int32 pool.

For each request ``r`` with ``start, end = offsets[r], offsets[r + 1]`` and
``write_len = min(end - start, max_context_len)``::

    pool_out[req_pool_indices[r], j] = int32(flat_in[start + j])      for j in [0, write_len)

``int32()`` keeps the low 32 bits (two's-complement wrap). Rows not addressed, and columns at or
past ``write_len`` of addressed rows, keep their contents. Padding row 0 is written like any other.

This is the semantics of SGLang's newer upstream scatter (2-D grid, no batch cap), which on
well-formed offsets equals SGLang 0.5.23's ``launch_scatter_req_token_ids_kernel`` and its torch
reference byte for byte. Where the inputs are malformed every implementation stays in bounds
instead of mirroring undefined GPU behaviour:

* a flat index outside ``[0, len(flat_in))`` is never read and its cell is left untouched
  (a negative ``start`` does not wrap around as Python slicing would in SGLang's reference);
* a target row outside ``[0, max_reqs)`` is skipped (SGLang's kernel writes out of bounds; its
  reference wraps negative rows);
* decreasing offsets give an empty range.

Zero sizes (no request, no token, a pool of 0 rows or 0 columns) copy nothing and return the
pool as it is, for every implementation (:func:`sized_call`): SGLang's launcher accepts them too
(it returns early on 0 tokens; on a 0-row pool its kernel writes outside the pool and its
reference raises IndexError once a request has tokens; here every target row is out of range).

Requests that name the same row are applied in request order by the reference (the later request
wins, as in SGLang's torch reference); on the GPU their order is unspecified. Unlike SGLang
0.5.23 (``bs + 1 <= 512``) there is no cap on the number of requests.

This module holds the op's contract, its arguments as one pytree (:class:`ScatterInputs`, taken by
every layer: ``api.run``, :func:`sized_call`, the reference and each implementation's ``run``,
statics as keywords, the updated pool returned), its static shapes (the keys of tuned launch
configs) and the pure-jnp sequential reference, the test oracle of every implementation.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from kvcanary_jax import _config
from kvcanary_jax.contracts import Contract, DType, NDim, Rule

__all__ = ["CONTRACT", "ScatterInputs", "validate", "shapes", "sized_call", "reference",
           "scatter_req_token_ids_reference"]

_P = "kv-canary: scatter_req_token_ids"


def _offsets_length(metas, scalars):
    n, bs = metas["offsets"].shape[0], metas["req_pool_indices"].shape[0]
    return None if n == bs + 1 else {"n": n, "bs1": bs + 1}


# SGLang's launcher checks, in its order and words: dims, then dtypes (TypeError), then length.
CONTRACT = Contract(
    op="scatter_req_token_ids",
    checks=(
        NDim("flat_in", 1, _P + " flat_in must be 1-D, got shape {shape}"),
        NDim("offsets", 1, _P + " offsets must be 1-D, got shape {shape}"),
        NDim("req_pool_indices", 1, _P + " req_pool_indices must be 1-D, got shape {shape}"),
        NDim("pool_out", 2, _P + " pool_out must be 2-D, got shape {shape}"),
        DType("flat_in", "int64", _P + " flat_in must be int64, got {dtype}"),
        DType("offsets", "int64", _P + " offsets must be int64, got {dtype}"),
        DType("req_pool_indices", "int64", _P + " req_pool_indices must be int64, got {dtype}"),
        DType("pool_out", "int32", _P + " pool_out must be int32, got {dtype}"),
        Rule(_offsets_length, _P + " offsets length {n} != bs+1 ({bs1})"),
    ),
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class ScatterInputs:
    """A scatter's arrays, under SGLang's launcher names: int64 ``flat_in [num_tokens]`` (all
    requests' tokens in request order), int64 ``offsets [bs + 1]`` (their prefix sums), int64
    ``req_pool_indices [bs]`` (each request's target row) and the int32 pool ``pool_out
    [max_reqs, width]``, whose updated value every layer returns (aliased to it)."""

    flat_in: jax.Array
    offsets: jax.Array
    req_pool_indices: jax.Array
    pool_out: jax.Array

    def arrays(self) -> dict[str, jax.Array]:
        """The fields by name (what :data:`CONTRACT` reads)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def validate(inputs: ScatterInputs) -> None:
    """SGLang's checks on the four arrays (raises at trace time)."""
    CONTRACT.validate(inputs.arrays())


def shapes(inputs: ScatterInputs, *, max_cols: int) -> dict[str, int]:
    """The static sizes a launch configuration may depend on."""
    return {"bs": int(inputs.req_pool_indices.shape[0]),
            "num_tokens": int(inputs.flat_in.shape[0]),
            "rows": int(inputs.pool_out.shape[0]), "max_cols": int(max_cols)}


def sized_call(fn, inputs: ScatterInputs, *, max_cols: int, **statics) -> jax.Array:
    """``fn(inputs, max_cols=max_cols, **statics)`` (an implementation's ``run``, or the
    reference), or the pool as it is when a zero size leaves nothing to copy (see the module
    docstring): no implementation gets an empty array."""
    if 0 in (inputs.req_pool_indices.shape[0], inputs.flat_in.shape[0], *inputs.pool_out.shape,
             max_cols):
        return inputs.pool_out
    return fn(inputs, max_cols=max_cols, **statics)


@functools.partial(jax.jit, static_argnames=("max_cols",))
def _reference(inputs: ScatterInputs, *, max_cols: int):
    num_tokens = inputs.flat_in.shape[0]
    num_rows, width = inputs.pool_out.shape
    cols = jnp.arange(width, dtype=jnp.int64)

    def one_request(r, pool):
        start, end = inputs.offsets[r], inputs.offsets[r + 1]
        write_len = jnp.minimum(end - start, max_cols)
        src = start + cols
        take = (cols < write_len) & (src >= 0) & (src < num_tokens)
        rp = inputs.req_pool_indices[r]
        row_ok = (rp >= 0) & (rp < num_rows)
        row = jnp.where(row_ok, rp, 0)
        vals = inputs.flat_in[jnp.clip(src, 0, max(num_tokens - 1, 0))].astype(jnp.int32)
        new_row = jnp.where(take & row_ok, vals, pool[row])
        return pool.at[row].set(new_row)

    return jax.lax.fori_loop(0, inputs.req_pool_indices.shape[0], one_request, inputs.pool_out)


def reference(inputs: ScatterInputs, *, max_cols: int | None = None) -> jax.Array:
    """The array-level reference (the arguments and result of an implementation's ``run``):
    requests applied one after another, no validation; returns the updated pool. ``max_cols``:
    columns a row may receive (default: the pool's width)."""
    max_cols = inputs.pool_out.shape[1] if max_cols is None else int(max_cols)
    return sized_call(_reference, inputs, max_cols=max_cols)


@_config.with_x64
def scatter_req_token_ids_reference(*, flat_in, offsets, req_pool_indices, pool_out) -> jax.Array:
    """Pure-jnp reference of :func:`kvcanary_jax.scatter_req_token_ids` (same validation)."""
    inputs = ScatterInputs(flat_in=jnp.asarray(flat_in), offsets=jnp.asarray(offsets),
                           req_pool_indices=jnp.asarray(req_pool_indices),
                           pool_out=jnp.asarray(pool_out))
    validate(inputs)
    return reference(inputs)
