"""The violation ring's guard (kvcanary_jax.ops._kernel_lib): a negative write index writes no row
and stays as it is, rows go to ``w0 + j`` only below the ring's capacity (no wraparound), and the
index saturates at 2**31 - 1. Every implementation that runs here and both jnp references, on
rings pre-filled with recorded rows that must survive; where the index is in range the result is
SGLang's reference's. The bridge's value checks raise on a negative index (SGLang's reference
raises RuntimeError there too), and the runtime's reader reports it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from kvcanary_jax import consts
from kvcanary_jax import runtime as rt
from kvcanary_jax.ops.verify import canary_verify, canary_verify_reference
from kvcanary_jax.testing import cases

import _canary_support as support
import _impls
from _impls import with_tpu

CAP = 4
MAX = consts.VIOLATION_WRITE_INDEX_MAX
BAD_INDICES = (-1, -2, -CAP - 1, MAX, MAX - 1)
VERIFY_RUNNERS = with_tpu("verify") + ["reference"]
WRITE_RUNNERS = with_tpu("write") + ["reference"]


def _recorded_ring(cap=CAP):
    """A ring whose every row holds a recorded violation (distinct values)."""
    return np.arange(cap * 8, dtype=np.int64).reshape(cap, 8) + 10_000


def _state(num_slots, w0, cap=CAP):
    st = support.State.zeros(num_slots, cap)
    st.ring[:] = _recorded_ring(cap)
    st.widx = w0
    return st


def _expected_index(w0, n):
    return w0 if w0 < 0 else min(w0 + n, MAX)


# --- verify -------------------------------------------------------------------------------------


def _verify_entries(n):
    """``n`` entries on zero slots 1..n, each a position mismatch (one row each), chain check off."""
    slots = [1 + i for i in range(n)]
    return dict(verify_slot_indices=slots, verify_expected_tokens=[-1] * n,
                verify_expected_positions=[7] * n, verify_prev_slot_indices=[0] * n,
                verify_num_valid=n)


def _run_verify_ours(st, runner, e):
    fn = canary_verify_reference if runner == "reference" else canary_verify
    kw = {} if runner == "reference" else dict(implementation=runner,
                                                config=_impls.config("verify", runner))
    with jax.enable_x64(True):
        out = fn(**cases.jax_verify_args(context=support.jax_context(st), **e), **kw)
    return support.state_of(out)


@pytest.mark.parametrize("runner", VERIFY_RUNNERS)
@pytest.mark.parametrize("w0", BAD_INDICES)
@pytest.mark.parametrize("n", [1, 3, 600])
def test_verify_bad_index_writes_no_row(sgl, w0, n, runner):
    """600 entries span several blocks (programs that each claim rows on the GPU)."""
    e = _verify_entries(n)
    st = _state(n + 1, w0)
    ours = _run_verify_ours(st, runner, e)
    # What the ring guard does not touch is SGLang's: its reference on the same launch from an
    # index of 0 (the counters and the canary do not depend on the index).
    _, ref = support.run_verify(sgl, _state(n + 1, 0, cap=n), ours=False, **e)
    assert ref.widx == n
    np.testing.assert_array_equal(ours.ring, _recorded_ring())
    assert ours.widx == _expected_index(w0, n)
    np.testing.assert_array_equal(ours.canary, st.canary)
    assert (ours.sctr, ours.kctr) == (ref.sctr, ref.kctr)


def test_sglang_reference_raises_or_writes_the_last_rows_on_a_negative_index(sgl):
    """What the guard replaces: SGLang's reference slices the ring with the index."""
    with pytest.raises(RuntimeError):
        support.run_verify(sgl, _state(3, -1), ours=False, **_verify_entries(2))
    _, ref = support.run_verify(sgl, _state(3, -2), ours=False, **_verify_entries(1))
    assert ref.widx == -1 and not np.array_equal(ref.ring[CAP - 2], _recorded_ring()[CAP - 2])


