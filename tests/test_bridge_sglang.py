"""The bridge as a drop-in for SGLang 0.5.23's own canary runtime (``bridge.install_into_sglang``).

SGLang's CanaryManager, with its perturbers and sweep, serves the same toy workload twice: once
launching SGLang's own launchers, once after ``install_into_sglang()``; every step's violations,
counters, canary buffers and expected-token pool must be equal. The install rebinds exactly the
four names the runtime calls, refuses another version or signature without rebinding anything,
and its handle restores SGLang's launchers."""

from __future__ import annotations

import collections
import sys

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

import kvcanary_jax.bridge as bridge  # noqa: E402
from kvcanary_jax.bridge import sglang_install  # noqa: E402
from kvcanary_jax import oracle  # noqa: E402

from _sglang_runtime import ToyServer, compare_runs, sglang_launchers_on_cpu  # noqa: E402

STEPS = 36


@pytest.fixture(scope="module")
def rt():
    return oracle.load_runtime()


def _sglang_names():
    """Every module-level binding of every loaded ``sglang`` module (to see what changed)."""
    return {(name, attr): id(value)
            for name, module in list(sys.modules.items())
            if name.startswith("sglang") and module is not None
            for attr, value in list(vars(module).items())}


def _launchers(rt):
    return {t.dotted: getattr(sys.modules[t.module], t.name) for t in sglang_install.TARGETS}


def test_dropin_matches_sglang_runtime_step_by_step(rt, monkeypatch):
    monkeypatch.setenv("SGLANG_KV_CANARY_ENABLE_MHA_V", "1")  # V-half endpoints too
    server = ToyServer(seed=1)  # a seed whose perturbations the sweep catches too
    with sglang_launchers_on_cpu():
        want = server.run(STEPS)
    with bridge.install_into_sglang():
        got = server.run(STEPS)
        used = bridge.paths()
    compare_runs(want, got)
    for t in sglang_install.TARGETS:
        assert used[t.name]["path"] == "dlpack"  # CPU tensors
        assert used[t.name]["sglang"] == t.dotted
    # A comparison worth making: SGLang's perturbers fired and its canary caught them, in
    # per-forward HEAD and TAIL launches of both halves and in the sweep, for several reasons.
    tags = rt.kernels.verify.CanaryLaunchTag
    rows = [v for s in want for v in s["violations"]]
    kinds = collections.Counter(tags(v[0]).name for v in rows)
    reasons = {v[-1] for v in rows}
    assert len(rows) >= 20, kinds
    assert {"HEAD_K_FULL", "TAIL_K_FULL", "HEAD_V_FULL", "SWEEP_K_FULL"} <= set(kinds), kinds
    assert len(reasons) >= 3, reasons
    assert {s["mode"] for s in want} == {"extend", "decode"}


def test_install_rebinds_exactly_the_runtime_launch_names(rt):
    before = _sglang_names()
    sglang_launchers = _launchers(rt)
    handle = bridge.install_into_sglang()
    try:
        changed = {k for k, v in _sglang_names().items() if before.get(k) != v}
        assert changed == {(t.module, t.name) for t in sglang_install.TARGETS}
        for t in sglang_install.TARGETS:
            assert getattr(sys.modules[t.module], t.name) is getattr(bridge, t.name)
        assert handle.patched == tuple(t.dotted for t in sglang_install.TARGETS)
        assert {k: v["sglang"] for k, v in bridge.paths().items() if "sglang" in v} == {
            t.name: t.dotted for t in sglang_install.TARGETS}
    finally:
        handle.uninstall()
    assert _launchers(rt) == sglang_launchers
    assert not any("sglang" in v for v in bridge.paths().values())
    handle.uninstall()  # idempotent
    assert {k for k, v in _sglang_names().items() if before.get(k) != v} == set()


