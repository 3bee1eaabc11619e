"""canary_write against SGLang's torch reference (``write_ref``), run on the same inputs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from kvcanary_jax import consts, hashing
from kvcanary_jax.context import RealKvSource, VerifyOrWriteContext
from kvcanary_jax.ops.write import canary_write
from kvcanary_jax.testing import cases

import _canary_support as support
import _impls
import _write_races
import _tier
from _impls import implementations, in_reference_order, lower, pallas, with_tpu

ANCHOR = hashing.ANCHOR_HASH_I64
IMPLS = implementations("write")
# A request longer than the Pallas kernels' default token block spans several blocks.
LONG = 128


@pytest.fixture(params=with_tpu("write"))
def impl(request):
    return request.param


def _w(sgl, st, impl, *, write_offsets, write_seed_slot_indices=None,
       write_num_valid_reqs=None, config=None, real_kv_sources=(), real_kv_hash_mode=0, **case):
    """A write case (no seeds, every request valid unless given) on ``impl`` and SGLang's
    reference, compared (:func:`_assert_write`)."""
    n = len(write_offsets) - 1
    launch = dict(case, write_offsets=write_offsets,
                  write_seed_slot_indices=([-1] * n if write_seed_slot_indices is None
                                           else write_seed_slot_indices),
                  write_num_valid_reqs=n if write_num_valid_reqs is None else write_num_valid_reqs)
    ours, ref = support.run_write(sgl, st, **launch, real_kv_sources=real_kv_sources,
                                  real_kv_hash_mode=real_kv_hash_mode, implementation=impl,
                                  config=config)
    _assert_write(ours, ref, st, impl, launch, real_kv_sources, real_kv_hash_mode, config)
    return ours, ref


def _assert_write(ours, ref, st, impl, launch, sources, mode, config=None):
    """``ours`` against SGLang's ``ref``: exact where the implementation keeps request order;
    on the GPU, where requests race, as an outcome some execution of the launch gives
    (:func:`_write_races.assert_write_outcome`: exact wherever no race reaches), which SGLang's
    must be too."""
    if in_reference_order(impl):
        support.assert_same(ours, ref, st)
    else:
        _write_races.assert_write_outcome(ours, st, launch, sources, mode, config=config)
        _write_races.assert_write_outcome(ref, st, launch, sources, mode, config=config)


# --- the spec's write cases, rebuilt; expectations from the reference --------------------------


def test_anchor_chain_single_request(sgl, impl):
    st = support.State.zeros(8, 4)
    ours, _ = _w(sgl, st, impl, write_offsets=[0, 3], input_ids=[100, 101, 102],
                 positions=[0, 1, 2], out_cache_loc=[1, 2, 3])
    # Hand-checked links (docs/spec.md §2.5): the anchor hash, then mix3(anchor hash, 100, 0).
    assert int(ours.canary_i64[1, 2]) == -2414019407054260458 == ANCHOR
    assert int(ours.canary_i64[2, 2]) == -4923688959175860244
    assert (ours.sctr, ours.kctr) == (3, 1)


def _seeded_state():
    st = support.State.zeros(8, 4)
    st.canary_i64[3] = [77, 2, 12345, 0]
    return st


@pytest.mark.parametrize("positions,cpa", [([3, 4], 1), ([4, 5], 1), ([4, 5], 0), ([3, 3], 1)])
def test_continue_from_seed_and_chain_position_assert(sgl, positions, cpa, impl):
    _w(sgl, _seeded_state(), impl, write_offsets=[0, 2], write_seed_slot_indices=[3],
       input_ids=[5, 6], positions=positions, out_cache_loc=[4, 5],
       enable_chain_position_assert=cpa)


def test_write_input_assert_mismatches(sgl, impl):
    st = _seeded_state()
    _, ref = _w(sgl, st, impl, write_offsets=[0, 3], write_seed_slot_indices=[3],
                input_ids=[5, 6, 7], positions=[3, 4, 9], out_cache_loc=[4, 5, 6],
                enable_write_input_assert=True, expected_input_tokens=[9, 6, 8],
                expected_input_positions=[3, 5, 7])
    assert [int(r[7]) for r in ref.ring[:ref.widx]] == [8, 16, 24, 16]


def test_skip_negative_slots(sgl, impl):
    _w(sgl, _seeded_state(), impl, write_offsets=[0, 4], write_seed_slot_indices=[3],
       input_ids=[5, 6, 7, 8], positions=[3, 99, 4, 5], out_cache_loc=[4, -1, 5, -7])


def test_multi_request_with_padding_and_capacity(sgl, impl):
    _w(sgl, support.State.zeros(16, 4), impl, write_offsets=[0, 2, 2, 5, 5],
       write_seed_slot_indices=[-1, -1, -1, -1], write_num_valid_reqs=3,
       input_ids=[1, 2, 3, 4, 5, 6, 7], positions=[0, 1, 0, 1, 2, 0, 0],
       out_cache_loc=[1, 2, 3, 4, 5, 6, 7])


def _src(rng, num_slots, page, nbpt, read, extra=0, dtype="uint8", pad=0):
    rows = -(-num_slots // page)
    return cases.KvSource(rng.integers(0, 256, (rows, page * nbpt + extra), dtype=np.uint8),
                          page, nbpt, read, dtype, pad)


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_real_kv_sources(sgl, mode, impl):
    rng = np.random.default_rng(mode)
    sources = [_src(rng, 6, 1, 32, 32), _src(rng, 6, 2, 16, 16, extra=16, dtype="bfloat16")]
    ours, _ = _w(sgl, support.State.zeros(6, 3), impl, write_offsets=[0, 3], input_ids=[5, 6, 7],
                 positions=[0, 1, 2], out_cache_loc=[1, 2, 3], real_kv_sources=sources,
                 real_kv_hash_mode=mode)
    assert (ours.canary_i64[1:4, 3] != 0).all() == (mode != 0)


def test_real_kv_long_strips(sgl, impl):
    """Strips of 14 and 34 words (112 and 272 bytes): the kernels fold them in a loop, loading a
    group of words ahead (``_kernel_lib.REAL_KV_PREFETCH``), whole groups and a remainder; the
    fingerprints equal SGLang's word-by-word fold."""
    rng = np.random.default_rng(11)
    sources = [_src(rng, 6, 1, 112, 112), _src(rng, 6, 2, 272, 272, extra=16)]
    ours, _ = _w(sgl, support.State.zeros(6, 3), impl, write_offsets=[0, 3], input_ids=[5, 6, 7],
                 positions=[0, 1, 2], out_cache_loc=[1, 2, 3], real_kv_sources=sources,
                 real_kv_hash_mode=2)
    assert (ours.canary_i64[1:4, 3] != 0).all()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_real_kv_nan_payloads_hash_as_stored_bytes(sgl, dtype, impl):
    """KV bytes that read as NaNs with payloads, signalling or quiet, hash as the bytes they are,
    as in SGLang, which reads bytes (a float conversion may quiet or canonicalize a NaN). Found
    when XLA's CPU elemental emitters changed a bf16 NaN's payload in the ``xla``
    implementation."""
    width = np.dtype(np.uint16 if dtype == "bfloat16" else np.uint32)
    exp = 0x7F80 if dtype == "bfloat16" else 0x7F800000
    quiet = 0x40 if dtype == "bfloat16" else 0x400000
    payloads = np.arange(1, 3 * 2 * 32 // width.itemsize + 1) % (quiet - 1) + 1  # never 0 (inf)
    words = (exp | payloads).astype(width)  # signalling NaNs: the quiet bit is 0
    words[1::3] |= np.array(1 << (8 * width.itemsize - 1), width)  # negative ones
    words[2::3] |= np.array(quiet, width)  # quiet NaNs with payloads
    src = cases.KvSource(words.view(np.uint8).reshape(3, 64), 2, 32, 32, dtype)
    ours, _ = _w(sgl, support.State.zeros(6, 3), impl, write_offsets=[0, 4], input_ids=[5, 6, 7, 8],
                 positions=[0, 1, 2, 3], out_cache_loc=[1, 2, 3, 5], real_kv_sources=[src],
                 real_kv_hash_mode=2)
    assert (ours.canary_i64[[1, 2, 3, 5], 3] != 0).all()


def test_real_kv_hash_of_bytes_0_to_15_is_the_hand_checked_value(sgl, impl):
    src = cases.KvSource(np.arange(16, dtype=np.uint8).reshape(1, 16).repeat(4, 0), 1, 16, 16)
    ours, _ = _w(sgl, support.State.zeros(4, 2), impl, write_offsets=[0, 1], input_ids=[1],
                 positions=[0], out_cache_loc=[2], real_kv_sources=[src], real_kv_hash_mode=2)
    assert int(ours.canary_i64[2, 3]) == -2965813710295743732


def test_ring_overflow(sgl, impl):
    _w(sgl, _seeded_state().copy(), impl, write_offsets=[0, 3], write_seed_slot_indices=[3],
       input_ids=[5, 6, 7], positions=[9, 9, 9], out_cache_loc=[4, 5, 6])
    st = support.State.zeros(8, 1)
    _, ref = _w(sgl, st, impl, write_offsets=[0, 3], write_seed_slot_indices=[0],
                input_ids=[5, 6, 7], positions=[5, 9, 9], out_cache_loc=[4, 5, 6])
    assert ref.widx == 3


@pytest.mark.parametrize("num_valid", [0, -2])
def test_no_valid_requests_only_bumps_kernel_counter(sgl, num_valid, impl):
    _, ref = _w(sgl, support.State.zeros(8, 2), impl, write_offsets=[0, 2],
                write_num_valid_reqs=num_valid, input_ids=[1, 2], positions=[0, 1],
                out_cache_loc=[1, 2])
    assert (ref.sctr, ref.kctr) == (0, 1)


def test_seed_slot_zero_is_a_real_seed(sgl, impl):
    _w(sgl, support.State.zeros(8, 2), impl, write_offsets=[0, 2], write_seed_slot_indices=[0],
       input_ids=[1, 2], positions=[0, 1], out_cache_loc=[1, 2])


def test_wide_slot_stride_keeps_trailing_bytes(sgl, impl):
    st = support.State.zeros(6, 2, stride=48)
    st.canary[:, 32:] = 0xEE
    _w(sgl, st, impl, write_offsets=[0, 2], input_ids=[1, 2], positions=[0, 1],
       out_cache_loc=[1, 2])


def test_empty_batch(sgl, impl):
    _w(sgl, support.State.zeros(8, 2), impl, write_offsets=[0, 0], input_ids=[], positions=[],
       out_cache_loc=[])


# --- sequential semantics inside a request ------------------------------------------------------


@pytest.mark.tpu_races  # the in-flight row writes, in TPU interpret mode
def test_repeated_slots_within_a_request_last_write_wins(sgl, impl):
    rng = np.random.default_rng(7)
    # repeats inside one block and across blocks (pallas: LONG-token blocks; pallas_mosaic_tpu:
    # repeats inside and beyond its window of row writes in flight, in TPU interpret mode)
    n = 3 * LONG + 17 if impl != _impls.TPU else 97
    ocl = rng.integers(1, 40, n)
    ocl[rng.random(n) < 0.1] = -1
    _w(sgl, support.State.zeros(64, 8), impl, write_offsets=[0, n], write_seed_slot_indices=[5],
       input_ids=rng.integers(0, 9, n), positions=np.arange(n) + rng.integers(0, 2, n),
       out_cache_loc=ocl)


@pytest.mark.parametrize("impl", pallas("write"))
def test_repeated_slots_with_four_warps(sgl, impl):
    """``num_warps=4``: the chain's scalar stores still land in token order (Triton issues a
    scalar store from one thread), so a slot repeated inside a request keeps its last row."""
    rng = np.random.default_rng(8)
    n = LONG + 9
    ocl = rng.integers(1, 24, n)
    _w(sgl, support.State.zeros(32, 8), impl, write_offsets=[0, n], write_seed_slot_indices=[3],
       input_ids=rng.integers(0, 9, n), positions=np.arange(n), out_cache_loc=ocl,
       config=_launch(num_warps=4))


@pytest.mark.parametrize("impl", pallas("write"))
@pytest.mark.parametrize("fold_vec", [1, 2, 4])
def test_real_kv_words_loaded_several_at_a_time(sgl, impl, fold_vec):
    """``fold_vec``: the strip's words loaded 1, 2 or 4 at a time (whole tiles and remainders:
    strips of 6, 14 and 34 words); the fingerprints equal SGLang's word-by-word fold."""
    rng = np.random.default_rng(12)
    sources = [_src(rng, 6, 1, 48, 48), _src(rng, 6, 1, 112, 112),
               _src(rng, 6, 2, 272, 272, extra=16)]
    ours, _ = _w(sgl, support.State.zeros(6, 3), impl, write_offsets=[0, 3], input_ids=[5, 6, 7],
                 positions=[0, 1, 2], out_cache_loc=[1, 2, 3], real_kv_sources=sources,
                 real_kv_hash_mode=2, config=_launch(fold_vec=fold_vec))
    assert (ours.canary_i64[1:4, 3] != 0).all()


@pytest.mark.parametrize("impl", pallas("write"))
def test_a_decode_step_takes_the_small_block(sgl, impl):
    """No more tokens than requests (a decode step): the Triton write's heuristics take
    ``SMALL_BLOCK`` tokens a block, whose fingerprints fold on 32 lanes, not 128. A request
    holding most of such a step's tokens spans several small blocks: its chain and fingerprints
    are SGLang's. So does a step of at most ``SMALL_BLOCK`` tokens, whatever its rows."""
    from kvcanary_jax.ops.write import pallas_triton as wpt

    shapes = {"num_slots": 4096, "write_capacity": 64}
    assert wpt.heuristics({**shapes, "num_tokens": 64}).block == wpt.SMALL_BLOCK == 32
    assert wpt.heuristics({**shapes, "num_tokens": 65}).block == wpt.BLOCK
    # A decode step padded to a token bucket above its request rows (tpu-inference pads to 16
    # tokens, 9 rows at bs 8): no request can hold more than 32 tokens, one small block each.
    few = {"num_slots": 4096, "write_capacity": 9}
    assert wpt.heuristics({**few, "num_tokens": 16}).block == wpt.SMALL_BLOCK
    assert wpt.heuristics({**few, "num_tokens": 32}).block == wpt.SMALL_BLOCK
    assert wpt.heuristics({**few, "num_tokens": 33}).block == wpt.BLOCK
    rng = np.random.default_rng(14)
    lens = [70] + [1] * 9 + [0] * 70  # 79 tokens, 80 requests
    offsets = np.concatenate([[0], np.cumsum(lens)])
    n = int(offsets[-1])
    _w(sgl, support.State.zeros(n + 1, 8), impl, write_offsets=offsets,
       input_ids=rng.integers(0, 9, n),
       positions=np.concatenate([np.arange(k) for k in lens]),
       out_cache_loc=rng.permutation(np.arange(1, n + 1)),
       real_kv_sources=[_src(rng, n + 1, 2, 256, 256)], real_kv_hash_mode=2,
       config=_launch(block=wpt.SMALL_BLOCK))


def test_request_rewrites_its_own_seed(sgl, impl):
    st = _seeded_state()
    _w(sgl, st, impl, write_offsets=[0, 3], write_seed_slot_indices=[3], input_ids=[5, 6, 7],
       positions=[3, 4, 5], out_cache_loc=[4, 3, 6])


@pytest.mark.parametrize("impl", pallas("write"))
def test_small_blocks_remainders_and_violations_in_later_blocks(sgl, impl):
    """Block 8, unroll 3: requests of 0, 1, 2, 3, 7, 8, 9 and 29 tokens cover the peeled first
    block, full and remainder trips, several blocks, and violation rows recorded from any block
    (each request is one program: its blocks claim their rows in token order, each block's rows
    in entry order)."""
    rng = np.random.default_rng(9)
    lens = [0, 1, 2, 3, 7, 8, 9, 29]
    n = sum(lens)
    offsets = np.concatenate([[0], np.cumsum(lens)])
    st = support.State.zeros(256, 2 * 59)  # room for every row: exact on any backend
    st.canary_i64[:, :3] = rng.integers(-5, 40, (256, 3))
    pos = rng.integers(0, 40, n)
    for r, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])):
        pos[a:b] = np.arange(b - a) + int(rng.integers(0, 5)) + (rng.random(b - a) < 0.2)
    ocl = np.concatenate([32 * r + 1 + rng.integers(0, 12, k) for r, k in enumerate(lens)])
    ocl[rng.random(n) < 0.1] = -1
    ids = rng.integers(0, 9, n)
    ours, ref = _w(sgl, st, impl, write_offsets=offsets,
                   write_seed_slot_indices=[32 * r for r in range(len(lens))], input_ids=ids,
                   positions=pos, out_cache_loc=ocl, enable_write_input_assert=True,
                   expected_input_tokens=np.where(rng.random(n) < 0.2, 0, ids),
                   expected_input_positions=pos, config=_launch(block=8, unroll=3))
    assert ref.widx > 10


