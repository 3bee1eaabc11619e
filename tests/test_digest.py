"""The per-slot KV digest (ours, docs/spec.md §16): hand-checked vectors, every implementation
against the numpy oracle of ``_digest_support`` (random sources of every kind, windows, phases,
hostile indices, the ring guard), and single bit flips, which must always be reported."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import kvcanary_jax as kc
from kvcanary_jax import consts, hashing
from kvcanary_jax.contracts import TensorMeta
from kvcanary_jax.ops.digest import base

import _digest_support as ds
import _impls
import _tier
from _impls import with_tpu

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


@pytest.fixture(params=with_tpu("digest"))
def impl(request):
    return request.param


def _cases(impl, fast, long):
    """Fewer cases in TPU interpret mode (hundreds of times slower here)."""
    return _tier.n(1, long) if _impls.tpu_interpreted(impl) else _tier.n(fast, long)


def _write(impl, digest, slots, sources, config=None):
    with jax.enable_x64(True):
        out = kc.digest_write(jnp.asarray(digest, jnp.int64), jnp.asarray(slots, jnp.int64),
                              ds.jax_sources(sources), implementation=impl,
                              config=config or _impls.config("digest", impl))
    return np.asarray(out)


def _verify(impl, st, slots, positions, num_valid, phase, window, sources, config=None):
    with jax.enable_x64(True):
        out = kc.digest_verify(st.context(), jnp.asarray(slots, jnp.int64),
                               jnp.asarray(positions, jnp.int64),
                               jnp.asarray([num_valid], jnp.int32),
                               jnp.asarray([phase], jnp.int32), window=window,
                               sources=ds.jax_sources(sources), implementation=impl,
                               config=config or _impls.config("digest", impl))
    return ds.State.of(out)


def _check_verify(impl, st, slots, positions, num_valid, phase, window, sources, config=None):
    got = _verify(impl, st, slots, positions, num_valid, phase, window, sources, config)
    want, rows = ds.np_verify(st, slots, positions, num_valid, phase, window, sources)
    ds.assert_verified(got, want, st, rows, ordered=_impls.in_reference_order(impl))
    return got, rows


def _state(rng, num_slots, ring_cap, widx=0, kind=9):
    ring = rng.integers(-2**62, 2**62, (ring_cap, 8))  # sentinel rows: untouched ones stay
    return ds.State(np.zeros(num_slots, np.int64), ring, widx, int(rng.integers(0, 99)),
                    int(rng.integers(0, 99)), kind)


# --- the definition: hand-checked vectors, two independent codes -----------------------------

_B = lambda *r: [bytes(range(*x)) for x in r]  # noqa: E731

# (strips per source, digest as u64 hex): docs/spec.md §16.4, computed by hashing.digest_int
# (Python ints) and hashing.digest_np (numpy uint64), which agree.
VECTORS = [
    ([bytes(8)], 0x0),
    ([(1).to_bytes(8, "little") + (2).to_bytes(8, "little")], 0xEDEA4BFB2CA25CB3),
    (_B((0, 16)), 0xC76C4893F5EA4522),
    (_B((0, 16), (16, 32)), 0xCF1F878036052700),
    (_B((0, 32)), 0x0B9719AF44961859),
    ([bytes([1]) + bytes(range(1, 16)), bytes(range(16, 32))], 0x9FF6750C2D9723D9),
    ([bytes(range(8, 16)) + bytes(range(8))], 0x86B248CACD0247C2),
    (_B((16, 32), (0, 16)), 0xF8AAA9E9C5F23C18),
]

SALTS = [((0, 0), 0x0), ((0, 1), 0x9E3779B97F4A7C15), ((1, 0), 0x7F4A7C1500000000),
         ((2, 3), 0xD93B65567DDF743F)]


@pytest.mark.parametrize("strips,want", VECTORS)
def test_worked_examples(strips, want):
    words = [[int.from_bytes(s[i:i + 8], "little") for i in range(0, len(s), 8)] for s in strips]
    assert hashing.to_u64(hashing.digest_int(words)) == want
    got_np = hashing.digest_np([np.frombuffer(s, np.uint8)[None] for s in strips])
    assert hashing.to_u64(int(got_np[0])) == want
    with jax.enable_x64(True):
        total = sum(jnp.sum(hashing.digest_term(jnp.asarray(np.frombuffer(s, "<i8")), j,
                                                jnp.arange(len(s) // 8)))
                    for j, s in enumerate(strips))
        assert hashing.to_u64(int(total)) == want


def test_salts_and_terms_by_hand():
    for (j, i), want in SALTS:
        assert hashing.to_u64(hashing.digest_salt_int(j, i)) == want
        assert want == ((j << 32) + i) * 0x9E3779B97F4A7C15 % 2**64
    # bytes 0..15: the two terms of docs/spec.md §16.4, and their sum
    t0 = hashing.to_u64(hashing.splitmix64_int(0x0706050403020100))
    t1 = hashing.to_u64(hashing.splitmix64_int(0x0F0E0D0C0B0A0908 + 0x9E3779B97F4A7C15))
    assert (t0, t1) == (0x6E068E3B28B76F49, 0x5965BA58CD32D5D9)
    assert (t0 + t1) % 2**64 == 0xC76C4893F5EA4522
    with pytest.raises(ValueError, match="word in"):
        hashing.digest_salt_int(0, 2**32)


def test_a_single_changed_word_always_changes_the_digest():
    """The argument of docs/spec.md §16.2, exhaustively on one word's 64 bits and a sample of
    values: a changed word changes its one term (splitmix64 and the salted add are bijections)."""
    rng = np.random.default_rng(5)
    words = [int(w) for w in rng.integers(0, 2**63, 6)]
    d = hashing.digest_int([words[:3], words[3:]])
    for j, i in [(0, 0), (0, 2), (1, 1)]:
        for bit in range(64):
            changed = [words[:3], words[3:]]
            changed[j] = list(changed[j])
            changed[j][i] ^= 1 << bit
            assert hashing.digest_int(changed) != d, (j, i, bit)


# --- write ---------------------------------------------------------------------------------------


@pytest.mark.fuzz
def test_write_against_numpy(impl):
    """Random sources (plain rows read in part, packed pages of int16 / bf16, a fused layer's
    strided K and V head strips, int64 pages, a source shorter than the slots), random slots with
    duplicates, padding and slots past the buffer; untouched digests stay byte for byte."""
    seed = 4200
    rng = np.random.default_rng(seed)
    for k in _tier.cases("digest write vs numpy", seed, _cases(impl, 4, 40)):
        with _tier.case("digest write vs numpy", seed, k):
            num_slots = int(rng.integers(8, 70))
            sources = ds.random_sources(rng, num_slots, small=_impls.tpu_interpreted(impl))
            slots = rng.integers(-3, num_slots + 3, int(rng.integers(1, 50)))
            before = rng.integers(-2**62, 2**62, num_slots)
            got = _write(impl, before, slots, sources)
            np.testing.assert_array_equal(got, ds.np_write(before, slots, sources))


def test_write_hostile_slots_touch_nothing_else(impl):
    """Slots far outside the buffer, negative ones, duplicates: only valid slots change."""
    rng = np.random.default_rng(7)
    sources = ds.fused(rng, 16, 1, 8)
    slots = [2**62, -2**62, -1, 16, 17, 2**31, 3, 3, 15, 0, INT32_MIN]
    before = rng.integers(-2**62, 2**62, 16)
    got = _write(impl, before, slots, sources)
    np.testing.assert_array_equal(got, ds.np_write(before, slots, sources))
    assert set(np.flatnonzero(got != before)) <= {0, 3, 15}


# --- verify --------------------------------------------------------------------------------------


@pytest.mark.fuzz
def test_verify_against_numpy(impl):
    """Written digests, some corrupted or never written, KV bytes flipped; windows 1, 4 and 64,
    phases in and out of [0, window), num_valid in and past [0, capacity], a ring with sentinel
    rows and a write index inside or past it."""
    seed = 4300
    rng = np.random.default_rng(seed)
    windows = (1, 4, 64)
    for k in _tier.cases("digest verify vs numpy", seed, _cases(impl, 6, 60)):
        window = windows[k % 3]
        with _tier.case("digest verify vs numpy", seed, k, window=window):
            num_slots = int(rng.integers(8, 90))
            sources = ds.random_sources(rng, num_slots, small=_impls.tpu_interpreted(impl))
            ring_cap = int(rng.integers(1, 12))
            st = _state(rng, num_slots, ring_cap, widx=int(rng.integers(0, ring_cap + 2)))
            written = rng.integers(0, num_slots, num_slots)
            st.digest = ds.np_write(st.digest, written, sources)
            for s in rng.integers(0, num_slots, 2):
                st.digest[s] ^= np.int64(1) << np.int64(rng.integers(64))  # bit 63 too
            sources = ds.flip(sources, [ds.random_flip(rng, sources,
                                                       int(rng.integers(1, num_slots - 3)))])
            cap = int(rng.integers(1, 3 * num_slots))
            slots = rng.integers(-2, num_slots + 2, cap)
            positions = rng.integers(-5, 10**6, cap)
            num_valid = int(rng.choice([cap, cap + 5, int(rng.integers(0, cap + 1)), -1]))
            phase = int(rng.integers(-window, 2 * window))
            _check_verify(impl, st, slots, positions, num_valid, phase, window, sources)


HOSTILE = [
    # (slots, num_valid, phase, window, write index, ring capacity)
    ([2**62, -2**62, -1, 0, 40, 41, INT32_MAX, 5, 5, 6], 10, 0, 1, 0, 4),
    ([1, 2, 3, 4, 5, 6, 7], INT32_MAX, 1, 2, 0, 2),  # num_valid past the capacity; ring fills
    ([1, 2, 3, 4, 5, 6, 7], INT32_MIN, 0, 1, 0, 4),  # negative num_valid: nothing
    ([1, 2, 3, 4, 5, 6, 7], 7, -1, 4, 0, 4),  # phase -1: 3 (mod 4)
    ([1, 2, 3, 4, 5, 6, 7], 7, INT32_MAX, 4, 0, 4),  # phase 2**31 - 1: 3
    ([1, 2, 3, 4, 5, 6, 7], 7, 0, 1, -3, 4),  # negative write index: no row, index stays
    ([1, 2, 3, 4, 5, 6, 7], 7, 0, 1, INT32_MAX - 2, 4),  # saturates at 2**31 - 1
    ([1, 2, 3, 4, 5, 6, 7], 7, 0, 1, 3, 4),  # one row lands, the index counts all
    ([1, 2, 3, 4, 5, 6, 7], 7, 0, 1, 9, 4),  # past the capacity: only the index grows
    ([1, 2, 3, 4, 5, 6, 7], 7, 5, 2**31 + 3, 0, 4),  # a window past int32: slot 5 only
]


@pytest.mark.parametrize("case", range(len(HOSTILE)))
def test_verify_hostile_indices_and_the_ring_guard(case, impl):
    """Indices no caller should pass and write indices where the ring guard acts; nothing but the
    rows the guard allows changes (sentinel rows elsewhere, byte for byte)."""
    slots, num_valid, phase, window, widx, ring_cap = HOSTILE[case]
    rng = np.random.default_rng(50 + case)
    sources = ds.fused(rng, 40, 2, 8)[:3] + [ds.NpSource(
        rng.integers(0, 256, (20, 64), dtype=np.uint8), 2, 32, 16)]
    st = _state(rng, 40, ring_cap, widx=widx)
    st.digest = rng.integers(-2**62, 2**62, 40)  # every checked slot mismatches
    positions = rng.integers(0, 10**6, len(slots))
    _, rows = _check_verify(impl, st, slots, positions, num_valid, phase, window, sources)
    assert len(rows) == {0: 3, 1: 4, 2: 0, 3: 2, 4: 2, 9: 1}.get(case, 7)


def test_verify_zero_sizes(impl):
    """No entry, a 0-slot digest buffer: only the launch is counted. A 0-row ring counts its
    violations in the write index. A source of 0 rows reads zero words."""
    rng = np.random.default_rng(8)
    sources = [ds.NpSource(rng.integers(0, 256, (8, 32), dtype=np.uint8), 1, 32, 32)]
    st = _state(rng, 8, 2)
    for slots, digest in (([], np.zeros(8, np.int64)), ([1, 2], np.zeros(0, np.int64))):
        got = _verify(impl, dataclasses.replace(st, digest=digest), slots, slots, 2, 0, 1,
                      sources)
        assert (got.widx, got.sctr, got.kctr) == (st.widx, st.sctr, st.kctr + 1)
        np.testing.assert_array_equal(got.ring, st.ring)
    empty_ring = dataclasses.replace(st, ring=np.zeros((0, 8), np.int64), widx=5)
    got = _verify(impl, empty_ring, [1, 2, 3], [0, 0, 0], 3, 0, 1, sources)
    assert (got.widx, got.sctr, got.ring.shape) == (8, st.sctr + 3, (0, 8))
    no_rows = [ds.NpSource(np.zeros((0, 32), np.uint8), 1, 32, 32)]
    zero = ds.np_write(np.zeros(8, np.int64), [3], no_rows)
    assert zero[3] == hashing.digest_int([[0] * 4])
    np.testing.assert_array_equal(_write(impl, np.zeros(8, np.int64), [3], no_rows), zero)
    np.testing.assert_array_equal(_write(impl, np.ones(8, np.int64), [], sources), np.ones(8))


# --- single bit flips: always reported, and only where the strips are ---------------------------


def _round_trip(impl, rng, num_slots, sources):
    """Every slot written by ``impl`` (checked against numpy), then verified clean."""
    digest = _write(impl, np.zeros(num_slots, np.int64), rng.permutation(num_slots), sources)
    np.testing.assert_array_equal(digest, ds.np_write(np.zeros(num_slots, np.int64),
                                                      range(num_slots), sources))
    st = ds.State(digest, np.zeros((num_slots, 8), np.int64))
    slots = np.arange(num_slots)
    clean = _verify(impl, st, slots, slots, num_slots, 0, 1, sources)
    assert (clean.widx, clean.sctr) == (0, num_slots - 1)  # slot 0 is never checked
    return st, slots


@pytest.mark.fuzz
def test_single_bit_flips_are_always_reported(impl):
    """A clean run reports nothing; then one bit flipped in a random byte of a random source of
    each of many slots (a slot's flip touches one word of one source): window 1 reports exactly
    the flipped slots, with the stored and the recomputed digest; window 4 over its four phases
    reports each flipped slot exactly once, in the phase of its slot."""
    seed = 4400
    rng = np.random.default_rng(seed)
    flips_seen = 0
    for k in _tier.cases("digest bit flips", seed, _cases(impl, 4, 30)):
        with _tier.case("digest bit flips", seed, k):
            num_slots = int(rng.integers(40, 80))
            sources = ds.random_sources(rng, num_slots, small=_impls.tpu_interpreted(impl))
            st, slots = _round_trip(impl, rng, num_slots, sources)
            held = [s for s in range(1, num_slots)
                    if any(s // src.page < src.rows for src in sources)]
            flipped = rng.choice(held, min(48, len(held)), replace=False)
            bad = ds.flip(sources, [ds.random_flip(rng, sources, int(s)) for s in flipped])
            want = dict(zip((int(s) for s in flipped), ds.np_digests(bad, flipped)))
            got = _verify(impl, st, slots, slots, num_slots, 0, 1, bad)
            rows = {int(r[1]): r for r in got.ring[:got.widx]}
            assert got.widx == len(flipped) and set(rows) == set(want)
            for s, r in rows.items():
                assert tuple(r[[0, 2, 3, 4, 7]]) == (0, s, 0, 0, consts.KV_DIGEST_MISMATCH)
                assert (r[5], r[6]) == (st.digest[s], want[s]) and r[5] != r[6]
            flips_seen += len(flipped)
            if _impls.tpu_interpreted(impl):
                continue
            seen = []
            for phase in range(4):
                got = _verify(impl, st, slots, slots, num_slots, phase, 4, bad)
                phase_rows = [int(r[1]) for r in got.ring[:got.widx]]
                assert all(s % 4 == phase for s in phase_rows)
                seen += phase_rows
            assert sorted(seen) == sorted(want)
    assert flips_seen >= _cases(impl, 4, 30) * 36


def test_flips_outside_the_strips_are_not_reported(impl):
    """Bytes of a token past ``read_bytes`` and bytes of a fused layer that no source reads (its
    V strips, when only K is hashed) are not digested; a flipped slot that the phase does not
    select is not reported in that phase, and is in its own."""
    rng = np.random.default_rng(11)
    num_slots = 32
    sources = ds.fused(rng, num_slots, 2, 8, v=False) + [
        ds.NpSource(rng.integers(0, 256, (num_slots, 64), dtype=np.uint8), 1, 64, 32)]
    st, slots = _round_trip(impl, rng, num_slots, sources)
    v_strip = 16  # fused views: K of head h at byte 32 h, V at 32 h + 16 of a 64-byte row
    outside = ds.flip(sources, [(0, 5, v_strip + 3, 1), (1, 9, v_strip, 7), (2, 7, 40, 0)])
    got = _verify(impl, st, slots, slots, num_slots, 0, 1, outside)
    assert got.widx == 0
    inside = ds.flip(sources, [(2, 6, 31, 5)])
    assert _verify(impl, st, slots, slots, num_slots, 3, 4, inside).widx == 0
    got = _verify(impl, st, slots, slots, num_slots, 2, 4, inside)
    assert [int(r[1]) for r in got.ring[:got.widx]] == [6]


# --- launch shapes, the selection, the references ------------------------------------------------


PALLAS_SHAPES = [
    # whole slots, tiles narrower than a strip (a 34-word strip loops over its batches)
    dict(block=1, lanes=16, unroll=1, group_words=0, entries=1),
    # a program looping over a slot's groups (strips cut in the middle)
    dict(block=2, lanes=16, group_words=20, spread=False, entries=32),
    # tiles wider than most strips; a chunk of one block
    dict(block=8, lanes=32, unroll=4, group_words=0, entries=8),
    # groups that cut strips in the middle, chunks of several blocks, finishing chunks smaller
    # than the capacity and not dividing it
    dict(block=2, lanes=8, unroll=2, group_words=24, entries=16, finish=4),
    # several tile widths in a group, an unroll that does not divide the tiles
    dict(block=4, lanes=64, unroll=3, group_words=40, entries=64, finish=16),
    # a chunk's selected entries split among programs, in one kernel and spread (a share left
    # with nothing where a chunk holds fewer than the shares), and a chunk of one block shared
    dict(block=1, lanes=16, group_words=0, entries=16, share=4),
    dict(block=2, lanes=8, unroll=2, group_words=24, entries=16, finish=4, share=8),
    dict(block=8, lanes=32, group_words=0, entries=8, share=2),
]


@pytest.mark.parametrize("impl", _impls.pallas("digest"))
@pytest.mark.parametrize("shape", PALLAS_SHAPES, ids=str)
def test_pallas_launch_shapes(shape, impl):
    """Every way the kernels cut the work: tiles narrower and wider than a strip, groups of a
    slot's words (one kernel, or partials and a finishing kernel), chunks of one or several
    blocks of selected entries, sizes that none of the blocks divides; windows 1, 3 (not a power
    of two) and 4, each phase."""
    from kvcanary_jax.ops.digest.pallas_triton import Config

    rng = np.random.default_rng(13)
    sources = ds.random_sources(rng, 50) + [
        ds.NpSource(rng.integers(0, 256, (50, 272), dtype=np.uint8), 1, 272, 272)]
    cfg = Config(**shape, interpret=impl == "pallas_interpret")
    got = _write(impl, np.zeros(50, np.int64), range(-1, 52), sources, config=cfg)
    np.testing.assert_array_equal(got, ds.np_write(np.zeros(50, np.int64), range(50), sources))
    st = _state(rng, 50, 64)
    st.digest = got.copy()
    st.digest[[3, 20, 41]] += 1
    slots = rng.integers(0, 50, 120)
    for window, phase in ((1, 0), (3, 2), (3, -1), (4, 1)):
        _check_verify(impl, st, slots, slots * 3, 117, phase, window, sources, config=cfg)


@pytest.mark.parametrize("impl", _impls.pallas("digest"))
def test_pallas_many_sources_few_slots(impl):
    """Thirty-three sources (a fused layer's K and V strips of 16 heads and a paged source) over
    four slots, cut into more groups than a finishing program sums at once (one word a group: 66
    groups, each its own program), looped over by one program (groups of 8 words) and in one
    group; duplicate slots store the same value."""
    from kvcanary_jax.ops.digest.pallas_triton import Config

    rng = np.random.default_rng(31)
    sources = ds.fused(rng, 4, 16, 8) + [
        ds.NpSource(rng.integers(0, 256, (2, 64), dtype=np.uint8), 2, 32, 16)]
    assert len(sources) == 33 and sum(s.read for s in sources) == 66 * 8
    slots = [3, 1, -1, 3, 2]
    interpret = impl == "pallas_interpret"
    for cfg in (Config(group_words=1, finish=2, interpret=interpret),
                Config(group_words=8, spread=False, lanes=2, interpret=interpret),
                Config(group_words=0, lanes=2, interpret=interpret)):
        got = _write(impl, np.zeros(4, np.int64), slots, sources, config=cfg)
        np.testing.assert_array_equal(got, ds.np_write(np.zeros(4, np.int64), slots, sources))
        st = _state(rng, 4, 4)
        st.digest = got.copy()
        st.digest[2] ^= 1 << 40
        _check_verify(impl, st, slots, [7, 8, 9, 10, 11], 5, 0, 1, sources, config=cfg)


def test_pallas_groups_by_hand():
    """A slot's words cut into groups: consecutive words, a strip split where a group ends, the
    last group shorter; 0 words a group: one group."""
    from kvcanary_jax.context import SourceSpec
    from kvcanary_jax.ops.digest import pallas_triton as pt

    spec = lambda words: SourceSpec(0, words, 8, 1, words, words)  # noqa: E731
    specs = ((0, spec(3)), (1, spec(5)), (0, spec(2)))
    cut = [[(s.source, s.buffer, s.first, s.words) for s in g] for g in pt.groups(specs, 4)]
    assert cut == [[(0, 0, 0, 3), (1, 1, 0, 1)], [(1, 1, 1, 4)], [(2, 0, 0, 2)]]
    assert [[(s.source, s.first, s.words) for s in g] for g in pt.groups(specs, 0)] == \
        [[(0, 0, 3), (1, 0, 5), (2, 0, 2)]]
    assert len(pt.groups(specs, 1)) == 10 and len(pt.groups(specs, 100)) == 1


def test_pallas_heuristics_spread_few_slots_and_hash_many_whole():
    """A decode step's few new tokens and a sparse verify are spread over programs in groups of
    a slot's words (two kernels); a prefill's thousands of tokens and a dense verify hash whole
    slots a program (one kernel); a verify hashes its selected entries one at a time, its chunk
    a quarter of a window of entries with few slots (a quarter of an entry expected), four
    windows with more; a narrow slot is hashed whole by one program of 8 warps (one kernel); a
    verify's chunk is shared among programs (more where a slot is one group)."""
    from kvcanary_jax.ops.digest import pallas_triton as pt

    def shapes(verify, capacity, window=1):
        return {"verify": verify, "num_slots": 1 << 20, "capacity": capacity, "window": window,
                "words": 16384, "sources": 32, "buffers": 32}

    few = pt.heuristics(shapes(0, 8))
    assert (few.group_words, few.spread) == (pt.GROUP_WORDS, True)
    assert pt.heuristics(shapes(0, 8192)).spread is False
    small = pt.heuristics(shapes(1, 4096, 64))
    assert (small.group_words, small.spread, small.entries, small.block) == (2048, True, 16, 1)
    assert 16384 // small.group_words == pt.VERIFY_GROUPS
    mid = pt.heuristics(dict(shapes(1, 4096, 64), words=4096))
    assert (mid.group_words, mid.spread, mid.entries) == (pt.MIN_GROUP_WORDS, True, 16)
    narrow = pt.heuristics(dict(shapes(1, 4096, 64), words=2048))
    assert (narrow.group_words, narrow.spread, narrow.entries, narrow.num_warps) == (0, False, 16, 8)
    assert (narrow.share, small.share, mid.share) == (pt.SHARE_FEW, 1, 1)
    assert pt.heuristics(dict(shapes(1, 64, 2), words=2048)).entries == 1  # a window under 4
    wide = pt.heuristics(shapes(1, 131072, 64))
    assert (wide.group_words, wide.entries, wide.block) == (pt.WIDE_GROUP_WORDS, 256, 1)
    assert wide.share == pt.SHARE_GROUPS
    assert pt.heuristics(dict(shapes(1, 131072, 64), words=2048)).share == pt.SHARE_ONE_GROUP
    dense = pt.heuristics(shapes(1, 131072, 1))
    assert (dense.spread, dense.entries, dense.block) == (False, 1, 1)
    assert pt.heuristics(shapes(0, 2048)).share == 1 == dense.share


@pytest.mark.parametrize("block", [1, 4])
def test_xla_blocks(block):
    from kvcanary_jax.ops.digest.xla import Config

    rng = np.random.default_rng(17)
    sources = ds.random_sources(rng, 30)
    cfg = Config(block=block)
    got = _write("xla", np.zeros(30, np.int64), rng.integers(-1, 31, 40), sources, config=cfg)
    st = _state(rng, 30, 16)
    st.digest = got
    slots = rng.integers(0, 30, 45)
    _check_verify("xla", st, slots, slots, 41, 1, 2, sources, config=cfg)


@pytest.mark.tpu_interpret
def test_tpu_long_strips_paged_rows_and_shared_operands():
    """The Mosaic kernel's chunk loop (strips of more than four 256-word chunk pairs), pages of 4
    slots of 1 KiB located per entry, fused views sharing one operand, a row width padded to 128
    words, and a slot list longer than one 1,024-entry slab."""
    impl = _impls.TPU
    rng = np.random.default_rng(19)
    n = 1100
    sources = [ds.NpSource(rng.integers(0, 256, (n, 4608), dtype=np.uint8), 1, 4608, 4608),
               ds.NpSource(rng.integers(0, 256, (n // 4, 4096), dtype=np.uint8), 4, 1024, 1024),
               *ds.fused(rng, n, 1, 8)]
    slots = np.concatenate([[-1, n, 0], rng.permutation(n)])
    got = _write(impl, np.zeros(n, np.int64), slots, sources)
    np.testing.assert_array_equal(got, ds.np_write(np.zeros(n, np.int64), slots, sources))


# Every in-place layout of the Mosaic kernel, and a float16 source, which it reads through a
# copy (Mosaic loads no float16).
LAYOUT_SLOTS = 19  # odd, and not a multiple of 4: 2-D sources end in a partial row group
LAYOUTS = sorted(ds.in_place_layouts(np.random.default_rng(0), LAYOUT_SLOTS)) + ["float16 rows"]


def _layout(rng, name):
    if name == "float16 rows":
        return [ds.NpSource(ds._random_bytes(rng, (LAYOUT_SLOTS, 128), np.float16), 1, 256, 256)]
    return ds.in_place_layouts(rng, LAYOUT_SLOTS)[name]


@pytest.mark.tpu_interpret
@pytest.mark.parametrize("layout", LAYOUTS)
def test_mosaic_tpu_every_dtype_and_layout(layout):
    """The Mosaic kernel over each layout it reads in place (row groups of 16- and 8-bit types,
    a partial last group, strips read in part, pages, views at a row offset and stride, fused
    layers of 2, 3 and 5 dimensions) against numpy: a write of hostile and repeated slots, then a
    verify at window 2 that finds the slots whose stored digest is stale."""
    impl = _impls.TPU
    n = LAYOUT_SLOTS
    rng = np.random.default_rng(37)
    sources = _layout(rng, layout)
    slots = np.concatenate([[-1, n, 0], rng.permutation(n), [n - 1, 2, -5]])
    got = _write(impl, np.zeros(n, np.int64), slots, sources)
    np.testing.assert_array_equal(got, ds.np_write(np.zeros(n, np.int64), slots, sources))
    st = _state(rng, n, 8, widx=1)
    st.digest = got.copy()
    st.digest[[3, 6, n - 1]] ^= 1  # stale: found where the phase selects them
    checked = np.concatenate([rng.permutation(n), [n - 1, -1]])
    _check_verify(impl, st, checked, checked * 3, len(checked), 1, 2, sources)


def _small_slice(eqn) -> bool:
    return eqn.primitive.name == "slice" and eqn.outvars[0].aval.shape[0] < 4


def _consumers(jaxpr, var) -> list:
    """The equations that read ``var``, through calls (into the called jaxpr) and same-width
    bitcasts that only small slices read (to those slices; a bitcast read by anything else is
    itself a reader: on a TPU it is a copy)."""
    out = []
    for eqn in jaxpr.eqns:
        for at, v in enumerate(eqn.invars):
            if v is not var:
                continue
            called = None if eqn.primitive.name == "pallas_call" else eqn.params.get("jaxpr")
            if called is not None:
                inner = getattr(called, "jaxpr", called)
                out += _consumers(inner, inner.invars[at])
            elif eqn.primitive.name == "bitcast_convert_type" and \
                    eqn.outvars[0].aval.shape == var.aval.shape:
                sliced = _consumers(jaxpr, eqn.outvars[0])
                out += sliced if all(_small_slice(e) for e in sliced) else [eqn]
            else:
                out.append(eqn)
    return out


@pytest.mark.parametrize("layout", LAYOUTS[:-1])
def test_mosaic_tpu_sources_reach_the_kernel_as_they_are(layout):
    """The Mosaic implementation hands each in-place layout's buffers to its kernel untouched:
    in the traced write and verify, a buffer is read by the kernel and by nothing else, but a
    slice of fewer than 4 rows (a 2-D buffer's partial last row group, its words an operand of
    their own; sliced from a bitcast to unsigned integers, which XLA fuses into the slice).
    Before, XLA bitcast every buffer to int32 rows first (for a 16- or 8-bit buffer a relayout
    the size of the KV on a TPU, every call)."""
    rng = np.random.default_rng(41)
    n = LAYOUT_SLOTS
    with jax.enable_x64(True):
        sources = ds.jax_sources(_layout(rng, layout))
        arrays = tuple({id(s.tensor): s.tensor for s in sources}.values())
        config = _impls.config("digest", _impls.TPU)

        def with_arrays(kv):
            at = {id(a): x for a, x in zip(arrays, kv)}
            return tuple(dataclasses.replace(s, tensor=at[id(s.tensor)]) for s in sources)

        def write(kv):
            return kc.digest_write(jnp.zeros(n, jnp.int64), jnp.arange(n, dtype=jnp.int64),
                                   with_arrays(kv), implementation=_impls.TPU, config=config)

        def verify(kv):
            ctx = kc.DigestContext.allocate(num_slots=n, ring_capacity=4)
            s = jnp.arange(n, dtype=jnp.int64)
            return kc.digest_verify(ctx, s, s, jnp.asarray([n], jnp.int32),
                                    jnp.asarray([0], jnp.int32), window=2,
                                    sources=with_arrays(kv), implementation=_impls.TPU,
                                    config=config)

        for fn in (write, verify):
            closed = jax.make_jaxpr(fn)(arrays)
            for var in closed.jaxpr.invars:
                readers = _consumers(closed.jaxpr, var)
                kinds = [e.primitive.name for e in readers]
                assert "pallas_call" in kinds, (fn.__name__, kinds)
                others = [e for e in readers if e.primitive.name != "pallas_call"]
                assert all(_small_slice(e) for e in others), (fn.__name__, var.aval, kinds)


def test_selection_and_compaction():
    rng = np.random.default_rng(23)
    with jax.enable_x64(True):
        for window in (1, 3, 64):
            slots = rng.integers(-3, 40, 100)
            for num_valid, phase in ((100, 1), (37, -1), (0, 0), (500, 2**31 - 1)):
                sel = base.selection(jnp.asarray(slots), jnp.asarray([num_valid], jnp.int32),
                                     jnp.asarray([phase], jnp.int32), window=window,
                                     num_slots=30)
                e = np.arange(100)
                want = (e < min(num_valid, 100)) & (slots > 0) & (slots < 30) & \
                    (slots % window == phase % window)
                np.testing.assert_array_equal(np.asarray(sel), want)
                order, count = base.compact(sel)
                assert int(count[0]) == want.sum()
                np.testing.assert_array_equal(np.asarray(order)[:want.sum()], np.flatnonzero(want))


@pytest.mark.fuzz
def test_references_against_numpy():
    """The pure-jnp references (the registry's oracle) against the numpy one."""
    seed = 4500
    rng = np.random.default_rng(seed)
    for k in _tier.cases("digest references vs numpy", seed, _tier.n(6, 40)):
        with _tier.case("digest references vs numpy", seed, k):
            num_slots = int(rng.integers(4, 60))
            sources = ds.random_sources(rng, num_slots)
            slots = rng.integers(-2, num_slots + 2, 30)
            with jax.enable_x64(True):
                got = kc.digest_write_reference(jnp.zeros(num_slots, jnp.int64),
                                                jnp.asarray(slots), ds.jax_sources(sources))
            digest = ds.np_write(np.zeros(num_slots, np.int64), slots, sources)
            np.testing.assert_array_equal(np.asarray(got), digest)
            st = _state(rng, num_slots, 8, widx=int(rng.integers(-1, 9)))
            st.digest = digest
            window = (1, 4, 64)[k % 3]
            with jax.enable_x64(True):
                out = kc.digest_verify_reference(
                    st.context(), jnp.asarray(slots), jnp.asarray(slots * 7),
                    jnp.asarray([25], jnp.int32), jnp.asarray([k], jnp.int32), window=window,
                    sources=ds.jax_sources(sources))
            want, rows = ds.np_verify(st, slots, slots * 7, 25, k, window, sources)
            ds.assert_verified(ds.State.of(out), want, st, rows, ordered=True)


def test_views_of_one_buffer_share_one_kernel_argument():
    rng = np.random.default_rng(29)
    with jax.enable_x64(True):
        bound = base.bind_sources(ds.jax_sources(ds.fused(rng, 8, 2, 8)), "digest_write")
    assert len(bound.buffers) == 1 and len(bound.specs) == 4
    assert [spec.word_offset for _, spec in bound.specs] == [0, 2, 4, 6]


# --- bad input -----------------------------------------------------------------------------------


class _Bad:
    """What the bad calls below are made of (built inside the test, under x64)."""

    def __init__(self):
        self.src = kc.RealKvSource(tensor=jnp.zeros((8, 16), jnp.uint8), page_size=1,
                                   num_bytes_per_token=16, read_bytes=16)
        self.ctx = kc.DigestContext.allocate(num_slots=8, ring_capacity=4)

    @staticmethod
    def i64(*shape):
        return jnp.zeros(shape, jnp.int64)

    @staticmethod
    def i32(*shape):
        return jnp.zeros(shape, jnp.int32)

    def w(self, buf=None, slots=None, sources=None):
        return kc.digest_write(self.i64(8) if buf is None else buf,
                               self.i64(3) if slots is None else slots,
                               (self.src,) if sources is None else sources)

    def v(self, ctx=None, slots=None, pos=None, nv=None, ph=None, window=4, sources=None):
        return kc.digest_verify(
            self.ctx if ctx is None else ctx, self.i64(3) if slots is None else slots,
            self.i64(3) if pos is None else pos, self.i32(1) if nv is None else nv,
            self.i32(1) if ph is None else ph, window=window,
            sources=(self.src,) if sources is None else sources)


BAD = [
    (lambda b: b.w(buf=b.i32(8)), TypeError, "digest_write: digest_buf must be int64, got int32"),
    (lambda b: b.w(buf=b.i64(8, 1)), ValueError, "digest_buf must be 1-D, got shape (8, 1)"),
    (lambda b: b.w(slots=b.i64(3, 1)), ValueError, "slots must be 1-D, got shape (3, 1)"),
    (lambda b: b.w(sources=()), ValueError, "sources must hold 1 to 512"),
    (lambda b: b.w(sources=(b.src,) * 513), ValueError, "got 513"),
    (lambda b: b.w(sources=[jnp.zeros(3)]), TypeError, "sources[0] must be a RealKvSource"),
    (lambda b: b.w(sources=b.src), TypeError, "sources must be a tuple"),
    (lambda b: b.v(window=0), ValueError, "window must be >= 1, got 0"),
    (lambda b: b.v(window=2.0), TypeError, "window must be a static int"),
    (lambda b: b.v(pos=b.i64(4)), ValueError, "positions must have the shape of slots (3,)"),
    (lambda b: b.v(ph=b.i32(2)), ValueError, "phase must be of shape (1,), got shape (2,)"),
    (lambda b: b.v(nv=b.i64(1)), TypeError, "num_valid must be int32, got int64"),
    (lambda b: b.v(ctx=b.ctx.replace(violation_ring=b.i64(4, 7))), ValueError,
     "violation_ring must be of shape (ring_capacity, 8)"),
    (lambda b: b.v(ctx=b.src), TypeError, "context must be a DigestContext"),
    (lambda b: kc.DigestContext.allocate(num_slots=4, kernel_kind=-1), TypeError,
     "kernel_kind must be an int in [0, 2**31)"),
]


@pytest.mark.parametrize("case", range(len(BAD)))
def test_bad_input_is_refused_naming_it(case):
    call, exc, msg = BAD[case]
    with jax.enable_x64(True):
        bad = _Bad()
        with pytest.raises(exc) as err:
            call(bad)
    assert msg in str(err.value)


def test_a_source_buffer_shorter_than_its_rows_is_refused():
    view = TensorMeta(shape=(8, 16), dtype="uint8", strides=(16, 1), device=None,
                      framework="jax")
    src = kc.RealKvSource(tensor=jnp.zeros((96,), jnp.uint8), page_size=1,
                          num_bytes_per_token=16, read_bytes=16, view=view)
    with jax.enable_x64(True), pytest.raises(ValueError, match="buffer holds 12 8-byte words "
                                                               "but its rows span 16"):
        kc.digest_write(jnp.zeros(8, jnp.int64), jnp.zeros(2, jnp.int64), (src,))


@pytest.mark.e2e
def test_bench_op_digest_smoke(tmp_path):
    """bench/op_digest.py in its smoke mode (tiny model, any machine): every case runs, is
    correct (a write's digests against numpy's, a verify reports exactly the changed digests)
    and has its timings."""
    import json

    from kvcanary_jax.bench import op_digest

    assert op_digest.main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "digest.json").read_text())["rows"]
    assert len(rows) == len(op_digest.SMOKE_CASES)
    assert all(r["ours_correct"] and r["ours"]["median_us"] > 0 for r in rows)


@pytest.mark.e2e
def test_bench_op_digest_sweep_smoke(tmp_path, capsys):
    """bench/op_digest.py's launch-config sweep in the smoke mode (the Triton kernels in interpret
    mode off a GPU): a config override applies to every case (groups of 8 words: each slot's 16
    spread over two programs), each case runs it and its variants, every one correct, and the best
    per case is printed."""
    import json

    from kvcanary_jax.bench import op_digest

    assert op_digest.main(["--smoke", "--sweep", "--config", "group_words=8,spread=1",
                           "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "digest.json").read_text())["rows"]
    for case in op_digest.SMOKE_CASES:
        mine = [r for r in rows if r["case"] == op_digest._case_name(case)]
        assert len(mine) >= 4 and all(r["ours_correct"] for r in mine)
        assert mine[0]["config"]["group_words"] == 8 and mine[0]["config"]["spread"] is True
        assert len({json.dumps(r["config"], sort_keys=True) for r in mine}) == len(mine)
    assert "best per case:" in capsys.readouterr().out


@pytest.mark.e2e
def test_bench_op_digest_configs_side_by_side_smoke(tmp_path):
    """bench/op_digest.py with ``--config`` given twice (the heuristics' own, then one changed),
    one case kept by ``--cases`` and a model of ``--layers`` layers: that case only, timed with
    both configs in turn, both correct."""
    import json

    from kvcanary_jax.bench import op_digest
    from kvcanary_jax.ops.digest import pallas_triton as pt

    assert op_digest.main(["--smoke", "--cases", "0", "--layers", "3", "--config", "",
                           "--config", "block=2,group_words=8", "--out", str(tmp_path)]) == 0
    got = json.loads((tmp_path / "digest.json").read_text())
    rows = got["rows"]
    case = op_digest.SMOKE_CASES[0]
    model = dict(op_digest.SMOKE_MODEL, layers=3)
    assert got["model"] == model and all(r["layers"] == 3 for r in rows)
    assert [r["case"] for r in rows] == [op_digest._case_name(case)] * 2
    own = pt.heuristics(op_digest.shapes_of(case, model))
    assert rows[0]["config"]["group_words"] == own.group_words
    assert (rows[1]["config"]["block"], rows[1]["config"]["group_words"]) == (2, 8)
    assert all(r["ours_correct"] for r in rows)