def test_context_manager_restores_on_error(rt):
    sglang_launchers = _launchers(rt)
    with pytest.raises(KeyError):
        with bridge.install_into_sglang() as handle:
            assert handle.active
            raise KeyError("a failing step")
    assert not handle.active
    assert _launchers(rt) == sglang_launchers


def test_refuses_another_sglang_version(rt, monkeypatch):
    sglang_launchers = _launchers(rt)
    monkeypatch.setattr(sglang_install, "_sglang_version", lambda: "0.5.24")
    with pytest.raises(bridge.BridgeError) as e:
        bridge.install_into_sglang()
    assert str(e.value) == (
        "kv-canary bridge: install_into_sglang() supports SGLang 0.5.23's canary runtime, whose "
        "launchers the bridge reproduces; installed: sglang 0.5.24")
    assert _launchers(rt) == sglang_launchers


def test_refuses_a_launcher_signature_that_differs(rt, monkeypatch):
    sglang_launchers = _launchers(rt)
    verify = rt.kernels.verify

    # SGLang's launcher as a later version might declare it: a new keyword.
    def launch_canary_verify_kernel(*, context, plan, check_verify_expected_token,
                                    block_size=256):
        raise AssertionError("never called")

    launch_canary_verify_kernel.__module__ = verify.__name__
    monkeypatch.setattr(rt.endpoint, "launch_canary_verify_kernel", launch_canary_verify_kernel)
    with pytest.raises(bridge.BridgeError) as e:
        bridge.install_into_sglang()
    assert str(e.value) == (
        "kv-canary bridge: SGLang 0.5.23's sglang.srt.kv_canary.endpoint.launch_canary_verify_"
        "kernel has signature (*, context, plan, check_verify_expected_token, block_size=256), "
        "the bridge's launch_canary_verify_kernel takes (*, context, plan, "
        "check_verify_expected_token); not installed")
    # Nothing rebound, the names checked before it included.
    monkeypatch.undo()
    assert _launchers(rt) == sglang_launchers


def test_refuses_a_name_that_no_longer_holds_sglangs_launcher(rt, monkeypatch):
    def wrapped(**kwargs):
        raise AssertionError("never called")

    monkeypatch.setattr(rt.kernel_launcher, "launch_canary_plan_kernels", wrapped)
    with pytest.raises(bridge.BridgeError, match=r"kernel_launcher\.launch_canary_plan_kernels "
                       r"is not SGLang 0\.5\.23's launcher from sglang\.kernels\.ops\.kv_canary"
                       r"\.plan\.api .*; not installed"):
        bridge.install_into_sglang()
    assert rt.endpoint.launch_canary_verify_kernel is rt.kernels.verify.launch_canary_verify_kernel


def test_refuses_a_second_install(rt):
    with bridge.install_into_sglang():
        with pytest.raises(bridge.BridgeError, match="already active"):
            bridge.install_into_sglang()
    assert rt.endpoint.launch_canary_write_kernel is rt.kernels.write.launch_canary_write_kernel


def test_uninstall_leaves_a_name_rebound_after_it(rt):
    handle = bridge.install_into_sglang()
    def later(**kwargs):  # noqa: E306
        raise AssertionError("never called")
    rt.endpoint.launch_canary_write_kernel = later
    try:
        with pytest.raises(bridge.BridgeError, match="except sglang.srt.kv_canary.endpoint."
                           "launch_canary_write_kernel, which other code rebound"):
            handle.uninstall()
        assert rt.endpoint.launch_canary_write_kernel is later
        assert rt.endpoint.launch_canary_verify_kernel is \
            rt.kernels.verify.launch_canary_verify_kernel
        assert not handle.active
    finally:
        rt.endpoint.launch_canary_write_kernel = rt.kernels.write.launch_canary_write_kernel


class _Rerun:
    """A stand-in for a CUDA graph on the CPU: warmed up twice, then "replayed" by running the
    same Python again on the same static batch tensors."""

    def __init__(self, fn):
        fn()
        fn()
        self.replay = fn