@pytest.mark.parametrize("impl", pallas("write"))
def test_blocks_of_written_tokens_and_blocks_with_a_skipped_one(sgl, impl):
    """Block 8, unroll 3. A block of at least 3 tokens, all in bounds and all written, takes the
    Triton write's fast chain (no per-token checks; the position check on the block's vectors,
    its first lane against the block before's last token); a block with a skipped token takes
    the general one. Request 0's five blocks: clean; a position gap mid-block; a skipped slot;
    a first token that does not follow the block before's last; a slot repeated (the last
    write wins). Request 1 skips its third token; request 2 is a partial block whose first
    position does not follow its seed's."""
    rng = np.random.default_rng(15)
    lens = [40, 5, 6]
    n = sum(lens)
    offsets = np.concatenate([[0], np.cumsum(lens)])
    pos0 = np.arange(40) + 6  # the seed, slot 60, holds position 5
    pos0[12:] += 1  # block 1: a gap between tokens 11 and 12
    pos0[24:] += 3  # block 3: its first token does not follow token 23
    slots0 = rng.permutation(np.arange(1, 41))
    slots0[19] = -1  # block 2: a skipped token
    slots0[36] = slots0[33]  # block 4: a slot written twice
    slots = np.concatenate([slots0, [41, 42, -1, 43, 44], [45, 46, 47, 48, 49, 50]])
    pos = np.concatenate([pos0, np.arange(5), np.arange(6) + 9])
    st = support.State.zeros(64, 2 * n)
    st.canary_i64[60, :3] = [3, 5, 77]
    st.canary_i64[61, :3] = [4, 7, 78]  # request 2's seed: position 7, its first token 9
    ours, ref = _w(sgl, st, impl, write_offsets=offsets,
                   write_seed_slot_indices=[60, -1, 61], input_ids=rng.integers(0, 9, n),
                   positions=pos, out_cache_loc=slots, config=_launch(block=8, unroll=3))
    rows = ref.ring[:ref.widx]
    # Each break's position and the one expected: the gap at token 12, token 20 after the
    # skipped token 19, token 24 after token 23, request 2 after its seed (request 1 has no seed,
    # so no position check).
    assert rows[:, 2].tolist() == [19, 27, 34, 9] and rows[:, 6].tolist() == [18, 26, 31, 8]


