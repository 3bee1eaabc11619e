"""Coverage (ours, docs/spec.md §17): the setting and its bad inputs, the KV a step takes (every
layer, SGLang's form kept), SGLang's bytes unchanged beside it, no false alarm from slots never
stamped, the report, and the manager's stats. The flip campaigns are in
tests/test_coverage_campaign.py."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvcanary_jax import cli, consts
from kvcanary_jax import runtime as rt
from kvcanary_jax import sim as sm
from kvcanary_jax.runtime import agreement
from kvcanary_jax.runtime import config as rc
from kvcanary_jax.runtime.reporting import format_violation
from kvcanary_jax.testing.forward import layered_kv, write_every_layer

from _manager_support import Harness

warnings.filterwarnings("ignore", message=".*donated buffers.*")

LOGGER = "kvcanary_jax.runtime.manager"
ENV = "SGLANG_KV_CANARY_COVERAGE_WINDOW"


# ------------------------------------------------------------------------------- the setting


def test_the_window_from_the_flag_and_the_variable():
    assert rt.ManagerConfig().coverage_window == 0  # off: SGLang's behaviour
    assert rc.OUR_ENV_VARS == {"coverage_window": ENV}
    c = rt.ManagerConfig.from_env(kv_canary="log", kv_canary_sweep_interval=4,
                                  environ={ENV: " 8 "})
    assert c.coverage_window == 8
    parser = argparse.ArgumentParser()
    rc.add_arguments(parser)
    base = ["--kv-canary", "log", "--kv-canary-sweep-interval", "4"]
    flag = parser.parse_args(base + ["--kv-canary-coverage-window", "2"])
    assert rt.ManagerConfig.from_args(flag, environ={ENV: "8"}).coverage_window == 2
    assert rt.ManagerConfig.from_args(parser.parse_args(base), environ={ENV: "8"}
                                      ).coverage_window == 8
    assert rt.ManagerConfig.from_args(parser.parse_args(base), environ={}).coverage_window == 0
    assert "coverage_window" in agreement.SETTINGS


@pytest.mark.parametrize("fields, match", [
    (dict(mode="none", coverage_window=4),
     r"^--kv-canary-coverage-window 4 requires --kv-canary in \{log, raise\}$"),
    (dict(mode="log", coverage_window=4),
     r"^--kv-canary-coverage-window 4 verifies .* it requires --kv-canary-sweep-interval > 0 "
     r"\(without a sweep, cached slots no request reads would never be verified\)$"),
    (dict(mode="log", sweep_interval=2, draft_worker=True, coverage_window=4),
     r"a draft worker's manager runs none"),
    (dict(mode="log", sweep_interval=2, coverage_window=-1),
     r"coverage_window \(--kv-canary-coverage-window / SGLANG_KV_CANARY_COVERAGE_WINDOW\) "
     r"must be >= 0, got -1"),
    (dict(mode="log", sweep_interval=2, coverage_window=True), r"must be an integer, got True"),
    (dict(mode="log", sweep_interval=2, coverage_window=2.0), r"must be an integer, got 2.0"),
])
def test_a_window_that_cannot_hold_is_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        rt.ManagerConfig(**fields)


def test_a_window_from_the_environment_is_refused_naming_the_variable():
    """A window set by the variable alone: the refusal names it beside the flag's words (the
    flag or an argument over it: the flag's words alone)."""
    env = {"SGLANG_KV_CANARY_COVERAGE_WINDOW": "9999999999"}
    with pytest.raises(ValueError, match=r"^--kv-canary-coverage-window 9999999999: a window is "
                       r"at most \d+ steps \(the window from SGLANG_KV_CANARY_COVERAGE_WINDOW\)$"):
        rt.ManagerConfig.from_env(kv_canary="log", kv_canary_sweep_interval=4, environ=env)
    with pytest.raises(ValueError, match=r"requires --kv-canary in \{log, raise\} \(the window "
                       r"from SGLANG_KV_CANARY_COVERAGE_WINDOW\)$"):
        rt.ManagerConfig.from_env(environ={"SGLANG_KV_CANARY_COVERAGE_WINDOW": "4"})
    with pytest.raises(ValueError, match=r"a window is at most \d+ steps$"):
        rt.ManagerConfig.from_env(kv_canary="log", kv_canary_sweep_interval=4, environ=env,
                                  coverage_window=1 << 40)


@pytest.mark.parametrize("text, match", [
    ("x", r'^kv-canary: SGLANG_KV_CANARY_COVERAGE_WINDOW="x" is not a valid integer value$'),
    ("-2", r'^kv-canary: SGLANG_KV_CANARY_COVERAGE_WINDOW="-2" must be >= 0$'),
])
def test_a_bad_variable_is_refused_naming_it(text, match):
    with pytest.raises(ValueError, match=match):
        rt.ManagerConfig.from_env(kv_canary="log", kv_canary_sweep_interval=4,
                                  environ={ENV: text})


SIZES = dict(max_reqs=4, context_len=16, num_slots=16, max_bs=2, max_tokens=8, ring_capacity=64,
             implementation="xla")


