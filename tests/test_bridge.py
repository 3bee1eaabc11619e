"""The torch bridge: SGLang's own differential helpers and invariants with our launchers substituted
for SGLang's kernels, zero-copy hand-over, the view cache, strided views, x64, bad input, streams.

Expectations come from SGLang 0.5.23's torch references (the oracle), run on the same inputs by
SGLang's ``_differential`` helpers (``run_plan_diff`` / ``run_write_diff`` / ``run_verify_diff``)
whose kernel side is monkeypatched to the bridge's launchers.
"""

from __future__ import annotations

import random
import weakref

import pytest
import torch

import jax

import kvcanary_jax.bridge as bridge
from kvcanary_jax.bridge import dlpack, views

import _tier
from kvcanary_jax.bridge import launch_canary_step

CPU = torch.device("cpu")
DEVICES = [pytest.param(CPU, id="cpu"),
           pytest.param(torch.device("cuda"), id="cuda", marks=pytest.mark.gpu)]


# --------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture
def diff(sgl, monkeypatch):
    """SGLang's differential helpers with the bridge's launchers as the kernel side."""
    d = sgl.differential
    monkeypatch.setattr(d, "launch_canary_plan_kernels", bridge.launch_canary_plan_kernels)
    monkeypatch.setattr(d, "launch_canary_verify_kernel", bridge.launch_canary_verify_kernel)
    monkeypatch.setattr(d, "launch_canary_write_kernel", bridge.launch_canary_write_kernel)
    if not torch.cuda.is_available():
        # The helpers synchronise CUDA after both launches; on CPU there is nothing to wait for.
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    return d


@pytest.fixture(scope="module")
def helpers(sgl):
    import importlib

    return importlib.import_module("sglang.test.kernels.kv_canary._canary_helpers")


def _snapshot(*objs):
    out = []
    for o in objs:
        if isinstance(o, torch.Tensor):
            out.append(o.clone())
        elif o is None:
            out.append(None)
        else:
            out.append(_snapshot(*[getattr(o, f) for f in o.__dataclass_fields__
                                   if isinstance(getattr(o, f), torch.Tensor)]))
    return out


def _same(a, b):
    if isinstance(a, list):
        return all(_same(x, y) for x, y in zip(a, b))
    if a is None:
        return b is None
    return torch.equal(a, b)


def _context(cls_ctx, tag, mode, *, num_slots=64, ring=64, device=CPU, sources=(), counters=None):
    if counters is None:
        sctr = torch.zeros(1, dtype=torch.int64, device=device)
        kctr = torch.zeros(1, dtype=torch.int64, device=device)
    else:
        sctr, kctr = counters
    return cls_ctx(
        canary_buf=torch.zeros(num_slots, 32, dtype=torch.uint8, device=device),
        kernel_kind=tag.HEAD_K_FULL,
        violation_ring=torch.zeros(ring, 8, dtype=torch.int64, device=device),
        violation_write_index=torch.zeros(1, dtype=torch.int32, device=device),
        slot_run_counter=sctr, kernel_run_counter=kctr, real_kv_sources=sources,
        real_kv_hash_mode=mode,
        enable_chain_position_assert=torch.ones(1, dtype=torch.int32, device=device),
    )


# --------------------------------------------------------------------------------------------
# 1. Differential against SGLang's references, through SGLang's own helpers


def _plan_case(rng, sgl, device, *, bs=6, max_reqs=8, width=32):
    F = sgl.fixtures
    rtt = F.make_req_to_token(kind="sparse_permuted", max_reqs=max_reqs, max_seq_len=width,
                              device=device, rng=rng)
    rows = list(range(1, max_reqs))
    rng.shuffle(rows)
    pad = F.make_padding_mask(bs=bs, kind=rng.choice(["none", "trailing", "interleaved"]), rng=rng)
    rpi = torch.tensor([0 if p else rows[i] for i, p in enumerate(pad)], dtype=torch.int64,
                       device=device)
    prefix = torch.tensor([rng.randint(0, width - 4) for _ in range(bs)], dtype=torch.int64,
                          device=device)
    extend = torch.tensor([rng.randint(0, 4) for _ in range(bs)], dtype=torch.int64,
                          device=device)
    return rtt, rpi, prefix, extend


@pytest.mark.parametrize("device", DEVICES)
def test_plan_matches_sglang_reference_through_its_differential_helper(sgl, diff, device):
    rng = random.Random(1)
    inv = sgl.invariants.PlanInvariants
    n_cases = 0
    for case in range(24):
        rtt, rpi, prefix, extend = _plan_case(rng, sgl, device)
        swa = rng.choice([0, 0, 5])
        lut = (sgl.fixtures.make_lut(kind=rng.choice(["identity", "permutation"]),
                                     pool_size=rtt.numel(), device=device, rng=rng)
               if swa or rng.random() < 0.3 else None)
        cap = rng.choice([64, 256, 8])  # 8: overflow (enable = 0) on most cases
        pool = valid = None
        if rng.random() < 0.5:
            pool = torch.randint(0, 1000, (8, 40), dtype=torch.int32, device=device)
            valid = torch.randint(0, 40, (rpi.shape[0],), dtype=torch.int64, device=device)
        k = rng.choice([0, 1])
        ours = (bridge.VerifyPlan.allocate(verify_capacity=cap, device=device).zero_for_testing_(),
                bridge.WritePlan.allocate(write_req_capacity=8, device=device).zero_for_testing_())
        ref = (
            sgl.verify.VerifyPlan.allocate(verify_capacity=cap, device=device).zero_for_testing_(),
            sgl.write.WritePlan.allocate(write_req_capacity=8, device=device).zero_for_testing_(),
        )
        diff.run_plan_diff(
            plan_pair=(ours, ref), req_pool_indices=rpi, prefix_lens=prefix,
            extend_seq_lens=extend, req_to_token=rtt, extras=None, swa_window_size=swa,
            full_to_swa_index_mapping=lut, req_to_verify_expected_tokens=pool,
            req_to_verify_expected_tokens_valid_lens=valid, kv_token_id_vs_position_offset=k,
        )
        # Whole plans equal, tails included (both sides start from zero_for_testing_).
        for f in bridge.VerifyPlan.__dataclass_fields__:
            assert torch.equal(getattr(ours[0], f), getattr(ref[0], f)), (case, f)
        for f in bridge.WritePlan.__dataclass_fields__:
            assert torch.equal(getattr(ours[1], f), getattr(ref[1], f)), (case, f)
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        inv.assert_all(verify_plan=ours[0], write_plan=ours[1], req_pool_indices=rpi,
                       prefix_lens=prefix, extend_seq_lens=extend, swa_window_size=swa,
                       extras_slot_indices=empty, extras_positions=empty,
                       extras_prev_slot_indices=empty, extras_count=0)
        n_cases += 1
    assert n_cases == 24


def _write_case(rng, helpers, device, *, n_tokens=16, num_slots=64, cap=4):
    nreq = rng.randint(0, cap)
    cuts = sorted(rng.randint(0, n_tokens) for _ in range(nreq))
    offsets = [0] + cuts
    seeds = [rng.choice([-1, rng.randint(1, num_slots - 1)]) for _ in range(nreq)]
    plans = helpers.make_write_plan_pair(write_offsets=offsets, seed_slot_indices=seeds,
                                         num_valid_reqs=nreq, req_capacity=cap, device=device)
    slots = rng.sample(range(1, num_slots), n_tokens)
    ocl = torch.tensor([s if rng.random() > 0.15 else -1 for s in slots], dtype=torch.int64,
                       device=device)
    ids = torch.tensor([rng.randint(-2**40, 2**40) for _ in range(n_tokens)], dtype=torch.int64,
                       device=device)
    pos = torch.tensor([rng.randint(0, 50) for _ in range(n_tokens)], dtype=torch.int64,
                       device=device)
    etok = torch.where(torch.rand(n_tokens, device=device) < 0.2, ids + 1, ids)
    epos = torch.where(torch.rand(n_tokens, device=device) < 0.2, pos + 1, pos)
    return plans, ids, pos, ocl, etok, epos


def _ring_rows(log):
    n = int(log.write_index[0])
    assert n <= log.ring.shape[0], "ring overflowed: the multiset comparison needs every row"
    return sorted(tuple(r) for r in log.ring[:n].tolist())


def _assert_logs_match(ours, ref, *, bufs=None):
    """On the GPU requests and entries run in parallel, so (as with SGLang's own CUDA kernels)
    the order of ring rows across them is unspecified: rows compared as multisets, the write
    index, counters and unused ring rows exactly. (CPU: SGLang's exact comparison already ran.)"""
    if bufs is not None:
        assert torch.equal(bufs[0], bufs[1]), "canary_buf diverged"
    for name in ("write_index", "slot_run_counter", "kernel_run_counter"):
        assert torch.equal(getattr(ours, name), getattr(ref, name)), name
    assert _ring_rows(ours) == _ring_rows(ref)
    n = int(ours.write_index[0])
    assert torch.equal(ours.ring[n:], ref.ring[n:])


