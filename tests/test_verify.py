"""canary_verify against SGLang's torch reference (``verify_ref``), run on the same inputs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from kvcanary_jax import hashing
from kvcanary_jax.context import RealKvSource
from kvcanary_jax.contracts import TensorMeta
from kvcanary_jax.ops.verify import canary_verify
from kvcanary_jax.testing import cases

import _canary_support as support
import _impls
import _races
import _tier
from _impls import implementations, in_reference_order, lower, pallas, with_tpu

ANCHOR = hashing.ANCHOR_HASH_I64
IMPLS = implementations("verify")


@pytest.fixture(params=with_tpu("verify"))
def impl(request):
    return request.param


def _launch(**kw):
    """A launch config of the Pallas kernel (its module imported where it is tested)."""
    from kvcanary_jax.ops.verify.pallas_triton import Config

    return Config(**kw)


def _written(sgl, chains, *, real_kv_sources=(), real_kv_hash_mode=0, stride=32, num_slots=8,
             ring_cap=4):
    """A canary holding ``chains`` (lists of (slot, token, position)), written by the reference."""
    offsets, ids, pos, ocl = [0], [], [], []
    for ch in chains:
        for s, t, p in ch:
            ocl.append(s), ids.append(t), pos.append(p)
        offsets.append(len(ids))
    _, st = support.run_write(
        sgl, support.State.zeros(num_slots, ring_cap, stride), write_offsets=offsets,
        write_seed_slot_indices=[-1] * len(chains), write_num_valid_reqs=len(chains),
        input_ids=ids, positions=pos, out_cache_loc=ocl, real_kv_sources=real_kv_sources,
        real_kv_hash_mode=real_kv_hash_mode, ours=False)
    st.sctr = st.kctr = 0
    return st


CHAIN = [(1, 100, 0), (2, 101, 1), (3, 102, 2), (4, 103, 3), (5, 104, 4)]


def _entries(chain=CHAIN):
    slots = [s for s, _, _ in chain]
    return dict(verify_slot_indices=slots, verify_expected_tokens=[t for _, t, _ in chain],
                verify_expected_positions=[p for _, _, p in chain],
                verify_prev_slot_indices=[-1] + slots[:-1])


def _check(sgl, st, impl, *, verify_num_valid=None, expect_rows=None, **kw):
    """A verify of the entries in ``kw`` (a plan of their number unless ``verify_num_valid``)
    on ``impl`` and SGLang's reference, compared (:func:`support.check_verify`)."""
    e = {k: kw.pop(k) for k in cases.VERIFY_ENTRY_FIELDS}
    plan = cases.padded_verify_plan(e, capacity=len(e["verify_slot_indices"]))
    if verify_num_valid is not None:
        plan["verify_num_valid"] = verify_num_valid
    ours, ref = support.check_verify(sgl, st, implementation=impl, **plan, **kw)
    if expect_rows is not None:
        assert ref.widx - st.widx == expect_rows
    return ours, ref


# --- the spec's verify cases, rebuilt; expectations from the reference ------------------------


def test_clean_chain(sgl, impl):
    st = _written(sgl, [CHAIN])
    _, ref = _check(sgl, st, impl, **_entries(), check_verify_expected_token=True, expect_rows=0)
    assert ref.sctr == 5 and ref.kctr == 1


@pytest.mark.parametrize("check_token", [True, False])
def test_corrupted_token(sgl, check_token, impl):
    st = _written(sgl, [CHAIN])
    st.canary_i64[2, 0] = 999
    _, ref = _check(sgl, st, impl, **_entries(), check_verify_expected_token=check_token,
                    expect_rows=2 if check_token else 1)
    bits = sorted(int(r[7]) for r in ref.ring[:ref.widx])
    assert bits == ([1, 32] if check_token else [1])


def test_position_mismatch_records_stored_position(sgl, impl):
    st = _written(sgl, [CHAIN])
    e = _entries()
    e["verify_expected_positions"] = [0, 2, 3, 3, 4]
    _, ref = _check(sgl, st, impl, **e, check_verify_expected_token=True, expect_rows=2)
    assert sorted(int(r[2]) for r in ref.ring[:2]) == [1, 2]


def test_chain_head_anchor_mismatch(sgl, impl):
    st = _written(sgl, [CHAIN])
    st.canary_i64[1, 2] ^= 0x55
    _, ref = _check(sgl, st, impl, **_entries(), check_verify_expected_token=True, expect_rows=2)
    assert ANCHOR in [int(r[6]) for r in ref.ring[:2]]


def test_slot_zero_skipped_but_counted_and_prev_zero(sgl, impl):
    st = _written(sgl, [CHAIN])
    st.canary_i64[3, 2] ^= 1  # would fail the chain check, which prev 0 disables
    e = dict(verify_slot_indices=[0, 1, 0, 3, 4], verify_expected_tokens=[-1, 100, 7, 102, 103],
             verify_expected_positions=[9, 0, 9, 5, 3], verify_prev_slot_indices=[-1, -1, 0, 0, 3])
    _, ref = _check(sgl, st, impl, **e, check_verify_expected_token=True)
    assert ref.sctr == 5


