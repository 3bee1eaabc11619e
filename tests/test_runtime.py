"""The serving runtime against a composition of SGLang's torch references, step by step.

A small simulated server (chunked prefill, decode, radix-cache prefix reuse, row and slot reuse,
FULL + SWA groups through a LUT) drives :func:`runtime.make_canary_step`; after every step the
same batch is replayed through SGLang's scatter / plan / verify / write references on torch
mirrors of the state, and the canary buffers, the violation ring (as a multiset: the GPU appends
in any order), the write index, the per-tag counters and the expected-token pool must be equal.
Faults that only change inputs (req_to_token, real KV, sampled tokens) are injected on the way so
the ring is not empty.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import jax
import numpy as np
import pytest
import torch  # the oracle (SGLang's references) runs on torch: a test dependency

from kvcanary_jax import runtime as rt
from kvcanary_jax import sim as sm
from _impls import implementations

# The step runs one implementation for every op.
IMPLS = implementations()

warnings.filterwarnings("ignore", message=".*donated buffers.*")



def _t(x, dtype=None):
    a = np.array(x)
    t = torch.from_numpy(a)
    return t if dtype is None else t.to(dtype)


class OracleCanary:
    """Torch mirror of :class:`runtime.CanaryState`, advanced with SGLang's references."""

    def __init__(self, sgl, cfg: rt.CanaryConfig):
        self.sgl, self.cfg = sgl, cfg
        self.bufs = {k: torch.zeros((cfg.group_slots(k.split("_")[2]), 32), dtype=torch.uint8)
                     for k in rt.init_state(cfg).bufs}
        self.ring = torch.zeros((cfg.ring_capacity, 8), dtype=torch.int64)
        self.widx = torch.zeros(1, dtype=torch.int32)
        self.slot_ctr = torch.zeros(12, dtype=torch.int64)
        self.kernel_ctr = torch.zeros(12, dtype=torch.int64)
        self.pool = torch.zeros((cfg.max_reqs, cfg.context_len), dtype=torch.int32)
        self.flag = torch.ones(1, dtype=torch.int32)
        V, W = sgl.verify.VerifyPlan, sgl.write.WritePlan
        self.plans = {g: (V.allocate(verify_capacity=cfg.verify_cap, device="cpu"),
                          W.allocate(write_req_capacity=cfg.write_cap, device="cpu"))
                      for g in cfg.groups}

    def _ctx(self, key, tag, sources):
        v = self.sgl.verify
        mode = self.sgl.consts.RealKvHashMode.ALL if sources else self.sgl.consts.RealKvHashMode.NONE
        return v.VerifyOrWriteContext(
            canary_buf=self.bufs[key], kernel_kind=v.CanaryLaunchTag(tag),
            violation_ring=self.ring, violation_write_index=self.widx,
            slot_run_counter=self.slot_ctr[tag:tag + 1], kernel_run_counter=self.kernel_ctr[tag:tag + 1],
            real_kv_sources=tuple(sources), real_kv_hash_mode=mode,
            enable_chain_position_assert=self.flag,
        )

    def _sources(self, arrays):
        out = []
        for a in arrays:
            b = np.array(a).view(np.uint8).reshape(a.shape[0], -1)
            out.append(self.sgl.verify.RealKvSource(tensor=torch.from_numpy(b.copy()), page_size=1,
                                                    num_bytes_per_token=b.shape[1],
                                                    read_bytes=b.shape[1]))
        return out

    def step(self, batch, rtt, lut, kv):
        sgl, cfg = self.sgl, self.cfg
        b = {k: _t(getattr(batch, k)) for k in rt.ForwardBatch.__dataclass_fields__}
        sgl.scatter_ref.scatter_req_token_ids_torch_reference(
            flat_in=b["all_ids_flat"], offsets=b["all_ids_offsets"],
            req_pool_indices=b["req_pool_indices"], pool_out=self.pool)
        valid = b["all_ids_offsets"][1:] - b["all_ids_offsets"][:-1]
        rtt_t, lut_t = _t(rtt), _t(lut)
        for g in cfg.groups:
            vp, wp = self.plans[g]
            sgl.plan_ref.launch_canary_plan_kernels_torch_reference(
                verify_plan_out=vp, write_plan_out=wp, req_pool_indices=b["req_pool_indices"],
                prefix_lens=b["prefix_lens"], extend_seq_lens=b["extend_seq_lens"],
                req_to_token=rtt_t, swa_window_size=cfg.window(g),
                full_to_swa_index_mapping=lut_t if g == "SWA" else None,
                verify_capacity=cfg.verify_cap, req_to_verify_expected_tokens=self.pool,
                req_to_verify_expected_tokens_valid_lens=valid, kv_token_id_vs_position_offset=0)
        for copy in ("HEAD", "TAIL"):
            for g in cfg.groups:
                vp, wp = self.plans[g]
                loc = b["out_cache_loc"]
                if g == "SWA":
                    loc = torch.where(loc < 0, loc, lut_t[loc.clamp(min=0)])
                for h in cfg.halves:
                    key, tag = f"{copy}_{h}_{g}", rt.TAG_NAMES.index(f"{copy}_{h}_{g}")
                    srcs = self._sources(kv[g]["layers"][h][:1]) if copy == "TAIL" else []
                    sgl.verify_ref.launch_canary_verify_kernel_torch_reference(
                        context=self._ctx(key, tag, srcs), plan=vp, check_verify_expected_token=True)
                    sgl.write_ref.launch_canary_write_kernel_torch_reference(
                        context=self._ctx(key, tag, srcs), plan=wp, input_ids=b["input_ids"],
                        positions=b["positions"], out_cache_loc=loc, enable_write_input_assert=True,
                        expected_input_tokens=b["expected_input_tokens"],
                        expected_input_positions=b["expected_input_positions"])

    def sweep(self, table, rows, lengths, lut, kv):
        sgl, cfg = self.sgl, self.cfg
        n = rows.shape[0]
        cap = n * table.shape[1]
        for g in cfg.groups:
            vp = sgl.verify.VerifyPlan.allocate(verify_capacity=cap, device="cpu")
            wp = sgl.write.WritePlan.allocate(write_req_capacity=n, device="cpu")
            sgl.plan_ref.launch_canary_plan_kernels_torch_reference(
                verify_plan_out=vp, write_plan_out=wp, req_pool_indices=_t(rows),
                prefix_lens=_t(lengths), extend_seq_lens=torch.zeros(n, dtype=torch.int64),
                req_to_token=_t(table), swa_window_size=cfg.window(g),
                full_to_swa_index_mapping=_t(lut) if g == "SWA" else None, verify_capacity=cap,
                req_to_verify_expected_tokens=None, req_to_verify_expected_tokens_valid_lens=None,
                kv_token_id_vs_position_offset=0)
            for h in cfg.halves:
                tag = rt.TAG_NAMES.index(f"SWEEP_{h}_{g}")
                sgl.verify_ref.launch_canary_verify_kernel_torch_reference(
                    context=self._ctx(f"TAIL_{h}_{g}", tag, self._sources(kv[g]["layers"][h][:1])),
                    plan=vp,
                    check_verify_expected_token=False)

    def assert_equal(self, state: rt.CanaryState, step: int):
        for k, buf in self.bufs.items():
            np.testing.assert_array_equal(np.asarray(state.bufs[k]), buf.numpy(), err_msg=f"{k} @ {step}")
        n = int(self.widx[0])
        assert rt.violation_count(state) == n, f"write index @ {step}"
        m = min(n, self.cfg.ring_capacity)
        mine = sorted(map(tuple, np.asarray(state.violation_ring)[:m].tolist()))
        theirs = sorted(map(tuple, self.ring[:m].tolist()))
        assert mine == theirs, f"ring @ {step}"
        np.testing.assert_array_equal(np.asarray(state.slot_run_counters), self.slot_ctr.numpy())
        np.testing.assert_array_equal(np.asarray(state.kernel_run_counters), self.kernel_ctr.numpy())
        np.testing.assert_array_equal(np.asarray(state.expected_tokens), self.pool.numpy())


