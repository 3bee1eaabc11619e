"""canary_plan as two Mosaic TPU kernels (implementation ``"pallas_mosaic_tpu"``).

Semantics and bounds choices: those of the plan op (SGLang's ``launch_canary_plan_kernels``; the
offsets and entries halves as documented in the op's base module): SGLang's flat
``req_to_token`` address ``rp * row_pitch + col``, cells outside the table read as 0, the SWA LUT
clamped to its last entry, expected tokens outside the pool read as -1.

**Offsets** (:func:`plan_offsets`): the per-request lengths, their prefix sums (64-bit, as pairs
of 32-bit words: Mosaic has no cumsum and no int64) and the totals run on the scalar unit over
the batch held in SMEM. A chain seed needs one ``req_to_token`` cell per request (and one LUT
entry): cells are fetched in batches of :data:`SEED_BATCH` row DMAs (the 128-column segment that
holds the cell), the LUT entries likewise, so a batch costs two DMA round trips.

**Entries** (:func:`plan_entries`): the output is written in blocks of ``block`` entries; an *item*
is the part of one request inside one block (a request's entries are consecutive positions of
one ``req_to_token`` row). Per item, the row's 128-column segments that hold its positions are
DMA'd into VMEM (and SMEM when a LUT translates them), realigned to the block's lanes with a lane
rotation and a one-row carry, and merged into the block; the previous slot of an entry is the
slot of the entry before it (shifted by one lane), the first one's is read from the same
segments; expected tokens come from the pool row the same way. A block is written with one DMA
per plan field once its last item is merged. The next item's segments are in flight while an
item is merged. Items whose positions leave their row or the table (malformed plans: SGLang reads
neighbouring rows there) take a per-entry path with the same results.

Per entry: 4 B of ``req_to_token`` and 4 B of pool read (1/128 DMA each), 32 B of plan written
(1/block DMA per field), plus one 8-byte LUT row DMA per entry when a LUT translates slots.
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

from kvcanary_jax import hashing_u32 as H
from kvcanary_jax.ops import _tpu_lib as T
from kvcanary_jax.ops.plan import base
from kvcanary_jax.plans import VerifyPlan, WritePlan

__all__ = ["Config", "heuristics", "run", "plan_offsets", "plan_entries", "SEED_BATCH", "BLOCK",
           "SMEM_BUDGET"]

# Requests whose seed cells (then LUT entries) are fetched together.
SEED_BATCH = 128
# Plan entries per output block.
BLOCK = 1024
# SMEM the offsets kernel may use (of 1 MiB per core on v5e / v6e).
SMEM_BUDGET = 768 * 1024

_I32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class Config(T.BlockConfig):
    """``block``: plan entries per output block (a multiple of 512); the rest:
    :class:`kvcanary_jax.ops._tpu_lib.Config`."""

    OP: ClassVar[str] = "canary_plan"
    block: int = BLOCK



def heuristics(shapes) -> Config:
    cap = int(shapes.get("verify_capacity", BLOCK))
    return Config(block=min(BLOCK, T.pad_to(max(cap, 1), T.PAIR_TILE)))


def _pair(ref, e):
    row, col = T.idiv(e, 64), 2 * T.irem(e, 64)
    return T.u32(ref[row, col + 1]), T.u32(ref[row, col])


def _set_pair(ref, e, p):
    row, col = T.idiv(e, 64), 2 * T.irem(e, 64)
    ref[row, col] = T.i32(p[1])
    ref[row, col + 1] = T.i32(p[0])


def _window_start(prefix, window: int):
    """``max(P - W, 0)`` if ``W > 0`` else 0, on pairs (wrapping like int64)."""
    if window <= 0:
        return (jnp.zeros_like(prefix[0]), jnp.zeros_like(prefix[1]))
    d = H.sub(prefix, H.const(window))
    neg = H.is_neg(d)
    return (jnp.where(neg, jnp.uint32(0), d[0]), jnp.where(neg, jnp.uint32(0), d[1]))


def _relu(p):
    neg = H.is_neg(p)
    return (jnp.where(neg, jnp.uint32(0), p[0]), jnp.where(neg, jnp.uint32(0), p[1]))


def _flat(rp, col, pitch: int, n_cells: int):
    """SGLang's flat address ``rp * pitch + col`` (pairs) -> (in table, int32 address)."""
    f = H.add(H.mul_const(rp, pitch), col)
    ok = T.pair_in_range(f, n_cells)
    return ok, T.i32(f[1])


# ---------------------------------------------------------------------------------------------
# Offsets


