"""The torch bridge against careless inputs (CPU): the fused step checks the caller's token
arrays as the four launchers do, and a tensor a launcher writes may not share memory with one it
reads. Every refusal is checked to leave every buffer as it was (sentinel-filled)."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch

import kvcanary_jax.bridge as bridge
from kvcanary_jax.testing import cases

pytestmark = pytest.mark.torch


def _raises(cls, message):
    return pytest.raises(cls, match="^" + re.escape(message) + "$")


def _ctx(num_slots=16):
    return cases.torch_context(
        cases.TorchApi.bridge(), canary_buf=torch.full((num_slots, 32), 0xA5, dtype=torch.uint8),
        violation_ring=cases.violation_ring(8, fill=-9),
        kernel_kind=bridge.CanaryLaunchTag.HEAD_K_FULL,
        real_kv_hash_mode=bridge.RealKvHashMode.NONE)


def _step_kw(**change):
    rtt = torch.zeros(4, 8, dtype=torch.int32)
    rtt[1, :4] = torch.tensor([3, 4, 5, 6])
    vp = bridge.VerifyPlan.allocate(verify_capacity=16, device=torch.device("cpu"))
    wp = bridge.WritePlan.allocate(write_req_capacity=2, device=torch.device("cpu"))
    for t in _tensors(vp) + _tensors(wp):
        t.fill_(-3)  # sentinels: a refused call leaves them
    kw = dict(context=_ctx(), verify_plan_out=vp, write_plan_out=wp,
              req_pool_indices=torch.tensor([1]), prefix_lens=torch.tensor([0]),
              extend_seq_lens=torch.tensor([2]), req_to_token=rtt,
              input_ids=torch.tensor([5, 6]), positions=torch.tensor([0, 1]),
              out_cache_loc=torch.tensor([3, 4]))
    kw.update(change)
    return kw


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        return [obj]
    if dataclasses.is_dataclass(obj):
        return [t for f in dataclasses.fields(obj) for t in _tensors(getattr(obj, f.name))]
    if isinstance(obj, (tuple, list)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _snapshot(kw):
    return [t.clone() for v in kw.values() for t in _tensors(v)]


def _unchanged(kw, before):
    after = [t for v in kw.values() for t in _tensors(v)]
    return all(torch.equal(a, b) for a, b in zip(after, before))


@pytest.mark.parametrize("change,message", [
    # A slot past the canary buffer: the write would skip the token without a word.
    (dict(out_cache_loc=torch.tensor([3, 21])),
     "out_cache_loc[1]=21 is outside [-1, 16) (canary slots, negative = skip)"),
    # 3 extend tokens for 2 input_ids: the third token would be skipped.
    (dict(extend_seq_lens=torch.tensor([3])),
     "extend_seq_lens of the active requests (req_pool_indices != 0) sum to 3, more than the "
     "2 tokens of input_ids"),
])
def test_fused_step_checks_the_token_arrays_as_the_write_launcher_does(change, message):
    kw = _step_kw(**change)
    before = _snapshot(kw)
    with _raises(ValueError, "kv-canary: launch_canary_step " + message):
        bridge.launch_canary_step(**kw)
    assert _unchanged(kw, before)
    # The four launchers in sequence refuse the same call at the write.
    bridge.launch_canary_plan_kernels(**{k: kw[k] for k in (
        "verify_plan_out", "write_plan_out", "req_pool_indices", "prefix_lens",
        "extend_seq_lens", "req_to_token")}, swa_window_size=0, full_to_swa_index_mapping=None,
        verify_capacity=16, req_to_verify_expected_tokens=None,
        req_to_verify_expected_tokens_valid_lens=None, kv_token_id_vs_position_offset=0)
    with pytest.raises(ValueError, match="^kv-canary: launch_canary_write_kernel "):
        bridge.launch_canary_write_kernel(
            context=kw["context"], plan=kw["write_plan_out"], input_ids=kw["input_ids"],
            positions=kw["positions"], out_cache_loc=kw["out_cache_loc"],
            enable_write_input_assert=False, expected_input_tokens=None,
            expected_input_positions=None)


def test_fused_step_runs_the_well_formed_call():
    kw = _step_kw()
    bridge.launch_canary_step(**kw)
    assert int(kw["context"].kernel_run_counter[0]) == 2
    assert kw["write_plan_out"].write_offsets[:2].tolist() == [0, 2]


def _shared(msg):
    return _raises(bridge.BridgeError, "kv-canary bridge: " + msg + "; a tensor the launcher "
                   "writes must not overlap one it reads (pass distinct tensors)")


@pytest.mark.parametrize("checks", [True, False], ids=["value_checks", "no_value_checks"])
def test_scatter_refuses_a_pool_over_its_input(checks):
    buf = torch.arange(64, dtype=torch.int64)
    kw = dict(flat_in=buf[:8], offsets=torch.tensor([0, 8]), req_pool_indices=torch.tensor([1]),
              pool_out=buf.view(torch.int32).view(8, 16))
    with bridge.value_checks(checks), _shared(
            "launch_scatter_req_token_ids_kernel pool_out shares memory with flat_in"):
        bridge.launch_scatter_req_token_ids_kernel(**kw)
    assert buf.tolist() == list(range(64))


def test_plan_refuses_an_input_inside_its_output():
    kw = _step_kw()
    wp = kw["write_plan_out"]
    before = _snapshot(kw)
    with _shared("launch_canary_plan_kernels write_plan_out.write_offsets shares memory with "
                 "prefix_lens"):
        bridge.launch_canary_plan_kernels(
            verify_plan_out=kw["verify_plan_out"], write_plan_out=wp,
            req_pool_indices=kw["req_pool_indices"], prefix_lens=wp.write_offsets[:1],
            extend_seq_lens=kw["extend_seq_lens"], req_to_token=kw["req_to_token"],
            swa_window_size=0, full_to_swa_index_mapping=None, verify_capacity=16,
            req_to_verify_expected_tokens=None, req_to_verify_expected_tokens_valid_lens=None,
            kv_token_id_vs_position_offset=0)
    assert _unchanged(kw, before)


def test_fused_step_refuses_to_scatter_into_req_to_token():
    kw = _step_kw()
    before = _snapshot(kw)
    with _shared("launch_canary_step req_to_verify_expected_tokens shares memory with "
                 "req_to_token"):
        bridge.launch_canary_step(
            **kw, req_to_verify_expected_tokens=kw["req_to_token"],
            req_to_verify_expected_tokens_valid_lens=torch.tensor([2]),
            expected_token_ids=torch.tensor([5, 6]), expected_token_offsets=torch.tensor([0, 2]),
            check_verify_expected_token=True)
    assert _unchanged(kw, before)


@pytest.mark.parametrize("checks", [True, False], ids=["value_checks", "no_value_checks"])
def test_fused_step_checks_the_history_against_the_pool_it_is_given(checks):
    """The pool's address is part of the call signature: a step given a new pool of the same
    shape checks its history against that pool, not against the one an earlier call was
    prepared with. Both ways: a history where the old pool was runs, and a history inside the
    new pool's row is refused, with nothing written."""
    rows, cols = 4, 8
    old = torch.zeros(rows * cols, dtype=torch.int32)
    kw = _step_kw()  # the same outputs every call: one signature, but for the pool's address

    def step(pool, history):
        bridge.launch_canary_step(
            **kw, req_to_verify_expected_tokens=pool,
            req_to_verify_expected_tokens_valid_lens=torch.tensor([2]),
            expected_token_ids=history, expected_token_offsets=torch.tensor([0, 2]),
            check_verify_expected_token=True)

    with bridge.value_checks(checks):
        step(old.view(rows, cols), torch.tensor([5, 6]))
        assert old.view(rows, cols)[1, :2].tolist() == [5, 6]
        # The pool moves; the next history lies where the old pool was.
        new = torch.zeros(rows, cols, dtype=torch.int32)
        history = old.view(torch.int64)[:2]
        history.copy_(torch.tensor([5, 6]))
        step(new, history)
        assert new[1, :2].tolist() == [5, 6]
        # A history inside the row the step would scatter into is refused, nothing written.
        newer = torch.full((rows, cols), -1, dtype=torch.int32)
        inside = newer.view(-1).view(torch.int64)[4:6]  # row 1, columns 0-3
        inside.copy_(torch.tensor([5, 6]))
        before = newer.clone()
        with _shared("launch_canary_step req_to_verify_expected_tokens shares memory with "
                     "expected_token_ids"):
            step(newer, inside)
        assert torch.equal(newer, before)