@pytest.mark.parametrize("fields, error, match", [
    (dict(coverage_window=2), ValueError, r"coverage_window 2 digests every layer of the KV: set "
                                          r"num_layers"),
    (dict(coverage_window=-1, num_layers=2), ValueError, r"coverage_window must be >= 0"),
    (dict(coverage_window=1.5, num_layers=2), TypeError, r"coverage_window must be an int"),
    (dict(num_layers=0), ValueError, r"num_layers must be >= 1"),
    (dict(swa_num_layers=2), ValueError, r"there is no SWA group"),
    (dict(sweep_interval=-1), ValueError, r"sweep_interval must be >= 0"),
    (dict(sweep_interval=2.0), TypeError, r"sweep_interval must be an int"),
])
def test_canary_config_refuses_coverage_it_cannot_give(fields, error, match):
    with pytest.raises(error, match=match):
        rt.CanaryConfig(**SIZES, **fields)


def test_the_manager_refuses_sizes_that_contradict_the_window():
    config = rt.ManagerConfig(mode="log", sweep_interval=2, coverage_window=4)
    with pytest.raises(ValueError, match=r"--kv-canary-coverage-window 4 digests every layer .* "
                                         r"must state CanaryConfig.num_layers"):
        rt.CanaryManager(config, rt.CanaryConfig(**SIZES))
    with pytest.raises(ValueError, match=r"the sizes ask for CanaryConfig.coverage_window=2, but "
                                         r"the manager's config has coverage_window"):
        rt.CanaryManager(config, rt.CanaryConfig(**SIZES, coverage_window=2, num_layers=1))
    built = rt.CanaryManager(config, rt.CanaryConfig(**SIZES, num_layers=3))
    assert built.cfg.coverage_window == 4 and built.state.coverage is not None
    # The sweep's interval is the config's too: at most the window, the steps leave to the
    # sweep the read slots it checked (docs/spec.md §17.2).
    assert built.cfg.sweep_interval == 2 and built.cfg.sweep_covers_reads
    with pytest.raises(ValueError, match=r"the sizes ask for CanaryConfig.sweep_interval=3, but "
                                         r"the manager's config has sweep_interval"):
        rt.CanaryManager(config, rt.CanaryConfig(**SIZES, num_layers=3, sweep_interval=3))
    longer = rt.ManagerConfig(mode="log", sweep_interval=8, coverage_window=4)
    assert not rt.CanaryManager(longer, rt.CanaryConfig(**SIZES, num_layers=3)).cfg \
        .sweep_covers_reads


def test_processes_with_different_windows_are_refused(monkeypatch):
    """The settings every process must share include the window (a fake coordination store
    holding a peer that runs another window)."""
    peer = {name: getattr(rt.ManagerConfig(mode="log", sweep_interval=2), name)
            for name in agreement.SETTINGS}

    class Store:
        def __init__(self):
            self.kv = {}

        def key_value_set(self, key, value):
            self.kv[key] = value

        def key_value_dir_get(self, prefix):
            return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]

        def blocking_key_value_get(self, key, timeout_ms):
            assert key.endswith("/settings/1"), key
            return json.dumps(peer)

        def key_value_delete(self, key):
            self.kv.pop(key, None)

    monkeypatch.setattr(agreement.jax, "process_count", lambda: 2)
    monkeypatch.setattr(agreement, "_coordination_client", Store)
    config = rt.ManagerConfig(mode="log", sweep_interval=2, coverage_window=4,
                              agree_across_processes=True)
    with pytest.raises(ValueError, match=r"rank 0: .* coverage_window=4; rank 1: .* "
                                         r"coverage_window=0$"):
        agreement.Agreement(config).check_settings(config)


# ------------------------------------------------------------------------- the KV a step takes

LAYERS = 2
CFG = rt.CanaryConfig(**SIZES, coverage_window=2, num_layers=LAYERS)


def _batch(cfg, ids, prefix, row=1):
    """One request in ``row``, its tokens in slots 1, 2, ...: ``prefix`` cached, the rest new."""
    n = len(ids)
    return rt.make_batch(cfg, req_pool_indices=[row], prefix_lens=[prefix],
                         extend_seq_lens=[n - prefix], all_ids=[ids], input_ids=ids[prefix:],
                         positions=list(range(prefix, n)),
                         out_cache_loc=list(range(prefix + 1, n + 1)))


def _table(cfg, n, row=1, first=1):
    t = np.zeros((cfg.max_reqs, cfg.context_len), np.int32)
    t[row, :n] = range(first, first + n)
    return jnp.asarray(t)


def _layered(slots=16, width=8, layers=LAYERS, halves=("K", "V")):
    return layered_kv(slots, width, layers, halves)


_write_forward = write_every_layer  # every layer's K and V of each new token


@pytest.mark.parametrize("kv, match", [
    ({"FULL": {"K": [jnp.zeros((16, 8), jnp.bfloat16)]}},
     r"coverage_window 2 digests every layer's K and V, but kv\['FULL'\] does not list its "
     r"layers"),
    (_layered(layers=1), r"kv\['FULL'\]\['layers'\]\['K'\] holds 1 layer\(s\), the config's "
                         r"num_layers is 2: every layer of the model's KV"),
    (_layered(halves=("K",)), r"kv\['FULL'\]\['layers'\] must map 'K' and 'V' \(or 'KV', "
                              r"fused\)"),
    (_layered(slots=12), r"kv\['FULL'\]\['layers'\]\['K'\]\[0\] holds 12 slots, the FULL group "
                         r"has 16 \(num_slots\): .* \(sources of different slot counts\)"),
    ({"FULL": {"layers": {"KV": tuple(jnp.zeros((16, 16), jnp.bfloat16) for _ in range(2))}}},
     r"gives fused layers \('KV'\) and no 'K' sources for SGLang's fingerprint"),
])
def test_a_kv_the_window_cannot_cover_is_refused_before_anything_runs(kv, match):
    with jax.enable_x64(True):
        state = rt.init_state(CFG)
        with pytest.raises(ValueError, match=match):
            rt.canary_step_tail(CFG, state, _batch(CFG, [5], 0), kv=kv)
        assert not state.violation_ring.is_deleted()  # refused while tracing: nothing donated