@pytest.mark.fuzz
@pytest.mark.parametrize("device", DEVICES)
def test_write_then_verify_match_sglang_reference_through_its_differential_helpers(
        sgl, diff, helpers, device):
    rng = random.Random(2)
    torch.manual_seed(2)
    F = sgl.fixtures
    mode_cls, inv = sgl.consts.RealKvHashMode, sgl.invariants
    exact = device.type == "cpu"  # SGLang's helpers compare the ring in order
    n_cases = 0
    _tier.seeded("bridge write/verify differential", 2, _tier.n(6, 16))
    for case in range(_tier.n(6, 16)):
        n_src = rng.choice([0, 0, 1, 2])
        mode = mode_cls(rng.choice([1, 2])) if n_src else mode_cls.NONE
        # row_gap > 0: strided per-layer views into a wider buffer (rows stepped by stride(0)).
        srcs = F.make_real_kv_sources(count=n_src, num_bytes_per_token=32, num_slots=64,
                                      device=device, rng=rng, fill_strategy="random_bytes",
                                      row_gap=rng.choice([0, 16]))
        src_pair = (srcs, F.clone_real_kv_sources(srcs))
        bufs = helpers.make_canary_buf_pair(num_slots=64, device=device)
        for b in bufs:  # some history in the buffer: seeds read real rows
            b.copy_(torch.randint(0, 256, tuple(b.shape), dtype=torch.uint8))
        bufs[1].copy_(bufs[0])
        plans, ids, pos, ocl, etok, epos = _write_case(rng, helpers, device)
        assert_on = rng.random() < 0.5
        before = bufs[0].clone()
        logs = diff.run_write_diff(
            buf_pair=bufs, plan_pair=plans, input_ids=ids, positions=pos, out_cache_loc=ocl,
            expected_input_tokens=etok, expected_input_positions=epos,
            enable_write_verify_inputs=assert_on, real_kv_sources_pair=src_pair,
            real_kv_hash_mode=mode, device=device, assert_equal=exact,
        )
        _assert_logs_match(*logs, bufs=bufs)
        empty_log = helpers.FakeViolationLog.allocate(device=device)
        n = int(plans[0].write_num_valid_reqs[0])
        if all(s < 0 for s in plans[0].write_seed_slot_indices[:n].tolist()):
            # (SGLang's write invariants count input-assert rows only: no chain-position rows.)
            inv.WriteInvariants.assert_all(
                canary_buf_before=before, canary_buf_after=bufs[0], plan=plans[0],
                input_ids=ids, positions=pos, out_cache_loc=ocl,
                enable_write_verify_inputs=assert_on, expected_input_tokens=etok,
                expected_input_positions=epos, log_before=empty_log, log_after=logs[0],
            )
        # Verify the slots just written (chains from the plan), some corrupted.
        offs = plans[0].write_offsets.tolist()
        slots, poss, prevs = [], [], []
        for r in range(n):
            prev = int(plans[0].write_seed_slot_indices[r])
            for i in range(offs[r], offs[r + 1]):
                s = int(ocl[i])
                if s < 0:
                    continue
                slots.append(s), poss.append(int(pos[i])), prevs.append(prev)
                prev = s
        if rng.random() < 0.5 and slots:
            victim, byte = rng.choice(slots), rng.randint(0, 31)
            for b in bufs:
                b[victim, byte] ^= 0x5A
            if n_src:
                for pair in src_pair:
                    pair[0].tensor[victim // pair[0].page_size, 0] ^= 1
        vplans = helpers.make_verify_plan_pair(
            slot_indices=slots, positions=poss, prev_slot_indices=prevs,
            expected_input_ids=[int(ids[ocl.tolist().index(s)]) if rng.random() < 0.8 else -5
                                for s in slots],
            capacity=max(len(slots), 1) + 3, device=device)
        before = bufs[0].clone()
        vlogs = diff.run_verify_diff(
            buf_pair=bufs, plan_pair=vplans, real_kv_sources_pair=src_pair,
            real_kv_hash_mode=mode, device=device,
            check_verify_expected_token=rng.random() < 0.5, assert_equal=exact,
        )
        _assert_logs_match(*vlogs, bufs=bufs)
        inv.VerifyInvariants.assert_all(
            canary_buf_before=before, canary_buf_after=bufs[0], log_before=empty_log,
            log_after=vlogs[0], plan=vplans[0], kernel_kind=sgl.verify.CanaryLaunchTag.HEAD_K_FULL,
        )
        n_cases += 1
    assert n_cases == _tier.n(6, 16)


@pytest.mark.parametrize("device", DEVICES)
def test_scatter_matches_sglang_reference_including_strided_pool_view(sgl, device):
    rng = random.Random(3)
    ref_fn = sgl.scatter_ref.scatter_req_token_ids_torch_reference
    for case in range(12):
        bs = rng.randint(1, 6)
        lens = [rng.randint(0, 40) for _ in range(bs)]
        offsets = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int64,
                               device=device)
        flat = torch.randint(-2**40, 2**40, (int(offsets[-1]),), dtype=torch.int64, device=device)
        rpi = torch.tensor(rng.sample(range(8), bs), dtype=torch.int64, device=device)
        big = torch.randint(-100, 100, (8, 48), dtype=torch.int32, device=device)
        strided = case % 2 == 1
        ours = big.clone()
        ref = big.clone()
        view, rview = (ours[:, :32], ref[:, :32]) if strided else (ours, ref)
        ptr = view.data_ptr()
        bridge.launch_scatter_req_token_ids_kernel(flat_in=flat, offsets=offsets,
                                                   req_pool_indices=rpi, pool_out=view)
        ref_fn(flat_in=flat, offsets=offsets, req_pool_indices=rpi, pool_out=rview)
        assert view.data_ptr() == ptr
        assert torch.equal(ours, ref), case  # columns outside the view untouched too


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("inference,launch_inside", [(False, False), (True, False), (False, True)],
                         ids=["tensors", "inference_tensors", "inside_inference_mode"])
def test_fused_step_equals_the_four_sglang_references_in_sequence(sgl, device, inference,
                                                                  launch_inside):
    """``inference_tensors``: the step's buffers allocated under ``torch.inference_mode()`` (as a
    server's model runner may) and the step launched outside it; ``inside_inference_mode``: the
    reverse. torch refuses an in-place update
    of such a tensor outside the mode: the copies that stand in for a kernel's writes failed after
    the kernels ran, leaving the step half written. SGLang's kernels write the memory directly."""
    F = sgl.fixtures
    rng = random.Random(4)

    # Per-layer KV rows with a gap after each (a strided real-KV source).
    kv = torch.randint(0, 256, (300, 64 + 16), dtype=torch.uint8).to(device)

    def state(VP, WP, Ctx, Tag, Mode, Src):
        src = Src(tensor=kv[:, :64], page_size=1, num_bytes_per_token=64, read_bytes=32)
        return dict(
            vp=VP.allocate(verify_capacity=64, device=device).zero_for_testing_(),
            wp=WP.allocate(write_req_capacity=8, device=device).zero_for_testing_(),
            ctx=_context(Ctx, Tag, Mode.ALL, num_slots=300, sources=(src,), device=device),
            pool=torch.full((8, 48), -5, dtype=torch.int32, device=device),
        )

    rtt = F.make_req_to_token(kind="sparse_permuted", max_reqs=8, max_seq_len=32, device=device)
    with torch.inference_mode(inference):
        ours = state(bridge.VerifyPlan, bridge.WritePlan, bridge.VerifyOrWriteContext,
                     bridge.CanaryLaunchTag, bridge.RealKvHashMode, bridge.RealKvSource)
    assert ours["ctx"].violation_ring.is_inference() == inference
    ref = state(sgl.verify.VerifyPlan, sgl.write.WritePlan, sgl.verify.VerifyOrWriteContext,
                sgl.verify.CanaryLaunchTag, sgl.consts.RealKvHashMode, sgl.verify.RealKvSource)
    prefix = torch.zeros(4, dtype=torch.int64, device=device)
    rpi = torch.tensor([1, 0, 3, 5], device=device)
    hist = {1: [], 3: [], 5: []}
    for step in range(3):  # prefill, then decodes: each step verifies what the last one wrote
        extend = torch.tensor([rng.randint(1, 5) if r else 0 for r in rpi.tolist()], device=device)
        ids, pos, ocl = [], [], []
        for r, p, e in zip(rpi.tolist(), prefix.tolist(), extend.tolist()):
            if r == 0:
                continue
            for j in range(e):
                tok = rng.randint(0, 2**33)
                hist[r].append(tok)
                ids.append(tok), pos.append(p + j), ocl.append(int(rtt[r, p + j]))
        ids, pos, ocl = (torch.tensor(v, dtype=torch.int64, device=device) for v in (ids, pos, ocl))
        flat = torch.tensor([t for r in rpi.tolist() for t in hist.get(r, [])], dtype=torch.int64,
                            device=device)
        offs = torch.tensor([0] + list(torch.tensor([len(hist.get(r, [])) for r in
                                                     rpi.tolist()]).cumsum(0)), dtype=torch.int64,
                            device=device)
        valid = torch.tensor([len(hist.get(r, [])) for r in rpi.tolist()], dtype=torch.int64,
                             device=device)
        kw = dict(req_pool_indices=rpi, prefix_lens=prefix, extend_seq_lens=extend,
                  req_to_token=rtt)
        pool_view = ours["pool"][:, :40]  # strided expected-token pool
        with torch.inference_mode(launch_inside):
            launch_canary_step(
                context=ours["ctx"], verify_plan_out=ours["vp"], write_plan_out=ours["wp"], **kw,
                input_ids=ids, positions=pos, out_cache_loc=ocl,
                req_to_verify_expected_tokens=pool_view,
                req_to_verify_expected_tokens_valid_lens=valid, expected_token_ids=flat,
                expected_token_offsets=offs, check_verify_expected_token=True,
                enable_write_input_assert=True, expected_input_tokens=ids,
                expected_input_positions=pos)
        rpool = ref["pool"][:, :40]
        sgl.scatter_ref.scatter_req_token_ids_torch_reference(
            flat_in=flat, offsets=offs, req_pool_indices=rpi, pool_out=rpool)
        sgl.plan_ref.launch_canary_plan_kernels_torch_reference(
            verify_plan_out=ref["vp"], write_plan_out=ref["wp"], **kw, swa_window_size=0,
            full_to_swa_index_mapping=None, verify_capacity=64,
            req_to_verify_expected_tokens=rpool, req_to_verify_expected_tokens_valid_lens=valid,
            kv_token_id_vs_position_offset=0)
        sgl.verify_ref.launch_canary_verify_kernel_torch_reference(
            context=ref["ctx"], plan=ref["vp"], check_verify_expected_token=True)
        sgl.write_ref.launch_canary_write_kernel_torch_reference(
            context=ref["ctx"], plan=ref["wp"], input_ids=ids, positions=pos, out_cache_loc=ocl,
            enable_write_input_assert=True, expected_input_tokens=ids,
            expected_input_positions=pos)
        for f in ("canary_buf", "violation_write_index", "slot_run_counter",
                  "kernel_run_counter"):
            assert torch.equal(getattr(ours["ctx"], f), getattr(ref["ctx"], f)), (step, f)
        if device.type == "cpu":
            assert torch.equal(ours["ctx"].violation_ring, ref["ctx"].violation_ring), step
        else:  # parallel entries: ring order unspecified (as in SGLang's CUDA kernels)
            n = int(ours["ctx"].violation_write_index[0])
            assert n <= 64
            assert sorted(map(tuple, ours["ctx"].violation_ring[:n].tolist())) == \
                sorted(map(tuple, ref["ctx"].violation_ring[:n].tolist())), step
        for f in bridge.VerifyPlan.__dataclass_fields__:
            assert torch.equal(getattr(ours["vp"], f), getattr(ref["vp"], f)), (step, f)
        for f in bridge.WritePlan.__dataclass_fields__:
            assert torch.equal(getattr(ours["wp"], f), getattr(ref["wp"], f)), (step, f)
        assert torch.equal(ours["pool"], ref["pool"])
        prefix = prefix + extend
        if step == 1:  # the model "rewrites" one cached token's KV: the next verify flags it
            kv[int(rtt[3, 0]), 5] ^= 0xFF
    assert int(ours["ctx"].violation_write_index[0]) > 0


