"""The KV digest as a Mosaic TPU kernel (implementation ``"pallas_mosaic_tpu"``).

Semantics and bounds: :mod:`kvcanary_jax.ops.digest.base`; rows in entry order.

One kernel, ``kvcanary_digest_tpu``, computes the digests of a list of slots (the first
``n_live`` of them); XLA does the rest: a write scatters the digests into ``digest_buf``, a
verify compacts its selected entries first (:func:`~kvcanary_jax.ops.digest.base.compact`),
digests only those, then compares and records (:func:`~kvcanary_jax.ops.digest.base.
finish_verify`), so the KV read follows the selection.

**Operands.** Each source is read in place, from its buffer as int32 *page rows* ``[rows,
width]`` (``width`` = the view's row stride): slot ``s`` is row ``s // page_size +
row_offset`` (the view's offset gives ``row_offset``), its strip starts at word ``col + (s %
page_size) * num_bytes_per_token / 4`` of that row. A source whose strips do not lie inside its
rows is gathered into strips by XLA first (:func:`kvcanary_jax.ops._tpu_lib.source_strips`, a
copy). Sources with the same buffer, row stride, offset row and page size (the heads of a fused
K/V layer, K and V strips alike) share one operand: a slot's row is fetched once for all of
them. A width that is not a multiple of 128 words is padded (a copy): the kernel hashes whole
128-lane vectors.

On a TPU the page rows are the buffer itself (no copy) when it is a 2-D buffer of a 32-bit dtype
whose rows are the view's rows; a 16- or 8-bit buffer is laid out as 32-bit rows once per call
(XLA packs such dtypes along the rows, not along the bytes of a row), and any other shape is
flattened first: temporaries of the buffer's size. ``tests/test_tpu_compile.py`` compiles the
serving sizes with 32-bit buffers.

**The kernel.** Entries are taken 8 at a time (a *group*: one sublane tile), their slots read by
the scalar unit from SMEM (1,024 entries a fetch). Per group and operand, one DMA per entry
fetches its slot's page row (a full-width ``[1, width]`` window at a dynamic row: Mosaic refuses
narrower windows there) into a VMEM ``[8, width]`` buffer; a slot past the source's rows fetches
nothing and reads zero words. A page holds ``page_size`` slots: the kernel hashes the words of
the page row where any of its slots' strips may lie, each entry's own strip selected by a mask
(``page_size`` times the hashing of a page-1 source; the bytes read are the row's). Group
``g + 1``'s DMAs are in flight while group ``g`` is hashed. The hash is vectorised over the
words of a strip: a pair of 128-lane chunks holds 128 64-bit words of 8 entries as 32-bit halves,
de-interleaved into ``(hi, lo)`` planes by a lane gather; each word's term
``splitmix64(w + salt(j, i))`` is computed on 32-bit pairs (:mod:`kvcanary_jax.hashing_u32`) and
added, with carries, to its entry's sublane. A roll-and-add over the lanes finishes each entry's
sum; group ``g`` of a 1,024-entry slab stores its 8 digests in lane ``g`` of an ``[8, 128]`` pair
of planes, one DMA out per slab.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar, Mapping, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kvcanary_jax import consts, hashing, hashing_u32
from kvcanary_jax.context import DigestContext
from kvcanary_jax.ops import _tpu_lib as tpu
from kvcanary_jax.ops._xla_lib import take
from kvcanary_jax.ops.digest import base

__all__ = ["Config", "heuristics", "run", "GROUP", "SLAB"]

GROUP = 8  # entries hashed together: one sublane tile
SLAB = 8 * tpu.LANES  # entries whose slots one SMEM fetch brings: 128 groups, an 8 x 128 tile
# Chunk pairs of a strip above which its whole-vector middle is a loop, not unrolled.
_UNROLL_PAIRS = 4


@dataclasses.dataclass(frozen=True)
class Config(tpu.Config):
    """:class:`kvcanary_jax.ops._tpu_lib.Config`. VMEM holds ``2 * 8 * width * 4`` bytes per
    operand (a 4 KiB row: 64 KiB): raise ``vmem_limit_bytes`` for sources wider than the
    default scoped limit allows."""

    OP: ClassVar[str] = "digest"


def heuristics(shapes: Mapping[str, int]) -> Config:
    return Config()


class _Operand(NamedTuple):
    row_offset: int  # page row r of the view is row r + row_offset
    page_size: int  # slot s is in page row s // page_size
    slots: int  # slots fetched: s in [0, slots) (the most any of its sources addresses)
    width: int  # int32 words per row (a multiple of 128)


class _Source(NamedTuple):
    operand: int
    slots: int  # s in [0, slots) reads the source's bytes; any other slot reads zero words
    col: int  # int32 word of the row where the strip of a page's first slot starts (even)
    stride: int  # int32 words from one slot of a page to the next
    words32: int  # int32 words of the strip (even)


def _rows32(buf, width: int, rows: int):
    """``buf``'s bytes as int32 ``[>= rows, width]`` rows. A 2-D buffer whose rows are ``width``
    words is bitcast row by row (no copy for a 32-bit dtype; one relayout on a TPU otherwise);
    anything else is flattened and cut into rows (a copy)."""
    isz = jnp.dtype(buf.dtype).itemsize
    if buf.ndim == 2 and buf.dtype != jnp.bool_ and buf.shape[1] * isz == 4 * width:
        r = buf.shape[0]
        if isz == 4:
            out = lax.bitcast_convert_type(buf, jnp.int32)
        elif isz == 8:
            out = lax.bitcast_convert_type(buf, jnp.int32).reshape(r, width)
        else:
            out = lax.bitcast_convert_type(buf.reshape(r, width, 4 // isz), jnp.int32)
        return out if r >= rows else jnp.pad(out, ((0, rows - r), (0, 0)))
    words = tpu.flat_words32(buf)
    need = max(-(-words.shape[0] // width), rows, 1)
    return jnp.pad(words, (0, need * width - words.shape[0])).reshape(need, width)


def _operands(sources: base.BoundSources):
    """The kernel's operands (int32 ``[rows, width]`` arrays), their static descriptions and
    each source's place in them. A source reads its buffer's page rows in place when its strips
    lie inside them; otherwise XLA gathers its strips first (a copy)."""
    arrays, ops, srcs, index, nslots = [], [], [], {}, {}
    plans = []
    for b, spec in sources.specs:
        o32, r32, n32 = 2 * spec.word_offset, 2 * spec.row_stride_words, 2 * spec.nbpt_words
        e32 = 2 * spec.read_words
        slots = spec.num_rows * spec.page_size
        col = o32 % r32 if r32 else 0
        inside = r32 > 0 and col + (spec.page_size - 1) * n32 + e32 <= r32
        key = (b, r32, o32 // r32, spec.page_size) if inside else None
        if key is not None:
            nslots[key] = max(nslots.get(key, 0), slots)
        plans.append((b, spec, key, col, slots))
    for b, spec, key, col, slots in plans:
        e32 = 2 * spec.read_words
        if key is None or key not in index:
            if key is not None:
                _, r32, row_offset, page = key
                rows = row_offset + -(-nslots[key] // page)
                arr = _rows32(sources.buffers[b], r32, rows)
                op_slots = nslots[key]
            else:
                row_offset, page, op_slots = 0, 1, slots
                arr = tpu.source_strips(sources.buffers[b], spec, int(consts.RealKvHashMode.ALL))
                if arr.shape[0] == 0:
                    arr = jnp.zeros((1, arr.shape[1]), jnp.int32)
            width = tpu.pad_to(arr.shape[1], tpu.LANES)
            if width != arr.shape[1]:
                arr = jnp.pad(arr, ((0, 0), (0, width - arr.shape[1])))
            if key is not None:
                index[key] = len(ops)
            arrays.append(arr)
            ops.append(_Operand(row_offset, page, op_slots, width))
        if key is not None:
            srcs.append(_Source(index[key], slots, col, 2 * spec.nbpt_words, e32))
        else:
            srcs.append(_Source(len(ops) - 1, slots, 0, 0, e32))
    return arrays, tuple(ops), tuple(srcs)


class _Sem:
    """DMA semaphores."""

    SLOTS = 0  # a slab's slots into SMEM
    OUT = 1  # a slab's digests out
    ROWS = 2  # + buffer: a group's rows, every operand


def _digest_kernel(n_ref, slots_hbm, *refs, ops, srcs):
    nops = len(ops)
    ops_hbm, out_hbm = refs[:nops], refs[nops]
    slots_s, out_v, counts, *rest = refs[nops + 1:]
    bufs, sems = rest[:nops], rest[nops]
    n = n_ref[0]
    shape = (GROUP, tpu.LANES)
    sub = lax.broadcasted_iota(jnp.int32, shape, 0)
    lane = lax.broadcasted_iota(jnp.int32, shape, 1)
    zero = jnp.zeros(shape, jnp.uint32)
    low_half = lane < 64
    # Lane gather that puts a 128-lane chunk's even words (low halves) in lanes 0..63 and its odd
    # words (high halves) in lanes 64..127.
    perm = jnp.where(low_half, 2 * lane, 2 * (lane - 64) + 1)

    def row_copy(k, row, i, slot):
        return pltpu.make_async_copy(ops_hbm[k].at[pl.ds(row, 1)], bufs[k].at[slot, pl.ds(i, 1)],
                                     sems.at[_Sem.ROWS + slot])

    def issue(g, slot, n_b):
        for k in range(nops):
            counts[2 * k + slot] = jnp.int32(0)

        def one(i, c):
            e = g * GROUP + i
            s = slots_s[tpu.idiv(e, tpu.LANES), tpu.irem(e, tpu.LANES)]
            live = e < n_b
            for k, op in enumerate(ops):
                @pl.when(live & (s >= 0) & (s < op.slots))
                def _(k=k, op=op):
                    row = tpu.idiv(s, op.page_size) + op.row_offset
                    row_copy(k, row, i, slot).start()
                    counts[2 * k + slot] = counts[2 * k + slot] + 1

            return c

        lax.fori_loop(0, GROUP, one, 0)

    def wait(slot):
        for k in range(nops):
            tpu.wait_n(row_copy(k, 0, 0, slot), counts[2 * k + slot])

    def pair_words(ref, t, two: bool):
        """(hi, lo) uint32 planes of the 64-bit words in int32 words [t, t + 256) of the rows
        (``two``), or [t, t + 128) (lanes 64.. then hold nothing): the word at int32 word
        ``t + 2 * lane`` in lane ``lane``."""
        ga = jnp.take_along_axis(ref[:, pl.ds(t, tpu.LANES)], perm, axis=1)
        if not two:
            return tpu.u32(pltpu.roll(ga, 64, 1)), tpu.u32(ga)
        gb = jnp.take_along_axis(ref[:, pl.ds(t + tpu.LANES, tpu.LANES)], perm, axis=1)
        lo = jnp.where(low_half, ga, pltpu.roll(gb, 64, 1))
        hi = jnp.where(low_half, pltpu.roll(ga, 64, 1), gb)
        return tpu.u32(hi), tpu.u32(lo)

    def terms(ref, t, two: bool, j: int, src: _Source, col, row_ok):
        """The masked terms of source ``j``'s words held by int32 words [t, t + 256) (or 128)
        of the rows: each entry's strip starts at ``col`` (int or int32 planes); its word ``q =
        (t - col) / 2 + lane`` counts where ``0 <= q < words``."""
        q = lax.shift_right_arithmetic(t - col, 1) + lane if not isinstance(col, int) \
            else (t - col) // 2 + lane
        m = (q >= 0) & (q < src.words32 // 2)
        if not two:
            m = m & low_half
        hi, lo = pair_words(ref, t, two)
        words = (jnp.where(row_ok, hi, zero), jnp.where(row_ok, lo, zero))
        salt = hashing_u32.add(hashing_u32.mul_const(hashing_u32.from_i32(q),
                                                     hashing.DIGEST_GAMMA),
                               hashing_u32.const(hashing.digest_salt_int(j, 0), lane))
        th, tl = hashing_u32.splitmix64(hashing_u32.add(words, salt))
        return jnp.where(m, th, zero), jnp.where(m, tl, zero)

    def hash_group(slot, svec, live):
        acc = (zero, zero)
        fetched = [live & (svec >= 0) & (svec < op.slots) for op in ops]
        for j, src in enumerate(srcs):
            op = ops[src.operand]
            ref = bufs[src.operand].at[slot]
            row_ok = fetched[src.operand] & (svec < src.slots)
            if op.page_size == 1:
                col = src.col
            else:  # the slot's place in its page: a plane
                col = src.col + lax.rem(jnp.maximum(svec, 0), op.page_size) * src.stride
            first = src.col - src.col % tpu.LANES
            end = src.col + (op.page_size - 1) * src.stride + src.words32
            starts = list(range(first, end, 2 * tpu.LANES))
            looped = len(starts) - 1 if len(starts) > _UNROLL_PAIRS else 0
            for t in starts[looped:]:
                acc = hashing_u32.add(acc, terms(ref, t, t + tpu.LANES < end, j, src, col,
                                                 row_ok))
            if looped:
                def pair(c, acc, ref=ref, j=j, src=src, col=col, row_ok=row_ok, first=first):
                    t = pl.multiple_of(first + c * (2 * tpu.LANES), tpu.LANES)
                    return hashing_u32.add(acc, terms(ref, t, True, j, src, col, row_ok))

                acc = lax.fori_loop(0, looped, pair, acc)
        d = 64
        while d:
            acc = hashing_u32.add(acc, (pltpu.roll(acc[0], d, 1), pltpu.roll(acc[1], d, 1)))
            d //= 2
        return acc

    def slab(b, carry):
        copy = pltpu.make_async_copy(slots_hbm.at[pl.ds(pl.multiple_of(b * 8, 8), 8)], slots_s,
                                     sems.at[_Sem.SLOTS])
        copy.start()
        copy.wait()
        n_b = jnp.minimum(SLAB, n - b * SLAB)
        groups = tpu.idiv(n_b + GROUP - 1, GROUP)
        out_v[...] = jnp.zeros((2, *shape), jnp.int32)
        issue(0, 0, n_b)

        def group(g, c):
            slot = tpu.irem(g, 2)

            @pl.when(g + 1 < groups)
            def _():
                issue(g + 1, 1 - slot, n_b)

            wait(slot)
            svec = jnp.full(shape, -1, jnp.int32)
            for i in range(GROUP):
                e = g * GROUP + i
                s = slots_s[tpu.idiv(e, tpu.LANES), tpu.irem(e, tpu.LANES)]
                svec = jnp.where(sub == i, s, svec)
            live = g * GROUP + sub < n_b
            hi, lo = hash_group(slot, svec, live)
            mine = lane == g
            out_v[0] = jnp.where(mine, tpu.i32(lo), out_v[0])
            out_v[1] = jnp.where(mine, tpu.i32(hi), out_v[1])
            return c

        lax.fori_loop(0, groups, group, 0)
        out = pltpu.make_async_copy(out_v, out_hbm.at[b], sems.at[_Sem.OUT])
        out.start()
        out.wait()
        return carry

    lax.fori_loop(0, tpu.idiv(n + SLAB - 1, SLAB), slab, 0)


def digests(slots, n_live, sources: base.BoundSources, *, config: Config):
    """The digests (int64 ``[n]``) of the int32 ``slots`` ``[n]`` for entries below ``n_live``
    (int32 ``[1]``; -1 or a slot past a source's rows reads zero words there); the rest are 0."""
    n = slots.shape[0]
    nslabs = -(-n // SLAB)
    rows = jnp.pad(slots, (0, nslabs * SLAB - n), constant_values=-1).reshape(
        nslabs * 8, tpu.LANES)
    arrays, ops, srcs = _operands(sources)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    words = sum(s.words32 for s in srcs) // 2
    out = tpu.call(
        functools.partial(_digest_kernel, ops=ops, srcs=srcs),
        n_live.astype(jnp.int32).reshape(1), rows, *arrays,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(1,), in_specs=[any_spec] * (1 + len(arrays)),
            out_specs=any_spec,
            scratch_shapes=[
                pltpu.SMEM((8, tpu.LANES), jnp.int32),
                pltpu.VMEM((2, GROUP, tpu.LANES), jnp.int32),
                pltpu.SMEM((2 * len(ops),), jnp.int32),
                *(pltpu.VMEM((2, GROUP, op.width), jnp.int32) for op in ops),
                pltpu.SemaphoreType.DMA((_Sem.ROWS + 2,)),
            ]),
        out_shape=jax.ShapeDtypeStruct((nslabs, 2, GROUP, tpu.LANES), jnp.int32),
        compiler_params=tpu.compiler_params(config.vmem_limit_bytes),
        cost_estimate=tpu.cost(bytes_accessed=n * (4 + 8 + 4 * sum(o.width for o in ops)),
                               ops=n * words * 80),
        interpret=config.interpret or False,
        name="kvcanary_digest_tpu",
    )
    # Slab b's entry 8 g + i sits at [b, :, i, g]. The halves are joined by shifts: a bitcast of
    # int32 pairs to int64 compiles about 15x slower on a TPU (14 s at 64k entries on v5e).
    live = jnp.arange(n, dtype=jnp.int32) < n_live[0]
    lo, hi = (jnp.where(live, jnp.transpose(out[:, h], (0, 2, 1)).reshape(-1)[:n], 0)
              for h in (0, 1))
    return (hi.astype(jnp.int64) << 32) | lo.astype(jnp.uint32).astype(jnp.int64)


def _int32_slots(num_slots: int) -> None:
    if num_slots >= 2**31:
        raise ValueError(f"kv-canary digest (pallas_mosaic_tpu): slots are int32 in the kernel; "
                         f"digest_buf has {num_slots} slots")


def write(digest_buf, slots, sources: base.BoundSources, *, config: Config):
    num_slots = digest_buf.shape[0]
    _int32_slots(num_slots)
    ok = (slots >= 0) & (slots < num_slots)
    s32 = jnp.where(ok, slots, -1).astype(jnp.int32)
    d = digests(s32, jnp.full((1,), slots.shape[0], jnp.int32), sources, config=config)
    return digest_buf.at[jnp.where(ok, slots, num_slots)].set(d, mode="drop")


def verify(context: DigestContext, slots, positions, num_valid, phase,
           sources: base.BoundSources, *, window: int, config: Config) -> DigestContext:
    num_slots = context.digest_buf.shape[0]
    _int32_slots(num_slots)
    order, count = base.compact(base.selection(slots, num_valid, phase, window=window,
                                               num_slots=num_slots))
    live = jnp.arange(slots.shape[0]) < count[0]
    s32 = take(slots, order, live, fill=-1).astype(jnp.int32)
    d = digests(s32, count, sources, config=config)
    return base.finish_verify(context, slots, positions, order, count, d)


_FUNCTIONS = {"write": write, "verify": verify}


def run(function: str, *args, config: Config, **kwargs):
    """``function`` (``"write"`` or ``"verify"``) of this implementation."""
    return _FUNCTIONS[function](*args, config=config, **kwargs)