def _run(cfg, kv, steps, *, forward=_write_forward, corrupt=None, batch_fn=None):
    """``steps`` steps of one request (prefill of 3, then decode); ``corrupt(kv, i)`` before step
    ``i``, and step ``i`` given ``batch_fn(batch, i)``. Returns the state and the KV."""
    step = rt.make_canary_step(cfg, forward)
    ids = [11, 12, 13]
    with jax.enable_x64(True):
        state = rt.init_state(cfg)
        for i in range(steps):
            prefix = 0 if i == 0 else len(ids) - 1
            if corrupt is not None:
                kv = corrupt(kv, i)
            batch = _batch(cfg, ids, prefix)
            if batch_fn is not None:
                batch = batch_fn(batch, i)
            state, kv = step(state, kv, batch, _table(cfg, len(ids)))
            ids = ids + [20 + i]
    return state, kv


def test_sglangs_form_and_layer_zero_give_sglangs_bytes():
    """With the window off, ``{"layers": ...}`` fingerprints layer 0 of each half, as SGLang's
    adapters do: the same canary bytes, ring and counters as SGLang's form given layer 0 alone,
    while the other layers differ."""
    cfg = rt.CanaryConfig(**SIZES, enable_v_half=True)

    def sglang_form(kv, batch, rtt, lut):
        out = _write_forward({"FULL": {"layers": {h: kv["FULL"][h] for h in ("K", "V")}}},
                             batch, rtt, lut)
        return {"FULL": out["FULL"]["layers"]}

    def flip(kv, i):  # a byte of layer 0's V before step 3: found by both forms
        if i != 3:
            return kv
        layers = kv["FULL"]["layers"] if "layers" in kv["FULL"] else kv["FULL"]
        v0 = layers["V"][0].at[2, 1].add(1)
        new = {**layers, "V": (v0,) + tuple(layers["V"][1:])}
        return {"FULL": {"layers": new} if "layers" in kv["FULL"] else new}

    one = {"FULL": {h: (jnp.zeros((16, 8), jnp.bfloat16),) for h in ("K", "V")}}
    a, _ = _run(cfg, one, 5, forward=sglang_form, corrupt=flip)
    b, _ = _run(cfg, _layered(), 5, corrupt=flip)
    assert rt.violation_count(a) > 0
    for key in a.bufs:
        np.testing.assert_array_equal(np.asarray(a.bufs[key]), np.asarray(b.bufs[key]), key)
    np.testing.assert_array_equal(np.asarray(a.violation_ring), np.asarray(b.violation_ring))
    np.testing.assert_array_equal(np.asarray(a.slot_run_counters), np.asarray(b.slot_run_counters))


def _sglang_rows(state):
    return sorted(tuple(int(x) for x in row) for row in np.asarray(state.violation_ring)
                  [:rt.violation_count(state)] if not int(row[7]) & consts.KV_DIGEST_MISMATCH)


def test_sglangs_canary_is_unchanged_beside_the_window():
    """The same server with the window off and on, the same faults: the canary buffers, SGLang's
    per-tag counters, the expected tokens and SGLang's ring rows are equal; the window only adds
    its digest rows."""
    faults = {6: "req_to_token", 9: "real_kv_used", 12: "layer_flip_used",
              15: "next_token_swap", 18: "real_kv_post_forward"}
    servers = [sm.Server(sm.SimConfig(steps=0, seed=4, sweep_interval=4, swa_window_size=6,
                                      implementation="xla", coverage_window=w)) for w in (0, 3)]
    for i in range(22):
        for srv in servers:
            if i in faults:
                sm.inject(srv, faults[i], np.random.default_rng(i))
            srv.step()
    off, on = (s.state for s in servers)
    assert off.coverage is None and on.coverage is not None
    for key in off.bufs:
        np.testing.assert_array_equal(np.asarray(off.bufs[key]), np.asarray(on.bufs[key]), key)
    for name in ("slot_run_counters", "kernel_run_counters", "expected_tokens"):
        np.testing.assert_array_equal(np.asarray(getattr(off, name)),
                                      np.asarray(getattr(on, name)), name)
    assert _sglang_rows(off) == _sglang_rows(on) and _sglang_rows(off)
    assert rt.violation_count(on) > rt.violation_count(off)  # the layer flip: the window's rows
    assert {v.reasons for v in rt.read_violations(on)} - {v.reasons for v in rt.read_violations(
        off)} == {("KV_DIGEST_MISMATCH",)}


