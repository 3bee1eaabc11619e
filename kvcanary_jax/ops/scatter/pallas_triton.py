"""scatter_req_token_ids as a Pallas kernel (Triton lowering on CUDA GPUs; interpret mode too).

A 2-D grid: program ``(r, c)`` copies column tile ``c`` of request ``r`` (``block_cols`` columns,
masked gather of the int64 ids, masked int32 store into the pool row); tiles past the request's
length exit at once. The masks keep every access in bounds whatever ``offsets`` and
``req_pool_indices`` hold. The pool is aliased input-to-output: untouched cells are never copied.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kvcanary_jax.ops import _kernel_lib
from kvcanary_jax.ops.scatter.base import ScatterInputs

__all__ = ["Config", "heuristics", "run", "BLOCK_COLS", "NUM_WARPS"]

# Column tile per program and warps, chosen by the H200 sweep in bench/NOTES.md
# (bench/tune_scatter.py): 256 x 4 warps is the fastest or within 6% of the fastest of 15 variants
# on every case, from 1 x 128 (launch-bound) to 511 x 8192 (bandwidth-bound); larger tiles leave
# most lanes idle on short rows and serialise long rows into fewer programs.
BLOCK_COLS = 256
NUM_WARPS = 4


@dataclasses.dataclass(frozen=True)
class Config:
    """``block_cols``: columns per program (a power of two; capped at the longest row);
    ``num_warps``: warps per program; ``interpret``: Pallas interpret mode (any backend; what
    ``pallas_interpret`` runs)."""

    block_cols: int = BLOCK_COLS
    num_warps: int = NUM_WARPS
    interpret: bool = False

    def __post_init__(self):
        _kernel_lib.check_interpret("scatter", self.interpret)
        if self.block_cols < 1 or self.block_cols & (self.block_cols - 1) or self.num_warps < 1:
            raise ValueError(f"kv-canary: scatter: bad launch config {self} (block_cols a power "
                             "of two, num_warps >= 1)")


def heuristics(shapes) -> Config:
    return Config()


def _scatter_kernel(flat_ref, offsets_ref, rpi_ref, *refs, block, max_cols, limited):
    """Program (r, c) copies column tile c of request r; tiles past the request's length exit.
    ``limited``: the operand after ``rpi_ref`` holds flat_in's true length, and the offsets
    are read as at most that (a bucketed ``flat_in``)."""
    limit_ref, _pool_in_ref, pool_ref = refs if limited else (None, *refs)
    r = pl.program_id(0)
    c = pl.program_id(1)
    num_tokens = flat_ref.shape[0]
    num_rows = pool_ref.shape[0]
    start = offsets_ref[r]
    end = offsets_ref[r + 1]
    if limited:
        limit = limit_ref[0]
        start, end = jnp.minimum(start, limit), jnp.minimum(end, limit)
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


def run(inputs: ScatterInputs, *, max_cols: int | None, config: Config,
        num_tokens: jax.Array | None = None):
    """The updated pool (aliased to ``inputs.pool_out``). ``max_cols``: columns a row may receive
    (default: the pool's width); ``config.interpret``: Pallas interpret mode; ``num_tokens``: an
    int64 ``[1]`` array, ``flat_in``'s true length where ``flat_in`` is a longer buffer (see
    :func:`kvcanary_jax.ops.scatter.api.run`), read by the kernel."""
    interpret = config.interpret
    bs = inputs.req_pool_indices.shape[0]
    length = inputs.flat_in.shape[0]
    max_cols = inputs.pool_out.shape[1] if max_cols is None else max_cols
    span = min(max_cols, length)  # >= 1: zero sizes never get here (base.sized_call)
    block = min(config.block_cols, pl.next_power_of_2(span))
    limited = num_tokens is not None
    kernel = functools.partial(_scatter_kernel, block=block, max_cols=max_cols, limited=limited)
    operands = (inputs.flat_in, inputs.offsets, inputs.req_pool_indices,
                *((num_tokens.astype(inputs.offsets.dtype),) if limited else ()), inputs.pool_out)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(inputs.pool_out.shape, inputs.pool_out.dtype),
        grid=(bs, pl.cdiv(span, block)),
        input_output_aliases={len(operands) - 1: 0},
        interpret=interpret,
        compiler_params=None if interpret else _kernel_lib.compiler_params(config.num_warps),
        name="kvcanary_scatter_req_token_ids",
    )(*operands)
