"""canary_verify as a Mosaic TPU kernel (implementation ``"pallas_mosaic_tpu"``).

Semantics and bounds choices: those of the verify op (SGLang's ``launch_canary_verify_kernel``,
docs/spec.md §10; out-of-range slots as documented in the op's base module). Rows are appended in
entry order, i.e. in SGLang's reference order, with the ring guard
of docs/spec.md §14.1.

Shape: one kernel instance (grid ``(1,)``) walks the active entries in blocks of ``block``:

1. the block's plan words (four int64 fields as pair rows) are DMA'd into VMEM and its slot and
   predecessor words into SMEM;
2. the scalar unit walks the block's slots and issues the canary-row DMAs: one per *run* of
   consecutive rows (entries whose slots follow each other, within one 128-entry slab of the
   block: a dynamic-length row window), so a paged allocator's contiguous slots cost one DMA per
   run, scattered slots one per entry; and one per predecessor row unless the predecessor is the
   previous entry's slot (chain order: that row is in the block already);
3. the vector unit checks the block: rows -> lane-dense planes, chain link (mix3 on 32-bit
   pairs), position, token, fingerprint; violations are appended in entry order.

Block ``b + 1``'s plan is already in SMEM and its row DMAs are in flight while block ``b`` is
checked, and block ``b + 2``'s plan DMA overlaps both. Real-KV fingerprints come from
:mod:`kvcanary_jax.ops._tpu_fingerprint` (a separate kernel with the same
gather structure), as planes the check reads per block.

Per entry the kernel moves 32 B of plan (+ 16 B of it again into SMEM), 32 B of canary row (one
DMA per run of consecutive slots), 32 B more for a predecessor outside the block's chain (one
DMA), and 8 B of fingerprint.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kvcanary_jax import consts
from kvcanary_jax import hashing_u32
from kvcanary_jax.context import VerifyOrWriteContext
from kvcanary_jax.ops import _tpu_fingerprint as fingerprint
from kvcanary_jax.ops import _tpu_lib as tpu
from kvcanary_jax.plans import VerifyPlan

__all__ = ["Config", "heuristics", "run", "BLOCK"]

# Entries per block: 16 pair rows of each plan field (8 KiB of SMEM per field and buffer), two
# [8, 128, 8] row buffers, and a check over 8 x 128-lane planes. Larger blocks amortise the
# per-block DMA waits; smaller ones shorten the pipeline's fill for small plans.
BLOCK = 1024


@dataclasses.dataclass(frozen=True)
class Config(tpu.BlockConfig):
    """``block``: entries per block, a multiple of 512 (whole 8 x 128 tiles of pair rows); the
    rest: :class:`kvcanary_jax.ops._tpu_lib.Config`."""

    OP: ClassVar[str] = "canary_verify"
    block: int = BLOCK



def heuristics(shapes) -> Config:
    """Full blocks, smaller for plans below one block."""
    cap = int(shapes.get("capacity", BLOCK))
    return Config(block=min(BLOCK, tpu.pad_to(cap, tpu.PAIR_TILE)))


# st words: inputs then outputs share one SMEM vector (_PAD: zero, the vector is 8 words).
_NVALID, _ENABLE, _WIDX, _SCTR, _KCTR, _PAD = 0, 1, 2, 3, 5, 7
_F = consts.FailReason


class _Misc(enum.IntEnum):
    """Words of ``misc``."""

    RUNS = 0  # + s: canary-row runs (DMAs) in flight for buffer s, their lengths in ``lens``
    RING = 2  # two words: the Ring's state
    PREVS = 5  # + s: predecessor-row DMAs in flight for buffer s


_MISC_WORDS = 8


class _Sem(enum.IntEnum):
    """DMA semaphores (``+ s``: one per block buffer ``s``)."""

    PLAN = 0  # + s: the block's plan words (and fingerprints)
    ROWS = 2  # + s: the block's canary rows
    RING = 4  # a violation record
    PREV = 5  # + s: predecessor rows outside the block's chain


_SEMS = 7


class _Scratch(NamedTuple):
    """The kernel's scratch refs, in ``scratch_shapes`` order (:func:`_scratch_shapes`);
    ``r = block / 128`` plane rows; a leading 2 is the block buffer ``s``."""

    plan_v: Any  # VMEM [2, 4, 2 r, 128]: the block's slot, prev, token, position pair rows
    plan_s: Any  # SMEM [2, 2, 2 r, 128]: its slot and prev pair rows, as scalars
    rows: Any  # VMEM [2, r, 128, 8]: the canary row of each entry's slot
    prow: Any  # VMEM [2, r, 128, 8]: the canary row of each entry's predecessor
    rkv_v: Any  # VMEM [2, 2 r, 128]: the block's fingerprints (pair rows)
    misc: Any  # SMEM [_MISC_WORDS]: indexed by _Misc
    lens: Any  # SMEM [2, block]: run k's length, per buffer
    stage: Any  # SMEM RING_STAGE: the violation record being appended
    sems: Any  # DMA semaphores, indexed by _Sem


def _scratch_shapes(block: int) -> list:
    """``_Scratch``'s shapes."""
    r = block // tpu.LANES
    return [
        pltpu.VMEM((2, 4, 2 * r, tpu.LANES), jnp.int32),
        pltpu.SMEM((2, 2, 2 * r, tpu.LANES), jnp.int32),
        pltpu.VMEM((2, r, tpu.LANES, 8), jnp.int32),
        pltpu.VMEM((2, r, tpu.LANES, 8), jnp.int32),
        pltpu.VMEM((2, 2 * r, tpu.LANES), jnp.int32),
        pltpu.SMEM((_MISC_WORDS,), jnp.int32),
        pltpu.SMEM((2, block), jnp.int32),
        pltpu.SMEM(tpu.RING_STAGE, jnp.int32),
        pltpu.SemaphoreType.DMA((_SEMS,)),
    ]