def test_zero_capacity_still_bumps_kernel_counter(sgl, impl):
    _, ref = _w(sgl, support.State.zeros(8, 2), impl, write_offsets=[0], write_seed_slot_indices=[],
                write_num_valid_reqs=1, input_ids=[1, 2], positions=[0, 1], out_cache_loc=[1, 2])
    assert (ref.sctr, ref.kctr) == (0, 1)


@pytest.mark.slow
def test_long_chain(sgl, impl):
    rng = np.random.default_rng(8)
    n = 4096
    _w(sgl, support.State.zeros(n + 1, 8), impl, write_offsets=[0, n], write_seed_slot_indices=[-1],
       input_ids=rng.integers(0, 9, n), positions=np.arange(n),
       out_cache_loc=rng.permutation(np.arange(1, n + 1)),
       real_kv_sources=[_src(rng, n + 1, 2, 32, 32)], real_kv_hash_mode=2)


# --- fuzz: random launches with violations, against the reference --------------------------------

# (stride, input assert, hash mode, sources layout as in cases.BUCKETS)
WRITE_BUCKETS = (
    (32, True, 0, ()),
    (48, False, 2, cases.BUCKETS[1].sources),
    (32, True, 1, cases.BUCKETS[2].sources),
    (32, False, 2, cases.BUCKETS[0].sources),
)
CASES_PER_BUCKET = _tier.n(15, 500)


def _launch(**kw):
    """A launch config of the Pallas kernel (its module imported where it is tested)."""
    from kvcanary_jax.ops.write.pallas_triton import Config

    return Config(**kw)


# The reference, xla and interpret mode run the requests one after another, as SGLang's
# reference does, so their results are compared exactly, cross-request hazards included. On the
# GPU (pallas_triton) requests run concurrently: a slot written by two requests, a seed another
# request writes, and which rows of several requests land in a full ring are unspecified there
# (as in SGLang's kernel).


def _check_launch(sgl, st, launch, sources, mode, impl):
    """Ours against SGLang's reference (:func:`_assert_write`); returns SGLang's result."""
    ours, ref = support.run_write(sgl, st, **launch, real_kv_sources=sources,
                                  real_kv_hash_mode=mode, implementation=impl)
    _assert_write(ours, ref, st, impl, launch, sources, mode)
    return ref


@pytest.mark.fuzz
@pytest.mark.parametrize("impl", IMPLS)  # pallas_mosaic_tpu: test_tpu_fuzz below
@pytest.mark.parametrize("bucket", range(len(WRITE_BUCKETS)))
def test_write_fuzz(sgl, bucket, impl):
    stride, assert_on, mode, layout = WRITE_BUCKETS[bucket]
    seed = 300 + bucket
    rng = np.random.default_rng(seed)
    rows = overflows = 0
    for i in _tier.cases(f"write fuzz, bucket {bucket}", seed, CASES_PER_BUCKET):
        st = support.State.zeros(cases.NUM_SLOTS, cases.RING_CAP, stride)
        st.canary_i64[:] = rng.integers(-(2**63), 2**63 - 1, st.canary_i64.shape,
                                        dtype=np.int64)
        st.canary_i64[:, 1] = rng.integers(-2, 30, cases.NUM_SLOTS)
        st.widx = int(rng.integers(0, cases.RING_CAP + 4))
        filled = min(st.widx, cases.RING_CAP)
        st.ring[:filled] = rng.integers(-9, 9, (filled, 8))
        st.sctr, st.kctr = (int(x) for x in rng.integers(0, 100, 2))
        # kernel_kind is static (one compile per tag): one tag per bucket.
        launch = cases.random_write_launch(rng, assert_on, kernel_kind=(2, 8, 5, 11)[bucket],
                                           hazards=True)
        with _tier.case("write fuzz", seed, i, bucket=bucket, implementation=impl):
            ref = _check_launch(sgl, st, launch, cases.bucket_sources(rng, layout), mode, impl)
        rows += ref.widx - st.widx
        overflows += support.rows_dropped(st, ref)
    assert rows > 0  # the fuzz does exercise the violation paths
    if CASES_PER_BUCKET >= 100:  # often, and the full ring (the fast tier's few cases may not)
        assert rows > CASES_PER_BUCKET // 2 and overflows > CASES_PER_BUCKET // 20