def _offsets_kernel(rpi_s, pre_s, ext_s, rtt_hbm, lut_hbm, _wo_in, _seed_in, _nv_in, _en_in,
                    _wn_in, voff_s, wo_hbm, seed_hbm, nv_out, en_out, wn_out, wo_s, seed_s,
                    seed_at, cells, lutrows, misc, sems, cells_tail, *, bs, cap_w, cap_v, window, rows, pitch,
                    has_lut, lut_len):
    n_cells = rows * pitch
    tail_w = pitch % T.LANES
    tail_base = pitch - tail_w

    # Pass 1: lengths, prefix sums, totals; where each request's seed comes from.
    def one(r, carry):
        vsum, wsum = carry
        rp, p, e = _pair(rpi_s, r), _pair(pre_s, r), _pair(ext_s, r)
        active = jnp.logical_not(T.pair_is_zero(rp))
        zero = (jnp.uint32(0), jnp.uint32(0))
        vlen = _relu(H.sub(p, _window_start(p, window)))
        vlen = tuple(jnp.where(active, a, b) for a, b in zip(vlen, zero))
        wlen = tuple(jnp.where(active, a, b) for a, b in zip(_relu(e), zero))
        _set_pair(voff_s, r, vsum)
        _set_pair(wo_s, r, wsum)
        need = active & jnp.logical_not(H.is_neg(p)) & jnp.logical_not(T.pair_is_zero(p)) & \
            jnp.logical_not(T.pair_is_zero(wlen))
        ok, flat = _flat(rp, H.sub(p, H.const(1)), pitch, n_cells)
        # -2: no seed (-1); -1: the cell is outside the table (reads 0); else its flat address
        seed_at[r] = jnp.where(need, jnp.where(ok, flat, -1), -2)
        return H.add(vsum, vlen), H.add(wsum, wlen)

    zero = (jnp.uint32(0), jnp.uint32(0))
    vtot, wtot = lax.fori_loop(0, bs, one, (zero, zero))
    _set_pair(voff_s, bs, vtot)
    _set_pair(wo_s, bs, wtot)

    def clear(i, c):
        _set_pair(wo_s, i, zero)
        return c

    lax.fori_loop(bs + 1, cap_w + 1, clear, 0)
    over = H.lt(H.const(cap_v), vtot)
    nv_out[0] = jnp.where(over, jnp.int32(cap_v), T.i32(vtot[1]))
    en_out[0] = jnp.where(over, 0, 1).astype(jnp.int32)
    wn_out[0] = jnp.int32(bs)

    # Pass 2: seeds, a batch of cells then a batch of LUT entries at a time.
    def cell_copy(flat, j, *, tail):
        row = T.idiv(flat, pitch)
        col = T.irem(flat, pitch)
        if tail:
            # into rows of the tail's own width: Mosaic refuses a DMA into a window of a wider
            # buffer row unless it is a multiple of 512 bytes
            src = rtt_hbm.at[pl.ds(row, 1), pl.ds(tail_base, tail_w)]
            return pltpu.make_async_copy(src, cells_tail.at[pl.ds(j, 1)], sems.at[1])
        base = pl.multiple_of(col - T.irem(col, T.LANES), T.LANES)
        return pltpu.make_async_copy(rtt_hbm.at[pl.ds(row, 1), pl.ds(base, T.LANES)],
                                     cells.at[pl.ds(j, 1)], sems.at[0])

    def is_tail(flat):
        if not tail_w:
            return jnp.bool_(False)
        return T.irem(flat, pitch) >= tail_base

    def lut_copy(idx, j):
        return pltpu.make_async_copy(lut_hbm.at[pl.ds(idx, 1)], lutrows.at[pl.ds(j, 1)],
                                     sems.at[2])

    def batch(k, c):
        b0 = k * SEED_BATCH
        n = jnp.minimum(SEED_BATCH, bs - b0)

        def fetch(j, counts):
            at = seed_at[b0 + j]
            tail = is_tail(jnp.maximum(at, 0))
            full_ok = (at >= 0) & jnp.logical_not(tail)

            @pl.when(full_ok)
            def _():
                cell_copy(at, j, tail=False).start()

            if tail_w:
                @pl.when((at >= 0) & tail)
                def _():
                    cell_copy(at, j, tail=True).start()

            return (counts[0] + full_ok.astype(jnp.int32),
                    counts[1] + ((at >= 0) & tail).astype(jnp.int32))

        nf, nt = lax.fori_loop(0, n, fetch, (jnp.int32(0), jnp.int32(0)))
        T.wait_n(cell_copy(0, 0, tail=False), nf)
        if tail_w:
            T.wait_n(cell_copy(0, 0, tail=True), nt)

        def cell(j):
            at = seed_at[b0 + j]
            col = T.irem(jnp.maximum(at, 0), pitch)
            v = cells[j, T.irem(col, T.LANES)]
            if tail_w:
                v = jnp.where(is_tail(jnp.maximum(at, 0)),
                              cells_tail[j, jnp.clip(col - tail_base, 0, tail_w - 1)], v)
            return jnp.where(at >= 0, v, 0)

        if has_lut:
            def lookup(j, count):
                v = cell(j)
                go = (seed_at[b0 + j] >= -1) & (v >= 0)

                @pl.when(go)
                def _():
                    lut_copy(jnp.minimum(v, lut_len - 1), j).start()

                return count + go.astype(jnp.int32)

            T.wait_n(lut_copy(0, 0), lax.fori_loop(0, n, lookup, jnp.int32(0)))

        def store(j, c):
            at = seed_at[b0 + j]
            v = cell(j)
            val = H.from_i32(v)
            if has_lut:
                lut = (T.u32(lutrows[j, 1]), T.u32(lutrows[j, 0]))
                val = tuple(jnp.where(v >= 0, a, b) for a, b in zip(lut, val))
            none = H.const(-1)
            _set_pair(seed_s, b0 + j, tuple(jnp.where(at >= -1, a, b)
                                            for a, b in zip(val, none)))
            return c

        lax.fori_loop(0, n, store, 0)
        return c

    # Seeds past bs keep their values: the last partial row is read first.
    last_row = T.idiv(jnp.int32(bs), 64)
    if bs % 64:
        c = pltpu.make_async_copy(seed_hbm.at[pl.ds(bs // 64, 1)],
                                  seed_s.at[pl.ds(bs // 64, 1)], sems.at[3])
        c.start()
        c.wait()
    del last_row
    lax.fori_loop(0, -(-bs // SEED_BATCH), batch, 0)
    nrows = -(-bs // 64)
    out = [pltpu.make_async_copy(seed_s.at[pl.ds(0, nrows)], seed_hbm.at[pl.ds(0, nrows)],
                                 sems.at[3]),
           pltpu.make_async_copy(wo_s, wo_hbm, sems.at[4])]
    for c in out:
        c.start()
    for c in out:
        c.wait()


def offsets_smem_bytes(bs: int, cap_w: int) -> int:
    bp, cp, wp = (T.pad_to(n, T.PAIR_TILE) for n in (bs, cap_w, cap_w + 1))
    return (3 * 8 * bp + 8 * T.pad_to(bs + 1, T.PAIR_TILE) + 8 * wp + 8 * cp + 4 * bp
            + 2 * 4 * T.LANES * SEED_BATCH + 64)


def plan_offsets(rpi, prefix, extend, req_to_token, lut, write_offsets, seeds, verify_num_valid,
                 enable, write_num_valid_reqs, *, swa_window_size, verify_capacity,
                 config: Config):
    """Today's array-level offsets half (``bs >= 1``): returns ``(verify_offsets[bs + 1],
    write_offsets, seeds, verify_num_valid, enable, write_num_valid_reqs)``."""
    bs = int(rpi.shape[0])
    cap_w = int(seeds.shape[0])
    rows, pitch = (int(d) for d in req_to_token.shape)
    if rows * pitch >= 2**31:
        raise ValueError(f"kv-canary: canary_plan (pallas_mosaic_tpu): req_to_token has "
                         f"{rows * pitch} cells; 32-bit addressing allows fewer than 2**31")
    need = offsets_smem_bytes(bs, cap_w)
    if need > SMEM_BUDGET:
        raise ValueError(
            f"kv-canary: canary_plan (pallas_mosaic_tpu): a batch of {bs} requests and a write "
            f"plan of {cap_w} need {need} bytes of SMEM, more than the kernel's budget of "
            f"{SMEM_BUDGET}; use implementation='xla' for batches this large")
    has_lut = lut is not None
    bp = T.pad_to(bs, T.PAIR_TILE)
    rpi_r, pre_r, ext_r = (T.to_pair_rows(x, bp) for x in (rpi, prefix, extend))
    wo_r = T.to_pair_rows(write_offsets, T.pad_to(cap_w + 1, T.PAIR_TILE))
    seed_r = T.to_pair_rows(seeds, T.pad_to(max(cap_w, 1), T.PAIR_TILE))
    rtt = req_to_token if rows * pitch else jnp.zeros((1, 1), jnp.int32)
    lut2 = T.words32(lut.reshape(-1, 1)) if has_lut else jnp.zeros((1, 2), jnp.int32)
    voff_shape = (T.pad_to(bs + 1, T.PAIR_TILE) // 64, T.LANES)
    kernel = functools.partial(
        _offsets_kernel, bs=bs, cap_w=cap_w, cap_v=int(verify_capacity),
        window=int(swa_window_size), rows=int(rtt.shape[0]) if rows * pitch else 0,
        pitch=int(rtt.shape[1]), has_lut=has_lut, lut_len=int(lut.shape[0]) if has_lut else 1)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    smem = pl.BlockSpec(memory_space=pltpu.SMEM)
    voff, wo_new, seed_new, nv, en, wn = T.call(
        kernel, rpi_r, pre_r, ext_r, rtt, lut2, wo_r, seed_r, verify_num_valid, enable,
        write_num_valid_reqs,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3, grid=(1,),
            in_specs=[any_spec] * 4 + [smem] * 3,
            out_specs=[smem, any_spec, any_spec, smem, smem, smem],
            scratch_shapes=[
                pltpu.SMEM(wo_r.shape, jnp.int32),
                pltpu.SMEM(seed_r.shape, jnp.int32),
                pltpu.SMEM((bp,), jnp.int32),
                pltpu.SMEM((SEED_BATCH, T.LANES), jnp.int32),
                pltpu.SMEM((SEED_BATCH, 2), jnp.int32),
                pltpu.SMEM((8,), jnp.int32),
                pltpu.SemaphoreType.DMA((5,)),
                pltpu.SMEM((SEED_BATCH, max(int(rtt.shape[1]) % T.LANES, 1)), jnp.int32),
            ]),
        out_shape=[jax.ShapeDtypeStruct(voff_shape, jnp.int32),
                   jax.ShapeDtypeStruct(wo_r.shape, jnp.int32),
                   jax.ShapeDtypeStruct(seed_r.shape, jnp.int32),
                   *(jax.ShapeDtypeStruct((1,), jnp.int32),) * 3],
        # the plan's arrays are updated in place (the scalars too)
        input_output_aliases={5: 1, 6: 2, 7: 3, 8: 4, 9: 5},
        compiler_params=T.compiler_params(config.vmem_limit_bytes),
        cost_estimate=T.cost(bytes_accessed=bs * (24 + 16 + 512 + 16) + cap_w * 16,
                             ops=bs * 150),
        interpret=config.interpret or False,
        name="kvcanary_plan_offsets_tpu",
    )
    return (T.from_pair_rows(voff, bs + 1), T.from_pair_rows(wo_new, cap_w + 1),
            T.from_pair_rows(seed_new, cap_w), nv, en, wn)


# ---------------------------------------------------------------------------------------------
# Entries


def _entries_kernel(voff_s, rpi_s, pre_s, vl_s, st_s, rtt_hbm, lut_hbm, pool_hbm, _o0, _o1, _o2,
                    _o3, out0, out1, out2, out3, seg_v, seg_s, tok_v, lutrows, cell_s, acc, blk,
                    misc, sems, tail_v, tail_s, tail_tok, cell_tail_r, cell_tail_p, lut_s, *, bs, cap, block, window, rows, pitch, has_lut, lut_len,
                    has_pool, prows, ppitch, k_off):
    outs = (out0, out1, out2, out3)  # slots, expected tokens, positions, previous slots
    R = block // T.LANES
    NS = R + 8  # staging rows: one before the block's rows, its rows, the carry row; whole tiles
    n_cells = rows * pitch
    n_pool = prows * ppitch
    total = _pair(voff_s, bs)
    cap_p = H.const(cap)
    live_p = tuple(jnp.where(H.lt(total, cap_p), a, b) for a, b in zip(total, cap_p))
    live = jnp.where((st_s[0] != 0) & jnp.logical_not(H.is_neg(live_p)), T.i32(live_p[1]), 0)
    nblocks = T.idiv(live + block - 1, block)
    # misc: [2 s + 0 / 1] req_to_token full / short-segment copies in flight for item buffer s;
    # [4 + 2 s + 0 / 1] the same for the pool; [8] bit s: item buffer s is on the fast path,
    # bit 2 + s: its tokens are; [9] bit s: block buffer s has output copies in flight.
    for i in range(10):
        misc[i] = jnp.int32(0)

    def voff(r):
        """Request r's first entry (r <= bs), clamped to [0, live]."""
        p = _pair(voff_s, r)
        return jnp.where(H.is_neg(p), 0,
                         jnp.where(T.pair_in_range(p, live + 1), T.i32(p[1]), live))

    def owner(t):
        """Largest r < bs with voff[r] <= t (the reference's searchsorted)."""
        if bs == 1:
            return jnp.int32(0)
        top = 1 << (bs - 1).bit_length() - 1

        def body(i, r):
            cand = r + lax.shift_right_logical(jnp.int32(top), i)
            ok = (cand < bs) & (voff(jnp.minimum(cand, bs - 1)) <= t)
            return jnp.where(ok, cand, r)

        return lax.fori_loop(0, top.bit_length(), body, jnp.int32(0))

    def item(b, r):
        """Block-relative entries [e_lo, e_hi) of request r in block b, and its first position."""
        t0 = b * block
        lo = jnp.maximum(voff(r), t0)
        hi = jnp.minimum(jnp.minimum(voff(r + 1), t0 + block), live)
        pos0 = H.add(_window_start(_pair(pre_s, r), window), H.from_i32(lo - voff(r)))
        return lo - t0, jnp.maximum(hi, lo) - t0, pos0

    def next_item(b, r):
        def empty(r):
            rc = jnp.minimum(r, bs - 1)
            return (r < bs) & (voff(rc + 1) <= voff(rc))

        nr = lax.while_loop(empty, lambda r: r + 1, r + 1)
        t_end = jnp.minimum((b + 1) * block, live)
        same = (nr < bs) & (voff(jnp.minimum(nr, bs - 1)) < t_end)
        nb = b + 1
        return lax.cond(same, lambda: (b, nr),
                        lambda: (nb, owner(jnp.minimum(nb * block, jnp.maximum(live - 1, 0)))))

    # A row's short last segment (when the pitch is not a multiple of 128) is DMA'd into a
    # buffer of its own width, then copied into its staging row once landed: Mosaic refuses a DMA
    # into a window of a wider row unless it is a multiple of 512 bytes. misc[16 + at] holds the
    # staging row it goes to (at: the fetch's counter words, see fetch).
    tails = {id(seg_v): tail_v, id(seg_s): tail_s, id(tok_v): tail_tok}

    # -- 128-column segments of a table row. Staging row j holds segment j - 1 + (delta >> 7),
    # so that out[e] = column e + delta for e in [0, block) (see realign).
    def seg_copy(tab, tpitch, row, s, j, dst, slot, sem, *, tail):
        tw = tpitch % T.LANES
        if tail:
            return pltpu.make_async_copy(tab.at[pl.ds(row, 1), pl.ds(tpitch - tw, tw)],
                                         tails[id(dst)].at[slot], sem)
        return pltpu.make_async_copy(
            tab.at[pl.ds(row, 1), pl.ds(pl.multiple_of(s * T.LANES, T.LANES), T.LANES)],
            dst.at[slot, pl.ds(j, 1)], sem)

    def fetch(tab, tpitch, row, c_lo, c_hi, delta, slot, dsts, sem_full, sem_tail, at):
        """DMAs of the segments holding columns [c_lo, c_hi) of ``row`` into each of ``dsts``;
        their counts go to misc[at], misc[at + 1]."""
        tw = tpitch % T.LANES
        a = lax.shift_right_arithmetic(delta, 7)

        def one(s, counts):
            tail = (s * T.LANES + T.LANES > tpitch) if tw else jnp.bool_(False)
            for dst in dsts:
                @pl.when(jnp.logical_not(tail))
                def _(dst=dst):
                    seg_copy(tab, tpitch, row, s, s - a + 1, dst, slot, sem_full,
                             tail=False).start()

                if tw:
                    @pl.when(tail)
                    def _(dst=dst):
                        seg_copy(tab, tpitch, row, s, s - a + 1, dst, slot, sem_tail,
                                 tail=True).start()
                        misc[16 + at] = s - a + 1
            k = len(dsts)
            return (counts[0] + k * jnp.logical_not(tail).astype(jnp.int32),
                    counts[1] + k * tail.astype(jnp.int32))

        s_lo = lax.shift_right_arithmetic(c_lo, 7)
        s_hi = lax.shift_right_arithmetic(c_hi - 1, 7) + 1
        nf, nt = lax.fori_loop(s_lo, jnp.maximum(s_hi, s_lo), one, (jnp.int32(0), jnp.int32(0)))
        misc[at] = nf
        misc[at + 1] = nt

    def wait_fetched(tab, tpitch, dsts, slot, sem_full, sem_tail, at):
        """Waits for ``fetch``'s copies into ``dsts`` and puts a short last segment in place."""
        tw = tpitch % T.LANES
        for dst in dsts:
            T.wait_n(seg_copy(tab, tpitch, 0, 0, 0, dst, slot, sem_full, tail=False),
                     misc[at] // len(dsts))
            if tw:
                T.wait_n(seg_copy(tab, tpitch, 0, 0, 0, dst, slot, sem_tail, tail=True),
                         misc[at + 1] // len(dsts))
        if tw:
            j = misc[16 + at]

            @pl.when(misc[at + 1] > 0)
            def _():
                for dst in dsts:
                    tail = tails[id(dst)]
                    if dst is seg_s:  # SMEM: word by word
                        def word(k, c):
                            seg_s[slot, j, k] = tail_s[slot, 0, k]
                            return c

                        lax.fori_loop(0, tw, word, 0)
                        continue
                    for jj in range(NS):  # VMEM: the staging row, statically indexed
                        @pl.when(j == jj)
                        def _(jj=jj, dst=dst, tail=tail):
                            dst[slot, pl.ds(jj, 1), pl.ds(0, tw)] = tail[slot]
        misc[at] = jnp.int32(0)
        misc[at + 1] = jnp.int32(0)

    def realign(staging, delta):
        b = delta & (T.LANES - 1)
        rot = pltpu.roll(staging, T.irem(T.LANES - b, T.LANES), 1)
        this = pltpu.roll(rot, NS - 1, 0)  # this[i] = rot[i + 1]
        carry = pltpu.roll(rot, NS - 2, 0)  # carry[i] = rot[i + 2]
        lane = lax.broadcasted_iota(jnp.int32, staging.shape, 1)
        return jnp.where(lane < T.LANES - b, this, carry)[:R]

    def staged_at(delta, c):
        """(staging row, lane) of column c."""
        return (lax.shift_right_arithmetic(c, 7) - lax.shift_right_arithmetic(delta, 7) + 1,
                c & (T.LANES - 1))

    def item_paths(b, r):
        e_lo, e_hi, pos0 = item(b, r)
        rp = _pair(rpi_s, r)
        n = e_hi - e_lo
        cells_fast = (T.pair_in_range(rp, rows) & jnp.logical_not(H.is_neg(pos0)) &
                      T.pair_in_range(H.add_u32(pos0, T.u32(n)), pitch + 1))
        if not has_pool:
            return e_lo, e_hi, pos0, rp, cells_fast, None
        vl = _pair(vl_s, r)
        c0 = H.add(pos0, H.const(k_off))
        c_end = H.add_u32(c0, T.u32(n))
        hi_n = tuple(jnp.where(H.lt(vl, c_end), x, y) for x, y in zip(vl, c_end))
        lo_n = tuple(jnp.where(H.is_neg(c0), jnp.uint32(0), x) for x in c0)
        empty = jnp.logical_not(H.lt(lo_n, hi_n))
        tok_fast = T.pair_in_range(rp, prows) & (empty | T.pair_in_range(hi_n, ppitch + 1))
        return e_lo, e_hi, pos0, rp, cells_fast, (c0, lo_n, hi_n, empty, tok_fast, vl)

    def issue(b, r, slot):
        e_lo, e_hi, pos0, rp, cells_fast, tok = item_paths(b, r)
        flags = misc[8] & ~(1 << slot) & ~(4 << slot)
        flags = flags | jnp.where(cells_fast, 1 << slot, 0)
        p32 = T.i32(pos0[1])

        @pl.when(cells_fast)
        def _():
            fetch(rtt_hbm, pitch, T.i32(rp[1]), jnp.maximum(p32 - 1, 0), p32 + e_hi - e_lo,
                  p32 - e_lo, slot, (seg_v, seg_s) if has_lut else (seg_v,), sems.at[slot],
                  sems.at[2 + slot], 2 * slot)

        if has_pool:
            c0, lo_n, hi_n, empty, tok_fast, _ = tok
            flags = flags | jnp.where(tok_fast, 4 << slot, 0)

            @pl.when(tok_fast & jnp.logical_not(empty))
            def _():
                fetch(pool_hbm, ppitch, T.i32(rp[1]), T.i32(lo_n[1]), T.i32(hi_n[1]),
                      T.i32(c0[1]) - e_lo, slot, (tok_v,), sems.at[4 + slot], sems.at[6 + slot],
                      4 + 2 * slot)
        misc[8] = flags

    def wait_item(slot):
        wait_fetched(rtt_hbm, pitch, (seg_v, seg_s) if has_lut else (seg_v,), slot,
                     sems.at[slot], sems.at[2 + slot], 2 * slot)
        if has_pool:
            wait_fetched(pool_hbm, ppitch, (tok_v,), slot, sems.at[4 + slot], sems.at[6 + slot],
                         4 + 2 * slot)

    def read_cell(tab, tpitch, flat, j):
        """The cell at a flat address (sync), through SMEM row j of cell_s."""
        row = T.idiv(flat, tpitch)
        col = T.irem(flat, tpitch)
        tw = tpitch % T.LANES
        tail = (col >= tpitch - tw) if tw else jnp.bool_(False)

        @pl.when(jnp.logical_not(tail))
        def _():
            c = pltpu.make_async_copy(
                tab.at[pl.ds(row, 1), pl.ds(pl.multiple_of(col - (col & 127), T.LANES),
                                            T.LANES)],
                cell_s.at[pl.ds(j, 1)], sems.at[8])
            c.start()
            c.wait()

        cell_tail = cell_tail_r if tab is rtt_hbm else cell_tail_p
        if tw:
            @pl.when(tail)
            def _():
                c = pltpu.make_async_copy(tab.at[pl.ds(row, 1), pl.ds(tpitch - tw, tw)],
                                          cell_tail.at[pl.ds(j, 1)], sems.at[8])
                c.start()
                c.wait()

            return jnp.where(tail, cell_tail[j, jnp.clip(col - (tpitch - tw), 0, tw - 1)],
                             cell_s[j, col & 127])
        return cell_s[j, col & 127]

    def set_entry(plane, i, v):
        """acc[plane][entry i] = v (one row read-modify-write)."""
        row = T.idiv(i, T.LANES)
        cur = acc[plane, pl.ds(row, 1), :]
        lanes = lax.broadcasted_iota(jnp.int32, cur.shape, 1)
        acc[plane, pl.ds(row, 1), :] = jnp.where(lanes == (i & 127), v, cur)

    def lut_copy(v, i):
        return pltpu.make_async_copy(
            lut_hbm.at[pl.ds(jnp.minimum(v, lut_len - 1), 1)],
            lutrows.at[T.idiv(i, T.LANES), pl.ds(i & 127, 1)], sems.at[9])

    def xlat_one(v):
        """LUT translation of one int32 value (sync), through row 2 of cell_s."""
        if not has_lut:
            return H.from_i32(v)
        c = pltpu.make_async_copy(lut_hbm.at[pl.ds(jnp.minimum(jnp.maximum(v, 0),
                                                               lut_len - 1), 1)],
                                  lut_s, sems.at[8])

        @pl.when(v >= 0)
        def _():
            c.start()
            c.wait()

        lut = (T.u32(lut_s[0, 1]), T.u32(lut_s[0, 0]))
        return tuple(jnp.where(v >= 0, x, y) for x, y in zip(lut, H.from_i32(v)))

    def merge(b, r, slot):
        e_lo, e_hi, pos0, rp, _, tok = item_paths(b, r)
        e = T.entry_index(R)
        inside = (e >= e_lo) & (e < e_hi)
        p32 = T.i32(pos0[1])
        delta = p32 - e_lo
        cells_fast = ((misc[8] >> slot) & 1) == 1

        def fast_cells():
            stage = seg_v[slot]
            row, lane = staged_at(delta, jnp.maximum(p32 - 1, 0))
            at = (lax.broadcasted_iota(jnp.int32, stage.shape, 0) == row) & \
                (lax.broadcasted_iota(jnp.int32, stage.shape, 1) == lane)
            return realign(stage, delta), T.sum_scalar(jnp.where(at, stage, 0))

        def slow_cells():
            # Per entry, SGLang's flat address (it may leave the row); outside the table: 0.
            def one(i, c):
                ok, flat = _flat(rp, H.add_u32(pos0, T.u32(i - e_lo)), pitch, n_cells)
                set_entry(8, i, jnp.where(ok, read_cell(rtt_hbm, pitch, jnp.where(ok, flat, 0),
                                                        0), 0))
                return c

            lax.fori_loop(e_lo, e_hi, one, 0)
            okp, flatp = _flat(rp, H.sub(pos0, H.const(1)), pitch, n_cells)
            return acc[8], jnp.where(okp, read_cell(rtt_hbm, pitch, jnp.where(okp, flatp, 0), 1),
                                     0)

        raw, first_prev = lax.cond(cells_fast, fast_cells, slow_cells)
        if has_lut:
            def look(value):
                def one(i, count):
                    v = value(i)

                    @pl.when(v >= 0)
                    def _():
                        lut_copy(v, i).start()

                    return count + (v >= 0).astype(jnp.int32)

                return lax.fori_loop(e_lo, e_hi, one, jnp.int32(0))

            def fast_value(i):
                row, lane = staged_at(delta, p32 - e_lo + i)
                return seg_s[slot, jnp.clip(row, 0, NS - 1), lane]

            def slow_value(i):
                return T.sum_scalar(jnp.where(e == i, raw, 0))

            n = lax.cond(cells_fast, lambda: look(fast_value), lambda: look(slow_value))
            T.wait_n(lut_copy(0, 0), n)
            w = T.rows_to_planes(lutrows[...])
            slot_p = tuple(jnp.where(raw >= 0, x, y) for x, y in zip((w[1], w[0]),
                                                                     H.from_i32(raw)))
        else:
            slot_p = H.from_i32(raw)
        first_prev_p = xlat_one(first_prev)
        minus1 = H.const(-1, e)
        first = e == e_lo
        at_zero = first & T.pair_is_zero(pos0)
        prev_p = tuple(jnp.where(at_zero, m, jnp.where(first, f, T.shift_one(x)))
                       for m, f, x in zip(minus1, first_prev_p, slot_p))
        pos = H.add_u32((jnp.full(e.shape, pos0[0]), jnp.full(e.shape, pos0[1])), T.u32(e - e_lo))

        if has_pool:
            c0, lo_n, hi_n, empty, _, vl = tok
            posk = H.add(pos, H.const(k_off, e))
            in_vl = jnp.logical_not(H.is_neg(posk)) & \
                H.lt(posk, (jnp.full(e.shape, vl[0]), jnp.full(e.shape, vl[1])))
            tok_fast = ((misc[8] >> (2 + slot)) & 1) == 1

            def fast_tok():
                return jnp.where(in_vl, realign(tok_v[slot], T.i32(c0[1]) - e_lo), -1)

            def slow_tok():
                def one(i, c):
                    p = H.add(H.add_u32(pos0, T.u32(i - e_lo)), H.const(k_off))
                    ok_vl = jnp.logical_not(H.is_neg(p)) & H.lt(p, vl)
                    ok, flat = _flat(rp, p, ppitch, n_pool)
                    go = ok & ok_vl
                    set_entry(9, i, jnp.where(
                        go, read_cell(pool_hbm, ppitch, jnp.where(go, flat, 0), 3), -1))
                    return c

                lax.fori_loop(e_lo, e_hi, one, 0)
                return acc[9]

            tok_p = H.from_i32(lax.cond(tok_fast, fast_tok, slow_tok))
        else:
            tok_p = minus1

        for f, pair in enumerate((slot_p, tok_p, pos, prev_p)):
            for w in range(2):
                acc[2 * f + w] = jnp.where(inside, T.i32(pair[w]), acc[2 * f + w])

    def out_copy(b, f, bslot):
        return pltpu.make_async_copy(
            blk.at[bslot, f], outs[f].at[pl.ds(pl.multiple_of(b * 2 * R, 8), 2 * R)],
            sems.at[10 + bslot])

    def free_block_buffer(bslot):
        @pl.when(((misc[9] >> bslot) & 1) == 1)
        def _():
            for f in range(4):
                out_copy(0, f, bslot).wait()
            misc[9] = misc[9] & ~(1 << bslot)

    def start_block(b):
        """The last block, when partial, keeps its entries past the live count: load it."""
        bslot = b & 1

        @pl.when((b + 1) * block > live)
        def _():
            free_block_buffer(bslot)
            for f in range(4):
                c = pltpu.make_async_copy(
                    outs[f].at[pl.ds(pl.multiple_of(b * 2 * R, 8), 2 * R)], blk.at[bslot, f],
                    sems.at[12])
                c.start()
                c.wait()
                hi, lo = T.planes(blk.at[bslot, f])
                acc[2 * f] = T.i32(hi)
                acc[2 * f + 1] = T.i32(lo)

    def finish_block(b):
        bslot = b & 1
        free_block_buffer(bslot)
        for f in range(4):
            T.store_planes(blk.at[bslot, f], acc[2 * f], acc[2 * f + 1])
            out_copy(b, f, bslot).start()
        misc[9] = misc[9] | (1 << bslot)

    @pl.when(nblocks > 0)
    def _():
        r0 = owner(jnp.int32(0))
        start_block(jnp.int32(0))
        issue(jnp.int32(0), r0, 0)

        def body(carry):
            b, r, slot = carry
            nb, nr = next_item(b, r)

            @pl.when(nb < nblocks)
            def _():
                issue(nb, nr, 1 - slot)

            wait_item(slot)
            merge(b, r, slot)

            @pl.when(nb != b)
            def _():
                finish_block(b)

                @pl.when(nb < nblocks)
                def _():
                    start_block(nb)

            return nb, nr, 1 - slot

        lax.while_loop(lambda c: c[0] < nblocks, body, (jnp.int32(0), r0, jnp.int32(0)))
        for bslot in (0, 1):
            free_block_buffer(bslot)


def plan_entries(rpi, prefix, req_to_token, lut, verify_offsets, enable, pool, valid_lens, slots,
                 tokens, positions, prevs, *, swa_window_size, kv_token_id_vs_position_offset,
                 config: Config):
    """Today's array-level entries half (``bs >= 1``): returns the four verify arrays (aliased
    to their inputs; entries past the live count untouched)."""
    bs = int(rpi.shape[0])
    cap = int(slots.shape[0])
    block = config.block
    cap_pad = T.pad_to(cap, block)
    rows, pitch = (int(d) for d in req_to_token.shape)
    has_lut = lut is not None
    has_pool = pool is not None
    prows, ppitch = (int(d) for d in pool.shape) if has_pool else (0, 1)
    for name, n in (("req_to_token", rows * pitch), ("the expected-token pool", prows * ppitch)):
        if n >= 2**31:
            raise ValueError(f"kv-canary: canary_plan (pallas_mosaic_tpu): {name} has {n} cells; "
                             f"32-bit addressing allows fewer than 2**31")
    bp = T.pad_to(bs + 1, T.PAIR_TILE)
    voff_r = T.to_pair_rows(verify_offsets, bp)
    rpi_r, pre_r = (T.to_pair_rows(x, bp) for x in (rpi, prefix))
    vl_r = T.to_pair_rows(valid_lens, bp) if has_pool else jnp.zeros((8, T.LANES), jnp.int32)
    st = jnp.concatenate([enable.astype(jnp.int32).reshape(1), jnp.zeros((3,), jnp.int32)])
    rtt = req_to_token if rows * pitch else jnp.zeros((1, 1), jnp.int32)
    lut2 = T.words32(lut.reshape(-1, 1)) if has_lut else jnp.zeros((1, 2), jnp.int32)
    pool_ = pool if has_pool and prows * ppitch else jnp.zeros((1, 1), jnp.int32)
    outs = [T.to_pair_rows(x, cap_pad) for x in (slots, tokens, positions, prevs)]
    R = block // T.LANES
    NS = R + 8
    # widths of the short last segments of the tables as the kernel sees them
    tw_r, tw_p = (max(int(t.shape[1]) % T.LANES, 1) for t in (rtt, pool_))
    kernel = functools.partial(
        _entries_kernel, bs=bs, cap=cap, block=block, window=int(swa_window_size),
        rows=rows if rows * pitch else 0, pitch=int(rtt.shape[1]), has_lut=has_lut,
        lut_len=int(lut.shape[0]) if has_lut else 1, has_pool=has_pool,
        prows=prows if prows * ppitch else 0, ppitch=int(pool_.shape[1]),
        k_off=int(kv_token_id_vs_position_offset))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    new = T.call(
        kernel, voff_r, rpi_r, pre_r, vl_r, st, rtt, lut2, pool_, *outs,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5, grid=(1,),
            in_specs=[any_spec] * 7,
            out_specs=[any_spec] * 4,
            scratch_shapes=[
                pltpu.VMEM((2, NS, T.LANES), jnp.int32),
                pltpu.SMEM((2, NS, T.LANES) if has_lut else (1, T.LANES), jnp.int32),
                pltpu.VMEM((2, NS, T.LANES), jnp.int32),
                pltpu.VMEM((R, T.LANES, 2), jnp.int32),
                pltpu.SMEM((4, T.LANES), jnp.int32),
                pltpu.VMEM((10, R, T.LANES), jnp.int32),
                pltpu.VMEM((2, 4, 2 * R, T.LANES), jnp.int32),
                pltpu.SMEM((24,), jnp.int32),
                pltpu.SemaphoreType.DMA((13,)),
                # a short last segment of a req_to_token / pool row, and a LUT entry: buffers
                # of exactly the copied width (see _entries_kernel)
                pltpu.VMEM((2, 1, tw_r), jnp.int32),
                pltpu.SMEM((2, 1, tw_r) if has_lut else (1, 1, 1), jnp.int32),
                pltpu.VMEM((2, 1, tw_p), jnp.int32),
                pltpu.SMEM((4, tw_r), jnp.int32),
                pltpu.SMEM((4, tw_p), jnp.int32),
                pltpu.SMEM((1, 2), jnp.int32),
            ]),
        out_shape=[jax.ShapeDtypeStruct(o.shape, jnp.int32) for o in outs],
        input_output_aliases={8 + i: i for i in range(4)},
        compiler_params=T.compiler_params(config.vmem_limit_bytes),
        cost_estimate=T.cost(bytes_accessed=cap * (4 + 4 * has_pool + 32 + 8 * has_lut),
                             ops=cap * 60),
        interpret=config.interpret or False,
        name="kvcanary_plan_entries_tpu",
    )
    return tuple(T.from_pair_rows(o, cap) for o in new)


# The kernels compile per batch size: no ``num_reqs`` operand (api.run refuses one).
TAKES_NUM_REQS = False


def run(vp: VerifyPlan, wp: WritePlan, inputs: base.PlanInputs, *, swa_window_size: int,
        verify_capacity: int, kv_token_id_vs_position_offset: int, config: Config):
    """``(VerifyPlan, WritePlan)`` filled (``bs >= 1``; the caller handles an empty batch);
    every plan array is aliased to its input."""
    return base.compose(
        functools.partial(plan_offsets, config=config),
        functools.partial(plan_entries, config=config),
        vp, wp, inputs, swa_window_size=swa_window_size, verify_capacity=verify_capacity,
        kv_token_id_vs_position_offset=kv_token_id_vs_position_offset)
