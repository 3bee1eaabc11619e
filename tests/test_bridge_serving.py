"""The bridge in a torch serving loop (CPU): bounded compiles over a growing token history, flat
memory, tensors changed in place, several threads, dropped buffer sets, and the inputs SGLang
accepts that a first bridge refused (issue 12: a source that requires grad, a column slice with an
offset, a tensor on the meta device). Expectations: SGLang 0.5.23's torch references.
"""

from __future__ import annotations

import gc
import random
import threading
import weakref

import pytest
import torch

import kvcanary_jax.bridge as bridge
from kvcanary_jax import buckets
from kvcanary_jax.testing import cases

CPU = torch.device("cpu")
BRIDGE = cases.TorchApi.bridge()


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    import os

    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _context(api, *, num_slots, ring=256, real_kv_sources=(),
             real_kv_hash_mode=bridge.RealKvHashMode.NONE, device=CPU):
    """``api``'s context (the bridge's or SGLang's) over a zero canary, a zero ring of ``ring``
    rows."""
    return cases.torch_context(
        api, canary_buf=torch.zeros(num_slots, 32, dtype=torch.uint8, device=device),
        violation_ring=cases.violation_ring(ring), kernel_kind=bridge.CanaryLaunchTag.HEAD_K_FULL,
        real_kv_sources=real_kv_sources, real_kv_hash_mode=real_kv_hash_mode)


class _Compiles:
    """Counts the executables XLA produced while active: JAX records this event around each
    compile, whether it compiles or loads the executable from the persistent compilation cache
    (the suite keeps one, see conftest.py), so a warm cache hides no compile."""

    def __enter__(self):
        from jax import monitoring

        self.n = 0

        def listener(event, duration, **kw):
            if event == "/jax/core/compile/backend_compile_duration":
                self.n += 1

        self._listener = listener
        monitoring.register_event_duration_secs_listener(listener)
        return self

    def __exit__(self, *exc):
        from jax._src import monitoring

        monitoring.unregister_event_duration_listener(self._listener)


# --------------------------------------------------------------------------------------------
# Bounded compiles


def test_bucket_is_a_power_of_two_above_the_floor():
    assert [buckets.bucket(n) for n in (0, 1, 63, 64, 65, 128, 129, 5000)] == \
        [0, 64, 64, 64, 128, 128, 256, 8192]
    assert buckets.bucket(3, floor=4) == 4 and buckets.bucket(5, floor=4) == 8
    assert buckets.num_buckets(64) == 1 and buckets.num_buckets(4000) == 7
    with pytest.raises(ValueError, match="cannot be negative"):
        buckets.bucket(-1)