def test_enable_zero_only_bumps_kernel_counter(sgl, impl):
    st = _written(sgl, [CHAIN])
    st.canary_i64[2, 0] = 999
    _, ref = _check(sgl, st, impl, **_entries(), enable=0, check_verify_expected_token=True,
                    expect_rows=0)
    assert (ref.sctr, ref.kctr) == (0, 1)


@pytest.mark.parametrize("num_valid", [9, 2, 0, -3])
def test_num_valid_clamped(sgl, num_valid, impl):
    st = _written(sgl, [CHAIN])
    e = _entries()
    # entries past an active prefix of 2 would fail
    e["verify_expected_positions"] = [0, 1, 7, 7, 7]
    _check(sgl, st, impl, **e, verify_num_valid=num_valid, check_verify_expected_token=True)


def test_expected_token_sentinel_and_mismatch(sgl, impl):
    st = _written(sgl, [CHAIN])
    e = _entries()
    e["verify_expected_tokens"] = [-1, 5, 102, -1, 104]
    _check(sgl, st, impl, **e, check_verify_expected_token=True, expect_rows=1)


def _kv_source(rng, num_slots=8, page=1, nbpt=32, read=32, pad=0, dtype="uint8"):
    rows = -(-num_slots // page)
    return cases.KvSource(rng.integers(0, 256, (rows, page * nbpt), dtype=np.uint8), page, nbpt,
                          read, dtype, pad)


@pytest.mark.parametrize("mode", [1, 2])
def test_real_kv_clean_then_bit_flip(sgl, mode, impl):
    rng = np.random.default_rng(3)
    src = _kv_source(rng)
    st = _written(sgl, [CHAIN], real_kv_sources=[src], real_kv_hash_mode=mode)
    _check(sgl, st, impl, **_entries(), real_kv_sources=[src], real_kv_hash_mode=mode,
           check_verify_expected_token=True, expect_rows=0)
    flipped = cases.KvSource(src.u8.copy(), 1, 32, 32)
    flipped.u8[2, 20 if mode == 2 else 5] ^= 0x10
    _, ref = _check(sgl, st, impl, **_entries(), real_kv_sources=[flipped], real_kv_hash_mode=mode,
                    check_verify_expected_token=True, expect_rows=1)
    assert int(ref.ring[0, 1]) == 2 and int(ref.ring[0, 7]) == 4


def test_real_kv_long_strips_clean_then_last_word_flipped(sgl, impl):
    """Strips of 14 and 34 words (112 and 272 bytes; the kernels fold whole groups of
    ``_kernel_lib.REAL_KV_PREFETCH`` words, then a remainder), written by SGLang's reference:
    clean, no row; a flip in the last word of one slot's 34-word strip, that slot's row."""
    rng = np.random.default_rng(12)
    srcs = [_kv_source(rng, nbpt=112, read=112), _kv_source(rng, nbpt=272, read=272)]
    st = _written(sgl, [CHAIN], real_kv_sources=srcs, real_kv_hash_mode=2)
    _check(sgl, st, impl, **_entries(), real_kv_sources=srcs, real_kv_hash_mode=2,
           check_verify_expected_token=True, expect_rows=0)
    flipped = cases.KvSource(srcs[1].u8.copy(), 1, 272, 272)
    flipped.u8[4, 271] ^= 0x01
    _, ref = _check(sgl, st, impl, **_entries(), real_kv_sources=[srcs[0], flipped],
                    real_kv_hash_mode=2, check_verify_expected_token=True, expect_rows=1)
    assert int(ref.ring[0, 1]) == 4


@pytest.mark.parametrize("impl", pallas("verify"))
@pytest.mark.parametrize("fold_vec", [1, 2, 4])
def test_real_kv_words_loaded_several_at_a_time(sgl, impl, fold_vec):
    """``fold_vec``: the strips' words loaded 1, 2 or 4 at a time (whole tiles, then the
    remainder of 14- and 34-word strips): clean, no row; the last word of one slot's strip
    flipped, that slot's row, as SGLang's reference."""
    rng = np.random.default_rng(12)
    srcs = [_kv_source(rng, nbpt=112, read=112), _kv_source(rng, nbpt=272, read=272)]
    st = _written(sgl, [CHAIN], real_kv_sources=srcs, real_kv_hash_mode=2)
    from kvcanary_jax.ops.verify.pallas_triton import FOLD_PLANS, Config

    config = Config(**{**FOLD_PLANS[0][1], "fold_vec": fold_vec})  # the fold's shape
    _check(sgl, st, impl, **_entries(), real_kv_sources=srcs, real_kv_hash_mode=2,
           check_verify_expected_token=True, expect_rows=0, config=config)
    flipped = cases.KvSource(srcs[1].u8.copy(), 1, 272, 272)
    flipped.u8[4, 271] ^= 0x01
    _, ref = _check(sgl, st, impl, **_entries(), real_kv_sources=[srcs[0], flipped],
                    real_kv_hash_mode=2, check_verify_expected_token=True, expect_rows=1,
                    config=config)
    assert int(ref.ring[0, 1]) == 4


def test_real_kv_mode_mismatch_flags_every_slot(sgl, impl):
    src = _kv_source(np.random.default_rng(4))
    st = _written(sgl, [CHAIN], real_kv_sources=[src], real_kv_hash_mode=2)
    _check(sgl, st, impl, **_entries(), real_kv_sources=[src], real_kv_hash_mode=1,
           check_verify_expected_token=True, expect_rows=5)


def test_ring_overflow_with_preexisting_index(sgl, impl):
    st = _written(sgl, [CHAIN], ring_cap=2)
    st.widx = 1
    st.ring[0] = np.arange(8) + 7
    e = _entries()
    e["verify_expected_positions"] = [5, 5, 5, 3, 4]
    _, ref = _check(sgl, st, impl, **e, check_verify_expected_token=True)
    assert ref.widx == 4


# --- out-of-range indices (never read out of bounds) -------------------------------------------


def test_negative_slot_reads_wrapped_row_like_the_reference(sgl, impl):
    st = _written(sgl, [CHAIN])
    e = dict(verify_slot_indices=[-3, -8, -7, 4], verify_expected_tokens=[102, 1, 100, 103],
             verify_expected_positions=[2, 0, 0, 3], verify_prev_slot_indices=[2, -1, -1, -9])
    _check(sgl, st, impl, **e, check_verify_expected_token=True)


def test_out_of_range_slot_and_prev_read_as_zero_rows(impl):
    st = support.State.zeros(8, 4)
    st.canary_i64[3] = [5, 6, 7, 0]
    with jax.enable_x64(True):
        ctx = support.jax_context(st)
        plan = cases.jax_verify_plan(
            verify_slot_indices=[8, -9, 3, 3], verify_expected_tokens=[-1, -1, 5, 5],
            verify_expected_positions=[0, 1, 6, 6], verify_prev_slot_indices=[0, 0, 100, 0],
            verify_num_valid=4)
        out = support.state_of(canary_verify(context=ctx, plan=plan,
                                             check_verify_expected_token=True, implementation=impl,
                                             config=_impls.config("verify", impl)))
    # slot 8 (zero row, position 0 == 0): clean; slot -9: position 0 != 1; slot 3 with prev 100
    # (zero row): expected link mix3(0, 0, 0) = 0 != 7; slot 3 with prev 0: clean.
    rows = sorted(tuple(int(v) for v in r) for r in out.ring[:out.widx])
    assert rows == sorted([(2, -9, 0, 0, -1, 0, 0, 2), (2, 3, 6, 5, 5, 7, 0, 1)])


# --- many blocks and programs (grid-stride) ----------------------------------------------------


@pytest.mark.parametrize("impl", pallas("verify"))
@pytest.mark.parametrize("structure", [dict(group=1, vec=1), dict(group=4, vec=4)])
def test_many_blocks_grid_stride(sgl, structure, impl):
    rng = np.random.default_rng(11)
    num_slots, n = 1024, 1500
    slots = rng.integers(1, num_slots, n)
    st = support.State.zeros(num_slots, 2048)
    st.canary_i64[:, :4] = rng.integers(-5, 5, (num_slots, 4))
    e = dict(verify_slot_indices=slots, verify_expected_tokens=rng.integers(-5, 5, n),
             verify_expected_positions=rng.integers(-5, 5, n),
             verify_prev_slot_indices=rng.integers(-2, num_slots, n))
    plan = cases.padded_verify_plan(e, capacity=2048)
    plan["verify_num_valid"] = 1400
    ours, ref = support.check_verify(sgl, st, implementation=impl, **plan,
                                     check_verify_expected_token=True)
    tight_config = _launch(block=128, max_programs=3, **structure)
    with jax.enable_x64(True):
        tight = canary_verify(
            **cases.jax_verify_args(context=support.jax_context(st), **plan),
            implementation=impl, config=tight_config)
    # Three programs take the blocks in turns: interpret mode runs them one after another, so
    # its rows come program by program, one of the GPU's outcomes.
    claims = _races.assert_verify_outcome(support.state_of(tight), st, config=tight_config,
                                          **plan, check_verify_expected_token=True)
    _races.assert_verify_outcome(ref, st, claims=claims, **plan, check_verify_expected_token=True)


@pytest.mark.parametrize("impl", pallas("verify"))
@pytest.mark.parametrize("shape", [0, 1, 2])
def test_the_heuristics_small_and_mid_plan_shapes(sgl, shape, impl):
    """Each shape of ``SMALL_PLANS`` (2: the mid-size plans', 4-warp programs of 512 entries as
    4 column vectors, 2 canary words a load) over a chain-ordered plan (a predecessor taken
    from the previous column) with others gathered, many violations, a few programs."""
    from kvcanary_jax.ops.verify.pallas_triton import SMALL_PLANS

    rng = np.random.default_rng(21 + shape)
    num_slots, n = 1024, 1500
    slots = rng.integers(1, num_slots, n)
    st = support.State.zeros(num_slots, 2048)
    st.canary_i64[:, :4] = rng.integers(-5, 5, (num_slots, 4))
    prev = np.where(rng.random(n) < 0.7, np.roll(slots, 1), rng.integers(-2, num_slots, n))
    e = dict(verify_slot_indices=slots, verify_expected_tokens=rng.integers(-5, 5, n),
             verify_expected_positions=rng.integers(-5, 5, n), verify_prev_slot_indices=prev)
    plan = cases.padded_verify_plan(e, capacity=2048)
    plan["verify_num_valid"] = 1400
    _, ref = support.check_verify(sgl, st, implementation="xla", **plan,
                                  check_verify_expected_token=True)
    config = _launch(**SMALL_PLANS[shape][1])
    with jax.enable_x64(True):
        got = canary_verify(**cases.jax_verify_args(context=support.jax_context(st), **plan),
                            implementation=impl, config=config)
    claims = _races.assert_verify_outcome(support.state_of(got), st, config=config, **plan,
                                          check_verify_expected_token=True)
    _races.assert_verify_outcome(ref, st, claims=claims, **plan, check_verify_expected_token=True)


# --- round trips: write then verify, clean, per hash mode --------------------------------------

TRIPS_PER_MODE = _tier.n(30, 1000)
# Round trips write and verify with one implementation.
TRIP_IMPLS = tuple(i for i in IMPLS if i in implementations("write"))


@pytest.mark.fuzz
@pytest.mark.parametrize("impl", TRIP_IMPLS)
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_round_trips_clean(sgl, mode, impl):
    rng = np.random.default_rng(100 + mode)
    for k in _tier.cases("verify round trips", 100 + mode, TRIPS_PER_MODE):
        trip = cases.make_trip(rng, mode, k % len(cases.BUCKETS))
        st = support.run_trip(sgl, rng, trip, implementation=impl)
        plan = cases.padded_verify_plan(cases.verify_entries(rng, trip.chains))
        ours, ref = support.run_verify(
            sgl, st, **plan, real_kv_sources=trip.real_kv_sources, real_kv_hash_mode=mode,
            check_verify_expected_token=trip.check_verify_expected_token, implementation=impl)
        support.assert_same(ours, ref, st)
        assert ref.widx == 0, (k, ref.ring)


# --- single corruptions: the exact records of the reference ------------------------------------

KINDS = ("token", "position", "prev_hash", "real_kv_byte", "swapped_slot", "stale_entry")


def corrupt(rng, kind, trip, st, entries):
    """``entries`` (:func:`cases.verify_entries`) and ``st`` with one corruption of ``kind``,
    or None where there is none to make; the entries returned are a copy."""
    e = {f: list(v) for f, v in entries.items()}
    slots, prev = e["verify_slot_indices"], e["verify_prev_slot_indices"]
    live = [i for i, s in enumerate(slots) if s != 0]
    i = live[int(rng.integers(len(live)))]
    s = slots[i]
    c = st.canary_i64
    if kind == "token":
        c[s, 0] += 1 + int(rng.integers(1000))
    elif kind == "position":
        c[s, 1] += 1
    elif kind == "prev_hash":
        c[s, 2] ^= np.int64(1) << np.int64(rng.integers(64))  # bit 63 included
    elif kind == "real_kv_byte":
        src = trip.real_kv_sources[int(rng.integers(len(trip.real_kv_sources)))]
        nbytes = 16 if trip.real_kv_hash_mode == 1 else src.read_bytes
        row = s // src.page_size
        col = (s % src.page_size) * src.num_bytes_per_token + int(rng.integers(nbytes))
        src.u8[row, col] ^= 1 << int(rng.integers(8))
    elif kind == "swapped_slot":
        others = [j for j in live if slots[j] != s]
        if not others:
            return None
        t = slots[others[int(rng.integers(len(others)))]]
        c[[s, t]] = c[[t, s]]
    elif kind == "stale_entry":
        # req_to_token holds a stale slot at this position: the entry and its successor's
        # predecessor both name it.
        stale = int(rng.integers(1, cases.NUM_SLOTS))
        for j in range(len(slots)):
            if prev[j] == s and slots[j] != 0:
                prev[j] = stale
        slots[i] = stale
    return e


# Small plans run the Pallas kernel's one-entry-per-lane structure, large ones the grouped /
# vectorised one (its ``heuristics``): both are checked on the same corruptions.
CORRUPTION_RUNS = [(i, "auto") for i in TRIP_IMPLS] + [
    (i, "large") for i in pallas("verify") if i in TRIP_IMPLS]


@pytest.mark.fuzz
@pytest.mark.parametrize("impl,launch", CORRUPTION_RUNS)
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_single_corruptions(sgl, mode, impl, launch):
    config = None
    if launch == "large":
        from kvcanary_jax.ops.verify import pallas_triton

        config = pallas_triton.heuristics({"capacity": 1 << 30})
    rng = np.random.default_rng(200 + mode)
    detected = {k: 0 for k in KINDS}
    for k in _tier.cases("verify single corruptions", 200 + mode, _tier.n(6, 60) * len(KINDS)):
        kind = KINDS[k % len(KINDS)]
        trip = cases.make_trip(rng, mode, (k // len(KINDS)) % len(cases.BUCKETS))
        if not any(trip.chains) or not trip.real_kv_sources and kind == "real_kv_byte":
            continue
        st = support.run_trip(sgl, rng, trip, implementation=impl)
        entries = cases.verify_entries(rng, trip.chains)
        got = corrupt(rng, kind, trip, st, entries)
        if got is None:
            continue
        plan = cases.padded_verify_plan(got)
        ours, ref = support.check_verify(
            sgl, st, implementation=impl, **plan, real_kv_sources=trip.real_kv_sources,
            real_kv_hash_mode=mode, check_verify_expected_token=trip.check_verify_expected_token,
            config=config)
        detected[kind] += ref.widx > 0
    for kind, n in detected.items():
        if kind == "real_kv_byte" and mode == 0:
            assert n == 0  # mode NONE has no fingerprint to break
        else:
            assert n > 0, kind


# --- validation ---------------------------------------------------------------------------------


def _ctx(**kw):
    return support.jax_context(support.State.zeros(8, 4), **kw)


def _vplan(n=4, **over):
    """A zero plan of ``n`` entries, none valid, its fields in ``over`` replaced."""
    with jax.enable_x64(True):
        plan = cases.jax_verify_plan(**{f: [0] * n for f in cases.VERIFY_ENTRY_FIELDS},
                                     verify_num_valid=0)
        return dataclasses.replace(plan, **over)


def test_too_many_sources(sgl):
    src = cases.KvSource(np.zeros((8, 16), np.uint8), 1, 16, 16)
    with pytest.raises(ValueError) as ours:
        canary_verify(context=_ctx(real_kv_sources=[src] * 5), plan=_vplan(),
                      check_verify_expected_token=False)
    with pytest.raises(ValueError) as ref:
        sgl.verify.launch_canary_verify_kernel(
            context=support.torch_context(sgl, support.State.zeros(8, 4),
                                          real_kv_sources=[src] * 5),
            plan=sgl.verify.VerifyPlan.allocate(verify_capacity=4, device="cpu"),
            check_verify_expected_token=False)
    assert str(ours.value) == str(ref.value)


@pytest.mark.parametrize("stride,cls,msg", [
    (24, ValueError, "kv-canary: canary_buf slot stride must hold at least 4 int64 fields, got 3"),
    (36, ValueError, "kv-canary: canary_buf slot stride must be a multiple of 8 bytes, got 36"),
])
def test_canary_stride(stride, cls, msg):
    with jax.enable_x64(True):
        ctx = _ctx().replace(canary_buf=jnp.zeros((8, stride), jnp.uint8))
    with pytest.raises(cls) as e:
        canary_verify(context=ctx, plan=_vplan(), check_verify_expected_token=False)
    assert str(e.value) == msg


def test_canary_stride_message_is_the_references(sgl):
    st = support.State(np.zeros((8, 24), np.uint8), np.zeros((4, 8), np.int64))
    ctx = support.torch_context(sgl, st)
    plan = cases.torch_verify_plan(
        cases.TorchApi.sglang(sgl), verify_slot_indices=[1, 1], verify_expected_tokens=[0, 0],
        verify_expected_positions=[0, 0], verify_prev_slot_indices=[0, 0], verify_num_valid=2)
    with pytest.raises(ValueError) as ref:
        sgl.verify_ref.launch_canary_verify_kernel_torch_reference(
            context=ctx, plan=plan, check_verify_expected_token=False)
    with jax.enable_x64(True):
        jctx = _ctx().replace(canary_buf=jnp.zeros((8, 24), jnp.uint8))
    with pytest.raises(ValueError) as ours:
        canary_verify(context=jctx, plan=_vplan(), check_verify_expected_token=False)
    assert str(ours.value) == str(ref.value)


@pytest.mark.parametrize("field,value,msg", [
    ("verify_slot_indices", "i32",
     "kv-canary: canary_verify: plan.verify_slot_indices must be int64, got int32"),
    ("verify_prev_slot_indices", "short",
     "kv-canary: canary_verify: plan.verify_prev_slot_indices must have the shape of "
     "plan.verify_slot_indices (4,), got (3,)"),
    ("verify_num_valid", "i64", "kv-canary: canary_verify: plan.verify_num_valid must be int32, "
     "got int64"),
    ("enable", "two", "kv-canary: canary_verify: plan.enable must be of shape (1,), got shape (2,)"),
])
def test_guard_errors(field, value, msg):
    with jax.enable_x64(True):
        v = {"i32": jnp.zeros((4,), jnp.int32), "short": jnp.zeros((3,), jnp.int64),
             "i64": jnp.zeros((1,), jnp.int64), "two": jnp.ones((2,), jnp.int32)}[value]
        plan = _vplan(**{field: v})
        with pytest.raises(RuntimeError) as e:
            canary_verify(context=_ctx(), plan=plan, check_verify_expected_token=False)
    assert str(e.value) == msg


@pytest.mark.parametrize("what,msg", [
    ("ring", "kv-canary: canary_verify: violation_ring must be of shape (ring_capacity, 8), "
             "got shape (4, 7)"),
    ("index", "kv-canary: canary_verify: violation_write_index must be int32, got int64"),
    ("counter", "kv-canary: canary_verify: kernel_run_counter must be of shape (1,), "
                "got shape (2,)"),
])
def test_context_guard_errors(what, msg):
    with jax.enable_x64(True):
        ctx = _ctx()
        ctx = {"ring": lambda: ctx.replace(violation_ring=jnp.zeros((4, 7), jnp.int64)),
               "index": lambda: ctx.replace(violation_write_index=jnp.zeros((1,), jnp.int64)),
               "counter": lambda: ctx.replace(kernel_run_counter=jnp.zeros((2,), jnp.int64)),
               }[what]()
    with pytest.raises(RuntimeError) as e:
        canary_verify(context=ctx, plan=_vplan(), check_verify_expected_token=False)
    assert str(e.value) == msg


def test_source_abi_checks(sgl):
    import torch

    # rows not packed: a torch view with stride(-1) == 2, described to us by its metadata.
    base = torch.zeros((4, 64), dtype=torch.uint8)
    view = base[:, ::2]
    meta = TensorMeta(shape=tuple(view.shape), dtype="uint8", strides=tuple(view.stride()),
                      device=None, framework="torch")
    with jax.enable_x64(True):
        src = RealKvSource(tensor=jnp.zeros((4, 64), jnp.uint8), page_size=1,
                           num_bytes_per_token=16, read_bytes=16, view=meta)
        ctx = _ctx().replace(real_kv_sources=(src,))
    with pytest.raises(ValueError) as ours:
        canary_verify(context=ctx, plan=_vplan(), check_verify_expected_token=False)
    assert str(ours.value) == ("kv-canary: real_kv_sources[0].tensor rows must be packed "
                               "(stride(-1) == 1), got strides (64, 2)")
    # a 3-D source
    with jax.enable_x64(True):
        src3 = RealKvSource(tensor=jnp.zeros((4, 16, 2), jnp.uint8), page_size=1,
                            num_bytes_per_token=16, read_bytes=16)
        ctx = _ctx().replace(real_kv_sources=(src3,))
    with pytest.raises(ValueError) as ours:
        canary_verify(context=ctx, plan=_vplan(), check_verify_expected_token=False)
    assert str(ours.value) == ("kv-canary: real_kv_sources[0].tensor (viewed as uint8) must be "
                               "2-D, got 3-D")


@pytest.mark.parametrize("check_token,mode", [(True, 2), (False, 0)])
def test_lowers_through_triton_for_the_gpu(check_token, mode):
    """The GPU (Triton) lowering runs on any machine: every primitive the kernel uses must have a
    lowering rule there (a GPU run is still needed to compile and execute it)."""
    src = cases.KvSource(np.zeros((64, 32), np.uint8), 1, 32, 32, "float32")
    with jax.enable_x64(True):
        ctx = support.jax_context(support.State.zeros(64, 16), real_kv_sources=[src],
                                  real_kv_hash_mode=mode)
        f = jax.jit(lambda context, plan: canary_verify(
            context=context, plan=plan, check_verify_expected_token=check_token,
            implementation="pallas_triton"), donate_argnums=0)
        text = lower(f, (ctx, _vplan(5000)), "cuda").as_text()
    assert "kvcanary_verify" in text and "output_operand_alias" in text


@pytest.mark.fuzz
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_round_trips_and_corruptions_against_jnp_reference(mode, impl):
    """Every implementation against the pure-jnp reference (no SGLang needed): canaries written
    by the jnp reference, then corrupted."""
    rng = np.random.default_rng(900 + mode)
    count = _tier.n(1, 60) if _impls.tpu_interpreted(impl) else _tier.n(12, 60)
    for k in _tier.cases("verify vs jnp reference", 900 + mode, count):
        trip = cases.make_trip(rng, mode, k % len(cases.BUCKETS))
        st = support.run_trip(None, rng, trip, jnp_reference=True, reference=False)
        entries = cases.verify_entries(rng, trip.chains)
        kind = KINDS[k % len(KINDS)]
        if any(trip.chains) and (trip.real_kv_sources or kind != "real_kv_byte"):
            entries = corrupt(rng, kind, trip, st, entries) or entries
        case = dict(**cases.padded_verify_plan(entries), real_kv_sources=trip.real_kv_sources,
                    real_kv_hash_mode=mode,
                    check_verify_expected_token=trip.check_verify_expected_token)
        want, _ = support.run_verify(None, st, jnp_reference=True, reference=False, **case)
        got, _ = support.run_verify(None, st, implementation=impl, reference=False, **case)
        if in_reference_order(impl):
            support.assert_same(got, want, st)
        else:
            claims = _races.assert_verify_outcome(got, st, **case)
            _races.assert_verify_outcome(want, st, claims=claims, **case)


# --- the xla implementation: its launch configurations ----------------------------------------


def _xla_config(**kw):
    from kvcanary_jax.ops.verify.xla import Config

    return Config(**kw)


@pytest.mark.parametrize("config", [dict(block=0, branch=False), dict(block=0, branch=True),
                                    dict(block=128), dict(block=256, branch=False)])
def test_xla_blocks_and_branches(sgl, config):
    """One pass or blocks over the live entries (the last one clamped to the capacity), with or
    without the conditionals; predecessors in chain order (taken from the previous entry) and
    elsewhere (gathered); many violations, the ring overflowing."""
    rng = np.random.default_rng(12)
    num_slots, n = 1024, 1500
    slots = rng.integers(1, num_slots, n)
    st = support.State.zeros(num_slots, 96)
    st.widx = 5
    st.canary_i64[:, :4] = rng.integers(-5, 5, (num_slots, 4))
    prev = np.where(rng.random(n) < 0.6, np.roll(slots, 1), rng.integers(-2, num_slots, n))
    e = dict(verify_slot_indices=slots, verify_expected_tokens=rng.integers(-5, 5, n),
             verify_expected_positions=rng.integers(-5, 5, n), verify_prev_slot_indices=prev)
    for cap, num_valid in ((1500, 1500), (2000, 1399), (2000, 77)):
        plan = cases.padded_verify_plan({k: v[:cap] for k, v in e.items()}, capacity=cap)
        plan["verify_num_valid"] = num_valid
        support.check_verify(sgl, st, implementation="xla", config=_xla_config(**config), **plan,
                             check_verify_expected_token=True)


# --- the pure-jnp references against SGLang's ---------------------------------------------------


@pytest.mark.fuzz
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_jnp_references_round_trips_and_corruptions(sgl, mode):
    rng = np.random.default_rng(400 + mode)
    for k in _tier.cases("verify jnp reference vs SGLang", 400 + mode, _tier.n(12, 60)):
        trip = cases.make_trip(rng, mode, k % len(cases.BUCKETS))
        st = support.run_trip(sgl, rng, trip, jnp_reference=True)
        entries = cases.verify_entries(rng, trip.chains)
        kind = KINDS[k % len(KINDS)]
        if any(trip.chains) and (trip.real_kv_sources or kind != "real_kv_byte"):
            entries = corrupt(rng, kind, trip, st, entries) or entries
        ours, ref = support.run_verify(
            sgl, st, **cases.padded_verify_plan(entries), real_kv_sources=trip.real_kv_sources,
            real_kv_hash_mode=mode, check_verify_expected_token=trip.check_verify_expected_token,
            jnp_reference=True)
        support.assert_same(ours, ref, st)


# --- every implementation: fuzz with hostile entries ---------------------------------------------
# Written chains (SGLang's write reference), then verify plans with corruptions of every kind, and
# hostile plans: slots past the buffer or below -num_slots, predecessors past the buffer or
# negative, huge values, active counts past the capacity or negative, enable 0; and write indices
# where the ring guard acts (negative: nothing written; near 2**31 - 1: saturating). Expected:
# the reference run from write index 0 on a ring with room for every row, placed by the ring
# guard (support.guarded): SGLang's reference where it is defined, else the jnp reference
# (SGLang raises on slots past the buffer). Rows come in the reference's order (pallas_triton: the
# blocks' claims in the order the atomics ran, _races.assert_verify_outcome). pallas_mosaic_tpu
# runs in TPU interpret mode off a TPU.
# Every implementation runs FUZZ_CASES in CI; pallas_mosaic_tpu in TPU interpret mode its first
# FUZZ_TPU_INTERPRETED (the long run with --tpu-long).
FUZZ_CASES = _tier.n(48, 1000)  # --long: 1,000
FUZZ_TPU_INTERPRETED = _tier.n(2, 60)  # --tpu-long: 1,000
LONG_CASES = 1000


@dataclasses.dataclass
class HostileCase:
    """A drawn hostile case: its start state, the verify's arguments (``kw``), the reference's
    result from write index 0 on a ring with room for every row (``full``), the write index
    ``w0`` it starts from, and its kinds (records rows, hostile or clean, overflows the ring)."""

    start: support.State
    kw: dict
    full: support.State
    w0: int
    kinds: dict


def _draw_hostile_case(sgl, rng, k) -> HostileCase:
    """Hostile case ``k`` (above), its reference checked against SGLang's where that is
    defined."""
    mode = k % 3
    trip = cases.make_trip(rng, mode, (k // 3) % len(cases.BUCKETS), contiguous=k % 2 == 1)
    st = support.reference_trip_state(sgl, rng, trip)
    entries = cases.verify_entries(rng, trip.chains)
    kind = KINDS[int(rng.integers(len(KINDS)))]
    if (any(trip.chains) and (trip.real_kv_sources or kind != "real_kv_byte")
            and rng.random() < 0.6):
        entries = corrupt(rng, kind, trip, st, entries) or entries
    e = {f: list(v) for f, v in entries.items()}
    slots, prev = e["verify_slot_indices"], e["verify_prev_slot_indices"]
    n = cases.NUM_SLOTS
    hostile = rng.random() < 0.35 and len(slots) > 0
    if hostile:
        for i in range(len(slots)):
            if rng.random() < 0.2:
                slots[i] = int(rng.choice([-1, -n, -n - 1, n, n + 5, 2**40, -(2**40)]))
            if rng.random() < 0.2:
                prev[i] = int(rng.choice([n, n + 3, -7, 2**40, -(2**40), 0]))
    plan = cases.padded_verify_plan(e)
    u = rng.random()
    if u < 0.1:
        plan["verify_num_valid"] = int(rng.integers(-3, 0))
    elif u < 0.2:
        plan["verify_num_valid"] = cases.VERIFY_CAP + int(rng.integers(0, 9))
    enable = int(rng.random() > 0.05)
    u = rng.random()
    w0 = int(rng.integers(0, cases.RING_CAP + 4))
    if u < 0.1:
        w0 = int(rng.choice([-1, -5, -(2**31)]))
    elif u < 0.2:
        w0 = 2**31 - 1 - int(rng.integers(0, 3))
    st.widx = 0
    st.sctr, st.kctr = (int(x) for x in rng.integers(0, 2**40, 2))
    kw = dict(**plan, enable=enable, real_kv_sources=trip.real_kv_sources, real_kv_hash_mode=mode,
              kernel_kind=2 + mode % 2,
              check_verify_expected_token=trip.check_verify_expected_token)
    wide = support.widened(st, 2 * cases.VERIFY_CAP)
    full, _ = support.run_verify(sgl, wide, **kw, reference=False, jnp_reference=True)
    try:  # SGLang's reference too, wherever it is defined (it raises on slots past the buffer)
        _, sg = support.run_verify(sgl, wide, **kw, ours=False)
    except IndexError:
        assert hostile
    else:
        support.assert_same(full, sg, wide)
    start = st.copy()
    start.widx = w0
    start.ring[:] = rng.integers(-9, 9, start.ring.shape)
    return HostileCase(start, kw, full, w0, dict(
        rows=full.widx > 0, hostile=hostile, clean=not hostile,
        overflow=w0 >= 0 and w0 + full.widx > len(start.ring)))


def _run_hostile_case(sgl, h: HostileCase, implementation, ordered=None) -> None:
    """``h`` run on ``implementation``: exactly the reference's under the ring guard
    (``ordered``, by default where the implementation keeps entry order), or an outcome of the
    GPU's blocks claiming their rows in some order."""
    ours, _ = support.run_verify(sgl, h.start, **h.kw, reference=False,
                                 implementation=implementation)
    if ordered is None:
        ordered = _impls.in_reference_order(implementation)
    if ordered:
        support.assert_guarded(ours, h.start, h.full, h.w0)
    else:
        claims = _races.assert_verify_outcome(ours, h.start, **h.kw)
        # The entry order (the reference's, placed by the ring guard) is one of the outcomes.
        _races.assert_verify_outcome(support.guarded(h.start, h.full, h.w0), h.start,
                                     claims=claims, **h.kw)


def _hostile_fuzz(sgl, n_cases, seed, implementation):
    rng = np.random.default_rng(seed)
    # Violations recorded (in a quarter of the cases at least), hostile and clean cases (a short
    # run: the cases that cover them, _tier.Coverage).
    cover = _tier.Coverage("verify hostile fuzz", seed, n_cases, ("rows", "hostile", "clean"))
    for k in cover.draws():
        with _tier.case("verify hostile fuzz", seed, k, implementation=implementation):
            h = _draw_hostile_case(sgl, rng, k)
            if cover.wants(**h.kinds):
                _run_hostile_case(sgl, h, implementation)
                cover.ran(**h.kinds)
    cover.check()
    assert cover.counts["rows"] > cover.runs // 4
    return cover.runs


@pytest.mark.fuzz
@pytest.mark.parametrize("impl", _impls.with_tpu("verify"))
def test_hostile_fuzz(sgl, impl):
    n = FUZZ_TPU_INTERPRETED if _impls.tpu_interpreted(impl) else FUZZ_CASES
    _hostile_fuzz(sgl, n, 900, impl)


def test_gpu_ring_comparison_accepts_request_order(sgl):
    """The GPU's comparison (:func:`_races.assert_verify_outcome`: the blocks' claims in some
    order, the first rows landing where the ring overflows) runs on the CPU too, over xla's
    results on hostile launches: entry order is one of the outcomes it must accept (the
    impossible ones it must reject: tests/test_races.py)."""
    rng = np.random.default_rng(905)
    overflowed = 0
    for k in range(24):
        with _tier.case("verify ring comparison", 905, k):
            h = _draw_hostile_case(sgl, rng, k)
            _run_hostile_case(sgl, h, "xla", ordered=False)
        overflowed += h.kinds["overflow"]
    assert overflowed > 0


def test_short_hostile_fuzz_checks_its_coverage(sgl, monkeypatch):
    """TPU interpret mode's short hostile fuzz (FUZZ_TPU_INTERPRETED cases) runs the coverage
    check too: its cases cover every kind (xla standing in for the interpreter here), and a
    stream that lacks a kind fails it."""
    assert _hostile_fuzz(sgl, FUZZ_TPU_INTERPRETED, 900, "xla") >= 2
    drawn = _draw_hostile_case

    def never_hostile(*a):
        h = drawn(*a)
        h.kinds.update(hostile=False, clean=True)
        return h

    monkeypatch.setitem(globals(), "_draw_hostile_case", never_hostile)
    with pytest.raises(AssertionError, match="no case of kind"):
        _hostile_fuzz(sgl, FUZZ_TPU_INTERPRETED, 900, "xla")


@pytest.mark.slow
@pytest.mark.tpu_interpret
def test_hostile_fuzz_tpu_interpreted_long(sgl):
    _hostile_fuzz(sgl, LONG_CASES, 901, _impls.TPU)


@pytest.mark.tpu_interpret
@pytest.mark.tpu_races
def test_tpu_long_runs_across_slabs_and_blocks(sgl):
    """A chain of 1,100 consecutive slots verified in 512-entry blocks: row runs of the gather
    cross 128-entry slabs and blocks, corruptions anywhere in them are found in order."""
    n = 1100
    chain = [(s, 1000 + s, s - 1) for s in range(1, n + 1)]
    st = _written(sgl, [chain], num_slots=n + 8, ring_cap=16)
    for s in (1, 127, 128, 129, 511, 512, 700, 1024, 1099):
        st.canary_i64[s, int(s % 3)] ^= 1 << int(s % 50)
    plan = cases.padded_verify_plan(_entries(chain), capacity=n)
    _, ref = support.run_verify(sgl, st, **plan, check_verify_expected_token=True, ours=False)
    ours, _ = support.run_verify(sgl, st, **plan, check_verify_expected_token=True,
                                 reference=False, implementation=_impls.TPU,
                                 config=_impls.config("verify", _impls.TPU, block=512))
    support.assert_same(ours, ref, st)
    assert ref.widx >= 9
