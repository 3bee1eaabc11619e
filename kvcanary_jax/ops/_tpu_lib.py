"""Building blocks of the Mosaic TPU kernels (implementation ``"pallas_mosaic_tpu"``).

Mosaic TPU has no 64-bit types, no atomics, no general gather and no cumsum. The kernels work
around each with the pieces below. They import this one module (``from kvcanary_jax.ops import
_tpu_lib as tpu``), which re-exports the two parts kept in modules of their own:

* :mod:`kvcanary_jax.ops._tpu_formats`: the formats at the kernel boundary (pair rows, canary
  tiles, the ring's words, real-KV strips) and their constants (:data:`LANES`,
  :data:`PAIR_TILE`, the slot and tile sizes), built and read back by the wrappers outside the
  kernels;
* :mod:`kvcanary_jax.ops._tpu_launch`: the ``pallas_call`` plumbing (:func:`call`,
  :func:`compiler_params`, :func:`cost`), the launch configs (:class:`Config`,
  :class:`BlockConfig`), TPU interpret mode (:func:`interpret_params`) and the lowering for a TPU
  on a machine without one (:func:`tpu_lowering`).

What is here runs inside the kernels, except the status words' two ends outside them:

**The boundary formats, in a kernel**: :func:`planes` splits a block of pair rows in VMEM into
lane-dense planes ``[R, 128]`` of high and low words (:func:`store_planes` writes them back,
:func:`smem_pair` reads one entry from SMEM); :func:`tile_window` is a canary tile's HBM window,
:func:`tile_words` a fetched tile as int32 words, and :func:`select_tiles` picks entries' slots out
of gathered tiles (:func:`fetch_places` says where each entry's tile lands). A verify or write
launch's scalars (the plan's count and switch, the ring's write index, the two run counters) are
the :class:`Status` words, int32 ``[8]`` in SMEM, in and out (:func:`status_words`,
:func:`finish_status`, :func:`from_status`).

**Gathers by slot**: the scalar unit reads a block's slots from SMEM and issues one row DMA per
entry (``[1, W]`` windows at a dynamic row, the layout every TPU DMA engine takes) into a VMEM
block ``[R, 128, W]``; :func:`rows_to_planes` turns it into ``W`` lane-dense planes with two
transposes (minor, then major-minor). The DMAs of block ``b + 1`` are in flight while block ``b``
is checked (double buffering).

**No atomics**: a kernel runs its blocks in order on one core and appends violations with
:class:`Ring`: rows in launch order starting at the launch's write index ``w0``, the ring guard of
docs/spec.md §14.1 (``w0 < 0``: nothing written, index unchanged; rows only below capacity; the
new index saturates at ``2**31 - 1``). A block's violating entries are found in entry order by
repeated min-reductions, so no prefix sum is needed.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kvcanary_jax import consts
from kvcanary_jax import hashing_u32
from kvcanary_jax.ops._tpu_formats import (
    LANES,
    PAIR_TILE,
    SLOT_BYTES,
    SLOT_WORDS,
    TILE_SLOTS,
    canary_from_tiles,
    canary_tiles,
    flat_words32,
    from_pair_rows,
    from_words32,
    i64_words,
    pad_to,
    source_strips,
    strip_words,
    to_pair_rows,
    words32,
)
from kvcanary_jax.ops._tpu_launch import (
    BlockConfig,
    Config,
    call,
    compiler_params,
    cost,
    interpret_params,
    tpu_lowering,
)

__all__ = [
    "Config",
    "BlockConfig",
    "PAIR_TILE",
    "LANES",
    "INT32_MAX",
    "RING_STAGE",
    "pad_to",
    "to_pair_rows",
    "from_pair_rows",
    "words32",
    "from_words32",
    "SLOT_WORDS",
    "SLOT_BYTES",
    "TILE_SLOTS",
    "canary_tiles",
    "canary_from_tiles",
    "tile_window",
    "tile_words",
    "select_tiles",
    "lane_prefix_count",
    "fetch_places",
    "i64_words",
    "Status",
    "STATUS_WORDS",
    "status_words",
    "finish_status",
    "from_status",
    "source_strips",
    "flat_words32",
    "strip_words",
    "idiv",
    "irem",
    "u32",
    "i32",
    "planes",
    "store_planes",
    "smem_pair",
    "rows_to_planes",
    "shift_one",
    "entry_index",
    "sum_scalar",
    "min_scalar",
    "pair_in_range",
    "pair_neg_in_range",
    "pair_is_zero",
    "pair_clamp",
    "Ring",
    "record_words",
    "pipeline",
    "wait_n",
    "call",
    "compiler_params",
    "cost",
    "interpret_params",
    "tpu_lowering",
]

INT32_MAX = consts.VIOLATION_WRITE_INDEX_MAX  # where the write index saturates
# The scratch :class:`Ring` stages a record in: one ring row (16 int32 words), exactly.
RING_STAGE = (1, 16)


# ---------------------------------------------------------------------------------------------
# The boundary formats in a kernel: canary tiles and the status words (pair rows: planes, below).


def tile_window(canary, tile):
    """The HBM window of canary tile ``tile`` (an int32 scalar) in a canary tiles ref: its first
    32 rows (a slot's fields; a wider slot's other bytes are never read), 128 lanes at a
    128-aligned offset, which Mosaic DMAs (a 4 KiB block of whole tiles)."""
    return canary.at[pl.ds(0, SLOT_BYTES), pl.ds(pl.multiple_of(tile * TILE_SLOTS, TILE_SLOTS),
                                                  TILE_SLOTS)]


def tile_words(tile_ref):
    """A uint8 ``[32, 128]`` tile ref in VMEM -> int32 ``[8, 128]``: word ``w`` of its slot
    ``l`` at ``[w, l]`` (4 bytes of a slot are one word of the packed uint8 layout)."""
    return pltpu.bitcast(tile_ref[...], jnp.int32)


def select_tiles(tiles, n, place, lane):
    """The 8 words of 128 entries' slots out of the tiles they were gathered into.

    ``tiles``: a uint8 ``[k, 32, 128]`` VMEM ref, of which the first ``n`` (an int32 scalar)
    were fetched; ``place``, ``lane``: int32 ``[1, 128]``, entry ``e``'s slot is slot
    ``lane[e]`` of tile ``place[e]``. Returns int32 ``[8, 128]``: word ``w`` of entry ``e``'s
    slot at ``[w, e]`` (0 for an entry whose place is not below ``n``). Per fetched tile: a
    lane gather moves each entry's slot to the entry's lane, and the entries of that tile keep
    it (a vector carried in the loop, int32: Mosaic cannot carry masks)."""
    at = jnp.broadcast_to(lane, (SLOT_WORDS, LANES))
    mine = jnp.broadcast_to(place, (SLOT_WORDS, LANES))

    def one(k, acc):
        words = jnp.take_along_axis(tile_words(tiles.at[k]), at, axis=1)
        return jnp.where(mine == k, words, acc)

    return lax.fori_loop(0, n, one, jnp.zeros((SLOT_WORDS, LANES), jnp.int32))


def lane_prefix_count(x):
    """Inclusive prefix sums of int32 planes ``[R, 128]`` along each plane row (its 128 lanes),
    in 7 roll-and-add steps (Mosaic has no cumsum)."""
    lane = lax.broadcasted_iota(jnp.int32, x.shape, 1)
    d = 1
    while d < LANES:
        x = x + jnp.where(lane >= d, pltpu.roll(x, d, 1), 0)
        d *= 2
    return x


def fetch_places(tile, fetch):
    """Where each entry's tile lands when a slab of 128 entries fetches its slots' tiles in
    entry order, an entry skipping the fetch when the previous entry fetched the same tile (the
    rule the kernels' scalar issue loops follow). ``tile``: int32 planes ``[R, 128]``;
    ``fetch``: bool planes, the entries that read a slot. Returns int32 planes: the entry's
    place among its slab's fetched tiles (0 where not ``fetch``)."""
    lane = lax.broadcasted_iota(jnp.int32, tile.shape, 1)
    f = fetch.astype(jnp.int32)
    same = (lane > 0) & (pltpu.roll(f, 1, 1) == 1) & (pltpu.roll(tile, 1, 1) == tile)
    new = jnp.where(same, 0, f)
    return jnp.maximum(lane_prefix_count(new) - 1, 0)


class Status(enum.IntEnum):
    """The status words of a verify or write launch: int32 ``[STATUS_WORDS]`` in SMEM, in (scalar
    prefetch, built by :func:`status_words`) and out (written by :func:`finish_status`, read back
    by :func:`from_status`). A 64-bit counter takes two words, low then high."""

    NUM_VALID = 0  # the plan's count (verify_num_valid / write_num_valid_reqs), passed through
    ENABLE = 1  # the plan's enable (verify) / enable_chain_position_assert (write), passed through
    WRITE_INDEX = 2  # violation_write_index: in, the launch's start index; out, the new index
    SLOT_RUNS = 3  # slot_run_counter (two words)
    KERNEL_RUNS = 5  # kernel_run_counter (two words)
    PAD = 7  # zero (the vector is 8 words)


STATUS_WORDS = 8


def status_words(num_valid, enable, context) -> jax.Array:
    """The :class:`Status` words a verify or write kernel starts from: ``num_valid`` and
    ``enable`` (``[1]`` arrays) and ``context``'s ring guard state."""
    return jnp.concatenate([num_valid.astype(jnp.int32).reshape(1),
                            enable.astype(jnp.int32).reshape(1),
                            context.violation_write_index.astype(jnp.int32).reshape(1),
                            i64_words(context.slot_run_counter),
                            i64_words(context.kernel_run_counter),
                            jnp.zeros((1,), jnp.int32)])


def finish_status(st_in, st_out, *, ring: "Ring", slot_runs) -> None:
    """In a kernel: the :class:`Status` words out (SMEM ``st_out``) from those in (``st_in``):
    the count and the switch as they came, ``ring``'s new write index, ``slot_run_counter`` plus
    ``slot_runs`` (an int32 scalar) and ``kernel_run_counter`` plus one (64-bit adds on
    pairs)."""

    def add64(at, v):
        lo = u32(st_in[at])
        hi = u32(st_in[at + 1])
        new_hi, new_lo = hashing_u32.add_u32((hi, lo), u32(v))
        st_out[at] = i32(new_lo)
        st_out[at + 1] = i32(new_hi)

    st_out[Status.NUM_VALID] = st_in[Status.NUM_VALID]
    st_out[Status.ENABLE] = st_in[Status.ENABLE]
    st_out[Status.WRITE_INDEX] = ring.new_index()
    add64(Status.SLOT_RUNS, slot_runs)
    add64(Status.KERNEL_RUNS, jnp.int32(1))
    st_out[Status.PAD] = jnp.int32(0)


def from_status(context, status: jax.Array, ring32: jax.Array, **updated):
    """``context`` with what a kernel returned: the ring from its int32 words ``ring32`` (an
    empty ring stays as it is) and the ring guard state from its :class:`Status` words
    ``status``; ``updated``: the kernel's other outputs."""
    ring = context.violation_ring

    def pair(at):
        return lax.bitcast_convert_type(status[at:at + 2], jnp.int64).reshape(1)

    return context.replace(
        violation_ring=from_words32(ring32, ring) if ring.shape[0] else ring,
        violation_write_index=status[Status.WRITE_INDEX:Status.WRITE_INDEX + 1].astype(
            context.violation_write_index.dtype),
        slot_run_counter=pair(Status.SLOT_RUNS),
        kernel_run_counter=pair(Status.KERNEL_RUNS),
        **updated)


# ---------------------------------------------------------------------------------------------
# In-kernel values.


def idiv(x, d: int):
    """``x // d`` for a non-negative int32 ``x`` and a static ``d > 0``. In kernels use this, not
    ``//`` / ``%``: jnp's floor division goes through ``lax.sign``, whose Mosaic lowering builds
    int64 values when 64-bit types are on."""
    return lax.div(x, jnp.asarray(d, jnp.int32).astype(x.dtype) if hasattr(x, "dtype")
                   else jnp.int32(d))


def irem(x, d: int):
    """``x % d`` for a non-negative int32 ``x`` and a static ``d > 0`` (see :func:`idiv`)."""
    return lax.rem(x, jnp.asarray(d, jnp.int32).astype(x.dtype) if hasattr(x, "dtype")
                   else jnp.int32(d))


def u32(x):
    return x.astype(jnp.uint32)


def i32(x):
    return x.astype(jnp.int32)


def planes(ref) -> tuple[jax.Array, jax.Array]:
    """Pair rows ``[2R, 128]`` (a VMEM ref or view) -> ``(hi, lo)`` uint32 planes ``[R, 128]``."""
    r2 = ref.shape[0]
    even = ref[pl.ds(0, r2 // 2, stride=2), :]  # entries 128 i + 0..63
    odd = ref[pl.ds(1, r2 // 2, stride=2), :]  # entries 128 i + 64..127
    lane = lax.broadcasted_iota(jnp.int32, even.shape, 1)
    # lanes 0..63 <- even lanes (low words), 64..127 <- odd lanes (high words)
    perm = jnp.where(lane < 64, 2 * lane, 2 * (lane - 64) + 1)
    eg = jnp.take_along_axis(even, perm, axis=1)
    og = jnp.take_along_axis(odd, perm, axis=1)
    lo = jnp.where(lane < 64, eg, pltpu.roll(og, 64, 1))
    hi = jnp.where(lane < 64, pltpu.roll(eg, 64, 1), og)
    return u32(hi), u32(lo)


def store_planes(ref, hi, lo) -> None:
    """Inverse of :func:`planes`: writes planes ``[R, 128]`` as pair rows ``[2R, 128]``."""
    hi, lo = i32(hi), i32(lo)
    lane = lax.broadcasted_iota(jnp.int32, hi.shape, 1)
    # even rows: lanes 0..63 of lo and hi interleaved; odd rows: lanes 64..127
    eg = jnp.where(lane < 64, lo, pltpu.roll(hi, 64, 1))
    og = jnp.where(lane < 64, pltpu.roll(lo, 64, 1), hi)
    half = lax.shift_right_logical(lane, 1)
    inv = jnp.where((lane & 1) == 0, half, 64 + half)
    r = hi.shape[0]
    ref[pl.ds(0, r, stride=2), :] = jnp.take_along_axis(eg, inv, axis=1)
    ref[pl.ds(1, r, stride=2), :] = jnp.take_along_axis(og, inv, axis=1)


def smem_pair(ref, e):
    """Entry ``e`` of pair rows held in SMEM (a ``[k, 128]`` ref or view): ``(hi, lo)`` uint32
    scalars."""
    row = idiv(e, 64)
    col = 2 * irem(e, 64)
    return u32(ref[row, col + 1]), u32(ref[row, col])


def rows_to_planes(rows) -> list:
    """A gathered block ``[R, 128, W]`` (entry ``e`` at ``[e // 128, e % 128]``) -> ``W`` uint32
    planes ``[R, 128]``, one per word."""
    t = jnp.transpose(rows, (0, 2, 1))  # [R, W, 128]
    t = jnp.transpose(t, (1, 0, 2))  # [W, R, 128]
    return [u32(t[w]) for w in range(rows.shape[2])]


def shift_one(x):
    """Planes shifted by one entry: ``out[e] = x[e - 1]`` (``out[0]`` is ``x``'s last entry)."""
    a = pltpu.roll(x, 1, 1)
    b = pltpu.roll(a, 1, 0)
    lane = lax.broadcasted_iota(jnp.int32, x.shape, 1)
    return jnp.where(lane == 0, b, a)


def entry_index(r: int, base=0):
    """int32 planes ``[r, 128]`` holding ``base + e``."""
    return base + lax.broadcasted_iota(jnp.int32, (r, LANES), 0) * LANES + \
        lax.broadcasted_iota(jnp.int32, (r, LANES), 1)


def sum_scalar(x):
    """Sum of an int32 ``[R, 128]`` value as an int32 scalar. (Mosaic lowers a reduction to a
    scalar through ``jnp.sum`` at lowering time, which yields int64 when the caller has 64-bit
    types on; reducing to a ``[1]`` vector first keeps everything 32-bit.)"""
    return jnp.sum(jnp.sum(x, axis=0)[None, :], axis=1)[0]


def min_scalar(x):
    """Minimum of an int32 ``[R, 128]`` value as an int32 scalar (see :func:`sum_scalar`)."""
    return jnp.min(jnp.min(x, axis=0)[None, :], axis=1)[0]


def pair_in_range(p, n):
    """``0 <= v < n`` for a pair ``v`` and an int ``0 <= n < 2**31``."""
    return (p[0] == jnp.uint32(0)) & (p[1] < jnp.asarray(n, jnp.uint32))


def pair_neg_in_range(p, n: int):
    """``-n <= v < 0`` for a pair ``v`` and a static ``0 <= n < 2**31``."""
    if n == 0:
        return jnp.zeros(jnp.shape(p[0]), jnp.bool_)
    return (p[0] == jnp.uint32(0xFFFFFFFF)) & (p[1] >= jnp.uint32(2**32 - n))


def pair_clamp(p, n: int):
    """A pair read as int64, clamped to ``[0, n]`` (static ``0 <= n < 2**31``), as int32."""
    return i32(jnp.where(hashing_u32.is_neg(p), jnp.uint32(0),
                         jnp.where(pair_in_range(p, n + 1), p[1], jnp.uint32(n))))


def pair_is_zero(p):
    return (p[0] == jnp.uint32(0)) & (p[1] == jnp.uint32(0))


# ---------------------------------------------------------------------------------------------
# The ordered violation append.


class Ring:
    """Appends violation records (8 int64 fields = 16 int32 words) to the ring, in launch order.

    ``state``: the ring's :data:`WORDS` SMEM words (a kernel state's word span,
    :class:`kvcanary_jax.ops._tpu_state.Span`): the launch's start index ``w0`` and the number of
    violations found so far. ``ring``: the ring's int32 ``[C, 16]`` ref (HBM, or VMEM where XLA
    places a small ring); ``stage``: an SMEM ``[1, 16]`` scratch (:data:`RING_STAGE`); ``sem``: a
    DMA semaphore.

    A record is one DMA of the whole stage into one ring row. The stage is exactly one row wide:
    Mosaic refuses a DMA of a window narrower than its buffer's rows unless that window is a
    multiple of 512 bytes ("The contiguous inner slice in the DMA transfer must be divisible by
    512 bytes"), and a record is 64 bytes; whole 16-word rows copy between any memories.
    """

    # the state words
    W0 = 0  # the launch's start index
    COUNT = 1  # violations found so far (appended or not)
    WORDS = 2

    def __init__(self, ring, capacity: int, state, stage, sem):
        self.ring, self.cap, self.state = ring, capacity, state
        self.stage, self.sem = stage, sem

    def start(self, w0) -> None:
        self.state[self.W0] = w0
        self.state[self.COUNT] = jnp.int32(0)

    def _room(self):
        """Rows this launch may still write (0 when ``w0 < 0`` or the ring is full)."""
        w0 = self.state[self.W0]
        count = self.state[self.COUNT]
        free = jnp.where(w0 >= 0, jnp.maximum(self.cap - w0, 0), 0)  # cap - w0: no overflow
        return jnp.maximum(free - count, 0)

    def _write(self, k, words) -> None:
        """Writes ``words`` (16 int32 scalars) as row ``w0 + count + k``."""
        for i, w in enumerate(words):
            self.stage[0, i] = w
        row = self.state[self.W0] + self.state[self.COUNT] + k
        copy = pltpu.make_async_copy(self.stage, self.ring.at[pl.ds(row, 1)], self.sem)
        copy.start()
        copy.wait()

    def append(self, words, when) -> None:
        """Appends one record (16 int32 scalars) when ``when`` (a scalar bool)."""

        @pl.when(when)
        def _():
            @pl.when(self._room() > 0)
            def _row():
                self._write(0, words)

            self.state[self.COUNT] = self.state[self.COUNT] + 1

    def append_block(self, viol, fields, index) -> None:
        """Appends the violating entries of a block in entry order. ``viol``: bool planes;
        ``fields``: 16 int32 planes (the record words); ``index``: int32 planes of distinct
        entry indices, increasing in entry order."""
        n = sum_scalar(viol.astype(jnp.int32))
        big = jnp.int32(INT32_MAX)

        @pl.when(n > 0)
        def _():
            todo = jnp.minimum(n, self._room())

            def one(k, last):
                j = min_scalar(jnp.where(viol & (index > last), index, big))
                at = index == j
                words = [sum_scalar(jnp.where(at, f, 0)) for f in fields]
                self._write(k, words)
                return j

            lax.fori_loop(0, todo, one, jnp.int32(-1))
            self.state[self.COUNT] = self.state[self.COUNT] + n

    def new_index(self):
        """The write index after the launch (unchanged when ``w0 < 0``; saturating)."""
        w0 = self.state[self.W0]
        n = self.state[self.COUNT]
        return jnp.where(w0 < 0, w0, jnp.where(n > INT32_MAX - w0, INT32_MAX, w0 + n))


def record_words(kind, fields) -> list:
    """The 16 int32 words of a record (low word first): ``kind`` (an int32 value, non-negative)
    then seven ``(hi, lo)`` pairs: slot, position, stored token, expected token, stored link,
    expected aux, fail bits."""
    out = [i32(kind), jnp.zeros_like(i32(kind))]
    for hi, lo in fields:
        out += [i32(lo), i32(hi)]
    return out


# ---------------------------------------------------------------------------------------------
# The block pipeline.


def pipeline(nblocks, *, fetch, issue, wait, body) -> None:
    """Runs ``body(b, slot)`` for blocks ``b < nblocks`` with two buffers (``slot = b % 2``).

    ``fetch(b, slot)`` returns the block's bulk copies (started here, waited before ``issue``);
    ``issue(b, slot)`` starts the block's gathers; ``wait(slot)`` waits for them. Block ``b + 1``
    is fetched and its gathers are in flight while block ``b``'s body runs; block ``b + 2``'s
    fetch starts as soon as block ``b``'s buffers are free."""

    @pl.when(nblocks > 0)
    def _prologue():
        for c in fetch(0, 0):
            c.start()
        for c in fetch(0, 0):
            c.wait()
        issue(0, 0)

        @pl.when(nblocks > 1)
        def _():
            for c in fetch(1, 1):
                c.start()

    def step(b, carry):
        slot = irem(b, 2)

        @pl.when(b + 1 < nblocks)
        def _():
            for c in fetch(b + 1, 1 - slot):
                c.wait()
            issue(b + 1, 1 - slot)

        wait(slot)
        body(b, slot)

        @pl.when(b + 2 < nblocks)
        def _():
            for c in fetch(b + 2, slot):
                c.start()

        return carry

    lax.fori_loop(0, nblocks, step, 0)


def wait_n(copy, n) -> None:
    """Waits ``n`` times on ``copy``'s semaphore (``n`` same-sized copies signalled it)."""

    def one(i, c):
        copy.wait()
        return c

    lax.fori_loop(0, n, one, 0)
