"""The public verify: validate once, pick the implementation and its launch config, run it."""

from __future__ import annotations

import functools

import jax

from kvcanary_jax import _config
from kvcanary_jax.context import VerifyOrWriteContext, check_extents
from kvcanary_jax.ops import _registry
from kvcanary_jax.ops.verify import base
from kvcanary_jax.plans import VerifyPlan

__all__ = ["OP", "run", "canary_verify"]

OP = _registry.standard_op("verify")

@functools.partial(
    jax.jit, static_argnames=("check_verify_expected_token", "implementation", "config"))
def _run(context, plan, *, check_verify_expected_token, implementation, config):
    check_extents(context.real_kv_sources)
    out = base.sized_call(functools.partial(OP.run, implementation, config=config),
                          context, plan, check_verify_expected_token=check_verify_expected_token)
    # Only the updated fields leave the jit: one returned unchanged would be copied by XLA.
    return {k: getattr(out, k) for k in base.OUTPUTS}


@_config.entry_point
def run(context: VerifyOrWriteContext, plan: VerifyPlan, *, check_verify_expected_token: bool,
        implementation: str | None = None, config=None) -> VerifyOrWriteContext:
    """Array-level verify, without the contract's checks (the torch bridge checks the same
    contract on its tensors). A source's ``tensor`` may be any compact array holding its bytes,
    addressed through its ``view`` and ``offset_bytes`` (a buffer shorter than its rows span
    raises ValueError). Returns the context with :data:`~kvcanary_jax.ops.verify.base.OUTPUTS`
    updated; donate those for an in-place update (``canary_buf`` is only read).
    ``implementation`` / ``config``: as :func:`canary_verify`."""
    impl = OP.select(implementation, config=config,
                     args=(context.canary_buf, plan.verify_slot_indices))  # the target: see select
    cfg = OP.config(impl, base.shapes(context, plan), config)
    return context.replace(**_run(
        context, plan, check_verify_expected_token=bool(check_verify_expected_token),
        implementation=impl, config=cfg))


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
    return run(context, plan, check_verify_expected_token=check_verify_expected_token,
               implementation=implementation, config=config)
