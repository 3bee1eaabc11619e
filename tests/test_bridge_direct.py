"""The direct Triton path, everything but the launch (CPU): lowering for CUDA, extracting each
kernel's TTIR, grid and launch parameters, mapping every kernel parameter to the launcher's
arguments (pointer order, in-place aliases, scratch and constants), and compiling the TTIR with
the installed ``triton`` for sm_90.

The expected parameter lists are hand-written from the ops' ``pallas_call`` argument lists
(inputs, then outputs; an output aliased to an input is that input's memory).
"""

from __future__ import annotations

import functools

import pytest
import torch

import kvcanary_jax.bench.bridge_overhead as bo
from kvcanary_jax.bridge import declarations
from kvcanary_jax.bridge import triton_direct as td
from kvcanary_jax.bridge.launcher import bind, lowered_specs
from kvcanary_jax.ops.plan import pallas_triton as _plan_triton

CPU = torch.device("cpu")
CTX = ["violation_ring", "violation_write_index", "slot_run_counter", "kernel_run_counter"]
VP = ["verify_slot_indices", "verify_expected_tokens", "verify_expected_positions",
      "verify_prev_slot_indices"]


@functools.lru_cache(maxsize=None)
def _case():
    return bo.make_case(device="cpu", bs=4, prefix=12, width=32, ring=64)


def _calls():
    import kvcanary_jax.bridge as bridge

    c = _case()
    kv = torch.zeros(c["ctx"].canary_buf.shape[0], 80, dtype=torch.uint8)
    ctx_src = bridge.VerifyOrWriteContext(**{
        **{f: getattr(c["ctx"], f) for f in bridge.VerifyOrWriteContext.__dataclass_fields__},
        "real_kv_sources": (bridge.RealKvSource(tensor=kv[:, 16:80], page_size=1,
                                                num_bytes_per_token=64, read_bytes=32),),
        "real_kv_hash_mode": bridge.RealKvHashMode.ALL})
    write_kw = dict(context=c["ctx"], plan=c["wp"], input_ids=c["input_ids"],
                    positions=c["positions"], out_cache_loc=c["ocl"],
                    enable_write_input_assert=False, expected_input_tokens=None,
                    expected_input_positions=None)
    return {
        "scatter": (declarations.SCATTER, dict(flat_in=c["flat"], offsets=c["offs"],
                                    req_pool_indices=c["rpi"], pool_out=c["pool"])),
        "plan": (declarations.PLAN, bo._plan_kw(c)),
        "verify": (declarations.VERIFY, dict(context=c["ctx"], plan=c["vp"],
                                  check_verify_expected_token=True)),
        "verify_source": (declarations.VERIFY, dict(context=ctx_src, plan=c["vp"],
                                         check_verify_expected_token=False)),
        "write": (declarations.WRITE, write_kw),
        "write_checked_source": (declarations.WRITE, {**write_kw, "context": ctx_src,
                                           "enable_write_input_assert": True,
                                           "expected_input_tokens": c["input_ids"],
                                           "expected_input_positions": c["positions"]}),
    }


def _extract(fn, args, results, static):
    """The direct path's program of a declaration's function, bound by name as the launcher
    binds it."""
    names = [a.name for a in args]
    return td.extract_program(bind(fn, names, results), lowered_specs(args),
                              results_to_args=[names.index(r) for r in results], static=static)


@functools.lru_cache(maxsize=None)
def _program(name):
    decl, kw = _calls()[name]
    ts = decl.tensors(kw)
    args, static, results = decl.arguments(kw, ts)
    static = dict(static, platform="cuda")
    return args, _extract(decl.fn, args, results, static=static)


def _mapping(name):
    args, prog = _program(name)
    return [(k.name, k.grid, [(args[b.index].name if b.kind == "arg" else b.kind, p.dtype)
                              for b, p in zip(k.bufs, k.params)]) for k in prog.kernels]