def test_decode_loop_with_a_growing_history_compiles_logarithmically_with_flat_memory(sgl):
    """200 decode steps of 8 requests: the token history that scatter reads grows every step and
    each step writes 1-3 tokens per request (speculative decoding). The bridge's four launchers
    match SGLang's references step after step (checked every 20 steps), compile a number of
    kernels logarithmic in the history's length, and the process's memory stays flat."""
    rng = random.Random(0)
    bs, width, start = 8, 1024, 40
    max_reqs, num_slots = bs + 1, (bs + 1) * width + 1
    g = torch.Generator().manual_seed(0)
    rtt = torch.randperm(max_reqs * width, generator=g).add_(1).to(torch.int32)
    rtt = rtt.reshape(max_reqs, width)
    rpi = torch.arange(1, bs + 1, dtype=torch.int64)
    hist = [[rng.randrange(50000) for _ in range(start)] for _ in range(bs)]

    def state(api):
        return dict(vp=api.verify_plan.allocate(verify_capacity=bs * width,
                                                device=CPU).zero_for_testing_(),
                    wp=api.write_plan.allocate(write_req_capacity=max_reqs,
                                               device=CPU).zero_for_testing_(),
                    ctx=_context(api, num_slots=num_slots, ring=4096),
                    pool=torch.zeros(max_reqs, width, dtype=torch.int32))

    ours = state(BRIDGE)
    ref = state(cases.TorchApi.sglang(sgl))
    refs = (sgl.scatter_ref.scatter_req_token_ids_torch_reference,
            sgl.plan_ref.launch_canary_plan_kernels_torch_reference,
            sgl.verify_ref.launch_canary_verify_kernel_torch_reference,
            sgl.write_ref.launch_canary_write_kernel_torch_reference)
    ours_fns = (bridge.launch_scatter_req_token_ids_kernel, bridge.launch_canary_plan_kernels,
                bridge.launch_canary_verify_kernel, bridge.launch_canary_write_kernel)
    prefix = [start] * bs
    bridge.clear_cache()
    max_flat = max_tokens = 0
    rss = {}
    with _Compiles() as compiles:
        for step in range(200):
            new = [rng.randint(1, 3) for _ in range(bs)]
            ids, pos, ocl = [], [], []
            for r in range(bs):
                for j in range(new[r]):
                    hist[r].append(rng.randrange(50000))
                    ids.append(hist[r][-1]), pos.append(prefix[r] + j)
                    ocl.append(int(rtt[r + 1, prefix[r] + j]))
            flat = torch.tensor([t for h in hist for t in h], dtype=torch.int64)
            offs = torch.tensor([0] + [len(h) for h in hist], dtype=torch.int64).cumsum(0)
            ids, pos, ocl = (torch.tensor(v, dtype=torch.int64) for v in (ids, pos, ocl))
            kw = dict(req_pool_indices=rpi, prefix_lens=torch.tensor(prefix),
                      extend_seq_lens=torch.tensor(new), req_to_token=rtt, swa_window_size=0,
                      full_to_swa_index_mapping=None, verify_capacity=bs * width,
                      kv_token_id_vs_position_offset=0,
                      req_to_verify_expected_tokens_valid_lens=torch.tensor(
                          [len(h) - n for h, n in zip(hist, new)]))
            max_flat, max_tokens = max(max_flat, flat.shape[0]), max(max_tokens, ids.shape[0])
            for (scatter, plan, verify, write), s in ((ours_fns, ours), (refs, ref)):
                scatter(flat_in=flat, offsets=offs, req_pool_indices=rpi, pool_out=s["pool"])
                plan(verify_plan_out=s["vp"], write_plan_out=s["wp"],
                     req_to_verify_expected_tokens=s["pool"], **kw)
                verify(context=s["ctx"], plan=s["vp"], check_verify_expected_token=True)
                write(context=s["ctx"], plan=s["wp"], input_ids=ids, positions=pos,
                      out_cache_loc=ocl, enable_write_input_assert=False,
                      expected_input_tokens=None, expected_input_positions=None)
            prefix = [p + n for p, n in zip(prefix, new)]
            if step % 20 == 19:
                assert torch.equal(ours["pool"], ref["pool"]), step
                for f in ("canary_buf", "violation_write_index", "slot_run_counter",
                          "kernel_run_counter", "violation_ring"):
                    assert torch.equal(getattr(ours["ctx"], f), getattr(ref["ctx"], f)), (step, f)
                for f in bridge.VerifyPlan.__dataclass_fields__:
                    assert torch.equal(getattr(ours["vp"], f), getattr(ref["vp"], f)), (step, f)
            if step in (60, 199):
                gc.collect()
                rss[step] = _rss_mib()
    # One kernel per bucket of the growing history (scatter), per bucket of the step's tokens
    # (write), one each for plan and verify (fixed batch), plus the clamp-free first shapes.
    bound = buckets.num_buckets(max_flat) + buckets.num_buckets(max_tokens) + 2
    assert max_flat > 3000 and compiles.n <= bound, (compiles.n, bound)
    assert int(ours["ctx"].kernel_run_counter[0]) == 2 * 200  # a verify and a write per step
    assert rss[199] - rss[60] < 40, rss  # MiB; one new executable costs ~30 MB


# --------------------------------------------------------------------------------------------
# Tensors changed in place


def _verify_case(api, helpers, *, num_slots=32):
    ctx = _context(api, num_slots=num_slots)
    ctx.canary_buf.view(torch.int64)[:, 0] = torch.arange(num_slots)  # tokens = slot index
    plan = helpers.make_verify_plan(slot_indices=[1, 2, 3, 4, 5, 6], positions=[0] * 6,
                                    prev_slot_indices=[0] * 6, device=CPU)
    plan.verify_expected_tokens.copy_(torch.tensor([1, 2, 3, 4, 9, 9]))
    return ctx, plan