# --------------------------------------------------------------------------------------------
# 2. Zero-copy in, in place out, the cache


def test_import_is_zero_copy_and_int64_under_scoped_x64():
    assert not jax.config.read("jax_enable_x64")
    t = torch.arange(64, dtype=torch.int64) * (2**40)
    info = dlpack.device_info(t, "t")
    with dlpack.x64_scope():
        a = dlpack.import_tensor(t, info)
    assert a.dtype == jax.numpy.int64
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    assert int(a[5]) == 5 * 2**40
    assert not jax.config.read("jax_enable_x64")  # the caller's flag is untouched


def test_cpu_import_of_unaligned_view_copies_and_is_never_cached():
    # JAX's CPU client imports zero-copy only from 64-byte aligned addresses; a 1-element view
    # into a counters array 8 bytes in is copied, so serving it twice would return stale data.
    bridge.clear_cache()
    counters = torch.zeros(12, dtype=torch.int64)
    ctx = _context(bridge.VerifyOrWriteContext, bridge.CanaryLaunchTag, bridge.RealKvHashMode.NONE,
                   counters=(counters[1:2], counters[7:8]))
    vp = bridge.VerifyPlan.allocate(verify_capacity=4, device=CPU).zero_for_testing_()
    vp.enable.fill_(1)
    for _ in range(3):
        bridge.launch_canary_verify_kernel(context=ctx, plan=vp, check_verify_expected_token=False)
    cache = views.for_device(CPU)
    assert cache.get(ctx.kernel_run_counter, ((1,), "dense")) is None
    assert counters[7] == 3


def test_launchers_update_in_place_keep_objects_and_pointers(sgl, helpers):
    ctx = _context(bridge.VerifyOrWriteContext, bridge.CanaryLaunchTag, bridge.RealKvHashMode.NONE)
    plan = helpers.make_write_plan(write_offsets=[0, 2], seed_slot_indices=[-1], num_valid_reqs=1,
                                   req_capacity=2, device=CPU)
    ptrs = {f: getattr(ctx, f).data_ptr() for f in ("canary_buf", "violation_ring")}
    objs = {f: getattr(ctx, f) for f in ("canary_buf", "violation_ring")}
    ctx.canary_buf[40:].fill_(0xAB)  # untouched rows keep their contents
    for _ in range(3):
        ret = bridge.launch_canary_write_kernel(
            context=ctx, plan=plan, input_ids=torch.tensor([7, 8]), positions=torch.tensor([0, 1]),
            out_cache_loc=torch.tensor([3, 4]), enable_write_input_assert=False,
            expected_input_tokens=None, expected_input_positions=None)
        assert ret is None
    assert int(ctx.kernel_run_counter[0]) == 3 and int(ctx.slot_run_counter[0]) == 6
    assert ctx.canary_buf.view(torch.int64)[3, 0] == 7
    assert bool((ctx.canary_buf[40:] == 0xAB).all())
    for f in ptrs:
        assert getattr(ctx, f) is objs[f] and getattr(ctx, f).data_ptr() == ptrs[f]


def test_view_cache_hits_on_persistent_tensors_and_misses_on_moved_ones():
    bridge.clear_cache()
    pool = torch.zeros(4, 8, dtype=torch.int32)
    rpi, offs = torch.tensor([1]), torch.tensor([0, 3])
    flat = torch.tensor([1, 2, 3])
    cache = views.for_device(CPU)
    for _ in range(3):
        bridge.launch_scatter_req_token_ids_kernel(flat_in=flat, offsets=offs,
                                                   req_pool_indices=rpi, pool_out=pool)
    assert cache.get(rpi, ((1,), "dense")) is not None
    hits = bridge.stats().get("view_hits", 0)
    bridge.launch_scatter_req_token_ids_kernel(flat_in=flat, offsets=offs, req_pool_indices=rpi,
                                               pool_out=pool)
    assert bridge.stats()["view_hits"] >= hits + 1  # rpi (outputs are donated on every call)
    # The same object pointed at new memory (set_) misses and is imported again: never stale.
    rpi.set_(torch.tensor([2]))
    bridge.launch_scatter_req_token_ids_kernel(flat_in=flat, offsets=offs, req_pool_indices=rpi,
                                               pool_out=pool)
    assert pool[2, :3].tolist() == [1, 2, 3]
    bridge.clear_cache()
    assert len(cache) == 0


def test_temporaries_are_not_kept_alive_by_the_cache():
    bridge.clear_cache()
    pool = torch.zeros(4, 8, dtype=torch.int32)
    for i in range(5):  # a fresh flat_in every step, as a serving loop builds it
        flat = torch.tensor([i, i, i])
        w = weakref.ref(flat.untyped_storage())
        bridge.launch_scatter_req_token_ids_kernel(flat_in=flat, offsets=torch.tensor([0, 3]),
                                                   req_pool_indices=torch.tensor([1]),
                                                   pool_out=pool)
        del flat
        assert w() is None  # freed at once: no JAX view pins it
    assert pool[1, :3].tolist() == [4, 4, 4]


def test_a_cached_tensor_freed_inside_the_cache_lock_neither_deadlocks_nor_leaks():
    """The garbage collector may run at any allocation inside the view cache's critical section
    and free a cached tensor there; its weakref callback used to wait for the lock its own
    thread held (a hang inside a launch). Freed while the lock is held, the entry goes when the
    holder leaves; freed otherwise, at once."""
    import threading

    class Array:  # what the cache asks of a JAX array
        def is_deleted(self):
            return False

    cache, arrays = views.ViewCache(), (Array(), Array())
    kept, freed = torch.zeros(4), torch.zeros(4)
    cache.put(kept, arrays[0])
    cache.put(freed, arrays[1])

    def free_inside():
        with cache._lock:  # as the collector would, mid-put
            nonlocal freed
            del freed
        assert cache.get(kept) is arrays[0]  # the holder's way out removes the queued entry

    worker = threading.Thread(target=free_inside, daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), "a weakref callback waited for its own thread's lock"
    assert len(cache._d) == 1 and len(cache) == 1
    del kept
    assert len(cache._d) == 0  # no holder: removed by the callback at once


