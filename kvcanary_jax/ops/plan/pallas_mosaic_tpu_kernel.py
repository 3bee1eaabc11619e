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
neighbouring rows there) take a per-entry path with the same results. The DMAs have descriptors of
their own (:class:`_TableRows`: a table's staged row segments and single cells; :class:`_Blocks`:
the output blocks), so the kernel body is the walk over items and the merge.

Each kernel's scratch is declared once (:func:`_offsets_state`, :func:`_entries_state`; see
:mod:`kvcanary_jax.ops._tpu_state`).

Per entry: 4 B of ``req_to_token`` and 4 B of pool read (1/128 DMA each), 32 B of plan written
(1/block DMA per field), plus one 8-byte LUT row DMA per entry when a LUT translates slots.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kvcanary_jax import hashing_u32
from kvcanary_jax.ops import _tpu_lib as tpu
from kvcanary_jax.ops import _tpu_state as tpu_state
from kvcanary_jax.ops.plan.base import VERIFY_ARRAYS, PlanInputs, PlanOffsets
from kvcanary_jax.plans import VerifyPlan, WritePlan

__all__ = ["plan_offsets", "plan_entries", "offsets_smem_bytes", "SEED_BATCH", "BLOCK",
           "SMEM_BUDGET"]

# Requests whose seed cells (then LUT entries) are fetched together.
SEED_BATCH = 128
# Plan entries per output block.
BLOCK = 1024
# SMEM the offsets kernel may use (of 1 MiB per core on v5e / v6e).
SMEM_BUDGET = 768 * 1024


def _pair(ref, e):
    row, col = tpu.idiv(e, 64), 2 * tpu.irem(e, 64)
    return tpu.u32(ref[row, col + 1]), tpu.u32(ref[row, col])


def _set_pair(ref, e, p):
    row, col = tpu.idiv(e, 64), 2 * tpu.irem(e, 64)
    ref[row, col] = tpu.i32(p[1])
    ref[row, col + 1] = tpu.i32(p[0])


def _window_start(prefix, window: int):
    """``max(P - W, 0)`` if ``W > 0`` else 0, on pairs (wrapping like int64)."""
    if window <= 0:
        return (jnp.zeros_like(prefix[0]), jnp.zeros_like(prefix[1]))
    d = hashing_u32.sub(prefix, hashing_u32.const(window))
    neg = hashing_u32.is_neg(d)
    return (jnp.where(neg, jnp.uint32(0), d[0]), jnp.where(neg, jnp.uint32(0), d[1]))


def _relu(p):
    neg = hashing_u32.is_neg(p)
    return (jnp.where(neg, jnp.uint32(0), p[0]), jnp.where(neg, jnp.uint32(0), p[1]))


def _flat(rp, col, pitch: int, n_cells: int):
    """SGLang's flat address ``rp * pitch + col`` (pairs) -> (in table, int32 address)."""
    f = hashing_u32.add(hashing_u32.mul_const(rp, pitch), col)
    ok = tpu.pair_in_range(f, n_cells)
    return ok, tpu.i32(f[1])


# ---------------------------------------------------------------------------------------------
# Offsets


def _offsets_state(wo_shape, seed_shape, bp: int, pitch: int) -> tpu_state.State:
    """The offsets kernel's scratch (``pitch``: the req_to_token row pitch the kernel sees). The
    short-segment buffer is exactly as wide as the segment: Mosaic refuses a DMA into a window of
    a wider buffer row unless it is a multiple of 512 bytes."""
    return tpu_state.State(
        # the write offsets (pair rows [(cap_w + 1) pad // 64, 128]), copied out last
        wo_s=tpu_state.smem(wo_shape),
        # the write seeds (pair rows [cap_w pad // 64, 128]), copied out last
        seed_s=tpu_state.smem(seed_shape),
        # request r's seed cell: its flat address, -1 outside the table, -2 no seed
        seed_at=tpu_state.smem((bp,)),
        # the 128-column segment holding seed cell j of a batch
        cells=tpu_state.smem((SEED_BATCH, tpu.LANES)),
        # LUT entry j of a batch (low, high word)
        lutrows=tpu_state.smem((SEED_BATCH, 2)),
        sems=tpu_state.semaphores(
            cells=1,  # seed cells' 128-column segments
            cells_tail=1,  # seed cells in a row's short last segment
            lut=1,  # LUT entries of the seeds
            seeds=1,  # the seeds' rows, in (the partial last one) and out
            write_offsets=1,  # the write offsets, out
        ),
        # a seed cell in a row's short last segment
        cells_tail=tpu_state.smem((SEED_BATCH, max(pitch % tpu.LANES, 1))),
    )