def test_a_flip_in_any_layer_or_half_is_found_within_the_window():
    """Layer 1's V of slot 2 flipped after it was written: SGLang's check (layer 0) does not see
    it; the window (2) checks slot 2 at the first even step that reads it."""
    def corrupt(kv, i):
        if i != 2:
            return kv
        layers = kv["FULL"]["layers"]
        v1 = jax.lax.bitcast_convert_type(layers["V"][1], jnp.uint16)
        v1 = v1.at[2, 3].set(v1[2, 3] ^ jnp.uint16(1 << 9))
        return {"FULL": {"layers": {**layers, "V": (layers["V"][0], jax.lax.bitcast_convert_type(
            v1, jnp.bfloat16))}}}

    state, _ = _run(CFG, _layered(), 4, corrupt=corrupt)
    rows = rt.read_violations(state)
    # Steps 1..4 (T): step 3 reads slot 2 (odd phase, not its), step 4 checks it.
    assert [(v.tag, v.slot, v.position, v.reasons) for v in rows] == [
        ("TAIL_K_FULL", 2, 1, ("KV_DIGEST_MISMATCH",))]
    assert rows[0].stored_chain_hash != rows[0].expected_aux  # stored vs recomputed digest
    assert int(state.coverage.groups["FULL"].checked_at[2]) == 4
    message = format_violation(np.asarray(state.violation_ring)[0].tolist(), total=1,
                               ring_overflow=False, step_when_pumped=4)
    assert message.startswith("kv_canary violation: launch_tag=TAIL_K_FULL fail_reason=kv_digest "
                              "slot_idx=2 position=1 ")
    assert "stored:   kv_digest=0x" in message and "every layer's K and V" in message


@pytest.mark.parametrize("implementation", ["xla", "pallas_interpret"])
def test_a_server_s_int32_token_arrays_give_the_int64_bytes(implementation):
    """``input_ids``, ``positions`` and ``out_cache_loc`` handed to the step as int32 (a server's
    own arrays, read as they are: no convert kernel) give the bytes of int64 ones: canary
    buffers, ring, counters, digests and step counters, with a wrong position (the write's
    chain check) and a flipped layer (the digest) along the way."""
    cfg = dataclasses.replace(CFG, implementation=implementation)

    def corrupt(kv, i):  # layer 1's K of slot 1 after step 1 wrote it
        if i != 2:
            return kv
        layers = kv["FULL"]["layers"]
        return {"FULL": {"layers": {**layers, "K": (layers["K"][0],
                                                    layers["K"][1].at[1, 0].add(1))}}}

    def batch_fn(width):
        def fn(batch, i):
            if i == 3:  # a position one past the chain's
                batch = dataclasses.replace(batch, positions=batch.positions + 1)
            return dataclasses.replace(batch, **{
                f: getattr(batch, f).astype(width)
                for f in ("input_ids", "positions", "out_cache_loc")})
        return fn

    wide, _ = _run(cfg, _layered(), 6, corrupt=corrupt, batch_fn=batch_fn(jnp.int64))
    narrow, _ = _run(cfg, _layered(), 6, corrupt=corrupt, batch_fn=batch_fn(jnp.int32))
    reasons = {r for v in rt.read_violations(wide) for r in v.reasons}
    assert {"KV_DIGEST_MISMATCH", "WRITE_POSITION_MISMATCH"} <= reasons, reasons
    for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(wide),
                                 jax.tree_util.tree_leaves_with_path(narrow)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), jax.tree_util.keystr(path))


def test_fused_layers_are_digested_whole():
    """Fused layers (``"KV"``, one buffer per layer) with the K half's fingerprint sources
    listed beside them: a flip in the V columns of layer 1 is found."""
    cfg = rt.CanaryConfig(**SIZES, coverage_window=1, num_layers=LAYERS)

    def fused(kv, batch, rtt, lut):
        split = {"FULL": {"layers": {"K": tuple(a[:, :8] for a in kv["FULL"]["layers"]["KV"]),
                                     "V": tuple(a[:, 8:] for a in kv["FULL"]["layers"]["KV"])}}}
        out = _write_forward(split, batch, rtt, lut)["FULL"]["layers"]
        layers = tuple(jnp.concatenate([k, v], axis=1) for k, v in zip(out["K"], out["V"]))
        return {"FULL": {"layers": {"KV": layers}, "K": [layers[0][:, :8]]}}

    def corrupt(kv, i):
        if i != 2:
            return kv
        layers = kv["FULL"]["layers"]["KV"]
        return {"FULL": {**kv["FULL"], "layers": {"KV": (layers[0], layers[1].at[1, 12].add(3))}}}

    kv = {"FULL": {"layers": {"KV": tuple(jnp.zeros((16, 16), jnp.bfloat16) for _ in range(2))},
                   "K": [jnp.zeros((16, 8), jnp.bfloat16)]}}
    state, _ = _run(cfg, kv, 3, forward=fused, corrupt=corrupt)
    assert [(v.slot, v.reasons) for v in rt.read_violations(state)] == [
        (1, ("KV_DIGEST_MISMATCH",))]


# --------------------------------------------------------------- each leaf updated in place


def _aliases(lowered) -> dict[int, int]:
    """The lowered module's donated-argument pairs: argument index -> output index."""
    text = lowered.as_text()
    head = text[text.index("func.func public @main"):]
    head = head[:head.index(") -> (")]
    out = {}
    for m in re.finditer(r"%arg(\d+): tensor<[^>]*>\s*\{([^}]*)\}", head):
        alias = re.search(r"tf.aliasing_output = (\d+)", m.group(2))
        if alias:
            out[int(m.group(1))] = int(alias.group(1))
    return out


