"""Data-parallel fault campaign for the sharded canary step (one canary per DP-attention rank).

    python -m bench.sharded --shards 2 [--device cpu|gpu] [--steps 24] [--faults all]
                            [--injections 1] [--out DIR] [--json]

On CPU the shards are host devices forced by XLA: run with
``XLA_FLAGS=--xla_force_host_platform_device_count=N JAX_PLATFORMS=cpu``.

Setup: ``N`` simulated servers (:class:`kvcanary_jax.sim.Server`, seeds ``seed .. seed+N-1``,
the demo's limits), one per data-parallel shard of :func:`kvcanary_jax.sharded.data_parallel_mesh`.
Each step every server's host scheduler builds its batch (``prepare``); the batches,
``req_to_token`` tables and LUTs are stacked along the mesh axis; one call of
:func:`kvcanary_jax.sharded.make_sharded_step` runs HEAD -> forward -> TAIL on every shard under
``shard_map``; each server then finishes its step on the host (``complete``) from its shard of the
outputs. A host-side change to one server's canary state or KV (a fault, a checkpoint restore) is
restaged into the stacked arrays before the next step.

What is measured:

1. Clean phase, ``--steps`` steps. False positives: violations recorded on any shard (must be 0).
   ``N`` solo servers of the same seeds run the ordinary single-device step in lockstep; at the
   end each shard's canary state and KV pool must equal its solo twin's byte for byte, i.e.
   nothing crosses shards.
2. Fault phase: for each fault kind, ``--injections`` trials, the target shard rotating over the
   mesh. A trial restores every server from a checkpoint of the clean phase, arms the fault on
   the target server only (:func:`kvcanary_jax.sim.inject`) and steps the whole mesh until
   the host poll (violation counts of all shards) is non-zero or the window passes
   (:func:`kvcanary_jax.sim.run_trial`). Detected: violations on the faulted shard.
   Cross-shard leaks: violations on any other shard (must be 0).
   The sharded step is HEAD -> forward -> TAIL only: the SWEEP launch (``canary_sweep`` over the
   radix-cache walk) is not part of it, so the servers run with ``sweep_interval=0`` and fault
   kinds only the sweep can catch are reported as skipped, with the reason.
3. Timing of the device step alone. The last ``--timing-steps`` clean steps are recorded with
   their device-resident inputs, together with the canary state and KV before them; replaying
   them from that state repeats the clean steps exactly (no violations, checked). Per call, each
   synchronised with ``block_until_ready``: the sharded step over ``N`` devices, and the
   single-device jitted step (``runtime.make_canary_step``, what ``Server.step`` runs) on device 0
   with one shard's inputs (every shard in turn), i.e. the same per-shard load. Medians over
   ``--timing-repeats`` replays, the first call of each replay dropped (compilation happened in the
   clean phase). Host staging (``prepare`` on every server + stacking onto the mesh) is timed
   separately in the clean phase. On CPU the forced devices share the host's cores, so the ratio
   only means something on GPUs.

Exit code 0 only with no false positives, every shard identical to its solo twin, no cross-shard
violations and every placed fault detected on its shard.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from kvcanary_jax import _config
from kvcanary_jax import runtime as rt
from kvcanary_jax import sharded
from kvcanary_jax import sim as sm

# Fault kinds the sharded step cannot catch, and why (they are listed in the output, not run).
NEEDS_SWEEP = {
    "real_kv_unused_cache": "caught only by the SWEEP launch (canary_sweep over the radix-cache "
                            "walk), which make_sharded_step does not run (HEAD -> forward -> TAIL "
                            "only); the sharded servers run with sweep_interval=0",
}

# The clean run's checkpoints, as in sim.run_campaign: every 2 steps from step 4 on.
CHECKPOINT_EVERY, CHECKPOINT_WARMUP = 2, 4
RATIO_TARGET = 1.1  # sharded / single-device step time on GPU


# ------------------------------------------------------------------------------------------
# N servers, one sharded step
# ------------------------------------------------------------------------------------------


class ShardedFleet:
    """One server per data-parallel shard, stepped together by the sharded canary step.

    ``states`` / ``kvs`` are the stacked device arrays. After every step each server holds views
    of its shard (``server.state`` / ``server.kv``), so host code (fault hooks, checkpoints, ring
    decoding) works on a server as on a single-device one; a server whose state or KV object was
    replaced on the host is restaged into the stacked arrays before the next step or poll.
    """

    def __init__(self, sims: list[sm.SimConfig], mesh, *, manager: bool = False):
        self.mesh = mesh
        self.servers = [sm.Server(s) for s in sims]
        cfg = self.servers[0].cfg
        self.step_fn = sharded.make_sharded_step(cfg, sm.make_forward(cfg, sims[0].kv_width), mesh)
        # With ``manager``: the steps run through the runtime manager over the mesh (log mode:
        # its host side one step late, the error flag max-reduced over the shards inside the
        # step); the timing replays keep the plain sharded step.
        self.manager = None
        if manager:
            config = rt.ManagerConfig(
                mode="log", real_data=cfg.real_kv_hash_mode, ring_capacity=cfg.ring_capacity,
                enable_verify_token_assert=cfg.enable_verify_token_assert,
                enable_write_input_assert=cfg.enable_write_input_assert,
                stats_print_every_n_steps=0)
            self.manager = rt.CanaryManager(
                config, cfg, forward=sm.make_forward(cfg, sims[0].kv_width), mesh=mesh,
                allocate=False)
            self.manager.mark_init_finished()
        self.states = self.kvs = None
        self._views: list[tuple] = [(None, None)] * len(self.servers)
        self.staging_s: list[float] = []  # host: prepare on every server + stacking
        self._restage()

    def _hand_views(self):
        views = _local_views((self.states, self.kvs), len(self.servers))
        for s, (state, kv) in zip(self.servers, views):
            s.state, s.kv = state, kv
        self._views = views

    def _restage(self):
        """Stack again what the host replaced (a server whose state or KV is not the view it
        was handed)."""
        dirty_state = any(s.state is not v[0] for s, v in zip(self.servers, self._views))
        dirty_kv = any(s.kv is not v[1] for s, v in zip(self.servers, self._views))
        if dirty_state:
            self.states = _stack_local([s.state for s in self.servers], self.mesh)
        if dirty_kv:
            self.kvs = _stack_local([s.kv for s in self.servers], self.mesh)
        if dirty_state or dirty_kv:
            self._hand_views()

    def stage(self):
        """Host half of a step: every server's batch, stacked onto the mesh."""
        t0 = time.perf_counter()
        preps = [s.prepare() for s in self.servers]  # pre-step fault hooks run here
        self._restage()
        inputs = tuple(sharded.stack_shards([p[k] for p in preps], self.mesh) for k in (1, 2, 3))
        self.staging_s.append(time.perf_counter() - t0)
        return preps, inputs

    def step(self):
        """One step of every shard; returns what it ran (per-server preps, stacked inputs)."""
        preps, inputs = self.stage()
        if self.manager is not None:
            self.manager.state = self.states
            self.kvs = self.manager.step(self.kvs, *inputs)
            self.states = self.manager.state
        else:
            self.states, self.kvs = self.step_fn(self.states, self.kvs, *inputs)
        self._hand_views()
        for s, p in zip(self.servers, preps):
            s.complete(p[0], 0.0, poll=False)  # post-sample / post-step fault hooks run here
        return preps, inputs

    def violation_counts(self) -> np.ndarray:
        """The host poll: violations ever recorded, per shard (one transfer)."""
        self._restage()
        return np.asarray(self.states.violation_write_index).reshape(len(self.servers), -1)[:, 0]

    def snapshot(self):
        return [s.snapshot() for s in self.servers]

    def restore(self, snap):
        for s, one in zip(self.servers, snap):
            s.restore(one)
        self._restage()
        if self.manager is not None:
            self.manager.state = self.states
            self.manager.resync()  # reporting resumes from the restored rings


