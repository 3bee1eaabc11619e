"""The public scatter: validate once, pick the implementation and its launch config, run it."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from kvcanary_jax import _config
from kvcanary_jax.ops import _registry
from kvcanary_jax.ops.scatter import base
from kvcanary_jax.ops.scatter.base import ScatterInputs

__all__ = ["OP", "run", "scatter_req_token_ids"]

OP = _registry.standard_op("scatter")


# The implementations whose kernel reads ``num_tokens`` itself; the others are given the
# offsets at most it.
_READ_NUM_TOKENS = ("pallas_triton", "pallas_interpret")


@functools.partial(jax.jit, static_argnames=("max_cols", "implementation", "config"))
def _run(inputs, num_tokens=None, *, max_cols, implementation, config):
    fn = functools.partial(OP.run, implementation, config=config)
    if num_tokens is not None:
        num_tokens = jnp.asarray(num_tokens).astype(inputs.offsets.dtype).reshape(1)
        if implementation in _READ_NUM_TOKENS:
            fn = functools.partial(fn, num_tokens=num_tokens)
        else:
            inputs = dataclasses.replace(inputs, offsets=jnp.minimum(inputs.offsets,
                                                                     num_tokens[0]))
    return base.sized_call(fn, inputs, max_cols=max_cols)


@_config.entry_point
def run(inputs: ScatterInputs, *, max_cols: int | None = None,
        implementation: str | None = None, config=None,
        num_tokens: jax.Array | None = None) -> jax.Array:
    """Array-level scatter, without the contract's checks (the torch bridge checks the same
    contract on its tensors): returns the updated pool, aliased to ``inputs.pool_out``.

    ``max_cols``: columns a row may receive (default ``pool_out.shape[1]``; the bridge passes the
    view's width when ``pool_out`` is the compact base of a column-sliced view).
    ``num_tokens``: an integer ``[1]`` array, the true length of a ``flat_in`` passed in a
    longer buffer (a bucket: the torch bridge's launches): the offsets are read as
    ``min(offsets, num_tokens[0])``, so nothing at or past it is read (the Triton kernel reads
    it; the other implementations take the offsets at most it).
    ``implementation``: see :mod:`kvcanary_jax.ops._registry` (default: the platform's);
    ``config``: the implementation's ``Config`` (default: tuned table, else heuristics)."""
    impl = OP.select(implementation, config=config,
                     args=(inputs.pool_out, inputs.flat_in))  # the target: see select
    max_cols = int(inputs.pool_out.shape[1] if max_cols is None else max_cols)
    cfg = OP.config(impl, base.shapes(inputs, max_cols=max_cols), config)
    return _run(inputs, num_tokens, max_cols=max_cols, implementation=impl, config=cfg)


@_config.entry_point
def scatter_req_token_ids(
    *,
    flat_in: jax.Array,
    offsets: jax.Array,
    req_pool_indices: jax.Array,
    pool_out: jax.Array,
    max_context_len: int | None = None,
    implementation: str | None = None,
    config=None,
) -> jax.Array:
    """Scatter each request's token ids into its row of ``pool_out``; returns the new pool
    (semantics: :mod:`kvcanary_jax.ops.scatter.base`).

    Args:
      flat_in: int64 ``[num_tokens]``, all requests' tokens concatenated in request order.
      offsets: int64 ``[bs + 1]``, prefix sums of the per-request lengths.
      req_pool_indices: int64 ``[bs]``, target row of each request (0 = padding, still written).
      pool_out: int32 ``[max_reqs, max_context_len]``.
      max_context_len: columns a row may receive; defaults to ``pool_out.shape[1]``.
      implementation: ``"xla"``, ``"pallas_triton"``, ``"pallas_interpret"``, ... (default: the
        platform's, see :mod:`kvcanary_jax.ops._registry`).
      config: launch configuration of that implementation (its module's ``Config``; default:
        the device kind's tuned table, else heuristics).

    Returns the updated pool (same shape and dtype). Under
    ``jax.jit(..., donate_argnames="pool_out")`` the pool is updated in place (the kernel aliases
    its input and output buffers), so untouched cells are never copied.

    Raises SGLang's errors, at trace time: ValueError for dimensionality and the offsets length,
    TypeError for dtypes (int64 inputs, int32 ``pool_out``).
    """
    inputs = ScatterInputs(flat_in=jnp.asarray(flat_in), offsets=jnp.asarray(offsets),
                           req_pool_indices=jnp.asarray(req_pool_indices),
                           pool_out=jnp.asarray(pool_out))
    base.validate(inputs)
    return run(inputs, max_cols=max_context_len, implementation=implementation, config=config)