def _run_against_oracle(sgl, sim: sm.SimConfig, steps: int, faults: dict[int, str]):
    server = sm.Server(sim)
    oracle = OracleCanary(sgl, server.cfg)
    for i in range(steps):
        if i in faults:
            sm.inject(server, faults[i], np.random.default_rng(i))
        sched, batch, rtt, lut = server.prepare()
        server.state, server.kv = server.device_step(server.state, server.kv, batch, rtt, lut)
        oracle.step(batch, np.asarray(rtt), np.asarray(lut), server.kv)
        server.complete(sched, 0.0, poll=False)  # sweep_interval 0: sweeps below
        if i % 3 == 2:
            table, rows, lengths = server.sweep_inputs()
            server.sweep()
            oracle.sweep(table, rows, lengths, np.asarray(server.lut), server.kv)
        oracle.assert_equal(server.state, i)
    return server


@pytest.mark.parametrize("impl", IMPLS)
def test_steps_match_sglang_references(sgl, impl):
    sim = sm.SimConfig(steps=0, seed=3, sweep_interval=0, swa_window_size=6, implementation=impl)
    faults = {9: "req_to_token", 13: "real_kv_used", 16: "next_token_swap", 19: "real_kv_post_forward"}
    server = _run_against_oracle(sgl, sim, 22, faults)
    assert rt.violation_count(server.state) > 0  # the faults above left records to compare
    names = {v.tag for v in rt.read_violations(server.state)}
    assert {"HEAD_K_FULL", "TAIL_K_FULL"} <= names


