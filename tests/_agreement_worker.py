"""One process of the agreement tests (tests/test_agreement.py): a simulated server run through
``CanaryManager`` in raise mode, a KV byte flipped on one rank (or one shard) at a given step;
prints one JSON line saying when and how this process raised.

``--nproc N --rank R --port P``: N processes joined by ``jax.distributed`` on 127.0.0.1.
``--shards S``: one process, a mesh of S CPU devices (XLA_FLAGS must force them)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import warnings

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_HERE), _HERE]  # this checkout first, then the test helpers

import jax  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--victim", type=int, default=0)
    p.add_argument("--inject-step", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--log-on-rank", type=int, default=-1,
                   help="this rank runs log mode (the others raise): a settings mismatch")
    a = p.parse_args()
    if a.nproc > 1:
        jax.distributed.initialize(f"127.0.0.1:{a.port}", num_processes=a.nproc,
                                   process_id=a.rank, initialization_timeout=120)
    warnings.filterwarnings("ignore", message=".*donated buffers.*")
    from kvcanary_jax import runtime as rt
    from _manager_support import SIM, Harness

    config = rt.ManagerConfig(mode="raise", real_data="all", enable_verify_token_assert=True,
                              enable_write_input_assert=True)
    out = {"rank": jax.process_index(), "raised_at": None, "loop_step": None}
    if a.rank == a.log_on_rank:
        config = dataclasses.replace(config, mode="log")
    if a.shards == 1:
        try:
            h = Harness(config)
        except ValueError as e:
            out["config_error"] = str(e)
            print(json.dumps(out), flush=True)
            if a.nproc > 1:
                jax.distributed.shutdown()
            return 0
        h.mgr.mark_init_finished()
        step = -1
        try:
            for step in range(a.steps):
                if a.rank == a.victim and step == a.inject_step:
                    req, slot = h.live_prefix_slot()
                    h.corrupt_kv(slot)
                    out["slot"] = slot
                h.step(1)
            h.mgr.flush()
        except rt.CanaryViolationError as e:
            out.update(raised_at=e.step, loop_step=step, message=str(e).splitlines()[0],
                       ranks={str(k): list(v) for k, v in e.ranks.items()},
                       local_slots=[r.violation.slot for r in e.reports])
    else:
        out.update(_mesh_run(a, config))
    print(json.dumps(out), flush=True)
    if a.nproc > 1:
        jax.distributed.shutdown()
    return 0


def _mesh_run(a, config) -> dict:
    import jax.numpy as jnp

    from kvcanary_jax import runtime as rt
    from kvcanary_jax.sharded import data_parallel_mesh, stack_shards
    from kvcanary_jax.sim.server import Server
    from _manager_support import SIM, forward_for

    mesh = data_parallel_mesh(a.shards)
    servers = [Server(dataclasses.replace(SIM, seed=0)) for _ in range(a.shards)]
    cfg = servers[0].cfg
    mgr = rt.CanaryManager(config, cfg, forward=forward_for(cfg, SIM.kv_width), mesh=mesh)
    mgr.mark_init_finished()
    kvs = stack_shards([s.kv for s in servers], mesh)
    out = {}
    step = -1
    try:
        for step in range(a.steps):
            if step == a.inject_step:
                req = next(r for r in servers[a.victim].live if r.slots)
                slot = req.slots[0]
                k = kvs["FULL"]["K"][0]
                u16 = jax.lax.bitcast_convert_type(k, jnp.uint16)
                u16 = u16.at[a.victim, slot, 0].set(u16[a.victim, slot, 0] ^ jnp.uint16(0xFF))
                kvs["FULL"]["K"] = (jax.lax.bitcast_convert_type(u16, jnp.bfloat16),)
                out["slot"] = slot
            t0 = time.perf_counter()
            prepared = [s.prepare() for s in servers]
            batches, rtts, luts = (stack_shards([p[i] for p in prepared], mesh) for i in (1, 2, 3))
            kvs = mgr.step(kvs, batches, rtts, luts)
            for s, p in zip(servers, prepared):
                s.complete(p[0], t0, poll=False)
        mgr.flush()
    except rt.CanaryViolationError as e:
        out.update(raised_at=e.step, loop_step=step, message=str(e).splitlines()[0],
                   shards=[r.shard for r in e.reports], local_slots=[r.violation.slot
                                                                    for r in e.reports])
    return out


if __name__ == "__main__":
    sys.exit(main())
