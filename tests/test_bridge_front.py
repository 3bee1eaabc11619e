"""A launcher's last signature matched in C++ (:mod:`kvcanary_jax.bridge.front`): a repeated call
computes no signature, and every change the signature would see computes it again, so the call
is checked and laid out as a first call with those tensors would be. Expectations: SGLang
0.5.23's torch references, and the same calls with the front off.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref

import pytest
import torch

import kvcanary_jax.bridge as bridge
from kvcanary_jax.bridge import front, launcher
from kvcanary_jax.bridge.cache import CACHES

pytestmark = pytest.mark.torch


@pytest.fixture
def signatures(monkeypatch):
    """Counts the calls that computed their signature."""
    count = [0]
    metas = launcher._metas

    def counting(values):
        count[0] += 1
        return metas(values)

    monkeypatch.setattr(launcher, "_metas", counting)
    bridge.clear_cache()
    yield count
    bridge.clear_cache()


def _scatter_args(n=6):
    return dict(flat_in=torch.arange(1, n + 1), offsets=torch.tensor([0, n // 2, n]),
                req_pool_indices=torch.tensor([1, 3]))


def _scatter(sgl, pool, ref, **args):
    bridge.launch_scatter_req_token_ids_kernel(pool_out=pool, **args)
    sgl.scatter_ref.scatter_req_token_ids_torch_reference(pool_out=ref, **args)
    assert torch.equal(pool, ref)


def test_the_check_is_here_on_this_torch():
    assert front.available() and front.enabled()


def test_a_repeated_call_computes_its_signature_once(sgl, signatures):
    pool, ref = torch.zeros(4, 16, dtype=torch.int32), torch.zeros(4, 16, dtype=torch.int32)
    for i in range(5):
        args = _scatter_args()
        args["flat_in"] += 10 * i  # new tensors of the same layout, as a server's step makes
        _scatter(sgl, pool, ref, **args)
    assert signatures[0] == 1


def _changes():
    """(name, change): each takes the scatter's arguments and the pool, and returns new ones
    whose signature differs from the first call's."""

    def size(a, pool):
        return dict(a, req_pool_indices=torch.tensor([1, 3, 0]),
                    offsets=torch.tensor([0, 2, 4, 6])), pool

    def strides(a, pool):
        pool.as_strided_((2, 16), (32, 1))  # in place: the same tensor object, every other row
        return dict(a, req_pool_indices=torch.tensor([0, 1])), pool

    def dtype(a, pool):
        return dict(a, offsets=a["offsets"].to(torch.int32)), pool

    def type_(a, pool):
        return dict(a, req_pool_indices=a["req_pool_indices"].as_subclass(_Sub)), pool

    def requires_grad(a, pool):
        return dict(a, flat_in=a["flat_in"].double().requires_grad_()), pool

    def output_address(a, pool):
        return a, torch.zeros_like(pool)

    def bucket(a, pool):
        n = 300  # past the first bucket of the history
        return dict(a, flat_in=torch.arange(n), offsets=torch.tensor([0, 100, n])), pool

    def history_of_one(a, pool):
        return dict(a, flat_in=torch.tensor([7]), offsets=torch.tensor([0, 1, 1])), pool

    return [(f.__name__.rstrip("_"), f) for f in
            (size, strides, dtype, type_, requires_grad, output_address, bucket, history_of_one)]


class _Sub(torch.Tensor):
    pass


@pytest.mark.parametrize("name,change", _changes(), ids=[n for n, _ in _changes()])
def test_each_change_computes_the_signature_again(sgl, signatures, name, change):
    """The call after the change computes its signature, and runs (or is refused) as it does
    with the front off."""
    outcomes = []
    for on in (True, False):
        front.set_enabled(on)
        try:
            bridge.clear_cache()
            signatures[0] = 0
            base = torch.zeros(8, 16, dtype=torch.int32)
            pool = base[:4]
            args = _scatter_args()
            for _ in range(3):
                bridge.launch_scatter_req_token_ids_kernel(pool_out=pool, **args)
            assert signatures[0] == (1 if on else 3)
            args, pool = change(args, pool)
            try:
                bridge.launch_scatter_req_token_ids_kernel(pool_out=pool, **args)
                outcomes.append(("ran", base.clone(), pool.clone()))
            except (TypeError, ValueError) as e:
                outcomes.append(("refused", str(e), base.clone()))
            assert signatures[0] == (2 if on else 4)
        finally:
            front.set_enabled(True)
    (a, *x), (b, *y) = outcomes
    assert a == b and all(torch.equal(p, q) if isinstance(p, torch.Tensor) else p == q
                          for p, q in zip(x, y))