def test_scatter_kernel_parameters_are_its_operands_then_the_aliased_pool():
    [(name, grid, params)] = _mapping("scatter")
    assert name == "kvcanary_scatter_req_token_ids"
    # bs = 4 requests; span = min(pool width 32, bucketed tokens 64) = 32 -> one 32-column tile.
    assert grid == (4, 1, 1)
    # The bucketed flat_in's true length is an operand the kernel reads (no per-call clamp of
    # the offsets): a row of the bridge's never-freed table of lengths (CACHES.lengths).
    assert params == [("flat_in", "i64"), ("offsets", "i64"), ("req_pool_indices", "i64"),
                      ("num_tokens", "i64"), ("pool_out", "i32"), ("pool_out", "i32")]
    args, prog = _program("scatter")
    assert args[0].shape == (64,)  # 4 x 13 tokens, bucketed up to the floor
    count = next(a for a in args if a.name == "num_tokens")
    assert (count.length_of, count.shape) == ("flat_in", (1,))
    assert all(a.clamp is None for a in args)
    assert prog.scratch == () and prog.consts == () and prog.copies == ()


def test_plan_kernels_share_the_verify_offsets_scratch_and_alias_the_plan_fields():
    (n1, g1, p1), (n2, g2, p2) = _mapping("plan")
    assert (n1, n2) == ("kvcanary_plan_offsets", "kvcanary_plan_entries")
    assert g1 == (1, 1, 1) and g2 == (1, 1, 1)
    wp = [("write_plan_out.write_offsets", "i64"),
          ("write_plan_out.write_seed_slot_indices", "i64"),
          ("verify_plan_out.verify_num_valid", "i32"), ("verify_plan_out.enable", "i32"),
          ("write_plan_out.write_num_valid_reqs", "i32")]
    # The batch size is an operand (num_reqs): 4 requests lowered as min(bucket(4), the write
    # request capacity 5) = 5 lanes.
    assert p1 == [("req_pool_indices", "i64"), ("prefix_lens", "i64"), ("extend_seq_lens", "i64"),
                  ("req_to_token", "i32"), ("const", "i64"),  # no LUT: a 1-element dummy
                  ("num_reqs", "i32"), *wp, ("scratch", "i64"), *wp]
    vp = [(f"verify_plan_out.{k}", "i64") for k in VP]
    assert p2 == [("req_pool_indices", "i64"), ("prefix_lens", "i64"), ("req_to_token", "i32"),
                  ("const", "i64"), ("scratch", "i64"), ("verify_plan_out.enable", "i32"),
                  ("req_to_verify_expected_tokens", "i32"),
                  ("req_to_verify_expected_tokens_valid_lens", "i64"), *vp, *vp]
    args, prog = _program("plan")
    assert [a.shape for a in args if a.name in ("req_pool_indices", "num_reqs")] == [(5,), (1,)]
    # The verify offsets [lanes + 1] are the one buffer no argument holds: written by the first
    # kernel, read by the second.
    assert [s.shape for s in prog.scratch] == [(6,)]
    k1, k2 = prog.kernels
    assert k1.bufs[11] == k2.bufs[4] == td.Buf("scratch", 0)
    assert prog.copies == ()


def test_an_interpret_config_is_never_launched_directly():
    """A launch config in interpret mode (what ``pallas_interpret`` runs) has no Triton kernel to
    launch: the direct path refuses it before lowering, and the call takes the DLPack path."""
    kw = bo._plan_kw(_case())
    args, static, results = declarations.PLAN.arguments(kw, declarations.PLAN.tensors(kw))
    config = _plan_triton.Config(interpret=True)
    with pytest.raises(td.Unsupported, match="asks for interpret mode"):
        _extract(declarations.plan_fn, args, results,
                 static=dict(static, platform="cuda", config=config))