def _verify_kernel(
    # Prefetch (SMEM [8]): st words _NVALID ... _KCTR
    st_in,
    # Input (HBM): the plan's four fields, pair rows [4, cap_pad // 64, 128]; canary rows
    # [N, canary_words]; fingerprints, pair rows [cap_pad // 64, 128]; the ring (aliased)
    plan_hbm, canary_hbm, rkv_hbm, _ring_in,
    # Output: the ring [C, 16] (HBM); st words (SMEM [8])
    ring_hbm, st_out,
    # Scratch: _Scratch
    *scratch,
    capacity, block, num_slots, canary_words, ring_cap, kind, check_token, has_rkv,
):
    scr = _Scratch(*scratch)
    plan_v, plan_s, rows, prow, rkv_v = scr.plan_v, scr.plan_s, scr.rows, scr.prow, scr.rkv_v
    misc, lens = scr.misc, scr.lens

    def sem(k: _Sem, s=0):
        return tpu.sem_at(scr.sems, k, s)

    r = block // tpu.LANES  # plane rows per block
    pr = 2 * r  # pair rows per block
    nvalid = st_in[_NVALID]
    enabled = st_in[_ENABLE] != 0
    active = jnp.where(enabled, jnp.clip(nvalid, 0, capacity), 0)
    nblocks = tpu.idiv(active + block - 1, block)
    ring = tpu.Ring(ring_hbm, ring_cap, misc, _Misc.RING, scr.stage, sem(_Sem.RING))
    ring.start(st_in[_WIDX])

    def fetch(b, slot):
        rows_b = pl.ds(pl.multiple_of(b * pr, 8), pr)
        cps = [pltpu.make_async_copy(plan_hbm.at[:, rows_b, :], plan_v.at[slot],
                                     sem(_Sem.PLAN, slot)),
               pltpu.make_async_copy(plan_hbm.at[pl.ds(0, 2), rows_b, :], plan_s.at[slot],
                                     sem(_Sem.PLAN, slot))]
        if has_rkv:
            cps.append(pltpu.make_async_copy(rkv_hbm.at[rows_b], rkv_v.at[slot],
                                             sem(_Sem.PLAN, slot)))
        return cps

    def rows_copy(row, m, buf, e, slot, sem):
        """Canary rows [row, row + m) into entries [e, e + m) of ``buf`` (one 128-entry slab)."""
        src = canary_hbm.at[pl.ds(row, m)] if canary_words == 8 else \
            canary_hbm.at[pl.ds(row, m), pl.ds(0, 8)]
        return pltpu.make_async_copy(
            src, buf.at[slot, tpu.idiv(e, tpu.LANES), pl.ds(tpu.irem(e, tpu.LANES), m)], sem)

    def issue(b, slot):
        """Row DMAs of block b's entries: the slots' rows, a run of consecutive rows (in one
        128-entry slab) per DMA; the predecessors' rows, one DMA each, unless the predecessor
        is the previous entry's slot (chain order: that row is in the block already)."""
        n = jnp.minimum(block, active - b * block)
        ss, ps = plan_s.at[slot, 0], plan_s.at[slot, 1]
        zero = jnp.int32(0)

        def flush(start, first, length, runs):
            @pl.when(length > 0)
            def _():
                rows_copy(start, length, rows, first, slot, sem(_Sem.ROWS, slot)).start()
                lens[slot, runs] = length

            return runs + (length > 0).astype(jnp.int32)

        def one(e, carry):
            start, first, length, runs, nprev, last_hi, last_lo = carry
            row_, col = tpu.idiv(e, 64), 2 * tpu.irem(e, 64)
            s_lo, s_hi = tpu.u32(ss[row_, col]), tpu.u32(ss[row_, col + 1])
            checked = (s_hi | s_lo) != jnp.uint32(0)
            pos_ok = tpu.pair_in_range((s_hi, s_lo), num_slots)
            fetch = checked & (pos_ok | tpu.pair_neg_in_range((s_hi, s_lo), num_slots))
            row = tpu.i32(jnp.where(pos_ok, s_lo, s_lo + jnp.uint32(num_slots)))
            extend = fetch & (length > 0) & (row == start + length) & (tpu.irem(e, tpu.LANES) != 0)
            runs = flush(start, first, jnp.where(extend, 0, length), runs)
            start = jnp.where(extend, start, jnp.where(fetch, row, zero))
            first = jnp.where(extend, first, e)
            length = jnp.where(extend, length + 1, fetch.astype(jnp.int32))
            p_lo, p_hi = tpu.u32(ps[row_, col]), tpu.u32(ps[row_, col + 1])
            reuse = (e > 0) & (p_hi == last_hi) & (p_lo == last_lo)
            fetch_p = checked & (p_hi == jnp.uint32(0)) & (p_lo != jnp.uint32(0)) & \
                (p_lo < jnp.uint32(num_slots)) & jnp.logical_not(reuse)

            @pl.when(fetch_p)
            def _():
                rows_copy(tpu.i32(p_lo), 1, prow, e, slot, sem(_Sem.PREV, slot)).start()

            return (start, first, length, runs, nprev + fetch_p.astype(jnp.int32), s_hi, s_lo)

        start, first, length, runs, nprev, _, _ = lax.fori_loop(
            0, n, one, (zero, zero, zero, zero, zero, jnp.uint32(0), jnp.uint32(0)))
        misc[_Misc.RUNS + slot] = flush(start, first, length, runs)
        misc[_Misc.PREVS + slot] = nprev

    def wait(slot):
        def one(k, c):
            rows_copy(0, lens[slot, k], rows, 0, slot, sem(_Sem.ROWS, slot)).wait()
            return c

        lax.fori_loop(0, misc[_Misc.RUNS + slot], one, 0)
        tpu.wait_n(rows_copy(0, 1, prow, 0, slot, sem(_Sem.PREV, slot)), misc[_Misc.PREVS + slot])

    def check(b, slot):
        slot_p = tpu.planes(plan_v.at[slot, 0])
        prev_p = tpu.planes(plan_v.at[slot, 1])
        etok_p = tpu.planes(plan_v.at[slot, 2])
        epos_p = tpu.planes(plan_v.at[slot, 3])
        idx = tpu.entry_index(r, b * block)
        first = tpu.entry_index(r) == 0
        checked = (idx < active) & jnp.logical_not(tpu.pair_is_zero(slot_p))
        s_ok = checked & (tpu.pair_in_range(slot_p, num_slots) |
                          tpu.pair_neg_in_range(slot_p, num_slots))
        zero = jnp.zeros((r, tpu.LANES), jnp.uint32)

        def masked(words, ok):
            return [jnp.where(ok, w, zero) for w in words]

        f = masked(tpu.rows_to_planes(rows[slot]), s_ok)
        tok, pos, link, rkv = (f[1], f[0]), (f[3], f[2]), (f[5], f[4]), (f[7], f[6])
        p_ok = checked & tpu.pair_in_range(prev_p, num_slots) & \
            jnp.logical_not(tpu.pair_is_zero(prev_p))
        reuse = (p_ok & jnp.logical_not(first)
                 & hashing_u32.eq(prev_p, tuple(map(tpu.shift_one, slot_p))))
        pf = masked(tpu.rows_to_planes(prow[slot]), p_ok)
        pf = [jnp.where(reuse, tpu.shift_one(cur), other) for cur, other in zip(f[:6], pf[:6])]
        p_tok, p_pos, p_link = (pf[1], pf[0]), (pf[3], pf[2]), (pf[5], pf[4])
        anchor = hashing_u32.const(hashing_u32.join_int(*hashing_u32.ANCHOR_HASH), zero)
        linked = hashing_u32.mix3(p_link, p_tok, p_pos)
        neg = hashing_u32.is_neg(prev_p)
        exp_chain = (jnp.where(neg, anchor[0], linked[0]), jnp.where(neg, anchor[1], linked[1]))
        chain_checked = jnp.logical_not(tpu.pair_is_zero(prev_p))
        exp_aux = tuple(jnp.where(chain_checked, e, l_) for e, l_ in zip(exp_chain, link))
        if has_rkv:
            k = tpu.planes(rkv_v.at[slot])
            ok = checked & jnp.logical_not(hashing_u32.is_neg(slot_p))
            exp_rkv = (jnp.where(ok, k[0], zero), jnp.where(ok, k[1], zero))
        else:
            exp_rkv = (zero, zero)
        bits = (jnp.where(chain_checked & hashing_u32.ne(link, exp_chain),
                          int(_F.VERIFY_CHAIN_HASH_MISMATCH), 0)
                | jnp.where(hashing_u32.ne(pos, epos_p), int(_F.VERIFY_POSITION_MISMATCH), 0)
                | jnp.where(hashing_u32.ne(rkv, exp_rkv), int(_F.VERIFY_REAL_KV_HASH_MISMATCH), 0))
        minus1 = hashing_u32.const(-1, zero)
        if check_token:
            exp_tok = etok_p
            bits = bits | jnp.where(hashing_u32.ne(exp_tok, minus1) & hashing_u32.ne(tok, exp_tok),
                                    int(_F.VERIFY_TOKEN_MISMATCH), 0)
        else:
            exp_tok = minus1
        viol = checked & (bits != 0)
        bits_p = (zero, tpu.u32(bits))
        words = tpu.record_words(jnp.full((r, tpu.LANES), kind, jnp.int32),
                                 [slot_p, pos, tok, exp_tok, link, exp_aux, bits_p])
        ring.append_block(viol, words, idx)

    tpu.pipeline(nblocks, fetch=fetch, issue=issue, wait=wait, body=check)

    # Counters: kernel_run_counter + 1 always; slot_run_counter + the active entries.
    def add64(at, v):
        lo = tpu.u32(st_in[at])
        hi = tpu.u32(st_in[at + 1])
        new_hi, new_lo = hashing_u32.add_u32((hi, lo), tpu.u32(v))
        st_out[at] = tpu.i32(new_lo)
        st_out[at + 1] = tpu.i32(new_hi)

    st_out[_NVALID] = nvalid
    st_out[_ENABLE] = st_in[_ENABLE]
    st_out[_WIDX] = ring.new_index()
    add64(_SCTR, active)
    add64(_KCTR, jnp.int32(1))
    st_out[_PAD] = jnp.int32(0)