def _python(code: str) -> str:
    """``code`` run by this Python in a process of its own; its stdout (it must exit 0)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_cpu_imports_are_tracked_until_released_and_kept_after_the_exit_hook():
    """XLA's CPU client ends a launch on a worker thread, which may hold the operands a moment
    after the results are ready. Where that thread dropped the last reference to an import
    during the interpreter's finalization, torch's DLPack deleter took the GIL there and the
    process aborted ("terminate called without an active exception", after the script's last
    line). Every CPU import is tracked until its torch alias dies; the exit hook waits for
    those released by Python but still held by a worker, and keeps the cached ones."""
    import time

    bridge.clear_cache()
    pool = torch.zeros(4, 8, dtype=torch.int32)
    for i in range(50):  # fresh temporaries every call: their entries go with them
        bridge.launch_scatter_req_token_ids_kernel(
            flat_in=torch.tensor([i, i]), offsets=torch.tensor([0, 2]),
            req_pool_indices=torch.tensor([1]), pool_out=pool)
    deadline = time.monotonic() + 5
    while dlpack.released_but_held() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert dlpack.released_but_held() == 0
    assert len(dlpack._IMPORTS) <= 8  # the cached imports' entries, not one per call
    assert pool[1, :2].tolist() == [49, 49]

    code = ("import gc, torch; import kvcanary_jax.bridge as bridge; "
            "from kvcanary_jax.bridge import dlpack, views; "
            "pool, flat = torch.zeros(2, 4, dtype=torch.int32), torch.tensor([1, 2]); "
            "offs, rpi = torch.tensor([0, 2]), torch.tensor([1]); "
            "bridge.launch_scatter_req_token_ids_kernel(flat_in=flat, offsets=offs, "
            "req_pool_indices=rpi, pool_out=pool); "
            "cache = views.for_device(torch.device('cpu')); before = len(cache); "
            "views._freeze(); del pool, flat, offs, rpi; gc.collect(); "
            "print(before, len(cache), dlpack.released_but_held())")
    before, after, held = _python(code).split()
    # After the exit hook the cached views stay though their tensors died, and nothing
    # released is left to a worker.
    assert int(before) >= 1 and after == before and held == "0"


def test_a_cpu_launch_after_the_exit_hook_waits_for_its_imports():
    """An ``atexit`` handler registered before the bridge was imported runs after the bridge's
    exit hook; a CPU launch from it returns only once no import it released is held by a worker
    (the hook's wait, per call), and the process exits cleanly."""
    code = (
        "import atexit, torch\n"
        "def late():\n"
        "    import kvcanary_jax.bridge as bridge\n"
        "    from kvcanary_jax.bridge import dlpack, views\n"
        "    assert views._FROZEN.is_set()\n"
        "    pool, held = torch.zeros(4, 8, dtype=torch.int32), []\n"
        "    for i in range(30):\n"
        "        bridge.launch_scatter_req_token_ids_kernel(\n"
        "            flat_in=torch.tensor([i, i, i]), offsets=torch.tensor([0, 3]),\n"
        "            req_pool_indices=torch.tensor([2]), pool_out=pool)\n"
        "        held.append(dlpack.released_but_held())\n"
        "    print(pool[2, :3].tolist(), max(held))\n"
        "atexit.register(late)\n"
        "import kvcanary_jax.bridge\n")
    out = _python(code)
    assert out.split("\n")[0] == "[29, 29, 29] 0", out


def test_an_import_held_past_its_array_or_its_donation_is_waited_for_and_a_carried_one_is_not():
    """What the exit hook waits for: an import whose torch alias is alive while the JAX array
    that held it is gone or deleted (a donated operand that a worker may still hold). An import
    whose memory a launch's result took over (:func:`dlpack.carry_import`) is held by that
    result, and is not waited for while the result lives."""
    import jax.numpy as jnp

    base = dlpack.released_but_held()
    donated, alias = jnp.zeros(3), torch.zeros(3)
    donated.delete()
    dlpack.track_import(donated, alias)
    assert dlpack.released_but_held() == base + 1
    result = jnp.ones(3)
    dlpack.carry_import(donated, result)  # the result holds the import now
    assert dlpack.released_but_held() == base
    del result
    assert dlpack.released_but_held() == base + 1
    del alias  # the alias released: nothing left to wait for
    assert dlpack.released_but_held() == base


def test_unaligned_counter_views_are_updated_in_place(sgl, helpers):  # noqa: ARG001
    counters = torch.zeros(12, dtype=torch.int64)  # per-tag counters, 1-element views into it
    ctx = _context(bridge.VerifyOrWriteContext, bridge.CanaryLaunchTag, bridge.RealKvHashMode.NONE,
                   counters=(counters[1:2], counters[7:8]))
    vp = helpers.make_verify_plan(slot_indices=[0, 0, 0], positions=[0, 0, 0],
                                  prev_slot_indices=[0, 0, 0], device=CPU)
    for _ in range(2):
        bridge.launch_canary_verify_kernel(context=ctx, plan=vp, check_verify_expected_token=False)
    assert counters.tolist() == [0, 6, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0]


# --------------------------------------------------------------------------------------------
# 3. Views JAX's DLPack refuses


def test_row_range_slice_of_req_to_token_works_and_column_slice_is_sglangs_error(sgl):
    big = sgl.fixtures.make_req_to_token(kind="linear", max_reqs=16, max_seq_len=32, device=CPU)
    shard = big[8:16]  # a DP shard's rows: contiguous, at an offset
    args = dict(req_pool_indices=torch.tensor([1, 3]), prefix_lens=torch.tensor([4, 2]),
                extend_seq_lens=torch.tensor([1, 1]), swa_window_size=0,
                full_to_swa_index_mapping=None, verify_capacity=32,
                req_to_verify_expected_tokens=None, req_to_verify_expected_tokens_valid_lens=None,
                kv_token_id_vs_position_offset=0)
    vp = bridge.VerifyPlan.allocate(verify_capacity=32, device=CPU).zero_for_testing_()
    wp = bridge.WritePlan.allocate(write_req_capacity=4, device=CPU).zero_for_testing_()
    bridge.launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, req_to_token=shard,
                                      **args)
    assert vp.verify_slot_indices[:6].tolist() == [
        int(shard[1, p]) for p in range(4)] + [int(shard[3, p]) for p in range(2)]
    before = _snapshot(vp, wp)
    with pytest.raises(ValueError, match="^kv-canary: req_to_token must be contiguous\n"):
        bridge.launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp,
                                          req_to_token=big[:, :16], **args)
    assert _same(before, _snapshot(vp, wp))


def test_inexpressible_view_is_refused_naming_the_tensor_and_nothing_changes():
    base = torch.zeros(8, 4, dtype=torch.int32)
    pool = base.t()  # column-major: no compact base to share
    before = base.clone()
    with pytest.raises(bridge.BridgeError, match="pool_out is a strided view"):
        bridge.launch_scatter_req_token_ids_kernel(
            flat_in=torch.tensor([1, 2]), offsets=torch.tensor([0, 2]),
            req_pool_indices=torch.tensor([1]), pool_out=pool)
    assert torch.equal(base, before)


# --------------------------------------------------------------------------------------------
# 4. Bad input: SGLang's error (class and words) before any launch, tensors unchanged


def _scatter_args():
    return dict(flat_in=torch.tensor([1, 2, 3]), offsets=torch.tensor([0, 3]),
                req_pool_indices=torch.tensor([1]), pool_out=torch.zeros(2, 4, dtype=torch.int32))


_SP = "kv-canary: scatter_req_token_ids"
SCATTER_BAD = {
    "flat_in_2d": (dict(flat_in=torch.zeros(1, 3, dtype=torch.int64)), ValueError,
                   _SP + " flat_in must be 1-D, got shape (1, 3)"),
    "flat_in_int32": (dict(flat_in=torch.tensor([1, 2, 3], dtype=torch.int32)), TypeError,
                      _SP + " flat_in must be int64, got torch.int32"),
    "pool_int64": (dict(pool_out=torch.zeros(2, 4, dtype=torch.int64)), TypeError,
                   _SP + " pool_out must be int32, got torch.int64"),
    "offsets_len": (dict(offsets=torch.tensor([0, 1, 3])), ValueError,
                    _SP + " offsets length 3 != bs+1 (2)"),
    "pool_none": (dict(pool_out=None), TypeError,
                  _SP + " pool_out must be a torch.Tensor, got NoneType"),
    "non_contiguous_flat": (dict(flat_in=torch.arange(6)[::2]), ValueError,
                            "kv-canary: flat_in must be contiguous"),
    "other_device": (dict(offsets=torch.tensor([0, 3], device="meta")), ValueError,
                     "kv-canary: offsets must be on pool_out's device cpu, got meta"),
    "row_out_of_range": (dict(req_pool_indices=torch.tensor([2])), ValueError,
                         _SP + " req_pool_indices[0]=2 is outside [0, 2) (rows of pool_out)"),
    "row_negative": (dict(req_pool_indices=torch.tensor([-1])), ValueError,
                     _SP + " req_pool_indices[0]=-1 is outside [0, 2) (rows of pool_out)"),
    "offsets_past_flat": (dict(offsets=torch.tensor([0, 5])), ValueError,
                          _SP + " offsets[1]=5 is outside [0, 4) (flat_in positions)"),
}