def test_plan_multi_block_path_is_three_kernels():
    c = _case()
    kw = bo._plan_kw(c)
    ts = declarations.PLAN.tensors(kw)
    args, static, results = declarations.PLAN.arguments(kw, ts)
    config = _plan_triton.Config(single_block_max=2, multi_block=2)
    prog = _extract(declarations.plan_fn, args, results,
                    static=dict(static, platform="cuda", config=config))
    names = [k.name for k in prog.kernels]
    assert names == ["kvcanary_plan_offsets_block_sums", "kvcanary_plan_offsets",
                     "kvcanary_plan_entries"]
    sums, offsets, entries = prog.kernels
    assert sums.grid == (3, 1, 1)  # 4 requests lowered as 5 lanes, in blocks of 2
    # The block sums (two scratch arrays) feed the offsets kernel, whose verify offsets feed the
    # entries kernel; both read the batch size (num_reqs, the last argument).
    n = len(args) - 1
    assert sums.bufs[3:] == (td.Buf("arg", n), td.Buf("scratch", 0), td.Buf("scratch", 1))
    assert offsets.bufs[5:8] == (td.Buf("scratch", 0), td.Buf("scratch", 1), td.Buf("arg", n))
    assert entries.bufs[4] == td.Buf("scratch", 2)
    compiled = td.compile_kernel(sums.ttir, num_warps=sums.num_warps, num_stages=sums.num_stages,
                                 target=_target())
    assert compiled.metadata.name == "kvcanary_plan_offsets_block_sums"


def test_verify_kernel_reads_the_plan_and_the_canary_words_and_updates_the_context():
    [(name, grid, params)] = _mapping("verify")
    assert name == "kvcanary_verify"
    plan = [(f"plan.{k}", "i64") for k in VP] + [("plan.verify_num_valid", "i32"),
                                                  ("plan.enable", "i32")]
    ctx = [("violation_ring", "i64"), ("violation_write_index", "i32"),
           ("slot_run_counter", "i64"), ("kernel_run_counter", "i64")]
    # canary_buf is uint8 [slots, 32] to torch and int64 words to the kernel (a bitcast view).
    assert params == [*plan, ("canary_buf", "i64"), *ctx, *ctx]
    [(_, _, with_src)] = _mapping("verify_source")
    assert with_src[7] == ("real_kv_sources[0].tensor", "i64")
    args, _ = _program("verify_source")
    # The source's bytes from the view's first element: 160 rows of 80 bytes, the last one read
    # for 64 (page_size 1 x num_bytes_per_token 64).
    assert args[-1].shape == (160 * 80 + 64,) and args[-1].layout == "bytes"


def test_write_kernel_parameters_and_its_bucketed_token_arrays():
    [(name, grid, params)] = _mapping("write")
    assert name == "kvcanary_write"
    assert grid == (5, 1, 1)  # one program per request row of the plan's capacity
    ctx = [("canary_buf", "i64"), ("violation_ring", "i64"), ("violation_write_index", "i32"),
           ("slot_run_counter", "i64"), ("kernel_run_counter", "i64")]
    toks = [("input_ids", "i64"), ("positions", "i64"), ("out_cache_loc", "i64")]
    plan = [("plan.write_offsets", "i64"), ("plan.write_seed_slot_indices", "i64"),
            ("plan.write_num_valid_reqs", "i32")]
    # Without the input assert the kernel takes ids / positions again as its expected arrays.
    assert params == [*plan, *toks, ("input_ids", "i64"), ("positions", "i64"),
                      ("enable_chain_position_assert", "i32"), *ctx, *ctx]
    args, _ = _program("write")
    assert [a.shape for a in args if a.name in ("input_ids", "positions", "out_cache_loc")] == \
        [(64,)] * 3  # 4 tokens, bucketed
    offsets = next(a for a in args if a.name == "plan.write_offsets")
    assert offsets.clamp == 4  # a per-call clamp to the true token count
    [(_, _, checked)] = _mapping("write_checked_source")
    assert checked[6:10] == [("expected_input_tokens", "i64"), ("expected_input_positions", "i64"),
                             ("enable_chain_position_assert", "i32"),
                             ("real_kv_sources[0].tensor", "i64")]


def _target():
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", 90, 32)


@pytest.mark.parametrize("name", ["scatter", "plan", "verify", "verify_source", "write"])
def test_every_kernel_compiles_for_sm90_with_the_installed_triton(name):
    _, prog = _program(name)
    for k in prog.kernels:
        compiled = td.compile_kernel(k.ttir, num_warps=k.num_warps, num_stages=k.num_stages,
                                     target=_target())
        assert compiled.metadata.name == k.name
        assert compiled.metadata.num_warps == k.num_warps
        assert compiled.metadata.global_scratch_size == 0  # the launcher passes no scratch
        assert len(compiled.asm["cubin"]) > 0


