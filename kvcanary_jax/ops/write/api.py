"""The public write: validate once, pick the implementation and its launch config, run it."""

from __future__ import annotations

import functools

import jax

from kvcanary_jax import _config
from kvcanary_jax.context import SourceSpec, VerifyOrWriteContext, check_extents
from kvcanary_jax.ops import _registry
from kvcanary_jax.ops.write import base
from kvcanary_jax.plans import WritePlan

__all__ = ["OP", "run", "canary_write"]

OP = _registry.standard_op("write")

_ARRAYS = ("canary_buf", "violation_ring", "violation_write_index", "slot_run_counter",
           "kernel_run_counter", "enable_chain_position_assert", "write_offsets",
           "write_seed_slot_indices", "write_num_valid_reqs", "input_ids", "positions",
           "out_cache_loc", "expected_input_tokens", "expected_input_positions")


@functools.partial(
    jax.jit,
    static_argnames=("specs", "kernel_kind", "real_kv_hash_mode", "enable_write_input_assert",
                     "implementation", "config"),
)
def _run(arrays, source_bufs, *, specs, kernel_kind, real_kv_hash_mode,
         enable_write_input_assert, implementation, config):
    check_extents(source_bufs, specs)
    impl = functools.partial(OP.run, implementation, kernel_kind=kernel_kind,
                             real_kv_hash_mode=real_kv_hash_mode,
                             enable_write_input_assert=enable_write_input_assert, config=config)
    return base.sized_call(impl, **dict(zip(_ARRAYS, arrays)),
                           sources=tuple(zip(source_bufs, specs)))


@_config.entry_point
def run(
    *, canary_buf, violation_ring, violation_write_index, slot_run_counter, kernel_run_counter,
    enable_chain_position_assert, write_offsets, write_seed_slot_indices, write_num_valid_reqs,
    input_ids, positions, out_cache_loc, expected_input_tokens, expected_input_positions,
    sources: tuple[tuple[jax.Array, SourceSpec], ...], kernel_kind: int, real_kv_hash_mode: int,
    enable_write_input_assert: bool, implementation: str | None = None, config=None,
):
    """Array-level write, without the contract's checks (the torch bridge checks the same
    contract on its tensors). Each source is ``(buffer, SourceSpec)``, the buffer any compact
    array holding the source's bytes (a buffer shorter than its rows span raises ValueError).
    Returns ``(canary_buf, violation_ring, violation_write_index, slot_run_counter,
    kernel_run_counter)``; donate those five for an in-place update.
    ``implementation`` / ``config``: as :func:`canary_write`."""
    impl = OP.select(implementation, config=config, args=(canary_buf, input_ids))  # the target: see select
    cfg = OP.config(impl, base.shapes(canary_buf, write_seed_slot_indices, input_ids), config)
    arrays = (canary_buf, violation_ring, violation_write_index, slot_run_counter,
              kernel_run_counter, enable_chain_position_assert, write_offsets,
              write_seed_slot_indices, write_num_valid_reqs, input_ids, positions, out_cache_loc,
              expected_input_tokens, expected_input_positions)
    return _run(arrays, tuple(b for b, _ in sources), specs=tuple(s for _, s in sources),
                kernel_kind=int(kernel_kind), real_kv_hash_mode=int(real_kv_hash_mode),
                enable_write_input_assert=bool(enable_write_input_assert), implementation=impl,
                config=cfg)


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
    base.validate(context, plan, input_ids, positions, out_cache_loc, enable_write_input_assert,
                  expected_input_tokens, expected_input_positions)
    canary, ring, widx, sctr, kctr = run(
        **base.arguments(context, plan, input_ids, positions, out_cache_loc,
                         expected_input_tokens, expected_input_positions),
        enable_write_input_assert=enable_write_input_assert, implementation=implementation,
        config=config)
    return context.replace(canary_buf=canary, violation_ring=ring, violation_write_index=widx,
                           slot_run_counter=sctr, kernel_run_counter=kctr)