@pytest.mark.parametrize("launcher,kw,message", [
    ("launch_scatter_req_token_ids_kernel",
     dict(flat_in=torch.arange(8)[::2], offsets=torch.tensor([0, 4]),
          req_pool_indices=torch.tensor([1]), pool_out=torch.zeros(2, 8, dtype=torch.int32)),
     "kv-canary: flat_in must be contiguous"),
    ("launch_canary_write_kernel",
     dict(context=_ctx(), plan=cases.torch_write_plan(cases.TorchApi.bridge(),
                                                      write_offsets=[0, 2],
                                                      write_seed_slot_indices=[-1],
                                                      write_num_valid_reqs=1),
          input_ids=torch.tensor([5, 0, 6, 0])[::2], positions=torch.arange(2),
          out_cache_loc=torch.tensor([3, 4]), enable_write_input_assert=False,
          expected_input_tokens=None, expected_input_positions=None),
     "kv-canary: input_ids must be contiguous"),
])
def test_contiguity_errors_name_the_launcher(launcher, kw, message):
    """SGLang's contiguity message names the tensor only; it stays word for word (the tests
    against SGLang compare it) and a note names the launcher wherever the traceback shows."""
    with pytest.raises(ValueError) as e:
        getattr(bridge, launcher)(**kw)
    assert str(e.value) == message
    assert e.value.__notes__ == [f"kv-canary bridge: raised by {launcher}"]