def _write_ttir_lines(num_sources: int) -> int:
    import kvcanary_jax.bridge as bridge

    c = _case()
    srcs = tuple(bridge.RealKvSource(
        tensor=torch.zeros(c["ctx"].canary_buf.shape[0], 256, dtype=torch.uint8), page_size=1,
        num_bytes_per_token=256, read_bytes=256) for _ in range(num_sources))
    ctx = bridge.VerifyOrWriteContext(**{
        **{f: getattr(c["ctx"], f) for f in bridge.VerifyOrWriteContext.__dataclass_fields__},
        "real_kv_sources": srcs, "real_kv_hash_mode": bridge.RealKvHashMode.ALL})
    kw = dict(context=ctx, plan=c["wp"], input_ids=c["input_ids"], positions=c["positions"],
              out_cache_loc=c["ocl"], enable_write_input_assert=False,
              expected_input_tokens=None, expected_input_positions=None)
    ts = declarations.WRITE.tensors(kw)
    args, static, results = declarations.WRITE.arguments(kw, ts)
    prog = _extract(declarations.WRITE.fn, args, results, static=dict(static, platform="cuda"))
    [kernel] = prog.kernels
    return kernel.ttir.count("\n")


def test_the_writes_kernel_grows_little_with_sglangs_four_sources():
    """SGLang's ALL mode hands the write four real-KV sources: the kernel stays about the size
    of the one-source kernel (the fold's words ahead shared by the sources, its code once).
    It was 2.2x (13,888 TTIR lines against 6,331; 110 s of triton's compile for sm_90 on the
    first step of each new bucket)."""
    one, four = _write_ttir_lines(1), _write_ttir_lines(4)
    assert four < 1.25 * one, (one, four)


def test_a_misaligned_pointer_gets_a_kernel_with_the_divisibility_it_has():
    _, prog = _program("verify")
    k = prog.kernels[0]
    assert {p.divisibility for p in k.params} == {32} or all(
        p.divisibility for p in k.params)
    ptrs = [0x7f0000000000] * len(k.params)
    ptrs[8] += 8  # violation_write_index, a 1-element view 8 bytes into a counters array
    div = td.divisibility_for(k, ptrs)
    assert div[8] == 8 and div[0] == k.params[0].divisibility
    text = td.with_divisibility(k.ttir, div)
    _, params = td.kernel_params(text)
    assert params[8].divisibility == 8 and params[0] == k.params[0]
    compiled = td.compile_kernel(text, num_warps=k.num_warps, num_stages=k.num_stages,
                                 target=_target())
    assert compiled.metadata.name == k.name
    ptrs[8] += 2  # an int32 at an odd address: refused, naming the tensor
    with pytest.raises(ValueError, match="violation_write_index starts at an address that is "
                                         "not 4-byte aligned"):
        td.check_alignment(k, ptrs, [f"p{i}" if i != 8 else "violation_write_index"
                                     for i in range(len(ptrs))])


def test_a_length_operand_is_declared_8_byte_aligned_and_compiles_once_for_any_length():
    """The scatter's true length is a row of an int64 table, so its address is 8-byte aligned
    only: the program declares that parameter so (every other one as lowered), so every length
    takes the kernel built first, none a variant of its own."""
    args, prog = _program("scatter")
    i = next(j for j, a in enumerate(args) if a.name == "num_tokens")
    loose = td.with_arg_alignment(prog, {i: 8})
    [k], [k0] = loose.kernels, prog.kernels
    for b, p, p0 in zip(k.bufs, k.params, k0.params):
        if (b.kind, b.index) == ("arg", i):
            assert p0.divisibility > 8 and p.divisibility == 8
        else:
            assert p == p0
    assert td.kernel_params(k.ttir)[1] == k.params
    # Any row's address: 8-byte aligned at least, so no pointer is less aligned than declared.
    ptrs = [0x7f0000000000] * len(k.params)
    ptrs[[b.index for b in k.bufs].index(i)] += 8
    assert td.divisibility_for(k, ptrs) == tuple(p.divisibility for p in k.params)
    compiled = td.compile_kernel(k.ttir, num_warps=k.num_warps, num_stages=k.num_stages,
                                 target=_target())
    assert compiled.metadata.name == k.name
    assert td.with_arg_alignment(prog, {}) is prog