def _offsets_kernel(
    # Prefetch (SMEM pair rows [bs pad // 64, 128]): req_pool_indices, prefix_lens,
    # extend_seq_lens (``pad``: to whole tiles of PAIR_TILE entries)
    rpi_s, pre_s, ext_s,
    # Input: req_to_token [rows, pitch] and the LUT [n, 2] (HBM); the write offsets and seeds
    # (HBM pair rows, aliased to wo_hbm / seed_hbm); verify_num_valid, enable,
    # write_num_valid_reqs (SMEM [1], aliased to their outputs)
    rtt_hbm, lut_hbm, _wo_in, _seed_in, _nv_in, _en_in, _wn_in,
    # Output: verify offsets (SMEM pair rows [(bs + 1) pad // 64, 128]); write offsets and seeds
    # (HBM pair rows); verify_num_valid, enable, write_num_valid_reqs (SMEM [1])
    voff_s, wo_hbm, seed_hbm, nv_out, en_out, wn_out,
    # Scratch: _offsets_state(...)
    *scratch,
    state, bs, cap_w, cap_v, window, rows, pitch, has_lut, lut_len,
):
    scr = state.bind(scratch)
    wo_s, seed_s, seed_at, cells = scr.wo_s, scr.seed_s, scr.seed_at, scr.cells
    lutrows, cells_tail, sems = scr.lutrows, scr.cells_tail, scr.sems

    n_cells = rows * pitch
    tail_w = pitch % tpu.LANES
    tail_base = pitch - tail_w

    # Pass 1: lengths, prefix sums, totals; where each request's seed comes from.
    def one(r, carry):
        vsum, wsum = carry
        rp, p, e = _pair(rpi_s, r), _pair(pre_s, r), _pair(ext_s, r)
        active = jnp.logical_not(tpu.pair_is_zero(rp))
        zero = (jnp.uint32(0), jnp.uint32(0))
        vlen = _relu(hashing_u32.sub(p, _window_start(p, window)))
        vlen = tuple(jnp.where(active, a, b) for a, b in zip(vlen, zero))
        wlen = tuple(jnp.where(active, a, b) for a, b in zip(_relu(e), zero))
        _set_pair(voff_s, r, vsum)
        _set_pair(wo_s, r, wsum)
        need = (active & jnp.logical_not(hashing_u32.is_neg(p))
                & jnp.logical_not(tpu.pair_is_zero(p)) & jnp.logical_not(tpu.pair_is_zero(wlen)))
        ok, flat = _flat(rp, hashing_u32.sub(p, hashing_u32.const(1)), pitch, n_cells)
        # -2: no seed (-1); -1: the cell is outside the table (reads 0); else its flat address
        seed_at[r] = jnp.where(need, jnp.where(ok, flat, -1), -2)
        return hashing_u32.add(vsum, vlen), hashing_u32.add(wsum, wlen)

    zero = (jnp.uint32(0), jnp.uint32(0))
    vtot, wtot = lax.fori_loop(0, bs, one, (zero, zero))
    _set_pair(voff_s, bs, vtot)
    _set_pair(wo_s, bs, wtot)

    def clear(i, c):
        _set_pair(wo_s, i, zero)
        return c

    lax.fori_loop(bs + 1, cap_w + 1, clear, 0)
    over = hashing_u32.lt(hashing_u32.const(cap_v), vtot)
    nv_out[0] = jnp.where(over, jnp.int32(cap_v), tpu.i32(vtot[1]))
    en_out[0] = jnp.where(over, 0, 1).astype(jnp.int32)
    wn_out[0] = jnp.int32(bs)

    # Pass 2: seeds, a batch of cells then a batch of LUT entries at a time.
    def cell_copy(flat, j, *, tail):
        row = tpu.idiv(flat, pitch)
        col = tpu.irem(flat, pitch)
        if tail:
            # into rows of the tail's own width: Mosaic refuses a DMA into a window of a wider
            # buffer row unless it is a multiple of 512 bytes
            src = rtt_hbm.at[pl.ds(row, 1), pl.ds(tail_base, tail_w)]
            return pltpu.make_async_copy(src, cells_tail.at[pl.ds(j, 1)],
                                         sems.cells_tail)
        base = pl.multiple_of(col - tpu.irem(col, tpu.LANES), tpu.LANES)
        return pltpu.make_async_copy(rtt_hbm.at[pl.ds(row, 1), pl.ds(base, tpu.LANES)],
                                     cells.at[pl.ds(j, 1)], sems.cells)

    def is_tail(flat):
        if not tail_w:
            return jnp.bool_(False)
        return tpu.irem(flat, pitch) >= tail_base

    def lut_copy(idx, j):
        return pltpu.make_async_copy(lut_hbm.at[pl.ds(idx, 1)], lutrows.at[pl.ds(j, 1)],
                                     sems.lut)

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
        tpu.wait_n(cell_copy(0, 0, tail=False), nf)
        if tail_w:
            tpu.wait_n(cell_copy(0, 0, tail=True), nt)

        def cell(j):
            at = seed_at[b0 + j]
            col = tpu.irem(jnp.maximum(at, 0), pitch)
            v = cells[j, tpu.irem(col, tpu.LANES)]
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

            tpu.wait_n(lut_copy(0, 0), lax.fori_loop(0, n, lookup, jnp.int32(0)))

        def store(j, c):
            at = seed_at[b0 + j]
            v = cell(j)
            val = hashing_u32.from_i32(v)
            if has_lut:
                lut = (tpu.u32(lutrows[j, 1]), tpu.u32(lutrows[j, 0]))
                val = tuple(jnp.where(v >= 0, a, b) for a, b in zip(lut, val))
            none = hashing_u32.const(-1)
            _set_pair(seed_s, b0 + j, tuple(jnp.where(at >= -1, a, b)
                                            for a, b in zip(val, none)))
            return c

        lax.fori_loop(0, n, store, 0)
        return c

    # Seeds past bs keep their values: the last partial row is read first.
    last_row = tpu.idiv(jnp.int32(bs), 64)
    if bs % 64:
        c = pltpu.make_async_copy(seed_hbm.at[pl.ds(bs // 64, 1)],
                                  seed_s.at[pl.ds(bs // 64, 1)], sems.seeds)
        c.start()
        c.wait()
    del last_row
    lax.fori_loop(0, -(-bs // SEED_BATCH), batch, 0)
    nrows = -(-bs // 64)
    out = [pltpu.make_async_copy(seed_s.at[pl.ds(0, nrows)], seed_hbm.at[pl.ds(0, nrows)],
                                 sems.seeds),
           pltpu.make_async_copy(wo_s, wo_hbm, sems.write_offsets)]
    for c in out:
        c.start()
    for c in out:
        c.wait()


def offsets_smem_bytes(bs: int, cap_w: int) -> int:
    bp, cp, wp = (tpu.pad_to(n, tpu.PAIR_TILE) for n in (bs, cap_w, cap_w + 1))
    return (3 * 8 * bp + 8 * tpu.pad_to(bs + 1, tpu.PAIR_TILE) + 8 * wp + 8 * cp + 4 * bp
            + 2 * 4 * tpu.LANES * SEED_BATCH + 64)


def plan_offsets(inputs: PlanInputs, vp: VerifyPlan, wp: WritePlan, *, swa_window_size,
                 verify_capacity, config: tpu.BlockConfig) -> PlanOffsets:
    """The offsets half (:func:`kvcanary_jax.ops.plan.base.compose`, ``bs >= 1``; the kernels
    compile per batch size, so ``inputs.num_reqs`` is None: ``api.run`` refuses one); the write
    plan and the verify plan's two scalars are aliased to their inputs."""
    rpi, req_to_token, lut = inputs.req_pool_indices, inputs.req_to_token, \
        inputs.full_to_swa_index_mapping
    bs = int(rpi.shape[0])
    cap_w = int(wp.write_seed_slot_indices.shape[0])
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
    bp = tpu.pad_to(bs, tpu.PAIR_TILE)
    rpi_r, pre_r, ext_r = (tpu.to_pair_rows(x, bp) for x in (rpi, inputs.prefix_lens,
                                                              inputs.extend_seq_lens))
    wo_r = tpu.to_pair_rows(wp.write_offsets, tpu.pad_to(cap_w + 1, tpu.PAIR_TILE))
    seed_r = tpu.to_pair_rows(wp.write_seed_slot_indices,
                              tpu.pad_to(max(cap_w, 1), tpu.PAIR_TILE))
    rtt = req_to_token if rows * pitch else jnp.zeros((1, 1), jnp.int32)
    lut2 = tpu.words32(lut.reshape(-1, 1)) if has_lut else jnp.zeros((1, 2), jnp.int32)
    voff_shape = (tpu.pad_to(bs + 1, tpu.PAIR_TILE) // 64, tpu.LANES)
    state = _offsets_state(wo_r.shape, seed_r.shape, bp, int(rtt.shape[1]))
    kernel = functools.partial(
        _offsets_kernel, state=state, bs=bs, cap_w=cap_w, cap_v=int(verify_capacity),
        window=int(swa_window_size), rows=int(rtt.shape[0]) if rows * pitch else 0,
        pitch=int(rtt.shape[1]), has_lut=has_lut, lut_len=int(lut.shape[0]) if has_lut else 1)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    smem = pl.BlockSpec(memory_space=pltpu.SMEM)
    voff, wo_new, seed_new, nv, en, wn = tpu.call(
        kernel, rpi_r, pre_r, ext_r, rtt, lut2, wo_r, seed_r, vp.verify_num_valid, vp.enable,
        wp.write_num_valid_reqs,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3, grid=(1,),
            in_specs=[any_spec] * 4 + [smem] * 3,
            out_specs=[smem, any_spec, any_spec, smem, smem, smem],
            scratch_shapes=state.scratch_shapes()),
        out_shape=[jax.ShapeDtypeStruct(voff_shape, jnp.int32),
                   jax.ShapeDtypeStruct(wo_r.shape, jnp.int32),
                   jax.ShapeDtypeStruct(seed_r.shape, jnp.int32),
                   *(jax.ShapeDtypeStruct((1,), jnp.int32),) * 3],
        # the plan's arrays are updated in place (the scalars too)
        input_output_aliases={5: 1, 6: 2, 7: 3, 8: 4, 9: 5},
        compiler_params=tpu.compiler_params(config.vmem_limit_bytes),
        cost_estimate=tpu.cost(bytes_accessed=bs * (24 + 16 + 512 + 16) + cap_w * 16,
                               ops=bs * 150),
        interpret=config.interpret or False,
        name="kvcanary_plan_offsets_tpu",
    )
    return PlanOffsets(
        verify_offsets=tpu.from_pair_rows(voff, bs + 1), verify_num_valid=nv, enable=en,
        write_plan=WritePlan(write_offsets=tpu.from_pair_rows(wo_new, cap_w + 1),
                             write_seed_slot_indices=tpu.from_pair_rows(seed_new, cap_w),
                             write_num_valid_reqs=wn))


# ---------------------------------------------------------------------------------------------
# Entries

# acc planes: 2 f + w holds plan field f (slots, expected tokens, positions, previous slots), its
# high (w = 0) or low (w = 1) words. Two more planes gather the per-entry (slow) paths' values
# before they are merged: req_to_token cells, and expected tokens.
_ACC_SLOW_CELLS = 8
_ACC_SLOW_TOKENS = 9
_ACC_PLANES = 10


class _CellRow(enum.IntEnum):
    """Rows of ``cell_s`` (and of the short-segment ``cell_tail_*``) a single cell is read into."""

    CELL = 0  # the slow path's req_to_token cell of one entry
    FIRST_PREV = 1  # the cell of an item's first previous slot (slow path)
    TOKEN = 2  # the slow path's expected token of one entry


class _Flag(enum.IntEnum):
    """Bits of ``misc.flags``: item buffer s's bit is :func:`_flag_bit` ``(flag, s)``."""

    CELLS_FAST = 0  # the item's req_to_token cells are read from its staged segments
    TOKENS_FAST = 2  # the item's expected tokens are read from its staged pool segments


def _flag_bit(flag: _Flag, slot):
    """The mask of ``flag`` for item buffer ``slot``."""
    return (1 << flag) << slot


def _entries_state(block: int, has_lut: bool, tw_r: int, tw_p: int) -> tpu_state.State:
    """The entries kernel's scratch (``tw_r`` / ``tw_p``: the widths, at least 1, of the short
    last segments of a req_to_token / pool row). ``R = block / 128`` plane rows; ``NS = R + 8``
    staging rows (one before the block's rows, its rows, the carry row; whole tiles); a leading 2
    (or a span of 2) is the item buffer ``slot`` or the block buffer ``bslot``. Buffers a short
    segment or a LUT entry is DMA'd into are exactly as wide as the copy: Mosaic refuses a DMA
    into a window of a wider buffer row unless it is a multiple of 512 bytes."""
    R = block // tpu.LANES
    NS = R + 8
    return tpu_state.State(
        # an item's req_to_token segments, staged (see _TableRows)
        seg_v=tpu_state.vmem((2, NS, tpu.LANES)),
        # with a LUT, the same as scalars (else unused)
        seg_s=tpu_state.smem((2, NS, tpu.LANES) if has_lut else (1, tpu.LANES)),
        # an item's expected-token pool segments, staged
        tok_v=tpu_state.vmem((2, NS, tpu.LANES)),
        # the LUT entry of each of the block's slots
        lutrows=tpu_state.vmem((R, tpu.LANES, 2)),
        # single cells read synchronously, a row per _CellRow
        cell_s=tpu_state.smem((len(_CellRow), tpu.LANES)),
        # the block being merged, see _ACC_SLOW_CELLS
        acc=tpu_state.vmem((_ACC_PLANES, R, tpu.LANES)),
        # the four plan fields of a finished block, as pair rows
        blk=tpu_state.vmem((2, 4, 2 * R, tpu.LANES)),
        misc=tpu_state.words(
            cell_copies=2,  # [s]: req_to_token whole-segment copies in flight, item buffer s
            cell_short_copies=2,  # [s]: its short-last-segment copies
            token_copies=2,  # [s]: the same for the expected-token pool
            token_short_copies=2,
            flags=1,  # _Flag bits
            out_busy=1,  # bit s: block buffer s has output copies in flight
            cell_tail_row=2,  # [s]: the staging row a short req_to_token segment goes to
            token_tail_row=2,  # [s]: the same for the pool
        ),
        sems=tpu_state.semaphores(
            cells=2,  # [s]: req_to_token segments of item buffer s
            cells_tail=2,  # [s]: their short last segments
            tokens=2,  # [s]: pool segments of item buffer s
            tokens_tail=2,  # [s]: their short last segments
            sync=1,  # a single cell or LUT entry, waited at once (slow paths, first prev slots)
            lut=1,  # the LUT entries of an item's slots
            out=2,  # [s]: block buffer s's output copies
            load=1,  # a partial last block read back
        ),
        tail_v=tpu_state.vmem((2, 1, tw_r)),  # a req_to_token row's short last segment
        # with a LUT, the same as scalars (else unused)
        tail_s=tpu_state.smem((2, 1, tw_r) if has_lut else (1, 1, 1)),
        tail_tok=tpu_state.vmem((2, 1, tw_p)),  # a pool row's short last segment
        # a single req_to_token cell in a short segment, a row per _CellRow
        cell_tail_r=tpu_state.smem((len(_CellRow), tw_r)),
        # a single pool cell in a short segment, a row per _CellRow
        cell_tail_p=tpu_state.smem((len(_CellRow), tw_p)),
        lut_s=tpu_state.smem((1, 2)),  # a single LUT entry (an item's first previous slot)
    )


class _Staging(NamedTuple):
    """Where an item's row segments are staged: ``rows`` ``[2, NS, 128]`` (VMEM, or SMEM when
    ``in_smem``), and ``tail`` ``[2, 1, pitch % 128]``, the row's short last segment at its own
    width (a leading 2: the item buffer)."""

    rows: Any
    tail: Any
    in_smem: bool


class _TableRows:
    """The reads of one table SGLang addresses by flat ``rp * pitch + col`` (req_to_token, or the
    expected-token pool): an item's row segments, DMA'd ahead (:meth:`start`, :meth:`wait`), and
    single cells, read at once (:meth:`read`).

    Segments: columns ``[c_lo, c_hi)`` of row ``row`` come in the row's 128-column segments, one
    DMA each into every staging of ``staging`` (item buffer ``slot``); staging row ``j`` holds
    segment ``j - 1 + (delta >> 7)``, so that :func:`_realign` puts column ``e + delta`` at entry
    ``e``. A row's short last segment (when the pitch is not a multiple of 128) is DMA'd into the
    staging's ``tail`` and copied into its staging row once landed (``tail_row``): Mosaic refuses
    a DMA into a window of a wider row unless it is a multiple of 512 bytes. The copies in flight
    are counted per item buffer in ``copies`` and ``short_copies`` (word spans) and signal
    ``sems`` / ``short_sems`` (semaphore spans).

    Single cells: through row ``j`` of ``cell_s`` (or of ``cell_tail`` for a short segment),
    signalling ``sync``.
    """

    def __init__(self, table, pitch: int, staging, *, sems, short_sems, copies, short_copies,
                 tail_row, cell_s, cell_tail, sync):
        self.table, self.pitch, self.staging = table, pitch, tuple(staging)
        self.tw = pitch % tpu.LANES
        self.sems, self.short_sems, self.sync = sems, short_sems, sync
        self.copies, self.short_copies, self.tail_row = copies, short_copies, tail_row
        self.cell_s, self.cell_tail = cell_s, cell_tail

    def _copy(self, row, s, j, stage: _Staging, slot, sem, *, tail):
        """Segment ``s`` of ``row`` into staging row ``j`` (or the short last segment into the
        staging's tail)."""
        if tail:
            return pltpu.make_async_copy(
                self.table.at[pl.ds(row, 1), pl.ds(self.pitch - self.tw, self.tw)],
                stage.tail.at[slot], sem)
        return pltpu.make_async_copy(
            self.table.at[pl.ds(row, 1),
                          pl.ds(pl.multiple_of(s * tpu.LANES, tpu.LANES), tpu.LANES)],
            stage.rows.at[slot, pl.ds(j, 1)], sem)

    def start(self, row, c_lo, c_hi, delta, slot) -> None:
        """Starts the DMAs of the segments holding columns ``[c_lo, c_hi)`` of ``row`` for item
        buffer ``slot``."""
        sem, short_sem = self.sems[slot], self.short_sems[slot]
        tw = self.tw
        a = lax.shift_right_arithmetic(delta, 7)

        def one(s, counts):
            tail = (s * tpu.LANES + tpu.LANES > self.pitch) if tw else jnp.bool_(False)
            for stage in self.staging:
                @pl.when(jnp.logical_not(tail))
                def _(stage=stage):
                    self._copy(row, s, s - a + 1, stage, slot, sem, tail=False).start()

                if tw:
                    @pl.when(tail)
                    def _(stage=stage):
                        self._copy(row, s, s - a + 1, stage, slot, short_sem, tail=True).start()
                        self.tail_row[slot] = s - a + 1
            k = len(self.staging)
            return (counts[0] + k * jnp.logical_not(tail).astype(jnp.int32),
                    counts[1] + k * tail.astype(jnp.int32))

        s_lo = lax.shift_right_arithmetic(c_lo, 7)
        s_hi = lax.shift_right_arithmetic(c_hi - 1, 7) + 1
        nf, nt = lax.fori_loop(s_lo, jnp.maximum(s_hi, s_lo), one, (jnp.int32(0), jnp.int32(0)))
        self.copies[slot] = nf
        self.short_copies[slot] = nt

    def wait(self, slot) -> None:
        """Waits for :meth:`start`'s copies of item buffer ``slot`` and puts a short last segment
        in its staging row."""
        sem, short_sem = self.sems[slot], self.short_sems[slot]
        tw = self.tw
        k = len(self.staging)
        for stage in self.staging:
            tpu.wait_n(self._copy(0, 0, 0, stage, slot, sem, tail=False), self.copies[slot] // k)
            if tw:
                tpu.wait_n(self._copy(0, 0, 0, stage, slot, short_sem, tail=True),
                           self.short_copies[slot] // k)
        if tw:
            j = self.tail_row[slot]

            @pl.when(self.short_copies[slot] > 0)
            def _():
                for stage in self.staging:
                    if stage.in_smem:  # word by word
                        def word(w, c, stage=stage):
                            stage.rows[slot, j, w] = stage.tail[slot, 0, w]
                            return c

                        lax.fori_loop(0, tw, word, 0)
                        continue
                    for jj in range(stage.rows.shape[1]):  # VMEM: the row, statically indexed
                        @pl.when(j == jj)
                        def _(jj=jj, stage=stage):
                            stage.rows[slot, pl.ds(jj, 1), pl.ds(0, tw)] = stage.tail[slot]
        self.copies[slot] = jnp.int32(0)
        self.short_copies[slot] = jnp.int32(0)

    def read(self, flat, j):
        """The cell at flat address ``flat`` (in the table), read at once through row ``j`` (a
        :class:`_CellRow`) of ``cell_s`` (or of ``cell_tail``)."""
        pitch, tw = self.pitch, self.tw
        row = tpu.idiv(flat, pitch)
        col = tpu.irem(flat, pitch)
        tail = (col >= pitch - tw) if tw else jnp.bool_(False)

        @pl.when(jnp.logical_not(tail))
        def _():
            c = pltpu.make_async_copy(
                self.table.at[pl.ds(row, 1), pl.ds(pl.multiple_of(col - (col & 127), tpu.LANES),
                                                   tpu.LANES)],
                self.cell_s.at[pl.ds(j, 1)], self.sync)
            c.start()
            c.wait()

        if tw:
            @pl.when(tail)
            def _():
                c = pltpu.make_async_copy(self.table.at[pl.ds(row, 1), pl.ds(pitch - tw, tw)],
                                          self.cell_tail.at[pl.ds(j, 1)], self.sync)
                c.start()
                c.wait()

            return jnp.where(tail, self.cell_tail[j, jnp.clip(col - (pitch - tw), 0, tw - 1)],
                             self.cell_s[j, col & 127])
        return self.cell_s[j, col & 127]


def _realign(staging, delta, R: int):
    """``out[e] = column e + delta`` for the ``R`` plane rows of a block, out of the staging rows
    ``[NS, 128]`` (see :class:`_TableRows`): a lane rotation and a one-row carry."""
    NS = staging.shape[0]
    b = delta & (tpu.LANES - 1)
    rot = pltpu.roll(staging, tpu.irem(tpu.LANES - b, tpu.LANES), 1)
    this = pltpu.roll(rot, NS - 1, 0)  # this[i] = rot[i + 1]
    carry = pltpu.roll(rot, NS - 2, 0)  # carry[i] = rot[i + 2]
    lane = lax.broadcasted_iota(jnp.int32, staging.shape, 1)
    return jnp.where(lane < tpu.LANES - b, this, carry)[:R]


def _staged_at(delta, c):
    """(staging row, lane) of column ``c`` (see :class:`_TableRows`)."""
    return (lax.shift_right_arithmetic(c, 7) - lax.shift_right_arithmetic(delta, 7) + 1,
            c & (tpu.LANES - 1))


class _Blocks:
    """The output blocks: the four plan fields of block ``b`` accumulate in ``acc`` (planes
    ``2 f``, ``2 f + 1``: high, low words), are stored as pair rows in block buffer ``b & 1`` of
    ``blk`` and written with one DMA per field (``sems``), while the other buffer's copies may be
    in flight (``misc.out_busy``, a bit per buffer). A partial last block keeps its entries past
    the live count: :meth:`start` loads it first (``load``)."""

    def __init__(self, outs, acc, blk, misc, sems, load, *, block: int, live):
        self.outs, self.acc, self.blk, self.misc = outs, acc, blk, misc
        self.sems, self.load = sems, load
        self.block, self.live = block, live
        self.rows = 2 * (block // tpu.LANES)  # pair rows per block

    def _copy(self, b, f, bslot):
        return pltpu.make_async_copy(
            self.blk.at[bslot, f],
            self.outs[f].at[pl.ds(pl.multiple_of(b * self.rows, 8), self.rows)],
            self.sems[bslot])

    def free(self, bslot) -> None:
        """Waits for block buffer ``bslot``'s copies in flight."""
        @pl.when((self.misc.out_busy & (1 << bslot)) != 0)
        def _():
            for f in range(4):
                self._copy(0, f, bslot).wait()
            self.misc.out_busy = self.misc.out_busy & ~(1 << bslot)

    def start(self, b) -> None:
        """Block ``b`` begins: the last block, when partial, is loaded."""
        bslot = b & 1

        @pl.when((b + 1) * self.block > self.live)
        def _():
            self.free(bslot)
            for f in range(4):
                c = pltpu.make_async_copy(
                    self.outs[f].at[pl.ds(pl.multiple_of(b * self.rows, 8), self.rows)],
                    self.blk.at[bslot, f], self.load)
                c.start()
                c.wait()
                hi, lo = tpu.planes(self.blk.at[bslot, f])
                self.acc[2 * f] = tpu.i32(hi)
                self.acc[2 * f + 1] = tpu.i32(lo)

    def finish(self, b) -> None:
        """Block ``b`` is merged: its copies out start."""
        bslot = b & 1
        self.free(bslot)
        for f in range(4):
            tpu.store_planes(self.blk.at[bslot, f], self.acc[2 * f], self.acc[2 * f + 1])
            self._copy(b, f, bslot).start()
        self.misc.out_busy = self.misc.out_busy | (1 << bslot)


class _Tokens(NamedTuple):
    """An item's expected tokens: pool columns from ``c0`` (its first position + k), read in
    ``[lo, hi)`` (non-negative, below its valid length ``valid``), ``empty`` when none; ``fast``
    when they lie in the row (staged segments) rather than per entry. Pairs are ``(hi, lo)``
    uint32 words."""

    c0: tuple
    lo: tuple
    hi: tuple
    empty: Any
    fast: Any
    valid: tuple


class _Item(NamedTuple):
    """Request ``r``'s part of block ``b``: block-relative entries ``[e_lo, e_hi)``, its first
    position ``pos0`` and row ``rp`` (pairs); ``cells_fast`` when its req_to_token cells lie in
    the row (staged segments) rather than per entry; ``tokens``: with a pool, :class:`_Tokens`."""

    e_lo: Any
    e_hi: Any
    pos0: tuple
    rp: tuple
    cells_fast: Any
    tokens: _Tokens | None


def _entries_kernel(
    # Prefetch (SMEM pair rows [(bs + 1) pad // 64, 128]): verify offsets, req_pool_indices,
    # prefix_lens, valid lens (with a pool; else zeros); st [4]: enable, then zeros
    voff_s, rpi_s, pre_s, vl_s, st_s,
    # Input (HBM): req_to_token [rows, pitch], the LUT [n, 2] (low, high word), the pool
    # [prows, ppitch]; the four plan fields (aliased to out0..out3)
    rtt_hbm, lut_hbm, pool_hbm, _o0, _o1, _o2, _o3,
    # Output (HBM pair rows [cap_pad // 64, 128]): slots, expected tokens, positions, previous
    # slots
    out0, out1, out2, out3,
    # Scratch: _entries_state(...)
    *scratch,
    state, bs, cap, block, window, rows, pitch, has_lut, lut_len, has_pool, prows, ppitch,
    k_off,
):
    scr = state.bind(scratch)
    seg_v, seg_s, tok_v, lutrows, acc = scr.seg_v, scr.seg_s, scr.tok_v, scr.lutrows, scr.acc
    misc, sems, lut_s = scr.misc, scr.sems, scr.lut_s

    def flag(f: _Flag, slot):
        """Whether ``f`` is set for item buffer ``slot``."""
        return (misc.flags & _flag_bit(f, slot)) != 0

    outs = (out0, out1, out2, out3)  # slots, expected tokens, positions, previous slots
    R = block // tpu.LANES
    NS = R + 8  # staging rows: one before the block's rows, its rows, the carry row; whole tiles
    n_cells = rows * pitch
    n_pool = prows * ppitch
    total = _pair(voff_s, bs)
    cap_p = hashing_u32.const(cap)
    live_p = tuple(jnp.where(hashing_u32.lt(total, cap_p), a, b) for a, b in zip(total, cap_p))
    live = jnp.where((st_s[0] != 0) & jnp.logical_not(hashing_u32.is_neg(live_p)),
                     tpu.i32(live_p[1]), 0)
    nblocks = tpu.idiv(live + block - 1, block)
    tpu_state.fill(misc, ("cell_copies", "cell_short_copies", "token_copies",
                          "token_short_copies", "flags", "out_busy"), jnp.int32(0))
    cells = _TableRows(
        rtt_hbm, pitch,
        [_Staging(seg_v, scr.tail_v, False)] + ([_Staging(seg_s, scr.tail_s, True)] if has_lut
                                                else []),
        sems=sems.cells, short_sems=sems.cells_tail, copies=misc.cell_copies,
        short_copies=misc.cell_short_copies, tail_row=misc.cell_tail_row, cell_s=scr.cell_s,
        cell_tail=scr.cell_tail_r, sync=sems.sync)
    tokens = _TableRows(
        pool_hbm, ppitch, [_Staging(tok_v, scr.tail_tok, False)],
        sems=sems.tokens, short_sems=sems.tokens_tail, copies=misc.token_copies,
        short_copies=misc.token_short_copies, tail_row=misc.token_tail_row, cell_s=scr.cell_s,
        cell_tail=scr.cell_tail_p, sync=sems.sync)
    blocks = _Blocks(outs, acc, scr.blk, misc, sems.out, sems.load, block=block, live=live)

    def voff(r):
        """Request r's first entry (r <= bs), clamped to [0, live]."""
        p = _pair(voff_s, r)
        return jnp.where(hashing_u32.is_neg(p), 0,
                         jnp.where(tpu.pair_in_range(p, live + 1), tpu.i32(p[1]), live))

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

    def item(b, r) -> _Item:
        t0 = b * block
        lo = jnp.maximum(voff(r), t0)
        hi = jnp.minimum(jnp.minimum(voff(r + 1), t0 + block), live)
        pos0 = hashing_u32.add(_window_start(_pair(pre_s, r), window),
                               hashing_u32.from_i32(lo - voff(r)))
        e_lo, e_hi = lo - t0, jnp.maximum(hi, lo) - t0
        rp = _pair(rpi_s, r)
        n = e_hi - e_lo
        cells_fast = (tpu.pair_in_range(rp, rows) & jnp.logical_not(hashing_u32.is_neg(pos0)) &
                      tpu.pair_in_range(hashing_u32.add_u32(pos0, tpu.u32(n)), pitch + 1))
        if not has_pool:
            return _Item(e_lo, e_hi, pos0, rp, cells_fast, None)
        vl = _pair(vl_s, r)
        c0 = hashing_u32.add(pos0, hashing_u32.const(k_off))
        c_end = hashing_u32.add_u32(c0, tpu.u32(n))
        hi_n = tuple(jnp.where(hashing_u32.lt(vl, c_end), x, y) for x, y in zip(vl, c_end))
        lo_n = tuple(jnp.where(hashing_u32.is_neg(c0), jnp.uint32(0), x) for x in c0)
        empty = jnp.logical_not(hashing_u32.lt(lo_n, hi_n))
        tok_fast = tpu.pair_in_range(rp, prows) & (empty | tpu.pair_in_range(hi_n, ppitch + 1))
        return _Item(e_lo, e_hi, pos0, rp, cells_fast,
                     _Tokens(c0=c0, lo=lo_n, hi=hi_n, empty=empty, fast=tok_fast, valid=vl))

    def issue(b, r, slot):
        """Starts the DMAs of item (b, r)'s staged segments into item buffer ``slot``, and
        records which paths it takes."""
        it = item(b, r)
        cells_bit = _flag_bit(_Flag.CELLS_FAST, slot)
        tokens_bit = _flag_bit(_Flag.TOKENS_FAST, slot)
        flags = misc.flags & ~cells_bit & ~tokens_bit
        flags = flags | jnp.where(it.cells_fast, cells_bit, 0)
        p32 = tpu.i32(it.pos0[1])

        @pl.when(it.cells_fast)
        def _():
            cells.start(tpu.i32(it.rp[1]), jnp.maximum(p32 - 1, 0), p32 + it.e_hi - it.e_lo,
                        p32 - it.e_lo, slot)

        if has_pool:
            tok = it.tokens
            flags = flags | jnp.where(tok.fast, tokens_bit, 0)

            @pl.when(tok.fast & jnp.logical_not(tok.empty))
            def _():
                tokens.start(tpu.i32(it.rp[1]), tpu.i32(tok.lo[1]), tpu.i32(tok.hi[1]),
                             tpu.i32(tok.c0[1]) - it.e_lo, slot)
        misc.flags = flags

    def wait_item(slot):
        cells.wait(slot)
        if has_pool:
            tokens.wait(slot)

    def set_entry(plane, i, v):
        """acc[plane][entry i] = v (one row read-modify-write)."""
        row = tpu.idiv(i, tpu.LANES)
        cur = acc[plane, pl.ds(row, 1), :]
        lanes = lax.broadcasted_iota(jnp.int32, cur.shape, 1)
        acc[plane, pl.ds(row, 1), :] = jnp.where(lanes == (i & 127), v, cur)

    def lut_copy(v, i):
        return pltpu.make_async_copy(
            lut_hbm.at[pl.ds(jnp.minimum(v, lut_len - 1), 1)],
            lutrows.at[tpu.idiv(i, tpu.LANES), pl.ds(i & 127, 1)], sems.lut)

    def xlat_one(v):
        """LUT translation of one int32 value (sync), through ``lut_s``."""
        if not has_lut:
            return hashing_u32.from_i32(v)
        c = pltpu.make_async_copy(lut_hbm.at[pl.ds(jnp.minimum(jnp.maximum(v, 0),
                                                               lut_len - 1), 1)],
                                  lut_s, sems.sync)

        @pl.when(v >= 0)
        def _():
            c.start()
            c.wait()

        lut = (tpu.u32(lut_s[0, 1]), tpu.u32(lut_s[0, 0]))
        return tuple(jnp.where(v >= 0, x, y) for x, y in zip(lut, hashing_u32.from_i32(v)))

    def merge(b, r, slot):
        """Item (b, r)'s entries into ``acc``, its segments landed in item buffer ``slot``."""
        it = item(b, r)
        e_lo, e_hi, pos0, rp = it.e_lo, it.e_hi, it.pos0, it.rp
        e = tpu.entry_index(R)
        inside = (e >= e_lo) & (e < e_hi)
        p32 = tpu.i32(pos0[1])
        delta = p32 - e_lo
        cells_fast = flag(_Flag.CELLS_FAST, slot)

        def fast_cells():
            stage = seg_v[slot]
            row, lane = _staged_at(delta, jnp.maximum(p32 - 1, 0))
            at = (lax.broadcasted_iota(jnp.int32, stage.shape, 0) == row) & \
                (lax.broadcasted_iota(jnp.int32, stage.shape, 1) == lane)
            return _realign(stage, delta, R), tpu.sum_scalar(jnp.where(at, stage, 0))

        def slow_cells():
            # Per entry, SGLang's flat address (it may leave the row); outside the table: 0.
            def one(i, c):
                ok, flat = _flat(rp, hashing_u32.add_u32(pos0, tpu.u32(i - e_lo)), pitch, n_cells)
                set_entry(_ACC_SLOW_CELLS, i, jnp.where(
                    ok, cells.read(jnp.where(ok, flat, 0), _CellRow.CELL), 0))
                return c

            lax.fori_loop(e_lo, e_hi, one, 0)
            okp, flatp = _flat(rp, hashing_u32.sub(pos0, hashing_u32.const(1)), pitch, n_cells)
            return acc[_ACC_SLOW_CELLS], jnp.where(
                okp, cells.read(jnp.where(okp, flatp, 0), _CellRow.FIRST_PREV), 0)

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
                row, lane = _staged_at(delta, p32 - e_lo + i)
                return seg_s[slot, jnp.clip(row, 0, NS - 1), lane]

            def slow_value(i):
                return tpu.sum_scalar(jnp.where(e == i, raw, 0))

            n = lax.cond(cells_fast, lambda: look(fast_value), lambda: look(slow_value))
            tpu.wait_n(lut_copy(0, 0), n)
            w = tpu.rows_to_planes(lutrows[...])
            slot_p = tuple(jnp.where(raw >= 0, x, y) for x, y in zip((w[1], w[0]),
                                                                     hashing_u32.from_i32(raw)))
        else:
            slot_p = hashing_u32.from_i32(raw)
        first_prev_p = xlat_one(first_prev)
        minus1 = hashing_u32.const(-1, e)
        first = e == e_lo
        at_zero = first & tpu.pair_is_zero(pos0)
        prev_p = tuple(jnp.where(at_zero, m, jnp.where(first, f, tpu.shift_one(x)))
                       for m, f, x in zip(minus1, first_prev_p, slot_p))
        pos = hashing_u32.add_u32((jnp.full(e.shape, pos0[0]), jnp.full(e.shape, pos0[1])),
                                  tpu.u32(e - e_lo))

        if has_pool:
            tok, vl = it.tokens, it.tokens.valid
            posk = hashing_u32.add(pos, hashing_u32.const(k_off, e))
            in_vl = jnp.logical_not(hashing_u32.is_neg(posk)) & \
                hashing_u32.lt(posk, (jnp.full(e.shape, vl[0]), jnp.full(e.shape, vl[1])))
            tok_fast = flag(_Flag.TOKENS_FAST, slot)

            def fast_tok():
                return jnp.where(in_vl, _realign(tok_v[slot], tpu.i32(tok.c0[1]) - e_lo, R), -1)

            def slow_tok():
                def one(i, c):
                    p = hashing_u32.add(hashing_u32.add_u32(pos0, tpu.u32(i - e_lo)),
                                        hashing_u32.const(k_off))
                    ok_vl = jnp.logical_not(hashing_u32.is_neg(p)) & hashing_u32.lt(p, vl)
                    ok, flat = _flat(rp, p, ppitch, n_pool)
                    go = ok & ok_vl
                    set_entry(_ACC_SLOW_TOKENS, i, jnp.where(
                        go, tokens.read(jnp.where(go, flat, 0), _CellRow.TOKEN), -1))
                    return c

                lax.fori_loop(e_lo, e_hi, one, 0)
                return acc[_ACC_SLOW_TOKENS]

            tok_p = hashing_u32.from_i32(lax.cond(tok_fast, fast_tok, slow_tok))
        else:
            tok_p = minus1

        for f, pair in enumerate((slot_p, tok_p, pos, prev_p)):
            for w in range(2):
                acc[2 * f + w] = jnp.where(inside, tpu.i32(pair[w]), acc[2 * f + w])

    # The walk: item k + 1's segments are in flight while item k is merged; a block is written
    # out once its last item is merged.
    @pl.when(nblocks > 0)
    def _():
        r0 = owner(jnp.int32(0))
        blocks.start(jnp.int32(0))
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
                blocks.finish(b)

                @pl.when(nb < nblocks)
                def _():
                    blocks.start(nb)

            return nb, nr, 1 - slot

        lax.while_loop(lambda c: c[0] < nblocks, body, (jnp.int32(0), r0, jnp.int32(0)))
        for bslot in (0, 1):
            blocks.free(bslot)


def plan_entries(inputs: PlanInputs, vp: VerifyPlan, verify_offsets, *, swa_window_size,
                 kv_token_id_vs_position_offset, config: tpu.BlockConfig) -> VerifyPlan:
    """The entries half (:func:`kvcanary_jax.ops.plan.base.compose`, ``bs >= 1``): ``vp`` with
    its four arrays filled (aliased to their inputs; entries past the live count untouched)."""
    rpi, req_to_token, lut = inputs.req_pool_indices, inputs.req_to_token, \
        inputs.full_to_swa_index_mapping
    pool = inputs.req_to_verify_expected_tokens
    bs = int(rpi.shape[0])
    cap = int(vp.verify_slot_indices.shape[0])
    block = config.block
    cap_pad = tpu.pad_to(cap, block)
    rows, pitch = (int(d) for d in req_to_token.shape)
    has_lut = lut is not None
    has_pool = pool is not None
    prows, ppitch = (int(d) for d in pool.shape) if has_pool else (0, 1)
    for name, n in (("req_to_token", rows * pitch), ("the expected-token pool", prows * ppitch)):
        if n >= 2**31:
            raise ValueError(f"kv-canary: canary_plan (pallas_mosaic_tpu): {name} has {n} cells; "
                             f"32-bit addressing allows fewer than 2**31")
    bp = tpu.pad_to(bs + 1, tpu.PAIR_TILE)
    voff_r = tpu.to_pair_rows(verify_offsets, bp)
    rpi_r, pre_r = (tpu.to_pair_rows(x, bp) for x in (rpi, inputs.prefix_lens))
    vl_r = (tpu.to_pair_rows(inputs.req_to_verify_expected_tokens_valid_lens, bp) if has_pool
            else jnp.zeros((8, tpu.LANES), jnp.int32))
    st = jnp.concatenate([vp.enable.astype(jnp.int32).reshape(1), jnp.zeros((3,), jnp.int32)])
    rtt = req_to_token if rows * pitch else jnp.zeros((1, 1), jnp.int32)
    lut2 = tpu.words32(lut.reshape(-1, 1)) if has_lut else jnp.zeros((1, 2), jnp.int32)
    pool_ = pool if has_pool and prows * ppitch else jnp.zeros((1, 1), jnp.int32)
    # the kernel's four outputs, in VERIFY_ARRAYS order (slots, expected tokens, positions,
    # previous slots)
    outs = [tpu.to_pair_rows(getattr(vp, f), cap_pad) for f in VERIFY_ARRAYS]
    # widths of the short last segments of the tables as the kernel sees them
    tw_r, tw_p = (max(int(t.shape[1]) % tpu.LANES, 1) for t in (rtt, pool_))
    state = _entries_state(block, has_lut, tw_r, tw_p)
    kernel = functools.partial(
        _entries_kernel, state=state, bs=bs, cap=cap, block=block, window=int(swa_window_size),
        rows=rows if rows * pitch else 0, pitch=int(rtt.shape[1]), has_lut=has_lut,
        lut_len=int(lut.shape[0]) if has_lut else 1, has_pool=has_pool,
        prows=prows if prows * ppitch else 0, ppitch=int(pool_.shape[1]),
        k_off=int(kv_token_id_vs_position_offset))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    new = tpu.call(
        kernel, voff_r, rpi_r, pre_r, vl_r, st, rtt, lut2, pool_, *outs,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5, grid=(1,),
            in_specs=[any_spec] * 7,
            out_specs=[any_spec] * 4,
            scratch_shapes=state.scratch_shapes()),
        out_shape=[jax.ShapeDtypeStruct(o.shape, jnp.int32) for o in outs],
        input_output_aliases={8 + i: i for i in range(4)},
        compiler_params=tpu.compiler_params(config.vmem_limit_bytes),
        cost_estimate=tpu.cost(bytes_accessed=cap * (4 + 4 * has_pool + 32 + 8 * has_lut),
                               ops=cap * 60),
        interpret=config.interpret or False,
        name="kvcanary_plan_entries_tpu",
    )
    return dataclasses.replace(vp, **{f: tpu.from_pair_rows(o, cap)
                                      for f, o in zip(VERIFY_ARRAYS, new)})