def test_every_state_leaf_is_donated_to_its_own_output():
    """A step overwrites some coverage leaves without reading them (the digest's byte count;
    a sweep's step stamp). JAX drops unread inputs before pairing donated inputs with outputs of
    the same shape, so every later leaf of that shape would pair with its neighbour's output and
    XLA would copy each into place (6 copies a step on an H200, ~1 us each). Each state leaf
    must pair with its own output, in the step and in the sweep."""
    step = rt.make_canary_step(CFG, _write_forward)
    with jax.enable_x64(True):
        state = rt.init_state(CFG)
        leaves = len(jax.tree.leaves(state))
        kv = _layered()
        args = (state, kv, _batch(CFG, [11, 12, 13], 2), _table(CFG, 3),
                jnp.zeros((1,), jnp.int64))
        pairs = _aliases(step.jitted.lower(*args))
        donated = leaves + len(jax.tree.leaves(kv))
        assert pairs == {i: i for i in range(donated)}, pairs
        table = jnp.asarray(np.zeros((2, CFG.context_len), np.int32))
        rows, lengths = jnp.zeros((1,), jnp.int64), jnp.zeros((1,), jnp.int64)
        lowered = rt.step._sweep_jit.lower(state, table, rows, lengths,
                                           jnp.zeros((1,), jnp.int64), kv, cfg=CFG)
        assert _aliases(lowered) == {i: i for i in range(leaves)}


# ------------------------------------------------------------------- slots never stamped


def test_slots_never_stamped_are_not_checked_and_show_as_unverified():
    """A state built over a pool that holds KV already (a restarted canary; warm-up batches that
    read slots no guarded forward wrote): the slots it reads have no digest to check against.
    No digest row for them (SGLang's own check reports its stored zeros, as SGLang does), and the
    report counts them live and unverified; slots written under the state are checked."""
    cfg = dataclasses.replace(CFG, enable_verify_token_assert=False,
                              enable_write_input_assert=False, real_kv_hash_mode="none")
    _, kv = _run(cfg, _layered(), 4)  # slots 1..6 hold KV written under another state
    step = rt.make_canary_step(cfg, _write_forward)
    ids = [11, 12, 13, 20, 21, 22]
    with jax.enable_x64(True):
        state = rt.init_state(cfg, chain_position_assert=False)  # warm-up: SGLang's flag off
        for i in range(4):
            state, kv = step(state, kv, _batch(cfg, ids, len(ids) - 1), _table(cfg, len(ids)))
            ids = ids + [30 + i]
    digest_rows = [v for v in rt.read_violations(state) if "KV_DIGEST_MISMATCH" in v.reasons]
    assert digest_rows == []
    cov = rt.coverage_stats(cfg, state)
    group = cov.groups["FULL"]
    # Slots 1..5 were read in each of the last 2 steps and never checked; 6, 7 and 8 were
    # written under this state and checked at their phase.
    assert group.live_slots >= 5 and group.verified_slots == group.live_slots - 5, group
    assert cov.share < 1
    stamped = np.asarray(state.coverage.groups["FULL"].written_at)
    assert list(np.nonzero(stamped >= 0)[0]) == [6, 7, 8, 9]


# --------------------------------------------------------------------------- the manager


# The manager runs the sweep (every 3 steps, through the attached walk), not the server.
WINDOWED = sm.SimConfig(max_reqs=6, context_len=32, num_slots=96, max_bs=3, max_tokens=16,
                        chunk_size=8, swa_window_size=0, sweep_interval=0, max_cache_entries=3,
                        kv_width=8, implementation="xla", coverage_window=2)


def _manager(*, on_violation=None, **fields):
    config = rt.ManagerConfig(mode="log", real_data="all", sweep_interval=3, coverage_window=2,
                              enable_verify_token_assert=True, enable_write_input_assert=True,
                              **fields)
    return Harness(config, WINDOWED, on_violation=on_violation)


def test_the_stats_line_and_coverage_give_the_window_and_its_share(caplog):
    h = _manager(stats_print_every_n_steps=3)
    h.mgr.mark_init_finished()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        h.step(7)
        h.mgr.flush()
    stats = [r.getMessage() for r in caplog.records if "protected_tokens" in r.getMessage()]
    assert [s.split()[1] for s in stats] == ["step=3", "step=6"], stats
    assert " coverage_window=2 coverage=100.00% live_kv_bytes=" in stats[-1], stats[-1]
    cov = h.mgr.coverage()
    assert (cov.window, cov.sweep_interval, cov.step, cov.share) == (2, 3, 7, 1.0)
    assert cov.live_bytes > 0 and cov.groups["FULL"].bytes_per_slot == 2 * 4 * 16
    assert "window 2 steps, cached slots every 3: 100.0% of live KV bytes" in cov.summary()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert Harness(rt.ManagerConfig(mode="log")).mgr.coverage() is None
    assert Harness(rt.ManagerConfig()).mgr.coverage() is None


def test_the_manager_reports_a_flip_in_another_layer_with_its_request(caplog):
    seen = []
    h = _manager(on_violation=seen.append)
    h.mgr.mark_init_finished()
    h.step(3)
    req, slot = h.live_prefix_slot()
    sm.flip_kv_bit(h.srv, "FULL", slot, 3, "V", 5, 6)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        h.step(3)
        h.mgr.flush()
    digest = [r for r in seen if "KV_DIGEST_MISMATCH" in r.violation.reasons]
    assert digest and digest[0].violation.slot == slot and digest[0].request is req
    assert {r.violation.reasons for r in seen} == {("KV_DIGEST_MISMATCH",)}
    assert caplog.records[0].getMessage().startswith("kv_canary violation: launch_tag=")
    assert "fail_reason=kv_digest" in caplog.records[0].getMessage()