def run(context: VerifyOrWriteContext, plan: VerifyPlan, *, check_verify_expected_token: bool,
        config: Config) -> VerifyOrWriteContext:
    """The updated context, the ring aliased to its input (``canary_buf`` is only read)."""
    mode, kind = int(context.real_kv_hash_mode), int(context.kernel_kind)
    sources = context.bound_sources()
    capacity = int(plan.verify_slot_indices.shape[0])
    block = config.block
    cap_pad = tpu.pad_to(capacity, block)
    num_slots = int(context.canary_buf.shape[0])
    ring_cap = int(context.violation_ring.shape[0])

    entries = jnp.stack([tpu.to_pair_rows(x, cap_pad) for x in (
        plan.verify_slot_indices, plan.verify_prev_slot_indices, plan.verify_expected_tokens,
        plan.verify_expected_positions)])
    canary = tpu.words32(context.canary_buf) if num_slots else jnp.zeros((1, 8), jnp.int32)
    ring = tpu.words32(context.violation_ring) if ring_cap else jnp.zeros((1, 16), jnp.int32)
    st = jnp.concatenate([  # the status words _NVALID, _ENABLE, then _WIDX.._KCTR
        plan.verify_num_valid.astype(jnp.int32).reshape(1),
        plan.enable.astype(jnp.int32).reshape(1), tpu.counter_words(context),
        jnp.zeros((1,), jnp.int32)])
    has_rkv = bool(sources) and mode != int(consts.RealKvHashMode.NONE)
    if has_rkv:
        live = jnp.where(plan.enable.reshape(()) != 0,
                         jnp.clip(plan.verify_num_valid.reshape(()), 0, capacity), 0)
        rkv = fingerprint.fingerprints_from_pair_rows(entries[0], live, sources, mode=mode,
                                                      block=block,
                                                      interpret=config.interpret or False)
    else:
        rkv = jnp.zeros((8, tpu.LANES), jnp.int32)
    kernel = functools.partial(
        _verify_kernel, capacity=capacity, block=block, num_slots=num_slots,
        canary_words=int(canary.shape[1]), ring_cap=ring_cap, kind=kind,
        check_token=bool(check_verify_expected_token), has_rkv=has_rkv)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    # Bytes: plan (32 B + 16 B into SMEM per entry), two canary rows, a fingerprint (8 B).
    nbytes = capacity * (48 + 64 + (8 if has_rkv else 0)) + ring_cap * 0
    ring32, st_out = tpu.call(
        kernel, st, entries, canary, rkv, ring,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(1,),
            in_specs=[any_spec, any_spec, any_spec, any_spec],
            out_specs=[any_spec, pl.BlockSpec(memory_space=pltpu.SMEM)],
            scratch_shapes=_scratch_shapes(block)),
        out_shape=[jax.ShapeDtypeStruct(ring.shape, jnp.int32),
                   jax.ShapeDtypeStruct((8,), jnp.int32)],
        input_output_aliases={4: 0},
        compiler_params=tpu.compiler_params(config.vmem_limit_bytes),
        cost_estimate=tpu.cost(bytes_accessed=nbytes, ops=capacity * 1500),
        interpret=config.interpret or False,
        name="kvcanary_verify_tpu",
    )
    return tpu.counters_from_words(context, st_out[_WIDX:], ring32)