@pytest.mark.fuzz
def test_write_fuzz_against_jnp_reference(impl):
    """Every implementation against the pure-jnp reference (no SGLang needed), cross-request
    hazards included: exact where the implementation keeps request order, else as an outcome
    some execution of the racing requests gives (:mod:`_write_races`)."""
    rng = np.random.default_rng(800)
    count = _tier.n(2, 160) if _impls.tpu_interpreted(impl) else _tier.n(20, 160)
    for k in _tier.cases("write vs jnp reference", 800, count):
        stride, assert_on, mode, layout = WRITE_BUCKETS[k % len(WRITE_BUCKETS)]
        st = support.State.zeros(cases.NUM_SLOTS, cases.RING_CAP, stride)
        st.canary_i64[:] = rng.integers(-(2**63), 2**63 - 1, st.canary_i64.shape, dtype=np.int64)
        st.canary_i64[:, 1] = rng.integers(-2, 30, cases.NUM_SLOTS)
        st.widx = int(rng.integers(0, cases.RING_CAP + 4))
        launch = cases.random_write_launch(rng, assert_on, kernel_kind=(2, 8, 5, 11)[k % 4],
                                           hazards=True)
        sources = cases.bucket_sources(rng, layout)
        with _tier.case("write vs jnp reference", 800, k, implementation=impl):
            got, _ = support.run_write(None, st, **launch, real_kv_sources=sources,
                                       real_kv_hash_mode=mode, reference=False, implementation=impl)
            if in_reference_order(impl):
                want, _ = support.run_write(None, st, **launch, real_kv_sources=sources,
                                            real_kv_hash_mode=mode, reference=False,
                                            jnp_reference=True)
                support.assert_same(got, want, st)
            else:
                _write_races.assert_write_outcome(got, st, launch, sources, mode)


# --- the xla implementation: windows of requests, cross-request order ----------------------------


def _xla_config(**kw):
    from kvcanary_jax.ops.write.xla import Config

    return Config(**kw)


XLA_CONFIGS = [dict(lanes=1, unroll=1), dict(lanes=2, unroll=3), dict(lanes=4, unroll=8),
               dict(lanes=256, unroll=2, branch=False)]


@pytest.mark.fuzz
@pytest.mark.parametrize("config", XLA_CONFIGS)
def test_xla_windows_and_hazards(sgl, config):
    """Requests walked one, two or four at a time, several links per trip or one, against the
    reference on launches with cross-request hazards: slots written by several requests, seeds
    read from slots earlier requests of the launch write."""
    rng = np.random.default_rng(600 + config["lanes"])
    stride, assert_on, mode, layout = WRITE_BUCKETS[2]
    for _ in _tier.cases("xla write windows", 600 + config["lanes"], _tier.n(12, 80)):
        st = support.State.zeros(cases.NUM_SLOTS, cases.RING_CAP, stride)
        st.canary_i64[:] = rng.integers(-(2**63), 2**63 - 1, st.canary_i64.shape,
                                        dtype=np.int64)
        st.canary_i64[:, 1] = rng.integers(-2, 30, cases.NUM_SLOTS)
        st.widx = int(rng.integers(0, cases.RING_CAP + 4))
        launch = cases.random_write_launch(rng, assert_on, hazards=True)
        ours, ref = support.run_write(sgl, st, **launch,
                                      real_kv_sources=cases.bucket_sources(rng, layout),
                                      real_kv_hash_mode=mode, implementation="xla",
                                      config=_xla_config(**config))
        support.assert_same(ours, ref, st)


@pytest.mark.parametrize("config", XLA_CONFIGS[:2])
def test_xla_seeds_written_earlier_in_the_launch(sgl, config):
    """Request 1 continues from a slot request 0 writes, request 2 from one request 1 writes,
    request 3 from one request 2 rewrites after request 0 wrote it: each seed's link is the one
    the earlier request left, three levels deep."""
    st = support.State.zeros(16, 8)
    st.canary_i64[:, :3] = np.random.default_rng(5).integers(-9, 9, (16, 3))
    _, ref = _w(sgl, st, "xla", write_offsets=[0, 5, 8, 10, 12],
                write_seed_slot_indices=[2, 3, 7, 11], write_num_valid_reqs=4,
                input_ids=np.arange(12) + 100, positions=[0, 1, 2, 3, 4, 4, 5, 6, 7, 8, 9, 10],
                out_cache_loc=[1, 3, 4, 5, 3, 6, 7, 8, 9, 11, 12, 7], config=_xla_config(**config))
    assert ref.widx > 0


def _racy_launch(rng, bucket):
    """A state and a launch whose requests race: a few slots shared by every request, and seeds
    on slots other requests write (some continuing a chain another request extends)."""
    stride, assert_on, mode, layout = WRITE_BUCKETS[bucket]
    st = support.State.zeros(cases.NUM_SLOTS, cases.RING_CAP, stride)
    st.canary_i64[:] = rng.integers(-(2**63), 2**63 - 1, st.canary_i64.shape, dtype=np.int64)
    st.canary_i64[:, 1] = rng.integers(-2, 30, cases.NUM_SLOTS)
    st.widx = int(rng.integers(0, cases.RING_CAP))
    launch = cases.random_write_launch(rng, assert_on, kernel_kind=(2, 8, 5, 11)[bucket],
                                       hazards=True)
    launch["write_num_valid_reqs"] = cases.REQ_CAP
    shared = rng.integers(1, cases.NUM_SLOTS, 3)
    hot = rng.random(cases.NUM_TOKENS) < 0.35
    launch["out_cache_loc"][hot] = rng.choice(shared, int(hot.sum()))
    launch["write_seed_slot_indices"][rng.random(cases.REQ_CAP) < 0.6] = int(rng.choice(shared))
    return st, launch, cases.bucket_sources(rng, layout), mode


@pytest.mark.fuzz
def test_cross_request_races_give_one_order(sgl, impl):
    """The write's races, drawn on purpose (slots every request writes, seeds other requests
    store): the result is an outcome of some execution of the racing requests (each slot, field
    by field, one writer's last store; each seed field read from the pre-launch word or another
    request's store; the blocks' ring claims in some order; :mod:`_write_races`), exact wherever
    no race reaches; SGLang's request order is one of them, and the implementations that keep
    request order give it exactly."""
    rng = np.random.default_rng(31)
    count = _tier.n(1, 2) if _impls.tpu_interpreted(impl) else 8
    races = 0
    for i in range(count):
        st, launch, sources, mode = _racy_launch(rng, i % len(WRITE_BUCKETS))
        races += _write_races.write_races(st, launch)
        with _tier.case("write races", 31, i, implementation=impl):
            ours, ref = support.run_write(sgl, st, **launch, real_kv_sources=sources,
                                          real_kv_hash_mode=mode, implementation=impl)
            _write_races.assert_write_outcome(ref, st, launch, sources, mode)
            _write_races.assert_write_outcome(ours, st, launch, sources, mode)
            if in_reference_order(impl):
                support.assert_same(ours, ref, st)
    assert races >= 2 * count


