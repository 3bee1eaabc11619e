"""scatter_req_token_ids as a Mosaic TPU kernel (implementation ``"pallas_mosaic_tpu"``).

Semantics and bounds choices: those of the scatter op (SGLang's newer upstream scatter: request
``r`` writes ``pool[req_pool_indices[r], j] = int32(flat_in[offsets[r] + j])`` for ``j <
min(offsets[r+1] - offsets[r], max_context_len)``; flat indices outside ``flat_in`` and rows
outside the pool are skipped). Requests are applied in order, so for duplicate target rows the
later request wins, as in SGLang's reference.

Shape: one kernel instance walks *items*, a request's columns in groups of ``group`` 128-column
segments. Per item:

* the source: the low words of ``flat_in`` (a lane-dense ``[rows, 128]`` copy made at the kernel
  boundary, zero padded), one DMA of the ``group + 8`` rows that hold the item's tokens, realigned
  to the pool's columns with a lane rotation and a one-row carry;
* the destination: the pool row's 128-column segments, each one DMA (``[1, 128]`` windows at
  128-aligned offsets; a partial last segment of the row is a ``[1, C % 128]`` window). Segments
  the request covers in part (at most its first and last) are read first and merged, the others
  are written blind.

The next item's reads are in flight while an item is merged and its writes drain; a read of a row
with writes in flight waits for them first (duplicate rows), so the result is the sequential one.

Per copied token the kernel moves 4 B of source (plus the boundary copy: 8 B read, 4 B written)
and 4 B of pool; DMAs: one per 128 pool columns, one per item of source, and at most two reads
per request.
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

from kvcanary_jax import hashing_u32
from kvcanary_jax.ops import _tpu_lib as tpu
from kvcanary_jax.ops import _tpu_state as tpu_state
from kvcanary_jax.ops.scatter.base import ScatterInputs

__all__ = ["Config", "heuristics", "run", "GROUP"]

# 128-column segments per item: 2,048 columns, i.e. one item for most requests' histories.
GROUP = 16


def _state(group: int, width: int) -> tpu_state.State:
    """The kernel's scratch; a leading 2 (or a span of 2) is the item buffer ``s``. A row's short
    last segment has buffers of its own width: Mosaic refuses a DMA into (or from) a window of a
    wider VMEM row unless it is a multiple of 512 bytes."""
    tail = max(width % tpu.LANES, 1)
    return tpu_state.State(
        # the source rows holding an item's tokens
        srcbuf=tpu_state.vmem((2, group + 8, tpu.LANES)),
        # the item's merged pool segments, written out
        outbuf=tpu_state.vmem((2, group, tpu.LANES)),
        # the pool segments the item covers in part, read back
        oldbuf=tpu_state.vmem((2, group, tpu.LANES)),
        misc=tpu_state.words(  # each [s]: item buffer s
            pend_row=2,  # the pool row the buffer's writes in flight go to (-1: none)
            pend_n=2,  # whole-segment writes in flight
            pend_tail=2,  # short-last-segment writes in flight
            rd_n=2,  # whole-segment reads in flight
            rd_tail=2,  # short-last-segment reads in flight
        ),
        sems=tpu_state.semaphores(  # each [s]: item buffer s
            src=2,  # the item's source rows
            read=2,  # pool segments read back (whole)
            read_tail=2,  # a row's short last segment read back
            write=2,  # pool segments written (whole)
            write_tail=2,  # a row's short last segment written
        ),
        oldtail=tpu_state.vmem((2, 1, tail)),  # a row's short last segment, read back
        outtail=tpu_state.vmem((2, 1, tail)),  # the same, staged to be written
    )


@dataclasses.dataclass(frozen=True)
class Config(tpu.Config):
    """``group``: 128-column segments per item (1-64); the rest:
    :class:`kvcanary_jax.ops._tpu_lib.Config`."""

    OP: ClassVar[str] = "scatter_req_token_ids"
    group: int = GROUP

    def __post_init__(self):
        super().__post_init__()
        if not 1 <= self.group <= 64:
            raise ValueError(f"kv-canary: scatter_req_token_ids (pallas_mosaic_tpu): group must "
                             f"be in [1, 64], got {self.group}")



def heuristics(shapes) -> Config:
    cols = int(shapes.get("max_cols", GROUP * tpu.LANES))
    return Config(group=max(1, min(GROUP, -(-cols // tpu.LANES))))


def _scatter_kernel(
    # Prefetch (SMEM pair rows [(bs + 1) pad // 64, 128]): offsets, req_pool_indices
    off_s, rpi_s,
    # Input (HBM): the low words of flat_in, front padded, [n // 128, 128]; the pool (aliased)
    src_hbm, _pool_in,
    # Output (HBM): the pool [rows, width]
    pool_hbm,
    # Scratch: _state(group, width)
    *scratch,
    state, bs, num_tokens, rows, cols, width, group, front,
):
    scr = state.bind(scratch)
    srcbuf, outbuf, oldbuf, misc = scr.srcbuf, scr.outbuf, scr.oldbuf, scr.misc
    oldtail, outtail, sems = scr.oldtail, scr.outtail, scr.sems

    G = group
    W = G * tpu.LANES
    nsb = G + 8  # source rows per item
    tail_w = width % tpu.LANES
    tail_base = width - tail_w  # start of the row's short last segment (if tail_w)

    def pair(ref, e):
        row, col = tpu.idiv(e, 64), 2 * tpu.irem(e, 64)
        return tpu.u32(ref[row, col + 1]), tpu.u32(ref[row, col])

    def req(r):
        """(ok, rp, jlo, jhi, start) of request r; columns [jlo, jhi) are written."""
        start, end = pair(off_s, r), pair(off_s, r + 1)
        rp = pair(rpi_s, r)
        length = tpu.pair_clamp(hashing_u32.sub(end, start), cols)
        jlo = tpu.pair_clamp(hashing_u32.neg(start), cols)
        left = hashing_u32.sub(hashing_u32.const(num_tokens), start)
        jhi = jnp.minimum(length, tpu.pair_clamp(left, cols))
        ok = tpu.pair_in_range(rp, rows) & (jhi > jlo)
        return ok, tpu.i32(rp[1]), jlo, jhi, start

    def first_item(r):
        """The first request >= r with columns to write (bs if none) and its first group."""

        def cond(r):
            return (r < bs) & jnp.logical_not(req(jnp.minimum(r, bs - 1))[0])

        r = lax.while_loop(cond, lambda r: r + 1, r)
        _, _, jlo, _, _ = req(jnp.minimum(r, bs - 1))
        return r, tpu.idiv(jlo, W)

    def next_item(r, g):
        _, _, _, jhi, _ = req(r)
        last = tpu.idiv(jhi - 1, W)
        return lax.cond(g < last, lambda: (r, g + 1), lambda: first_item(r + 1))

    # -- copies
    def src_copy(q0, slot):
        return pltpu.make_async_copy(src_hbm.at[pl.ds(q0, nsb)], srcbuf.at[slot],
                                     sems.src[slot])

    def seg_copy(rp, base, i, slot, *, read, tail):
        buf = oldbuf if read else outbuf
        if tail:
            # The short last segment goes through a buffer of its own width: Mosaic refuses a
            # DMA into (or from) a window of a wider VMEM row unless it is a multiple of 512
            # bytes ("Tile size must be divisible by 512 bytes").
            hbm = pool_hbm.at[pl.ds(rp, 1), pl.ds(tail_base, tail_w)]
            vm = (oldtail if read else outtail).at[slot]
            sem = (sems.read_tail if read else sems.write_tail)[slot]
        else:
            hbm = pool_hbm.at[pl.ds(rp, 1), pl.ds(pl.multiple_of(base, tpu.LANES), tpu.LANES)]
            vm = buf.at[slot, pl.ds(i, 1)]
            sem = (sems.read if read else sems.write)[slot]
        return (pltpu.make_async_copy(hbm, vm, sem) if read else
                pltpu.make_async_copy(vm, hbm, sem))

    def segments(g, jlo, jhi):
        """Per segment i (static): (base, lo, hi, is_tail) of its written columns [lo, hi)."""
        out = []
        for i in range(G):
            base = g * W + i * tpu.LANES
            end = jnp.minimum(base + tpu.LANES, width)  # the segment's extent in the row
            lo = jnp.maximum(jlo, base)
            hi = jnp.minimum(jhi, end)
            is_tail = (base == tail_base) if tail_w else jnp.bool_(False)
            out.append((base, lo, hi, end, is_tail))
        return out

    def wait_writes(slot):
        tpu.wait_n(seg_copy(0, 0, 0, slot, read=False, tail=False), misc.pend_n[slot])
        if tail_w:
            tpu.wait_n(seg_copy(0, 0, 0, slot, read=False, tail=True), misc.pend_tail[slot])
        misc.pend_n[slot] = jnp.int32(0)
        misc.pend_tail[slot] = jnp.int32(0)
        misc.pend_row[slot] = jnp.int32(-1)

    def start_segments(rp, segs, wanted, slot, *, read):
        """Start the DMA of every segment whose ``wanted`` flag is set, between ``rp``'s row and
        the slot's buffer (``read``: row to buffer), whole segments and the row's tail segment
        each by its own copy shape; returns how many of each were started (to wait for)."""
        n_full = jnp.int32(0)
        n_tail = jnp.int32(0)
        for i, ((base, _, _, _, is_tail), want) in enumerate(zip(segs, wanted)):
            @pl.when(want & jnp.logical_not(is_tail))
            def _(i=i, base=base):
                seg_copy(rp, base, i, slot, read=read, tail=False).start()

            n_full = n_full + (want & jnp.logical_not(is_tail)).astype(jnp.int32)
            if tail_w:
                @pl.when(want & is_tail)
                def _(i=i, base=base):
                    if not read:  # the merged segment i is the row's tail: stage it
                        outtail[slot] = outbuf[slot, pl.ds(i, 1), pl.ds(0, tail_w)]
                    seg_copy(rp, base, i, slot, read=read, tail=True).start()

                n_tail = n_tail + (want & is_tail).astype(jnp.int32)
        return n_full, n_tail

    def issue_reads(r, g, slot):
        _, rp, jlo, jhi, start = req(r)
        u0 = tpu.i32(hashing_u32.add_u32(start, jnp.uint32(front))[1]) + g * W
        src_copy(tpu.idiv(u0, tpu.LANES), slot).start()
        segs = segments(g, jlo, jhi)
        partial = [(hi > lo) & ((lo > base) | (hi < end)) for base, lo, hi, end, _ in segs]
        any_partial = functools.reduce(jnp.logical_or, partial)
        for s_ in (0, 1):  # segments read back from a row with writes in flight: those land first
            @pl.when(any_partial & (misc.pend_row[s_] == rp))
            def _(s_=s_):
                wait_writes(s_)

        n_full, n_tail = start_segments(rp, segs, partial, slot, read=True)
        misc.rd_n[slot] = n_full
        misc.rd_tail[slot] = n_tail

    def merge_and_write(r, g, slot):
        _, rp, jlo, jhi, start = req(r)
        u0 = tpu.i32(hashing_u32.add_u32(start, jnp.uint32(front))[1]) + g * W
        d = tpu.irem(u0, tpu.LANES)
        src_copy(0, slot).wait()
        tpu.wait_n(seg_copy(0, 0, 0, slot, read=True, tail=False), misc.rd_n[slot])
        if tail_w:
            tpu.wait_n(seg_copy(0, 0, 0, slot, read=True, tail=True), misc.rd_tail[slot])
            # a tail read back lands in its own buffer: put it in its segment's row
            for i, (base, lo, hi, end, is_tail) in enumerate(segments(g, jlo, jhi)):
                @pl.when((hi > lo) & ((lo > base) | (hi < end)) & is_tail)
                def _(i=i):
                    oldbuf[slot, pl.ds(i, 1), pl.ds(0, tail_w)] = oldtail[slot]
        buf = srcbuf[slot]
        # a[i, l] = buf[i, (l + d) % 128]
        a = pltpu.roll(buf, tpu.irem(tpu.LANES - d, tpu.LANES), 1)
        b = pltpu.roll(a, nsb - 1, 0)  # b[i] = a[i + 1]
        lane = lax.broadcasted_iota(jnp.int32, buf.shape, 1)
        new = jnp.where(lane < tpu.LANES - d, a, b)[:G]
        col = g * W + tpu.entry_index(G)
        keep = (col >= jlo) & (col < jhi)
        # The writes of the item two back (same buffer) have drained before the buffer is reused,
        # and the previous item's have landed when they went to this row (a later write to a
        # segment must land last).
        wait_writes(slot)

        @pl.when(misc.pend_row[1 - slot] == rp)
        def _():
            wait_writes(1 - slot)

        outbuf[slot] = jnp.where(keep, new, oldbuf[slot])
        segs = segments(g, jlo, jhi)
        n_full, n_tail = start_segments(rp, segs, [hi > lo for _, lo, hi, _, _ in segs], slot,
                                        read=False)
        misc.pend_n[slot] = n_full
        misc.pend_tail[slot] = n_tail
        misc.pend_row[slot] = rp

    for slot in (0, 1):
        misc.pend_row[slot] = jnp.int32(-1)
        misc.pend_n[slot] = jnp.int32(0)
        misc.pend_tail[slot] = jnp.int32(0)
    r0, g0 = first_item(jnp.int32(0))

    @pl.when(r0 < bs)
    def _():
        issue_reads(r0, g0, 0)

    def body(carry):
        r, g, slot = carry
        nr, ng = next_item(r, g)
        # Item k + 1's reads go out before item k's merge (different buffers); a read of a row
        # that item k or k - 1 writes waits for those writes inside issue_reads.
        nxt = 1 - slot
        _, rp, _, _, _ = req(r)
        _, rp_next, _, _, _ = req(jnp.minimum(nr, bs - 1))
        # The next item's reads go out before this item's merge unless they read a row this item
        # writes (another request on the same row); the next group of the same request touches
        # other segments. issue_reads waits for writes in flight on its row.
        early = (nr < bs) & ((nr == r) | (rp_next != rp))

        @pl.when(early)
        def _():
            issue_reads(nr, ng, nxt)

        merge_and_write(r, g, slot)

        @pl.when((nr < bs) & jnp.logical_not(early))
        def _():
            issue_reads(nr, ng, nxt)

        return nr, ng, nxt

    lax.while_loop(lambda c: c[0] < bs, body, (r0, g0, jnp.int32(0)))
    for slot in (0, 1):
        wait_writes(slot)


def run(inputs: ScatterInputs, *, max_cols: int | None, config: Config):
    """The updated pool (aliased to ``inputs.pool_out``). ``max_cols``: columns a row may receive
    (default: ``pool_out.shape[1]``)."""
    bs = int(inputs.req_pool_indices.shape[0])
    num_tokens = int(inputs.flat_in.shape[0])
    rows, width = (int(d) for d in inputs.pool_out.shape)
    cols = width if max_cols is None else min(int(max_cols), width)
    if bs == 0 or num_tokens == 0 or rows == 0 or cols == 0:
        return inputs.pool_out
    G = min(config.group, -(-cols // tpu.LANES))
    W = G * tpu.LANES
    front = W
    lo = lax.bitcast_convert_type(inputs.flat_in.astype(jnp.int64), jnp.int32)[:, 0]
    back = W + 8 * tpu.LANES + (-(num_tokens + front) % tpu.LANES)
    src = jnp.pad(lo, (front, back)).reshape(-1, tpu.LANES)
    n_pad = tpu.pad_to(bs + 1, tpu.PAIR_TILE)
    off = tpu.to_pair_rows(inputs.offsets, n_pad)
    rpi = tpu.to_pair_rows(inputs.req_pool_indices, n_pad)
    state = _state(G, width)
    kernel = functools.partial(_scatter_kernel, state=state, bs=bs, num_tokens=num_tokens,
                               rows=rows, cols=cols, width=width, group=G, front=front)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    out = tpu.call(
        kernel, off, rpi, src, inputs.pool_out,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(1,),
            in_specs=[any_spec, any_spec],
            out_specs=any_spec,
            scratch_shapes=state.scratch_shapes()),
        out_shape=jax.ShapeDtypeStruct(inputs.pool_out.shape, inputs.pool_out.dtype),
        input_output_aliases={3: 0},
        compiler_params=tpu.compiler_params(config.vmem_limit_bytes),
        cost_estimate=tpu.cost(bytes_accessed=num_tokens * 12 + bs * (W * 8 + 32),
                               ops=num_tokens * 4 + bs * 200),
        interpret=config.interpret or False,
        name="kvcanary_scatter_tpu",
    )
    return out