@pytest.mark.parametrize("case", list(SCATTER_BAD))
def test_scatter_bad_input(case):
    change, exc, msg = SCATTER_BAD[case]
    args = {**_scatter_args(), **change}
    before = _snapshot(*[v for v in args.values() if v is None or v.device.type != "meta"])
    with pytest.raises(exc) as e:
        bridge.launch_scatter_req_token_ids_kernel(**args)
    assert str(e.value) == msg and type(e.value) is exc
    after = _snapshot(*[v for v in args.values() if v is None or v.device.type != "meta"])
    assert _same(before, after)


def _plan_args():
    return dict(
        verify_plan_out=bridge.VerifyPlan.allocate(verify_capacity=16,
                                                   device=CPU).zero_for_testing_(),
        write_plan_out=bridge.WritePlan.allocate(write_req_capacity=4,
                                                 device=CPU).zero_for_testing_(),
        req_pool_indices=torch.tensor([1, 2]), prefix_lens=torch.tensor([3, 1]),
        extend_seq_lens=torch.tensor([1, 1]),
        req_to_token=torch.arange(64, dtype=torch.int32).reshape(4, 16), swa_window_size=0,
        full_to_swa_index_mapping=None, verify_capacity=16, req_to_verify_expected_tokens=None,
        req_to_verify_expected_tokens_valid_lens=None, kv_token_id_vs_position_offset=0,
    )


_PP = "kv-canary: launch_canary_plan_kernels"
PLAN_BAD = {
    "swa_without_lut": (dict(swa_window_size=4), ValueError,
                        _PP + " requires full_to_swa_index_mapping when swa_window_size > 0"),
    "capacity_mismatch": (dict(verify_capacity=8), ValueError,
                          _PP + " verify_capacity=8 does not match "
                          "verify_plan_out.verify_slot_indices.shape[0]=16"),
    "rtt_int64": (dict(req_to_token=torch.zeros(4, 16, dtype=torch.int64)), ValueError,
                  "kv-canary: req_to_token must have dtype torch.int32, got torch.int64"),
    "prefix_int32": (dict(prefix_lens=torch.tensor([3, 1], dtype=torch.int32)), ValueError,
                     "kv-canary: prefix_lens must have dtype torch.int64, got torch.int32"),
    "extend_len": (dict(extend_seq_lens=torch.tensor([1, 1, 1])), ValueError,
                   "kv-canary: extend_seq_lens length must be 2, got 3"),
    "rtt_none": (dict(req_to_token=None), TypeError,
                 _PP + " req_to_token must be a torch.Tensor, got NoneType"),
    "pool_without_valid_lens": (
        dict(req_to_verify_expected_tokens=torch.zeros(4, 16, dtype=torch.int32)), ValueError,
        "kv-canary: launch_plan_entries_kernel requires req_to_verify_expected_tokens_valid_lens "
        "when req_to_verify_expected_tokens is set"),
    "rpi_out_of_range": (dict(req_pool_indices=torch.tensor([1, 9])), ValueError,
                         _PP + " req_pool_indices[1]=9 is outside [0, 4) (rows of req_to_token)"),
    "prefix_past_width": (dict(prefix_lens=torch.tensor([3, 17])), ValueError,
                          _PP + " prefix_lens[1]=17 exceeds req_to_token's width 16"),
}


@pytest.mark.parametrize("case", list(PLAN_BAD))
def test_plan_bad_input(case):
    change, exc, msg = PLAN_BAD[case]
    args = {**_plan_args(), **change}
    before = _snapshot(args["verify_plan_out"], args["write_plan_out"])
    with pytest.raises(exc) as e:
        bridge.launch_canary_plan_kernels(**args)
    assert str(e.value) == msg and type(e.value) is exc
    assert _same(before, _snapshot(args["verify_plan_out"], args["write_plan_out"]))


def _write_args(helpers):
    return dict(
        context=_context(bridge.VerifyOrWriteContext, bridge.CanaryLaunchTag,
                         bridge.RealKvHashMode.NONE, num_slots=16),
        plan=helpers.make_write_plan(write_offsets=[0, 2], seed_slot_indices=[-1],
                                     num_valid_reqs=1, req_capacity=2, device=CPU),
        input_ids=torch.tensor([5, 6]), positions=torch.tensor([0, 1]),
        out_cache_loc=torch.tensor([3, 4]), enable_write_input_assert=False,
        expected_input_tokens=None, expected_input_positions=None,
    )


WRITE_BAD = {
    "assert_without_expected": (dict(enable_write_input_assert=True), ValueError,
                                "kv-canary: expected input tensors are required when "
                                "enable_write_input_assert=True"),
    "expected_without_assert": (dict(expected_input_tokens=torch.tensor([5, 6]),
                                     expected_input_positions=torch.tensor([0, 1])), ValueError,
                                "kv-canary: expected input tensors must be None when "
                                "enable_write_input_assert=False"),
    "input_ids_strided": (dict(input_ids=torch.tensor([5, 0, 6, 0])[::2]), ValueError,
                          "kv-canary: input_ids must be contiguous"),
    "out_cache_loc_none": (dict(out_cache_loc=None), TypeError,
                           "kv-canary: launch_canary_write_kernel out_cache_loc must be a "
                           "torch.Tensor, got NoneType"),
    "slot_past_buffer": (dict(out_cache_loc=torch.tensor([3, 16])), ValueError,
                         "kv-canary: launch_canary_write_kernel out_cache_loc[1]=16 is outside "
                         "[-1, 16) (canary slots, negative = skip)"),
    "positions_other_device": (dict(positions=torch.tensor([0, 1], device="meta")), ValueError,
                               "kv-canary: positions must be on canary_buf's device cpu, got meta"),
}


@pytest.mark.parametrize("case", list(WRITE_BAD))
def test_write_bad_input(case, helpers):
    change, exc, msg = WRITE_BAD[case]
    args = {**_write_args(helpers), **change}
    before = _snapshot(args["context"], args["plan"])
    with pytest.raises(exc) as e:
        bridge.launch_canary_write_kernel(**args)
    assert str(e.value) == msg and type(e.value) is exc
    assert _same(before, _snapshot(args["context"], args["plan"]))


def test_write_too_many_sources_and_int32_ids(helpers):
    args = _write_args(helpers)
    srcs = tuple(bridge.RealKvSource(tensor=torch.zeros(16, 32, dtype=torch.uint8), page_size=1,
                                     num_bytes_per_token=32, read_bytes=32) for _ in range(5))
    ctx = bridge.VerifyOrWriteContext(**{**{f: getattr(args["context"], f) for f in
                                            bridge.VerifyOrWriteContext.__dataclass_fields__},
                                         "real_kv_sources": srcs})
    before = _snapshot(ctx)
    with pytest.raises(ValueError, match="^kv-canary: at most 4 RealKvSource entries supported by "
                                         "the CUDA ABI, got 5\n"):
        bridge.launch_canary_write_kernel(**{**args, "context": ctx})
    with pytest.raises(RuntimeError, match="input_ids must be torch.int64, got torch.int32"):
        bridge.launch_canary_write_kernel(**{**args, "input_ids": torch.tensor([5, 6],
                                                                               dtype=torch.int32)})
    assert _same(before, _snapshot(ctx))


def test_verify_bad_input(helpers):
    ctx = _context(bridge.VerifyOrWriteContext, bridge.CanaryLaunchTag, bridge.RealKvHashMode.NONE,
                   num_slots=16)
    plan = helpers.make_verify_plan(slot_indices=[3, 20], positions=[0, 1],
                                    prev_slot_indices=[-1, 3], device=CPU)
    before = _snapshot(ctx, plan)
    with pytest.raises(ValueError) as e:
        bridge.launch_canary_verify_kernel(context=ctx, plan=plan,
                                           check_verify_expected_token=False)
    assert str(e.value) == ("kv-canary: launch_canary_verify_kernel plan.verify_slot_indices[1]=20 "
                            "is outside [0, 16) (canary slots)")
    ring = torch.zeros(8, 16, dtype=torch.int64)[:, :8]
    bad_ctx = bridge.VerifyOrWriteContext(**{**{f: getattr(ctx, f) for f in
                                                bridge.VerifyOrWriteContext.__dataclass_fields__},
                                             "violation_ring": ring})
    with pytest.raises(ValueError, match="^kv-canary: violation_ring must be contiguous\n"):
        bridge.launch_canary_verify_kernel(context=bad_ctx, plan=plan,
                                           check_verify_expected_token=False)
    assert _same(before, _snapshot(ctx, plan))


def test_real_kv_source_construction_uses_sglangs_checks(sgl):
    t = torch.zeros(4, 64, dtype=torch.uint8)
    for kw, msg in [
        (dict(page_size=0), "kv-canary: RealKvSource.page_size must be >= 1, got 0"),
        (dict(num_bytes_per_token=24), "kv-canary: RealKvSource.num_bytes_per_token must be a "
                                       "positive multiple of 16, got 24"),
        (dict(tensor=torch.zeros(64, dtype=torch.uint8)),
         "kv-canary: RealKvSource.tensor must be at least 2-D, got shape (64,)"),
    ]:
        full = {**dict(tensor=t, page_size=1, num_bytes_per_token=32, read_bytes=32), **kw}
        with pytest.raises(ValueError) as ours:
            bridge.RealKvSource(**full)
        with pytest.raises(ValueError) as theirs:
            sgl.verify.RealKvSource(**full)
        assert str(ours.value) == str(theirs.value) == msg


