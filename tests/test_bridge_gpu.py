"""The direct Triton path on a CUDA GPU (marked ``gpu``: run on the H200, deselected elsewhere).

A four-op canary step (scatter, plan, write, verify) captured into one ``torch.cuda.graph`` and
replayed with its inputs changed in place, byte-equal to SGLang 0.5.23's references after every
replay; the direct path chosen automatically and reported; direct and DLPack paths agreeing.
(SGLang's differential helpers on CUDA tensors and the side-stream test are in
``tests/test_bridge.py``, parametrised over devices and paths.)
"""

from __future__ import annotations

import pytest
import torch

import kvcanary_jax.bridge as bridge

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")


def _cases(bs=16):
    import kvcanary_jax.bench.bridge_overhead as bo

    # width 128: 100 steps of one token each from a 12-token prefix stay inside the rows.
    # The ring holds every violation of the 100 steps (~100k rows: the unscattered positions
    # mismatch every step): an overflowing ring keeps the rows the atomics order first.
    cases = [bo.make_case(device=CUDA, bs=bs, prefix=12, width=128, ring=1 << 17)
             for _ in range(2)]
    for c in cases:
        for p in (c["vp"], c["wp"]):
            for f in p.__dataclass_fields__:
                getattr(p, f).fill_(-7)
    return bo, cases


def _advance(c, step):
    """A decode step in place: same tensor objects (the graph's inputs), new contents."""
    g = torch.Generator(device="cpu").manual_seed(step)
    c["prefix_lens"].add_(1)
    c["valid"].add_(1)
    c["positions"].copy_(c["prefix_lens"])
    c["ocl"].copy_(c["rtt"][c["rpi"], c["prefix_lens"]].to(torch.int64))
    c["input_ids"].copy_(torch.randint(0, 50000, c["input_ids"].shape, generator=g))
    c["flat"].copy_(torch.randint(0, 50000, c["flat"].shape, generator=g))
    if step % 7 == 3:  # corrupt a cached slot's canary: the next verify must report it
        slot = int(c["rtt"][1, 2])
        c["ctx"].canary_buf[slot, 0] ^= 0x11


def _state(c):
    vp, wp, ctx = c["vp"], c["wp"], c["ctx"]
    n = min(int(ctx.violation_write_index[0]), ctx.violation_ring.shape[0])
    return dict(
        pool=c["pool"].clone(), canary=ctx.canary_buf.clone(),
        counters=(int(ctx.violation_write_index[0]), int(ctx.slot_run_counter[0]),
                  int(ctx.kernel_run_counter[0])),
        ring=sorted(map(tuple, ctx.violation_ring[:n].tolist())),
        unused_ring=ctx.violation_ring[n:].clone(),
        vp=[getattr(vp, f).clone() for f in vp.__dataclass_fields__],
        wp=[getattr(wp, f).clone() for f in wp.__dataclass_fields__],
    )


def _assert_equal(a, b, label):
    for k in a:
        if isinstance(a[k], list) and a[k] and isinstance(a[k][0], torch.Tensor):
            for x, y in zip(a[k], b[k]):
                assert torch.equal(x, y), (label, k)
        elif isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), (label, k)
        else:
            assert a[k] == b[k], (label, k)


def test_four_op_step_captured_in_a_cuda_graph_replays_like_sglang(sgl):
    bo, (ours, ref) = _cases()
    lib = type("Ref", (), {})()
    lib.launch_scatter_req_token_ids_kernel = sgl.scatter_ref.scatter_req_token_ids_torch_reference
    lib.launch_canary_plan_kernels = sgl.plan_ref.launch_canary_plan_kernels_torch_reference
    lib.launch_canary_verify_kernel = sgl.verify_ref.launch_canary_verify_kernel_torch_reference
    lib.launch_canary_write_kernel = sgl.write_ref.launch_canary_write_kernel_torch_reference
    ops = (bo.run_scatter, bo.run_plan, bo.run_write, bo.run_verify)

    def step(c, lib=None):
        for op in ops:
            op(c) if lib is None else op(c, lib)

    # Warm up on a side stream (compiles and loads every kernel), as torch asks before capture;
    # the reference side takes the same step eagerly.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(ours)
    torch.cuda.current_stream().wait_stream(side)
    step(ref, lib)
    torch.cuda.synchronize()
    for op in ("launch_scatter_req_token_ids_kernel", "launch_canary_plan_kernels",
               "launch_canary_verify_kernel", "launch_canary_write_kernel"):
        assert bridge.paths()[op]["path"] == "triton_direct", bridge.paths()[op]
    _assert_equal(_state(ours), _state(ref), "eager warm-up")

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(ours)
    # Capture records without running: put the state back to the reference's.
    torch.cuda.synchronize()
    _assert_equal(_state(ours), _state(ref), "after capture (nothing ran)")
    violations = 0
    for i in range(100):
        for c in (ours, ref):
            _advance(c, i)
        graph.replay()
        step(ref, lib)
        torch.cuda.synchronize()
        _assert_equal(_state(ours), _state(ref), f"replay {i}")
        violations = int(ref["ctx"].violation_write_index[0])
    assert violations > 0  # the corruptions were reported, and ours reported them alike


def test_direct_and_dlpack_paths_give_the_same_bytes(sgl):
    bo, (a, b) = _cases(bs=8)
    old = bridge.direct_enabled()
    try:
        for i in range(5):
            for c in (a, b):
                _advance(c, i)
            bridge.set_direct(True)
            for op in (bo.run_scatter, bo.run_plan, bo.run_write, bo.run_verify):
                op(a)
            bridge.set_direct(False)
            for op in (bo.run_scatter, bo.run_plan, bo.run_write, bo.run_verify):
                op(b)
            torch.cuda.synchronize()
            _assert_equal(_state(a), _state(b), f"step {i}")
        assert bridge.paths()["launch_canary_write_kernel"]["path"] == "dlpack"
    finally:
        bridge.set_direct(old)
    del sgl


def test_fused_step_on_the_direct_path_is_capturable_and_matches_the_four_launchers():
    bo, (a, b) = _cases(bs=8)
    for c in (a, b):
        _advance(c, 0)
    bo.run_step(a)
    for op in (bo.run_scatter, bo.run_plan, bo.run_verify, bo.run_write):
        op(b)
    torch.cuda.synchronize()
    assert bridge.paths()["launch_canary_step"]["path"] == "triton_direct"
    _assert_equal(_state(a), _state(b), "eager")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        bo.run_step(a)
    for i in range(1, 20):
        for c in (a, b):
            _advance(c, i)
        graph.replay()
        for op in (bo.run_scatter, bo.run_plan, bo.run_verify, bo.run_write):
            op(b)
        torch.cuda.synchronize()
        _assert_equal(_state(a), _state(b), f"replay {i}")


def test_misaligned_counter_views_run_on_the_direct_path():
    counters = torch.zeros(12, dtype=torch.int64, device=CUDA)
    bo, (c, _) = _cases(bs=4)
    ctx = c["ctx"]
    c["ctx"] = bridge.VerifyOrWriteContext(**{
        **{f: getattr(ctx, f) for f in bridge.VerifyOrWriteContext.__dataclass_fields__},
        "slot_run_counter": counters[1:2], "kernel_run_counter": counters[7:8]})
    for _ in range(3):
        bo.run_plan(c)
        bo.run_verify(c)
    torch.cuda.synchronize()
    assert bridge.paths()["launch_canary_verify_kernel"]["path"] == "triton_direct"
    assert int(counters[7]) == 3 and int(counters[1]) > 0
