"""canary_verify as plain XLA (``implementation="xla"``: CPU, TPU, GPU).

The semantics and out-of-range choices of :mod:`kvcanary_jax.ops.verify.base`, byte for byte,
violation rows in SGLang's reference order (entry order).

Shape of the computation: every active entry at once. The slots' canary rows are one gather of
the uint8 buffer (only the gathered rows are reinterpreted as int64 fields). A predecessor that
is the previous entry's slot (a plan in chain order) takes that entry's fields; the others are a
second gather. The expected link, the real-KV fold and the fail bits are elementwise. Violations
are appended by cumsum compaction: an inclusive prefix sum of the violation flags, then each
ring row the launch may fill finds its entry (a binary search of the prefix sum) and rebuilds
that entry's record, so no more than ``ring_capacity`` records are ever materialised. The ring
guard of :mod:`kvcanary_jax.ops._xla_lib` applies.

:class:`Config` ``block``: 0 checks the whole plan capacity in one pass (fastest when the plan is
mostly live); a power of two walks the live entries in blocks of that many, so the work follows
``verify_num_valid`` rather than the capacity (a serving plan's capacity is 3x the KV pool).
``branch``: conditionals skip the predecessor gather when no entry needs it and the ring update
when nothing lands in the ring. Both off on GPUs, where XLA reads a loop's or a conditional's
predicate back to the host.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Mapping

import jax
import jax.numpy as jnp

from kvcanary_jax import consts, hashing
from kvcanary_jax.context import VerifyOrWriteContext
from kvcanary_jax.ops import _xla_lib
from kvcanary_jax.plans import VerifyPlan

__all__ = ["Config", "heuristics", "run"]


@dataclasses.dataclass(frozen=True)
class Config:
    """``block``: entries per loop trip over the live entries; 0 = one pass over the capacity.
    ``branch``: skip, behind a conditional, the work the data makes unnecessary (predecessor
    rows when every predecessor is the previous entry's slot, the ring when nothing is
    recorded)."""

    block: int = 0
    branch: bool = True

    def __post_init__(self):
        if self.block < 0 or self.block & (self.block - 1):
            raise ValueError(f"kv-canary: verify xla block must be 0 or a power of two, "
                             f"got {self.block}")


# One pass up to this capacity; past it, blocks of this many entries (off GPUs).
ONE_PASS_MAX = 1 << 16


def heuristics(shapes: Mapping[str, int], backend: str | None = None) -> Config:
    """On GPUs, one pass and no conditional: XLA reads the predicate of a loop trip or a
    conditional back to the host there. Elsewhere, conditionals, and blocks of
    :data:`ONE_PASS_MAX` entries past that capacity."""
    if (backend or jax.default_backend()) == "gpu":
        return Config(block=0, branch=False)
    return Config(block=0 if shapes["capacity"] <= ONE_PASS_MAX else ONE_PASS_MAX)


def _check(canary_buf, words, slots, etok, epos, prev, act, *, specs, mode, kind, check_token,
           branch):
    """Entries' violation flags and records (vectors over entries; ``act``: entries to check)."""
    i64 = jnp.int64
    num_slots = canary_buf.shape[0]
    checked = act & (slots != consts.TOKEN_TO_KV_SLOT_PADDING)
    s_eff = jnp.where(slots < 0, slots + num_slots, slots)
    tok, pos, ph, rkv = _xla_lib.canary_fields(canary_buf, s_eff,
                                        checked & (s_eff >= 0) & (s_eff < num_slots))
    p_ok = checked & (prev > 0) & (prev < num_slots)
    # In a chain-ordered plan the predecessor is the previous entry's slot, whose row was just
    # loaded (an active entry with a slot in (0, num_slots) always is): take it from there.
    reuse = p_ok & (jnp.arange(slots.shape[0]) > 0) & (prev == jnp.roll(slots, 1))
    need = p_ok & ~reuse
    gathered = _xla_lib.maybe(branch, jnp.any(need),
                              lambda: _xla_lib.canary_fields(canary_buf, prev, need),
                              lambda: (jnp.zeros(slots.shape, i64),)
                              * consts.CANARY_FIELDS_PER_SLOT)
    p_tok, p_pos, p_ph, _ = (jnp.where(reuse, jnp.roll(f, 1), g)
                             for f, g in zip((tok, pos, ph, rkv), gathered))
    chain_checked = prev != consts.TOKEN_TO_KV_SLOT_PADDING
    exp_chain = jnp.where(prev < 0, jnp.asarray(hashing.ANCHOR_HASH_I64, i64),
                          hashing.mix3(p_ph, p_tok, p_pos))
    exp_tok = etok if check_token else jnp.full(slots.shape, -1, i64)
    exp_rkv = hashing.fold_real_kv(slots, checked & (slots >= 0), words, specs, mode,
                                   gather=_xla_lib.source_word)
    F = consts.FailReason
    bits = (jnp.where(chain_checked & (ph != exp_chain), int(F.VERIFY_CHAIN_HASH_MISMATCH), 0)
            | jnp.where(pos != epos, int(F.VERIFY_POSITION_MISMATCH), 0)
            | jnp.where(rkv != exp_rkv, int(F.VERIFY_REAL_KV_HASH_MISMATCH), 0))
    if check_token:
        bits = bits | jnp.where((exp_tok != -1) & (tok != exp_tok), int(F.VERIFY_TOKEN_MISMATCH),
                                0)
    viol = checked & (bits != 0)
    record = jnp.stack([jnp.full(slots.shape, kind, i64), slots, pos, tok, exp_tok, ph,
                        jnp.where(chain_checked, exp_chain, ph), bits.astype(i64)], axis=-1)
    return viol, record