def test_dataclasses_mirror_sglangs(sgl):
    for ours, theirs in [(bridge.VerifyPlan, sgl.verify.VerifyPlan),
                         (bridge.WritePlan, sgl.write.WritePlan),
                         (bridge.VerifyOrWriteContext, sgl.verify.VerifyOrWriteContext),
                         (bridge.RealKvSource, sgl.verify.RealKvSource)]:
        assert list(ours.__dataclass_fields__) == list(theirs.__dataclass_fields__)
    assert bridge.VerifyPlan.allocation_bytes(10) == sgl.verify.VerifyPlan.allocation_bytes(10)
    assert bridge.WritePlan.allocation_bytes(10) == sgl.write.WritePlan.allocation_bytes(10)
    vp = bridge.VerifyPlan.allocate(verify_capacity=5, device=CPU)
    assert vp.enable.tolist() == [1] and vp.verify_slot_indices.dtype == torch.int64
    assert vp.zero_for_testing_() is vp and vp.verify_expected_tokens.tolist() == [-1] * 5
    with pytest.raises(ValueError, match="verify_capacity must be positive, got 0"):
        bridge.VerifyPlan.allocate(verify_capacity=0, device=CPU)
    assert [int(t) for t in bridge.CanaryLaunchTag] == [int(t) for t in sgl.verify.CanaryLaunchTag]