@functools.lru_cache(maxsize=None)
def _step_program():
    """The fused step's arguments and program on the shared case (scatter, plan, verify and
    write in one call)."""
    c = _case()
    kw = dict(context=c["ctx"], verify_plan_out=c["vp"], write_plan_out=c["wp"],
              input_ids=c["input_ids"], positions=c["positions"], out_cache_loc=c["ocl"],
              expected_token_ids=c["flat"], expected_token_offsets=c["offs"],
              check_verify_expected_token=True, enable_write_input_assert=False,
              expected_input_tokens=None, expected_input_positions=None,
              **{k: v for k, v in bo._plan_kw(c).items()
                 if k not in ("verify_plan_out", "write_plan_out")})
    ts = declarations.STEP.tensors(kw)
    args, static, results = declarations.STEP.arguments(kw, ts)
    return args, _extract(declarations.STEP.fn, args, results,
                          static=dict(static, platform="cuda"))


def test_fused_step_is_one_program_of_all_the_kernels():
    args, prog = _step_program()
    assert [k.name for k in prog.kernels] == [
        "kvcanary_scatter_req_token_ids", "kvcanary_plan_offsets", "kvcanary_plan_entries",
        "kvcanary_verify", "kvcanary_write"]
    names = [a.name for a in args]
    pool = names.index("req_to_verify_expected_tokens")
    scatter, _, entries, verify, write = prog.kernels
    # The scatter's output pool is the buffer the entries kernel reads, with no copy between
    # (after the bucketed history's true length, an operand of the scatter's kernel).
    assert scatter.bufs[3] == td.Buf("arg", names.index("expected_token_count"))
    assert scatter.bufs[4] == scatter.bufs[5] == td.Buf("arg", pool)
    assert entries.bufs[6] == td.Buf("arg", pool)
    # Verify's updated ring is what write appends to.
    ring = names.index("violation_ring")
    assert verify.bufs[7] == verify.bufs[11] == td.Buf("arg", ring)
    assert write.bufs[10] == td.Buf("arg", ring)
    assert prog.copies == ()


class _Recorder:
    """Stands in for triton's compiled kernel: records each launch (CPU, no driver)."""

    def __init__(self, kernel, divisibility, log):
        self.kernel, self.divisibility, self.log = kernel, divisibility, log

    def __getitem__(self, grid):
        def run(*args, stream):
            self.log.append((self.kernel.name, grid, args, stream, self.divisibility))
        return run


def _loaded(prog, args, log, compiled):
    def compile_one(kernel, divisibility):
        compiled.append((kernel.name, divisibility))
        return _Recorder(kernel, divisibility, log)

    import contextlib
    import unittest.mock as mock

    patch = mock.patch.object(torch.cuda, "device", lambda d: contextlib.nullcontext())
    patch.start()
    return td.Loaded(prog, CPU, compile_one, [a.name for a in args]), patch


