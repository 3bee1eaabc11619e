"""canary_verify: check that written slots still hold what the write op stamped.

Semantics (SGLang's ``launch_canary_verify_kernel``, docs/spec.md §10)::

    kernel_run_counter += 1                                   # always, even when enable == 0
    if enable[0] == 0: return
    A = clamp(verify_num_valid[0], 0, verify_capacity);  slot_run_counter += A
    for k in [0, A):  (entries with slot 0 are skipped, still counted)
        (tok, pos, ph, rkv) = canary_buf[s];  p = prev slot
        exp_chain = anchor hash if p < 0, slot_hash(p) if p > 0, ph (check skipped) if p == 0
        bits = 1 chain | 32 token (when asked, expected != -1) | 2 position | 4 real-KV
        if bits: record(s, pos, tok, exp_tok, ph, exp_chain, bits)

Records are appended in entry order by the reference and ``xla``; on the GPU (``pallas_triton``)
each block of entries reserves its rows with one atomic claim, so a block's rows are contiguous
and in entry order, and the blocks' claims land in the order the atomics ran.
``pallas_interpret`` runs that kernel's programs one after another: entry order, unless a launch
config's grid-stride loop gives a program several blocks (then program by program).

Out-of-range indices never cause an out-of-bounds access (SGLang's GPU reads outside the buffer):

* a negative slot ``-num_slots <= s < 0`` reads row ``s + num_slots``, as SGLang's reference
  does (Python indexing); its real-KV fingerprint is computed from zero words (the reference
  raises there), i.e. expected 0;
* a slot outside ``[-num_slots, num_slots)`` reads as an all-zero row (its record carries the raw
  slot index);
* a predecessor at or past ``num_slots`` reads as an all-zero row (expected link mix3(0,0,0) = 0);
* a negative ``verify_num_valid`` means no entry (the reference's clamp).

The violation ring is appended to under the ring guard of :mod:`kvcanary_jax.ops._kernel_lib`
(a negative write index writes nothing and stays; the index saturates at 2**31 - 1).

Zero sizes are handled here, once for every implementation (:func:`sized_call`), as SGLang does
where it accepts them: a 0-entry plan only bumps ``kernel_run_counter`` (SGLang's reference returns
before reading anything); a 0-row ring counts violations in ``violation_write_index`` and stores
none (SGLang's reference does the same); a 0-slot canary buffer has every slot out of range, so it
follows the rules above (SGLang's reference raises IndexError once an entry reads a slot, and its
GPU kernel reads outside the buffer); a real-KV source of 0 rows reads as zero words (SGLang's
reference raises from ``index_select`` once a slot is folded).

This module holds the op's contract, its static shapes (the keys of tuned launch configs) and
:func:`reference`, the pure-jnp version of the op (entries in order), the test oracle of every
implementation.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from kvcanary_jax import _config, consts, hashing
from kvcanary_jax.context import (
    SourceAbi,
    SourceCount,
    VerifyOrWriteContext,
    as_words,
    nonempty_source,
)
from kvcanary_jax.contracts import Contiguous, Contract, Rule, meta_of
from kvcanary_jax.ops._contract_lib import (
    canary_checks,
    context_guard_checks,
    source_metas,
    tensor_guard,
)
from kvcanary_jax.ops._kernel_lib import canary_words, ring_append
from kvcanary_jax.plans import VerifyPlan

__all__ = ["CONTRACT", "OUTPUTS", "validate", "shapes", "sized_call", "reference",
           "canary_verify_reference"]

_V = "canary_verify"

# SGLang's launcher order: source count (every path); contiguity (canary, plan, sinks);
# per-source ABI checks; then its C++ guards (RuntimeError, wording ours) and the stride check.
CONTRACT = Contract(
    op=_V,
    checks=(
        SourceCount(),
        *(Contiguous(n) for n in (
            "canary_buf", "plan.verify_slot_indices", "plan.verify_expected_tokens",
            "plan.verify_expected_positions", "plan.verify_prev_slot_indices",
            "plan.verify_num_valid", "plan.enable", "violation_ring", "violation_write_index",
            "slot_run_counter", "kernel_run_counter")),
        SourceAbi(),
        *tensor_guard(_V, "plan.verify_slot_indices", "int64", 1),
        *(
            c
            for n in ("plan.verify_expected_tokens", "plan.verify_expected_positions",
                      "plan.verify_prev_slot_indices")
            for c in tensor_guard(_V, n, "int64", 1)
        ),
        Rule(
            lambda metas, s: next(
                ({"name": n, "shape": metas[n].shape, "c": metas["plan.verify_slot_indices"].shape}
                 for n in ("plan.verify_expected_tokens", "plan.verify_expected_positions",
                           "plan.verify_prev_slot_indices")
                 if metas[n].shape != metas["plan.verify_slot_indices"].shape),
                None,
            ),
            "kv-canary: canary_verify: {name} must have the shape of plan.verify_slot_indices "
            "{c}, got {shape}",
            RuntimeError,
        ),
        *tensor_guard(_V, "plan.verify_num_valid", "int32", (1,)),
        *tensor_guard(_V, "plan.enable", "int32", (1,)),
        *context_guard_checks(_V),
        *canary_checks(),
    ),
)


# The context fields a launch updates (the others come back as they went in).
OUTPUTS = ("violation_ring", "violation_write_index", "slot_run_counter", "kernel_run_counter")


def validate(context: VerifyOrWriteContext, plan: VerifyPlan) -> None:
    """:data:`CONTRACT` on a context and a plan (raises at trace time)."""
    metas = {k: None if v is None else meta_of(v) for k, v in context.arrays("verify").items()
             if not k.startswith("real_kv_sources")}
    metas.update({f"plan.{f.name}": meta_of(getattr(plan, f.name))
                  for f in dataclasses.fields(VerifyPlan)})
    metas.update(source_metas(context.real_kv_sources))
    CONTRACT.validate_metas(metas, num_sources=len(context.real_kv_sources))


def shapes(context: VerifyOrWriteContext, plan: VerifyPlan) -> dict[str, int]:
    """The static sizes a launch configuration may depend on (``real_kv_words``: the words each
    entry's real-KV fingerprint folds, 0 without one)."""
    return {"num_slots": int(context.canary_buf.shape[0]),
            "capacity": int(plan.verify_slot_indices.shape[0]),
            "real_kv_words": context.real_kv_words()}


def sized_call(fn, context: VerifyOrWriteContext, plan: VerifyPlan, **statics
               ) -> VerifyOrWriteContext:
    """``fn(context, plan, **statics)`` (an implementation's ``run``, or the reference), with
    the zero sizes of the module docstring handled before any implementation sees them: the
    implementations never get an empty canary buffer, ring, plan or source buffer. Returns the
    updated context; what was swapped in for a zero size is the caller's again."""
    if plan.verify_slot_indices.shape[0] == 0:
        return context.replace(kernel_run_counter=context.kernel_run_counter + 1)
    swapped = {}
    if context.violation_ring.shape[0] == 0:
        # Violations are counted, never stored: a scratch row takes what is written, the empty
        # ring is returned (the guard's index update does not depend on the capacity).
        swapped["violation_ring"] = jnp.zeros((1, consts.VIOLATION_FIELDS),
                                              context.violation_ring.dtype)
    if context.canary_buf.shape[0] == 0:
        # Every slot is out of range and reads as an all-zero row. One zero row reads the same:
        # slot 0 is never checked, a predecessor 0 is never read, and a slot -1 (which wraps to
        # row 0 here) reads zeros like an out-of-range slot; its real-KV fingerprint does not
        # depend on the canary.
        swapped["canary_buf"] = jnp.zeros((1, context.canary_buf.shape[1]),
                                          context.canary_buf.dtype)
    out = fn(context.replace(**swapped, real_kv_sources=tuple(
        nonempty_source(s) for s in context.real_kv_sources)), plan, **statics)
    return out.replace(**{k: getattr(context, k) for k in swapped},
                       real_kv_sources=context.real_kv_sources)


# ---------------------------------------------------------------------------------------------
# Pure-jnp reference (entries in order, rows appended in entry order; same bounds choices).


@functools.partial(jax.jit, static_argnames=("specs", "mode", "kind", "check_token"))
def _reference(canary_buf, ring, widx, sctr, kctr, slots, etok, epos, prev, nvalid,
                          enable, source_bufs, *, specs, mode, kind, check_token):
    i64 = jnp.int64
    num_slots = canary_buf.shape[0]
    c = canary_words(canary_buf).reshape(num_slots, -1)
    cap = slots.shape[0]
    enabled = enable[0] != 0
    active = jnp.where(enabled, jnp.clip(nvalid[0], 0, cap), 0).astype(i64)
    k = jnp.arange(cap, dtype=i64)
    checked = (k < active) & (slots != consts.TOKEN_TO_KV_SLOT_PADDING)

    def row(idx, ok):
        return jnp.where(ok[:, None], c[jnp.where(ok, idx, 0), :4], 0)

    s_eff = jnp.where(slots < 0, slots + num_slots, slots)
    tok, pos, ph, rkv = row(s_eff, checked & (s_eff >= 0) & (s_eff < num_slots)).T
    p_tok, p_pos, p_ph, _ = row(prev, checked & (prev > 0) & (prev < num_slots)).T
    chain_checked = prev != consts.TOKEN_TO_KV_SLOT_PADDING
    exp_chain = jnp.where(prev < 0, jnp.asarray(hashing.ANCHOR_HASH_I64, i64),
                          hashing.mix3(p_ph, p_tok, p_pos))
    exp_tok = etok if check_token else jnp.full((cap,), -1, i64)
    words = [as_words(b) for b in source_bufs]
    exp_rkv = hashing.fold_real_kv(slots, checked & (slots >= 0), words, specs, mode,
                                   gather=hashing.array_gather)
    F = consts.FailReason
    bits = (jnp.where(chain_checked & (ph != exp_chain), int(F.VERIFY_CHAIN_HASH_MISMATCH), 0)
            | jnp.where(pos != epos, int(F.VERIFY_POSITION_MISMATCH), 0)
            | jnp.where(rkv != exp_rkv, int(F.VERIFY_REAL_KV_HASH_MISMATCH), 0))
    if check_token:
        bits = bits | jnp.where((exp_tok != -1) & (tok != exp_tok), int(F.VERIFY_TOKEN_MISMATCH), 0)
    viol = checked & (bits != 0)
    n = viol.astype(i64)
    vals = jnp.stack([jnp.full((cap,), kind, i64), slots, pos, tok, exp_tok, ph,
                      jnp.where(chain_checked, exp_chain, ph), bits.astype(i64)], axis=1)
    ring, widx = ring_append(ring, widx, viol, jnp.cumsum(n) - n, jnp.sum(n), vals)
    return ring, widx, sctr + active, kctr + 1


def reference(context: VerifyOrWriteContext, plan: VerifyPlan, *,
              check_verify_expected_token: bool) -> VerifyOrWriteContext:
    """The array-level reference: the arguments and result of an implementation's ``run``, no
    validation."""

    def run(context, plan):
        sources = context.bound_sources()
        ring, widx, sctr, kctr = _reference(
            context.canary_buf, context.violation_ring, context.violation_write_index,
            context.slot_run_counter, context.kernel_run_counter, plan.verify_slot_indices,
            plan.verify_expected_tokens, plan.verify_expected_positions,
            plan.verify_prev_slot_indices, plan.verify_num_valid, plan.enable,
            tuple(b for b, _ in sources), specs=tuple(s for _, s in sources),
            mode=int(context.real_kv_hash_mode), kind=int(context.kernel_kind),
            check_token=bool(check_verify_expected_token),
        )
        return context.replace(violation_ring=ring, violation_write_index=widx,
                               slot_run_counter=sctr, kernel_run_counter=kctr)

    return sized_call(run, context, plan)


@_config.with_x64
def canary_verify_reference(*, context: VerifyOrWriteContext, plan: VerifyPlan,
                            check_verify_expected_token: bool) -> VerifyOrWriteContext:
    """Pure-jnp reference of :func:`kvcanary_jax.canary_verify` (rows in entry order; same
    validation)."""
    validate(context, plan)
    return reference(context, plan,
                     check_verify_expected_token=bool(check_verify_expected_token))