def run(context: VerifyOrWriteContext, plan: VerifyPlan, *, check_verify_expected_token: bool,
        config: Config) -> VerifyOrWriteContext:
    """The updated context (no validation; ``canary_buf`` is only read)."""
    canary_buf = context.canary_buf
    ring, widx = context.violation_ring, context.violation_write_index
    sources = context.bound_sources()
    source_bufs, specs = tuple(b for b, _ in sources), tuple(s for _, s in sources)
    mode, kind = int(context.real_kv_hash_mode), int(context.kernel_kind)
    check_token = bool(check_verify_expected_token)
    block, branch = config.block, config.branch
    i64 = jnp.int64
    cap = plan.verify_slot_indices.shape[0]
    enabled = plan.enable[0] != 0
    active = jnp.where(enabled, jnp.clip(plan.verify_num_valid[0].astype(i64), 0, cap), 0)
    counted = dict(kernel_run_counter=context.kernel_run_counter + 1,
                   slot_run_counter=context.slot_run_counter + active)
    if cap == 0:
        return context.replace(**counted)
    words = _xla_lib.source_arrays(source_bufs, specs)
    check = functools.partial(_check, canary_buf, words, specs=specs, mode=mode, kind=kind,
                              check_token=check_token, branch=branch)
    entries = (plan.verify_slot_indices, plan.verify_expected_tokens,
               plan.verify_expected_positions, plan.verify_prev_slot_indices)

    def records(k, ok):
        return check(*(_xla_lib.take(a, k, ok) for a in entries), ok)[1]

    w0 = widx[0].astype(i64)
    if block == 0 or block >= cap:
        viol, _ = check(*entries, jnp.arange(cap, dtype=i64) < active)
        incl = jnp.cumsum(viol.astype(i64))
        ring, widx = _xla_lib.ring_append(
            ring, widx, incl[-1], lambda j, ok: records(_xla_lib.record_of(incl, j)[0], ok),
            branch=branch)
        return context.replace(violation_ring=ring, violation_write_index=widx, **counted)

    # Blocks over the live entries. The last block's slice is clamped to the capacity, so it may
    # start before the block boundary: entries below the boundary were done by the previous trip.
    def trip(carry):
        b, ring, done = carry
        lo = b * block
        start = jnp.minimum(lo, cap - block)
        k = start + jnp.arange(block, dtype=i64)
        part = tuple(jax.lax.dynamic_slice(a, (start,), (block,)) for a in entries)
        viol, _ = check(*part, (k >= lo) & (k < active))
        incl = jnp.cumsum(viol.astype(i64))
        n = incl[-1]

        def rows(j, ok):
            rel = j - done
            ok = ok & (rel >= 0) & (rel < n)
            return records(start + _xla_lib.record_of(incl, jnp.where(ok, rel, 0))[0], ok)

        ring = _xla_lib.ring_fill(ring, w0, done, n, rows, branch=branch)
        return b + 1, ring, done + n

    nblocks = (active + block - 1) // block
    _, ring, total = jax.lax.while_loop(lambda c: c[0] < nblocks, trip,
                                        (jnp.zeros((), i64), ring, jnp.zeros((), i64)))
    return context.replace(violation_ring=ring,
                           violation_write_index=_xla_lib.ring_index(widx, total), **counted)