@pytest.fixture(scope="module")
def helpers(sgl):
    import importlib

    return importlib.import_module("sglang.test.kernels.kv_canary._canary_helpers")


def test_stride_change_in_place_after_use_is_checked_again(sgl, helpers):
    """A plan tensor re-strided in place (``as_strided_``) after several calls: the next call
    sees the new layout and raises SGLang's contiguity error, writing nothing (a recorded call
    replaying the old layout reported 4 violations where SGLang reports 2)."""
    ctx, plan = _verify_case(BRIDGE, helpers)
    rctx, rplan = _verify_case(cases.TorchApi.sglang(sgl), helpers)
    with bridge.value_checks(False):
        for _ in range(3):
            bridge.launch_canary_verify_kernel(context=ctx, plan=plan,
                                               check_verify_expected_token=True)
            sgl.verify_ref.launch_canary_verify_kernel_torch_reference(
                context=rctx, plan=rplan, check_verify_expected_token=True)
        assert torch.equal(ctx.violation_ring, rctx.violation_ring)
        assert int(ctx.violation_write_index[0]) == 6  # 2 token mismatches per call
        ring = ctx.violation_ring.clone()
        plan.verify_expected_tokens.as_strided_((3,), (2,))
        with pytest.raises(ValueError, match="must be contiguous"):
            bridge.launch_canary_verify_kernel(context=ctx, plan=plan,
                                               check_verify_expected_token=True)
    assert torch.equal(ctx.violation_ring, ring) and int(ctx.kernel_run_counter[0]) == 3


def test_scatter_pool_restrided_in_place_follows_the_new_rows(sgl):
    big = torch.zeros(8, 16, dtype=torch.int32)
    ref = big.clone()
    pool, rpool = big[:4], ref[:4]  # contiguous rows first
    args = dict(flat_in=torch.arange(1, 7), offsets=torch.tensor([0, 3, 6]),
                req_pool_indices=torch.tensor([1, 3]))
    for _ in range(3):
        bridge.launch_scatter_req_token_ids_kernel(pool_out=pool, **args)
        sgl.scatter_ref.scatter_req_token_ids_torch_reference(pool_out=rpool, **args)
    for t in (pool, rpool):  # now every other row of the buffer, 8 columns wide
        t.as_strided_((4, 8), (32, 1))
    args["flat_in"] = torch.arange(11, 17)
    bridge.launch_scatter_req_token_ids_kernel(pool_out=pool, **args)
    sgl.scatter_ref.scatter_req_token_ids_torch_reference(pool_out=rpool, **args)
    assert torch.equal(big, ref)
    assert big[6, :3].tolist() == [14, 15, 16]


# --------------------------------------------------------------------------------------------
# Threads


def _run_threads(fns):
    errors, barrier = [], threading.Barrier(len(fns))

    def run(fn):
        try:
            barrier.wait()
            fn()
        except BaseException as e:  # noqa: BLE001  (reported by the test below)
            errors.append(e)

    ts = [threading.Thread(target=run, args=(f,)) for f in fns]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert errors == []


