"""One process of the agreement tests (tests/test_agreement.py): a simulated server run through
``CanaryManager`` in raise mode, a KV byte flipped on one rank (or one shard) at a given step;
prints one JSON line saying when and how this process raised.

``--nproc N --rank R --port P``: N processes joined by ``jax.distributed`` on 127.0.0.1 (with
JAX's recoverability on where a peer is killed: what the runtime's agreement asks of a server for
the live processes to keep running). ``--shards S``: one process, a mesh of S CPU devices
(XLA_FLAGS must force them).

Ordinary server events, across processes: ``--hang-rank R --hang-step K --hang-s T`` (rank R
stops for T seconds before step K; K = -1: before it builds its manager), ``--die-rank R
--die-step K`` (rank R is killed before step K), ``--log-on-rank`` / ``--none-on-rank`` (that
rank runs another mode), ``--agreement-timeout S``. Every process compiles its step before the
processes meet (a manager that agrees with no one, then a barrier), so the agreement timeout
measures the peers, not the compiler. A process stops serving at its first agreement error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
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
    p.add_argument("--none-on-rank", type=int, default=-1,
                   help="this rank runs mode none (the others raise): a settings mismatch")
    p.add_argument("--agreement-timeout", type=float, default=None)
    p.add_argument("--hang-rank", type=int, default=-1)
    p.add_argument("--hang-step", type=int, default=0)
    p.add_argument("--hang-s", type=float, default=0.0)
    p.add_argument("--die-rank", type=int, default=-1)
    p.add_argument("--die-step", type=int, default=0)
    a = p.parse_args()
    if a.nproc > 1:
        if a.die_rank >= 0:
            # What the runtime asks of a server for a dead peer to leave the live processes
            # running (kvcanary_jax.runtime.agreement).
            jax.config.update("jax_enable_recoverability", True)
        jax.distributed.initialize(f"127.0.0.1:{a.port}", num_processes=a.nproc,
                                   process_id=a.rank, initialization_timeout=120)
    warnings.filterwarnings("ignore", message=".*donated buffers.*")
    from kvcanary_jax import runtime as rt
    from _manager_support import SIM, Harness

    config = rt.ManagerConfig(mode="raise", real_data="all", enable_verify_token_assert=True,
                              enable_write_input_assert=True)
    if a.agreement_timeout is not None:
        config = dataclasses.replace(config, agreement_timeout_s=a.agreement_timeout)
    out = {"rank": jax.process_index(), "raised_at": None, "loop_step": None}
    if a.rank == a.log_on_rank:
        config = dataclasses.replace(config, mode="log")
    if a.rank == a.none_on_rank:
        config = dataclasses.replace(config, mode="none", real_data="none",
                                     enable_verify_token_assert=False,
                                     enable_write_input_assert=False)
    if a.shards > 1:
        out.update(_mesh_run(a, config))
    else:
        out.update(_run(a, config))
    print(json.dumps(out), flush=True)
    if a.nproc > 1:
        _leave(a)
    return 0


def _meet(a, name: str) -> None:
    """Every process that is to take part waits for the others (test choreography)."""
    if a.nproc > 1:
        from jax._src import distributed

        distributed.global_state.client.wait_at_barrier(f"agreement_worker_{name}", 120_000)


def _leave(a) -> None:
    """``jax.distributed.shutdown()``, whose barrier waits for every process; with a peer killed
    (and recoverability on), that barrier waits for no one, and process 0, which hosts the
    coordination service and whose exit takes the others down, leaves last instead: once every
    live process said it is done, and a moment after (for them to exit)."""
    if a.die_rank < 0:
        jax.distributed.shutdown()
        return
    from jax._src import distributed

    client = distributed.global_state.client
    sys.stdout.flush()
    sys.stderr.flush()
    if a.rank != 0:
        client.key_value_set(f"agreement_worker/done/{a.rank}", "1")
    else:
        for r in range(1, a.nproc):
            if r != a.die_rank:
                client.blocking_key_value_get(f"agreement_worker/done/{r}", 300_000)
        time.sleep(3)
    os._exit(0)


def _error(e, step: int, t0: float) -> dict:
    from kvcanary_jax import runtime as rt

    out = dict(raised_at=e.step, loop_step=step, message=str(e).splitlines()[0],
               ranks={str(k): list(v) for k, v in e.ranks.items()},
               local_slots=[r.violation.slot for r in e.reports], error=type(e).__name__,
               elapsed_s=time.monotonic() - t0,
               kv_attached=e.kv is not None and not jax.tree.leaves(e.kv)[0].is_deleted())
    if isinstance(e, rt.CanaryAgreementError):
        out["peers"] = list(e.peers)
    return out


def _run(a, config) -> dict:
    from kvcanary_jax import runtime as rt
    from _manager_support import Harness

    # Compile the step alone first (the manager's jits are shared by config and forward).
    warm = Harness(dataclasses.replace(config, mode="raise", agree_across_processes=False))
    warm.step(1)
    _meet(a, "compiled")
    if a.rank == a.hang_rank and a.hang_step < 0:
        time.sleep(a.hang_s)
    out = {}
    t0 = time.monotonic()
    try:
        h = Harness(config)
    except (ValueError, rt.CanaryAgreementError) as e:
        out["config_error"] = str(e)
        if isinstance(e, rt.CanaryAgreementError):
            out.update(error=type(e).__name__, peers=list(e.peers),
                       elapsed_s=time.monotonic() - t0)
        return out
    h.mgr.mark_init_finished()
    step = -1
    try:
        for step in range(a.steps):
            if a.rank == a.victim and step == a.inject_step:
                req, slot = h.live_prefix_slot()
                h.corrupt_kv(slot)
                out["slot"] = slot
            if a.rank == a.die_rank and step == a.die_step:
                os.kill(os.getpid(), signal.SIGKILL)
            if a.rank == a.hang_rank and step == a.hang_step:
                time.sleep(a.hang_s)
            t0 = time.monotonic()
            h.step(1)
        t0 = time.monotonic()
        h.mgr.flush()
    except rt.CanaryViolationError as e:
        out.update(_error(e, step, t0))
    return out


def _mesh_run(a, config) -> dict:
    import jax.numpy as jnp

    from kvcanary_jax import runtime as rt
    from kvcanary_jax.runtime.sharded import data_parallel_mesh, stack_shards
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
                k = kvs["FULL"]["layers"]["K"][0]
                u16 = jax.lax.bitcast_convert_type(k, jnp.uint16)
                u16 = u16.at[a.victim, slot, 0].set(u16[a.victim, slot, 0] ^ jnp.uint16(0xFF))
                kvs["FULL"]["layers"]["K"] = ((jax.lax.bitcast_convert_type(u16, jnp.bfloat16),)
                                              + kvs["FULL"]["layers"]["K"][1:])
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
