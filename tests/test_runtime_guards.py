"""The runtime refuses what would fail silently later: a configuration with a zero or negative
size (SGLang's runtime errors, in its words), and a state that does not fit its configuration
(refused by every step builder before anything runs, naming the buffer and both sizes)."""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import kvcanary_jax as kc
from kvcanary_jax import runtime as rt
from kvcanary_jax import sharded

warnings.filterwarnings("ignore", message=".*donated buffers.*")

@pytest.fixture(autouse=True)
def _x64():
    # int64 token ids, lengths and LUTs need 64-bit types where the tests build them.
    with jax.enable_x64(True):
        yield


BASE = dict(max_reqs=4, context_len=8, num_slots=32, max_bs=2, max_tokens=8, ring_capacity=16)


def _sglang_source(rel: str) -> str:
    root = os.path.dirname(importlib.util.find_spec("sglang").origin)
    with open(os.path.join(root, rel)) as f:
        return f.read()


# SGLang's runtime checks (sglang/srt/kv_canary/capacities.py and state.py, which import its
# server and cannot be loaded here): our field, SGLang's name for it, and where SGLang says it.
SGLANG_SIZES = [
    ("max_reqs", "req_to_token_pool_size", "capacities.py"),
    ("context_len", "max_seq_len_per_req", "capacities.py"),
    ("num_slots", "pool_slot_count", "capacities.py"),
    ("verify_capacity", "per_forward_verify_capacity", "capacities.py"),
    ("write_req_capacity", "per_forward_write_req_capacity", "capacities.py"),
    ("max_tokens", "per_forward_write_entry_capacity", "capacities.py"),
    ("ring_capacity", "ViolationLog ring_capacity", "state.py"),
]


@pytest.mark.torch  # reads SGLang's installed sources (the torch leg installs SGLang)
@pytest.mark.parametrize("field,sgl_name,where", SGLANG_SIZES)
@pytest.mark.parametrize("value", [0, -3])
def test_config_refuses_sizes_sglang_refuses(field, sgl_name, where, value):
    with pytest.raises(ValueError) as e:
        rt.CanaryConfig(**{**BASE, field: value})
    msg = f"kv-canary: {sgl_name} must be positive, got {value}"
    suffix = "" if sgl_name.endswith(field) else f" (CanaryConfig.{field})"
    assert str(e.value) == msg + suffix
    # SGLang's own wording, from its source: the message itself, or its generic form over a
    # table of names.
    src = _sglang_source(os.path.join("srt", "kv_canary", where))
    assert f'"kv-canary: {sgl_name} must be positive, ' in src or (
        f'"{sgl_name}"' in src and 'f"kv-canary: {name} must be positive, got {value}"' in src)


@pytest.mark.parametrize("field", ["max_bs", "sweep_rows"])
def test_config_refuses_empty_buckets(field):
    with pytest.raises(ValueError) as e:
        rt.CanaryConfig(**{**BASE, field: 0})
    assert str(e.value) == f"kv-canary runtime: {field} must be positive, got 0"


@pytest.mark.parametrize("extra", [{}, dict(swa_window_size=4, swa_num_slots=16),
                                   dict(enable_v_half=True), dict(verify_capacity=7)])
def test_a_state_from_init_state_fits(extra):
    cfg = rt.CanaryConfig(**BASE, **extra)
    rt.check_state(cfg, rt.init_state(cfg))