@pytest.mark.parametrize("shared", [True, False], ids=["one_buffer_set", "own_buffer_sets"])
def test_threads_count_every_call_and_get_sglangs_results(sgl, helpers, shared):
    calls, threads = 20, 3
    sets = [_verify_case(BRIDGE, helpers) for _ in range(1 if shared else threads)]
    pools = [torch.zeros(4, 64, dtype=torch.int32) for _ in range(1 if shared else threads)]

    def worker(i):
        ctx, plan = sets[0 if shared else i]
        pool = pools[0 if shared else i]

        def fn():
            with bridge.value_checks(False):
                for c in range(calls):
                    bridge.launch_canary_verify_kernel(context=ctx, plan=plan,
                                                       check_verify_expected_token=True)
                    bridge.launch_scatter_req_token_ids_kernel(
                        flat_in=torch.full((64,), c), offsets=torch.tensor([0, 64]),
                        req_pool_indices=torch.tensor([i + 1]), pool_out=pool)
        return fn

    _run_threads([worker(i) for i in range(threads)])
    per_set = calls * (threads if shared else 1)
    for ctx, plan in sets:
        assert int(ctx.kernel_run_counter[0]) == per_set
        assert int(ctx.slot_run_counter[0]) == 6 * per_set
        assert int(ctx.violation_write_index[0]) == 2 * per_set
    # What SGLang's reference gives for one call, repeated: every ring row is one of its two.
    rctx, rplan = _verify_case(cases.TorchApi.sglang(sgl), helpers)
    sgl.verify_ref.launch_canary_verify_kernel_torch_reference(
        context=rctx, plan=rplan, check_verify_expected_token=True)
    want = sorted(map(tuple, rctx.violation_ring[:2].tolist()))
    for ctx, _ in sets:
        rows = sorted(map(tuple, ctx.violation_ring[:2 * per_set].tolist()))
        assert rows == sorted(want * per_set)
    for i in range(threads):
        pool = pools[0 if shared else i]
        assert pool[i + 1].tolist() == [calls - 1] * 64


def _write_case(api):
    """One new chain over slots 10..13 (disjoint from _verify_case's verified slots 1..6)."""
    plan = cases.torch_write_plan(api, write_offsets=[0, 4], write_seed_slot_indices=[-1],
                                  write_num_valid_reqs=1)
    toks = dict(input_ids=torch.tensor([21, 22, 23, 24]), positions=torch.arange(4),
                out_cache_loc=torch.tensor([10, 11, 12, 13]))
    return plan, toks


def test_two_launchers_on_one_context_from_two_threads_match_sglang(sgl, helpers):
    """Verify in one thread and write in another, 25 calls each, on one context: every call
    counted, nothing read after donation (a lock per launcher, not per device, crashed with
    "Array has been deleted" and lost counter updates in 3 of 3 trials), and SGLang's
    reference state for the 50 calls run one after the other."""
    calls = 25
    ctx, vplan = _verify_case(BRIDGE, helpers)
    wplan, toks = _write_case(BRIDGE)

    def verifier():
        for _ in range(calls):
            bridge.launch_canary_verify_kernel(context=ctx, plan=vplan,
                                               check_verify_expected_token=True)

    def writer():
        for _ in range(calls):
            bridge.launch_canary_write_kernel(context=ctx, plan=wplan, **toks,
                                              enable_write_input_assert=False,
                                              expected_input_tokens=None,
                                              expected_input_positions=None)

    _run_threads([verifier, writer])
    rctx, rvplan = _verify_case(cases.TorchApi.sglang(sgl), helpers)
    rwplan, rtoks = _write_case(cases.TorchApi.sglang(sgl))
    for _ in range(calls):
        sgl.verify_ref.launch_canary_verify_kernel_torch_reference(
            context=rctx, plan=rvplan, check_verify_expected_token=True)
        sgl.write_ref.launch_canary_write_kernel_torch_reference(
            context=rctx, plan=rwplan, **rtoks, enable_write_input_assert=False,
            expected_input_tokens=None, expected_input_positions=None)
    for f in ("canary_buf", "violation_write_index", "slot_run_counter", "kernel_run_counter"):
        assert torch.equal(getattr(ctx, f), getattr(rctx, f)), f
    assert int(ctx.kernel_run_counter[0]) == 2 * calls
    n = int(rctx.violation_write_index[0])
    assert sorted(map(tuple, ctx.violation_ring[:n].tolist())) == \
        sorted(map(tuple, rctx.violation_ring[:n].tolist()))


# --------------------------------------------------------------------------------------------
# Dropped buffers


