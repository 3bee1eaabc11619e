"""Zero sizes, for every implementation that runs here and every jnp reference: what SGLang 0.5.23
does on the same input (its reference, whose counters and untouched memory are compared), or, where
SGLang's reference raises IndexError and its GPU kernel reads or writes outside the buffer, what it
does on the equivalent in-bounds input (every out-of-range read is zero or -1, every out-of-range
write skipped: the ops' documented bounds rules). Buffers start filled with sentinels, so whatever
is not the op's to write must come back as it was. The runtime's configuration refuses these sizes
with SGLang's runtime errors (tests/test_runtime_guards.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import jax

import kvcanary_jax as kc
from kvcanary_jax.testing import cases

import _canary_support as support
import test_plan
from _impls import implementations

SENTINEL = -9999


def _runners(op):
    return implementations(op) + ("reference",)


def _sentinel_state(num_slots, ring_cap, widx=1):
    """Garbage canary rows and recorded ring rows (widx of them), all of which must survive."""
    rng = np.random.default_rng(num_slots * 31 + ring_cap)
    st = support.State.zeros(num_slots, ring_cap)
    st.canary[:] = rng.integers(0, 256, st.canary.shape, dtype=np.uint8)
    st.ring[:] = SENTINEL
    st.widx, st.sctr, st.kctr = widx, 5, 7
    return st


def _kw(runner):
    return dict(jnp_reference=True) if runner == "reference" else dict(implementation=runner)


# --- verify -------------------------------------------------------------------------------------


@pytest.mark.parametrize("runner", _runners("verify"))
@pytest.mark.parametrize("num_valid,enable", [(0, 1), (3, 1), (3, 0)])
def test_verify_zero_length_plan(sgl, runner, num_valid, enable):
    """SGLang: only kernel_run_counter is bumped."""
    st = _sentinel_state(8, 4)
    ours, ref = support.run_verify(sgl, st, verify_slot_indices=[], verify_expected_tokens=[],
                                   verify_expected_positions=[], verify_prev_slot_indices=[],
                                   verify_num_valid=num_valid, enable=enable, **_kw(runner))
    support.assert_same(ours, ref, st)
    assert (ref.widx, ref.sctr, ref.kctr) == (st.widx, st.sctr, st.kctr + 1)


CHAIN_BREAKS = dict(verify_slot_indices=[1, 2, 3], verify_expected_tokens=[5, 6, 7],
                    verify_expected_positions=[0, 1, 9], verify_prev_slot_indices=[-1, 1, 2],
                    verify_num_valid=3)


@pytest.mark.parametrize("runner", _runners("verify"))
@pytest.mark.parametrize("widx", [0, 3])
def test_verify_zero_row_ring(sgl, runner, widx):
    """SGLang: violations are counted in the write index, none is stored."""
    st = _sentinel_state(8, 0, widx=widx)
    ours, ref = support.run_verify(sgl, st, **CHAIN_BREAKS, **_kw(runner))
    support.assert_same(ours, ref, st)
    assert ref.widx > widx and ours.ring.shape == (0, 8)


@pytest.mark.parametrize("runner", _runners("verify"))
def test_verify_zero_slot_canary_without_work(sgl, runner):
    """Only slot-0 entries (skipped, counted) or none: SGLang accepts it."""
    st = _sentinel_state(0, 4)
    for e in (dict(verify_slot_indices=[0, 0], verify_expected_tokens=[1, 2],
                   verify_expected_positions=[0, 1], verify_prev_slot_indices=[-1, 0],
                   verify_num_valid=2),
              dict(verify_slot_indices=[4, 5], verify_expected_tokens=[1, 2],
                   verify_expected_positions=[0, 1], verify_prev_slot_indices=[-1, 4],
                   verify_num_valid=0)):
        ours, ref = support.run_verify(sgl, st, **e, **_kw(runner))
        support.assert_same(ours, ref, st)
        assert ours.canary.shape == (0, 32)


@pytest.mark.parametrize("runner", _runners("verify"))
def test_verify_zero_slot_canary_reads_zero_rows(sgl, runner):
    """Entries that read slots (SGLang's reference: IndexError; its GPU: reads outside the
    buffer): every slot is out of range and reads as a zero row, i.e. SGLang on a zero canary
    large enough to hold them. Slot -1 included."""
    e = dict(verify_slot_indices=[1, 2, -1, 3], verify_expected_tokens=[5, 0, 0, 7],
             verify_expected_positions=[0, 0, 4, 1], verify_prev_slot_indices=[-1, 1, 2, 2],
             verify_num_valid=4)
    st = _sentinel_state(0, 8)
    big = st.copy()
    big.canary = np.zeros((8, 32), np.uint8)
    _, ref = support.run_verify(sgl, big, ours=False, **e)
    with jax.enable_x64(True):
        ours = _verify_ours(st, runner, e)
    assert ours.canary.shape == (0, 32)
    ref.canary = ours.canary
    support.assert_same(ours, ref, st)
    assert ref.widx - st.widx == 3  # slot 2 holds what its zero row says


def _verify_ours(st, runner, e, **options):
    fn = kc.canary_verify_reference if runner == "reference" else kc.canary_verify
    out = fn(**cases.jax_verify_args(context=support.jax_context(st, **options), **e),
             **({} if runner == "reference" else dict(implementation=runner)))
    return support.state_of(out)


@pytest.mark.parametrize("runner", _runners("verify"))
def test_verify_zero_row_real_kv_source(sgl, runner):
    """SGLang's reference raises from index_select on a 0-row source; every row past a source's
    rows reads as zero words: SGLang on a zero source with rows for every slot."""
    e = dict(verify_slot_indices=[1, 2, 0], verify_expected_tokens=[-1, -1, -1],
             verify_expected_positions=[0, 1, 0], verify_prev_slot_indices=[-1, 1, 0],
             verify_num_valid=3)
    st = _sentinel_state(8, 4)
    empty = cases.KvSource(np.zeros((0, 32), np.uint8), 1, 32, 32)
    zeros = cases.KvSource(np.zeros((8, 32), np.uint8), 1, 32, 32)
    other = cases.KvSource(np.arange(8 * 16, dtype=np.uint8).reshape(8, 16), 1, 16, 16)
    for mode in (1, 2):
        _, ref = support.run_verify(sgl, st, ours=False, real_kv_sources=[zeros, other],
                                    real_kv_hash_mode=mode, **e)
        with jax.enable_x64(True):
            ours = _verify_ours(st, runner, e, real_kv_sources=[empty, other],
                                real_kv_hash_mode=mode)
        support.assert_same(ours, ref, st)


# --- write --------------------------------------------------------------------------------------


def _write(sgl, st, runner, **launch):
    return support.run_write(sgl, st, **launch, **_kw(runner))


@pytest.mark.parametrize("runner", _runners("write"))
@pytest.mark.parametrize("num_valid", [0, 2])
def test_write_zero_capacity_plan(sgl, runner, num_valid):
    st = _sentinel_state(8, 4)
    ours, ref = _write(sgl, st, runner, write_offsets=[0], write_seed_slot_indices=[],
                       write_num_valid_reqs=num_valid, input_ids=[5, 6], positions=[0, 1],
                       out_cache_loc=[1, 2])
    support.assert_same(ours, ref, st)
    assert (ref.sctr, ref.kctr) == (st.sctr, st.kctr + 1)


@pytest.mark.parametrize("runner", _runners("write"))
def test_write_zero_tokens(sgl, runner):
    st = _sentinel_state(8, 4)
    ours, ref = _write(sgl, st, runner, write_offsets=[0, 0, 0], write_seed_slot_indices=[3, -1],
                       write_num_valid_reqs=2, input_ids=[], positions=[], out_cache_loc=[],
                       enable_write_input_assert=True, expected_input_tokens=[],
                       expected_input_positions=[])
    support.assert_same(ours, ref, st)
    assert (ref.sctr, ref.kctr) == (st.sctr, st.kctr + 1)


@pytest.mark.parametrize("runner", _runners("write"))
@pytest.mark.parametrize("widx", [0, 2])
def test_write_zero_row_ring(sgl, runner, widx):
    st = _sentinel_state(8, 0, widx=widx)
    # Request 1 seeds from slot 4, which no request writes: requests run concurrently on a GPU,
    # so a seed written in the same launch would be a race (SGLang's kernel has it too).
    ours, ref = _write(sgl, st, runner, write_offsets=[0, 2, 3], write_seed_slot_indices=[-1, 4],
                       write_num_valid_reqs=2, input_ids=[5, 6, 7], positions=[0, 1, 5],
                       out_cache_loc=[1, 2, 3], enable_write_input_assert=True,
                       expected_input_tokens=[5, 9, 7], expected_input_positions=[0, 1, 4])
    support.assert_same(ours, ref, st)
    assert ref.widx == widx + 3


@pytest.mark.parametrize("runner", _runners("write"))
def test_write_zero_slot_canary(sgl, runner):
    """Without work SGLang accepts it; with work (its reference: IndexError; its GPU: writes
    outside the buffer) every slot is out of range and skipped like a negative one, i.e. SGLang
    on the same launch with every slot negative: only kernel_run_counter moves."""
    st = _sentinel_state(0, 4)
    launch = dict(write_offsets=[0, 2, 3], write_seed_slot_indices=[-1, 4], write_num_valid_reqs=2,
                  input_ids=[5, 6, 7], positions=[0, 1, 9], out_cache_loc=[1, 2, 3],
                  enable_write_input_assert=True, expected_input_tokens=[5, 9, 7],
                  expected_input_positions=[0, 1, 4])
    big = st.copy()
    big.canary = np.zeros((8, 32), np.uint8)
    _, ref = support.run_write(sgl, big, ours=False,
                               **{**launch, "out_cache_loc": [-1, -1, -1],
                                  "write_seed_slot_indices": [-1, -1]})
    ours, _ = support.run_write(sgl, st, reference=False, **launch, **_kw(runner))
    assert ours.canary.shape == (0, 32)
    ref.canary = ours.canary
    support.assert_same(ours, ref, st)
    assert (ours.widx, ours.sctr, ours.kctr) == (st.widx, st.sctr, st.kctr + 1)
    ours, ref = _write(sgl, st, runner, **{**launch, "write_offsets": [0, 0, 0]})  # no work
    support.assert_same(ours, ref, st)


@pytest.mark.parametrize("runner", _runners("write"))
def test_write_zero_row_real_kv_source(sgl, runner):
    st = _sentinel_state(8, 4)
    launch = dict(write_offsets=[0, 3], write_seed_slot_indices=[-1], write_num_valid_reqs=1,
                  input_ids=[5, 6, 7], positions=[0, 1, 2], out_cache_loc=[1, 2, 3])
    empty = cases.KvSource(np.zeros((0, 32), np.uint8), 1, 32, 32)
    zeros = cases.KvSource(np.zeros((8, 32), np.uint8), 1, 32, 32)
    _, ref = support.run_write(sgl, st, ours=False, real_kv_sources=[zeros], real_kv_hash_mode=2,
                               **launch)
    ours, _ = support.run_write(sgl, st, reference=False, real_kv_sources=[empty],
                                real_kv_hash_mode=2, **launch, **_kw(runner))
    support.assert_same(ours, ref, st)


# --- plan ---------------------------------------------------------------------------------------


def _plan_ours(c, runner):
    if runner == "reference":
        return test_plan.run_ours(c, reference=True)
    return test_plan.run_ours(c, runner)


RTT = test_plan.RTT
PLAN_CASES = {
    # verify plan capacity 0: SGLang's reference and its GPU launcher accept it
    "capacity_0_with_prefixes": test_plan.case([1, 2], [3, 2], [1, 1], RTT, vc=0, wc=2),
    "capacity_0_without_prefixes": test_plan.case([1, 2], [0, 0], [1, 0], RTT, vc=0, wc=2),
    "capacity_0_bs_0": test_plan.case([], [], [], RTT, vc=0, wc=2),
    "write_capacity_0_bs_0": test_plan.case([], [], [], RTT, vc=2, wc=0),
    # empty tables without a read (SGLang accepts them)
    "req_to_token_0_rows_padding_only": test_plan.case([0], [2], [1], np.zeros((0, 6)), vc=4, wc=1),
    "req_to_token_0_cols_no_prefix": test_plan.case([1], [0], [1], np.zeros((4, 0)), vc=4, wc=1),
    "pool_0_rows_valid_lens_0": test_plan.case([1], [3], [1], RTT, pool=np.zeros((0, 6)), vl=[0],
                                               vc=4, wc=1),
}

# Reads from empty tables (SGLang's reference: IndexError; its GPU: reads outside the table):
# a cell outside reads as 0 (the unfilled slot), an expected token outside as -1, i.e. SGLang on
# a zero table large enough / with valid_lens 0.
PLAN_EQUIVALENT = {
    "req_to_token_0_rows": (test_plan.case([1, 2], [2, 1], [1, 1], np.zeros((0, 6)), vc=4, wc=2),
                            test_plan.case([1, 2], [2, 1], [1, 1], np.zeros((4, 6)), vc=4, wc=2)),
    "req_to_token_0_cols": (test_plan.case([1], [2], [1], np.zeros((4, 0)), vc=4, wc=1),
                            test_plan.case([1], [2], [1], np.zeros((4, 6)), vc=4, wc=1)),
    "pool_0_rows": (test_plan.case([1, 3], [3, 2], [1, 1], RTT, pool=np.zeros((0, 6)), vl=[2, 6],
                                   vc=6, wc=2),
                    test_plan.case([1, 3], [3, 2], [1, 1], RTT, pool=np.zeros((4, 6)), vl=[0, 0],
                                   vc=6, wc=2)),
}


@pytest.mark.parametrize("runner", _runners("plan"))
@pytest.mark.parametrize("name", sorted(PLAN_CASES))
def test_plan_zero_sizes_are_sglangs(sgl, name, runner):
    c = PLAN_CASES[name]
    test_plan.assert_same(_plan_ours(c, runner), test_plan.run_oracle(sgl, c), c)


@pytest.mark.parametrize("runner", _runners("plan"))
@pytest.mark.parametrize("name", sorted(PLAN_EQUIVALENT))
def test_plan_reads_from_empty_tables(sgl, name, runner):
    c, equivalent = PLAN_EQUIVALENT[name]
    with pytest.raises(IndexError):
        test_plan.run_oracle(sgl, c)
    test_plan.assert_same(_plan_ours(c, runner), test_plan.run_oracle(sgl, equivalent), c)


# --- scatter ------------------------------------------------------------------------------------


def _scatter_ours(runner, flat, offsets, rpi, pool):
    args = dict(flat_in=flat, offsets=offsets, req_pool_indices=rpi, pool_out=pool)
    if runner == "reference":
        return np.asarray(kc.scatter_req_token_ids_reference(**args))
    return np.asarray(kc.scatter_req_token_ids(**args, implementation=runner))


def _scatter_sglang(sgl, flat, offsets, rpi, pool):
    out = torch.from_numpy(pool.copy())
    sgl.scatter_ref.scatter_req_token_ids_torch_reference(
        flat_in=torch.from_numpy(flat), offsets=torch.from_numpy(offsets),
        req_pool_indices=torch.from_numpy(rpi), pool_out=out)
    return out.numpy()


def _i64(*v):
    return np.array(v, np.int64)


SCATTER_CASES = {
    "pool_0_cols": (_i64(1, 2, 3), _i64(0, 3), _i64(1), (3, 0)),
    "pool_0x0_no_request": (_i64(1, 2, 3), _i64(0), _i64(), (0, 0)),
    "pool_0_rows_no_tokens": (_i64(), _i64(0, 0), _i64(1), (0, 4)),
    "no_tokens": (_i64(), _i64(0, 0, 0), _i64(1, 2), (3, 4)),
}


@pytest.mark.parametrize("runner", _runners("scatter"))
@pytest.mark.parametrize("name", sorted(SCATTER_CASES))
def test_scatter_zero_sizes_are_sglangs(sgl, name, runner):
    flat, offsets, rpi, shape = SCATTER_CASES[name]
    pool = np.full(shape, SENTINEL, np.int32)
    want = _scatter_sglang(sgl, flat, offsets, rpi, pool)
    got = _scatter_ours(runner, flat, offsets, rpi, pool)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("runner", _runners("scatter"))
def test_scatter_into_a_zero_row_pool_writes_nothing(sgl, runner):
    """SGLang's launcher accepts it (its kernel writes outside the pool) and its reference raises
    IndexError: every target row is out of range, so nothing is copied."""
    flat, offsets, rpi = _i64(1, 2, 3, 4), _i64(0, 3, 4), _i64(1, 0)
    pool = np.full((0, 4), SENTINEL, np.int32)
    with pytest.raises(IndexError):
        _scatter_sglang(sgl, flat, offsets, rpi, pool)
    got = _scatter_ours(runner, flat, offsets, rpi, pool)
    assert got.shape == (0, 4) and got.dtype == np.int32


@pytest.mark.parametrize("runner", implementations("scatter"))
def test_scatter_max_context_len_0_copies_nothing(runner):
    pool = np.full((3, 4), SENTINEL, np.int32)
    got = kc.scatter_req_token_ids(flat_in=_i64(1, 2), offsets=_i64(0, 2), req_pool_indices=_i64(1),
                                   pool_out=pool, max_context_len=0, implementation=runner)
    np.testing.assert_array_equal(np.asarray(got), pool)