# ----------------------------------------------------------------------------------- the demo


def test_the_demo_runs_the_window_and_prints_its_coverage(capsys):
    rc_ = cli.main(["demo", "--steps", "28", "--layers", "3", "--coverage-window", "2",
                    "--faults", "layer_flip_used,layer_flip_cached", "--injections", "1",
                    "--no-progress"])
    out = capsys.readouterr().out
    assert rc_ == 0, out
    assert "real-KV coverage (3 layers, K and V):" in out
    assert ("SGLang's real-KV check (--real-data all): layer 0's K, 16.7% of each slot's KV "
            "bytes, at every read") in out
    assert "ours (--coverage-window 2): every byte; clean run: window 2 steps, cached slots " \
           "every 4: 100.0% of live KV bytes verified" in out


def test_without_the_window_the_demo_misses_other_layers(capsys):
    rc_ = cli.main(["demo", "--steps", "12", "--coverage-window", "0", "--real-data", "none",
                    "--faults", "layer_flip_used", "--injections", "2", "--json",
                    "--no-progress"])
    out = json.loads(capsys.readouterr().out)
    assert rc_ == 1 and out["coverage"] is None and out["fingerprint_share"] == 0
    assert out["faults"][0]["injected"] == 2 and out["faults"][0]["detected"] == 0