def test_dropped_buffer_sets_are_released(helpers):
    """100 buffer sets of 8 MiB, each used three times and dropped: nothing of them stays (a
    first bridge kept every set's storage alive until clear_cache: ~890 MB)."""
    slots = 8 * 2**20 // 32
    plan = helpers.make_verify_plan(slot_indices=[1, 2, 3], positions=[0, 1, 2],
                                    prev_slot_indices=[-1, 1, 2], device=CPU)
    bridge.clear_cache()
    gone = []
    rss = {}
    for i in range(100):
        ctx = _context(BRIDGE, num_slots=slots)
        for _ in range(3):
            bridge.launch_canary_verify_kernel(context=ctx, plan=plan,
                                               check_verify_expected_token=False)
        assert int(ctx.kernel_run_counter[0]) == 3
        gone.append(weakref.ref(ctx.canary_buf.untyped_storage()))
        del ctx
        if i in (9, 99):
            gc.collect()
            rss[i] = _rss_mib()
    gc.collect()
    assert sum(w() is not None for w in gone) == 0
    assert rss[99] - rss[9] < 64, rss  # MiB (90 sets pinned would be 720)


# --------------------------------------------------------------------------------------------
# Issue 12: inputs SGLang accepts


def test_real_kv_source_that_requires_grad_is_accepted(sgl, helpers):
    weights = torch.randn(32, 16, requires_grad=True)  # 64 bytes per row, float32
    outs = []
    for api in (BRIDGE, cases.TorchApi.sglang(sgl)):
        src = api.real_kv_source(tensor=weights, page_size=1, num_bytes_per_token=64,
                                 read_bytes=32)
        ctx = _context(api, num_slots=32, real_kv_sources=(src,),
                       real_kv_hash_mode=bridge.RealKvHashMode.ALL)
        plan = helpers.make_write_plan(write_offsets=[0, 3], seed_slot_indices=[-1],
                                       num_valid_reqs=1, req_capacity=2, device=CPU)
        outs.append((ctx, plan))
    args = dict(input_ids=torch.tensor([5, 6, 7]), positions=torch.tensor([0, 1, 2]),
                out_cache_loc=torch.tensor([3, 9, 4]), enable_write_input_assert=False,
                expected_input_tokens=None, expected_input_positions=None)
    bridge.launch_canary_write_kernel(context=outs[0][0], plan=outs[0][1], **args)
    sgl.write_ref.launch_canary_write_kernel_torch_reference(context=outs[1][0], plan=outs[1][1],
                                                             **args)
    assert torch.equal(outs[0][0].canary_buf, outs[1][0].canary_buf)
    assert outs[0][0].canary_buf.view(torch.int64)[9, 3] != 0  # the KV hash field is filled


def test_scatter_into_a_column_slice_with_an_offset_matches_sglang(sgl):
    big, ref = (torch.full((6, 16), -3, dtype=torch.int32) for _ in range(2))
    args = dict(flat_in=torch.arange(1, 10), offsets=torch.tensor([0, 6, 9]),
                req_pool_indices=torch.tensor([5, 1]))
    bridge.launch_scatter_req_token_ids_kernel(pool_out=big[:, 2:6], **args)
    sgl.scatter_ref.scatter_req_token_ids_torch_reference(pool_out=ref[:, 2:6], **args)
    assert torch.equal(big, ref)  # columns outside the slice untouched, last row included
    assert big[5, 2:6].tolist() == [1, 2, 3, 4]


def test_plan_pool_column_slice_whose_rows_run_past_the_storage_is_refused_with_what_to_pass():
    pool = torch.zeros(4, 16, dtype=torch.int32)
    vp = bridge.VerifyPlan.allocate(verify_capacity=16, device=CPU).zero_for_testing_()
    wp = bridge.WritePlan.allocate(write_req_capacity=4, device=CPU).zero_for_testing_()
    kw = dict(verify_plan_out=vp, write_plan_out=wp, req_pool_indices=torch.tensor([1, 2]),
              prefix_lens=torch.tensor([3, 1]), extend_seq_lens=torch.tensor([1, 1]),
              req_to_token=torch.arange(64, dtype=torch.int32).reshape(4, 16),
              swa_window_size=0, full_to_swa_index_mapping=None, verify_capacity=16,
              req_to_verify_expected_tokens_valid_lens=torch.tensor([3, 1]),
              kv_token_id_vs_position_offset=0)
    before = vp.verify_slot_indices.clone()
    with pytest.raises(bridge.BridgeError) as e:
        bridge.launch_canary_plan_kernels(req_to_verify_expected_tokens=pool[:, 2:6], **kw)
    assert "req_to_verify_expected_tokens is a column slice" in str(e.value)
    assert "pass req_to_verify_expected_tokens.contiguous(), or a slice starting at column 0" \
        in str(e.value)
    assert torch.equal(vp.verify_slot_indices, before)
    # A slice starting at column 0 works, as a slice of rows that are not the storage's last.
    bridge.launch_canary_plan_kernels(req_to_verify_expected_tokens=pool[:, :8], **kw)
    bridge.launch_canary_plan_kernels(
        req_to_verify_expected_tokens=torch.zeros(8, 16, dtype=torch.int32)[:4, 2:6], **kw)