def test_fused_step_without_a_history_runs_with_value_checks_off():
    """No ``expected_token_ids`` (no scatter) with value checks off, the GPU's default: the
    per-call check of a bucketed history met None and raised ``AttributeError`` on every call.
    Each call now runs, and ends every buffer as with value checks on."""
    ends = []
    for checks in (True, False):
        bridge.clear_cache()
        kw = _step_kw()
        with bridge.value_checks(checks):
            for _ in range(2):
                bridge.launch_canary_step(**kw)
        ends.append(_snapshot(kw))
    assert all(torch.equal(a, b) for a, b in zip(*ends))
    assert int(kw["context"].kernel_run_counter[0]) == 4  # a verify and a write per step


def test_digest_sources_given_as_numpy_integers_are_in_the_signature():
    """A source's ``read_bytes`` as a numpy integer was held in the call signature by its type
    alone, so a call with another ``read_bytes`` reused the first call's prepared launch and
    hashed the wrong bytes. Each now digests as on a fresh start."""
    import numpy as np

    rows = [torch.arange(16 * 64, dtype=torch.int64).remainder(251).to(torch.uint8).view(16, 64)]
    slots = torch.arange(1, 9)

    def digest(read_bytes, warm):
        bridge.clear_cache()
        buf = torch.zeros(16, dtype=torch.int64)
        for rb in ((64, read_bytes) if warm else (read_bytes,)):
            src = tuple(bridge.RealKvSource(tensor=r, page_size=np.int64(1),
                                            num_bytes_per_token=np.int64(64),
                                            read_bytes=np.int64(rb)) for r in rows)
            bridge.launch_kv_digest_write(digest_buf=buf, slots=slots, sources=src)
        return buf

    assert torch.equal(digest(32, warm=True), digest(32, warm=False))
    assert not torch.equal(digest(32, warm=False), digest(64, warm=False))


@pytest.mark.parametrize("bad", [1.0, torch.tensor(1), np.array(1), True],
                         ids=["float", "tensor", "array", "bool"])
