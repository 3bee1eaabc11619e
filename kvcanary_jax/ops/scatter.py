"""scatter_req_token_ids: copy each request's int64 token ids into its row of an int32 pool.

For each request ``r`` with ``start, end = offsets[r], offsets[r + 1]`` and
``write_len = min(end - start, max_context_len)``::

    pool_out[req_pool_indices[r], j] = int32(flat_in[start + j])      for j in [0, write_len)

``int32()`` keeps the low 32 bits (two's-complement wrap). Rows not addressed, and columns at or
past ``write_len`` of addressed rows, keep their contents. Padding row 0 is written like any other.

This is the semantics of SGLang's newer upstream scatter (2-D grid, no batch cap), which on
well-formed offsets equals SGLang 0.5.23's ``launch_scatter_req_token_ids_kernel`` and its torch
reference byte for byte. Where the inputs are malformed the kernel stays in bounds instead of
mirroring undefined GPU behaviour:

* a flat index outside ``[0, len(flat_in))`` is never read and its cell is left untouched
  (a negative ``start`` does not wrap around as Python slicing would in SGLang's reference);
* a target row outside ``[0, max_reqs)`` is skipped (SGLang's kernel writes out of bounds; its
  reference wraps negative rows);
* decreasing offsets give an empty range.

Unlike SGLang 0.5.23 (``bs + 1 <= 512``) there is no cap on the number of requests.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvcanary_jax import _config
from kvcanary_jax._config import pl, plt
from kvcanary_jax.contracts import Contract, DType, NDim, Rule

__all__ = [
    "CONTRACT",
    "scatter_req_token_ids",
    "scatter_req_token_ids_reference",
    "BLOCK_COLS",
    "NUM_WARPS",
]

# Column tile per program and warps, chosen by the H200 sweep in bench/NOTES.md
# (bench/tune_scatter.py): 256 x 4 warps is the fastest or within 6% of the fastest of 15 variants
# on every case, from 1 x 128 (launch-bound) to 511 x 8192 (bandwidth-bound); larger tiles leave
# most lanes idle on short rows and serialise long rows into fewer programs.
BLOCK_COLS = 256
NUM_WARPS = 4

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


def _scatter_kernel(flat_ref, offsets_ref, rpi_ref, _pool_in_ref, pool_ref, *, block, max_cols):
    """Program (r, c) copies column tile c of request r; tiles past the request's length exit."""
    r = pl.program_id(0)
    c = pl.program_id(1)
    num_tokens = flat_ref.shape[0]
    num_rows = pool_ref.shape[0]
    start = offsets_ref[r]
    end = offsets_ref[r + 1]
    write_len = jnp.minimum(end - start, max_cols)
    col0 = c * block

    @pl.when(col0 < write_len)
    def _copy_tile():
        cols = col0 + jnp.arange(block, dtype=jnp.int32)
        src = start + cols
        rp = rpi_ref[r]
        # The masks keep every access in bounds whatever offsets / req_pool_indices hold.
        read = (cols < write_len) & (src >= 0) & (src < num_tokens)
        vals = plt.load(flat_ref.at[jnp.where(read, src, 0)], mask=read, other=0)
        row_ok = (rp >= 0) & (rp < num_rows)
        row = jnp.where(row_ok, rp, 0).astype(jnp.int32)
        plt.store(
            pool_ref.at[row, pl.ds(col0, block)],
            vals.astype(jnp.int32),  # keeps the low 32 bits, as torch's .to(int32)
            mask=read & row_ok,
        )


@functools.partial(
    jax.jit, static_argnames=("max_cols", "block_cols", "num_warps", "interpret")
)
def _scatter_jit(flat_in, offsets, req_pool_indices, pool_out, *, max_cols, block_cols, num_warps,
                 interpret):
    CONTRACT.validate(
        dict(flat_in=flat_in, offsets=offsets, req_pool_indices=req_pool_indices, pool_out=pool_out)
    )
    bs = req_pool_indices.shape[0]
    num_tokens = flat_in.shape[0]
    max_cols = pool_out.shape[1] if max_cols is None else max_cols
    span = min(max_cols, num_tokens)
    if bs == 0 or span == 0:
        return pool_out
    block = min(block_cols, pl.next_power_of_2(span))
    kernel = functools.partial(_scatter_kernel, block=block, max_cols=max_cols)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(pool_out.shape, pool_out.dtype),
        grid=(bs, pl.cdiv(span, block)),
        input_output_aliases={3: 0},
        interpret=interpret,
        compiler_params=None if interpret else _config.compiler_params(num_warps),
        name="kvcanary_scatter_req_token_ids",
    )(flat_in, offsets, req_pool_indices, pool_out)