def test_launch_passes_each_kernel_its_pointers_in_parameter_order():
    args, prog = _program("plan")
    log, compiled = [], []
    loaded, patch = _loaded(prog, args, log, compiled)
    try:
        ptrs = [0x10000 * (i + 1) for i in range(len(args))]  # 32-byte aligned
        loaded.launch(ptrs, stream=77)
        k1, k2 = prog.kernels
        (n1, g1, a1, s1, d1), (n2, g2, a2, s2, d2) = log
        assert (n1, g1, s1) == (k1.name, k1.grid, 77)
        assert d1 == tuple(p.divisibility for p in k1.params)  # aligned: XLA's kernel as is
        assert (n2, g2, s2) == (k2.name, k2.grid, 77)
        by_name = {a.name: p for a, p in zip(args, ptrs)}
        assert a1[:4] == tuple(by_name[n] for n in ("req_pool_indices", "prefix_lens",
                                                   "extend_seq_lens", "req_to_token"))
        assert a1[5] == by_name["num_reqs"]  # the batch size operand
        assert a1[6] == a1[12] == by_name["write_plan_out.write_offsets"]  # the alias
        assert a1[11] == a2[4]  # the verify offsets: one scratch buffer, written then read
        assert a2[8:12] == a2[12:16] == tuple(by_name[f"verify_plan_out.{k}"] for k in VP)
        # A pointer 8 bytes off: that kernel is compiled (once) for the alignment it has.
        ptrs[args.index(next(a for a in args if a.name == "verify_plan_out.verify_num_valid"))] += 8
        log.clear()
        loaded.launch(ptrs, stream=5)
        loaded.launch(ptrs, stream=5)
        div = log[0][4]
        assert div[8] == 8 and div[0] == 32  # verify_num_valid is the offsets kernel's 9th
        assert sum(1 for name, d in compiled if d == div) == 1
    finally:
        patch.stop()


def test_empty_batch_plan_is_copies_of_constants_and_matches_sglang(sgl):
    """bs = 0: the lowered plan holds no kernel, only results that are constants (SGLang's
    empty-batch plan); the launch copies them into the caller's tensors."""
    import kvcanary_jax.bridge as bridge
    from kvcanary_jax.bridge.launcher import _byte_view

    rpi = torch.zeros(0, dtype=torch.int64)
    plans = []
    for VP_, WP_ in ((bridge.VerifyPlan, bridge.WritePlan),
                     (sgl.verify.VerifyPlan, sgl.write.WritePlan)):
        vp = VP_.allocate(verify_capacity=8, device=CPU).zero_for_testing_()
        wp = WP_.allocate(write_req_capacity=3, device=CPU).zero_for_testing_()
        wp.write_offsets.fill_(9)
        vp.enable.zero_()
        plans.append((vp, wp))
    kw = dict(req_pool_indices=rpi, prefix_lens=rpi, extend_seq_lens=rpi,
              req_to_token=torch.zeros(2, 4, dtype=torch.int32), swa_window_size=0,
              full_to_swa_index_mapping=None, verify_capacity=8,
              req_to_verify_expected_tokens=None, req_to_verify_expected_tokens_valid_lens=None,
              kv_token_id_vs_position_offset=0)
    ours = dict(kw, verify_plan_out=plans[0][0], write_plan_out=plans[0][1])
    ts = declarations.PLAN.tensors(ours)
    args, static, results = declarations.PLAN.arguments(ours, ts)
    prog = _extract(declarations.PLAN.fn, args, results, static=dict(static, platform="cuda"))
    assert prog.kernels == () and prog.copies
    log, compiled = [], []
    loaded, patch = _loaded(prog, args, log, compiled)
    try:
        loaded.launch([ts[a.name].data_ptr() for a in args], stream=0,
                      arg_views=lambda i: _byte_view(ts[args[i].name], args[i]))
    finally:
        patch.stop()
    assert log == []
    sgl.plan_ref.launch_canary_plan_kernels_torch_reference(
        verify_plan_out=plans[1][0], write_plan_out=plans[1][1], **kw)
    for f in bridge.VerifyPlan.__dataclass_fields__:
        assert torch.equal(getattr(plans[0][0], f), getattr(plans[1][0], f)), f
    for f in bridge.WritePlan.__dataclass_fields__:
        assert torch.equal(getattr(plans[0][1], f), getattr(plans[1][1], f)), f


def test_a_length_row_at_any_8_byte_address_takes_the_kernel_built_first():
    """The launch's alignment test reads each parameter against its own declared divisibility:
    the length operand (declared 8) at an address only 8-byte aligned takes the first kernel
    without the alignment walk; another operand off its 32 bytes still gets its variant."""
    args, prog = _program("scatter")
    i = next(j for j, a in enumerate(args) if a.name == "num_tokens")
    prog = td.with_arg_alignment(prog, {i: 8})
    loaded = td.Loaded(prog, "cpu", None, [a.name for a in args])
    asked = []
    loaded.runner = lambda k, div: (lambda *a, stream: asked.append(div))
    base = 0x7f0000000000
    ptrs = [base] * len(args)
    ptrs[i] = base + 8
    loaded.launch(ptrs, 0)
    assert asked == [None]
    ptrs[0] = base + 8  # flat_in off its declared 32 bytes: a variant for that
    loaded.launch(ptrs, 0)
    j = [b.index for b in prog.kernels[0].bufs].index(0)
    assert asked[1] is not None and asked[1][j] == 8