@pytest.mark.parametrize("runner", VERIFY_RUNNERS)
@pytest.mark.parametrize("w0", [0, CAP - 1, CAP, CAP + 5])
def test_verify_index_in_range_is_sglangs(sgl, w0, runner):
    e = _verify_entries(3)
    st = _state(4, w0)
    st.ring[w0:] = 0  # rows not yet recorded
    if runner == "reference":
        ours, ref = support.run_verify(sgl, st, jnp_reference=True, **e)
        support.assert_same(ours, ref, st)
    else:
        support.check_verify(sgl, st, implementation=runner, **e)


@pytest.mark.parametrize("runner", VERIFY_RUNNERS)
def test_verify_index_saturates_over_launches(runner):
    e = _verify_entries(5)
    st = _state(6, MAX - 2)
    for _ in range(2):
        st = _run_verify_ours(st, runner, e)
        assert st.widx == MAX
        np.testing.assert_array_equal(st.ring, _recorded_ring())


# --- write --------------------------------------------------------------------------------------


def _write_launch(nreq, per_req):
    """``nreq`` requests of ``per_req`` tokens, each token an input-assert mismatch (one row)."""
    n = nreq * per_req
    ids = list(range(100, 100 + n))
    return dict(write_offsets=[per_req * r for r in range(nreq + 1)],
                write_seed_slot_indices=[-1] * nreq, write_num_valid_reqs=nreq, input_ids=ids,
                positions=list(range(n)), out_cache_loc=[1 + i for i in range(n)],
                enable_write_input_assert=True, expected_input_tokens=[t + 1 for t in ids],
                expected_input_positions=list(range(n)))


@pytest.mark.parametrize("runner", WRITE_RUNNERS)
@pytest.mark.parametrize("w0", BAD_INDICES)
@pytest.mark.parametrize("nreq,per_req", [(1, 1), (1, 3), (5, 2)])
def test_write_bad_index_writes_no_row(sgl, w0, nreq, per_req, runner):
    """Five requests are five programs that each claim rows on the GPU."""
    launch = _write_launch(nreq, per_req)
    n = nreq * per_req
    st = _state(n + 1, w0)
    kw = dict(jnp_reference=True) if runner == "reference" else dict(implementation=runner)
    ours, _ = support.run_write(sgl, st, reference=False, **launch, **kw)
    _, ref = support.run_write(sgl, _state(n + 1, 0, cap=n), ours=False, **launch)
    assert ref.widx == n
    np.testing.assert_array_equal(ours.ring, _recorded_ring())
    assert ours.widx == _expected_index(w0, n)
    np.testing.assert_array_equal(ours.canary, ref.canary)
    assert (ours.sctr, ours.kctr) == (ref.sctr, ref.kctr)


@pytest.mark.parametrize("runner", WRITE_RUNNERS)
@pytest.mark.parametrize("w0", [0, CAP - 1, CAP, CAP + 5])
def test_write_index_in_range_is_sglangs(sgl, w0, runner):
    st = _state(4, w0)
    st.ring[w0:] = 0
    kw = dict(jnp_reference=True) if runner == "reference" else dict(implementation=runner)
    ours, ref = support.run_write(sgl, st, **_write_launch(1, 3), **kw)
    support.assert_same(ours, ref, st)


@pytest.mark.parametrize("runner", WRITE_RUNNERS)
def test_write_index_saturates_over_launches(sgl, runner):
    st = _state(4, MAX - 1)
    kw = dict(jnp_reference=True) if runner == "reference" else dict(implementation=runner)
    for _ in range(2):
        st, _ = support.run_write(sgl, st, reference=False, **_write_launch(1, 3), **kw)
        assert st.widx == MAX
        np.testing.assert_array_equal(st.ring, _recorded_ring())


# --- the bridge's value checks and the runtime's reader -----------------------------------------


def _torch_verify(sgl, bridge, st, e):
    ctx = support.torch_context(sgl, st)
    args = cases.torch_verify_args(cases.TorchApi.sglang(sgl), context=ctx, **e)
    return ctx, lambda: bridge.launch_canary_verify_kernel(**args)


def _torch_write(sgl, bridge, st, launch):
    ctx = support.torch_context(sgl, st)
    args = cases.torch_write_args(cases.TorchApi.sglang(sgl), context=ctx, **launch)
    return ctx, lambda: bridge.launch_canary_write_kernel(**args)


