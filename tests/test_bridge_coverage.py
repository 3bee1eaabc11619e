"""Coverage in SGLang 0.5.23's own canary runtime (``install_into_sglang(coverage_window=N)``,
ours): every layer's K and V of SGLang's pool (its MHA pool; an SWA pool's two sub-pools) digested
at SGLang's TAIL write and checked at its TAIL verify and sweep, rows in SGLang's own ring.

The campaign (tests/_sglang_coverage.py) runs SGLang's CanaryManager over multi-layer pools whose
canary SGLang's own adapters attach, one run per mode, single-bit flips placed between steps in a
random byte of a random layer, K or V, of a live slot (used or cached). Each flip's first check is
predicted on the host from the batch, SGLang's plan rule and the sweep's walk, so a layer, a half,
a group or a phase of the window left unchecked fails here: the flip is missed, or found at another
step. A clean run reports nothing, and every launch checked exactly the entries the rule gives.
Off (the default), the install is SGLang's drop-in unchanged (tests/test_bridge_sglang.py); on,
SGLang's own canary keeps its rows, counters and buffers step by step."""

from __future__ import annotations

import dataclasses
import importlib
import random
import types

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

import kvcanary_jax.bridge as bridge  # noqa: E402
from kvcanary_jax import consts, oracle  # noqa: E402
from kvcanary_jax.bridge import sglang_install  # noqa: E402

import _tier  # noqa: E402

RUNTIME = oracle.load_runtime()  # SGLang's canary runtime importable before the harness

import _sglang_coverage as sc  # noqa: E402
from _sglang_runtime import ToyRadix, ToyServer  # noqa: E402

CPU = torch.device("cpu")
DEVICES = [pytest.param(CPU, id="cpu"),
           pytest.param(torch.device("cuda"), id="cuda", marks=pytest.mark.gpu)]
MODES = {
    # A window shorter than the sweep interval: TAIL checks bound the read slots. SGLang's ALL
    # fingerprint and V half on: its own rows for layer-0 flips beside the digest's.
    "mha-window3-sweep7-all-v": dict(window=3, v_half=True, server=dict(
        layers=5, hash_mode="ALL", sweep_interval=7)),
    # An SWA pool: FULL and SWA groups, each its own layers; SGLang's fingerprint off.
    "swa-window2-sweep5-none": dict(window=2, v_half=False, server=dict(
        layers=3, swa_window=6, swa_layers=2, hash_mode="NONE", sweep_interval=5)),
}
STEPS = _tier.n(70, 300)
MIN_FOUND = _tier.n(200, 900)


def _env(monkeypatch, mode):
    if MODES[mode]["v_half"]:
        monkeypatch.setenv("SGLANG_KV_CANARY_ENABLE_MHA_V", "1")
    else:
        monkeypatch.delenv("SGLANG_KV_CANARY_ENABLE_MHA_V", raising=False)


def _run(mode, *, steps, flips_per_step, seed=5, device=CPU):
    window = MODES[mode]["window"]
    with bridge.install_into_sglang(coverage_window=window) as handle:
        server = sc.LayeredServer(seed=3, device=device, **MODES[mode]["server"])
        res = sc.campaign(server, steps=steps, flips_per_step=flips_per_step, window=window,
                          seed=seed)
        stats = handle.coverage.stats()
    return server, res, stats


def _assert_counts(res, stats, window):
    """Every digest launch checked exactly the entries the rule gives, once per forward (TAIL)
    and per sweep."""
    assert set(stats) == set(res.checked)
    for group, st in stats.items():
        assert st["window"] == window and st["steps"] == res.forwards
        assert st["tail_kernel_runs"] == res.forwards
        assert st["sweep_kernel_runs"] == res.sweeps > 0
        assert st["tail_slot_runs"] == res.checked[group]["TAIL"] > 0
        assert st["sweep_slot_runs"] == res.checked[group]["SWEEP"] > 0