def test_bridge_does_not_import_sglang():
    import subprocess
    import sys

    code = ("import sys, torch; import kvcanary_jax.bridge as bridge; "
            "bridge.launch_scatter_req_token_ids_kernel(flat_in=torch.tensor([1]), "
            "offsets=torch.tensor([0, 1]), req_pool_indices=torch.tensor([0]), "
            "pool_out=torch.zeros(1, 2, dtype=torch.int32)); "
            "print(any(m == 'sglang' or m.startswith('sglang.') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --------------------------------------------------------------------------------------------
# 5. GPU: streams, aliasing without write-back


@pytest.fixture
def dlpack_path():
    """Force the DLPack path (on CUDA tensors the direct path is the default)."""
    old = bridge.direct_enabled()
    bridge.set_direct(False)
    yield
    bridge.set_direct(old)


@pytest.mark.gpu
def test_gpu_dlpack_outputs_alias_torch_memory_without_write_back(dlpack_path):
    dev = torch.device("cuda")
    pool = torch.zeros(64, 256, dtype=torch.int32, device=dev)
    args = dict(flat_in=torch.arange(128, device=dev), offsets=torch.tensor([0, 128], device=dev),
                req_pool_indices=torch.tensor([3], device=dev))
    for _ in range(3):
        bridge.launch_scatter_req_token_ids_kernel(pool_out=pool, **args)
    wb = bridge.stats().get("write_backs", 0)
    for _ in range(5):
        bridge.launch_scatter_req_token_ids_kernel(pool_out=pool, **args)
    assert bridge.paths()["launch_scatter_req_token_ids_kernel"]["path"] == "dlpack"
    assert bridge.stats().get("write_backs", 0) == wb
    assert pool[3, :128].tolist() == list(range(128))
    arr = views.for_device(pool.device).get(pool, ((64, 256), "pitched"))
    assert arr.unsafe_buffer_pointer() == pool.data_ptr()


@pytest.fixture(params=["direct", "fence", "event"])
def gpu_path(request):
    """Each GPU path: the direct launch, and the DLPack path under each stream handshake."""
    old_mode, old_direct = bridge.stream_sync(), bridge.direct_enabled()
    bridge.set_direct(request.param == "direct")
    if request.param != "direct":
        bridge.set_stream_sync(request.param)
    yield request.param
    bridge.set_stream_sync(old_mode)
    bridge.set_direct(old_direct)


@pytest.mark.gpu
def test_gpu_event_sync_found_xla_compute_stream():
    from kvcanary_jax.bridge import streams

    dev = torch.device("cuda")
    info = dlpack.device_info(torch.zeros(1, device=dev), "t")
    assert streams.gpu_sync(info).compute_stream is not None


@pytest.mark.gpu
def test_gpu_stream_order_side_stream_producer_no_stale_reads(gpu_path):
    dev = torch.device("cuda")
    n = 4096
    pool = torch.zeros(2, n, dtype=torch.int32, device=dev)
    flat = torch.zeros(n, dtype=torch.int64, device=dev)
    offs = torch.tensor([0, n], device=dev)
    rpi = torch.tensor([1], device=dev)
    side = torch.cuda.Stream(device=dev)
    stale = 0
    for trial in range(1000):
        with torch.cuda.stream(side):
            torch.cuda._sleep(20000)  # make a missing wait visible
            flat.fill_(trial)
            bridge.launch_scatter_req_token_ids_kernel(flat_in=flat, offsets=offs,
                                                       req_pool_indices=rpi, pool_out=pool)
            total = pool[1].sum()  # queued after the call on the same torch stream
        side.synchronize()
        stale += int(total.item() != trial * n)
    want = "triton_direct" if gpu_path == "direct" else "dlpack"
    assert bridge.paths()["launch_scatter_req_token_ids_kernel"]["path"] == want
    assert stale == 0


@pytest.mark.gpu
def test_gpu_dlpack_fused_step_does_not_reimport_persistent_buffers(sgl, dlpack_path):
    dev = torch.device("cuda")
    import kvcanary_jax.bench.bridge_overhead as bo

    setup = bo.make_case(device=dev, bs=64)
    for _ in range(3):
        bo.run_step(setup)
    imports = bridge.stats()["imports"]
    bo.run_step(setup)
    # Per-call temporaries only: the scatter's history staged at its bucket (6,464 -> 8,192
    # tokens; its true length, which the kernel reads, is a tensor kept per call signature),
    # and the fence in "fence" mode.
    assert bridge.stats()["imports"] - imports == 1 + (bridge.stream_sync() == "fence")


def test_write_length_mismatch_is_a_runtime_error_before_launch(helpers):
    args = {**_write_args(helpers), "positions": torch.tensor([0])}
    before = _snapshot(args["context"], args["plan"])
    with pytest.raises(RuntimeError) as e:
        bridge.launch_canary_write_kernel(**args)
    assert str(e.value) == ("kv-canary: canary_write: positions must have the length of "
                            "input_ids (2), got shape (1,)")
    assert _same(before, _snapshot(args["context"], args["plan"]))


def test_fused_step_checks_everything_before_running_anything(helpers):
    plan_args = _plan_args()
    w = _write_args(helpers)
    pool = torch.full((4, 16), 7, dtype=torch.int32)
    objs = (plan_args["verify_plan_out"], plan_args["write_plan_out"], w["context"], pool)
    before = _snapshot(*objs)
    kw = {k: v for k, v in plan_args.items()
          if k not in ("req_to_verify_expected_tokens",
                       "req_to_verify_expected_tokens_valid_lens")}
    with pytest.raises(ValueError, match="^kv-canary: input_ids must be contiguous\n"):
        launch_canary_step(
            context=w["context"], **kw, input_ids=torch.tensor([5, 0, 6, 0])[::2],
            positions=w["positions"], out_cache_loc=w["out_cache_loc"],
            req_to_verify_expected_tokens=pool,
            req_to_verify_expected_tokens_valid_lens=torch.tensor([3, 3]),
            expected_token_ids=torch.tensor([1, 2, 3]),
            expected_token_offsets=torch.tensor([0, 1, 3]),
        )
    assert _same(before, _snapshot(*objs))


@pytest.mark.gpu
def test_gpu_cpu_cuda_mix_is_refused_before_launch():
    dev = torch.device("cuda")
    pool = torch.zeros(2, 4, dtype=torch.int32, device=dev)
    with pytest.raises(ValueError) as e:
        bridge.launch_scatter_req_token_ids_kernel(
            flat_in=torch.tensor([1, 2], device=dev), offsets=torch.tensor([0, 2]),
            req_pool_indices=torch.tensor([1], device=dev), pool_out=pool)
    assert str(e.value) == f"kv-canary: offsets must be on pool_out's device {pool.device}, got cpu"
    assert int(pool.abs().sum()) == 0


def test_value_checks_off_the_kernels_stay_in_bounds():
    pool = torch.full((2, 4), 3, dtype=torch.int32)
    with bridge.value_checks(False):
        bridge.launch_scatter_req_token_ids_kernel(
            flat_in=torch.tensor([1, 2, 3, 4]), offsets=torch.tensor([0, 2, 4]),
            req_pool_indices=torch.tensor([5, 1]), pool_out=pool)
    # The out-of-range row is skipped (SGLang's kernel would write past the pool).
    assert pool.tolist() == [[3, 3, 3, 3], [3, 4, 3, 3]]


# --------------------------------------------------------------------------------------------
# A serving loop: the same tensor objects every step, contents changed in place


def _twin_cases(dev, bs=8):
    import kvcanary_jax.bench.bridge_overhead as bo

    cases = [bo.make_case(device=dev, bs=bs, prefix=12, width=32, ring=256) for _ in range(3)]
    for c in cases:  # plans are allocated uninitialised: give untouched elements one value
        for p in (c["vp"], c["wp"]):
            for f in p.__dataclass_fields__:
                getattr(p, f).fill_(-7)
    return bo, cases


def _advance(c, step):
    """One decode step in place: the same tensor objects, new contents."""
    g = torch.Generator().manual_seed(step)
    c["prefix_lens"].add_(1)
    c["valid"].add_(1)
    c["positions"].copy_(c["prefix_lens"])
    c["ocl"].copy_(c["rtt"][c["rpi"], c["prefix_lens"]].to(torch.int64))
    c["input_ids"].copy_(torch.randint(0, 50000, c["input_ids"].shape, generator=g))
    c["flat"].copy_(torch.randint(0, 50000, c["flat"].shape, generator=g))


def _ring_multiset(ctx):
    n = min(int(ctx.violation_write_index[0]), ctx.violation_ring.shape[0])
    return sorted(map(tuple, ctx.violation_ring[:n].tolist()))


def _assert_same_state(a, r, label):
    for k in ("pool",):
        assert torch.equal(a[k], r[k]), (label, k)
    for f in ("verify_slot_indices", "verify_expected_tokens", "verify_expected_positions",
              "verify_prev_slot_indices", "verify_num_valid", "enable"):
        assert torch.equal(getattr(a["vp"], f), getattr(r["vp"], f)), (label, f)
    for f in ("write_offsets", "write_seed_slot_indices", "write_num_valid_reqs"):
        assert torch.equal(getattr(a["wp"], f), getattr(r["wp"], f)), (label, f)
    ca, cr = a["ctx"], r["ctx"]
    assert torch.equal(ca.canary_buf, cr.canary_buf), label
    for f in ("violation_write_index", "slot_run_counter", "kernel_run_counter"):
        assert torch.equal(getattr(ca, f), getattr(cr, f)), (label, f)
    assert _ring_multiset(ca) == _ring_multiset(cr), label


class _RefLib:
    """SGLang's torch references under its launchers' names (they run on CPU and CUDA tensors)."""

    def __init__(self, sgl):
        self.launch_scatter_req_token_ids_kernel = \
            sgl.scatter_ref.scatter_req_token_ids_torch_reference
        self.launch_canary_plan_kernels = sgl.plan_ref.launch_canary_plan_kernels_torch_reference
        self.launch_canary_verify_kernel = \
            sgl.verify_ref.launch_canary_verify_kernel_torch_reference
        self.launch_canary_write_kernel = sgl.write_ref.launch_canary_write_kernel_torch_reference


@pytest.mark.parametrize("device", DEVICES)
def test_persistent_buffers_match_sglang_step_after_step(device, sgl):
    """A decode loop on persistent buffers, inputs changed in place between steps: each step's
    outputs match SGLang's references on a twin set of buffers byte for byte (ring as a
    multiset: its order across requests is unspecified on the GPU), for the four launchers and
    for the fused step."""
    bo, (ours, fused, ref) = _twin_cases(device)
    lib = _RefLib(sgl)
    bridge.clear_cache()
    with bridge.value_checks(False):
        for step in range(6):
            for c in (ours, fused, ref):
                _advance(c, step)
            for fn in (bo.run_scatter, bo.run_plan, bo.run_verify, bo.run_write):
                fn(ours)
                fn(ref, lib)
            bo.run_step(fused)
            if device.type == "cuda":
                torch.cuda.synchronize()
            _assert_same_state(ours, ref, f"launchers, step {step}")
            _assert_same_state(fused, ref, f"fused step, step {step}")
    assert int(ref["ctx"].violation_write_index[0]) > 0  # the loop exercised the ring


def test_a_swapped_or_moved_tensor_is_checked_and_read_again(sgl):
    """A new tensor object, or the same object moved to new memory (``set_``), is checked and
    read at its new memory: never a stale array."""
    bo, (c, r, _) = _twin_cases(CPU)
    lib = _RefLib(sgl)
    bridge.clear_cache()
    with bridge.value_checks(False):
        for _ in range(3):
            bo.run_scatter(c)
            bo.run_scatter(r, lib)
        for case in (c, r):
            case["flat"].set_(torch.randint(0, 9, case["flat"].shape,
                                            generator=torch.Generator().manual_seed(5)))
        bo.run_scatter(c)
        bo.run_scatter(r, lib)
        assert torch.equal(c["pool"], r["pool"])
        # A new object for the offsets with another dtype: the checks run again.
        c["offs"] = c["offs"].to(torch.int32)
        with pytest.raises(TypeError):
            bo.run_scatter(c)


def test_clear_cache_empties_every_cache():
    from kvcanary_jax.bridge.cache import CACHES

    bo, (c, _, _) = _twin_cases(CPU)
    for _ in range(2):
        bo.run_verify(c)
        bo.run_scatter(c)
    assert CACHES.sizes()["prepared"] > 0 and CACHES.sizes()["jitted"] > 0
    assert len(views.for_device(CPU)) > 0
    bridge.clear_cache()
    assert all(v == 0 for v in CACHES.sizes().values())
    assert len(views.for_device(CPU)) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_real_kv_sources_step_after_step_see_new_kv_bytes(device, sgl):
    """Write and verify with a real-KV source, call after call on the same buffers: a KV byte flipped in
    place between steps is seen by the next verify exactly as by SGLang's reference."""
    import dataclasses

    bo, cases = _twin_cases(device)
    ours, ref = cases[0], cases[1]
    g = torch.Generator().manual_seed(3)
    kv = torch.randint(0, 256, (ours["ctx"].canary_buf.shape[0], 32), generator=g,
                       dtype=torch.uint8).to(device)
    for c in (ours, ref):
        src = bridge.RealKvSource(tensor=kv.clone(), page_size=1, num_bytes_per_token=32,
                                  read_bytes=32)
        c["ctx"] = dataclasses.replace(c["ctx"], real_kv_sources=(src,),
                                       real_kv_hash_mode=bridge.RealKvHashMode.ALL)
    lib = _RefLib(sgl)
    bridge.clear_cache()
    with bridge.value_checks(False):
        for step in range(5):
            for c in (ours, ref):
                _advance(c, step)
            for fn in (bo.run_scatter, bo.run_plan, bo.run_write, bo.run_verify):
                fn(ours)
                fn(ref, lib)
            if step == 3:  # corrupt a written slot's KV bytes on both sides
                slot = int(ours["ocl"][0])
                for c in (ours, ref):
                    c["ctx"].real_kv_sources[0].tensor[slot, 5] ^= 0x40
            if device.type == "cuda":
                torch.cuda.synchronize()
            _assert_same_state(ours, ref, f"step {step}")
    assert _ring_multiset(ref["ctx"])  # violations were recorded, and ours match them


def test_plan_serving_loop_compiles_once_per_batch_bucket(sgl):
    """Batch sizes 1..70 through the bridge's plan: the request vectors are lowered at
    min(bucket(bs), write_req_capacity) with the batch size as an operand, so the loop compiles
    2 programs (buckets 64 and 72 = the capacity), and every plan equals SGLang's."""
    from kvcanary_jax.bridge.cache import CACHES

    rng = random.Random(3)
    rtt = torch.randint(0, 500, (80, 12), dtype=torch.int32)
    pool = torch.randint(0, 1000, (80, 12), dtype=torch.int32)
    compiled_before = {k: v._cache_size() for k, v in CACHES.jitted._d.items()}
    for bs in list(range(1, 71)):
        rpi = torch.tensor([rng.randint(0, 79) for _ in range(bs)], dtype=torch.int64)
        prefix = torch.tensor([rng.randint(0, 10) for _ in range(bs)], dtype=torch.int64)
        extend = torch.tensor([rng.randint(0, 2) for _ in range(bs)], dtype=torch.int64)
        valid = torch.tensor([rng.randint(0, 12) for _ in range(bs)], dtype=torch.int64)
        kw = dict(req_pool_indices=rpi, prefix_lens=prefix, extend_seq_lens=extend,
                  req_to_token=rtt, swa_window_size=0, full_to_swa_index_mapping=None,
                  verify_capacity=256, req_to_verify_expected_tokens=pool,
                  req_to_verify_expected_tokens_valid_lens=valid,
                  kv_token_id_vs_position_offset=bs % 2)
        ours = (bridge.VerifyPlan.allocate(verify_capacity=256, device=CPU).zero_for_testing_(),
                bridge.WritePlan.allocate(write_req_capacity=72, device=CPU).zero_for_testing_())
        ref = (sgl.verify.VerifyPlan.allocate(verify_capacity=256,
                                              device=CPU).zero_for_testing_(),
               sgl.write.WritePlan.allocate(write_req_capacity=72,
                                            device=CPU).zero_for_testing_())
        bridge.launch_canary_plan_kernels(verify_plan_out=ours[0], write_plan_out=ours[1], **kw)
        sgl.plan_ref.launch_canary_plan_kernels_torch_reference(
            verify_plan_out=ref[0], write_plan_out=ref[1], **kw)
        for f in bridge.VerifyPlan.__dataclass_fields__:
            assert torch.equal(getattr(ours[0], f), getattr(ref[0], f)), (bs, f)
        for f in bridge.WritePlan.__dataclass_fields__:
            assert torch.equal(getattr(ours[1], f), getattr(ref[1], f)), (bs, f)
    plan_fns = {k: v for k, v in CACHES.jitted._d.items() if k[0] == "launch_canary_plan_kernels"}
    compiled = sum(v._cache_size() - compiled_before.get(k, 0) for k, v in plan_fns.items())
    assert compiled == 2 * 2  # two buckets, for each kv_token_id_vs_position_offset (a static)


def test_plan_batch_size_scalars_are_shared_aligned_and_never_freed():
    """The plan's num_reqs operand: one read-only tensor per (device, count), holding the count,
    32-byte aligned (the kernels keep their aligned variant), still valid after its table grows
    (a captured graph may hold its address), and none for an empty batch."""
    from kvcanary_jax.bridge.cache import Counts

    counts = Counts()
    a = counts.view(CPU, 7)
    assert a is counts.view(CPU, 7) and a.tolist() == [7] and a.dtype == torch.int32
    assert a.data_ptr() % 32 == 0 and counts.view(CPU, 8).data_ptr() - a.data_ptr() == 32
    big = counts.view(CPU, 5000)  # past the first table (4,096 counts): a second one
    assert big.tolist() == [5000] and big.data_ptr() % 32 == 0
    assert counts.view(CPU, 7) is a and a.tolist() == [7]  # the first table's views stay
    assert counts.view(CPU, 0) is None


def test_a_scatters_true_length_is_a_never_freed_table_row_kept_past_every_cache():
    """The scatter's bucketed flat_in length: a row of the bridge's int64 table (8 bytes apart,
    8-byte aligned), read by address (the DLPack path's views: the newest few, see below);
    the same address after clear_cache() (a captured CUDA graph may hold it), and the table
    grows past its first 65,536 lengths keeping the old rows."""
    from kvcanary_jax.bridge.cache import CACHES

    n = 6464  # 64 requests of 101 tokens: not a bucket
    flat = torch.arange(n, dtype=torch.int64)
    offs = torch.arange(0, n + 1, 101, dtype=torch.int64)
    rpi = torch.arange(1, 65, dtype=torch.int64)
    pool = torch.zeros(65, 128, dtype=torch.int32)
    with bridge.value_checks(False):
        bridge.launch_scatter_req_token_ids_kernel(flat_in=flat, offsets=offs,
                                                   req_pool_indices=rpi, pool_out=pool)
    assert torch.equal(pool[1:, :101], flat.reshape(64, 101).to(torch.int32))
    lengths = CACHES.lengths
    t = lengths.view(CPU, n)
    assert t.tolist() == [n] and t.dtype == torch.int64 and t.data_ptr() % 8 == 0
    assert lengths.address(CPU, n) == t.data_ptr() and lengths.view(CPU, n) is t
    assert lengths.address(CPU, n + 1) - t.data_ptr() == 8
    bridge.clear_cache()
    assert lengths.address(CPU, n) == t.data_ptr() and t.tolist() == [n]
    big = lengths.view(CPU, 70001)  # past the first table: a second one
    assert big.tolist() == [70001] and lengths.address(CPU, 70001) == big.data_ptr()
    assert t.tolist() == [n]


def test_a_growing_history_keeps_one_prepared_scatter_per_bucket_and_equals_sglang():
    """SGLang scatters each request's whole history every step, one token longer each time:
    the call signature holds flat_in's bucket, not its length, so every length of a bucket
    runs the call prepared once (its checks and arguments), each with its own true length (the
    kernel reads no token past it), equal to SGLang's reference; a 1-token history keeps a
    signature of its own (there the contiguity check decides on more than the stride)."""
    from kvcanary_jax.bridge.cache import CACHES
    from kvcanary_jax import oracle

    ref = oracle.load(cuda_jit=False).scatter_ref.scatter_req_token_ids_torch_reference
    bs, width = 4, 64
    rpi = torch.tensor([3, 1, 4, 2])
    pool, want = (torch.full((6, width), -5, dtype=torch.int32) for _ in range(2))
    g = torch.Generator().manual_seed(3)
    base = torch.randint(-1000, 1000, (bs * width,), generator=g)
    bridge.clear_cache()

    def prepared():
        return sum(k.launcher == "launch_scatter_req_token_ids_kernel"
                   for k in CACHES.prepared._d)

    seen = []
    with bridge.value_checks(False):
        for per in range(9, 40):  # 36 .. 156 tokens: buckets 64, 128 and 256
            flat = base[: bs * per].clone()
            offs = torch.arange(0, bs * per + 1, per)
            bridge.launch_scatter_req_token_ids_kernel(flat_in=flat, offsets=offs,
                                                       req_pool_indices=rpi, pool_out=pool)
            ref(flat_in=flat, offsets=offs, req_pool_indices=rpi, pool_out=want)
            assert torch.equal(pool, want), per
            seen.append(prepared())
    assert seen[0] == 1 and seen[-1] == 3  # one per bucket
    # A shorter history in a seen bucket: the kernel reads its own length, not the first one's.
    flat = base[: bs * 10].clone()
    offs = torch.tensor([0, 10, 20, 30, 1000])  # past the end: read as the true 40
    pool.fill_(-5)
    want.fill_(-5)
    with bridge.value_checks(False):
        bridge.launch_scatter_req_token_ids_kernel(flat_in=flat, offsets=offs,
                                                   req_pool_indices=rpi, pool_out=pool)
    ref(flat_in=flat, offsets=offs.clamp(max=40), req_pool_indices=rpi, pool_out=want)
    assert torch.equal(pool, want) and prepared() == 3
    pool2 = pool.clone()
    # A 1-element view with a stride is contiguous and runs; a strided longer one is refused.
    with bridge.value_checks(False):
        bridge.launch_scatter_req_token_ids_kernel(
            flat_in=base[:4:3][:1], offsets=torch.tensor([0, 1, 1, 1, 1]),
            req_pool_indices=rpi, pool_out=pool2)
        assert pool2[3, 0] == base[0]
        with pytest.raises(ValueError, match="flat_in must be contiguous"):
            bridge.launch_scatter_req_token_ids_kernel(
                flat_in=base[: 2 * 40:2], offsets=torch.tensor([0, 10, 20, 30, 40]),
                req_pool_indices=rpi, pool_out=pool2)


def test_a_longer_history_reaching_the_pool_is_refused_within_its_bucket():
    """The signature holds flat_in's bucket, not its extent: each call checks the history apart
    from the outputs, so one that grows into pool_out inside its bucket is refused as a fresh
    call would be, with value checks off, and nothing is written."""
    buf = torch.zeros(400, dtype=torch.int64)
    pool = buf[110:110 + 64].view(torch.int32).view(4, 32)
    rpi = torch.tensor([1, 2])
    with bridge.value_checks(False):
        bridge.launch_scatter_req_token_ids_kernel(
            flat_in=buf[:100], offsets=torch.tensor([0, 50, 100]), req_pool_indices=rpi,
            pool_out=pool)
        before = buf.clone()
        with pytest.raises(bridge.BridgeError, match="pool_out shares memory with flat_in"):
            bridge.launch_scatter_req_token_ids_kernel(
                flat_in=buf[:120], offsets=torch.tensor([0, 60, 120]), req_pool_indices=rpi,
                pool_out=pool)
    assert torch.equal(buf, before)


def test_the_length_table_is_bounded_and_its_views_few():
    """Lengths of 2**20 tokens or more get no table row (the caller makes a per-call tensor):
    the table stays under 16 MiB with those it outgrew; the DLPack path's views of it are the
    256 newest, not one per length ever seen; the plan's counts keep every view."""
    from kvcanary_jax.bridge.cache import Counts

    lengths = Counts("int64", row=1, minimum=1 << 16, keep_views=256, maximum=1 << 20)
    assert lengths.address(CPU, (1 << 20) - 1) is not None
    assert lengths.address(CPU, 1 << 20) is None and lengths.view(CPU, 1 << 20) is None
    assert sum(t.numel() * 8 for t in lengths._tables[CPU]) < 16 << 20
    views = [lengths.view(CPU, n) for n in range(1, 1001)]
    assert len(lengths._views) == 256 and lengths.view(CPU, 1000) is views[-1]
    assert all(v.tolist() == [n] for n, v in enumerate(views, 1))
    with bridge.value_checks(False):  # a history that long still runs, its length per call
        n = (1 << 20) + 3
        flat = torch.arange(n, dtype=torch.int64) % 1000
        pool = torch.zeros(3, 8, dtype=torch.int32)
        bridge.launch_scatter_req_token_ids_kernel(
            flat_in=flat, offsets=torch.tensor([0, 4, n + 50]), req_pool_indices=torch.tensor([1, 2]),
            pool_out=pool)
    assert pool[1, :4].tolist() == [0, 1, 2, 3] and pool[2].tolist() == list(range(4, 12))