@pytest.mark.parametrize("op", ["verify", "write"])
@pytest.mark.parametrize("w0", [-1, -CAP - 1])
def test_bridge_value_checks_raise_on_a_negative_index(sgl, op, w0):
    import kvcanary_jax.bridge as bridge

    st = _state(8, w0)
    if op == "verify":
        ctx, call = _torch_verify(sgl, bridge, st, _verify_entries(2))
        name = "launch_canary_verify_kernel"
    else:
        ctx, call = _torch_write(sgl, bridge, st, _write_launch(1, 2))
        name = "launch_canary_write_kernel"
    with bridge.value_checks(True), pytest.raises(RuntimeError) as e:
        call()
    assert str(e.value) == (
        f"kv-canary: {name} violation_write_index is {w0}, negative: it only counts up from 0, "
        "so something overwrote it; the ring's rows and the violation count cannot be trusted, "
        "and no violation is recorded while it stays negative")
    after = support.state_of(ctx)  # raised before anything ran
    np.testing.assert_array_equal(after.ring, st.ring)
    assert (after.widx, after.sctr, after.kctr) == (w0, 0, 0)
    with bridge.value_checks(False):  # the kernels keep the ring intact without the checks
        call()
    after = support.state_of(ctx)
    np.testing.assert_array_equal(after.ring, st.ring)
    assert (after.widx, after.kctr) == (w0, 1)


def _runtime_state(w0):
    cfg = rt.CanaryConfig(max_reqs=2, context_len=4, num_slots=8, max_bs=1, max_tokens=4,
                          ring_capacity=2)
    return dataclasses.replace(rt.init_state(cfg),
                               violation_write_index=jnp.asarray([w0], jnp.int32))


def test_runtime_reader_reports_a_negative_index():
    state = _runtime_state(-3)
    msg = ("kv-canary runtime: violation_write_index is -3, negative: it only counts up from 0, "
           "so something overwrote it; the ring's rows and the violation count cannot be "
           "trusted, and no violation is recorded while it stays negative")
    for read in (rt.violation_count, rt.read_violations):
        with pytest.raises(RuntimeError) as e:
            read(state)
        assert str(e.value) == msg
    with pytest.raises(RuntimeError):
        rt.decode_ring(np.zeros((2, 8), np.int64), -1)


def test_read_violations_refuses_a_negative_start():
    state = _runtime_state(2)
    assert len(rt.read_violations(state)) == 2 and rt.read_violations(state, start=1)[0].index == 1
    for call in (lambda: rt.read_violations(state, start=-1),
                 lambda: rt.decode_ring(np.zeros((2, 8), np.int64), 2, start=-1)):
        with pytest.raises(ValueError) as e:
            call()
        assert str(e.value) == "kv-canary runtime: start must be a ring row >= 0, got -1"


def test_runtime_reader_at_the_saturated_index():
    state = _runtime_state(MAX)
    assert rt.violation_count(state) == MAX
    assert [v.index for v in rt.read_violations(state)] == [0, 1]


@pytest.mark.gpu
@pytest.mark.parametrize("w0", [-1, MAX - 1000, 0, 40])
def test_gpu_many_programs_claim_under_the_guard(sgl, w0):
    """Hundreds of programs claim rows at once (compare-and-swap loops contending): the index
    ends exactly where the guard says, and the rows that land are distinct records of the launch
    (which ones is the atomics' order), in the right place."""
    n = 200_000
    e = _verify_entries(n)
    st = _state(n + 1, w0, cap=64)
    ours = _run_verify_ours(st, "pallas_triton", e)
    assert ours.widx == _expected_index(w0, n)
    if not 0 <= w0 < 64:  # a negative index, or one past the capacity: no row is written
        np.testing.assert_array_equal(ours.ring, st.ring)
        return
    np.testing.assert_array_equal(ours.ring[:w0], st.ring[:w0])
    rows = ours.ring[w0:]
    assert len(rows) == 64 - w0 > 0  # every row from w0 to the capacity is claimed
    # record of entry k: slot k + 1, stored position 0, expected token -1, reason 2
    assert len({int(r[1]) for r in rows}) == len(rows)
    assert all(1 <= int(r[1]) <= n and int(r[7]) == 2 and int(r[4]) == -1 for r in rows)
