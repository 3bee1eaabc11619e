"""The public write: validate once, pick the implementation and its launch config, run it."""

from __future__ import annotations

import functools

import jax

from kvcanary_jax import _config
from kvcanary_jax.context import VerifyOrWriteContext, check_extents
from kvcanary_jax.ops import _registry
from kvcanary_jax.ops.write import base
from kvcanary_jax.ops.write.base import WriteTokens
from kvcanary_jax.plans import WritePlan

__all__ = ["OP", "run", "canary_write"]

OP = _registry.standard_op("write")

@functools.partial(
    jax.jit, static_argnames=("enable_write_input_assert", "implementation", "config"))
def _run(context, plan, tokens, *, enable_write_input_assert, implementation, config):
    check_extents(context.real_kv_sources)
    out = base.sized_call(functools.partial(OP.run, implementation, config=config),
                          context, plan, tokens,
                          enable_write_input_assert=enable_write_input_assert)
    # Only the updated fields leave the jit: one returned unchanged would be copied by XLA.
    return {k: getattr(out, k) for k in base.OUTPUTS}


@_config.entry_point
def run(context: VerifyOrWriteContext, plan: WritePlan, tokens: WriteTokens, *,
        enable_write_input_assert: bool, implementation: str | None = None,
        config=None) -> VerifyOrWriteContext:
    """Array-level write, without the contract's checks (the torch bridge checks the same
    contract on its tensors). A source's ``tensor`` may be any compact array holding its bytes,
    addressed through its ``view`` and ``offset_bytes`` (a buffer shorter than its rows span
    raises ValueError). Returns the context with :data:`~kvcanary_jax.ops.write.base.OUTPUTS`
    updated; donate those for an in-place update.
    ``implementation`` / ``config``: as :func:`canary_write`."""
    impl = OP.select(implementation, config=config,
                     args=(context.canary_buf, tokens.input_ids))  # the target: see select
    cfg = OP.config(impl, base.shapes(context, plan, tokens), config)
    return context.replace(**_run(
        context, plan, tokens, enable_write_input_assert=bool(enable_write_input_assert),
        implementation=impl, config=cfg))


@_config.entry_point
def canary_write(
    *,
    context: VerifyOrWriteContext,
    plan: WritePlan,
    input_ids: jax.Array,
    positions: jax.Array,
    out_cache_loc: jax.Array,
    enable_write_input_assert: bool,
    expected_input_tokens: jax.Array | None,
    expected_input_positions: jax.Array | None,
    implementation: str | None = None,
    config=None,
) -> VerifyOrWriteContext:
    """Write canary records for the batch's written tokens; returns the updated context
    (semantics: :mod:`kvcanary_jax.ops.write.base`).

    Arguments as SGLang's ``launch_canary_write_kernel`` (keyword-only; int64 token tensors of one
    length, a :class:`~kvcanary_jax.plans.WritePlan`). The returned context carries the new
    ``canary_buf``, ``violation_ring``, ``violation_write_index``, ``slot_run_counter`` and
    ``kernel_run_counter``; its other fields are the input's. Under
    ``jax.jit(..., donate_argnames="context")`` the update is in place (the kernel aliases those
    buffers; the sources' arrays come back unchanged and aliased).

    ``implementation``: ``"xla"``, ``"pallas_triton"``, ``"pallas_interpret"``, ... (default: the
    platform's, see :mod:`kvcanary_jax.ops._registry`); ``config``: that implementation's
    ``Config`` (default: the device kind's tuned table, else heuristics).

    Raises at trace time: SGLang's ValueErrors (more than 4 sources; expected tensors present iff
    the assert is on; per-source ABI checks; canary slot stride below 4 int64 fields);
    RuntimeError for dtype / shape mismatches (SGLang's C++ guards).
    """
    tokens = WriteTokens(input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc,
                         expected_input_tokens=expected_input_tokens,
                         expected_input_positions=expected_input_positions)
    base.validate(context, plan, tokens, enable_write_input_assert)
    return run(context, plan, tokens, enable_write_input_assert=enable_write_input_assert,
               implementation=implementation, config=config)