def test_meta_device_tensors_get_the_bridges_error():
    pool = torch.zeros(2, 4, dtype=torch.int32, device="meta")
    with pytest.raises(bridge.BridgeError) as e:
        bridge.launch_scatter_req_token_ids_kernel(
            flat_in=torch.zeros(3, dtype=torch.int64, device="meta"),
            offsets=torch.zeros(2, dtype=torch.int64, device="meta"),
            req_pool_indices=torch.zeros(1, dtype=torch.int64, device="meta"), pool_out=pool)
    assert str(e.value) == ("kv-canary bridge: pool_out is on the meta device, which holds no "
                            "data to run on; pass tensors on cpu or cuda")


def test_pinned_host_tensors_run_on_the_cpu_path(monkeypatch):
    """Page-locked CPU tensors (SGLang pins its token-id snapshots and offsets; on a CPU pool they
    reach the launchers as they are): torch's ``__dlpack_device__`` says kDLCUDAHost for them, its
    capsule kDLCPU. The bridge runs them as the host memory they are, with the results of the same
    launch on unpinned tensors, whichever tensor comes first. (A CPU-only torch cannot pin: the
    test makes torch report the pinned device type for the tensors it names.)"""
    from kvcanary_jax.bridge import dlpack

    flat = torch.arange(1, 7, dtype=torch.int64)
    offsets = torch.tensor([0, 2, 6])
    rows = torch.tensor([1, 3])
    pool = torch.zeros(4, 8, dtype=torch.int32)
    want = pool.clone()
    bridge.launch_scatter_req_token_ids_kernel(flat_in=flat, offsets=offsets,
                                               req_pool_indices=rows, pool_out=want)
    pinned = {pool.data_ptr(), flat.data_ptr(), offsets.data_ptr()}
    own = torch.Tensor.__dlpack_device__

    def dlpack_device(t):
        return (3, 0) if t.device.type == "cpu" and t.data_ptr() in pinned else own(t)

    monkeypatch.setattr(torch.Tensor, "__dlpack_device__", dlpack_device)
    monkeypatch.setattr(dlpack, "_DEVICES", {})  # the device looked up afresh, pinned first
    assert pool.__dlpack_device__() == (3, 0)
    bridge.launch_scatter_req_token_ids_kernel(flat_in=flat, offsets=offsets,
                                               req_pool_indices=rows, pool_out=pool)
    assert torch.equal(pool, want)
    assert pool[1, :2].tolist() == [1, 2] and pool[3, :4].tolist() == [3, 4, 5, 6]


# --------------------------------------------------------------------------------------------
# Buckets are exact, malformed offsets included


def test_bucketed_scatter_equals_the_unbucketed_op_when_offsets_run_past_flat_in():
    """With value checks off, offsets past ``flat_in``'s end: the bridge (``flat_in`` lowered at
    its bucket, the offsets clamped to the true length, a garbage tail) writes exactly what the op
    writes on the true-length array: cells past the end untouched."""
    import kvcanary_jax as kc

    flat = torch.arange(100, 170, dtype=torch.int64)  # 70 tokens -> bucket 128
    offsets = torch.tensor([-5, 20, 90, 60, 65, 200])  # negative, past the end, decreasing
    rpi = torch.tensor([0, 1, 2, 3, 4])
    pool = torch.full((5, 64), -1, dtype=torch.int32)
    with bridge.value_checks(False):
        bridge.launch_scatter_req_token_ids_kernel(flat_in=flat, offsets=offsets,
                                                   req_pool_indices=rpi, pool_out=pool)
    import jax

    with jax.enable_x64(True):
        want = kc.scatter_req_token_ids(flat_in=flat.numpy(), offsets=offsets.numpy(),
                                        req_pool_indices=rpi.numpy(),
                                        pool_out=torch.full((5, 64), -1,
                                                            dtype=torch.int32).numpy())
    assert pool.tolist() == want.tolist()
    assert pool[1, 50:].tolist() == [-1] * 14  # 90 - 20 = 70 wanted, only 50 exist past 20
    assert bridge.stats()["bucket_copies"] > 0