@pytest.mark.parametrize("extra,total,part", [
    (dict(ring_capacity=10**11), "6,400,000,002,860", "the violation ring (ring_capacity "
     "100,000,000,000 rows of 64 B): 6,400,000,000,000 B"),
    (dict(num_slots=10**11), "6,400,000,001,836", "the FULL canary buffers (2 of num_slots "
     "100,000,000,000 x 32 B): 6,400,000,000,000 B"),
    (dict(write_req_capacity=10**11), "1,600,000,003,820", "the plans (verify_capacity 16 "
     "entries, write_req_capacity 100,000,000,000 requests): 1,600,000,000,532 B"),
    (dict(swa_window_size=4, swa_num_slots=10**11), "6,400,000,004,528", "the SWA canary "
     "buffers (2 of swa_num_slots 100,000,000,000 x 32 B): 6,400,000,000,000 B"),
    (dict(coverage_window=4, num_layers=2, num_slots=10**11), "9,200,000,001,884", "the FULL "
     "canary buffers (2 of num_slots 100,000,000,000 x 32 B): 6,400,000,000,000 B; the FULL "
     "coverage counters (num_slots 100,000,000,000 slots, coverage_window > 0): "
     "2,800,000,000,040 B"),
])
def test_a_state_too_large_for_the_device_names_what_sizes_it(extra, total, part):
    # XLA's allocator refuses it at once (no allocation is attempted beyond what it asks).
    cfg = rt.CanaryConfig(**{**BASE, **extra})
    with pytest.raises(MemoryError) as e:
        rt.init_state(cfg)
    msg = str(e.value)
    assert msg.startswith("kv-canary: the canary's state does not fit the device's memory: it "
                          f"needs {total} B, most of it {part}; lower the fields named (XLA: "
                          "RESOURCE_EXHAUSTED: "), msg
    # Raised outside the failed allocation's handler: nothing of the state is kept alive by
    # the error (a server that catches it and retries smaller has its memory back).
    assert e.value.__cause__ is None and e.value.__context__ is None
    assert rt.state_bytes(cfg) == int(total.replace(",", ""))


def test_a_state_no_device_holds_is_refused_before_anything_is_allocated():
    """Sizes whose products pass int64 aborted the process in XLA's shape arithmetic, and one
    of 2**63 failed deep in JAX: each field is bounded, and a state past 2**48 bytes is refused
    from its shapes alone."""
    gc.collect()  # only what this test allocates counts
    before = sum(a.nbytes for a in jax.live_arrays())
    cfg = rt.CanaryConfig(**{**BASE, "max_reqs": 2**30, "context_len": 2**30})
    with pytest.raises(MemoryError) as e:
        rt.init_state(cfg)
    assert str(e.value).startswith("kv-canary: the canary's state does not fit the device's "
                                   "memory: it needs 4,611,686,")
    assert "the expected-token pool (max_reqs 1,073,741,824 x context_len 1,073,741,824, " \
           "int32): 4,611,686,018,427,387,904 B" in str(e.value)
    assert "(XLA:" not in str(e.value)  # nothing was allocated
    with pytest.raises(MemoryError):
        rt.init_state_stacked(cfg, 2)
    assert sum(a.nbytes for a in jax.live_arrays()) == before
    for field in ("num_slots", "ring_capacity", "context_len", "verify_capacity", "max_reqs"):
        for value in (2**40 + 1, 2**63, 2**70):
            with pytest.raises(ValueError) as e:
                rt.CanaryConfig(**{**BASE, field: value})
            assert str(e.value) == (f"kv-canary runtime: CanaryConfig.{field} must be at most "
                                    f"2**40 (1,099,511,627,776), got {value:,}: no device holds "
                                    "a canary that large")


def test_a_failed_allocation_leaves_nothing_allocated():
    # The expected-token pool fails after the canary buffers (64 MB) and the plans were built.
    gc.collect()  # only what this test allocates counts
    before = sum(a.nbytes for a in jax.live_arrays())
    cfg = rt.CanaryConfig(**{**BASE, "num_slots": 10**6, "context_len": 10**11})
    with pytest.raises(MemoryError) as e:
        rt.init_state(cfg)
    held = e.value  # a caller holding the error while it retries
    assert sum(a.nbytes for a in jax.live_arrays()) == before, held