@pytest.mark.parametrize("impl", IMPLS)
def test_v_half_full_only_matches_sglang_references(sgl, impl):
    sim = sm.SimConfig(steps=0, seed=5, sweep_interval=0, swa_window_size=0, enable_v_half=True,
                       implementation=impl)
    server = _run_against_oracle(sgl, sim, 10, {6: "real_kv_used"})
    assert "TAIL_V_FULL" in rt.read_counters(server.state)


def test_decode_violations_and_counters():
    cfg = rt.CanaryConfig(max_reqs=4, context_len=8, num_slots=16, max_bs=2, max_tokens=8,
                          ring_capacity=8)
    ring = np.zeros((2, 8), np.int64)
    ring[0] = [rt.TAG_NAMES.index("TAIL_K_SWA"), 5, 3, 11, 12, -7, -9, 4 | 32]
    ring[1] = [0, 6, 4, 13, 14, 1, 5, 8 | 16]
    vs = rt.decode_ring(ring, 3)
    assert len(vs) == 2  # the third record was dropped past the ring (index counts it)
    assert vs[0].tag == "TAIL_K_SWA" and vs[0].phase == "TAIL" and vs[0].group == "SWA"
    assert vs[0].reasons == ("VERIFY_REAL_KV_HASH_MISMATCH", "VERIFY_TOKEN_MISMATCH")
    assert vs[0].op == "verify" and vs[1].op == "write"
    assert vs[1].reasons == ("WRITE_TOKEN_MISMATCH", "WRITE_POSITION_MISMATCH")
    state = rt.init_state(cfg)
    assert rt.violation_count(state) == 0 and rt.read_counters(state) == {}
    assert set(state.bufs) == {"HEAD_K_FULL", "TAIL_K_FULL"}


def test_batch_bucket_overflow_raises():
    cfg = rt.CanaryConfig(max_reqs=4, context_len=8, num_slots=16, max_bs=1, max_tokens=4)
    with pytest.raises(ValueError, match="exceeds the bucket"):
        rt.make_batch(cfg, req_pool_indices=[1, 2], prefix_lens=[0, 0], extend_seq_lens=[1, 1],
                      all_ids=[[1], [2]], input_ids=[1, 2], positions=[0, 0], out_cache_loc=[1, 2])


_SHARDED = textwrap.dedent("""
    import warnings; warnings.filterwarnings("ignore")
    import jax, numpy as np, time
    assert len(jax.devices()) == 4, jax.devices()
    from kvcanary_jax import runtime as rt, sim as sm, sharded
    mesh = sharded.data_parallel_mesh(4)
    sims = [sm.SimConfig(steps=0, seed=10 + i, sweep_interval=0, swa_window_size=6) for i in range(4)]
    servers = [sm.Server(s) for s in sims]          # one DP rank each
    solo = [sm.Server(s) for s in sims]             # the same ranks, one canary per process
    cfg = servers[0].cfg
    step = sharded.make_sharded_step(cfg, sm.make_forward(cfg, sims[0].kv_width), mesh)
    states = sharded.stack_shards([s.state for s in servers], mesh)
    kvs = sharded.stack_shards([s.kv for s in servers], mesh)
    for i in range(8):
        if i == 5:
            sm.inject(servers[2], "real_kv_used", np.random.default_rng(0))
            sm.inject(solo[2], "real_kv_used", np.random.default_rng(0))
        preps = [s.prepare() for s in servers]
        if i == 5:  # the fault flipped server 2's KV on the host side: restage its shard
            kvs = sharded.stack_shards(
                [servers[j].kv if j == 2 else sharded.unstack_shard(kvs, j) for j in range(4)], mesh)
        states, kvs = step(states, kvs, *(sharded.stack_shards([p[k] for p in preps], mesh)
                                          for k in (1, 2, 3)))
        for j, s in enumerate(servers):
            s.state, s.kv = sharded.unstack_shard(states, j), sharded.unstack_shard(kvs, j)
            s.complete(preps[j][0], 0.0, poll=False)
        for s in solo:
            s.step()
    for j in range(4):
        a, b = sharded.unstack_shard(states, j), solo[j].state
        for k in a.bufs:
            np.testing.assert_array_equal(np.asarray(a.bufs[k]), np.asarray(b.bufs[k]))
        np.testing.assert_array_equal(np.asarray(a.violation_ring), np.asarray(b.violation_ring))
        np.testing.assert_array_equal(np.asarray(a.slot_run_counters), np.asarray(b.slot_run_counters))
        np.testing.assert_array_equal(np.asarray(a.kernel_run_counters), np.asarray(b.kernel_run_counters))
    counts = [rt.violation_count(sharded.unstack_shard(states, j)) for j in range(4)]
    assert counts[2] > 0 and counts[0] == counts[1] == counts[3] == 0, counts
    print("SHARDED_OK", counts)
""")


@pytest.mark.e2e
def test_sharded_four_cpu_devices():
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
    env["JAX_PLATFORMS"] = "cpu"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", _SHARDED], env=env, cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "SHARDED_OK" in proc.stdout