def test_a_sources_sizes_must_be_integers_even_after_an_integer_call(bad):
    """SGLang's ``RealKvSource`` takes any number for its sizes. A float or a 0-d tensor equal
    to an earlier call's integer was held in the call signature by its type or truncated to it,
    so the call reused the earlier one's checks and launch; a float that is not whole was
    truncated where the kernels index with it. Each is refused by name, with nothing written
    (an array scalar too, which a call signature cannot hold by value)."""
    import types

    rows = torch.arange(16 * 64, dtype=torch.int64).remainder(251).to(torch.uint8).view(16, 64)

    def source(page_size):  # as SGLang's own dataclass builds one: no type check
        return types.SimpleNamespace(tensor=rows, page_size=page_size, num_bytes_per_token=64,
                                     read_bytes=64)

    message = f"kv-canary: RealKvSource.page_size must be an int, got {type(bad).__name__} {bad!r}"
    buf, slots = torch.zeros(16, dtype=torch.int64), torch.arange(1, 9)
    bridge.launch_kv_digest_write(digest_buf=buf, slots=slots, sources=(source(1),))
    before = buf.clone()
    with pytest.raises(TypeError, match="^" + re.escape(message) + "(\n|$)"):
        bridge.launch_kv_digest_write(digest_buf=buf, slots=slots, sources=(source(bad),))
    assert torch.equal(buf, before)

    ctx = dataclasses.replace(_ctx(), real_kv_sources=(source(1),),
                              real_kv_hash_mode=bridge.RealKvHashMode.ALL)
    vp = bridge.VerifyPlan.allocate(verify_capacity=4, device=torch.device("cpu"))
    vp.zero_for_testing_().enable.fill_(1)
    bridge.launch_canary_verify_kernel(context=ctx, plan=vp, check_verify_expected_token=False)
    ctx = dataclasses.replace(ctx, real_kv_sources=(source(bad),))
    kw = dict(context=ctx, plan=vp)
    before = _snapshot(kw)
    with pytest.raises(TypeError, match="^" + re.escape(message) + "(\n|$)"):
        bridge.launch_canary_verify_kernel(context=ctx, plan=vp, check_verify_expected_token=False)
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(kw)))
    with pytest.raises(TypeError, match="^" + re.escape(message) + "(\n|$)"):
        bridge.RealKvSource(tensor=rows, page_size=bad, num_bytes_per_token=64, read_bytes=64)


def _plan_with_pool(pool, valid_lens, *, prefix=(6, 6), rpi=(1, 2), offset=0):
    rtt = torch.arange(4 * 16, dtype=torch.int32).view(4, 16)
    kw = dict(
        verify_plan_out=bridge.VerifyPlan.allocate(verify_capacity=32, device=torch.device("cpu")),
        write_plan_out=bridge.WritePlan.allocate(write_req_capacity=2, device=torch.device("cpu")),
        req_pool_indices=torch.tensor(rpi), prefix_lens=torch.tensor(prefix),
        extend_seq_lens=torch.tensor([1, 1]), req_to_token=rtt, swa_window_size=0,
        full_to_swa_index_mapping=None, verify_capacity=32, req_to_verify_expected_tokens=pool,
        req_to_verify_expected_tokens_valid_lens=torch.tensor(valid_lens),
        kv_token_id_vs_position_offset=offset)
    for t in _tensors(kw["verify_plan_out"]) + _tensors(kw["write_plan_out"]):
        t.fill_(-3)
    return kw


@pytest.mark.parametrize("rows,width,valid_lens,offset,message", [
    # Request 1's row past the pool: the kernel read no tokens (-1) for it.
    (2, 16, (7, 7), 0, "req_pool_indices[1]=2 is outside [0, 2) (rows of "
                       "req_to_verify_expected_tokens)"),
    # Columns 4 and 5 past a 4-wide pool: the kernel read the next row's tokens.
    (5, 4, (7, 7), 0, "req_to_verify_expected_tokens_valid_lens[0]=7 reads past "
                      "req_to_verify_expected_tokens's width 4 (prefix_lens[0]=6, "
                      "kv_token_id_vs_position_offset=0)"),
    (5, 6, (7, 7), 1, "req_to_verify_expected_tokens_valid_lens[0]=7 reads past "
                      "req_to_verify_expected_tokens's width 6 (prefix_lens[0]=6, "
                      "kv_token_id_vs_position_offset=1)"),
])
def test_plan_refuses_to_read_the_expected_token_pool_past_its_rows_or_width(
        rows, width, valid_lens, offset, message):
    """SGLang's reference indexes the pool at each verified position (an IndexError past it),
    while the kernels would have given a request no expected tokens or another row's, a miss or
    a false alarm, without a word. With value checks on, the plan and the fused step refuse it
    by name and write nothing."""
    from kvcanary_jax import oracle

    ref = oracle.load().plan_ref.launch_canary_plan_kernels_torch_reference
    pool = torch.arange(rows * width, dtype=torch.int32).view(rows, width) + 100
    with pytest.raises(IndexError):
        ref(**_plan_with_pool(pool.clone(), valid_lens, offset=offset))
    kw = _plan_with_pool(pool, valid_lens, offset=offset)
    before = _snapshot(kw)
    with _raises(ValueError, "kv-canary: launch_canary_plan_kernels " + message):
        bridge.launch_canary_plan_kernels(**kw)
    assert _unchanged(kw, before)
    step = {k: v for k, v in kw.items() if k != "verify_capacity"}
    step.update(context=_ctx(), input_ids=torch.tensor([5, 6]), positions=torch.tensor([6, 6]),
                out_cache_loc=torch.tensor([3, 4]))
    before = _snapshot(step)
    with _raises(ValueError, "kv-canary: launch_canary_plan_kernels " + message):
        bridge.launch_canary_step(**step)
    assert _unchanged(step, before)


