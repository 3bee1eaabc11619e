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

import _canary_support as support
from kvcanary_jax.bench import builders
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
    ours, ref = support.run_verify(sgl, st, slots=[], etok=[], epos=[], prev=[],
                                   num_valid=num_valid, enable=enable, **_kw(runner))
    support.assert_same(ours, ref, st)
    assert (ref.widx, ref.sctr, ref.kctr) == (st.widx, st.sctr, st.kctr + 1)


CHAIN_BREAKS = dict(slots=[1, 2, 3], etok=[5, 6, 7], epos=[0, 1, 9], prev=[-1, 1, 2], num_valid=3)


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
    for e in (dict(slots=[0, 0], etok=[1, 2], epos=[0, 1], prev=[-1, 0], num_valid=2),
              dict(slots=[4, 5], etok=[1, 2], epos=[0, 1], prev=[-1, 4], num_valid=0)):
        ours, ref = support.run_verify(sgl, st, **e, **_kw(runner))
        support.assert_same(ours, ref, st)
        assert ours.canary.shape == (0, 32)


@pytest.mark.parametrize("runner", _runners("verify"))
def test_verify_zero_slot_canary_reads_zero_rows(sgl, runner):
    """Entries that read slots (SGLang's reference: IndexError; its GPU: reads outside the
    buffer): every slot is out of range and reads as a zero row, i.e. SGLang on a zero canary
    large enough to hold them. Slot -1 included."""
    e = dict(slots=[1, 2, -1, 3], etok=[5, 0, 0, 7], epos=[0, 0, 4, 1], prev=[-1, 1, 2, 2],
             num_valid=4)
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


def _verify_ours(st, runner, e, **ctx_kw):
    fn = kc.canary_verify_reference if runner == "reference" else kc.canary_verify
    plan = builders.jax_verify_plan(e["slots"], e["etok"], e["epos"], e["prev"], e["num_valid"])
    out = fn(context=support.jax_context(st, **ctx_kw), plan=plan, check_verify_expected_token=True,
             **({} if runner == "reference" else dict(implementation=runner)))
    return support.state_of(out)


@pytest.mark.parametrize("runner", _runners("verify"))
def test_verify_zero_row_real_kv_source(sgl, runner):
    """SGLang's reference raises from index_select on a 0-row source; every row past a source's
    rows reads as zero words: SGLang on a zero source with rows for every slot."""
    e = dict(slots=[1, 2, 0], etok=[-1, -1, -1], epos=[0, 1, 0], prev=[-1, 1, 0], num_valid=3)
    st = _sentinel_state(8, 4)
    empty = support.Src(np.zeros((0, 32), np.uint8), 1, 32, 32)
    zeros = support.Src(np.zeros((8, 32), np.uint8), 1, 32, 32)
    other = support.Src(np.arange(8 * 16, dtype=np.uint8).reshape(8, 16), 1, 16, 16)
    for mode in (1, 2):
        _, ref = support.run_verify(sgl, st, ours=False, sources=[zeros, other], mode=mode, **e)
        with jax.enable_x64(True):
            ours = _verify_ours(st, runner, e, sources=[empty, other], mode=mode)
        support.assert_same(ours, ref, st)


# --- write --------------------------------------------------------------------------------------


def _write(sgl, st, runner, **launch):
    return support.run_write(sgl, st, **launch, **_kw(runner))


@pytest.mark.parametrize("runner", _runners("write"))
@pytest.mark.parametrize("num_valid", [0, 2])
def test_write_zero_capacity_plan(sgl, runner, num_valid):
    st = _sentinel_state(8, 4)
    ours, ref = _write(sgl, st, runner, offsets=[0], seeds=[], num_valid=num_valid, ids=[5, 6],
                       pos=[0, 1], ocl=[1, 2])
    support.assert_same(ours, ref, st)
    assert (ref.sctr, ref.kctr) == (st.sctr, st.kctr + 1)


@pytest.mark.parametrize("runner", _runners("write"))
def test_write_zero_tokens(sgl, runner):
    st = _sentinel_state(8, 4)
    ours, ref = _write(sgl, st, runner, offsets=[0, 0, 0], seeds=[3, -1], num_valid=2, ids=[],
                       pos=[], ocl=[], assert_on=True, etok=[], epos=[])
    support.assert_same(ours, ref, st)
    assert (ref.sctr, ref.kctr) == (st.sctr, st.kctr + 1)


@pytest.mark.parametrize("runner", _runners("write"))
@pytest.mark.parametrize("widx", [0, 2])
def test_write_zero_row_ring(sgl, runner, widx):
    st = _sentinel_state(8, 0, widx=widx)
    # Request 1 seeds from slot 4, which no request writes: requests run concurrently on a GPU,
    # so a seed written in the same launch would be a race (SGLang's kernel has it too).
    ours, ref = _write(sgl, st, runner, offsets=[0, 2, 3], seeds=[-1, 4], num_valid=2,
                       ids=[5, 6, 7], pos=[0, 1, 5], ocl=[1, 2, 3], assert_on=True,
                       etok=[5, 9, 7], epos=[0, 1, 4])
    support.assert_same(ours, ref, st)
    assert ref.widx == widx + 3


@pytest.mark.parametrize("runner", _runners("write"))
def test_write_zero_slot_canary(sgl, runner):
    """Without work SGLang accepts it; with work (its reference: IndexError; its GPU: writes
    outside the buffer) every slot is out of range and skipped like a negative one, i.e. SGLang
    on the same launch with every slot negative: only kernel_run_counter moves."""
    st = _sentinel_state(0, 4)
    launch = dict(offsets=[0, 2, 3], seeds=[-1, 4], num_valid=2, ids=[5, 6, 7], pos=[0, 1, 9],
                  ocl=[1, 2, 3], assert_on=True, etok=[5, 9, 7], epos=[0, 1, 4])
    big = st.copy()
    big.canary = np.zeros((8, 32), np.uint8)
    _, ref = support.run_write(sgl, big, ours=False, **{**launch, "ocl": [-1, -1, -1],
                                                        "seeds": [-1, -1]})
    ours, _ = support.run_write(sgl, st, reference=False, **launch, **_kw(runner))
    assert ours.canary.shape == (0, 32)
    ref.canary = ours.canary
    support.assert_same(ours, ref, st)
    assert (ours.widx, ours.sctr, ours.kctr) == (st.widx, st.sctr, st.kctr + 1)
    ours, ref = _write(sgl, st, runner, **{**launch, "offsets": [0, 0, 0]})  # no work
    support.assert_same(ours, ref, st)


@pytest.mark.parametrize("runner", _runners("write"))
def test_write_zero_row_real_kv_source(sgl, runner):
    st = _sentinel_state(8, 4)
    launch = dict(offsets=[0, 3], seeds=[-1], num_valid=1, ids=[5, 6, 7], pos=[0, 1, 2],
                  ocl=[1, 2, 3])
    empty = support.Src(np.zeros((0, 32), np.uint8), 1, 32, 32)
    zeros = support.Src(np.zeros((8, 32), np.uint8), 1, 32, 32)
    _, ref = support.run_write(sgl, st, ours=False, sources=[zeros], mode=2, **launch)
    ours, _ = support.run_write(sgl, st, reference=False, sources=[empty], mode=2, **launch,
                                **_kw(runner))
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