def test_a_launchs_kernels_are_chosen_once_per_alignment_pattern():
    """The fused step's five kernels: pointers all as aligned as declared take each kernel's
    default; a pattern of lower alignments is resolved once (a kernel compiled for what its
    pointers have, the others' defaults) and reused while the low address bits repeat; a
    pointer off its element's size is refused on every call, never remembered."""
    args, prog = _step_program()
    names = [a.name for a in args]
    loaded = td.Loaded(prog, "cpu", None, names)
    asked, calls = [], []
    loaded.runner = lambda k, div: asked.append((k, div)) or (
        lambda *a, stream, k=k, div=div: calls.append((k, div, a)))
    base = 1 << 40
    ptrs = [base + 4096 * i for i in range(len(args))]
    for _ in range(3):
        loaded.launch(ptrs, 0)
    assert asked == [(k, None) for k in range(5)]  # each default once, then kept
    assert [k for k, _, _ in calls] == list(range(5)) * 3
    ring = names.index("violation_ring")
    users = [k for k, kern in enumerate(prog.kernels) if td.Buf("arg", ring) in kern.bufs]
    assert users  # verify and write append to it
    ptrs[ring] += 16
    asked.clear()
    calls.clear()
    for _ in range(3):
        loaded.launch(ptrs, 0)
        ptrs = [p + (1 << 20) for p in ptrs]  # other addresses, the same low bits
    assert [k for k, _ in asked] == list(range(5))  # resolved once for the pattern
    for k, div in asked:
        kern = prog.kernels[k]
        if k in users:
            j = kern.bufs.index(td.Buf("arg", ring))
            assert div[j] == 16 and div == td.divisibility_for(kern, calls[k][2])
        else:
            assert div is None
    # The arguments each kernel got are the call's, in parameter order.
    for k, div, a in calls[-5:]:
        assert a == tuple(ptrs[b.index] - (1 << 20) if b.kind == "arg" else a[n]
                          for n, b in enumerate(prog.kernels[k].bufs))
    ptrs[ring] += 4  # an int64 ring at a 4-byte address
    for _ in range(2):
        with pytest.raises(td.BridgeError,
                           match="violation_ring starts at an address that is not 8-byte"):
            loaded.launch(ptrs, 0)


def test_the_host_profile_times_every_kernel_a_warm_launch_runs(monkeypatch):
    """``bench.bridge_profile`` times triton's launcher by wrapping ``Loaded.runner``; a launch
    keeps the runners it was given, so the wrap makes every kept program fetch them again (and
    its undo once more): a warmed-up plan still counts its two kernels a call."""
    from kvcanary_jax.bench import bridge_profile
    from kvcanary_jax.bridge.cache import CACHES

    args, prog = _program("plan")
    launched = []
    monkeypatch.setattr(td.Loaded, "runner", lambda self, i, div: (
        lambda *a, stream: launched.append(i)))
    loaded = td.Loaded(prog, "cpu", None, [a.name for a in args])
    key = ("test_the_host_profile", id(loaded))
    CACHES.programs.put(key, loaded)
    try:
        ptrs = [0x10000 * (i + 1) for i in range(len(args))]
        for _ in range(3):
            loaded.launch(ptrs, 0)  # warm: the defaults are kept
        acc = bridge_profile.collections.Counter()
        undo = bridge_profile._timed_runners(acc)
        for _ in range(4):
            loaded.launch(ptrs, 0)
        undo()
        loaded.launch(ptrs, 0)
        assert acc["kernels"] == 4 * len(prog.kernels) == 8
        assert launched == [0, 1] * 8  # every launch ran each kernel, in order
    finally:
        CACHES.programs.pop(key)