@pytest.mark.parametrize("rows,width,valid_lens,offset,prefix", [
    (2, 16, (7, 0), 0, (6, 6)),  # request 1 reads nothing (valid length 0): its row may be past
    (5, 4, (7, 7), 0, (4, 4)),  # valid lengths past the width, the reads within it
    (5, 4, (7, 7), -2, (6, 6)),  # the offset keeps the reads within the width
])
def test_plan_reads_of_the_pool_within_its_bounds_are_not_refused(rows, width, valid_lens,
                                                                  offset, prefix):
    from kvcanary_jax import oracle

    ref = oracle.load().plan_ref.launch_canary_plan_kernels_torch_reference
    pool = torch.arange(rows * width, dtype=torch.int32).view(rows, width) + 100
    theirs = _plan_with_pool(pool.clone(), valid_lens, offset=offset, prefix=prefix)
    ours = _plan_with_pool(pool, valid_lens, offset=offset, prefix=prefix)
    ref(**theirs)
    bridge.launch_canary_plan_kernels(**ours)
    n = int(theirs["verify_plan_out"].verify_num_valid[0])
    assert n == int(ours["verify_plan_out"].verify_num_valid[0]) > 0
    got, want = ours["verify_plan_out"], theirs["verify_plan_out"]
    assert torch.equal(got.verify_expected_tokens[:n], want.verify_expected_tokens[:n])
    assert (got.verify_expected_tokens[:n] != -1).any()


@pytest.mark.parametrize("name,value,launcher", [
    ("full_to_swa_index_mapping", [0, 1, 2], "plan"),
    ("req_to_verify_expected_tokens", np.zeros((4, 8), np.int32), "plan"),
    ("req_to_verify_expected_tokens_valid_lens", [2], "plan"),
    ("req_to_verify_expected_tokens_valid_lens", np.array([2]), "step"),
])
def test_a_non_tensor_in_an_optional_slot_is_refused_by_name(name, value, launcher):
    """An optional tensor given as a list, a numpy array or an int used to fail with an
    AttributeError from inside the checks (or pass them, a numpy array having a shape)."""
    kw = _step_kw(**{"req_to_verify_expected_tokens": torch.zeros(4, 8, dtype=torch.int32),
                     "req_to_verify_expected_tokens_valid_lens": torch.tensor([2]), name: value})
    if launcher == "plan":
        kw = {k: v for k, v in kw.items() if k not in (
            "context", "input_ids", "positions", "out_cache_loc")}
        kw.update(swa_window_size=0, verify_capacity=16, kv_token_id_vs_position_offset=0)
        kw.setdefault("full_to_swa_index_mapping", None)
    before = _snapshot(kw)
    full = "launch_canary_plan_kernels" if launcher == "plan" else "launch_canary_step"
    with _raises(TypeError, f"kv-canary: {full} {name} must be a torch.Tensor or None, got "
                            f"{type(value).__name__}"):
        getattr(bridge, full)(**kw)
    assert _unchanged(kw, before)


def test_the_write_keeps_sglangs_error_for_a_non_tensor_expected_input():
    kw = _step_kw()
    args = dict(context=kw["context"], plan=kw["write_plan_out"], input_ids=kw["input_ids"],
                positions=kw["positions"], out_cache_loc=kw["out_cache_loc"],
                enable_write_input_assert=False, expected_input_tokens=5,
                expected_input_positions=None)
    with pytest.raises(ValueError, match="^kv-canary: expected input tensors must be None when "
                                         "enable_write_input_assert=False\n"):
        bridge.launch_canary_write_kernel(**args)