@pytest.mark.fuzz
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", list(MODES))
def test_every_flip_is_found_at_its_first_check(mode, device, monkeypatch):
    """On a GPU the bridge's launchers and the digest's take the direct Triton path."""
    _env(monkeypatch, mode)
    _tier.seeded(f"sglang coverage flips {mode}", 5, STEPS)
    server, res, stats = _run(mode, steps=STEPS, flips_per_step=6, device=device)
    assert res.problems() == []
    found = res.detected
    assert len(found) >= MIN_FOUND, (len(found), len(res.flips))
    window = MODES[mode]["window"]
    # The campaign reached every layer of every group, both halves, used and cached slots, TAIL
    # and sweep checks and every phase of the window: each a place a dropped check would show.
    for group, pool in server.pools.items():
        assert {(f.layer, f.half) for f in found if f.group == group} == \
            {(layer, h) for layer in range(pool.layer_num) for h in sc.HALVES}, group
    assert {f.kind for f in found} == {"used", "cached"}
    assert {f.detected[1] for f in found} == {"TAIL", "SWEEP"}
    assert {f.slot % window for f in found if f.detected[1] == "TAIL"} == set(range(window))
    if MODES[mode]["server"]["hash_mode"] == "ALL":
        assert res.sglang_rows > 0  # SGLang's own layer-0 check found some, as it does
    _assert_counts(res, stats, window)
    if device.type == "cuda":
        assert {bridge.paths()[n]["path"] for n in ("launch_kv_digest_write",
                                                    "launch_kv_digest_verify")} == \
            {"triton_direct"}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", list(MODES))
def test_a_clean_run_reports_nothing(mode, device, monkeypatch):
    _env(monkeypatch, mode)
    server, res, stats = _run(mode, steps=_tier.n(40, 150), flips_per_step=0, device=device)
    assert res.problems() == [] and res.sglang_rows == 0
    _assert_counts(res, stats, MODES[mode]["window"])


def test_digest_rows_are_reported_by_sglangs_reporter_as_kv_digest(monkeypatch, caplog):
    """SGLang's violation manager logs the digest rows (log mode) through its own reporter,
    labelled ``kv_digest``; its own rows keep SGLang's words."""
    _env(monkeypatch, "swa-window2-sweep5-none")
    reporter = importlib.import_module("sglang.srt.kv_canary.runner.violation_reporter")
    sglang_format = reporter._format_violation
    with caplog.at_level("WARNING", logger=reporter.__name__):
        _, res, _ = _run("swa-window2-sweep5-none", steps=20, flips_per_step=3)
    lines = [r.getMessage() for r in caplog.records if r.name == reporter.__name__]
    assert len(res.detected) >= 10
    assert sum("fail_reason=kv_digest" in m for m in lines) == len(res.detected)
    assert all("launch_tag=TAIL_K_" in m or "launch_tag=SWEEP_K_" in m for m in lines)
    assert reporter._format_violation is sglang_format  # restored
    sglang_row = [int(consts.CanaryLaunchTag.HEAD_K_FULL), 5, 3, 7, 8, -1, 2,
                  int(consts.FailReason.VERIFY_CHAIN_HASH_MISMATCH)]
    with bridge.install_into_sglang(coverage_window=1):
        ours = reporter._format_violation(row=sglang_row, total=1, ring_overflow=False,
                                          step_when_pumped=2)
    assert ours == sglang_format(row=sglang_row, total=1, ring_overflow=False,
                                 step_when_pumped=2)


def test_sglangs_own_canary_is_unchanged_with_the_window_on(monkeypatch):
    """SGLang's perturbers on: with the window, every step's SGLang rows, per-tag counters,
    canary buffers and expected-token pool equal the run without it (the digest's rows come
    beside them, its launches in its own counters)."""
    monkeypatch.setenv("SGLANG_KV_CANARY_ENABLE_MHA_V", "1")
    server = ToyServer(seed=1)
    server.config = dataclasses.replace(server.config, ring_capacity=1 << 14)
    with bridge.install_into_sglang():
        want = server.run(36)
    with bridge.install_into_sglang(coverage_window=2) as handle:
        # The toy's hand-built group, registered with its one-layer pool.
        handle.coverage.register(types.SimpleNamespace(k_buffer=[server.k_pool],
                                                       v_buffer=[server.v_pool]), server.group)
        got = server.run(36)
    digest_rows = 0
    for a, b in zip(want, got):
        ours = [v for v in b["violations"] if v[7] & consts.KV_DIGEST_MISMATCH]
        digest_rows += len(ours)
        assert [v for v in b["violations"] if v not in ours] == a["violations"], a["step"]
        assert a["kernel_run_counters"] == b["kernel_run_counters"]
        assert a["slot_run_counters"] == b["slot_run_counters"]
        for name in a["canary"]:
            assert torch.equal(a["canary"][name], b["canary"][name]), (a["step"], name)
        assert torch.equal(a["expected_tokens"], b["expected_tokens"])
    assert sum(len(a["violations"]) for a in want) >= 20
    assert digest_rows > 0  # SGLang's perturbers changed real KV bytes: the digest saw them