@jax.jit
def _first(tree):
    return jax.tree.map(lambda x: x[0], tree)


def _local_views(tree, n: int) -> list:
    """Shard ``j`` of a stacked pytree for every ``j``, each on its own device: the same values
    as :func:`sharded.unstack_shard`, but one dispatch per shard (on the device that holds it)
    instead of one sharded slice per leaf and shard."""
    leaves, treedef = jax.tree.flatten(tree)
    local = [{(s.index[0].start or 0): s.data for s in x.addressable_shards} for x in leaves]
    with _config.x64_scope():
        return [jax.tree.unflatten(treedef, _first([d[j] for d in local])) for j in range(n)]


@jax.jit
def _expand(tree):
    return jax.tree.map(lambda x: x[None], tree)


def _stack_local(trees: list, mesh):
    """The inverse of :func:`_local_views` (what :func:`sharded.stack_shards` builds): shard ``j``
    of the result is ``trees[j]``, copied to device ``j`` first if it lives elsewhere."""
    devices = list(mesh.devices.flat)
    sharding = NamedSharding(mesh, P(mesh.axis_names[0]))
    with _config.x64_scope():
        pieces = [jax.tree.leaves(_expand(jax.device_put(t, d))) for t, d in zip(trees, devices)]
        stacked = [jax.make_array_from_single_device_arrays((len(col),) + col[0].shape[1:],
                                                            sharding, list(col))
                   for col in zip(*pieces)]
    return jax.tree.unflatten(jax.tree.structure(trees[0]), stacked)