def test_write_race_check_accepts_every_order_and_nothing_else(sgl):
    """The candidate check itself, on launches whose orders give different results: every order
    of the requests passes; a changed field, ring row, counter or write index fails."""
    import itertools

    rng = np.random.default_rng(32)
    checked = 0
    while checked < 4:
        st, launch, sources, mode = _racy_launch(rng, checked % len(WRITE_BUCKETS))
        results = [_write_races.apply_write_in_order(st, launch, sources, mode, order)
                   for order in itertools.permutations(range(cases.REQ_CAP))]
        if all(np.array_equal(r.canary, results[0].canary) for r in results):
            continue  # no order-dependent result here
        checked += 1
        for r in results[::5]:
            _write_races.assert_write_outcome(r, st, launch, sources, mode)
        good = results[-1]
        slot = int(np.argwhere((good.canary != st.canary).any(axis=1))[0][0])
        for corrupt in ("canary", "ring", "widx", "sctr"):
            bad = good.copy()
            if corrupt == "canary":
                bad.canary_i64[slot, 2] += 1
            elif corrupt == "ring":
                bad.ring[:] = rng.integers(100, 200, bad.ring.shape)
                if bad.widx == st.widx:
                    continue
            else:
                setattr(bad, corrupt, getattr(bad, corrupt) + 1)
            with pytest.raises(AssertionError):
                _write_races.assert_write_outcome(bad, st, launch, sources, mode)


@pytest.mark.fuzz
def test_xla_overlapping_and_unsorted_ranges_match_the_sequential_reference(sgl):
    """Malformed offsets (request ranges that overlap or come out of order): each request takes
    its own range, as the sequential jnp reference does (SGLang's reference stops early on
    ``write_offsets[A] <= 0`` there, the only place they differ)."""
    rng = np.random.default_rng(700)
    for k in _tier.cases("xla write malformed offsets", 700, _tier.n(12, 60)):
        stride, assert_on, mode, layout = WRITE_BUCKETS[k % len(WRITE_BUCKETS)]
        st = support.State.zeros(cases.NUM_SLOTS, cases.RING_CAP, stride)
        st.canary_i64[:] = rng.integers(-(2**63), 2**63 - 1, st.canary_i64.shape,
                                        dtype=np.int64)
        st.widx = int(rng.integers(0, cases.RING_CAP + 4))
        launch = cases.random_write_launch(rng, assert_on, hazards=True)
        launch["write_offsets"] = rng.integers(-3, cases.NUM_TOKENS + 3, cases.REQ_CAP + 1)
        sources = cases.bucket_sources(rng, layout)
        want, _ = support.run_write(sgl, st, **launch, real_kv_sources=sources,
                                    real_kv_hash_mode=mode, reference=False, jnp_reference=True)
        for config in XLA_CONFIGS[:3]:
            got, _ = support.run_write(sgl, st, **launch, real_kv_sources=sources,
                                       real_kv_hash_mode=mode, reference=False,
                                       implementation="xla", config=_xla_config(**config))
            support.assert_same(got, want, st)


# --- out-of-range indices (documented choices; never an out-of-bounds access) ------------------


def test_slot_past_the_buffer_is_skipped_like_a_negative_one(sgl, impl):
    st = _seeded_state()
    ours, _ = support.run_write(sgl, st, write_offsets=[0, 3], write_seed_slot_indices=[3],
                                write_num_valid_reqs=1, input_ids=[5, 6, 7], positions=[3, 4, 5],
                                out_cache_loc=[4, 8 + 3, 5], reference=False, implementation=impl)
    _, ref = support.run_write(sgl, st, write_offsets=[0, 3], write_seed_slot_indices=[3],
                               write_num_valid_reqs=1, input_ids=[5, 6, 7], positions=[3, 4, 5],
                               out_cache_loc=[4, -1, 5])
    support.assert_same(ours, ref, st)


def test_seed_past_the_buffer_reads_as_a_zero_slot(sgl, impl):
    st = support.State.zeros(8, 4)
    ours, _ = support.run_write(sgl, st, write_offsets=[0, 2], write_seed_slot_indices=[100],
                                write_num_valid_reqs=1, input_ids=[5, 6], positions=[1, 3],
                                out_cache_loc=[4, 5], reference=False, implementation=impl)
    _, ref = support.run_write(sgl, st, write_offsets=[0, 2], write_seed_slot_indices=[7],
                               write_num_valid_reqs=1, input_ids=[5, 6], positions=[1, 3],
                               out_cache_loc=[4, 5])
    support.assert_same(ours, ref, st)


def test_offsets_past_the_token_arrays_are_skipped(sgl, impl):
    st = support.State.zeros(8, 4)
    ours, _ = support.run_write(sgl, st, write_offsets=[0, 2, 6], write_seed_slot_indices=[-1, -1],
                                write_num_valid_reqs=2, input_ids=[5, 6, 7], positions=[0, 1, 0],
                                out_cache_loc=[1, 2, 3], reference=False, implementation=impl)
    # request 1 owns tokens [2, 6): only token 2 exists.
    _, ref = support.run_write(sgl, st, write_offsets=[0, 2, 3], write_seed_slot_indices=[-1, -1],
                               write_num_valid_reqs=2, input_ids=[5, 6, 7], positions=[0, 1, 0],
                               out_cache_loc=[1, 2, 3])
    support.assert_same(ours, ref, st)


# --- in place under jit with donation -----------------------------------------------------------


def test_donated_jit_updates_in_place(sgl, impl):
    st = _seeded_state()
    st.canary_i64[6] = [1, 2, 3, 4]
    launch = dict(write_offsets=[0, 2], write_seed_slot_indices=[3], write_num_valid_reqs=1,
                  input_ids=[5, 6], positions=[3, 9], out_cache_loc=[4, 5])
    with jax.enable_x64(True):
        args = cases.jax_write_args(context=support.jax_context(st), **launch)
        ctx = args.pop("context")
        f = jax.jit(lambda context, **kw: canary_write(
            context=context, implementation=impl, config=_impls.config("write", impl), **kw),
                    donate_argnames="context", static_argnames="enable_write_input_assert")
        out = f(ctx, **args)
        assert ctx.canary_buf.is_deleted()
    _, ref = support.run_write(sgl, st, **launch)
    support.assert_same(support.state_of(out), ref, st)


# --- validation ---------------------------------------------------------------------------------


def _plan(c=1):
    with jax.enable_x64(True):
        return cases.jax_write_plan(write_offsets=[0] * (c + 1), write_seed_slot_indices=[0] * c,
                                    write_num_valid_reqs=0)


def _call(ctx=None, plan=None, n=3, enable_write_input_assert=False, expected_input_tokens=None,
          expected_input_positions=None, **over):
    with jax.enable_x64(True):
        args = dict(input_ids=jnp.zeros((n,), jnp.int64), positions=jnp.zeros((n,), jnp.int64),
                    out_cache_loc=jnp.zeros((n,), jnp.int64))
        args.update(over)
        return canary_write(context=ctx or support.jax_context(support.State.zeros(8, 4)),
                            plan=plan or _plan(),
                            enable_write_input_assert=enable_write_input_assert,
                            expected_input_tokens=expected_input_tokens,
                            expected_input_positions=expected_input_positions, **args)