def test_bucketed_write_equals_the_unbucketed_op_when_offsets_run_past_the_tokens(helpers):
    import jax

    import kvcanary_jax as kc

    n = 5  # tokens -> bucket 64; the plan's ranges reach index 9
    ids, pos = torch.arange(11, 11 + n), torch.arange(n)
    ocl = torch.tensor([3, 4, 5, 6, 7])
    plan = helpers.make_write_plan(write_offsets=[0, 3, 9], seed_slot_indices=[-1, -1],
                                   num_valid_reqs=2, req_capacity=2, device=CPU)
    ctx = _context(BRIDGE, num_slots=16)
    with bridge.value_checks(False):
        bridge.launch_canary_write_kernel(context=ctx, plan=plan, input_ids=ids, positions=pos,
                                          out_cache_loc=ocl, enable_write_input_assert=False,
                                          expected_input_tokens=None,
                                          expected_input_positions=None)
    with jax.enable_x64(True):
        jctx = kc.VerifyOrWriteContext.allocate(num_slots=16, ring_capacity=256)
        jplan = cases.jax_write_plan(write_offsets=plan.write_offsets.numpy(),
                                     write_seed_slot_indices=plan.write_seed_slot_indices.numpy(),
                                     write_num_valid_reqs=int(plan.write_num_valid_reqs[0]))
        want = kc.canary_write(context=jctx, plan=jplan, input_ids=ids.numpy(),
                               positions=pos.numpy(), out_cache_loc=ocl.numpy(),
                               enable_write_input_assert=False, expected_input_tokens=None,
                               expected_input_positions=None)
    assert ctx.canary_buf.numpy().tobytes() == bytes(want.canary_buf.tobytes())
    assert int(ctx.slot_run_counter[0]) == int(want.slot_run_counter[0]) == 5


def test_per_call_layout_facts_are_checked_on_every_call(helpers):
    """What a call's cached arguments cannot know: whether a pool slice's rows fit its storage
    (the storage offset) and whether two outputs share memory (their addresses). A second call
    with the same shapes and strides is checked again."""
    kw = dict(req_pool_indices=torch.tensor([1, 2]), prefix_lens=torch.tensor([3, 1]),
              extend_seq_lens=torch.tensor([1, 1]),
              req_to_token=torch.arange(64, dtype=torch.int32).reshape(4, 16),
              swa_window_size=0, full_to_swa_index_mapping=None, verify_capacity=16,
              req_to_verify_expected_tokens_valid_lens=torch.tensor([3, 1]),
              kv_token_id_vs_position_offset=0)
    vp = bridge.VerifyPlan.allocate(verify_capacity=16, device=CPU).zero_for_testing_()
    wp = bridge.WritePlan.allocate(write_req_capacity=4, device=CPU).zero_for_testing_()
    store = torch.zeros(8, 16, dtype=torch.int32)
    bridge.launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp,
                                      req_to_verify_expected_tokens=store[:4, 2:6], **kw)
    with pytest.raises(bridge.BridgeError, match="runs past its storage"):
        bridge.launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp,
                                          req_to_verify_expected_tokens=store[4:, 2:6], **kw)
    ctx, plan = _verify_case(BRIDGE, helpers)
    bridge.launch_canary_verify_kernel(context=ctx, plan=plan, check_verify_expected_token=True)
    import dataclasses

    shared = dataclasses.replace(ctx, kernel_run_counter=ctx.slot_run_counter)
    before = ctx.slot_run_counter.clone()
    with pytest.raises(bridge.BridgeError, match="share memory"):
        bridge.launch_canary_verify_kernel(context=shared, plan=plan,
                                           check_verify_expected_token=True)
    assert torch.equal(ctx.slot_run_counter, before)
