"""The sglang-jax hooks without sglang-jax: the runner's version read from its objects (a
stand-in shaped as each version's ``ModelRunner``), an unsupported runner and a second hook
refused when installed, and :class:`HiCacheHook` moving a page's canary rows with it through a
stand-in controller. (The real runners and HiCache: tests/test_sglang_jax.py,
tests/test_sglang_jax_01.py.)"""

from __future__ import annotations

import dataclasses
import types

import jax
import numpy as np
import pytest

from kvcanary_jax.integrations import sglang_jax as ksj
from kvcanary_jax.runtime.state import SLOT_STEPS

PAGE = 4


def _canary(**kw):
    return ksj.SglangJaxCanary(num_slots=64, page_size=PAGE, context_len=10, max_bs=4, **kw)


def _wrapped_runner(version: str):
    """A stand-in ModelRunner shaped as each sglang-jax version's (its jitted_run_model a wrapper
    closing over the jitted body, model_def and model_state_def; the rest of the runner as that
    version has it)."""
    model_def, model_state_def, model_state_leaves = object(), object(), []
    jitted_run_model = jax.jit(lambda *args: args, static_argnums=(0, 1))
    if version == "0.0.2":
        def run_model_wrapper(forward_batch, logits_metadata):
            return jitted_run_model(model_def, model_state_def, model_state_leaves,
                                    forward_batch, None, logits_metadata)

        return types.SimpleNamespace(jitted_run_model=run_model_wrapper, token_to_kv_pool=None,
                                     _set_kv_cache_after_forward=lambda *a: None)
    runner = types.SimpleNamespace(model_state_leaves=[], token_to_kv_pool=None,
                                   memory_pools=types.SimpleNamespace(replace_all=print))

    def run_model_wrapper(forward_batch, logits_metadata):
        return jitted_run_model(model_def, model_state_def, runner.model_state_leaves,
                                forward_batch, runner.memory_pools, logits_metadata)

    runner.jitted_run_model = run_model_wrapper
    return runner


def test_the_runner_s_version_is_read_from_its_objects():
    """0.0.2: the wrapper passes token_to_kv_pool, the runner stores with
    _set_kv_cache_after_forward; 0.1.0rc0: a MemoryPools with replace_all, the weights read from
    model_state_leaves. The body is the wrapper's own jitted function."""
    for version in ksj.SUPPORTED_VERSIONS:
        api = ksj.runner_api(_wrapped_runner(version))
        assert api.version == version and callable(api.run_model)
        assert api.pooled == (version == "0.1.0rc0")


def test_an_unsupported_runner_is_refused_when_the_hook_is_installed():
    """A runner of neither version (a renamed pool, a wrapper without the jitted body): refused
    before anything is installed, naming what was found and what is supported."""
    odd = types.SimpleNamespace(jitted_run_model=lambda fb, lm: None, token_to_kv_pool=None)
    with pytest.raises(TypeError) as err:
        ksj.ModelRunnerHook(_canary(), odd)
    text = str(err.value)
    assert text.startswith("kv-canary sglang-jax: unsupported sglang-jax ModelRunner: found {")
    assert "'memory_pools': 'NoneType'" in text and "'jitted_run_model closes over': []" in text
    assert "supported: sglang-jax 0.0.2 (" in text and "and 0.1.0rc0 (" in text
    runner = _wrapped_runner("0.1.0rc0")
    runner.memory_pools = types.SimpleNamespace()  # a pool container without replace_all
    with pytest.raises(TypeError, match="unsupported sglang-jax ModelRunner"):
        ksj.ModelRunnerHook(_canary(), runner)
    assert odd.jitted_run_model.__name__ == "<lambda>"  # nothing installed


def test_a_second_hook_is_refused():
    runner = _wrapped_runner("0.0.2")
    hook = ksj.ModelRunnerHook(_canary(), runner)
    assert hook.version == "0.0.2"
    with pytest.raises(ValueError, match="already has a canary hook installed"):
        ksj.ModelRunnerHook(_canary(), runner)
    hook.uninstall()
    assert ksj.runner_api(runner).version == "0.0.2"