def _torch_call(sgl, *, real_kv_sources=(), enable_write_input_assert=False,
                expected_input_tokens=None, expected_input_positions=None):
    import torch

    ctx = support.torch_context(sgl, support.State.zeros(8, 4), real_kv_sources=real_kv_sources)
    plan = cases.torch_write_plan(cases.TorchApi.sglang(sgl), write_offsets=[0, 1],
                                  write_seed_slot_indices=[-1], write_num_valid_reqs=1)
    t = lambda x: None if x is None else torch.zeros(1, dtype=torch.int64)  # noqa: E731
    sgl.write.launch_canary_write_kernel(
        context=ctx, plan=plan, input_ids=torch.zeros(1, dtype=torch.int64),
        positions=torch.zeros(1, dtype=torch.int64),
        out_cache_loc=torch.ones(1, dtype=torch.int64),
        enable_write_input_assert=enable_write_input_assert,
        expected_input_tokens=t(expected_input_tokens),
        expected_input_positions=t(expected_input_positions))


@pytest.mark.parametrize("assert_on,has_tok,has_pos", [
    (True, False, False), (True, True, False), (True, False, True),
    (False, True, False), (False, False, True), (False, True, True)])
def test_expected_tensor_presence(sgl, assert_on, has_tok, has_pos):
    z = np.zeros(3)
    with pytest.raises(ValueError) as ref:
        _torch_call(sgl, enable_write_input_assert=assert_on,
                    expected_input_tokens=z if has_tok else None,
                    expected_input_positions=z if has_pos else None)
    with jax.enable_x64(True):
        z3 = jnp.zeros((3,), jnp.int64)
        with pytest.raises(ValueError) as ours:
            _call(enable_write_input_assert=assert_on,
                  expected_input_tokens=z3 if has_tok else None,
                  expected_input_positions=z3 if has_pos else None)
    assert str(ours.value) == str(ref.value)


def test_too_many_sources(sgl):
    src = cases.KvSource(np.zeros((8, 16), np.uint8), 1, 16, 16)
    with pytest.raises(ValueError) as ref:
        _torch_call(sgl, real_kv_sources=[src] * 5)
    with pytest.raises(ValueError) as ours:
        _call(ctx=support.jax_context(support.State.zeros(8, 4), real_kv_sources=[src] * 5))
    assert str(ours.value) == str(ref.value)
    assert str(ours.value).endswith("got 5")


def test_canary_stride_too_small():
    with jax.enable_x64(True):
        ctx = support.jax_context(support.State.zeros(8, 4))
        ctx = ctx.replace(canary_buf=jnp.zeros((8, 24), jnp.uint8))
    with pytest.raises(ValueError) as e:
        _call(ctx=ctx)
    assert str(e.value) == ("kv-canary: canary_buf slot stride must hold at least 4 int64 "
                            "fields, got 3")


@pytest.mark.parametrize("over,msg", [
    (dict(input_ids="i32"), "kv-canary: canary_write: input_ids must be int64, got int32"),
    (dict(positions="short"),
     "kv-canary: canary_write: positions must have the length of input_ids (3), got shape (2,)"),
    (dict(out_cache_loc="2d"), "kv-canary: canary_write: out_cache_loc must be 1-D, got shape (3, 1)"),
    (dict(plan="offsets"), "kv-canary: canary_write: write_offsets.size(0) must equal "
                           "write_req_capacity + 1 (2), got 3"),
    (dict(plan="nvalid"), "kv-canary: canary_write: plan.write_num_valid_reqs must be int32, "
                          "got int64"),
    (dict(ctx="cpa"), "kv-canary: canary_write: enable_chain_position_assert must be of shape "
                      "(1,), got shape (2,)"),
    (dict(ctx="canary"), "kv-canary: canary_write: canary_buf must be uint8, got int8"),
])
def test_guard_errors(over, msg):
    with jax.enable_x64(True):
        arrays = {"i32": jnp.zeros((3,), jnp.int32), "short": jnp.zeros((2,), jnp.int64),
                  "2d": jnp.zeros((3, 1), jnp.int64)}
        kw = {k: arrays[v] for k, v in over.items() if k not in ("plan", "ctx")}
        plan = _plan()
        if over.get("plan") == "offsets":
            plan = cases.jax_write_plan(write_offsets=[0, 0, 0], write_seed_slot_indices=[0],
                                        write_num_valid_reqs=0)
        elif over.get("plan") == "nvalid":
            plan = dataclasses.replace(_plan(), write_num_valid_reqs=jnp.zeros((1,), jnp.int64))
        ctx = support.jax_context(support.State.zeros(8, 4))
        if over.get("ctx") == "cpa":
            ctx = ctx.replace(enable_chain_position_assert=jnp.ones((2,), jnp.int32))
        elif over.get("ctx") == "canary":
            ctx = ctx.replace(canary_buf=jnp.zeros((8, 32), jnp.int8))
        with pytest.raises(RuntimeError) as e:
            _call(ctx=ctx, plan=plan, **kw)
    assert str(e.value) == msg


def test_int32_tokens_without_x64_get_the_hint():
    with pytest.raises(RuntimeError) as e:
        canary_write(context=support.jax_context(support.State.zeros(8, 4)), plan=_plan(),
                     input_ids=np.zeros(3, np.int32), positions=np.zeros(3, np.int32),
                     out_cache_loc=np.zeros(3, np.int32), enable_write_input_assert=False,
                     expected_input_tokens=None, expected_input_positions=None)
    assert "input_ids must be int64, got int32" in str(e.value)


# --- RealKvSource construction: SGLang's checks, class and message --------------------------------