def _differences(a, b) -> list[str]:
    """Paths of the leaves where two pytrees differ (shape, dtype or bytes)."""
    la, _ = jax.tree_util.tree_flatten_with_path(a)
    lb = jax.tree.leaves(b)
    out = []
    for (path, x), y in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        if x.shape != y.shape or x.dtype != y.dtype or x.tobytes() != y.tobytes():
            out.append(jax.tree_util.keystr(path))
    if len(la) != len(lb):
        out.append(f"<{len(la)} vs {len(lb)} leaves>")
    return out


# ------------------------------------------------------------------------------------------
# Phases
# ------------------------------------------------------------------------------------------


def run_clean(fleet: ShardedFleet, solo: list[sm.Server], steps: int, timing_steps: int, tick):
    """Clean steps with the solo twins in lockstep; returns checkpoints, the recording for the
    timing replay and the per-step wall times of the whole sharded step (host + device)."""
    ckpts, fleet_s = {}, []
    record_from = max(1, steps - timing_steps)
    rec = {"inputs": [], "solo_inputs": [[] for _ in solo], "start": None}
    for i in range(steps):
        if i >= CHECKPOINT_WARMUP and (i - CHECKPOINT_WARMUP) % CHECKPOINT_EVERY == 0:
            ckpts[i] = fleet.snapshot()
        if i == record_from:
            fleet._restage()
            rec["start"] = jax.tree.map(np.asarray, (fleet.states, fleet.kvs))
        t0 = time.perf_counter()
        preps, inputs = fleet.step()
        fleet.violation_counts()  # the host poll syncs the step
        fleet_s.append(time.perf_counter() - t0)
        if i >= record_from:
            rec["inputs"].append(inputs)
            for j, p in enumerate(preps):
                rec["solo_inputs"][j].append(p[1:])
        for s in solo:
            s.step()
        tick(1)
    return ckpts, rec, fleet_s


def run_faults(fleet: ShardedFleet, ckpts: dict, kinds: list[str], *, injections: int,
               window: int, tick) -> tuple[list[dict], list[dict]]:
    """The fault trials; returns per-kind summaries and every trial."""
    n = len(fleet.servers)
    poll = lambda: int(fleet.violation_counts().sum())  # noqa: E731
    summaries, trials = [], []
    rotation = 0
    for kind in kinds:
        ki = list(sm.FAULT_KINDS).index(kind)  # seeds the trial as run_campaign does
        rep, targets, leaks = sm.FaultReport(kind=kind), [], 0
        for ci, start in enumerate(sorted(ckpts)):
            if rep.injected == injections:
                break
            target = rotation % n
            server = fleet.servers[target]
            fleet.restore(ckpts[start])
            rng = np.random.default_rng((server.sim.seed, ki, ci))
            rec, found = sm.run_trial(server, kind, rng, window=window, step=fleet.step,
                                      poll=poll, tick=tick)
            if not rec["placed"]:
                continue
            rotation += 1
            counts = fleet.violation_counts()
            hit = int(counts[target]) > 0
            rep.add(rec, found if hit else None, start,
                    rt.read_violations(server.state) if hit else ())
            other = int(counts.sum() - counts[target])
            leaks += other
            targets.append(target)
            trials.append({
                "kind": kind, "shard": target, "checkpoint": start,
                "placed_step": rec.get("step"), "poll_step": found,
                "detected": hit,
                "latency": (found - rec.get("step", start)) if hit else None,
                "violations_per_shard": [int(c) for c in counts],
                "cross_shard_violations": other,
                "fault": {k: v for k, v in rec.items() if k not in ("kind", "placed")},
            })
        d = rep.as_dict()
        d.update(shards=targets, cross_shard_violations=leaks, requested=injections)
        summaries.append(d)
    return summaries, trials