class _Rerun:
    """A stand-in for a CUDA graph on the CPU: warmed up twice, then "replayed" by running the
    same Python again on the same static batch tensors."""

    def __init__(self, fn):
        fn()
        fn()
        self.replay = fn


@pytest.mark.parametrize("device", DEVICES)
def test_the_window_runs_inside_a_captured_decode_step(device, monkeypatch):
    """Decode steps through static batch tensors, the forward with its TAIL (and the digest's
    launches, the step counter's increment) captured once and replayed, as SGLang's decode graph
    runner does (a CUDA graph on a GPU; a rerun of the same Python on the CPU), against the same
    steps run eagerly: every step's rows (the digest's included), counters and buffers equal.
    Window 1: the capture's warm-up forwards advance the step counter, which only a window of 1
    leaves without effect."""
    monkeypatch.setenv("SGLANG_KV_CANARY_ENABLE_MHA_V", "1")
    runs = {}
    for graph in (False, True):
        server = ToyServer(device=str(device), seed=1, num_slots=256, max_reqs=6,
                           context_len=48, perturb_prob=0.1, warmup_steps=2, sweep_interval=5)
        server.config = dataclasses.replace(server.config, ring_capacity=1 << 14)
        with bridge.install_into_sglang(coverage_window=1) as handle:
            handle.coverage.register(types.SimpleNamespace(
                k_buffer=[server.k_pool], v_buffer=[server.v_pool]), server.group)
            runs[graph] = server.run_graphed(
                12, graph=graph, capture=_Rerun if device.type == "cpu" else None)
            runs[graph, "stats"] = handle.coverage.stats()["FULL"]
    from _sglang_runtime import compare_runs

    compare_runs(runs[False], runs[True], ordered=device.type == "cpu")
    digest = [v for s in runs[True] for v in s["violations"] if v[7] & consts.KV_DIGEST_MISMATCH]
    assert digest  # the perturbers changed real KV bytes: the digest, replayed, saw them
    eager, graphed = runs[False, "stats"], runs[True, "stats"]
    # The two warm-up forwards run the TAIL kernels; a CUDA graph's capture records them
    # without running them (the H200, 2026-12-04: 15 runs against 13 eager), as the rerun
    # stand-in runs nothing at capture.
    assert graphed["tail_kernel_runs"] == eager["tail_kernel_runs"] + 2
    assert graphed["sweep_kernel_runs"] == eager["sweep_kernel_runs"]


# --------------------------------------------------------------------------------------------
# The install: what it rebinds, and every refusal


def _bindings():
    targets = sglang_install.TARGETS + sglang_install.COVERAGE_TARGETS
    return {t.dotted: getattr(importlib.import_module(t.module), t.name) for t in targets}


def test_install_with_a_window_rebinds_eight_names_and_restores_them():
    before = _bindings()
    with bridge.install_into_sglang(coverage_window=4) as handle:
        now = _bindings()
        assert {k for k in before if now[k] is not before[k]} == set(before)
        assert handle.patched == tuple(before)
        assert repr(handle) == ("SglangInstall(sglang 0.5.23, active, 4 launchers, "
                                "coverage_window=4)")
        # paths() names the launchers only.
        assert {k: v["sglang"] for k, v in bridge.paths().items() if "sglang" in v} == {
            t.name: t.dotted for t in sglang_install.TARGETS}
    assert _bindings() == before
    with bridge.install_into_sglang(coverage_window=0) as handle:  # 0: off, the drop-in
        assert handle.coverage is None and len(handle.patched) == 4


@pytest.mark.parametrize("window", [-1, True, 2.0, "3"])
def test_install_refuses_a_window_that_is_not_an_int(window):
    before = _bindings()
    with pytest.raises(bridge.BridgeError, match=r"^kv-canary bridge: coverage_window must be "
                                                 r"an int >= 0 \(0: off\), got "):
        bridge.install_into_sglang(coverage_window=window)
    assert _bindings() == before