def test_stacked_states_refuse_what_cannot_be_built(tmp_path):
    cfg = rt.CanaryConfig(**BASE)
    for shards in (0, -1, True, 2.0, "2"):
        with pytest.raises(ValueError, match="init_state_stacked shards must be a positive int"):
            rt.init_state_stacked(cfg, shards)
    with pytest.raises(ValueError, match="shards must be at most 2\\*\\*40"):
        rt.init_state_stacked(cfg, 2**55)
    # Each state fits; 2**20 of them (2**66 B) do not: refused before anything is allocated.
    big = rt.CanaryConfig(**{**BASE, "max_reqs": 2**30, "context_len": 2**14})
    with pytest.raises(MemoryError) as e:
        rt.init_state_stacked(big, 2**20)
    assert str(e.value).endswith(f", or shards (1,048,576 states, "
                                 f"{2**20 * rt.state_bytes(big):,} B in all, each device "
                                 "holding its share)")
    for sharding in (jax.devices()[0], "dp"):
        with pytest.raises(TypeError, match="sharding must be None or a jax.sharding."
                                            "NamedSharding"):
            rt.init_state_stacked(cfg, 2, sharding)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("dp",))
    with pytest.raises(ValueError, match=r"must split the leading axis of 2 shards"):
        rt.init_state_stacked(cfg, 2, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    # One state, unsplit: every device of the mesh holds it (an integration without shard axes).
    one = rt.init_state_stacked(cfg, 1, jax.sharding.NamedSharding(mesh,
                                                                    jax.sharding.PartitionSpec()))
    assert one.violation_ring.shape == (1, cfg.ring_capacity, 8)
    with pytest.raises(TypeError, match="state_bytes takes a CanaryConfig, got dict"):
        rt.state_bytes(BASE)


def test_step_counts_and_the_ring_are_bounded_where_they_are_set():
    """A sweep interval of 2**70 ran, then overflowed the report's int64 arithmetic; a ring of
    2**41 from SGLang's variable was refused later, naming a field the user never set."""
    for field in ("sweep_interval", "kv_token_id_vs_position_offset"):
        with pytest.raises(ValueError, match=f"CanaryConfig.{field} must be within 2\\*\\*40"):
            rt.CanaryConfig(**{**BASE, field: 2**70})
    with pytest.raises(ValueError) as e:
        rt.ManagerConfig.from_env(kv_canary="log",
                                  environ={"SGLANG_KV_CANARY_RING_CAPACITY": str(2**41)})
    assert str(e.value) == ("kv-canary: ring_capacity (SGLANG_KV_CANARY_RING_CAPACITY) must be "
                            "<= 2**40, got 2199023255552")
    with pytest.raises(ValueError) as e:
        rt.ManagerConfig(mode="log", sweep_interval=2**70)
    assert str(e.value) == ("kv-canary: sweep_interval (--kv-canary-sweep-interval) must be "
                            f"<= 2**40, got {2**70}")


def test_stacked_zero_states_equal_the_single_one_stacked():
    cfg = rt.CanaryConfig(**{**BASE, "coverage_window": 4, "num_layers": 2})
    one = rt.init_state(cfg, chain_position_assert=False)
    stacked = rt.init_state_stacked(cfg, 3, chain_position_assert=False)
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(stacked)):
        assert b.shape == (3,) + a.shape and b.dtype == a.dtype
        np.testing.assert_array_equal(np.asarray(b), np.broadcast_to(np.asarray(a), b.shape))


def test_stacked_states_are_built_on_their_own_devices(tmp_path):
    """Over a mesh, each device allocates its own shard (stacking states built on one device
    put every shard there first: a state that fits each GPU failed on the first)."""
    script = tmp_path / "stacked.py"
    script.write_text(
        "import jax, numpy as np\n"
        "from jax.sharding import Mesh, NamedSharding, PartitionSpec as P\n"
        "from kvcanary_jax import runtime as rt\n"
        "cfg = rt.CanaryConfig(max_reqs=4, context_len=8, num_slots=32, max_bs=2, max_tokens=8,"
        " ring_capacity=16)\n"
        "mesh = Mesh(np.array(jax.devices()[:2]), ('dp',))\n"
        "with jax.enable_x64(True):\n"
        "    st = rt.init_state_stacked(cfg, 2, NamedSharding(mesh, P('dp')))\n"
        "for x in jax.tree.leaves(st):\n"
        "    shards = x.addressable_shards\n"
        "    assert len(shards) == 2 and {s.device for s in shards} == set(jax.devices()[:2])\n"
        "    assert all(s.data.shape == (1,) + x.shape[1:] for s in shards), x.shape\n"
        "print('ok')\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "")
                        + " --xla_force_host_platform_device_count=2").strip()
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