def test_a_changed_static_argument_computes_the_signature_again(sgl, signatures):
    """verify's ``check_verify_expected_token`` is in the signature, not in any tensor."""
    from tests.test_bridge_serving import _verify_case
    import importlib

    helpers = importlib.import_module("sglang.test.kernels.kv_canary._canary_helpers")
    from kvcanary_jax.testing import cases

    ctx, plan = _verify_case(cases.TorchApi.bridge(), helpers)
    rctx, rplan = _verify_case(cases.TorchApi.sglang(sgl), helpers)
    for check in (True, True, False, False, True):
        bridge.launch_canary_verify_kernel(context=ctx, plan=plan,
                                           check_verify_expected_token=check)
        sgl.verify_ref.launch_canary_verify_kernel_torch_reference(
            context=rctx, plan=rplan, check_verify_expected_token=check)
    assert torch.equal(ctx.violation_ring, rctx.violation_ring)
    assert int(ctx.violation_write_index[0]) == int(rctx.violation_write_index[0]) == 6
    assert signatures[0] == 3  # True, False, True: each change


def test_two_output_buffers_keep_a_front_each(sgl, signatures):
    """A launcher serving two pools in turn (two layers, two models) matches each call."""
    pools = [torch.zeros(4, 16, dtype=torch.int32) for _ in range(2)]
    refs = [p.clone() for p in pools]
    for i in range(6):
        _scatter(sgl, pools[i % 2], refs[i % 2], **_scatter_args())
    assert signatures[0] == 2


def test_a_tensor_passed_twice_keeps_no_front_and_runs(sgl, signatures):
    """The check refuses aliases, so such a call computes its signature every time."""
    idx = torch.tensor([0, 3, 6])
    args = dict(flat_in=torch.arange(1, 7), offsets=idx, req_pool_indices=idx[:2])
    pool, ref = torch.zeros(8, 16, dtype=torch.int32), torch.zeros(8, 16, dtype=torch.int32)
    for _ in range(3):
        _scatter(sgl, pool, ref, **args)
    pool2, ref2 = torch.zeros(8, 16, dtype=torch.int32), torch.zeros(8, 16, dtype=torch.int32)
    same = torch.tensor([0, 3, 6])
    for _ in range(3):  # one tensor as both offsets and req_pool_indices
        _scatter(sgl, pool2, ref2, flat_in=torch.arange(1, 7), offsets=same[:3],
                 req_pool_indices=same[:2])
    assert signatures[0] == 2  # distinct views are not aliases for the check
    t = torch.tensor([0, 1, 2])
    for _ in range(2):  # one tensor object as the history and the offsets
        _scatter(sgl, pool2, ref2, flat_in=t, offsets=t, req_pool_indices=torch.tensor([4, 5]))
    assert signatures[0] == 4


def test_a_front_keeps_no_tensor_alive(sgl, signatures):
    pool = torch.zeros(4, 16, dtype=torch.int32)
    args = _scatter_args()
    refs = [weakref.ref(t) for t in (*args.values(), pool)]
    for _ in range(2):
        bridge.launch_scatter_req_token_ids_kernel(pool_out=pool, **args)
    assert CACHES.front
    del args, pool
    gc.collect()
    assert all(r() is None for r in refs)


def test_clearing_the_caches_forgets_the_fronts(sgl, signatures):
    pool = torch.zeros(4, 16, dtype=torch.int32)
    bridge.launch_scatter_req_token_ids_kernel(pool_out=pool, **_scatter_args())
    assert CACHES.front
    CACHES.prepared.clear()
    assert not CACHES.front
    bridge.launch_scatter_req_token_ids_kernel(pool_out=pool, **_scatter_args())
    bridge.clear_cache()
    assert not CACHES.front