def _put(tree, sharding):
    """Host arrays onto ``sharding``; None: the default device, uncommitted, as ``Server``
    holds them (so the single-device step hits the executable compiled in the clean phase)."""
    with _config.x64_scope():
        if sharding is None:
            return jax.tree.map(jnp.asarray, tree)
        return jax.device_put(tree, sharding)


def _replay(step, start, inputs, sharding, repeats: int):
    """Per-call seconds of ``step`` over the recorded inputs from the recorded state (the first
    call of each replay dropped), and the state after the last replay."""
    samples, state = [], None
    for _ in range(repeats):
        state, kv = _put(start, sharding)
        jax.block_until_ready((state, kv))
        for k, args in enumerate(inputs):
            t0 = time.perf_counter()
            state, kv = step(state, kv, *args)
            jax.block_until_ready((state, kv))
            if k:
                samples.append(time.perf_counter() - t0)
    return samples, state


def run_timing(fleet: ShardedFleet, solo: list[sm.Server], rec: dict, repeats: int) -> dict:
    """Device step time: the sharded step vs the single-device step on each shard's inputs."""
    if rec["start"] is None or len(rec["inputs"]) < 2:
        return {"skipped": "too few clean steps to replay (need --steps >= 3)"}
    mesh_sharding = NamedSharding(fleet.mesh, P(fleet.mesh.axis_names[0]))
    sh, end = _replay(fleet.step_fn, rec["start"], rec["inputs"], mesh_sharding, repeats)
    sh_viol = int(np.asarray(end.violation_write_index).sum())
    solo_step = solo[0].device_step  # compiled in the clean phase
    per_shard, pooled, solo_viol = [], [], 0
    for j in range(len(fleet.servers)):
        start = jax.tree.map(lambda x: x[j], rec["start"])
        s, end = _replay(solo_step, start, rec["solo_inputs"][j], None, repeats)
        per_shard.append(statistics.median(s))
        pooled += s
        solo_viol += rt.violation_count(end)
    sharded_med, solo_med = statistics.median(sh), statistics.median(pooled)
    return {
        "replayed_steps": len(rec["inputs"]),
        "repeats": repeats,
        "calls_timed": {"sharded": len(sh), "single_device": len(pooled)},
        "sharded_step_median_s": sharded_med,
        "sharded_step_min_s": min(sh),
        "single_device_step_median_s": solo_med,
        "single_device_step_min_s": min(pooled),
        "single_device_step_median_per_shard_s": per_shard,
        "ratio": sharded_med / solo_med,
        "ratio_target": RATIO_TARGET,
        "replay_violations": {"sharded": sh_viol, "single_device": solo_viol},
    }


# ------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------


def _select_devices(device: str, shards: int):
    """Pin JAX to the platform (before it initialises) and return the mesh over ``shards``
    devices; a clear exit when there are fewer."""
    from kvcanary_jax._devices import select_device

    select_device(device)
    platform_name = "cpu" if device == "cpu" else "gpu"
    devs = jax.devices(platform_name)
    if len(devs) < shards:
        if device == "cpu":
            how = (f"force host devices before JAX starts: XLA_FLAGS="
                   f"--xla_force_host_platform_device_count={shards} JAX_PLATFORMS=cpu "
                   f"python -m bench.sharded --shards {shards} ...")
        else:
            how = (f"run on a machine with {shards} visible GPUs (check CUDA_VISIBLE_DEVICES), "
                   f"or use fewer --shards")
        raise SystemExit(f"bench.sharded: --shards {shards} needs {shards} {platform_name} "
                         f"devices, JAX sees {len(devs)} ({', '.join(map(str, devs))}); {how}")
    mesh = sharded.data_parallel_mesh(shards)
    got = {d.platform for d in mesh.devices.flat}
    if got != {platform_name}:
        raise SystemExit(f"bench.sharded: the mesh is on {sorted(got)}, expected {platform_name}")
    return mesh