@_config.with_x64
def scatter_req_token_ids(
    *,
    flat_in: jax.Array,
    offsets: jax.Array,
    req_pool_indices: jax.Array,
    pool_out: jax.Array,
    max_context_len: int | None = None,
    block_cols: int = BLOCK_COLS,
    num_warps: int = NUM_WARPS,
    interpret: bool | None = None,
) -> jax.Array:
    """Scatter each request's token ids into its row of ``pool_out``; returns the new pool.

    Args:
      flat_in: int64 ``[num_tokens]``, all requests' tokens concatenated in request order.
      offsets: int64 ``[bs + 1]``, prefix sums of the per-request lengths.
      req_pool_indices: int64 ``[bs]``, target row of each request (0 = padding, still written).
      pool_out: int32 ``[max_reqs, max_context_len]``.
      max_context_len: columns a row may receive; defaults to ``pool_out.shape[1]``. The torch
        bridge passes it when ``pool_out`` is the compact base of a column-sliced view.
      block_cols, num_warps: launch parameters (GPU).
      interpret: run the kernel in Pallas interpret mode; defaults to True off GPU.

    Returns the updated pool (same shape and dtype). Under
    ``jax.jit(..., donate_argnames="pool_out")`` the pool is updated in place (the kernel aliases
    its input and output buffers), so untouched cells are never copied.

    Raises SGLang's errors, at trace time: ValueError for dimensionality and the offsets length,
    TypeError for dtypes (int64 inputs, int32 ``pool_out``).
    """
    if interpret is None:
        interpret = _config.default_interpret()
    return _scatter_jit(
        jnp.asarray(flat_in),
        jnp.asarray(offsets),
        jnp.asarray(req_pool_indices),
        jnp.asarray(pool_out),
        max_cols=max_context_len,
        block_cols=block_cols,
        num_warps=num_warps,
        interpret=interpret,
    )


@jax.jit
def _scatter_reference_jit(flat_in, offsets, req_pool_indices, pool_out):
    num_tokens = flat_in.shape[0]
    num_rows, max_cols = pool_out.shape
    cols = jnp.arange(max_cols, dtype=jnp.int64)

    def one_request(r, pool):
        start, end = offsets[r], offsets[r + 1]
        write_len = jnp.minimum(end - start, max_cols)
        src = start + cols
        take = (cols < write_len) & (src >= 0) & (src < num_tokens)
        rp = req_pool_indices[r]
        row_ok = (rp >= 0) & (rp < num_rows)
        row = jnp.where(row_ok, rp, 0)
        vals = flat_in[jnp.clip(src, 0, max(num_tokens - 1, 0))].astype(jnp.int32)
        new_row = jnp.where(take & row_ok, vals, pool[row])
        return pool.at[row].set(new_row)

    if num_tokens == 0:
        return pool_out
    return jax.lax.fori_loop(0, req_pool_indices.shape[0], one_request, pool_out)


@_config.with_x64
def scatter_req_token_ids_reference(*, flat_in, offsets, req_pool_indices, pool_out) -> jax.Array:
    """Pure-jnp reference of :func:`scatter_req_token_ids` (requests applied in order, so for
    duplicate target rows the later request wins, as in SGLang's torch reference)."""
    CONTRACT.validate(
        dict(flat_in=flat_in, offsets=offsets, req_pool_indices=req_pool_indices, pool_out=pool_out)
    )
    return _scatter_reference_jit(
        jnp.asarray(flat_in), jnp.asarray(offsets), jnp.asarray(req_pool_indices),
        jnp.asarray(pool_out),
    )