def test_the_switch_turns_the_front_off_at_import():
    code = ("import kvcanary_jax.bridge as b; from kvcanary_jax.bridge import front; "
            "print(front.available(), front.enabled())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**__import__("os").environ, "KVCANARY_BRIDGE_FRONT": "0"},
                         check=True).stdout.split()
    assert out == ["True", "False"]
    bad = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**__import__("os").environ, "KVCANARY_BRIDGE_FRONT": "maybe"})
    assert bad.returncode != 0 and "KVCANARY_BRIDGE_FRONT='maybe'" in bad.stderr


@pytest.mark.parametrize("bad", ["none", "zero_d", "list"])
def test_a_bad_history_after_a_good_call_gets_sglangs_error(sgl, signatures, bad):
    """The front held a history of 6 tokens: a call with the same pool and no history, a 0-d
    one or a list is refused with SGLang's error, as with the front off, and writes nothing."""
    flat = {"none": None, "zero_d": torch.tensor(5), "list": [1, 2, 3]}[bad]
    errors = []
    for on in (True, False):
        front.set_enabled(on)
        try:
            bridge.clear_cache()
            pool = torch.zeros(4, 16, dtype=torch.int32)
            args = _scatter_args()
            bridge.launch_scatter_req_token_ids_kernel(pool_out=pool, **args)
            before = pool.clone()
            with pytest.raises((TypeError, ValueError)) as e:
                bridge.launch_scatter_req_token_ids_kernel(pool_out=pool, **dict(args,
                                                                                  flat_in=flat))
            assert torch.equal(pool, before)
            errors.append((type(e.value), str(e.value)))
        finally:
            front.set_enabled(True)
    assert errors[0] == errors[1] and "flat_in" in errors[0][1]


def test_a_step_that_stops_scattering_runs_as_with_the_front_off(sgl, signatures):
    """``launch_canary_step`` scattering twice, then without a history (no scatter), over the
    same outputs: each call runs, and every buffer ends as with the front off."""
    from tests.test_bridge import _context

    F = sgl.fixtures
    ends = []
    for on in (True, False):
        front.set_enabled(on)
        try:
            bridge.clear_cache()
            torch.manual_seed(0)
            kv = torch.randint(0, 256, (300, 80), dtype=torch.uint8)
            src = bridge.RealKvSource(tensor=kv[:, :64], page_size=1, num_bytes_per_token=64,
                                      read_bytes=32)
            vp = bridge.VerifyPlan.allocate(verify_capacity=64, device="cpu").zero_for_testing_()
            wp = bridge.WritePlan.allocate(write_req_capacity=8, device="cpu").zero_for_testing_()
            ctx = _context(bridge.VerifyOrWriteContext, bridge.CanaryLaunchTag,
                           bridge.RealKvHashMode.ALL, num_slots=300, sources=(src,))
            pool = torch.full((8, 48), -5, dtype=torch.int32)[:, :40]
            rtt = F.make_req_to_token(kind="sparse_permuted", max_reqs=8, max_seq_len=32,
                                      device="cpu")
            ocl = torch.tensor([int(rtt[1, 0]), int(rtt[1, 1]), int(rtt[3, 0]), int(rtt[3, 1])])
            base = dict(context=ctx, verify_plan_out=vp, write_plan_out=wp,
                        req_pool_indices=torch.tensor([1, 3]),
                        prefix_lens=torch.zeros(2, dtype=torch.int64),
                        extend_seq_lens=torch.tensor([2, 2]), req_to_token=rtt,
                        input_ids=torch.tensor([11, 12, 13, 14]),
                        positions=torch.tensor([0, 1, 0, 1]), out_cache_loc=ocl,
                        req_to_verify_expected_tokens=pool,
                        req_to_verify_expected_tokens_valid_lens=torch.tensor([0, 0]),
                        check_verify_expected_token=False, enable_write_input_assert=False,
                        expected_input_tokens=None, expected_input_positions=None)
            for scatter in (True, True, False):
                bridge.launch_canary_step(**dict(
                    base, expected_token_ids=torch.tensor([7, 8, 9]) if scatter else None,
                    expected_token_offsets=torch.tensor([0, 1, 3]) if scatter else None))
            ends.append([t.clone() for t in (ctx.canary_buf, ctx.violation_ring,
                                             ctx.violation_write_index, pool)])
        finally:
            front.set_enabled(True)
    assert all(torch.equal(a, b) for a, b in zip(*ends))
    assert int(ends[0][2][0]) >= 0 and ends[0][3][1, :1].tolist() == [7]
