"""The KV digest as Pallas kernels (Triton lowering on CUDA GPUs; interpret mode too).

Semantics and bounds: :mod:`kvcanary_jax.ops.digest.base`.

Parallel shape. A slot's digest is a sum of independent terms, one per word of its sources'
strips. Take a slot's words in order (source 0's ``read_words``, then source 1's, ...) and cut
that sequence into *groups* of :class:`Config` ``group_words`` consecutive words (0: one group);
a group may hold several narrow sources, or part of a wide one (:func:`groups`). The sum mod
2**64 is associative, so a slot's digest is the sum of its groups' partial sums, in any order
(int64 wrapping adds). With ``spread``, each group of a block of slots is its own program and a
finishing kernel adds the partials: a call with few slots then issues its loads from many SMs at
once instead of one program walking every strip in turn. Without it, a program loops over its
slots' groups (a loop, not unrolled code: only one group's loads are in flight, which bounds the
registers; unrolled, the compiler hoists every load of a slot and spills).

Inside a program each source segment of a group is read as ``[block, width]`` tiles (``width``
= ``lanes``, or the segment's words rounded up to a power of two when fewer), rows being
contiguous runs of a slot's strip (coalesced; a strip that starts on an even word is hinted as
such, so that a thread may load 16 bytes at once). A group's tiles are loaded before any is
hashed (a GPU issues in order and stalls at a load's first use; ``unroll`` tiles a step where a
long segment loops over its tiles); their terms are added elementwise into one ``[block,
width]`` accumulator per tile width, reduced once at the end (a reduction across warps costs a
shared-memory round and barriers). A group's code is static (the sources' specs are), so a
program reaches its group's code through branches on its group index.

* write: spread, grid ``(slot blocks x groups)``: programs store partials ``[groups, n]`` and a
  second kernel (``finish`` slots a program) sums each entry's partials in group order and
  stores them. Otherwise (or with one group) grid ``(slot blocks)``, each program storing its
  slots' digests (one kernel). Both store into ``digest_buf`` in place; duplicate slots store
  the same bytes: every entry's digest is the same sum taken in the same order.
* verify: the selection is part of the kernels. A program scans a chunk of ``entries``
  consecutive entries (``e < clamp(num_valid)``, ``0 < slot < num_slots``, ``slot % window ==
  phase mod window``), ranks its selected entries with a prefix sum over the chunk, and hashes
  them ``block`` at a time, in entry order (with ``entries == block``, the block is the chunk).
  With ``share`` > 1, ``share`` programs scan the same chunk and split its selected entries
  into as many runs of consecutive ranks, one each: a chunk's selected entries are hashed one
  after another by a program, so the kernel takes as long as the chunk with the most, and where
  one request's slots all share a residue (a page-size-1 allocator handing a batch of 64 its
  slots a step at a time, window 64) a phase selects a run of adjacent entries.
  The work follows the selected entries, not the capacity, without a compaction pass: the grid
  is static (from the capacity) and a chunk without a selected entry costs one scan of its
  slots. The heuristics' chunks hold a quarter of a selected entry on average where few slots
  are expected, four where a thousand or more are (shared among 4 or 8 programs there).
  Not spread (or one group): the program hashes every group of its entries, compares with the
  stored digests and records the mismatches (one kernel). Spread: grid ``(chunks x groups x
  share)``,
  programs store partials ``[groups, capacity]`` at their selected entries, and a finishing
  kernel over chunks of ``finish`` entries selects again, sums the partials, compares and
  records (two kernels).
  Records: each block of compared entries claims its rows with one claim under the ring guard
  (:func:`kvcanary_jax.ops._kernel_lib.claim_rows`): rows keep entry order within a block; the
  order across blocks is the atomics' (in interpret mode, where programs run in order, entry
  order). ``slot_run_counter`` takes one atomic add per chunk (its selected count, added by the
  chunk's first program), ``kernel_run_counter`` is bumped by program 0.

Why a static grid rather than a persistent one striding over blocks of compacted entries up to a
count read on the device: the selection is made where the entries are scanned, so no count
exists before the hashing kernel starts, and a program's loads then follow straight from its own
chunk (one round trip for the slot ids, one for the strips); a persistent program would chain
its blocks' round trips one after another, which is the latency a small verify cannot afford.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Mapping, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kvcanary_jax import consts, hashing
from kvcanary_jax.context import DigestContext, SourceSpec, as_words
from kvcanary_jax.ops import _kernel_lib
from kvcanary_jax.ops._kernel_lib import append_rows, claim_rows
from kvcanary_jax.ops.digest import base

__all__ = ["Config", "heuristics", "run", "Segment", "groups", "GROUP_WORDS", "MIN_GROUP_WORDS",
           "VERIFY_GROUPS", "WIDE_GROUP_WORDS", "LOOP_GROUP_WORDS", "WHOLE_SLOTS_AT",
           "SPREAD_SLOTS_AT"]

# Launch defaults (bench/NOTES.md, "the KV digest's kernels", has the predictions behind them and
# the measurements that set them). A slot of the benchmark's model (32 layers of a fused 8 x 128
# bf16 K/V row) is 16,384 words, one 512-word strip a layer. A call with few slots (a write's
# entries, a verify's expected selected entries) spreads each slot over programs: a write in
# groups of GROUP_WORDS (16 KiB: a decode step's 8 new tokens are 64 programs; a slot of at most
# that many words is one group, and the write one kernel), a verify in at most VERIFY_GROUPS
# groups of at least MIN_GROUP_WORDS (each group is a branch of its own code: 32 of them made the
# programs stall on instruction fetch; fewer than 4 left too few programs for its few slots),
# WIDE_GROUP_WORDS from SPREAD_SLOTS_AT slots. From WHOLE_SLOTS_AT a program hashes whole slots
# (one kernel, no partials), looping over groups of LOOP_GROUP_WORDS (16 KiB of loads in flight a
# program).
GROUP_WORDS = 2048
MIN_GROUP_WORDS = 512
VERIFY_GROUPS = 8
WIDE_GROUP_WORDS = 4096
LOOP_GROUP_WORDS = 2048
SPREAD_SLOTS_AT = 1024
WHOLE_SLOTS_AT = 4096
# A verify of few expected slots: a program scans a chunk of about a window over CHUNKS_A_WINDOW
# entries (its selected entries are hashed one after another, so the kernel takes as long as its
# chunk with the most: chunks of a window, about one expected each, held up to four), and a
# slot of at most ONE_KERNEL_WORDS is hashed whole by one program of ONE_KERNEL_WARPS warps
# (one kernel: no partials, no finishing kernel).
CHUNKS_A_WINDOW = 4
ONE_KERNEL_WORDS = 2048
ONE_KERNEL_WARPS = 8
# Programs a verify chunk's selected entries are split among (``Config.share``): a chunk's
# entries are hashed one after another, and a phase may select a run of adjacent ones (one
# request's slots handed out a step at a time with a stride of the window share its residue).
# The H100 sweep (bench/NOTES.md, "a chunk's selected entries shared among programs"): at 64 x
# 2,048 entries and window 64, 4 layers (one group), 32 adjacent selected entries 44.8 -> 8.6 us
# with 8 shares and the 2,048 of every read slot 25.2 -> 19.0; 32 layers (4 groups) 66.5 ->
# 23.2 and 110.9 -> 110.5 with 4 (8 and more lose: programs that only scan); 8 x 512, 4 layers,
# one kernel: 4.4 -> 3.5 with 2.
SHARE_ONE_GROUP = 8
SHARE_GROUPS = 4
SHARE_FEW = 2
LANES = 512
UNROLL = 4
FINISH = 128
NUM_WARPS = 4
NUM_STAGES = 1
# A chunk of more than this many entries costs registers (its slots, ranks and the match of a
# block against them) for no gain: the scan is already short against a strip's hash.
MAX_ENTRIES = 1024
# Partial sums loaded at once by a finishing program (more groups loop over batches of this).
PARTIALS_AT_ONCE = 32
# A segment with at least this many batches of ``unroll`` tiles loops over them; fewer are
# unrolled (and batched with the group's other segments).
LOOP_BATCHES = 2


def _pow2(n: int) -> bool:
    return n >= 1 and not n & (n - 1)


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclasses.dataclass(frozen=True)
class Config:
    """Launch parameters (results do not depend on them):

    * ``block``: slots (write) or selected entries (verify) a program hashes at once;
    * ``group_words``: words of a slot hashed by one program step (0: all of them);
    * ``spread``: several groups go to separate programs, whose partials a finishing kernel sums
      (two kernels); else a program loops over a slot's groups (one kernel);
    * ``lanes``: words of a strip per tile row; ``unroll``: tiles loaded before any is hashed
      where a segment loops over its tiles;
    * ``entries``: entries a verify program scans (a multiple of ``block``);
    * ``share``: programs a verify chunk's selected entries are split among (each scans the
      chunk and hashes one run of consecutive ranks);
    * ``finish``: entries (slots) per program of the finishing kernel;
    * ``num_warps``, ``num_stages``: Triton's.

    ``block``, ``lanes``, ``entries``, ``finish`` and ``share`` are powers of two.
    ``interpret``: Pallas interpret mode (any backend; what ``pallas_interpret`` runs)."""

    block: int = 1
    group_words: int = GROUP_WORDS
    spread: bool = True
    lanes: int = LANES
    unroll: int = UNROLL
    entries: int = 64
    finish: int = FINISH
    num_warps: int = NUM_WARPS
    num_stages: int = NUM_STAGES
    share: int = 1
    interpret: bool = False

    def __post_init__(self):
        _kernel_lib.check_interpret("digest", self.interpret)
        ok = all(_pow2(v) for v in (self.block, self.lanes, self.entries, self.finish,
                                    self.share)) and \
            self.entries >= self.block and self.unroll >= 1 and self.group_words >= 0 and \
            isinstance(self.spread, bool) and self.num_warps >= 1 and self.num_stages >= 1
        if not ok:
            raise ValueError(
                f"kv-canary digest: bad launch parameters block={self.block} lanes={self.lanes} "
                f"entries={self.entries} finish={self.finish} share={self.share} "
                f"(powers of two, entries >= block) unroll={self.unroll} "
                f"group_words={self.group_words} (>= 0) spread={self.spread!r} (a bool) "
                f"num_warps={self.num_warps} num_stages={self.num_stages} (>= 1)")


def _entries_for(size: int, block: int) -> int:
    """A chunk of about ``size`` entries: a power of two, at least ``block``, at most
    :data:`MAX_ENTRIES` (with slots spread evenly over the phases, a chunk of ``size`` entries
    holds ``size / window`` selected entries on average)."""
    return min(MAX_ENTRIES, max(block, _pow2_at_least(size)))


def heuristics(shapes: Mapping[str, int]) -> Config:
    """By the number of slots a call hashes (a write's entries; a verify's expected selected
    entries, capacity / window): a few are spread over programs in groups of
    :data:`GROUP_WORDS` (a write) or in at most :data:`VERIFY_GROUPS` of at least
    :data:`MIN_GROUP_WORDS` (a verify; two kernels; a slot of at most :data:`ONE_KERNEL_WORDS`
    is hashed whole by one program of :data:`ONE_KERNEL_WARPS` warps instead, one kernel), more
    in groups of :data:`WIDE_GROUP_WORDS`, and from :data:`WHOLE_SLOTS_AT` a program hashes
    whole slots (one kernel). A verify hashes its selected entries one at a time (``block`` 1:
    a block's rows are hashed whether selected or not); its chunk is about ``window`` /
    :data:`CHUNKS_A_WINDOW` entries with few slots (a quarter of an entry expected a chunk),
    four windows from :data:`SPREAD_SLOTS_AT` slots (fewer programs, each scanning more), and
    its chunks' selected entries split among :data:`SHARE_ONE_GROUP` programs (a slot of one
    group) or :data:`SHARE_GROUPS` (several) there, :data:`SHARE_FEW` where a narrow slot is
    hashed whole with few expected."""
    if shapes["verify"]:
        window = shapes["window"]
        expected = shapes["capacity"] // window
    else:
        window, expected = 1, shapes["capacity"]
    if expected >= WHOLE_SLOTS_AT:
        return Config(block=1, group_words=LOOP_GROUP_WORDS, spread=False,
                      entries=_entries_for(window, 1))
    if expected >= SPREAD_SLOTS_AT:
        if not shapes["verify"]:
            return Config(block=1, group_words=WIDE_GROUP_WORDS, entries=1)
        share = SHARE_ONE_GROUP if shapes["words"] <= WIDE_GROUP_WORDS else SHARE_GROUPS
        return Config(block=1, group_words=WIDE_GROUP_WORDS, entries=_entries_for(4 * window, 1),
                      share=share)
    if not shapes["verify"]:
        return Config(block=1, group_words=GROUP_WORDS, entries=_entries_for(window, 1))
    entries = _entries_for(max(1, window // CHUNKS_A_WINDOW), 1)
    if shapes["words"] <= ONE_KERNEL_WORDS:
        return Config(block=1, group_words=0, spread=False, entries=entries,
                      num_warps=ONE_KERNEL_WARPS, share=SHARE_FEW)
    words = max(MIN_GROUP_WORDS, _pow2_at_least(-(-shapes["words"] // VERIFY_GROUPS)))
    return Config(block=1, group_words=words, entries=entries)


# ---------------------------------------------------------------------------------------------
# Groups of a slot's words.


class Segment(NamedTuple):
    """Words ``[first, first + words)`` of source ``source``'s strip (its salt index), read from
    kernel argument ``buffer`` as ``spec`` addresses it."""

    source: int
    buffer: int
    spec: SourceSpec
    first: int
    words: int


def groups(specs, group_words: int) -> tuple[tuple[Segment, ...], ...]:
    """The sources' words (``specs``: ``(buffer, SourceSpec)`` per source, in order) cut into
    groups of ``group_words`` consecutive words (0: one group; the last may be shorter). Always at
    least one group (an empty one when no source has a word)."""
    out, cur, used = [], [], 0
    for j, (b, spec) in enumerate(specs):
        first = 0
        while first < spec.read_words:
            room = spec.read_words - first
            take = room if not group_words else min(room, group_words - used)
            cur.append(Segment(j, b, spec, first, take))
            first += take
            used += take
            if group_words and used == group_words:
                out.append(tuple(cur))
                cur, used = [], 0
    if cur or not out:
        out.append(tuple(cur))
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# Hashing a group of a block of slots.


class _Strip(NamedTuple):
    """Where a block's strips of one source start (``start``, int words of the buffer; 0 where
    ``row_ok`` is off), the buffer and its index dtype."""

    ref: object
    idt: object
    start: object
    row_ok: object
    source: int


def _strip(slot, ok, ref, seg: Segment) -> _Strip:
    spec = seg.spec
    idt = _kernel_lib.index_dtype(ref.shape[0])
    s = jnp.where(ok, slot, 0).astype(jnp.int64)  # >= 0 from here: truncating = floor division
    if spec.page_size == 1:
        row, in_page = s, None
    else:
        row = jax.lax.div(s, jnp.int64(spec.page_size))
        in_page = s - row * spec.page_size
    row_ok = ok & (row < spec.num_rows)
    start = spec.word_offset + row * spec.row_stride_words
    if in_page is not None:
        start = start + in_page * spec.nbpt_words
    start = jnp.where(row_ok, start + seg.first, 0).astype(idt)
    if (spec.word_offset + seg.first) % 2 == 0 and spec.row_stride_words % 2 == 0 and \
            (spec.page_size == 1 or spec.nbpt_words % 2 == 0):
        # Every strip starts on an even word (16 bytes): lets a thread load two words at once.
        start = pl.multiple_of(start, 2)
    return _Strip(ref, idt, start, row_ok, seg.source)


def _load_tile(st: _Strip, first, width: int, count: int, num_rows: int):
    """Tile of words ``[first, first + width)`` of the segment (``count`` of them in the strip):
    ``(index within the source's strip (int32 [width]), in-strip mask or None, words [block,
    width])``. Masked lanes read nothing (and rows past the source's rows read zero words)."""
    lane = jnp.arange(width, dtype=jnp.int32)
    rel = first + lane
    in_strip = lane < count if count < width else None
    block = st.start.shape[0]
    if num_rows == 0:
        return rel, in_strip, jnp.zeros((block, width), jnp.int64)
    off = rel if in_strip is None else jnp.where(in_strip, rel, 0)
    at = st.start[:, None] + off.astype(st.idt)[None, :]
    mask = st.row_ok[:, None] & (True if in_strip is None else in_strip[None, :])
    mask = jnp.broadcast_to(mask, (block, width))
    return rel, in_strip, plt.load(st.ref.at[at], mask=mask, other=0)


def _hash_tiles(loaded, accs):
    """Adds the terms of ``loaded`` tiles (``(strip, seg first, tile, ...)``) to ``accs`` (width ->
    ``[block, width]`` int64)."""
    accs = dict(accs)
    for st, seg_first, (rel, in_strip, words) in loaded:
        index = (rel + seg_first).astype(jnp.int64)[None, :]
        term = hashing.digest_term(words, st.source, index)
        if in_strip is not None:
            term = jnp.where(in_strip[None, :], term, 0)
        width = words.shape[1]
        accs[width] = term if width not in accs else accs[width] + term
    return accs


def _group_partial(slot, ok, refs, segs, *, lanes: int, unroll: int):
    """int64 ``[block]``: the sum of the terms of ``segs``' words of ``slot`` (meaningful where
    ``ok``). Tiles are loaded ``unroll`` at a time before they are hashed; a segment with many
    tiles loops over its batches."""
    block = slot.shape[0]
    accs = {}
    pending = []  # (strip, segment, tile's first word in the segment, width, count), unrolled
    for seg in segs:
        st = _strip(slot, ok, refs[seg.buffer], seg)
        width = min(lanes, _pow2_at_least(seg.words))
        full, rest = divmod(seg.words, width)
        batches = full // unroll
        done = 0
        if batches >= LOOP_BATCHES:

            def batch(c, acc, st=st, seg=seg, width=width):
                loaded = [(st, seg.first, _load_tile(st, (c * unroll + u) * width, width, width,
                                                     seg.spec.num_rows))
                          for u in range(unroll)]
                return _hash_tiles(loaded, {width: acc})[width]

            init = accs.get(width, jnp.zeros((block, width), jnp.int64))
            accs[width] = jax.lax.fori_loop(0, batches, batch, init)
            done = batches * unroll
        pending += [(st, seg, t * width, width, width) for t in range(done, full)]
        if rest:
            pending.append((st, seg, full * width, width, rest))
    for k in range(0, len(pending), unroll):
        loaded = [(st, seg.first, _load_tile(st, first, width, count, seg.spec.num_rows))
                  for st, seg, first, width, count in pending[k:k + unroll]]
        accs = _hash_tiles(loaded, accs)
    total = jnp.zeros((block,), jnp.int64)
    for acc in accs.values():
        total = total + jnp.sum(acc, axis=1)
    return total


def _switch(i, fns, lo: int = 0):
    """``fns[i - lo]()`` for a traced ``i``: a balanced tree of two-way branches (a group's code
    is static, so a program reaches its group's code through branches)."""
    if len(fns) == 1:
        return fns[0]()
    mid = len(fns) // 2
    return jax.lax.cond(i < lo + mid, lambda: _switch(i, fns[:mid], lo),
                        lambda: _switch(i, fns[mid:], lo + mid))


def _slot_partial(slot, ok, refs, group_list, *, lanes: int, unroll: int):
    """int64 ``[block]``: the digests of ``slot`` (meaningful where ``ok``), its groups hashed one
    after another by a loop: a group's loads are issued together and the next group's only after
    them, which bounds the words in flight (and the registers) by ``group_words`` (unrolled, the
    compiler hoists every load of a slot and spills)."""
    part = functools.partial(_group_partial, slot, ok, refs, lanes=lanes, unroll=unroll)
    if len(group_list) == 1:
        return part(group_list[0])
    fns = [functools.partial(part, segs) for segs in group_list]
    return jax.lax.fori_loop(0, len(fns), lambda gi, acc: acc + _switch(gi, fns),
                             jnp.zeros(slot.shape, jnp.int64))


def _by_group(g, group_list, body):
    """``body(index, segments)`` for the program's group ``g`` (a traced int32): one branch per
    group (a group's code is static)."""
    if len(group_list) == 1:
        body(0, group_list[0])
        return
    for gi, segs in enumerate(group_list):
        pl.when(g == gi)(functools.partial(body, gi, segs))


def _split_program(num_groups: int, share: int = 1):
    """``(block or chunk index, group index, share index)`` of this program (programs of one
    block are adjacent: they share its slots in the caches; a chunk's shares come in order, so
    that interpret mode, running programs in order, records in entry order)."""
    p, g, r = pl.program_id(0), jnp.int32(0), jnp.int32(0)
    if share > 1:
        p, r = jax.lax.div(p, jnp.int32(share)), jax.lax.rem(p, jnp.int32(share))
    if num_groups > 1:
        p, g = jax.lax.div(p, jnp.int32(num_groups)), jax.lax.rem(p, jnp.int32(num_groups))
    return p, g, r


def _sum_partials(part_ref, k, n: int, num_groups: int, mask):
    """int64: ``sum over g of part_ref[g * n + k]`` where ``mask`` (partials ``[groups, n]``
    flat), in group order; loads :data:`PARTIALS_AT_ONCE` groups at a time."""
    idt = _kernel_lib.index_dtype(num_groups * n + 1)
    k = jnp.where(mask, k, 0).astype(idt)

    def some(first, count, acc):
        vals = [plt.load(part_ref.at[k + (first + g) * n], mask=mask, other=0)
                for g in range(count)]
        for v in vals:
            acc = acc + v
        return acc

    acc = jnp.zeros(k.shape, jnp.int64)
    full, rest = divmod(num_groups, PARTIALS_AT_ONCE)
    if full == 1:
        acc = some(0, PARTIALS_AT_ONCE, acc)
    elif full > 1:
        acc = jax.lax.fori_loop(
            0, full, lambda c, a: some((c * PARTIALS_AT_ONCE).astype(idt), PARTIALS_AT_ONCE, a),
            acc)
    if rest:
        acc = some(full * PARTIALS_AT_ONCE, rest, acc)
    return acc


# ---------------------------------------------------------------------------------------------
# Write.


def _slots_at(slots_ref, k, in_plan):
    """``slots[k]`` as int64 where ``in_plan`` holds (-1 elsewhere): a write's slots are int32
    or int64 (the array-level write takes both), widened as they are loaded."""
    slot = plt.load(slots_ref.at[jnp.where(in_plan, k, 0)], mask=in_plan, other=-1)
    return slot.astype(jnp.int64)


def _write_kernel(slots_ref, *refs, group_list, nbuf, num_slots, block, lanes, unroll):
    """One program a block of slots, every group: the digests, stored."""
    srcs, out = refs[:nbuf], refs[nbuf + 1]  # refs[nbuf]: digest_buf in (aliased to out)
    n = slots_ref.shape[0]
    k = pl.program_id(0) * block + jnp.arange(block, dtype=jnp.int32)
    in_plan = k < n
    slot = _slots_at(slots_ref, k, in_plan)
    ok = in_plan & (slot >= 0) & (slot < num_slots)
    d = _slot_partial(slot, ok, srcs, group_list, lanes=lanes, unroll=unroll)
    _kernel_lib.scatter(out, slot, d, ok)


def _write_partials_kernel(slots_ref, *refs, group_list, nbuf, num_slots, block, lanes, unroll):
    """One program a block of slots and a group: the group's partials."""
    srcs, out = refs[:nbuf], refs[nbuf]
    n = slots_ref.shape[0]
    b, g, _ = _split_program(len(group_list))
    k = b * block + jnp.arange(block, dtype=jnp.int32)
    in_plan = k < n
    slot = _slots_at(slots_ref, k, in_plan)
    ok = in_plan & (slot >= 0) & (slot < num_slots)

    def body(gi, segs):
        d = _group_partial(slot, ok, srcs, segs, lanes=lanes, unroll=unroll)
        _kernel_lib.scatter(out, k.astype(jnp.int64) + gi * n, d, ok)

    _by_group(g, group_list, body)


def _write_finish_kernel(slots_ref, part_ref, digest_in, digest_out, *, num_groups, num_slots,
                         finish):
    del digest_in  # aliased to digest_out
    n = slots_ref.shape[0]
    k = pl.program_id(0) * finish + jnp.arange(finish, dtype=jnp.int32)
    in_plan = k < n
    slot = _slots_at(slots_ref, k, in_plan)
    ok = in_plan & (slot >= 0) & (slot < num_slots)
    _kernel_lib.scatter(digest_out, slot, _sum_partials(part_ref, k, n, num_groups, ok), ok)


def _params(config: Config):
    return None if config.interpret else _kernel_lib.compiler_params(config.num_warps,
                                                                       config.num_stages)


def write(digest_buf, slots, sources: base.BoundSources, *, config: Config):
    nbuf = len(sources.buffers)
    n = slots.shape[0]
    group_list = groups(sources.specs, config.group_words)
    args = dict(group_list=group_list, nbuf=nbuf, num_slots=digest_buf.shape[0],
                block=config.block, lanes=config.lanes, unroll=config.unroll)
    ins = [slots, *(as_words(b) for b in sources.buffers)]
    blocks = pl.cdiv(n, config.block)
    if not (config.spread and len(group_list) > 1):
        return pl.pallas_call(
            functools.partial(_write_kernel, **args),
            out_shape=jax.ShapeDtypeStruct(digest_buf.shape, digest_buf.dtype),
            grid=(blocks,), input_output_aliases={len(ins): 0}, interpret=config.interpret,
            compiler_params=_params(config), name="kvcanary_digest_write",
        )(*ins, digest_buf)
    partials = pl.pallas_call(
        functools.partial(_write_partials_kernel, **args),
        out_shape=jax.ShapeDtypeStruct((len(group_list) * n,), jnp.int64),
        grid=(blocks * len(group_list),), interpret=config.interpret,
        compiler_params=_params(config), name="kvcanary_digest_write_partials",
    )(*ins)
    finish = functools.partial(_write_finish_kernel, num_groups=len(group_list),
                               num_slots=digest_buf.shape[0], finish=config.finish)
    return pl.pallas_call(
        finish, out_shape=jax.ShapeDtypeStruct(digest_buf.shape, digest_buf.dtype),
        grid=(pl.cdiv(n, config.finish),), input_output_aliases={2: 0},
        interpret=config.interpret, compiler_params=_params(config),
        name="kvcanary_digest_write_finish",
    )(slots, partials, digest_buf)


# ---------------------------------------------------------------------------------------------
# Verify.


def _select(slots_ref, nv_ref, phase_ref, first, size: int, *, window: int, num_slots: int):
    """Entries ``[first, first + size)``: ``(e (int32), slot (int64), selected)``; the selection
    of :func:`kvcanary_jax.ops.digest.base.selection`."""
    cap = slots_ref.shape[0]
    e = first + jnp.arange(size, dtype=jnp.int32)
    in_cap = e < cap
    slot = plt.load(slots_ref.at[jnp.where(in_cap, e, 0)], mask=in_cap, other=0)
    active = jnp.clip(nv_ref[0], 0, cap)
    sel = (e < active) & (slot > consts.TOKEN_TO_KV_SLOT_PADDING) & (slot < num_slots)
    if window > 1:
        # floor mod: in [0, window); int64, as a static window may pass 2**31
        phase = jnp.remainder(phase_ref[0].astype(jnp.int64), jnp.int64(window))
        s = jnp.where(sel, slot, 0)  # >= 0: truncating remainder = floor
        rem = s & (window - 1) if _pow2(window) else jax.lax.rem(s, jnp.int64(window))
        sel = sel & (rem == phase)
    return e, slot, sel


def _count(sctr, flags):
    """``slot_run_counter += sum(flags)`` (one atomic add, none for 0)."""
    count = jnp.sum(flags)

    @pl.when(count > 0)
    def _add():
        plt.atomic_add(sctr, jnp.int32(0), count.astype(jnp.int64))


def _record(digest_ref, pos_ref, ring, widx, e, slot, live, d, *, kind, ring_cap, most):
    """Compares the digests ``d`` of entries ``e`` (where ``live``) with the stored ones and
    appends the mismatches' rows, in entry order, under one claim."""
    i64 = jnp.int64
    stored = _kernel_lib.gather(digest_ref, slot, live)
    viol = live & (stored != d)
    flags = viol.astype(jnp.int32)
    total = jnp.sum(flags, dtype=jnp.int32)

    @pl.when(total > 0)
    def _append():
        n = e.shape[0]
        pos = _kernel_lib.gather(pos_ref, e, viol)
        w0 = claim_rows(widx, total, most)
        rel = jnp.cumsum(flags, dtype=jnp.int32) - flags
        zero = jnp.zeros((n,), i64)
        append_rows(ring, w0, rel, viol, ring_cap, (
            jnp.full((n,), kind, i64), slot, pos, zero, zero, stored, d,
            jnp.full((n,), consts.KV_DIGEST_MISMATCH, i64)))


def _blocks_of_chunk(e, slot, sel, block: int, visit, *, share: int = 1, r=None):
    """``visit(entries, slots, live)`` for the selected entries of a chunk, ``block`` at a time
    in entry order (a prefix sum ranks them; a block gathers its ranks' entries). With ``share``
    > 1, only share ``r`` of them: the ranks ``[r * q, (r + 1) * q)``, ``q`` = the count over
    ``share`` rounded up."""
    size = e.shape[0]
    if size == block:
        go = jnp.sum(sel.astype(jnp.int32)) > 0
        if share > 1:
            go = go & (r == 0)

        @pl.when(go)
        def _one():
            visit(e, slot, sel)
        return
    flags = sel.astype(jnp.int32)
    rank = jnp.cumsum(flags, dtype=jnp.int32) - flags
    count = jnp.sum(flags, dtype=jnp.int32)
    lo, hi = jnp.int32(0), count
    if share > 1:
        q = (count + (share - 1)) // share
        lo = jnp.minimum(r * q, count)
        hi = jnp.minimum(lo + q, count)

    def trip(t, carry):
        k = lo + t * block + jnp.arange(block, dtype=jnp.int32)
        match = sel[None, :] & (rank[None, :] == k[:, None])
        ent = jnp.sum(jnp.where(match, e[None, :], 0), axis=1, dtype=jnp.int32)
        picked = jnp.sum(jnp.where(match, slot[None, :], 0), axis=1, dtype=jnp.int64)
        visit(ent, picked, k < hi)
        return carry

    jax.lax.fori_loop(0, (hi - lo + (block - 1)) // block, trip, 0)


def _verify_kernel(slots_ref, pos_ref, nv_ref, phase_ref, digest_ref, *refs, group_list, nbuf,
                   kind, ring_cap, window, num_slots, block, entries, lanes, unroll, share):
    """One program a chunk (a share of it), every group: select, hash, compare, record."""
    srcs = refs[:nbuf]
    ring, widx, sctr, kctr = refs[nbuf + 4:]
    cap = slots_ref.shape[0]
    c, _, r = _split_program(1, share)

    @pl.when(pl.program_id(0) == 0)
    def _launch():
        kctr[0] = kctr[0] + 1

    e, slot, sel = _select(slots_ref, nv_ref, phase_ref, c * entries, entries, window=window,
                           num_slots=num_slots)
    if share > 1:
        pl.when(r == 0)(lambda: _count(sctr, sel.astype(jnp.int32)))
    else:
        _count(sctr, sel.astype(jnp.int32))

    def visit(ent, picked, live):
        d = _slot_partial(picked, live, srcs, group_list, lanes=lanes, unroll=unroll)
        _record(digest_ref, pos_ref, ring, widx, ent, picked, live, d, kind=kind,
                ring_cap=ring_cap, most=cap)

    _blocks_of_chunk(e, slot, sel, block, visit, share=share, r=r)


def _verify_partials_kernel(slots_ref, nv_ref, phase_ref, *refs, group_list, nbuf, window,
                            num_slots, block, entries, lanes, unroll, share):
    """One program a chunk (a share of it) and a group: the selected entries' partials of the
    group."""
    srcs, part = refs[:nbuf], refs[nbuf]
    cap = slots_ref.shape[0]
    c, g, r = _split_program(len(group_list), share)
    e, slot, sel = _select(slots_ref, nv_ref, phase_ref, c * entries, entries, window=window,
                           num_slots=num_slots)

    def body(gi, segs):
        def visit(ent, picked, live):
            d = _group_partial(picked, live, srcs, segs, lanes=lanes, unroll=unroll)
            _kernel_lib.scatter(part, ent.astype(jnp.int64) + gi * cap, d, live)

        _blocks_of_chunk(e, slot, sel, block, visit, share=share, r=r)

    _by_group(g, group_list, body)


def _verify_finish_kernel(slots_ref, pos_ref, nv_ref, phase_ref, digest_ref, part_ref, *refs,
                          num_groups, kind, ring_cap, window, num_slots, finish):
    """After the partials: select again, sum the partials, compare, record."""
    ring, widx, sctr, kctr = refs[4:]
    q = pl.program_id(0)
    cap = slots_ref.shape[0]

    @pl.when(q == 0)
    def _launch():
        kctr[0] = kctr[0] + 1

    e, slot, sel = _select(slots_ref, nv_ref, phase_ref, q * finish, finish, window=window,
                           num_slots=num_slots)
    flags = sel.astype(jnp.int32)
    _count(sctr, flags)

    @pl.when(jnp.sum(flags) > 0)
    def _check():
        d = _sum_partials(part_ref, e, cap, num_groups, sel)
        _record(digest_ref, pos_ref, ring, widx, e, slot, sel, d, kind=kind, ring_cap=ring_cap,
                most=cap)


def verify(context: DigestContext, slots, positions, num_valid, phase,
           sources: base.BoundSources, *, window: int, config: Config) -> DigestContext:
    nbuf = len(sources.buffers)
    cap = slots.shape[0]
    num_slots = context.digest_buf.shape[0]
    group_list = groups(sources.specs, config.group_words)
    entries = config.entries
    hashing_args = dict(group_list=group_list, nbuf=nbuf, window=window, num_slots=num_slots,
                        block=config.block, entries=entries, lanes=config.lanes,
                        unroll=config.unroll, share=config.share)
    record_args = dict(kind=int(context.kernel_kind), ring_cap=context.violation_ring.shape[0],
                       window=window, num_slots=num_slots)
    words = [as_words(b) for b in sources.buffers]
    # The write index is passed as a scalar: the ring guard's compare-and-swap needs a scalar ref.
    outs = [context.violation_ring.reshape(-1), context.violation_write_index.reshape(()),
            context.slot_run_counter, context.kernel_run_counter]
    out_shape = [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs]
    chunks = pl.cdiv(cap, entries)
    if not (config.spread and len(group_list) > 1):
        ins = [slots, positions, num_valid, phase, context.digest_buf, *words]
        kernel = functools.partial(_verify_kernel, **hashing_args, kind=record_args["kind"],
                                   ring_cap=record_args["ring_cap"])
        name, grid = "kvcanary_digest_verify", (chunks * config.share,)
    else:
        partials = pl.pallas_call(
            functools.partial(_verify_partials_kernel, **hashing_args),
            out_shape=jax.ShapeDtypeStruct((len(group_list) * cap,), jnp.int64),
            grid=(chunks * len(group_list) * config.share,), interpret=config.interpret,
            compiler_params=_params(config), name="kvcanary_digest_verify_partials",
        )(slots, num_valid, phase, *words)
        ins = [slots, positions, num_valid, phase, context.digest_buf, partials]
        kernel = functools.partial(_verify_finish_kernel, num_groups=len(group_list),
                                   finish=config.finish, **record_args)
        name, grid = "kvcanary_digest_verify_finish", (pl.cdiv(cap, config.finish),)
    ring, widx, sctr, kctr = pl.pallas_call(
        kernel, out_shape=out_shape, grid=grid,
        input_output_aliases={len(ins) + j: j for j in range(len(outs))},
        interpret=config.interpret, compiler_params=_params(config), name=name,
    )(*ins, *outs)
    return context.replace(violation_ring=ring.reshape(context.violation_ring.shape),
                           violation_write_index=widx.reshape(1), slot_run_counter=sctr,
                           kernel_run_counter=kctr)


_FUNCTIONS = {"write": write, "verify": verify}


def run(function: str, *args, config: Config, **kwargs):
    """``function`` (``"write"`` or ``"verify"``) of this implementation."""
    return _FUNCTIONS[function](*args, config=config, **kwargs)