@pytest.mark.parametrize("name,bad,cls,message", [
    ("verify_capacity", 32.5, ValueError, "verify_capacity=32.5 does not match "
                                          "verify_plan_out.verify_slot_indices.shape[0]=32"),
    ("verify_capacity", 32.0, TypeError, "verify_capacity must be an int, got float 32.0"),
    ("swa_window_size", 0.0, TypeError, "swa_window_size must be an int, got float 0.0"),
    ("kv_token_id_vs_position_offset", torch.tensor(0), TypeError,
     "kv_token_id_vs_position_offset must be an int, got Tensor tensor(0)"),
    ("kv_token_id_vs_position_offset", 0.5, TypeError,
     "kv_token_id_vs_position_offset must be an int, got float 0.5"),
    # SGLang compares whatever it is given: its mismatch error where the comparison fails.
    ("verify_capacity", None, ValueError, "verify_capacity=None does not match "
                                          "verify_plan_out.verify_slot_indices.shape[0]=32"),
    ("verify_capacity", torch.tensor(31), ValueError,
     "verify_capacity=31 does not match verify_plan_out.verify_slot_indices.shape[0]=32"),
    ("verify_capacity", torch.tensor(32), TypeError,
     "verify_capacity must be an int, got Tensor tensor(32)"),
])
def test_the_plans_scalars_must_be_integers_even_after_an_integer_call(name, bad, cls, message):
    """The plan's scalars went through ``int()`` into the call signature and the checks: a
    ``verify_capacity`` of 32.5 was truncated where SGLang raises, and an offset of 0.5 or a
    0-d tensor reused an integer call's launch (SGLang's launcher truncates the offset, and
    its reference adds it to positions). SGLang's error where it raises one, else a TypeError
    naming the scalar; nothing written, by the plan or the fused step."""
    pool = torch.arange(5 * 16, dtype=torch.int32).view(5, 16) + 100
    bridge.launch_canary_plan_kernels(**_plan_with_pool(pool.clone(), (7, 7)))
    kw = _plan_with_pool(pool, (7, 7))
    kw[name] = bad
    before = _snapshot(kw)
    with pytest.raises(cls, match="^" + re.escape("kv-canary: launch_canary_plan_kernels "
                                                  + message) + "(\n|$)"):
        bridge.launch_canary_plan_kernels(**kw)
    assert _unchanged(kw, before)
    if name == "verify_capacity":
        return  # the step takes its capacity from the plan
    step = {k: v for k, v in kw.items() if k != "verify_capacity"}
    step.update(context=_ctx(), input_ids=torch.tensor([5, 6]), positions=torch.tensor([6, 6]),
                out_cache_loc=torch.tensor([3, 4]))
    good = dict(step, **{name: 0})
    bridge.launch_canary_step(**{k: (v.clone() if isinstance(v, torch.Tensor) else v)
                                 for k, v in good.items()})
    before = _snapshot(step)
    with pytest.raises(cls, match="^" + re.escape("kv-canary: launch_canary_plan_kernels "
                                                  + message) + "(\n|$)"):
        bridge.launch_canary_step(**step)
    assert _unchanged(step, before)


@pytest.mark.parametrize("rpi,prefix,refused", [
    ((1, 9), (6, 0), False),  # row 9 past the table, no prefix: nothing read there
    ((1, -2), (6, 0), False),
    ((1, 9), (6, 1), True),  # a prefix reads row 9: SGLang's reference raises
    ((1, -2), (6, 3), True),  # the reference wraps to row 2, the kernels would read zeros
])
def test_plan_checks_only_the_rows_it_reads(rpi, prefix, refused):
    """A request's row of ``req_to_token`` is read only for its prefix. A row past the table
    with no prefix was refused although SGLang's reference (and kernels) read nothing there;
    it now gives the reference's plans, and a row that is read is still refused by name."""
    from kvcanary_jax import oracle

    ref = oracle.load().plan_ref.launch_canary_plan_kernels_torch_reference
    pool = torch.arange(5 * 16, dtype=torch.int32).view(5, 16) + 100
    ours = _plan_with_pool(pool.clone(), (7, 7), rpi=rpi, prefix=prefix)
    if refused:
        before = _snapshot(ours)
        with _raises(ValueError, f"kv-canary: launch_canary_plan_kernels req_pool_indices[1]="
                                 f"{rpi[1]} is outside [0, 4) (rows of req_to_token)"):
            bridge.launch_canary_plan_kernels(**ours)
        assert _unchanged(ours, before)
        return
    theirs = _plan_with_pool(pool.clone(), (7, 7), rpi=rpi, prefix=prefix)
    ref(**theirs)
    bridge.launch_canary_plan_kernels(**ours)
    for got, want in zip(_tensors(ours["verify_plan_out"]) + _tensors(ours["write_plan_out"]),
                         _tensors(theirs["verify_plan_out"]) + _tensors(theirs["write_plan_out"])):
        assert torch.equal(got, want)