@pytest.mark.parametrize("shape,dtype,page,nbpt,read", [
    ((2, 32), "uint8", 0, 16, 16),
    ((2, 32), "uint8", 1, 24, 16),
    ((2, 32), "uint8", 1, 0, 16),
    ((2, 64), "uint8", 1, 32, 48),
    ((2, 64), "uint8", 1, 32, 8),
    ((2, 64), "uint8", 1, 32, 0),
    ((32,), "uint8", 1, 16, 16),
    ((2, 24), "uint8", 1, 16, 16),
    ((2, 12), "bfloat16", 1, 16, 16),
    ((2, 32), "uint8", 2, 32, 16),
    ((2, 8), "float32", 1, 48, 16),
])
def test_real_kv_source_checks(sgl, shape, dtype, page, nbpt, read):
    import torch

    tdt = {"uint8": torch.uint8, "bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    with pytest.raises(ValueError) as ref:
        sgl.verify.RealKvSource(tensor=torch.zeros(shape, dtype=tdt), page_size=page,
                                num_bytes_per_token=nbpt, read_bytes=read)
    with jax.enable_x64(True):
        with pytest.raises(ValueError) as ours:
            RealKvSource(tensor=jnp.zeros(shape, jnp.dtype(dtype)), page_size=page,
                         num_bytes_per_token=nbpt, read_bytes=read)
    assert str(ours.value) == str(ref.value).replace("torch.", "")


def test_real_kv_source_strided_view_checks_run_on_the_view(sgl):
    import torch

    from kvcanary_jax.contracts import meta_of

    base = torch.zeros((4, 40), dtype=torch.uint8)
    view = base[:, 8:40]  # row stride 40 bytes: not a multiple of 16
    with pytest.raises(ValueError) as ref:
        sgl.verify.RealKvSource(tensor=view, page_size=1, num_bytes_per_token=16, read_bytes=16)
    with pytest.raises(ValueError) as ours:
        RealKvSource(tensor=jnp.zeros((4, 40), jnp.uint8), page_size=1, num_bytes_per_token=16,
                     read_bytes=16, view=meta_of(view), offset_bytes=8)
    assert str(ours.value) == str(ref.value)


def test_context_is_a_pytree_with_static_meta():
    src = cases.KvSource(np.zeros((8, 16), np.uint8), 1, 16, 16)
    ctx = support.jax_context(support.State.zeros(8, 4), real_kv_sources=[src], real_kv_hash_mode=1)
    leaves, tree = jax.tree_util.tree_flatten(ctx)
    assert len(leaves) == 7
    again = jax.tree_util.tree_unflatten(tree, leaves)
    assert isinstance(again, VerifyOrWriteContext)
    assert again.real_kv_hash_mode == consts.RealKvHashMode.PARTIAL
    assert again.real_kv_sources[0].page_size == 1


@pytest.mark.parametrize("assert_on,mode", [(True, 2), (False, 1)])
def test_lowers_through_triton_for_the_gpu(assert_on, mode):
    """The GPU (Triton) lowering runs on any machine: every primitive the kernel uses must have a
    lowering rule there (a GPU run is still needed to compile and execute it)."""
    src = cases.KvSource(np.zeros((32, 64), np.uint8), 2, 32, 32, "bfloat16", 16)
    with jax.enable_x64(True):
        ctx = support.jax_context(support.State.zeros(64, 16), real_kv_sources=[src],
                                  real_kv_hash_mode=mode)
        n = 300
        e = jnp.zeros((n,), jnp.int64) if assert_on else None
        f = jax.jit(lambda context, plan, ids, e1, e2: canary_write(
            context=context, plan=plan, input_ids=ids, positions=ids, out_cache_loc=ids,
            enable_write_input_assert=assert_on, expected_input_tokens=e1,
            expected_input_positions=e2, implementation="pallas_triton"), donate_argnums=0)
        text = lower(f, (ctx, _plan(4), jnp.zeros((n,), jnp.int64), e, e), "cuda").as_text()
    assert "kvcanary_write" in text and "output_operand_alias" in text


@pytest.mark.fuzz
def test_jnp_reference_write_fuzz(sgl):
    rng = np.random.default_rng(500)
    for k in _tier.cases("write jnp reference vs SGLang", 500, _tier.n(16, 60)):
        stride, assert_on, mode, layout = WRITE_BUCKETS[k % len(WRITE_BUCKETS)]
        st = support.State.zeros(cases.NUM_SLOTS, cases.RING_CAP, stride)
        st.canary_i64[:] = rng.integers(-(2**63), 2**63 - 1, st.canary_i64.shape, dtype=np.int64)
        st.widx = int(rng.integers(0, cases.RING_CAP + 4))
        # The jnp reference is sequential on every backend: cross-request hazards included.
        launch = cases.random_write_launch(rng, assert_on, hazards=True)
        ours, ref = support.run_write(sgl, st, **launch,
                                      real_kv_sources=cases.bucket_sources(rng, layout),
                                      real_kv_hash_mode=mode, jnp_reference=True)
        support.assert_same(ours, ref, st)


def test_source_addressing_errors():
    from kvcanary_jax.context import source_spec
    from kvcanary_jax.contracts import TensorMeta
    from kvcanary_jax.ops.write import WriteTokens, run as write_run

    view = TensorMeta(shape=(4, 16), dtype="uint8", strides=(32, 1), device=None,
                      framework="jax")
    src = RealKvSource(tensor=jnp.zeros((4, 32), jnp.uint8), page_size=1,
                       num_bytes_per_token=16, read_bytes=16, view=view, offset_bytes=4)
    with pytest.raises(ValueError) as e:
        source_spec(src)
    assert str(e.value) == "kv-canary: RealKvSource.offset_bytes must be a multiple of 8, got 4"
    # A buffer shorter than the rows it claims would be read out of bounds: refused.
    st = support.State.zeros(8, 2)
    with jax.enable_x64(True), pytest.raises(ValueError) as e:
        # The array-level entry takes the buffer as a source's tensor, addressed through its
        # view: 9 rows of 16 bytes claimed over a buffer of 8 x 16.
        wide = TensorMeta(shape=(9, 16), dtype="uint8", strides=(16, 1), device=None,
                          framework="jax")
        short = RealKvSource(tensor=jnp.zeros((8, 16), jnp.uint8), page_size=1,
                             num_bytes_per_token=16, read_bytes=16, view=wide)
        ctx = support.jax_context(st, kernel_kind=0, real_kv_sources=(short,),
                                  real_kv_hash_mode=2)
        write_run(
            ctx, _plan(),
            WriteTokens(input_ids=jnp.zeros((1,), jnp.int64),
                        positions=jnp.zeros((1,), jnp.int64),
                        out_cache_loc=jnp.zeros((1,), jnp.int64)),
            enable_write_input_assert=False)
    assert str(e.value) == ("kv-canary: real_kv_sources[0] buffer holds 16 8-byte words but its "
                            "rows span 18")


# --- every implementation: fuzz with hostile inputs ----------------------------------------------
# The launches above (cross-request hazards included: a slot written by two requests, a seed an
# earlier request writes, slots repeating inside a request) plus hostile ones: slots past the
# buffer, seeds past the buffer or far below zero, offsets past the token arrays, negative or
# decreasing, request counts past the capacity; and write indices where the ring guard acts.
# Expected: the reference run from write index 0 on a ring with room for every row, placed by the
# ring guard (support.guarded): SGLang's reference where it is defined, else the jnp reference
# (SGLang raises on slots past the buffer). Exact, ring order included (support.assert_guarded;
# pallas_triton: an outcome of some execution of the racing requests, _write_races).
# pallas_mosaic_tpu runs in TPU interpret mode off a TPU.
# Every implementation runs FUZZ_CASES a bucket in CI; pallas_mosaic_tpu in TPU interpret mode
# its first FUZZ_TPU_INTERPRETED (the long run with --tpu-long).
FUZZ_CASES = _tier.n(12, 250)  # per bucket (--long: 250)
FUZZ_TPU_INTERPRETED = _tier.n(1, 15)  # per bucket (--tpu-long: 250)
LONG_CASES = 250


@dataclasses.dataclass
class HostileLaunch:
    """A drawn hostile launch: its start state, launch, sources and hash mode, the reference's
    result from write index 0 on a ring with room for every row (``full``), the write index
    ``w0`` it starts from, and its kinds (records rows, hostile or clean, draws races)."""

    start: support.State
    launch: dict
    sources: list
    mode: int
    full: support.State
    w0: int
    kinds: dict


def _draw_hostile_launch(sgl, rng, bucket, aux=None) -> HostileLaunch:
    """A hostile launch (above), its reference checked against SGLang's where that is
    defined."""
    stride, assert_on, mode, layout = WRITE_BUCKETS[bucket]
    st = support.State.zeros(cases.NUM_SLOTS, cases.RING_CAP, stride)
    st.canary_i64[:] = rng.integers(-(2**63), 2**63 - 1, st.canary_i64.shape, dtype=np.int64)
    st.canary_i64[:, 1] = rng.integers(-2, 30, cases.NUM_SLOTS)
    st.sctr, st.kctr = (int(x) for x in rng.integers(0, 2**40, 2))
    launch = cases.random_write_launch(rng, assert_on, kernel_kind=(2, 8, 5, 11)[bucket],
                                       hazards=True)
    if aux is not None and aux.random() < 0.4:
        # Races on purpose (``aux``, a stream of its own: the main draws stay as they were):
        # two slots that many tokens of every request write, seeds on them.
        hot = aux.integers(1, cases.NUM_SLOTS, 2)
        tokens = aux.random(cases.NUM_TOKENS) < 0.3
        launch["out_cache_loc"][tokens] = aux.choice(hot, int(tokens.sum()))
        seeds = aux.random(cases.REQ_CAP) < 0.5
        launch["write_seed_slot_indices"][seeds] = aux.choice(hot, int(seeds.sum()))
    hostile = rng.random() < 0.35
    if hostile:
        n = cases.NUM_SLOTS
        ocl, seeds = launch["out_cache_loc"], launch["write_seed_slot_indices"]
        offsets = launch["write_offsets"]
        bad = rng.random(ocl.shape[0]) < 0.1
        ocl[bad] = rng.choice([n, n + 3, 2**40], int(bad.sum()))
        bad = rng.random(seeds.shape[0]) < 0.3
        seeds[bad] = rng.choice([n, n + 9, 2**40, -(2**40)], int(bad.sum()))
        u = rng.random()
        if u < 0.3:
            offsets[int(rng.integers(1, offsets.shape[0]))] += int(rng.integers(1, 40))
        elif u < 0.5:
            offsets[:] = rng.integers(-10, cases.NUM_TOKENS + 10, offsets.shape[0])
        if rng.random() < 0.2:
            launch["write_num_valid_reqs"] = cases.REQ_CAP + int(rng.integers(1, 5))
    u = rng.random()
    w0 = int(rng.integers(0, cases.RING_CAP + 4))
    if u < 0.1:
        w0 = int(rng.choice([-1, -3, -(2**31)]))
    elif u < 0.2:
        w0 = 2**31 - 1 - int(rng.integers(0, 3))
    sources = cases.bucket_sources(rng, layout)
    wide = support.widened(st, 4 * cases.NUM_TOKENS)
    full, _ = support.run_write(sgl, wide, **launch, real_kv_sources=sources,
                                real_kv_hash_mode=mode, reference=False, jnp_reference=True)
    if _sglang_defined(launch):
        _, sg = support.run_write(sgl, wide, **launch, real_kv_sources=sources,
                                  real_kv_hash_mode=mode, ours=False)
        support.assert_same(full, sg, wide)
    start = st.copy()
    start.widx = w0
    start.ring[:] = rng.integers(-9, 9, start.ring.shape)
    return HostileLaunch(start, launch, sources, mode, full, w0, dict(
        rows=full.widx > 0, hostile=hostile, clean=not hostile,
        race=_write_races.write_races(start, launch) > 0))


def _run_hostile_launch(sgl, h: HostileLaunch, implementation, ordered=None) -> None:
    """``h`` run on ``implementation``: exactly the reference's under the ring guard
    (``ordered``, by default where the implementation keeps request order), or an outcome of
    the GPU's racing requests."""
    ours, _ = support.run_write(sgl, h.start, **h.launch, real_kv_sources=h.sources,
                                real_kv_hash_mode=h.mode, reference=False,
                                implementation=implementation)
    if ordered is None:
        ordered = _impls.in_reference_order(implementation)
    if ordered:
        support.assert_guarded(ours, h.start, h.full, h.w0)
    else:
        _write_races.assert_write_outcome(ours, h.start, h.launch, h.sources, h.mode)
        # Request order (the reference's, placed by the ring guard) is one of the outcomes.
        _write_races.assert_write_outcome(support.guarded(h.start, h.full, h.w0), h.start,
                                          h.launch, h.sources, h.mode)


def _sglang_defined(launch) -> bool:
    """Whether SGLang's reference is defined on a launch: offsets non-decreasing inside the
    tokens (its loop stops early on ``write_offsets[A] <= 0``), every slot and seed below the
    buffer's end (it raises IndexError past it)."""
    off, n = np.asarray(launch["write_offsets"]), len(launch["out_cache_loc"])
    return bool(off[0] >= 0 and (np.diff(off) >= 0).all() and off[-1] <= n
                and (np.asarray(launch["out_cache_loc"]) < cases.NUM_SLOTS).all()
                and (np.asarray(launch["write_seed_slot_indices"]) < cases.NUM_SLOTS).all())


def _hostile_fuzz(sgl, bucket, n_cases, seed, implementation):
    """Hostile launches (above) from any write index: ours against the reference under the ring
    guard, exact where the implementation keeps request order; elsewhere (the GPU) as an
    outcome of some execution of the racing requests (:mod:`_write_races`), the races drawn on
    purpose. The reference is the jnp one, checked against SGLang's wherever SGLang's is
    defined. (The race check accepts the sequential result too:
    test_cross_request_races_give_one_order.)"""
    rng, aux = np.random.default_rng(seed), np.random.default_rng(seed + 10_000)
    # Violations recorded, hostile and clean cases, races drawn (a short run: the cases that
    # cover them, _tier.Coverage).
    cover = _tier.Coverage(f"write hostile fuzz, bucket {bucket}", seed, n_cases,
                           ("rows", "hostile", "clean", "race"))
    for i in cover.draws():
        with _tier.case("write hostile fuzz", seed, i, bucket=bucket,
                        implementation=implementation):
            h = _draw_hostile_launch(sgl, rng, bucket, aux)
            if cover.wants(**h.kinds):
                _run_hostile_launch(sgl, h, implementation)
                cover.ran(**h.kinds)
    cover.check()
    return cover.runs


@pytest.mark.fuzz
@pytest.mark.parametrize("bucket", range(len(WRITE_BUCKETS)))
@pytest.mark.parametrize("impl", _impls.with_tpu("write"))
def test_hostile_fuzz(sgl, impl, bucket):
    n = FUZZ_TPU_INTERPRETED if _impls.tpu_interpreted(impl) else FUZZ_CASES
    _hostile_fuzz(sgl, bucket, n, 700 + bucket, impl)


def test_gpu_comparison_accepts_request_order(sgl):
    """The GPU's comparison (:func:`_write_races.assert_write_outcome`) runs on the CPU too,
    over xla's results on hostile launches with races drawn on purpose: request order is one of
    the outcomes it must accept (the impossible ones it must reject: tests/test_races.py)."""
    rng, aux = np.random.default_rng(906), np.random.default_rng(10_906)
    races = 0
    for k in range(24):
        with _tier.case("write race comparison", 906, k):
            h = _draw_hostile_launch(sgl, rng, k % len(WRITE_BUCKETS), aux)
            _run_hostile_launch(sgl, h, "xla", ordered=False)
        races += h.kinds["race"]
    assert races > 0


def test_short_hostile_fuzz_checks_its_coverage(sgl, monkeypatch):
    """TPU interpret mode's short hostile fuzz (FUZZ_TPU_INTERPRETED cases) runs the coverage
    check too: its cases cover every kind (xla standing in for the interpreter here), and a
    stream that lacks a kind fails it."""
    assert _hostile_fuzz(sgl, 0, FUZZ_TPU_INTERPRETED, 700, "xla") >= 2
    drawn = _draw_hostile_launch

    def never_hostile(*a):
        h = drawn(*a)
        h.kinds.update(hostile=False, clean=True)
        return h

    monkeypatch.setitem(globals(), "_draw_hostile_launch", never_hostile)
    with pytest.raises(AssertionError, match="no case of kind"):
        _hostile_fuzz(sgl, 0, FUZZ_TPU_INTERPRETED, 700, "xla")


@pytest.mark.slow
@pytest.mark.tpu_interpret
@pytest.mark.parametrize("bucket", range(len(WRITE_BUCKETS)))
def test_hostile_fuzz_tpu_interpreted_long(sgl, bucket):
    _hostile_fuzz(sgl, bucket, LONG_CASES, 800 + bucket, _impls.TPU)