def test_install_refuses_a_hook_target_that_is_not_sglangs(monkeypatch):
    manager = importlib.import_module("sglang.srt.kv_canary.runner.canary_manager")

    def SweepOrchestrator(**kw):  # noqa: N802
        raise AssertionError("never called")

    monkeypatch.setattr(manager, "SweepOrchestrator", SweepOrchestrator)
    before = _bindings()
    with pytest.raises(bridge.BridgeError, match=r"canary_manager\.SweepOrchestrator is not "
                                                 r"SGLang 0\.5\.23's object from sglang\.srt\."
                                                 r"kv_canary\.runner\.sweep .*; not installed"):
        bridge.install_into_sglang(coverage_window=2)
    assert _bindings() == before
    bridge.install_into_sglang().uninstall()  # without a window the hook is not needed


def test_a_manager_without_a_sweep_is_refused_when_built():
    with bridge.install_into_sglang(coverage_window=2):
        server = sc.LayeredServer(sweep_interval=0)
        with pytest.raises(bridge.BridgeError, match=r"coverage_window=2 needs SGLang's sweep "
                                                     r"\(--kv-canary-sweep-interval > 0, got 0\)"):
            server.manager()


def test_a_group_the_coverage_did_not_see_is_refused():
    """A group built by hand (or by an adapter other than SGLang's MHA and SWA ones, or attached
    before the install): refused when its manager is built; a manager built before the install
    is refused at its first TAIL launch."""
    with bridge.install_into_sglang(coverage_window=2):
        with pytest.raises(bridge.BridgeError, match=r"coverage_window=2: SGLang's FULL buffer "
                                                     r"group of this CanaryManager was attached "
                                                     r"to a pool the coverage did not see"):
            ToyServer().run(1)
    server = sc.LayeredServer()
    manager = server.manager()
    radix = ToyRadix(server.rt.radix_walker.UnifiedRadixCache, server.req_to_token_pool,
                     server.device)
    manager.attach_radix_cache(radix.obj)
    manager.mark_init_finished()
    with bridge.install_into_sglang(coverage_window=2):
        batch = server._schedule(random.Random(0), [], [1, 2], list(range(1, 40)), radix)
        with pytest.raises(bridge.BridgeError, match=r"coverage_window=2 is on, but SGLang's "
                                                     r"FULL buffer group of this launch was "
                                                     r"never registered"):
            server._forward(manager, batch)


def _pool(**change):
    pool = sc.ToyMhaPool(16, 2, 2, 8, torch.device("cpu"))
    for k, v in change.items():
        setattr(pool, k, v)
    return pool


@pytest.mark.parametrize("change, message", [
    (dict(k_scale_buffer=[torch.zeros(16, 2)]),
     r"does not cover quantized KV pools: ToyMhaPool has k_scale_buffer"),
    (dict(v_buffer=[torch.zeros(16, 2, 8, dtype=torch.bfloat16)]),
     r"ToyMhaPool has 2 K layers and 1 V layers"),
    (dict(k_buffer=torch.zeros(2, 16, 2, 8, dtype=torch.bfloat16)[0]),
     r"covers pools whose layers are k_buffer and v_buffer lists .* has k_buffer=Tensor"),
    # Rows that are pages (a paged HND layout), not the group's slots.
    (dict(v_buffer=[torch.zeros(16, 2, 8, dtype=torch.bfloat16),
                    torch.zeros(4, 2, 4, 8, dtype=torch.bfloat16)]),
     r"ToyMhaPool.v_buffer\[1\] must hold the FULL group's 16 slots as its rows, got "
     r"torch.Size\(\[4, 2, 4, 8\]\)"),
    (dict(k_buffer=[torch.zeros(16, 2, 8, dtype=torch.bfloat16),
                    torch.zeros(16, 2, 16, dtype=torch.bfloat16)[:, :, :8]]),
     r"ToyMhaPool.k_buffer\[1\] \(shape \(16, 2, 8\), strides \(32, 16, 1\)\) is not one run "
     r"of bytes per slot"),
])
def test_a_pool_the_coverage_cannot_read_whole_is_refused_at_attach(change, message):
    mha = importlib.import_module("sglang.srt.kv_canary.pool_patcher.adapters.mha")
    with bridge.install_into_sglang(coverage_window=3):
        with pytest.raises(bridge.BridgeError, match=r"^kv-canary bridge: coverage_window=3.* "
                                                     + message):
            mha.attach_mha(pool=_pool(**change), device=torch.device("cpu"), read_bytes=16,
                           kv_token_id_vs_position_offset=0)