def _environment(mesh) -> dict:
    import jaxlib

    return {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "mesh_devices": [str(d) for d in mesh.devices.flat],
        "device_kind": mesh.devices.flat[0].device_kind,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def _progress(enabled: bool, total: int):
    if enabled:
        try:
            from tqdm import tqdm

            return tqdm(total=total, desc="kv-canary sharded", unit="step", file=sys.stderr,
                        leave=False, dynamic_ncols=True)
        except ImportError:
            pass
    return None


def _ms(x) -> str:
    return "-" if x is None else f"{1e3 * x:.3f} ms"


def _table(faults: list[dict]) -> str:
    rows = [("fault", "shards", "injected", "detected", "latency", "caught by", "cross-shard")]
    for f in faults:
        rows.append((
            f["kind"], ",".join(map(str, f["shards"])) or "-", f"{f['injected']}/{f['requested']}",
            str(f["detected"]), ",".join(map(str, f["latencies"])) or "-",
            ",".join(f["tags"]) or "-", str(f["cross_shard_violations"]),
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _report(out: dict) -> str:
    c, t, cfg = out["clean"], out["timing"], out["config"]
    lines = [
        f"kv-canary sharded campaign: {cfg['shards']} DP shards on {cfg['device']} "
        f"({', '.join(out['environment']['mesh_devices'])}), {c['steps']} clean steps, "
        f"seeds {cfg['seeds'][0]}..{cfg['seeds'][-1]}",
        f"clean run: {c['false_positives']} false positive(s) (per shard "
        f"{','.join(map(str, c['violations_per_shard']))}); shards identical to solo runs: "
        f"{sum(c['identical_to_solo'])}/{len(c['identical_to_solo'])}",
    ]
    for j, diff in c["solo_differences"].items():
        lines.append(f"  shard {j} differs from its solo run at {', '.join(diff[:6])}")
    lines += ["", _table(out["faults"])]
    for s in out["skipped"]:
        lines.append(f"skipped {s['kind']}: {s['reason']}")
    lines.append("")
    if "skipped" in t:
        lines.append(f"timing: skipped ({t['skipped']})")
    else:
        lines.append(
            f"device step (median of {t['calls_timed']['sharded']} calls): sharded over "
            f"{cfg['shards']} devices {_ms(t['sharded_step_median_s'])}, single device "
            f"{_ms(t['single_device_step_median_s'])}, ratio {t['ratio']:.3f}x "
            f"(target <= {RATIO_TARGET}x on GPU)")
        lines.append(
            f"host staging (prepare x{cfg['shards']} + stack) "
            f"{_ms(out['host']['staging_median_s'])}"
            f"/step; whole sharded step incl. host and poll {_ms(out['host']['step_median_s'])}"
            f"/step; first step incl. compile {out['host']['first_step_s']:.2f} s")
        if cfg["device"] == "cpu":
            lines.append("  (CPU: the forced host devices share the host's cores; the ratio is only "
                         "meaningful on GPUs)")
    lines.append("")
    placed = sum(f["injected"] for f in out["faults"])
    caught = sum(f["detected"] for f in out["faults"])
    lines.append(f"{'OK' if out['ok'] else 'FAILED'}: {caught}/{placed} faults detected on their "
                 f"shard, {out['cross_shard_violations']} cross-shard violation(s), "
                 f"{c['false_positives']} false positive(s); wall {out['wall_s']:.1f} s")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.sharded",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=2, help="data-parallel shards = devices")
    ap.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                    help="cpu: forced host devices; gpu: the GPUs")
    ap.add_argument("--implementation", default=None,
                    help="what every op runs (default: the device's)")
    ap.add_argument("--steps", type=int, default=24, help="clean steps (default 24)")
    ap.add_argument("--seed", type=int, default=10, help="shard i runs seed + i (default 10)")
    ap.add_argument("--faults", default="all",
                    help="comma list of fault kinds, or 'all': " + ", ".join(sm.FAULT_KINDS))
    ap.add_argument("--injections", type=int, default=1, help="trials per fault kind (default 1)")
    ap.add_argument("--window", type=int, default=0,
                    help="steps a placed fault gets to be seen (default: as the demo)")
    ap.add_argument("--swa-window", type=int, default=8,
                    help="sliding window of the SWA buffer group; 0 = FULL group only")
    ap.add_argument("--timing-steps", type=int, default=16,
                    help="clean steps recorded for the timing replay (default 16)")
    ap.add_argument("--timing-repeats", type=int, default=5, help="timing replays (default 5)")
    ap.add_argument("--manager", action="store_true",
                    help="step the fleet through the runtime manager (log mode, one canary per "
                         "shard, the error flag max-reduced over the mesh inside the step)")
    ap.add_argument("--out", help="directory for sharded.json")
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return ap


def main(argv: list[str] | None = None) -> int:
    with warnings.catch_warnings():
        # CPU backends cannot donate every buffer the step donates; expected (the caller's
        # filters are restored on return).
        warnings.filterwarnings("ignore", message=".*donated buffers.*")
        return _main(argv)


def _main(argv) -> int:
    args = build_parser().parse_args(argv)
    if min(args.shards, args.steps, args.injections) < 1:
        print("bench.sharded: --shards, --steps and --injections must be >= 1", file=sys.stderr)
        return 2
    faults = None if args.faults in ("all", "") else [
        f.strip() for f in args.faults.split(",") if f.strip()]
    try:
        kinds = sm.fault_kinds(faults)
    except ValueError as e:
        print(f"bench.sharded: {e}", file=sys.stderr)
        return 2
    mesh = _select_devices(args.device, args.shards)
    t_start = time.perf_counter()

    sims = [sm.SimConfig(steps=args.steps, seed=args.seed + i, swa_window_size=args.swa_window,
                         sweep_interval=0, implementation=args.implementation)
            for i in range(args.shards)]
    window = args.window or sm.default_window(sims[0])
    skipped = [{"kind": k, "reason": NEEDS_SWEEP[k]} for k in kinds if k in NEEDS_SWEEP]
    run_kinds = [k for k in kinds if k not in NEEDS_SWEEP]

    fleet = ShardedFleet(sims, mesh, manager=args.manager)
    solo = [sm.Server(s) for s in sims]
    for s in solo[1:]:
        s.device_step = solo[0].device_step  # one single-device compile for every twin

    bar = _progress(not args.no_progress, args.steps + len(run_kinds) * args.injections * window)
    tick = (lambda k: bar.update(k)) if bar is not None else (lambda k: None)
    ckpts, rec, fleet_s = run_clean(fleet, solo, args.steps, args.timing_steps, tick)
    counts = fleet.violation_counts()
    diffs = {j: _differences((fleet.servers[j].state, fleet.servers[j].kv), (s.state, s.kv))
             for j, s in enumerate(solo)}
    clean = {
        "steps": args.steps,
        "false_positives": int(counts.sum()),
        "violations_per_shard": [int(c) for c in counts],
        "violations": {j: [str(v) for v in rt.read_violations(s.state)[:5]]
                       for j, s in enumerate(fleet.servers) if counts[j]},
        "identical_to_solo": [not diffs[j] for j in range(args.shards)],
        "solo_differences": {j: d for j, d in diffs.items() if d},
        "counters_per_shard": [rt.read_counters(s.state) for s in fleet.servers],
        "checkpoints": sorted(ckpts),
    }
    if run_kinds and not ckpts:
        print(f"bench.sharded: no clean checkpoint to inject faults from (the first is taken "
              f"before step {CHECKPOINT_WARMUP}); use --steps >= {CHECKPOINT_WARMUP + 1}",
              file=sys.stderr)
    faults_out, trials = run_faults(fleet, ckpts, run_kinds, injections=args.injections,
                                    window=window, tick=tick)
    if bar is not None:
        bar.close()
    timing = run_timing(fleet, solo, rec, max(1, args.timing_repeats))
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    host = {
        "staging_median_s": med(fleet.staging_s[1 : args.steps]),
        "step_median_s": med(fleet_s[1:]),
        "first_step_s": fleet_s[0],
    }

    leaks = sum(f["cross_shard_violations"] for f in faults_out)
    ok = (clean["false_positives"] == 0 and all(clean["identical_to_solo"]) and leaks == 0
          and all(f["detected"] == f["injected"] > 0 for f in faults_out))
    out = {
        "environment": _environment(mesh),
        "config": {
            "shards": args.shards, "device": args.device, "seeds": [s.seed for s in sims],
            "injections": args.injections, "window": window, "manager": args.manager,
            "sim": {k: v for k, v in dataclasses.asdict(sims[0]).items() if k != "seed"},
        },
        "clean": clean,
        "faults": faults_out,
        "trials": trials,
        "skipped": skipped,
        "cross_shard_violations": leaks,
        "timing": timing,
        "host": host,
        "ok": ok,
        "wall_s": time.perf_counter() - t_start,
    }
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "sharded.json"), "w") as f:
            json.dump(out, f, indent=1, default=str)
    print(json.dumps(out, default=str) if args.json else _report(out))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
