"""The KV digest as a Mosaic TPU kernel (implementation ``"pallas_mosaic_tpu"``).

Semantics and bounds: :mod:`kvcanary_jax.ops.digest.base`; rows in entry order.

One kernel, ``kvcanary_digest_tpu``, computes the digests of a list of slots (the first
``n_live`` of them); XLA does the rest: a write scatters the digests into ``digest_buf``, a
verify compacts its selected entries first (:func:`~kvcanary_jax.ops.digest.base.compact`),
digests only those, then compares and records (:func:`~kvcanary_jax.ops.digest.base.
finish_verify`), so the KV read follows the selection.

**Sources in place.** A source's buffer is a kernel operand as it is (in HBM,
``memory_space=pl.ANY``; no XLA op touches it) whenever the kernel can DMA a slot's strips out
of it. The DMA engine moves *rows* of a buffer (its last dimension, ``N`` elements, is the
lanes; row ``r`` is index ``r`` of the other dimensions, flattened). In a TPU's tiled layout one
32-bit word holds ``p = 4 / itemsize`` consecutive rows of a 16- or 8-bit type (bf16
``T(8,128)(2,1)``, int8 ``T(32,128)(4,1)``) and Mosaic refuses a DMA window that splits a word,
so the kernel fetches the *row group* that holds a strip's row (rows ``[p k, p k + p)``,
``4 N`` bytes: a bf16 row costs its neighbour's bytes too) and keeps the row's bits. A source
is read in place when

* its dtype is a 32-bit type, bf16, int16 / uint16, int8 / uint8 or an fp8 (Mosaic has no
  float16 loads and refuses bitcasts of float16 refs; XLA's bitcast of float16 to int16 is a
  copy);
* ``N`` is a multiple of 128 (Mosaic's DMAs move whole 512-byte slices);
* its view's row stride is a whole number ``L`` of buffer rows and the strips of a page's slots
  lie inside one buffer row: slot ``s``'s strip is in row ``(s // page_size) * L + c`` from
  int32 word ``col + (s % page_size) * num_bytes_per_token / 4`` (``c``, ``col``: the view's
  offset);
* its second-minor dimension holds at least ``p`` rows, a multiple of ``p`` for a buffer of 3
  or more dimensions (no group straddles two leading indices). A 2-D buffer whose row count is
  not a multiple of ``p`` ends in a partial group, which the DMA engine cannot move: XLA packs
  those ``rows % p`` rows into the int32 ``[1, N]`` words a group's load gives (integer ops:
  the KV's bytes, NaN payloads included), an operand of its own that the kernel fetches for the
  slots of that group (the only bytes copied).

That is every 2-D ``[slots, width]`` or paged ``[pages, page_size * width]`` KV buffer of a
serving dtype, strided views and byte offsets into one (a fused layer's head strips), and
sglang-jax's fused layers (``[slots, 2 * heads, head_dim]``, ``[pages, page_size, 2 * heads /
packing, packing, head_dim]``: a head's strip is one row of ``head_dim`` elements,
:func:`kvcanary_jax.integrations.sglang_jax.layout.fused_kv_sources`) with ``head_dim`` a
multiple of 128. Sources whose strips come from the same row group (same buffer, page size,
``L`` and group offset: the K and V strips of a fused layer's heads, views of one row) share
one *fetch*: a slot's group is fetched once for all of them. Any other source is laid out as
int32 rows by XLA first, a copy: its view's rows when its strips lie inside them
(:func:`_rows32`, padded to a multiple of 128 words; views of one buffer share it), else its
strips (:func:`kvcanary_jax.ops._tpu_lib.source_strips`). ``tests/test_tpu_compile.py``
compiles the serving sizes with bf16 and int32 KV and checks that no copy of it is made.

**The kernel.** Entries are taken 8 at a time (a *group*: one sublane tile), their slots read by
the scalar unit from SMEM (1,024 entries a fetch). Per group and fetch, one DMA per entry moves
its slot's row group (a ``[p, N]`` window at a dynamic row, at leading indices for a buffer of
3 or more dimensions) into rows ``[p i, p i + p)`` of a VMEM ``[8 p, N]`` buffer of the
buffer's dtype; a slot past the source's rows fetches nothing and reads zero words. A 128-lane
load of those rows bitcast to int32 ``[8, 128]`` (Mosaic's packing: row ``p i + k`` is bits
``[32 k / p, 32 (k + 1) / p)`` of sublane ``i``) holds entry ``i``'s elements in sublane ``i``,
selected by a shift (the row's place in its group: static, or per entry for a group offset
that varies with the slot) and a mask; a lane gather and ``p - 1`` rolls join ``p``
consecutive elements into a 32-bit word, ``128 / p`` words a load, so ``p`` loads make 128
words in lane order, as a 32-bit buffer's load does. A page holds ``page_size`` slots: the
kernel hashes the words of the row where any of its slots' strips may lie, each entry's own
strip selected by a mask (``page_size`` times the hashing of a page-1 source; the bytes read
are the row group's). Group ``g + 1``'s DMAs are in flight while group ``g`` is hashed. The
hash is vectorised over the words of a strip: a pair of 128-lane chunks holds 128 64-bit words
of 8 entries as 32-bit halves, de-interleaved into ``(hi, lo)`` planes by a lane gather; each
word's term ``splitmix64(w + salt(j, i))`` is computed on 32-bit pairs
(:mod:`kvcanary_jax.hashing_u32`) and added, with carries, to its entry's sublane. A
roll-and-add over the lanes finishes each entry's sum; group ``g`` of a 1,024-entry slab stores
its 8 digests in lane ``g`` of an ``[8, 128]`` pair of planes, one DMA out per slab.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar, Mapping, NamedTuple

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
# Dtypes Mosaic does not load (float16: "Invalid vector type for load"), read through a copy.
_NOT_LOADED = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bool_))


@dataclasses.dataclass(frozen=True)
class Config(tpu.Config):
    """:class:`kvcanary_jax.ops._tpu_lib.Config`. VMEM holds ``2 * 8 * 4 * N`` bytes per fetch
    (rows of ``N`` elements: 64 KiB for 1,024; twice that for a buffer that ends in a partial
    group): raise ``vmem_limit_bytes`` for sources wider than the default scoped limit allows."""

    OP: ClassVar[str] = "digest"


def heuristics(shapes: Mapping[str, int]) -> Config:
    return Config()


class _Fetch(NamedTuple):
    """One DMA per live entry of a group: slot ``s``'s row group of kernel argument ``array``.
    Its first row is ``(s // page_size) * rows_per_view_row + row_offset``, rounded down to a
    multiple of ``pack`` unless ``aligned`` (then it is one)."""

    array: int  # the kernel argument (in HBM) the groups come from
    tail: int  # the argument holding a 2-D buffer's partial last group as words (-1: none)
    tail_row: int  # the first row of that partial group
    dims: tuple  # the argument's shape but its last dimension (a row's index, flattened)
    page_size: int
    rows_per_view_row: int
    row_offset: int
    aligned: bool
    slots: int  # slots fetched: s in [0, slots) (the most any of its sources addresses)
    pack: int  # rows a 32-bit word holds (4 / itemsize): the rows of a group
    lanes: int  # elements of a row (a multiple of 128)
    dtype: Any  # the argument's dtype (the VMEM buffer's)


class _Source(NamedTuple):
    fetch: int
    slots: int  # s in [0, slots) reads the source's bytes; any other slot reads zero words
    col: int  # int32 word of the row where the strip of a page's first slot starts (even)
    stride: int  # int32 words from one slot of a page to the next
    words32: int  # int32 words of the strip (even)
    sub: int  # the strip's row in its group (-1: per slot, (s // page_size * L + c) % pack)


class _Place(NamedTuple):
    """Where a source read in place finds slot ``s``'s strip: buffer row
    ``(s // page_size) * rows_per_view_row + row``, from int32 word ``col + (s % page_size) *
    stride`` of it; a row is ``lanes`` elements, ``pack`` rows a 32-bit word."""

    pack: int
    lanes: int
    rows_per_view_row: int
    row: int
    col: int

    @property
    def aligned(self) -> bool:
        """Whether the strip's row has the same place in its group for every slot."""
        return self.rows_per_view_row % self.pack == 0

    @property
    def group_row(self) -> int:
        """The fetch's ``row_offset``: ``row``'s group's first row where ``aligned``."""
        return self.row - self.row % self.pack if self.aligned else self.row

    @property
    def sub(self) -> int:
        """:attr:`_Source.sub`."""
        return self.row % self.pack if self.aligned else -1


def _bits(dtype) -> int:
    dtype = jnp.dtype(dtype)
    info = jnp.iinfo if jnp.issubdtype(dtype, jnp.integer) else jnp.finfo
    return int(info(dtype).bits)


def _in_place(buf, spec) -> _Place | None:
    """How the kernel reads the source ``(buf, spec)`` in place (the module docstring's
    conditions), or None."""
    dtype = jnp.dtype(buf.dtype)
    if buf.ndim < 2 or dtype in _NOT_LOADED or dtype.itemsize not in (1, 2, 4) or \
            _bits(dtype) != 8 * dtype.itemsize:
        return None
    lanes, pack = int(buf.shape[-1]), 4 // dtype.itemsize
    # A buffer of fewer rows than a group has no group the DMA engine can move.
    if lanes % tpu.LANES or buf.shape[-2] < pack or (buf.ndim > 2 and buf.shape[-2] % pack):
        return None
    row32 = lanes // pack
    o32, r32, n32 = 2 * spec.word_offset, 2 * spec.row_stride_words, 2 * spec.nbpt_words
    if r32 == 0 or r32 % row32:
        return None
    col = o32 % row32
    if col + (spec.page_size - 1) * n32 + 2 * spec.read_words > row32:
        return None
    return _Place(pack, lanes, r32 // row32, o32 // row32, col)


def _rows32(buf, width: int, rows: int):
    """``buf``'s bytes as int32 ``[>= rows, width]`` rows (XLA ops: a copy unless ``buf`` is a
    2-D 32-bit buffer of such rows). A 2-D buffer whose rows are ``width`` words is bitcast row
    by row; anything else is flattened and cut into rows."""
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


def _tail_words(buf, first: int, pack: int):
    """Rows ``[first, rows)`` of a 2-D buffer (fewer than ``pack``: the one group the DMA engine
    cannot move) as the int32 ``[1, N]`` words a full group's load is bitcast to: row ``first +
    k`` in bits ``[32 k / pack, 32 (k + 1) / pack)``, missing rows zero. The buffer is bitcast
    to unsigned integers before it is sliced: an XLA op that makes a float array may rewrite NaN
    payloads (XLA's CPU backend's elemental emitters do), and these are the KV's bytes. (XLA fuses
    the bitcast into the slice: only the tail is read.)"""
    bits = 32 // pack
    rows = lax.bitcast_convert_type(buf, jnp.dtype(f"uint{bits}"))[first:].astype(jnp.uint32)
    at = jnp.arange(rows.shape[0], dtype=jnp.uint32)[:, None] * bits
    words = jnp.sum(rows << at, axis=0, dtype=jnp.uint32)  # disjoint bits: the sum is an or
    return lax.bitcast_convert_type(words, jnp.int32).reshape(1, -1)


def _operands(sources: base.BoundSources):
    """The kernel's array arguments, its fetches and each source's place in them. A source is
    read in place where :func:`_in_place` says how; otherwise XLA lays its view's rows (strips
    inside them) or its strips out as int32 rows first (a copy)."""
    arrays, arg_of, fetches, index, srcs = [], {}, [], {}, []

    def argument(key, make):
        if key not in arg_of:
            arg_of[key] = len(arrays)
            arrays.append(make())
        return arg_of[key]

    plans = []  # per source: (buffer, spec, fetch key, its _Place or its column, slots)
    for b, spec in sources.specs:
        buf = sources.buffers[b]
        slots = spec.num_rows * spec.page_size
        place = _in_place(buf, spec)
        if place is not None:
            key = ("in place", b, spec.page_size, place.rows_per_view_row, place.group_row)
            plans.append((b, spec, key, place, slots))
            continue
        o32, r32, n32 = 2 * spec.word_offset, 2 * spec.row_stride_words, 2 * spec.nbpt_words
        col = o32 % r32 if r32 else 0
        inside = r32 > 0 and col + (spec.page_size - 1) * n32 + 2 * spec.read_words <= r32
        key = ("rows", b, r32, o32 // r32, spec.page_size) if inside else None
        plans.append((b, spec, key, col, slots))
    nslots = {}
    for _, _, key, _, slots in plans:
        if key is not None:
            nslots[key] = max(nslots.get(key, 0), slots)
    for b, spec, key, how, slots in plans:
        e32, n32 = 2 * spec.read_words, 2 * spec.nbpt_words
        if isinstance(how, _Place):
            place = how
            if key not in index:
                buf = sources.buffers[b]
                tail, tail_row = -1, 0
                rows = int(buf.shape[0])
                if buf.ndim == 2 and rows % place.pack:
                    tail_row = rows - rows % place.pack
                    tail = argument(("tail", b), functools.partial(
                        _tail_words, buf, tail_row, place.pack))
                index[key] = len(fetches)
                fetches.append(_Fetch(
                    array=argument(("buffer", b), lambda buf=buf: buf), tail=tail,
                    tail_row=tail_row, dims=tuple(int(d) for d in buf.shape[:-1]),
                    page_size=spec.page_size, rows_per_view_row=place.rows_per_view_row,
                    row_offset=place.group_row, aligned=place.aligned, slots=nslots[key],
                    pack=place.pack, lanes=place.lanes, dtype=jnp.dtype(buf.dtype)))
            srcs.append(_Source(index[key], slots, place.col, n32, e32, place.sub))
            continue
        if key is None or key not in index:
            if key is not None:
                _, _, r32, row_offset, page = key
                rows = row_offset + -(-nslots[key] // page)
                arr = _rows32(sources.buffers[b], r32, rows)
                fetch_slots = nslots[key]
            else:
                row_offset, page, fetch_slots = 0, 1, slots
                arr = tpu.source_strips(sources.buffers[b], spec, int(consts.RealKvHashMode.ALL))
                if arr.shape[0] == 0:
                    arr = jnp.zeros((1, arr.shape[1]), jnp.int32)
            width = tpu.pad_to(arr.shape[1], tpu.LANES)
            if width != arr.shape[1]:
                arr = jnp.pad(arr, ((0, 0), (0, width - arr.shape[1])))
            if key is not None:
                index[key] = len(fetches)
            arg = argument(("copy", len(fetches)), lambda arr=arr: arr)
            fetches.append(_Fetch(
                array=arg, tail=-1, tail_row=0, dims=(int(arr.shape[0]),), page_size=page,
                rows_per_view_row=1, row_offset=row_offset, aligned=True, slots=fetch_slots,
                pack=1, lanes=width, dtype=jnp.dtype(jnp.int32)))
        if key is not None:
            srcs.append(_Source(index[key], slots, how, n32, e32, 0))
        else:
            srcs.append(_Source(len(fetches) - 1, slots, 0, 0, e32, 0))
    return arrays, tuple(fetches), tuple(srcs)


class _Sem:
    """DMA semaphores."""

    SLOTS = 0  # a slab's slots into SMEM
    OUT = 1  # a slab's digests out
    ROWS = 2  # + buffer: a group's rows, every fetch


def _digest_kernel(n_ref, slots_hbm, *refs, nargs, fetches, srcs):
    nf = len(fetches)
    args_hbm, out_hbm = refs[:nargs], refs[nargs]
    slots_s, out_v, counts, *rest = refs[nargs + 1:]
    bufs, rest = rest[:nf], rest[nf:]
    # Fetches with a partial last group: its words land in a buffer of their own, int32 [8, N].
    tailed = [k for k, f in enumerate(fetches) if f.tail >= 0]
    tail_bufs = dict(zip(tailed, rest))
    sems = rest[len(tailed)]
    n = n_ref[0]
    shape = (GROUP, tpu.LANES)
    sublane = lax.broadcasted_iota(jnp.int32, shape, 0)
    lane = lax.broadcasted_iota(jnp.int32, shape, 1)
    zero = jnp.zeros(shape, jnp.uint32)
    low_half = lane < 64
    # Lane gather that puts a 128-lane chunk's even words (low halves) in lanes 0..63 and its odd
    # words (high halves) in lanes 64..127.
    perm = jnp.where(low_half, 2 * lane, 2 * (lane - 64) + 1)

    def group_row(f: _Fetch, s):
        """The first row of slot ``s``'s group (a scalar)."""
        row = tpu.idiv(s, f.page_size) * f.rows_per_view_row + f.row_offset
        return row if f.aligned else row - tpu.irem(row, f.pack)

    def rows(f: _Fetch, start):
        aligned = f.pack == 1 or isinstance(start, int)
        return pl.ds(start if aligned else pl.multiple_of(start, f.pack), f.pack)

    def window(f: _Fetch, ref, row):
        """Rows ``[row, row + pack)`` of HBM ``ref`` (``row``: a group's first row)."""
        if len(f.dims) == 1:
            return ref.at[rows(f, row)]
        at = tpu.irem(row, f.dims[-1])
        rest = tpu.idiv(row, f.dims[-1])
        lead = []
        for d in reversed(f.dims[1:-1]):
            lead.append(tpu.irem(rest, d))
            rest = tpu.idiv(rest, d)
        return ref.at[(rest, *reversed(lead), rows(f, at))]

    def row_copy(k, row, i, slot, *, tail=False):
        f = fetches[k]
        if tail:  # 4 N bytes, as a group's copy: one wait counts either
            return pltpu.make_async_copy(args_hbm[f.tail].at[pl.ds(0, 1)],
                                         tail_bufs[k].at[slot, pl.ds(i, 1)],
                                         sems.at[_Sem.ROWS + slot])
        return pltpu.make_async_copy(window(f, args_hbm[f.array], row),
                                     bufs[k].at[slot, rows(f, i * f.pack)],
                                     sems.at[_Sem.ROWS + slot])

    def issue(g, slot, n_b):
        for k in range(nf):
            counts[2 * k + slot] = jnp.int32(0)

        def one(i, c):
            e = g * GROUP + i
            s = slots_s[tpu.idiv(e, tpu.LANES), tpu.irem(e, tpu.LANES)]
            live = e < n_b
            for k, f in enumerate(fetches):
                @pl.when(live & (s >= 0) & (s < f.slots))
                def _(k=k, f=f):
                    row = group_row(f, s)
                    if f.tail < 0:
                        row_copy(k, row, i, slot).start()
                    else:  # the partial last group: its words
                        @pl.when(row == f.tail_row)
                        def _():
                            row_copy(k, row, i, slot, tail=True).start()

                        @pl.when(row != f.tail_row)
                        def _():
                            row_copy(k, row, i, slot).start()

                    counts[2 * k + slot] = counts[2 * k + slot] + 1

            return c

        lax.fori_loop(0, GROUP, one, 0)

    def wait(slot):
        for k in range(nf):
            tpu.wait_n(row_copy(k, jnp.int32(0), 0, slot), counts[2 * k + slot])

    def words32(f: _Fetch, ref, shift, tail, t):
        """int32 words ``[t, t + 128)`` (``t`` a multiple of 128) of the rows of the 8 entries
        (sublanes), in lanes 0..127; a narrow type's row is bits ``shift`` up of its group's
        words (``shift``: an int or int32 planes), which come from ``tail`` (the partial last
        group's words, a ref, where the bool planes ``tail[1]`` hold) or else from ``ref``.
        Words past the row are unspecified."""
        if f.pack == 1:
            x = ref[:, pl.ds(t, tpu.LANES)]
            return x if x.dtype == jnp.int32 else lax.bitcast_convert_type(x, jnp.int32)
        bits = 32 // f.pack
        w = tpu.LANES // f.pack  # the words one 128-element load makes
        block = lane >> (w.bit_length() - 1)  # lane // w (w is a power of two)
        # Lane gather: lanes [j w, (j + 1) w) <- element j of each of the load's w words.
        gather = (lane & (w - 1)) * f.pack + block
        out = None
        for k in range(f.pack):  # load k: elements [p t + 128 k, + 128), words [t + k w, + w)
            first = f.pack * t + tpu.LANES * k
            if isinstance(first, int):
                if first >= f.lanes:
                    break
            else:
                first = pl.multiple_of(first, tpu.LANES)
            x = pltpu.bitcast(ref[:, pl.ds(first, tpu.LANES)], jnp.int32)
            if tail is not None:
                x = jnp.where(tail[1], tail[0][:, pl.ds(first, tpu.LANES)], x)
            g = jnp.take_along_axis((x >> shift) & ((1 << bits) - 1), gather, axis=1)
            word = None
            for j in range(f.pack):  # element j of word c of load k: lane j w + c -> k w + c
                d = ((k - j) * w) % tpu.LANES
                part = (pltpu.roll(g, d, 1) if d else g) << (bits * j)
                word = part if word is None else word | part
            out = word if out is None else jnp.where(block == k, word, out)
        return out

    def pair_words(chunk, t, two: bool):
        """(hi, lo) uint32 planes of the 64-bit words in int32 words [t, t + 256) of the rows
        (``two``), or [t, t + 128) (lanes 64.. then hold nothing): the word at int32 word
        ``t + 2 * lane`` in lane ``lane``. ``chunk(t)``: words [t, t + 128)."""
        ga = jnp.take_along_axis(chunk(t), perm, axis=1)
        if not two:
            return tpu.u32(pltpu.roll(ga, 64, 1)), tpu.u32(ga)
        gb = jnp.take_along_axis(chunk(t + tpu.LANES), perm, axis=1)
        lo = jnp.where(low_half, ga, pltpu.roll(gb, 64, 1))
        hi = jnp.where(low_half, pltpu.roll(ga, 64, 1), gb)
        return tpu.u32(hi), tpu.u32(lo)

    def terms(chunk, t, two: bool, j: int, src: _Source, col, row_ok):
        """The masked terms of source ``j``'s words held by int32 words [t, t + 256) (or 128)
        of the rows: each entry's strip starts at ``col`` (int or int32 planes); its word ``q =
        (t - col) / 2 + lane`` counts where ``0 <= q < words``."""
        q = lax.shift_right_arithmetic(t - col, 1) + lane if not isinstance(col, int) \
            else (t - col) // 2 + lane
        m = (q >= 0) & (q < src.words32 // 2)
        if not two:
            m = m & low_half
        hi, lo = pair_words(chunk, t, two)
        words = (jnp.where(row_ok, hi, zero), jnp.where(row_ok, lo, zero))
        salt = hashing_u32.add(hashing_u32.mul_const(hashing_u32.from_i32(q),
                                                     hashing.DIGEST_GAMMA),
                               hashing_u32.const(hashing.digest_salt_int(j, 0), lane))
        th, tl = hashing_u32.splitmix64(hashing_u32.add(words, salt))
        return jnp.where(m, th, zero), jnp.where(m, tl, zero)

    def hash_group(slot, svec, live, shifts, in_tail):
        acc = (zero, zero)
        fetched = [live & (svec >= 0) & (svec < f.slots) for f in fetches]
        for j, src in enumerate(srcs):
            f = fetches[src.fetch]
            shift = (32 // f.pack) * src.sub if src.sub >= 0 else shifts[src.fetch]
            tail = (tail_bufs[src.fetch].at[slot], in_tail[src.fetch] != 0) \
                if f.tail >= 0 else None
            chunk = functools.partial(words32, f, bufs[src.fetch].at[slot], shift, tail)
            row_ok = fetched[src.fetch] & (svec < src.slots)
            if f.page_size == 1:
                col = src.col
            else:  # the slot's place in its page: a plane
                col = src.col + lax.rem(jnp.maximum(svec, 0), f.page_size) * src.stride
            first = src.col - src.col % tpu.LANES
            end = src.col + (f.page_size - 1) * src.stride + src.words32
            starts = list(range(first, end, 2 * tpu.LANES))
            looped = len(starts) - 1 if len(starts) > _UNROLL_PAIRS else 0
            for t in starts[looped:]:
                acc = hashing_u32.add(acc, terms(chunk, t, t + tpu.LANES < end, j, src, col,
                                                 row_ok))
            if looped:
                def pair(c, acc, chunk=chunk, j=j, src=src, col=col, row_ok=row_ok,
                         first=first):
                    t = pl.multiple_of(first + c * (2 * tpu.LANES), tpu.LANES)
                    return hashing_u32.add(acc, terms(chunk, t, True, j, src, col, row_ok))

                acc = lax.fori_loop(0, looped, pair, acc)
        d = 64
        while d:
            acc = hashing_u32.add(acc, (pltpu.roll(acc[0], d, 1), pltpu.roll(acc[1], d, 1)))
            d //= 2
        return acc

    # Fetches whose group offset varies with the slot: each entry's row's place in its group.
    varying = [k for k, f in enumerate(fetches) if not f.aligned]

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
            # Per entry: its row's bits in its group's words, whether the group is the tail
            # (int32 planes: Mosaic carries no masks).
            shifts = {k: jnp.zeros(shape, jnp.int32) for k in varying}
            in_tail = {k: jnp.zeros(shape, jnp.int32) for k in tailed}
            for i in range(GROUP):
                e = g * GROUP + i
                s = slots_s[tpu.idiv(e, tpu.LANES), tpu.irem(e, tpu.LANES)]
                svec = jnp.where(sublane == i, s, svec)
                for k in sorted(set(varying) | set(tailed)):
                    f = fetches[k]
                    row = tpu.idiv(jnp.maximum(s, 0), f.page_size) * f.rows_per_view_row + \
                        f.row_offset
                    if k in shifts:
                        shifts[k] = jnp.where(sublane == i,
                                              tpu.irem(row, f.pack) * (32 // f.pack), shifts[k])
                    if k in in_tail:
                        first = row if f.aligned else row - tpu.irem(row, f.pack)
                        in_tail[k] = jnp.where(sublane == i, (first == f.tail_row).astype(
                            jnp.int32), in_tail[k])
            live = g * GROUP + sublane < n_b
            hi, lo = hash_group(slot, svec, live, shifts, in_tail)
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
    arrays, fetches, srcs = _operands(sources)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    words = sum(s.words32 for s in srcs) // 2
    out = tpu.call(
        functools.partial(_digest_kernel, nargs=len(arrays), fetches=fetches, srcs=srcs),
        n_live.astype(jnp.int32).reshape(1), rows, *arrays,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(1,), in_specs=[any_spec] * (1 + len(arrays)),
            out_specs=any_spec,
            scratch_shapes=[
                pltpu.SMEM((8, tpu.LANES), jnp.int32),
                pltpu.VMEM((2, GROUP, tpu.LANES), jnp.int32),
                pltpu.SMEM((2 * len(fetches),), jnp.int32),
                *(pltpu.VMEM((2, GROUP * f.pack, f.lanes), f.dtype) for f in fetches),
                *(pltpu.VMEM((2, GROUP, f.lanes), jnp.int32) for f in fetches if f.tail >= 0),
                pltpu.SemaphoreType.DMA((_Sem.ROWS + 2,)),
            ]),
        out_shape=jax.ShapeDtypeStruct((nslabs, 2, GROUP, tpu.LANES), jnp.int32),
        compiler_params=tpu.compiler_params(config.vmem_limit_bytes),
        # A group of p rows of N elements is 4 N bytes.
        cost_estimate=tpu.cost(bytes_accessed=n * (4 + 8 + 4 * sum(f.lanes for f in fetches)),
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