def test_a_hook_resumes_the_previous_hook_s_state_and_warns_over_a_serving_pool(caplog):
    """A hook installed again on a serving runner takes the previous hook's state and feed
    (``resume=``); one installed without it over slots in use says so, once, naming the way out
    (its new state knows none of that KV: every step reading it would report it)."""
    import logging

    canary = _canary()
    runner = _wrapped_runner("0.0.2")
    first = ksj.ModelRunnerHook(canary, runner)
    with pytest.raises(ValueError, match=r"it is still installed: call its uninstall\(\) first"):
        ksj.ModelRunnerHook(canary, runner, resume=first)
    first.uninstall()
    with pytest.raises(ValueError, match=r"resume= takes a hook of the same canary"):
        ksj.ModelRunnerHook(_canary(ring_capacity=128), runner, resume=first)
    with pytest.raises(TypeError, match=r"resume= takes the previous ModelRunnerHook, got dict"):
        ksj.ModelRunnerHook(canary, runner, resume={})
    # sglang-jax's allocator with 5 of 32 slots handed out (0.0.2: size, available_size()).
    runner.token_to_kv_pool_allocator = types.SimpleNamespace(size=32, available_size=lambda: 27)
    with caplog.at_level(logging.WARNING, logger="kvcanary_jax.integrations.sglang_jax.hooks"):
        second = ksj.ModelRunnerHook(canary, runner, resume=first)
        assert second.state is first.state and second.feed is first.feed
        assert not caplog.records  # resumed: the state knows the pool's KV
        second.uninstall()
        fresh = ksj.ModelRunnerHook(canary, runner)
    assert fresh.state is not first.state
    assert [r.getMessage() for r in caplog.records] == [
        "kv-canary sglang-jax: the runner's allocator has 5 KV slot(s) in use before this "
        "hook's canary: every step that reads one written before it (a prefix-cache hit, a "
        "running request) will report violations. Install before the runner serves, flush the "
        "radix cache first, or pass resume= the previous hook"]
    fresh.uninstall()
    # 0.1.0rc0's per-rank allocator: every rank's slots in use.
    runner.token_to_kv_pool_allocator = types.SimpleNamespace(
        size=64, dp_size=2, available_size=lambda dp_rank=0: (32, 30)[dp_rank])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvcanary_jax.integrations.sglang_jax.hooks"):
        ksj.ModelRunnerHook(canary, runner).uninstall()
    assert "has 2 KV slot(s) in use" in caplog.records[0].getMessage()
    # 0.1.0rc0's SWA hybrid: its available_size() is the smaller pool's (the window's, 0.8x by
    # default): the full-attention pool's count is read, so a fresh one warns of nothing.
    full = types.SimpleNamespace(size=64, available_size=lambda: 64)
    runner.token_to_kv_pool_allocator = types.SimpleNamespace(
        size=64, available_size=lambda: 51, full_attn_allocator=full)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvcanary_jax.integrations.sglang_jax.hooks"):
        ksj.ModelRunnerHook(canary, runner).uninstall()
    assert not caplog.records


def test_a_resumed_hook_s_state_flags_and_its_new_manager():
    """resume= takes an uninstalled hook once; a managed hook resumed with a new manager flushes
    the previous one and reads the state's ring from where it stands: rows the previous manager
    reported are not reported again (2 rows in the ring here: nothing new, nothing reported)."""
    import jax.numpy as jnp

    canary = _canary()
    runner = _wrapped_runner("0.0.2")
    first = ksj.ModelRunnerHook(canary, runner)
    first.uninstall()
    second = ksj.ModelRunnerHook(canary, runner, resume=first)
    first.uninstall()  # again: second keeps the runner
    assert runner.jitted_run_model == second._run
    second.uninstall()
    with pytest.raises(ValueError, match=r"resume= takes a hook that was uninstalled and not "
                                         r"resumed already \(another hook took over its state\)"):
        ksj.ModelRunnerHook(canary, runner, resume=first)
    first.uninstall()  # again, with a hook installed since: leaves the runner to that hook
    other = _wrapped_runner("0.0.2")
    third = ksj.ModelRunnerHook(canary, other, resume=second)
    with pytest.raises(ValueError, match=r"\(it is still installed: call its uninstall\(\) first\)"):
        ksj.ModelRunnerHook(canary, runner, resume=third)
    third.uninstall()

    seen, flushed = [], []
    old = ksj.canary_manager(canary, "log", on_violation=seen.append)
    managed = ksj.ManagedModelRunnerHook(canary, runner, old)
    managed.uninstall()
    # Two rows its manager saw already (a hand-made ring: slot 3, a TAIL token mismatch).
    state = managed.state
    with jax.enable_x64(True):
        ring = state.violation_ring.at[:, :2, 1].set(3)
        managed.state = dataclasses.replace(
            state, violation_ring=ring,
            violation_write_index=jnp.full_like(state.violation_write_index, 2))
    old.flush = lambda: flushed.append(True)
    new = ksj.canary_manager(canary, "log", on_violation=seen.append)
    ksj.ManagedModelRunnerHook(canary, runner, new, resume=managed).uninstall()
    assert flushed == [True] and new.state is not None
    new.flush()
    assert seen == []


