"""The public verify: validate once, pick the implementation and its launch config, run it."""

from __future__ import annotations

import functools

import jax

from kvcanary_jax import _config
from kvcanary_jax.context import SourceSpec, VerifyOrWriteContext, check_extents
from kvcanary_jax.ops import _registry
from kvcanary_jax.ops.verify import base
from kvcanary_jax.plans import VerifyPlan

__all__ = ["OP", "run", "canary_verify"]

OP = _registry.standard_op("verify")

_ARRAYS = ("canary_buf", "violation_ring", "violation_write_index", "slot_run_counter",
           "kernel_run_counter", "verify_slot_indices", "verify_expected_tokens",
           "verify_expected_positions", "verify_prev_slot_indices", "verify_num_valid", "enable")


@functools.partial(
    jax.jit,
    static_argnames=("specs", "kernel_kind", "real_kv_hash_mode", "check_verify_expected_token",
                     "implementation", "config"),
)
def _run(arrays, source_bufs, *, specs, kernel_kind, real_kv_hash_mode,
         check_verify_expected_token, implementation, config):
    check_extents(source_bufs, specs)
    impl = functools.partial(OP.run, implementation, kernel_kind=kernel_kind,
                             real_kv_hash_mode=real_kv_hash_mode,
                             check_verify_expected_token=check_verify_expected_token,
                             config=config)
    return base.sized_call(impl, **dict(zip(_ARRAYS, arrays)),
                           sources=tuple(zip(source_bufs, specs)))


@_config.entry_point
def run(
    *, canary_buf, violation_ring, violation_write_index, slot_run_counter, kernel_run_counter,
    verify_slot_indices, verify_expected_tokens, verify_expected_positions,
    verify_prev_slot_indices, verify_num_valid, enable,
    sources: tuple[tuple[jax.Array, SourceSpec], ...], kernel_kind: int, real_kv_hash_mode: int,
    check_verify_expected_token: bool, implementation: str | None = None, config=None,
):
    """Array-level verify, without the contract's checks (the torch bridge checks the same
    contract on its tensors). Each source is ``(buffer, SourceSpec)``, the buffer any compact
    array holding the source's bytes (a buffer shorter than its rows span raises ValueError).
    Returns ``(violation_ring, violation_write_index, slot_run_counter, kernel_run_counter)``;
    donate those four for an in-place update (``canary_buf`` is only read).
    ``implementation`` / ``config``: as :func:`canary_verify`."""
    impl = OP.select(implementation, config=config, args=(canary_buf, verify_slot_indices))  # the target: see select
    cfg = OP.config(impl, base.shapes(canary_buf, verify_slot_indices), config)
    arrays = (canary_buf, violation_ring, violation_write_index, slot_run_counter,
              kernel_run_counter, verify_slot_indices, verify_expected_tokens,
              verify_expected_positions, verify_prev_slot_indices, verify_num_valid, enable)
    return _run(arrays, tuple(b for b, _ in sources), specs=tuple(s for _, s in sources),
                kernel_kind=int(kernel_kind), real_kv_hash_mode=int(real_kv_hash_mode),
                check_verify_expected_token=bool(check_verify_expected_token),
                implementation=impl, config=cfg)


@_config.entry_point
def canary_verify(
    *,
    context: VerifyOrWriteContext,
    plan: VerifyPlan,
    check_verify_expected_token: bool,
    implementation: str | None = None,
    config=None,
) -> VerifyOrWriteContext:
    """Verify the plan's entries against ``context.canary_buf``; returns the updated context
    (semantics: :mod:`kvcanary_jax.ops.verify.base`).

    Arguments as SGLang's ``launch_canary_verify_kernel``. The returned context carries the new
    ``violation_ring``, ``violation_write_index``, ``slot_run_counter`` and
    ``kernel_run_counter``; ``canary_buf`` and the sources are the input's. Under
    ``jax.jit(..., donate_argnames="context")`` the update is in place.

    ``implementation``: ``"xla"``, ``"pallas_triton"``, ``"pallas_interpret"``, ... (default: the
    platform's, see :mod:`kvcanary_jax.ops._registry`); ``config``: that implementation's
    ``Config`` (default: the device kind's tuned table, else heuristics).

    Raises at trace time: SGLang's ValueErrors (more than 4 sources; per-source ABI checks;
    canary slot stride below 4 int64 fields); RuntimeError for dtype / shape mismatches.
    """
    base.validate(context, plan)
    ring, widx, sctr, kctr = run(
        **base.arguments(context, plan), check_verify_expected_token=check_verify_expected_token,
        implementation=implementation, config=config)
    return context.replace(violation_ring=ring, violation_write_index=widx,
                           slot_run_counter=sctr, kernel_run_counter=kctr)