# --- a state that does not fit its config --------------------------------------------------------

CFG = rt.CanaryConfig(**BASE)


def _inputs(cfg=CFG):
    batch = rt.make_batch(cfg, req_pool_indices=[1], prefix_lens=[0], extend_seq_lens=[2],
                          all_ids=[[5, 6]], input_ids=[5, 6], positions=[0, 1],
                          out_cache_loc=[3, 4])
    rtt = jnp.zeros((cfg.max_reqs, cfg.context_len), jnp.int32)
    kv = {"FULL": {"K": [jnp.zeros((cfg.num_slots, 16), jnp.bfloat16)]}}
    return batch, rtt, kv


def _forward(kv, batch, req_to_token, lut):
    return kv


MISFITS = {
    "fewer slots": (dict(num_slots=16),
                    "bufs[HEAD_K_FULL] is uint8 (16, 32), the config needs uint8 (32, 32) "
                    "(num_slots=32)"),
    "smaller ring": (dict(ring_capacity=4),
                     "violation_ring is int64 (4, 8), the config needs int64 (16, 8) "
                     "(ring_capacity=16)"),
    "smaller verify plan": (dict(verify_capacity=5),
                            "plans[FULL][0].verify_slot_indices is int64 (5,), the config needs "
                            "int64 (16,) (verify capacity 16)"),
    "fewer request rows": (dict(max_reqs=2),
                           "plans[FULL][1].write_offsets is int64 (3,), the config needs int64 "
                           "(5,) (write request capacity 4 + 1)"),
    "no SWA group": (None, "missing bufs[HEAD_K_SWA], bufs[TAIL_K_SWA], "
                           "kernel_run_counter_by_tag[HEAD_K_SWA], "
                           "kernel_run_counter_by_tag[SWEEP_K_SWA], "
                           "kernel_run_counter_by_tag[TAIL_K_SWA], plans[SWA][0]."),
}


def _misfit(name):
    change, _ = MISFITS[name]
    if change is None:  # a state for FULL only, a config with an SWA group
        return dataclasses.replace(CFG, swa_window_size=4, swa_num_slots=32), rt.init_state(CFG)
    return CFG, rt.init_state(dataclasses.replace(CFG, **change))


def _expect(name, call):
    with pytest.raises(ValueError) as e:
        call()
    msg = str(e.value)
    assert msg.startswith("kv-canary runtime: the state does not fit its config: "), msg
    assert MISFITS[name][1] in msg, msg
    assert "init_state(cfg)" in msg


@pytest.mark.parametrize("name", sorted(MISFITS))
def test_check_state_names_the_buffer_and_both_sizes(name):
    cfg, state = _misfit(name)
    _expect(name, lambda: rt.check_state(cfg, state))


def _lut(cfg):
    return jnp.zeros((cfg.swa_num_slots or 1,), jnp.int64) if cfg.swa_window_size else None


def _kv(cfg, kv):
    if cfg.swa_window_size:
        kv = {**kv, "SWA": {"K": [jnp.zeros((cfg.swa_num_slots, 16), jnp.bfloat16)]}}
    return kv


@pytest.mark.parametrize("name", ["fewer slots", "smaller ring", "no SWA group"])
@pytest.mark.parametrize("entry", ["make_canary_step", "canary_step_head", "canary_step_tail",
                                   "canary_sweep", "make_sharded_step"])
