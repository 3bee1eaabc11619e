"""canary_verify as a Mosaic TPU kernel (implementation ``"pallas_mosaic_tpu"``).

Semantics and bounds choices: those of the verify op (SGLang's ``launch_canary_verify_kernel``,
docs/spec.md §10; out-of-range slots as documented in the op's base module). Rows are appended in
entry order, i.e. in SGLang's reference order, with the ring guard
of docs/spec.md §14.1.

Shape: one kernel instance (grid ``(1,)``) walks the active entries in blocks of ``block``:

1. the block's plan words (four int64 fields as pair rows) are DMA'd into VMEM and its slot and
   predecessor words into SMEM;
2. the scalar unit walks the block's slots and issues the canary DMAs. The canary is read in
   place, as canary tiles (:func:`kvcanary_jax.ops._tpu_lib.canary_tiles`: the transpose of
   SGLang's bytes, which XLA already lays out that way), and a DMA moves a whole tile of 128
   slots (Mosaic refuses a slot's 32-byte window). An entry fetches its slot's tile unless the
   previous entry of its 128-entry slab fetched that tile, so a run of consecutive slots costs
   one DMA per 128 slots, scattered slots one per entry; the tiles a slab fetches land in fetch
   order. The predecessors' tiles follow the same rule, and an entry whose predecessor is the
   previous entry's slot fetches none (chain order: that slot is in the block already);
3. the vector unit checks the block: the entries' slots out of the fetched tiles as lane-dense
   planes (:func:`kvcanary_jax.ops._tpu_lib.select_tiles`: per fetched tile a lane gather and a
   select), chain link (mix3 on 32-bit pairs), position, token, fingerprint; violations are
   appended in entry order.

Block ``b + 1``'s plan is already in SMEM and its row DMAs are in flight while block ``b`` is
checked, and block ``b + 2``'s plan DMA overlaps both. Real-KV fingerprints come from
:mod:`kvcanary_jax.ops._tpu_fingerprint` (a separate kernel with the same
gather structure), as planes the check reads per block.

Per entry the kernel moves 32 B of plan (+ 16 B of it again into SMEM), a 4 KiB canary tile for a
scattered slot or 32 B of one for a slot in a run of consecutive slots, the same again for a
predecessor outside the block's chain, and 8 B of fingerprint.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

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
from kvcanary_jax.ops import _tpu_state as tpu_state
from kvcanary_jax.plans import VerifyPlan

__all__ = ["Config", "heuristics", "run", "BLOCK"]

# Entries per block: 8 pair rows of each plan field (4 KiB of SMEM per field and buffer), room
# for a 4 KiB canary tile per entry for the slots and for the predecessors, double-buffered
# (8 MiB of VMEM, half of v5e's default scoped limit), and a check over 4 x 128-lane planes.
# Larger blocks amortise the per-block DMA waits; smaller ones shorten the pipeline's fill.
BLOCK = 512


@dataclasses.dataclass(frozen=True)
class Config(tpu.BlockConfig):
    """``block``: entries per block, a multiple of 512 (whole 8 x 128 tiles of pair rows). The
    canary tiles a block may fetch take 16 KiB of VMEM per entry (a 4 KiB tile for the slot and
    one for the predecessor, double-buffered): 8 MiB at the default 512, within every TPU's
    default scoped VMEM; a larger block needs ``vmem_limit_bytes`` raised to match. The rest:
    :class:`kvcanary_jax.ops._tpu_lib.Config`."""

    OP: ClassVar[str] = "canary_verify"
    block: int = BLOCK



def heuristics(shapes) -> Config:
    """Full blocks, smaller for plans below one block."""
    cap = int(shapes.get("capacity", BLOCK))
    return Config(block=min(BLOCK, tpu.pad_to(cap, tpu.PAIR_TILE)))


_F = consts.FailReason


def _state(block: int) -> tpu_state.State:
    """The kernel's scratch; ``r = block / 128`` plane rows; a leading 2 (or a span of 2) is the
    block buffer ``s``."""
    r = block // tpu.LANES
    tile = (tpu.SLOT_BYTES, tpu.TILE_SLOTS)
    return tpu_state.State(
        # the block's slot, prev, token, position pair rows
        plan_v=tpu_state.vmem((2, 4, 2 * r, tpu.LANES)),
        # its slot and prev pair rows, as scalars
        plan_s=tpu_state.smem((2, 2, 2 * r, tpu.LANES)),
        # per slab, the slots' tiles in fetch order
        rows=tpu_state.vmem((2, r, tpu.LANES, *tile), jnp.uint8),
        # per slab, the predecessors' tiles
        prow=tpu_state.vmem((2, r, tpu.LANES, *tile), jnp.uint8),
        # the selected slot words, 8 rows a slab (word w: row 8 i + w)
        sel=tpu_state.vmem((tpu.SLOT_WORDS * r, tpu.LANES)),
        # the block's fingerprints (pair rows)
        rkv_v=tpu_state.vmem((2, 2 * r, tpu.LANES)),
        misc=tpu_state.words(
            runs=2,  # [s]: slot-tile DMAs in flight for buffer s
            ring=tpu.Ring.WORDS,  # the Ring's state
            prevs=2,  # [s]: predecessor-tile DMAs in flight for buffer s
        ),
        # tiles fetched per slab: [0] slots', [1] predecessors', per buffer
        tiles=tpu_state.smem((2, 2, r)),
        # the violation record being appended
        stage=tpu_state.smem(tpu.RING_STAGE),
        sems=tpu_state.semaphores(
            plan=2,  # [s]: the block's plan words (and fingerprints)
            rows=2,  # [s]: the block's slots' canary tiles
            ring=1,  # a violation record
            prev=2,  # [s]: predecessors' tiles outside the block's chain
        ),
    )


def _verify_kernel(
    # Prefetch (SMEM [STATUS_WORDS]): tpu.Status words
    st_in,
    # Input (HBM): the plan's four fields, pair rows [4, cap_pad // 64, 128]; canary tiles
    # uint8 [S, N']; fingerprints, pair rows [cap_pad // 64, 128]; the ring (aliased)
    plan_hbm, canary_hbm, rkv_hbm, _ring_in,
    # Output: the ring [C, 16] (HBM); tpu.Status words (SMEM [STATUS_WORDS])
    ring_hbm, st_out,
    # Scratch: _state(block)
    *scratch,
    state, capacity, block, num_slots, ring_cap, kind, check_token, has_rkv,
):
    scr = state.bind(scratch)
    plan_v, plan_s, rows, prow, rkv_v = scr.plan_v, scr.plan_s, scr.rows, scr.prow, scr.rkv_v
    misc, tiles, sems = scr.misc, scr.tiles, scr.sems

    r = block // tpu.LANES  # plane rows per block
    pr = 2 * r  # pair rows per block
    nvalid = st_in[tpu.Status.NUM_VALID]
    enabled = st_in[tpu.Status.ENABLE] != 0
    active = jnp.where(enabled, jnp.clip(nvalid, 0, capacity), 0)
    nblocks = tpu.idiv(active + block - 1, block)
    ring = tpu.Ring(ring_hbm, ring_cap, misc.ring, scr.stage, sems.ring)
    ring.start(st_in[tpu.Status.WRITE_INDEX])

    def fetch(b, slot):
        rows_b = pl.ds(pl.multiple_of(b * pr, 8), pr)
        cps = [pltpu.make_async_copy(plan_hbm.at[:, rows_b, :], plan_v.at[slot],
                                     sems.plan[slot]),
               pltpu.make_async_copy(plan_hbm.at[pl.ds(0, 2), rows_b, :], plan_s.at[slot],
                                     sems.plan[slot])]
        if has_rkv:
            cps.append(pltpu.make_async_copy(rkv_hbm.at[rows_b], rkv_v.at[slot],
                                             sems.plan[slot]))
        return cps

    def tile_copy(tile, buf, at, slot, sem):
        """Canary tile ``tile`` into place ``at`` (slab * 128 + fetch index) of ``buf``."""
        return pltpu.make_async_copy(
            tpu.tile_window(canary_hbm, tile),
            buf.at[slot, tpu.idiv(at, tpu.LANES), tpu.irem(at, tpu.LANES)], sem)

    def issue(b, slot):
        """Tile DMAs of block b's entries, per 128-entry slab in fetch order: an entry fetches
        its slot's tile unless the previous entry fetched the same one
        (:func:`kvcanary_jax.ops._tpu_lib.fetch_places` finds the places with that rule); the
        predecessors likewise, except that an entry whose predecessor is the previous entry's
        slot fetches none (chain order: that slot is in the block already)."""
        n = jnp.minimum(block, active - b * block)
        ss, ps = plan_s.at[slot, 0], plan_s.at[slot, 1]
        zero, none = jnp.int32(0), jnp.int32(-1)
        for i in range(r):
            tiles[0, slot, i] = zero
            tiles[1, slot, i] = zero

        def one(e, carry):
            # per kind (slot, predecessor): tiles this slab fetched; the tile the previous entry
            # fetched or shares (-1: none, or a new slab); DMAs issued in the block
            fetched, last, count, pfetched, plast, pcount, last_hi, last_lo = carry
            lane = tpu.irem(e, tpu.LANES)
            slab = tpu.idiv(e, tpu.LANES)
            new_slab = lane == 0
            fetched, pfetched = (jnp.where(new_slab, zero, x) for x in (fetched, pfetched))
            last, plast = (jnp.where(new_slab, none, x) for x in (last, plast))
            row_, col = tpu.idiv(e, 64), 2 * tpu.irem(e, 64)
            s_lo, s_hi = tpu.u32(ss[row_, col]), tpu.u32(ss[row_, col + 1])
            checked = (s_hi | s_lo) != jnp.uint32(0)
            pos_ok = tpu.pair_in_range((s_hi, s_lo), num_slots)
            fetch = checked & (pos_ok | tpu.pair_neg_in_range((s_hi, s_lo), num_slots))
            tile = tpu.idiv(tpu.i32(jnp.where(pos_ok, s_lo, s_lo + jnp.uint32(num_slots))),
                            tpu.TILE_SLOTS)
            new = fetch & (tile != last)

            @pl.when(new)
            def _():
                tile_copy(tile, rows, e - lane + fetched, slot, sems.rows[slot]).start()

            fetched = fetched + new.astype(jnp.int32)
            tiles[0, slot, slab] = fetched
            last = jnp.where(fetch, tile, none)
            p_lo, p_hi = tpu.u32(ps[row_, col]), tpu.u32(ps[row_, col + 1])
            reuse = (e > 0) & (p_hi == last_hi) & (p_lo == last_lo)
            fetch_p = checked & (p_hi == jnp.uint32(0)) & (p_lo != jnp.uint32(0)) & \
                (p_lo < jnp.uint32(num_slots)) & jnp.logical_not(reuse)
            ptile = tpu.idiv(tpu.i32(p_lo), tpu.TILE_SLOTS)
            pnew = fetch_p & (ptile != plast)

            @pl.when(pnew)
            def _():
                tile_copy(ptile, prow, e - lane + pfetched, slot, sems.prev[slot]).start()

            pfetched = pfetched + pnew.astype(jnp.int32)
            tiles[1, slot, slab] = pfetched
            plast = jnp.where(fetch_p, ptile, none)
            return (fetched, last, count + new.astype(jnp.int32), pfetched, plast,
                    pcount + pnew.astype(jnp.int32), s_hi, s_lo)

        _, _, count, _, _, pcount, _, _ = lax.fori_loop(
            0, n, one, (zero, none, zero, zero, none, zero, jnp.uint32(0), jnp.uint32(0)))
        misc.runs[slot] = count
        misc.prevs[slot] = pcount

    def wait(slot):
        tpu.wait_n(tile_copy(0, rows, 0, slot, sems.rows[slot]), misc.runs[slot])
        tpu.wait_n(tile_copy(0, prow, 0, slot, sems.prev[slot]), misc.prevs[slot])

    def slot_words(buf, kind, slot, slot_i, fetch):
        """The 8 words of each entry's slot (int32 planes ``slot_i``, read where ``fetch``, the
        entries that fetched as :func:`issue` does) out of ``buf``'s tiles (``kind``: 0 the
        slots', 1 the predecessors'). uint32 planes, zero where not ``fetch``."""
        place = tpu.fetch_places(tpu.idiv(slot_i, tpu.TILE_SLOTS), fetch)
        lane = tpu.irem(slot_i, tpu.TILE_SLOTS)
        for i in range(r):
            scr.sel[pl.ds(tpu.SLOT_WORDS * i, tpu.SLOT_WORDS), :] = tpu.select_tiles(
                buf.at[slot, i], tiles[kind, slot, i], place[i:i + 1], lane[i:i + 1])
        zero = jnp.zeros((r, tpu.LANES), jnp.uint32)
        return [jnp.where(fetch, tpu.u32(scr.sel[pl.ds(w, r, stride=tpu.SLOT_WORDS), :]), zero)
                for w in range(tpu.SLOT_WORDS)]

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
        pos_ok = tpu.pair_in_range(slot_p, num_slots)
        slot_i = tpu.i32(jnp.where(pos_ok, slot_p[1], slot_p[1] + jnp.uint32(num_slots)))
        f = slot_words(rows, 0, slot, slot_i, s_ok)
        tok, pos, link, rkv = (f[1], f[0]), (f[3], f[2]), (f[5], f[4]), (f[7], f[6])
        p_ok = checked & tpu.pair_in_range(prev_p, num_slots) & \
            jnp.logical_not(tpu.pair_is_zero(prev_p))
        reuse = (p_ok & jnp.logical_not(first)
                 & hashing_u32.eq(prev_p, tuple(map(tpu.shift_one, slot_p))))
        # the predecessors fetched (the rest are the previous entry's slot, or read as zero)
        pf = slot_words(prow, 1, slot, tpu.i32(prev_p[1]), p_ok & jnp.logical_not(reuse))
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
    tpu.finish_status(st_in, st_out, ring=ring, slot_runs=active)


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
    canary = tpu.canary_tiles(context.canary_buf)
    ring = tpu.words32(context.violation_ring) if ring_cap else jnp.zeros((1, 16), jnp.int32)
    st = tpu.status_words(plan.verify_num_valid, plan.enable, context)
    has_rkv = bool(sources) and mode != int(consts.RealKvHashMode.NONE)
    if has_rkv:
        live = jnp.where(plan.enable.reshape(()) != 0,
                         jnp.clip(plan.verify_num_valid.reshape(()), 0, capacity), 0)
        rkv = fingerprint.fingerprints_from_pair_rows(entries[0], live, sources, mode=mode,
                                                      block=block,
                                                      interpret=config.interpret or False)
    else:
        rkv = jnp.zeros((8, tpu.LANES), jnp.int32)
    state = _state(block)
    kernel = functools.partial(
        _verify_kernel, state=state, capacity=capacity, block=block, num_slots=num_slots,
        ring_cap=ring_cap, kind=kind,
        check_token=bool(check_verify_expected_token), has_rkv=has_rkv)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    # Bytes: plan (32 B + 16 B into SMEM per entry), its slot in a canary tile (32 B of a run,
    # up to 4 KiB when scattered; a predecessor mostly the previous entry's slot), a
    # fingerprint (8 B).
    nbytes = capacity * (48 + 64 + (8 if has_rkv else 0))
    ring32, st_out = tpu.call(
        kernel, st, entries, canary, rkv, ring,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(1,),
            in_specs=[any_spec, any_spec, any_spec, any_spec],
            out_specs=[any_spec, pl.BlockSpec(memory_space=pltpu.SMEM)],
            scratch_shapes=state.scratch_shapes()),
        out_shape=[jax.ShapeDtypeStruct(ring.shape, jnp.int32),
                   jax.ShapeDtypeStruct((tpu.STATUS_WORDS,), jnp.int32)],
        input_output_aliases={4: 0},
        compiler_params=tpu.compiler_params(config.vmem_limit_bytes),
        cost_estimate=tpu.cost(bytes_accessed=nbytes, ops=capacity * 1500),
        interpret=config.interpret or False,
        name="kvcanary_verify_tpu",
    )
    return tpu.from_status(context, st_out, ring32)