@pytest.mark.parametrize("argv, message", [
    (["--layers", "0"], "argument --layers: must be >= 1, got 0"),
    (["--coverage-window", "-1"], "argument --coverage-window: must be >= 0, got -1"),
])
def test_the_demo_refuses_bad_coverage_flags(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_the_demo_refuses_a_window_without_a_sweep(capsys):
    assert cli.main(["demo", "--sweep-interval", "0", "--steps", "6", "--no-progress"]) == 2
    assert ("kvcanary-jax: the demo's default --coverage-window 4 verifies the slots steps read "
            "within 4 steps and "
            "cached slots at each sweep: it needs --sweep-interval > 0 (without a sweep, cached "
            "slots no request reads would never be verified), or --coverage-window 0"
            in capsys.readouterr().err)


def test_the_demo_takes_the_window_from_the_servers_variable(capsys, monkeypatch):
    """Unset, the flag's default; set, the variable the servers read (the flag over both)."""
    assert cli._WINDOW_ENV == rc.OUR_ENV_VARS["coverage_window"]
    monkeypatch.setenv(ENV, "3")
    argv = ["demo", "--steps", "8", "--layers", "2", "--injections", "0", "--no-progress"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert f"ours ({ENV}=3): every byte; clean run: window 3 steps, cached slots every 4: " in out
    assert "; no violation so far)" in out
    assert cli.main(argv + ["--coverage-window", "0"]) == 0
    assert "  ours: off (--coverage-window 0)" in capsys.readouterr().out
    monkeypatch.setenv(ENV, "three")
    assert cli.main(argv) == 2
    assert (f'kvcanary-jax: kv-canary: {ENV}="three" is not a valid integer value'
            in capsys.readouterr().err)
    # Refused naming the variable, not a server flag the demo does not have.
    monkeypatch.setenv(ENV, str(2**29 + 1))
    assert cli.main(argv) == 2
    assert (f"kvcanary-jax: {ENV}=536870913: a window is at most 536870912 steps"
            in capsys.readouterr().err)
    monkeypatch.setenv(ENV, "2")
    assert cli.main(argv + ["--sweep-interval", "0"]) == 2
    assert (f"kvcanary-jax: {ENV}=2 verifies the slots steps read within 2 steps and cached "
            "slots at each sweep: it needs --sweep-interval > 0" in capsys.readouterr().err)


# ------------------------------------------------------------------ the report and its state


def test_the_report_counts_the_violations_beside_the_share():
    """A check that fails is a check: the share stays 100% (every live byte was checked), and
    the report says how many violations the state holds."""
    state, _ = _run(CFG, _layered(), 4, corrupt=lambda kv, i: kv if i != 2 else _flipped(kv))
    cov = rt.coverage_stats(CFG, state)
    assert cov.share == 1.0 and cov.violations == 1
    assert cov.summary().endswith("; 1 violation(s) so far)"), cov.summary()
    assert "checked against their digests" in cov.summary()
    clean, _ = _run(CFG, _layered(), 4)
    assert rt.coverage_stats(CFG, clean).violations == 0


def _flipped(kv):
    layers = kv["FULL"]["layers"]
    v1 = jax.lax.bitcast_convert_type(layers["V"][1], jnp.uint16)
    v1 = v1.at[2, 3].set(v1[2, 3] ^ jnp.uint16(1 << 9))
    return {"FULL": {"layers": {**layers, "V": (layers["V"][0], jax.lax.bitcast_convert_type(
        v1, jnp.bfloat16))}}}


def test_the_report_refuses_a_state_of_another_config():
    state, _ = _run(CFG, _layered(), 2)
    off = dataclasses.replace(CFG, coverage_window=0)
    with pytest.raises(ValueError, match=r"the state does not fit its config: unexpected "
                                         r"coverage\.groups\[FULL\]\.digest"):
        rt.coverage_stats(off, state)
    with jax.enable_x64(True):
        plain = rt.init_state(off)
    with pytest.raises(ValueError, match=r"the state does not fit its config: missing "
                                         r"coverage\.groups\[FULL\]\.digest"):
        rt.coverage_stats(CFG, plain)
    assert rt.coverage_stats(off, plain) is None
    bigger = dataclasses.replace(CFG, num_slots=32)
    with pytest.raises(ValueError, match=r"the state does not fit its config: bufs\[HEAD_K_FULL\] "
                                         r"is uint8 \(16, 32\), the config needs uint8 \(32, 32\)"):
        rt.coverage_stats(bigger, state)
    with pytest.raises(TypeError, match=r"expected a CanaryState \(init_state\(cfg\)\), got "
                                        r"dict"):
        rt.coverage_stats(CFG, {"coverage": state.coverage})


def test_slot_coverage_names_its_counters():
    from kvcanary_jax.runtime.state import SlotCoverage

    state, _ = _run(CFG, _layered(), 2)
    sc = state.coverage.groups["FULL"]
    with pytest.raises(ValueError, match=r"^kv-canary runtime: no step counter 'writen_at'; "
                                         r"SlotCoverage's are written_at, read_from, read_at, "
                                         r"checked_at, swept_at$"):
        sc.column("writen_at")
    fields = {f.name: getattr(sc, f.name) for f in dataclasses.fields(sc) if f.name != "steps"}
    with pytest.raises(TypeError, match=r"^SlotCoverage takes its step counters as one int32 "
                                        r"array steps=\[slots, 5\], .* not written_at=, "
                                        r"read_at=: pass steps=jnp\.stack\(\[written_at, "
                                        r"read_from, read_at, checked_at, swept_at\], axis=-1\)$"):
        SlotCoverage(**fields, written_at=sc.written_at, read_at=sc.read_at)
    rebuilt = SlotCoverage(**fields, steps=jnp.stack([sc.column(f) for f in
                                                      rt.state.SLOT_STEPS], axis=-1))
    np.testing.assert_array_equal(rebuilt.steps, sc.steps)
    # Its signature and help still name its fields.
    assert "steps" in str(__import__("inspect").signature(SlotCoverage))


def _one_long_request(sweep_interval: int):
    """The demo's server with one request of a 20-token prompt decoding 25 tokens, window 4."""
    srv = sm.Server(sm.SimConfig(steps=0, seed=3, coverage_window=4, sweep_interval=sweep_interval,
                                 swa_window_size=0, implementation="xla", arrival_prob=0.0))
    req = srv.admit(list(range(1, 21)))
    req.max_new = 25
    return srv, req


@pytest.mark.parametrize("sweep_interval, found_at", [(4, 15), (5, 11)])
def test_a_sweep_that_does_not_come_shows_in_the_report(sweep_interval, found_at):
    """The sweeps stop after step 8 (a walk that fails, a caller's schedule that slips). With a
    sweep every 4 steps stated (the window's 4), steps 9..11 left the prompt's slots to it: a
    byte flipped after step 8 in slot s (s = 3 mod 4) is found at s's phase step 15, four steps
    late, and the report shows those slots unverified from step 13 on (the last check of a slot
    in a read run more than 4 steps old, and no sweep due: the report of step 12, read after
    the step, counts on the sweep due after it). With 5 stated nothing is left to the sweep:
    found at step 11, the report at 100% throughout."""
    srv, req = _one_long_request(sweep_interval)
    slot = shares = None
    for t in range(1, 20):
        if t == 9:
            srv.sweep = lambda: None
            slot = next(s for s in req.slots if s % 4 == 3)
            sm.flip_kv_bit(srv, "FULL", slot, 2, "V", 5, 1)
            shares = []
        srv.step()
        if slot is None:
            continue
        shares.append(srv.coverage().share)
        found = [v for v in rt.read_violations(srv.state)
                 if v.reason_bits & consts.KV_DIGEST_MISMATCH]
        if found:
            assert [(v.slot, v.phase) for v in found] == [(slot, "TAIL")] and t == found_at
            break
    else:
        pytest.fail("the flip was not found")
    if sweep_interval == 4:
        assert shares[:4] == [1.0] * 4 and all(s < 1 for s in shares[4:-1]), shares
    else:
        assert set(shares) == {1.0}, shares


def test_the_report_read_before_the_due_sweep_counts_on_it():
    """A sweep every 4 steps, the window's 4: the steps leave the prompt's slots to it, so N
    steps after one sweep those slots were last checked N steps ago, and the next sweep, due
    after the step, checks them. A report read between the step and that sweep (sglang-jax's
    observe() prints the stats line before the caller's sweep) has every live byte verified,
    as after it."""
    srv, _ = _one_long_request(4)
    before = []
    sweep = srv.sweep
    srv.sweep = lambda: before.append(srv.coverage().share) or sweep()
    after = []
    for _ in range(20):
        srv.step()
        after.append(srv.coverage().share)
    # (before the first sweep nothing is live yet: no read run of 4 steps, no walk)
    assert len(before) == 5 and before[0] is None and set(before[1:]) == {1.0}, before
    assert set(after[4:]) == {1.0} and rt.violation_count(srv.state) == 0, after


def test_the_report_by_hand_cached_slots_expire_and_a_reused_slot_is_not_the_sweeps():
    """The report's rule (docs/spec.md §17.4) on counters set by hand, window 4, the last sweep
    at step 8, slots of one group:

    * slot 1, cached: walked at 8, written at 5, checked at 8: live and verified until step 12,
      unverified from 13 (the sweep due by 12 did not come), and slot 3 as well once its run
      ends;
    * slot 2, walked at 8 but written at 9 (freed and handed out again): not live, the sweep
      never saw its content;
    * slot 3, read at steps 7..10 (a run of 4 at step 10), written at 5, left to the sweep at 8:
      live, verified;
    * slot 4, the same run, written at 9 after the sweep, checked at 8: live, unverified (the
      check saw the content before);
    * slot 5, a run of 4 checked by a TAIL at 9: live, verified whatever the sweep.

    With a sweep every 6 steps stated, the cached slots stay verified through step 14; with an
    interval in calls, not steps, they are not aged."""
    cfg = dataclasses.replace(CFG, coverage_window=4)
    rows = {1: (5, -1, -1, 8, 8), 2: (9, -1, -1, 8, 8), 3: (5, 7, 10, 8, 8),
            4: (9, 7, 10, 8, 8), 5: (2, 7, 10, 9, -1)}
    with jax.enable_x64(True):
        state = rt.init_state(cfg)
        cov = state.coverage
        sc = cov.groups["FULL"]
        steps = np.full(np.asarray(sc.steps).shape, -1, np.int32)
        for slot, row in rows.items():
            steps[slot] = row
        sc = dataclasses.replace(sc, steps=jnp.asarray(steps),
                                 digest_bytes=jnp.full_like(sc.digest_bytes, 100))

        def report(t, c=cfg):
            st = dataclasses.replace(state, coverage=dataclasses.replace(
                cov, groups={"FULL": sc}, step=jnp.full_like(cov.step, t),
                last_sweep=jnp.full_like(cov.last_sweep, 8)))
            return rt.coverage_stats(c, st, sweep_interval=c.sweep_interval or None)

        at10, at12, at13 = report(10).groups["FULL"], report(12), report(13)
        # A sweep every 6 steps stated (more than the window): the cached slots' bound is 6.
        every6 = dataclasses.replace(cfg, sweep_interval=6)
        at14, at15 = report(14, every6), report(15, every6)
        # An interval in calls, not steps (tpu-inference's guard): the sweep is not aged.
        calls = dataclasses.replace(cfg, sweep_interval=2, sweep_in_steps=False)
        at30 = report(30, calls)
    assert (at10.live_slots, at10.verified_slots) == (4, 3)  # slots 1, 3, 4, 5; 4 unverified
    # At 12 and 13 no run is live any more: slots 1 and 3 are, cached as the sweep walked them.
    assert (at12.live_bytes, at12.verified_bytes, at12.share) == (200, 200, 1.0)
    assert (at13.live_bytes, at13.verified_bytes, at13.share) == (200, 0, 0.0)
    assert (at14.verified_bytes, at15.verified_bytes) == (200, 0)
    assert (at30.live_bytes, at30.verified_bytes) == (200, 200)
    assert not calls.sweep_covers_reads  # and the steps keep every read slot's check
    assert "cached slots every 6" in at15.summary()


def test_the_summary_says_when_no_sweep_is_on_record():
    """A stated sweep interval that no sweep followed (a manager with no radix walk attached
    and no sweep() call): the slots only a sweep would walk are not in the report at all, and
    its summary says so rather than "cached slots every K"."""
    groups = {"FULL": rt.coverage.GroupCoverage(live_slots=19, verified_slots=19, read_slots=20,
                                                bytes_per_slot=32)}
    cov = functools.partial(rt.coverage.CoverageStats, window=2, live_bytes=608,
                            verified_bytes=608, read_bytes=640, groups=groups, sweep_interval=4,
                            violations=0)
    assert cov(step=22, last_sweep=-1).summary().startswith(
        "window 2 steps, cached slots every 4, but no sweep on record: cached slots unchecked "
        "and not counted: 100.0% of live KV bytes verified (608 of 608 B")
    assert cov(step=22, last_sweep=20).summary().startswith(
        "window 2 steps, cached slots every 4: 100.0%")
    assert cov(step=0, last_sweep=-1).summary().startswith(  # nothing has run yet
        "window 2 steps, cached slots every 4: ")


def test_cached_slots_show_unverified_when_the_sweeps_stop():
    """One request finishes and its slots stay cached; the server idles, a sweep every 4 steps
    stated (window 4), and the sweeps stop after step 8: the report stays at 100% through step
    12 (the sweep of 8 is at most 4 steps old) and shows every cached byte unverified from step
    13 on; the summary says so, and names no sweep for a state that states none."""
    srv, req = _one_long_request(4)
    req.max_new = 4
    shares = {}
    for t in range(1, 21):
        if t == 9:
            srv.sweep = lambda: None
        srv.step()
        shares[t] = srv.coverage().share
    assert not srv.live and srv.cache and srv.coverage().last_sweep == 8
    assert [shares[t] for t in range(9, 13)] == [1.0] * 4, shares
    assert {shares[t] for t in range(13, 21)} == {0.0}, shares
    assert "0.0% of live KV bytes verified" in srv.coverage().summary()
    with jax.enable_x64(True):
        bare = rt.coverage_stats(srv.cfg, srv.state, sweep_interval=0)
    assert "no sweep: cached slots unchecked" in bare.summary()


def test_the_demo_s_coverage_heading_counts_one_layer_as_one():
    import types

    sim = types.SimpleNamespace(enable_v_half=True, real_kv_hash_mode="none", num_layers=1)
    lines = cli._coverage_lines(sim, types.SimpleNamespace(coverage=None), "--coverage-window 0")
    assert lines[0] == "real-KV coverage (1 layer, K and V):"