def test_every_step_builder_refuses_a_state_that_does_not_fit(name, entry):
    cfg, state = _misfit(name)
    batch, rtt, kv = _inputs(CFG)
    kv, lut = _kv(cfg, kv), _lut(cfg)
    if entry == "make_canary_step":
        call = lambda: rt.make_canary_step(cfg, _forward)(state, kv, batch, rtt, lut)  # noqa
    elif entry == "canary_step_head":
        call = lambda: rt.canary_step_head(cfg, state, batch, req_to_token=rtt, lut=lut)  # noqa
    elif entry == "canary_step_tail":
        call = lambda: rt.canary_step_tail(cfg, state, batch, kv=kv, lut=lut)  # noqa
    elif entry == "canary_sweep":
        call = lambda: rt.canary_sweep(  # noqa
            cfg, state, rows_table=rtt, row_indices=jnp.asarray([1], jnp.int64),
            lengths=jnp.asarray([2], jnp.int64), kv=kv, lut=lut)
    else:
        mesh = sharded.data_parallel_mesh(1)
        stack = lambda t: sharded.stack_shards([t], mesh)  # noqa
        step = kc.make_sharded_step(cfg, _forward, mesh)
        call = lambda: step(stack(state), stack(kv), stack(batch), stack(rtt),  # noqa
                            stack(jnp.zeros((1,), jnp.int64) if lut is None else lut))
    _expect(name, call)
    # Refused while tracing: nothing ran, so the donated state is still there.
    assert not state.violation_ring.is_deleted()
    np.testing.assert_array_equal(np.asarray(state.violation_write_index), [0])


def test_sweep_over_no_rows_runs():
    """A sweep with no row to verify (n = 0) is an empty plan, not SGLang's WritePlan error."""
    state = rt.init_state(CFG)
    _, rtt, kv = _inputs()
    state = rt.canary_sweep(CFG, state, rows_table=rtt, row_indices=jnp.zeros((0,), jnp.int64),
                            lengths=jnp.zeros((0,), jnp.int64), kv=kv)
    assert rt.violation_count(state) == 0
    assert rt.read_counters(state) == {"SWEEP_K_FULL": {"kernel_runs": 1, "slot_runs": 0}}



@pytest.mark.parametrize("extra, n", [({}, 3), (dict(swa_window_size=4, swa_num_slots=16), 6),
                                      (dict(enable_v_half=True), 6)])
def test_run_counters_are_one_buffer_per_launch_tag(extra, n):
    """The kernels update each launch tag's counters in place: the state holds one int64 [1]
    buffer per tag the config launches (HEAD, TAIL and SWEEP of each half and group)."""
    cfg = rt.CanaryConfig(**BASE, **extra)
    state = rt.init_state(cfg)
    want = {f"{c}_{h}_{g}" for c in ("HEAD", "TAIL", "SWEEP") for g in cfg.groups
            for h in cfg.halves}
    assert set(rt.launch_tags(cfg)) == want and len(want) == n
    for field in ("slot_run_counter_by_tag", "kernel_run_counter_by_tag"):
        rows = getattr(state, field)
        assert set(rows) == want
        assert all(r.shape == (1,) and r.dtype == jnp.int64 for r in rows.values())


def test_run_counters_read_back_by_tag_and_per_shard():
    """The [12] views read the per-tag buffers back in tag order, zeros for the tags never
    launched, with a leading shard axis when states are stacked."""
    _, rtt, kv = _inputs()
    state = rt.canary_sweep(CFG, rt.init_state(CFG), rows_table=rtt,
                            row_indices=jnp.zeros((0,), jnp.int64),
                            lengths=jnp.zeros((0,), jnp.int64), kv=kv)
    k = np.asarray(state.kernel_run_counters)
    assert k.dtype == np.int64 and k.shape == (len(kc.CanaryLaunchTag),)
    assert k.tolist() == [int(t == kc.CanaryLaunchTag.SWEEP_K_FULL) for t in kc.CanaryLaunchTag]
    assert not np.asarray(state.slot_run_counters).any()
    both = jax.tree.map(lambda a, b: jnp.stack([a, b]), state, rt.init_state(CFG))
    assert np.asarray(both.kernel_run_counters).tolist() == [k.tolist(), [0] * len(k)]