def test_a_shared_prefix_slot_resolves_to_each_request_holding_it():
    """Two requests share a prefix (slot 7 at position 1 in both rows), a third does not: the
    rows the step reports for slot 7 go to each holder in turn; a slot no request holds, or one
    held on two data-parallel ranks, resolves to None."""
    table = np.zeros((4, 8), np.int32)
    table[1, :3] = [5, 7, 9]
    table[2, :3] = [5, 7, 11]
    table[3, :2] = [12, 13]
    pool = types.SimpleNamespace(req_to_token=table)

    def req(rid, row, n, rank=0):
        return types.SimpleNamespace(rid=rid, req_pool_idx=row, origin_input_ids=[0] * n,
                                     output_ids=[], dp_rank=rank)

    a, b, c = req("a", 1, 3), req("b", 2, 3), req("c", 3, 2)
    resolve = ksj.request_resolver([a, b, c], pool)
    assert [resolve(7).rid for _ in range(3)] == ["a", "b", "a"]
    assert resolve(9).rid == "a" and resolve(13).rid == "c" and resolve(30) is None
    two_ranks = ksj.request_resolver([[a], [req("d", 2, 3, rank=1)]], pool)
    assert two_ranks(7) is None and two_ranks(9).rid == "a"


class _Controller:
    """What HiCacheHook wraps of sglang-jax's HiCacheController (the KV transfers elided)."""

    def __init__(self):
        self.calls = []

    def write(self, device_indices, host_buffer_ids):
        self.calls.append(("write", list(device_indices), list(host_buffer_ids)))

    def load(self, host_buffer_ids, device_indices):
        self.calls.append(("load", list(host_buffer_ids), list(device_indices)))

    def flush_load(self, host_buffer_ids, device_indices):
        self.calls.append(("flush_load", list(host_buffer_ids), list(device_indices)))

    def evict_callback(self, host_buffer_ids):
        self.calls.append(("evict", list(host_buffer_ids)))


def test_hicache_hook_moves_a_page_s_canary_rows(caplog):
    """A page's rows go to the host with it and come back into the slots it is loaded into;
    a page loaded without rows gets cleared rows and a warning; evicted pages drop theirs."""
    canary = _canary()
    holder = types.SimpleNamespace(canary=canary, state=canary.init_state())
    rows = np.arange(PAGE * 32, dtype=np.uint8).reshape(PAGE, 32) + 1
    holder.state = dataclasses.replace(holder.state, bufs={
        name: b.at[0, PAGE:2 * PAGE, :32].set(rows) for name, b in holder.state.bufs.items()})
    controller = _Controller()
    hook = ksj.HiCacheHook(holder, controller)
    controller.write([1], [7])  # page 1: slots PAGE .. 2 * PAGE - 1
    assert sorted(hook.host_rows) == [7]
    controller.flush_load([7], [3])
    for b in holder.state.bufs.values():
        assert np.array_equal(np.asarray(b[0, 3 * PAGE:4 * PAGE, :32]), rows)
    with caplog.at_level("WARNING", logger="kvcanary_jax"):
        controller.load([9], [1])  # never backed up through the hook
    assert "whose canary rows were never backed up" in caplog.text
    for b in holder.state.bufs.values():
        assert not np.asarray(b[0, PAGE:2 * PAGE, :32]).any()
    controller.evict_callback([7])
    assert hook.host_rows == {}
    assert [c[0] for c in controller.calls] == ["write", "flush_load", "load", "evict"]
    hook.uninstall()
    assert controller.write.__func__ is _Controller.write


