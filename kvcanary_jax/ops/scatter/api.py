"""The public scatter: validate once, pick the implementation and its launch config, run it."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvcanary_jax import _config
from kvcanary_jax.ops import _registry
from kvcanary_jax.ops.scatter import base
from kvcanary_jax.ops.scatter.base import ScatterInputs

__all__ = ["OP", "run", "scatter_req_token_ids"]

OP = _registry.standard_op("scatter")


@functools.partial(jax.jit, static_argnames=("max_cols", "implementation", "config"))
def _run(inputs, *, max_cols, implementation, config):
    return base.sized_call(functools.partial(OP.run, implementation, config=config), inputs,
                           max_cols=max_cols)


@_config.entry_point
def run(inputs: ScatterInputs, *, max_cols: int | None = None,
        implementation: str | None = None, config=None) -> jax.Array:
    """Array-level scatter, without the contract's checks (the torch bridge checks the same
    contract on its tensors): returns the updated pool, aliased to ``inputs.pool_out``.

    ``max_cols``: columns a row may receive (default ``pool_out.shape[1]``; the bridge passes the
    view's width when ``pool_out`` is the compact base of a column-sliced view).
    ``implementation``: see :mod:`kvcanary_jax.ops._registry` (default: the platform's);
    ``config``: the implementation's ``Config`` (default: tuned table, else heuristics)."""
    impl = OP.select(implementation, config=config,
                     args=(inputs.pool_out, inputs.flat_in))  # the target: see select
    max_cols = int(inputs.pool_out.shape[1] if max_cols is None else max_cols)
    cfg = OP.config(impl, base.shapes(inputs, max_cols=max_cols), config)
    return _run(inputs, max_cols=max_cols, implementation=impl, config=cfg)


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
