"""Real-KV fingerprints of a vector of slots, as a Mosaic TPU kernel (shared by verify and write).

For each entry ``e < n_live`` with slot ``s``: per source ``i``, the words of slot ``s``'s strip
(zero words when ``s < 0`` or ``s`` is past the source's rows) are folded
``h = splitmix64(h ^ w)``, and the sources ``acc = splitmix64(acc ^ h)`` (docs/spec.md §2.4), as
:func:`kvcanary_jax.hashing.fold_real_kv` does on int64. Entries past ``n_live`` get 0.

The kernel walks blocks of entries: the block's slots are DMA'd into SMEM, the scalar unit issues
the strip DMAs from each source's strips (see :func:`kvcanary_jax.ops._tpu_lib.source_strips`:
slot ``s``'s strip is row ``s``), one per run of consecutive slots within a 128-entry slab, and
the vector unit folds the block's words, 64-bit words as 32-bit pairs, while the next block's
DMAs are in flight. The result: pair rows ``[n_pad / 64, 128]``, as the slots.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kvcanary_jax import hashing_u32
from kvcanary_jax.ops import _tpu_lib as tpu
from kvcanary_jax.ops import _tpu_state as tpu_state

__all__ = ["fingerprints", "fingerprints_from_pair_rows"]

# Words of a strip above which the fold loops over words instead of unrolling them.
_UNROLL_WORDS = 16


def _state(block: int, widths) -> tpu_state.State:
    """The kernel's scratch (``widths``: each source's strip words ``E_i``); ``r = block / 128``
    plane rows; a leading 2 (or a span's last 2) is the block buffer ``s``."""
    r = block // tpu.LANES
    nsrc = len(widths)
    return tpu_state.State(
        slots_s=tpu_state.smem((2, 2 * r, tpu.LANES)),  # the block's slots (pair rows), as scalars
        slots_v=tpu_state.vmem((2, 2 * r, tpu.LANES)),  # the same, as vectors
        # per source i: the gathered strips
        bufs=tpu_state.vmem_each((2, r, tpu.LANES, w) for w in widths),
        # per source i: the strips as planes, one per word
        words=tpu_state.vmem_each((w, r, tpu.LANES) for w in widths),
        out_v=tpu_state.vmem((2, 2 * r, tpu.LANES)),  # the block's fingerprints (pair rows)
        misc=tpu_state.words(
            out_busy=1,  # bit s: block buffer s's output copy is in flight
            runs=(nsrc, 2),  # [i, s]: strip-run copies of source i in flight for buffer s
        ),
        # run k's length, per source and buffer
        lens=tpu_state.smem((max(nsrc, 1), 2, block)),
        sems=tpu_state.semaphores(
            slots=2,  # [s]: the block's slots
            out=2,  # [s]: the block's fingerprints, out
            strips=(nsrc, 2),  # [i, s]: strips of source i
        ),
    )


def _fold_kernel(
    # Prefetch (SMEM [1]): the live entry count
    n_ref,
    # Input (HBM): the slots, pair rows [n_pad // 64, 128]; then per source its strips
    # [rows * page_size, E_i] (source_strips); Output (HBM): fingerprints, pair rows as the slots;
    # Scratch: _state(block, widths)
    slots_hbm, *refs,
    state, nsrc, strips, widths, block,
):
    srcs = refs[:nsrc]
    out_hbm = refs[nsrc]
    scr = state.bind(refs[nsrc + 1:])
    slots_s, slots_v, bufs, words = scr.slots_s, scr.slots_v, scr.bufs, scr.words
    out_v, misc, lens, sems = scr.out_v, scr.misc, scr.lens, scr.sems

    r = block // tpu.LANES
    pr = 2 * r
    n_live = n_ref[0]
    nblocks = tpu.idiv(n_live + block - 1, block)
    misc.out_busy = jnp.int32(0)

    def fetch(b, slot):
        rows_b = pl.ds(pl.multiple_of(b * pr, 8), pr)
        return [pltpu.make_async_copy(slots_hbm.at[rows_b], slots_s.at[slot],
                                      sems.slots[slot]),
                pltpu.make_async_copy(slots_hbm.at[rows_b], slots_v.at[slot],
                                      sems.slots[slot])]

    def strips_copy(i, row, m, e, slot):
        """Strips [row, row + m) of source i into entries [e, e + m) (one 128-entry slab)."""
        return pltpu.make_async_copy(
            srcs[i].at[pl.ds(row, m)],
            bufs[i].at[slot, tpu.idiv(e, tpu.LANES), pl.ds(tpu.irem(e, tpu.LANES), m)],
            sems.strips[i, slot])

    def issue(b, slot):
        """Per source, one DMA per run of consecutive strips (consecutive slots in range, in
        one 128-entry slab)."""
        n = jnp.minimum(block, n_live - b * block)
        zero = jnp.int32(0)

        def flush(i, start, first, length, runs):
            @pl.when(length > 0)
            def _():
                strips_copy(i, start, length, first, slot).start()
                lens[i, slot, runs] = length

            return runs + (length > 0).astype(jnp.int32)

        def one(e, carry):
            row_, col = tpu.idiv(e, 64), 2 * tpu.irem(e, 64)
            s_lo, s_hi = tpu.u32(slots_s[slot, row_, col]), tpu.u32(slots_s[slot, row_, col + 1])
            out = []
            for i in range(nsrc):
                start, first, length, runs = carry[i]
                ok = tpu.pair_in_range((s_hi, s_lo), strips[i])
                row = tpu.i32(s_lo)
                extend = ok & (length > 0) & (row == start + length) & \
                    (tpu.irem(e, tpu.LANES) != 0)
                runs = flush(i, start, first, jnp.where(extend, 0, length), runs)
                out.append((jnp.where(extend, start, jnp.where(ok, row, zero)),
                            jnp.where(extend, first, e),
                            jnp.where(extend, length + 1, ok.astype(jnp.int32)), runs))
            return tuple(out)

        carry = lax.fori_loop(0, n, one, ((zero, zero, zero, zero),) * nsrc)
        for i in range(nsrc):
            misc.runs[i, slot] = flush(i, *carry[i])

    def wait(slot):
        for i in range(nsrc):
            def one(k, c, i=i):
                strips_copy(i, 0, lens[i, slot, k], 0, slot).wait()
                return c

            lax.fori_loop(0, misc.runs[i, slot], one, 0)

    def body(b, slot):
        s = tpu.planes(slots_v.at[slot])
        idx = tpu.entry_index(r, b * block)
        live = idx < n_live
        zero = jnp.zeros((r, tpu.LANES), jnp.uint32)
        acc = (zero, zero)
        for i in range(nsrc):
            ok = live & tpu.pair_in_range(s, strips[i])
            t = jnp.transpose(bufs[i][slot], (0, 2, 1))
            words[i][...] = jnp.transpose(t, (1, 0, 2))  # [E/4, R, 128]

            def word(w, i=i, ok=ok):
                return (jnp.where(ok, tpu.u32(words[i][2 * w + 1]), zero),
                        jnp.where(ok, tpu.u32(words[i][2 * w]), zero))

            nw = widths[i] // 2
            h = (zero, zero)
            if nw <= _UNROLL_WORDS:
                for w in range(nw):
                    h = hashing_u32.splitmix64(hashing_u32.xor(h, word(w)))
            else:
                h = lax.fori_loop(
                    0, nw, lambda w, h: hashing_u32.splitmix64(hashing_u32.xor(h, word(w))), h)
            acc = hashing_u32.splitmix64(hashing_u32.xor(acc, h))
        pending = misc.out_busy
        out_copy = pltpu.make_async_copy(
            out_v.at[slot], out_hbm.at[pl.ds(pl.multiple_of(b * pr, 8), pr)],
            sems.out[slot])

        @pl.when((pending >> slot) & 1 == 1)
        def _():
            out_copy.wait()  # the copy of block b - 2 out of this buffer

        tpu.store_planes(out_v.at[slot], jnp.where(live, acc[0], zero),
                         jnp.where(live, acc[1], zero))
        out_copy.start()
        misc.out_busy = pending | (1 << slot)

    tpu.pipeline(nblocks, fetch=fetch, issue=issue, wait=wait, body=body)
    for slot in (0, 1):
        @pl.when((misc.out_busy >> slot) & 1 == 1)
        def _(slot=slot):
            pltpu.make_async_copy(out_v.at[slot], out_hbm.at[pl.ds(0, pr)],
                                  sems.out[slot]).wait()


def fingerprints_from_pair_rows(slot_rows, n_live, sources, *, mode: int, block: int,
                                interpret=False):
    """Fingerprints of the slots in ``slot_rows`` (pair rows ``[n_pad / 64, 128]``, ``n_pad`` a
    multiple of ``block``) for entries below ``n_live`` (an int32 ``[1]`` array). ``sources``:
    ``((buffer, SourceSpec), ...)``. Returns the fingerprints as pair rows shaped as ``slot_rows``;
    entries at or past ``n_live`` are 0 within the blocks that hold live entries (the others are
    not written)."""
    n_pad = slot_rows.shape[0] * 64
    strips = [tpu.source_strips(b, spec, mode) for b, spec in sources]
    counts = tuple(int(s.shape[0]) for s in strips)
    widths = tuple(int(s.shape[1]) for s in strips)
    strips = [s if s.shape[0] else jnp.zeros((1, s.shape[1]), jnp.int32) for s in strips]
    nsrc = len(strips)
    state = _state(block, widths)
    kernel = functools.partial(_fold_kernel, state=state, nsrc=nsrc, strips=counts,
                               widths=widths, block=block)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    per_entry = 16 + 8 + sum(4 * w for w in widths)
    out = tpu.call(
        kernel, n_live.astype(jnp.int32).reshape(1), slot_rows, *strips,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(1,),
            in_specs=[any_spec] * (1 + nsrc),
            out_specs=any_spec,
            scratch_shapes=state.scratch_shapes()),
        out_shape=jax.ShapeDtypeStruct(slot_rows.shape, jnp.int32),
        compiler_params=tpu.compiler_params(),
        cost_estimate=tpu.cost(bytes_accessed=n_pad * per_entry,
                               ops=n_pad * 60 * (1 + sum(w // 2 + 1 for w in widths))),
        interpret=interpret,
        name="kvcanary_fingerprints_tpu",
    )
    return out


def fingerprints(slots, n_live, sources, *, mode: int, block: int, interpret=False):
    """:func:`fingerprints_from_pair_rows` of an int64 slot vector."""
    n_pad = tpu.pad_to(int(slots.shape[0]), block)
    return fingerprints_from_pair_rows(tpu.to_pair_rows(slots, n_pad), n_live, sources, mode=mode,
                                       block=block, interpret=interpret)