@pytest.mark.parametrize("tokens,positions", [(None, [0, 1]), ([5, 6], None), (None, 5)])
def test_the_write_keeps_sglangs_error_for_a_missing_expected_input(tokens, positions):
    """With the input assert on and one expected input missing, SGLang raises its "required"
    error whatever the other is; a list or an int beside the None gave the bridge's TypeError."""
    kw = _step_kw()
    args = dict(context=kw["context"], plan=kw["write_plan_out"], input_ids=kw["input_ids"],
                positions=kw["positions"], out_cache_loc=kw["out_cache_loc"],
                enable_write_input_assert=True, expected_input_tokens=tokens,
                expected_input_positions=positions)
    step = dict(kw, enable_write_input_assert=True, expected_input_tokens=tokens,
                expected_input_positions=positions)
    for launch, call in ((bridge.launch_canary_write_kernel, args),
                         (bridge.launch_canary_step, step)):
        before = _snapshot(call)
        with pytest.raises(ValueError, match="^kv-canary: expected input tensors are required "
                                             "when enable_write_input_assert=True\n"):
            launch(**call)
        assert _unchanged(call, before)


@pytest.mark.parametrize("row,swa,prefix,refused", [
    ((3, 6), 2, 2, "6"),  # the last verified slot past a 6-entry table
    ((6, 3), 2, 2, "6"),  # the first one's
    ((6, 3), 1, 2, "6"),  # a window of 1 verifies position 1 and reads its predecessor, slot 6
    ((6, 3, 4), 1, 3, None),  # position 0 is neither verified nor a predecessor: not read
    ((2, 5), 2, 2, None),
])
def test_plan_refuses_a_slot_past_the_swa_table(row, swa, prefix, refused):
    """A slot the plan translates through ``full_to_swa_index_mapping`` past the table was
    clamped to its last entry (as SGLang's kernels do): the slot checked against another's
    canary. SGLang's reference raises; with value checks on, the plan refuses it in its words
    and writes nothing."""
    from kvcanary_jax import oracle

    ref = oracle.load().plan_ref.launch_canary_plan_kernels_torch_reference

    def kw():
        out = dict(
            verify_plan_out=bridge.VerifyPlan.allocate(verify_capacity=4,
                                                       device=torch.device("cpu")),
            write_plan_out=bridge.WritePlan.allocate(write_req_capacity=1,
                                                     device=torch.device("cpu")),
            req_pool_indices=torch.tensor([1]), prefix_lens=torch.tensor([prefix]),
            extend_seq_lens=torch.tensor([1]),
            req_to_token=torch.tensor([[0] * len(row), list(row)], dtype=torch.int32),
            swa_window_size=swa, full_to_swa_index_mapping=torch.arange(10, 16),
            verify_capacity=4, req_to_verify_expected_tokens=None,
            req_to_verify_expected_tokens_valid_lens=None, kv_token_id_vs_position_offset=0)
        for t in _tensors(out["verify_plan_out"]) + _tensors(out["write_plan_out"]):
            t.fill_(-3)
        return out

    theirs, ours = kw(), kw()
    if refused is None:
        ref(**theirs)
        bridge.launch_canary_plan_kernels(**ours)
        for got, want in zip(_tensors(ours["verify_plan_out"]) + _tensors(ours["write_plan_out"]),
                             _tensors(theirs["verify_plan_out"])
                             + _tensors(theirs["write_plan_out"])):
            assert torch.equal(got, want)
        return
    message = f"kv-canary: SWA slot {refused} is outside full_to_swa_index_mapping length 6"
    with _raises(ValueError, message):
        ref(**theirs)
    before = _snapshot(ours)
    with pytest.raises(ValueError, match="^" + re.escape(message) + "(\n|$)"):
        bridge.launch_canary_plan_kernels(**ours)
    assert _unchanged(ours, before)