def test_dropin_matches_sglang_runtime_with_static_decode_batches(monkeypatch):
    """The CUDA-graph test's flow on the CPU: decode steps fed through static batch tensors
    (warm-up on padding rows before mark_init_finished, each step's inputs copied in, the
    forward inside with_ops_outside_graph), installed, against SGLang's references eagerly."""
    from _sglang_runtime import sglang_references

    monkeypatch.setenv("SGLANG_KV_CANARY_ENABLE_MHA_V", "1")
    server = ToyServer(seed=1, num_slots=256, max_reqs=6, context_len=48, perturb_prob=0.1,
                       warmup_steps=2, sweep_interval=5)
    with sglang_references():
        want = server.run_graphed(12, graph=False)
    with bridge.install_into_sglang():
        got = server.run_graphed(12, graph=True, capture=_Rerun)
    compare_runs(want, got)
    assert sum(len(s["violations"]) for s in want) > 0


@pytest.mark.gpu
def test_dropin_matches_sglang_runtime_in_a_cuda_graph(monkeypatch):
    """On a CUDA GPU: SGLang's runtime serves 4 requests (a prefill, then 24 decode steps) with
    its perturbers and sweep on, once eagerly launching SGLang's own torch references, once with
    the bridge installed and every decode step replayed from one CUDA graph captured as SGLang's
    decode graph runner captures it; every step's violations (as multisets: GPU atomics order
    them), counters, canary buffers and expected-token pool equal."""
    from _sglang_runtime import sglang_references

    monkeypatch.setenv("SGLANG_KV_CANARY_ENABLE_MHA_V", "1")
    server = ToyServer(device="cuda", seed=1, num_slots=256, max_reqs=6, context_len=48,
                       perturb_prob=0.1, warmup_steps=2, sweep_interval=5)
    with sglang_references():
        want = server.run_graphed(24, graph=False)
    with bridge.install_into_sglang():
        got = server.run_graphed(24, graph=True)
        used = bridge.paths()
    assert {used[t.name]["path"] for t in sglang_install.TARGETS} == {"triton_direct"}, used
    compare_runs(want, got, ordered=False)
    assert sum(len(s["violations"]) for s in want) > 0


def test_sglangs_phase_checker_runs_where_its_tensors_are_on_a_cuda_host():
    """SGLang's runtime over a CPU pool on a machine with CUDA (the whole suite on a GPU host):
    its phase checker's Triton kernel, imported compiled there, runs CPU tensors in Triton's
    interpreter, as on a machine without CUDA. The test makes torch report CUDA in a process of
    its own (the import is once per process); a phase out of order is still reported (the
interpreter prints the kernel's failure line)."""
    import subprocess
    import textwrap

    code = textwrap.dedent("""
        import torch
        torch.cuda.is_available = lambda: True  # as on a GPU host
        import sys
        from kvcanary_jax import oracle
        oracle.load_runtime()
        module = sys.modules["sglang.srt.utils.phase_checker"]
        kernel = module._phase_check_kernel
        print(type(kernel).__name__, type(kernel.compiled).__name__,
              type(kernel.interpreted).__name__)
        checker = module.SimplePhaseChecker(initial_phase=0, device=torch.device("cpu"))
        checker.update(expect_phase=0, next_phase=1, caller_name="pre")
        checker.update(expect_phase=1, next_phase=0, caller_name="post")
        checker.update(expect_phase=0, next_phase=1, caller_name="pre")
        print(int(checker._phase))
        checker.enable_assert()  # back to phase 0: a post now is out of order
        checker.update(expect_phase=1, next_phase=0, caller_name="post")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert lines[:2] == ["_PhaseKernelByDevice JITFunction InterpretedFunction", "1"], lines
    assert len(lines) == 3 and "[SimplePhaseChecker FAIL] caller_tag=2 expect=1 next=0" in lines[2]