def test_hicache_hook_moves_a_page_s_digests_with_it():
    """With a coverage window a page also carries each slot's KV digest and its stamp: restored
    at the slots it is loaded into (whose read, check and sweep counters start afresh); a page
    loaded without them gets a digest of 0 stamped at step 0, so its slots fail their next
    digest check instead of going unchecked."""
    canary = _canary(coverage_window=2, num_layers=1)
    holder = types.SimpleNamespace(canary=canary, state=canary.init_state())
    sc = holder.state.coverage.groups["FULL"]
    digests = np.arange(PAGE, dtype=np.int64) * 0x1_0000_0001 - 7
    with jax.enable_x64(True):
        col = SLOT_STEPS.index
        steps = (sc.steps.at[0, PAGE:2 * PAGE, col("written_at")].set(5)
                 .at[0, PAGE:2 * PAGE, col("read_at")].set(4)
                 .at[0, 3 * PAGE:4 * PAGE, col("checked_at")].set(9)
                 .at[0, 3 * PAGE:4 * PAGE, col("read_at")].set(9))
        sc = dataclasses.replace(sc, digest=sc.digest.at[0, PAGE:2 * PAGE].set(digests),
                                 steps=steps)
        cov = holder.state.coverage
        holder.state = dataclasses.replace(holder.state, coverage=dataclasses.replace(
            cov, groups={"FULL": sc}))
    controller = _Controller()
    ksj.HiCacheHook(holder, controller)
    controller.write([1], [7])  # page 1: slots PAGE .. 2 * PAGE - 1
    controller.load([7], [3])  # into page 3
    sc = holder.state.coverage.groups["FULL"]
    new = slice(3 * PAGE, 4 * PAGE)
    assert np.asarray(sc.digest)[0, new].tolist() == digests.tolist()
    assert np.asarray(sc.written_at)[0, new].tolist() == [5] * PAGE
    for field in ("read_from", "read_at", "checked_at", "swept_at"):
        assert np.asarray(getattr(sc, field))[0, new].tolist() == [-1] * PAGE, field
    assert np.asarray(sc.digest).dtype == np.int64
    controller.load([9], [2])  # never backed up through the hook
    sc = holder.state.coverage.groups["FULL"]
    lost = slice(2 * PAGE, 3 * PAGE)
    assert np.asarray(sc.digest)[0, lost].tolist() == [0] * PAGE
    assert np.asarray(sc.written_at)[0, lost].tolist() == [0] * PAGE


def test_hicache_hook_refuses_what_it_cannot_hook():
    with pytest.raises(TypeError, match="needs a holder with .canary"):
        ksj.HiCacheHook(types.SimpleNamespace(state=None), _Controller())
    canary = _canary()
    holder = types.SimpleNamespace(canary=canary, state=canary.init_state())
    with pytest.raises(TypeError, match=r"lacks \['load', 'flush_load'\]"):
        ksj.HiCacheHook(holder, types.SimpleNamespace(write=print, evict_callback=print))
    with pytest.raises(ValueError, match="device page 99 is outside the 16 pages"):
        ksj.HiCacheHook(holder, _Controller()).controller.write([99], [0])


def test_a_step_that_fails_on_the_device_leaves_the_hook_refusing_with_why():
    """The guarded step fails after it took the donated state (a device failure): the hook
    raises ``CanaryStateLost`` (the device's error its cause) and refuses every later step with
    it, where before each later step failed on XLA's deleted buffers. A step that fails before
    it runs (while traced) keeps the state."""
    from kvcanary_jax.runtime import CanaryStateLost

    hook = ksj.ModelRunnerHook(_canary(), _wrapped_runner("0.0.2"))
    kept = hook.state

    def refused(state, *args, **kw):
        raise ValueError("the step does not trace")

    def fails_on_device(state, *args, **kw):
        for leaf in jax.tree_util.tree_leaves(state):
            leaf.delete()  # what a donating computation that failed leaves
        raise RuntimeError("INTERNAL: the device step failed")

    hook._step = refused
    with pytest.raises(ValueError, match="does not trace"):
        hook._run(None, None)
    assert hook.state is kept
    hook._step = fails_on_device
    with pytest.raises(CanaryStateLost, match="a step failed on the device after taking it "
                       r"\(RuntimeError: INTERNAL: the device step failed\); the canary's "
                       "state and the runner's pools passed in went with it") as e:
        hook._run(None, None)
    assert "the device step failed" in str(e.value.__cause__) and hook.state is None
    with pytest.raises(CanaryStateLost, match="this hook has no canary state: a step failed on "
                       "the device.* Install a new hook"):
        hook._run(None, None)
    hook.uninstall()
    # A managed hook's manager held the same state: it holds none after (nothing to read).
    manager = ksj.canary_manager(_canary(), "log")
    managed = ksj.ManagedModelRunnerHook(_canary(), _wrapped_runner("0.0.2"), manager)
    managed._step = fails_on_device
    with pytest.raises(CanaryStateLost):
        managed._run(None, None)
    assert manager.state is None and manager.coverage() is None
    managed.uninstall()
