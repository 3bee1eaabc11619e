"""A life of a real tpu-inference 0.32 runner on the CPU with the canary installed, then faults.

Run as a script in a process of its own (``tests/_tpu_inference_runner.py`` says why and what
it patches); prints one JSON document that tests/test_tpu_inference.py checks. ``--head-dim
64`` runs the head_dim 64 layout (a shorter life: prefill, the decode loop, a flipped byte, the
real-KV modes); ``--dp 2`` data parallelism on two CPU devices (:func:`dp_main`; the caller
sets ``--xla_force_host_platform_device_count=2``).

The clean life, driven by vLLM's own scheduler: two requests sharing a 16-token block in the
step that fills it (a same-step prefix hit), their decode through the on-device decode loop
(``enable_continue_decode``, 4 steps per loop), a request after them that hits the cached
block, then three long requests on a cache too small for all of them (vLLM preempts one and
resumes it), and the sweep over the cached blocks. Then the faults, each on its own request
and counted by the violations its step added (read after the manager's readback of that step):

* a flipped K byte of the canary layer in a slot a running request reads;
* a wrong block-table entry (``input_batch.block_table[0]``) of a running request;
* a stale block reused: a new request's cached block swapped, in the scheduler's output, for a
  block another prefix fills;
* the decode loop's EOS lead: with ``CONTINUE_DECODE_EOS_CHECK_INTERVAL`` 0, a lane that
  sampled EOS keeps writing the padding token's KV over its last real token's slot; the same
  request with the interval 1 (the default) is the control;
* the real-KV modes (``all``, ``partial``, ``none``), each a fresh guard: K and V bits flipped
  inside and past what the mode fingerprints (:func:`real_data_modes`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

_env_before = os.environ.get("XLA_FLAGS", "")
import _tpu_inference_runner as R  # noqa: E402

R.patch_for_cpu()
_env_after = os.environ.get("XLA_FLAGS", "")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from kvcanary_jax.integrations import tpu_inference as kti  # noqa: E402


def rows(found):
    return [dict(shard=s, tag=v.tag, slot=v.slot, position=v.position, token=v.stored_token,
                 expected_token=v.expected_token, reasons=list(v.reasons)) for s, v in found]


class Life:
    def __init__(self, head_dim: int, num_blocks: int, *, dp_size: int = 1,
                 guarded: bool = True, continue_decode: bool = True):
        self.e = R.Engine(head_dim=head_dim, num_blocks=num_blocks, dp_size=dp_size,
                          continue_decode=continue_decode)
        self.dp_size = dp_size
        self.refused = self.refusals()
        # tpu-inference's DPScheduler keeps each rank's block pool in a process of its own,
        # which takes no eviction command: the evictions are only recorded there.
        evict = (lambda rank, block: None) if dp_size > 1 else None
        self.rem = kti.Remediator(self.e.scheduler, evict=evict)
        self.reports = []  # (slot, request) of every report the manager made
        self.guard = None
        if guarded:
            self.install("all")
        self.tamper = None
        self.preempted, self.prefix_hits, self.loops = set(), {}, 0
        self.log = []

    def install(self, real_data: str, **kwargs) -> None:
        """A fresh guard (the one installed, if any, taken off first)."""
        if self.guard is not None:
            self.guard.uninstall()
        self.guard = kti.install(self.e.runner, mode="log", real_data=real_data,
                                 on_violation=self.remediate, **kwargs)
        self.rem.guard = self.guard

    def refusals(self) -> dict:
        """Installs the real runner refuses: the message, and whether the runner kept its own
        functions."""
        r = self.e.runner
        own = lambda: (r.model_fn, r.model.step_fn_no_options,  # noqa: E731
                       r.persistent_batch_manager.update_states, r.__dict__.get(
                           "_execute_continue_decode"), len(r.kv_caches))
        before, out = own(), {}
        kvs = list(r.kv_caches)
        narrow = jax.device_put(np.zeros((kvs[1].shape[0] // 2, *kvs[1].shape[1:]),
                                         kvs[1].dtype), kvs[1].sharding)
        for name, kwargs in (("layer", dict(layer=2)), ("k_heads", dict(k_heads=3)),
                             ("real_data", dict(real_data="some")),
                             ("coverage_no_sweep", dict(coverage_window=4)),
                             ("coverage_negative", dict(coverage_window=-1, sweep_interval=2)),
                             ("coverage_layers", dict(coverage_window=4, sweep_interval=2)),
                             ("forbid_compile", {})):
            if name == "coverage_layers":  # a second layer of another shape
                r.kv_caches[1] = narrow
            forbid, compilation = r.maybe_forbid_compile, r.compilation_manager
            if name == "forbid_compile":  # what VLLM_XLA_CHECK_RECOMPILATION=1 gives the runner
                from tpu_inference.runner.utils import ForbidCompile
                r.maybe_forbid_compile = ForbidCompile()
                # ... on a runner whose warm-up the guard cannot reach for the decode loop
                r.compilation_manager = None
            try:
                kti.install(r, **kwargs).uninstall()
                out[name] = None
            except (ValueError, NotImplementedError) as e:
                out[name] = {"error": str(e), "untouched": own() == before}
            finally:
                r.kv_caches[:] = kvs
                r.maybe_forbid_compile, r.compilation_manager = forbid, compilation
        return out

    def remediate(self, report) -> None:
        self.reports.append((report.violation.slot, report.request))
        self.rem(report)

    def stamps(self, slots, shard: int = 0) -> list[tuple[int, int]]:
        """(token, position) stamped in ``slots`` of a shard's HEAD K buffer."""
        buf = np.asarray(self.guard.state.bufs["HEAD_K_FULL"])[shard]
        return [tuple(int(x) for x in buf[s].view(np.int64)[:2]) for s in slots]

    def step(self, name: str):
        before = kti.violation_counts(self.guard)
        out = self.e.scheduler.schedule()
        if self.tamper is not None:
            self.tamper(out)
            self.tamper = None
        self.preempted.update(getattr(out, "preempted_req_ids", ()) or ())
        self.last_ranks = dict(getattr(out, "assigned_dp_rank", None) or {})
        for nr in out.scheduled_new_reqs:
            self.prefix_hits[nr.req_id] = nr.num_computed_tokens
        result = self.e.runner.execute_model(out)
        if result is None:
            result = self.e.runner.sample_tokens(None)
        for eo in self.e.scheduler.update_from_output(out, result).values():
            for o in eo.outputs:
                self.e.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
        self.guard.manager.flush()
        found = kti.read_violations(self.guard, start=before)
        self.log.append({"step": name, "scheduled": dict(out.num_scheduled_tokens),
                         "new_violations": rows(found)})
        return found

    def prefix_hits_and_loops(self) -> None:
        """Two requests sharing a 16-token block in the step that fills it (a same-step prefix
        hit), their decode through the on-device loop, then a request hitting the cached
        block."""
        prefix = list(range(100, 116))
        self.e.add("a", prefix + [7, 8, 9, 10], 9)
        self.e.add("b", prefix + [20, 21], 5)
        self.run("a b")
        self.e.add("c", prefix + [30, 31, 32], 3)
        self.run("c")

    def run(self, name: str, limit: int = 40):
        found = []
        n = 0
        while self.e.scheduler.has_requests() and n < limit:
            found += self.step(f"{name} {n}")
            n += 1
        return found

    def slot(self, req_id: str, position: int) -> int:
        """The slot of a request's position, in its data-parallel rank's own numbering."""
        blocks = self.e.runner.requests[req_id].block_ids[0]
        return blocks[position // R.BLOCK_SIZE] * R.BLOCK_SIZE + position % R.BLOCK_SIZE

    def flip(self, slot: int, element: int = 3, rank: int = 0) -> None:
        """Flips a bit of one bf16 element of the canary layer's row at a rank's ``slot``
        (element ``e`` of the row ``[head rows, packing, lanes]``: combined head ``e // lanes``
        for head_dim 128, K lanes 0..63 / V lanes 64..127 of head ``e // 128`` for 64)."""
        idx = self.guard.canary.layer_index
        kv = self.e.runner.kv_caches[idx]
        flat = kv.reshape(-1, *kv.shape[2:])
        at = rank * (flat.shape[0] // self.dp_size) + slot
        b = np.asarray(flat[at]).view(np.uint16).copy()
        b.reshape(-1)[element] ^= 0x0100
        new = flat.at[at].set(np.frombuffer(b.tobytes(), dtype=kv.dtype).reshape(flat.shape[1:]))
        self.e.runner.kv_caches[idx] = jax.device_put(new.reshape(kv.shape), kv.sharding)


def real_data_modes(life: Life) -> dict:
    """Per real-KV mode, a fresh guard and a request whose prefill is followed by three flipped
    bits: K_0's element 3 (inside the first 16 bytes of the strip ``partial`` fingerprints),
    K_0's element 40 (past them) and V_0's element 3 (no mode covers V); then its decode loop."""
    lanes = 128
    v0 = 64 + 3 if life.guard.canary.layout.kind == "rpa_v3_hd64" else lanes + 3
    flips = {2: 3, 4: 40, 6: v0}  # position -> element of the slot's row
    found = {}
    for i, mode in enumerate(("all", "partial", "none")):
        life.install(mode)
        name = f"m_{mode}"
        life.e.add(name, [10 + 20 * i + k for k in range(12)], 6)
        life.step(f"{name} prefill")
        slots = {p: life.slot(name, p) for p in flips}
        for p, element in flips.items():
            life.flip(slots[p], element)
        found[mode] = {"slots": {str(p): s for p, s in slots.items()},
                       "found": rows(life.step(f"{name} decode, flipped K and V bits")),
                       "loop_steps": life.log[-1]["scheduled"][name],
                       "real_kv_hash_mode": life.guard.canary.real_kv_hash_mode}
        life.run(f"{name} rest")
    return found


def dp_main() -> None:
    """Data parallelism 2 on two CPU devices, tpu-inference's DPScheduler (a vLLM scheduler
    per rank, each in a process of its own, each with half the blocks): the prompts served
    bare, then again guarded (the same outputs, no violation, both ranks' canaries at work);
    a flipped K bit on rank 1; a wrong block-table entry on rank 0 naming a block id that a
    request of rank 1 holds (each rank numbers its blocks from 0)."""
    life = Life(128, num_blocks=28, dp_size=2, guarded=False)
    e, out = life.e, {"dp_size": life.e.runner.dp_size}
    prefix = list(range(100, 116))
    prompts = {"a": prefix + [7, 8, 9, 10], "b": [200 + k for k in range(18)],
               "c": prefix + [30, 31, 32], "d": [260 + k for k in range(5)]}
    for name, prompt in prompts.items():
        e.add(name, prompt, 6)
    e.run()
    out["bare"] = {name: e.outputs[name] for name in prompts}
    out["reset"] = bool(e.scheduler.reset_prefix_cache())
    life.install("all")
    out["num_shards"] = life.guard.canary.num_shards
    ranks = {}
    for name, prompt in prompts.items():
        e.add(name + "'", prompt, 6)
    while e.scheduler.has_requests():
        life.step("guarded")
        ranks.update(life.last_ranks)
    out["guarded"] = {name: e.outputs[name + "'"] for name in prompts}
    out["ranks"] = ranks
    out["clean_total"] = kti.violation_counts(life.guard).tolist()
    out["slot_runs"] = np.asarray(life.guard.state.slot_run_counters).sum(axis=1).tolist()
    out["life"] = life.log
    faults = out["faults"] = {}

    # --- a flipped K bit at position 3 of the request on rank 1
    e.add("f0", [300 + k for k in range(20)], 6)
    e.add("f1", [330 + k for k in range(20)], 6)
    life.step("f prefill")
    at = {r: n for n, r in life.last_ranks.items()}
    s = life.slot(at[1], 3)
    life.flip(s, rank=1)
    reports = len(life.reports)
    faults["flip"] = {"request": at[1], "slot": s, "position": 3,
                      "found": rows(life.step("f decode, flipped bit")),
                      "requests": sorted({str(r) for _, r in life.reports[reports:]}),
                      "aborted": list(life.rem.aborted), "evicted": list(life.rem.evicted)}
    life.run("f rest")

    # --- rank 0's request t0 reads its positions 16..31 from the block id that rank 1's t1
    # holds for its own positions 16..31: on rank 0 that id is another block
    e.add("t0", [380 + k for k in range(36)], 6)
    e.add("t1", [420 + k for k in range(36)], 6)
    life.step("t prefill")
    at = {r: n for n, r in life.last_ranks.items()}
    bt = e.runner.input_batch.block_table[0]
    row = e.runner.input_batch.req_id_to_index[at[0]]
    right = int(bt.block_table_cpu[row, 1])
    wrong = int(e.runner.requests[at[1]].block_ids[0][1])
    held = life.stamps(range(wrong * R.BLOCK_SIZE, (wrong + 1) * R.BLOCK_SIZE), shard=0)
    bt.block_table_cpu[row, 1] = wrong
    reports, aborted, evicted = len(life.reports), len(life.rem.aborted), len(life.rem.evicted)
    found = life.step("t decode, wrong table entry")
    bt.block_table_cpu[row, 1] = right
    faults["table"] = {"tampered": at[0], "holder": at[1], "right": right, "wrong": wrong,
                       "held": held, "after": life.slot(at[0], 2 * R.BLOCK_SIZE),
                       "loop_steps": life.log[-1]["scheduled"][at[0]], "found": rows(found),
                       "requests": [r if isinstance(r, (str, type(None))) else [list(x) for x in r]
                                    for _, r in life.reports[reports:]],
                       "aborted": life.rem.aborted[aborted:],
                       "evicted": life.rem.evicted[evicted:]}
    life.run("t rest")
    e.scheduler.shutdown()
    print(json.dumps(out))


def raise_main() -> None:
    """Mode "raise", every step a plain model step (no decode loop): a K byte of a slot the
    request reads flipped; the step whose readback reports it raises from ``runner.model_fn``,
    after the step donated the runner's KV."""
    from kvcanary_jax.runtime import CanaryViolationError

    e = R.Engine(num_blocks=16, continue_decode=False)
    runner = e.runner
    guard = kti.install(runner, mode="raise", real_data="all", sweep_interval=1)
    e.add("r", list(range(100, 132)) + [7, 8], 40)
    e.step()
    e.step()
    kv = np.asarray(runner.kv_caches[0]).copy()
    block = int(runner.requests["r"].block_ids[0][0])
    kv.view(np.uint16)[block, 3].reshape(-1)[3] ^= 0x0100
    runner.kv_caches[0] = jax.device_put(kv, runner.kv_caches[0].sharding)
    out, steps = {"raised": None}, 0
    while e.scheduler.has_requests() and steps < 12:
        steps += 1
        try:
            e.step()
        except CanaryViolationError as err:
            out = {"raised": type(err).__name__, "steps": steps,
                   "kv_attached": err.kv is not None and not any(a.is_deleted() for a in err.kv),
                   "reasons": sorted({r for rep in err.reports for r in rep.violation.reasons})}
            break
    out["runner_kv_live"] = not any(a.is_deleted() for a in runner.kv_caches)
    print(json.dumps(out))


def _tails(guard) -> int:
    """TAILs run so far (the coverage step counter: each step of a decode loop is one)."""
    return int(np.asarray(guard.state.coverage.step).max())


def _report(guard) -> dict:
    r = guard.coverage()
    return {"window": r.window, "sweep_interval": r.sweep_interval, "share": r.share,
            "live_bytes": r.live_bytes, "verified_bytes": r.verified_bytes,
            "read_bytes": r.read_bytes, "bytes_per_slot": r.groups["FULL"].bytes_per_slot,
            "violations": r.violations}


def coverage_main(head_dim: int, flips: int, seed: int) -> None:
    """The coverage window (every layer's K and V digested; window 4, the guard's sweep every 2
    calls, the manager's launch-health check as often): a clean life (a same-step prefix hit,
    the decode loop, a later prefix hit, the sweep) with its coverage report, then a campaign of
    ``flips`` single-bit flips, each in a random byte of a random layer's row (K or V, any head)
    of a random slot: alternately one that running requests read at every step (``used``) and
    one of a cached block no request reads (``cached``). After each flip the life steps until a
    violation names the slot (at most 3 calls), records when, and flips the bit back (unless
    vLLM handed the block out again and a request overwrote the row: recorded, never expected).
    Running requests are replaced as they finish; their blocks stay cached (the cache has room
    for every request's blocks, so vLLM takes never-used blocks before cached ones)."""
    window, interval = 4, 2
    life = Life(head_dim, num_blocks=256, guarded=False)
    e = life.e
    # Launch health checked every `interval` calls: each check must see the SWEEP launches of
    # the sweep the guard ran in its last call (a check that did not would fail the life).
    life.guard = kti.install(e.runner, mode="log", real_data="all", coverage_window=window,
                             sweep_interval=interval, health_check_every_n_steps=interval,
                             health_check_warmup_steps=0)
    guard = life.guard
    out = {"head_dim": head_dim, "layers": len(e.runner.kv_caches),
           "row_bytes": guard.canary.layout.row_elems * guard.canary.layout.itemsize}
    life.prefix_hits_and_loops()
    guard.sweep()
    guard.manager.flush()
    out["clean_total"] = kti.violation_counts(guard).tolist()
    out["clean_report"] = _report(guard)
    out["prefix_hits"] = dict(life.prefix_hits)

    rng = np.random.default_rng(seed)
    vocab = 512
    made = [0]

    def top_up():
        running = [r for r in e.runner.requests if r in e.scheduler.requests]
        while len(running) < 2:
            name = f"L{made[0]}"
            made[0] += 1
            e.add(name, rng.integers(3, vocab, 20).tolist(), 96)
            running.append(name)

    top_up()
    life.step("L prefill")
    life.step("L decode")
    kvs = e.runner.kv_caches
    row_bytes = out["row_bytes"]
    campaign = out["campaign"] = []
    def running():
        return [r for r in e.runner.requests if r in e.scheduler.requests
                and e.runner.requests[r].num_computed_tokens > 1]

    for k in range(flips):
        top_up()
        while not running():  # the new requests' prefill
            life.step(f"flip {k}, prefill")
            top_up()
        live = running()
        held = {int(b) for r in e.runner.requests if r in e.scheduler.requests
                for b in e.runner.requests[r].block_ids[0]}
        cached = sorted({b for chain in guard.cached.prefixes(0) for b in chain} - held)
        kind = "cached" if k % 2 and cached else "used"
        if kind == "used":
            req = live[int(rng.integers(len(live)))]
            pos = int(rng.integers(0, e.runner.requests[req].num_computed_tokens - 1))
            slot = life.slot(req, pos)
        else:
            block = cached[int(rng.integers(len(cached)))]
            slot = block * R.BLOCK_SIZE + int(rng.integers(R.BLOCK_SIZE))
        layer, byte, bit = (int(rng.integers(len(kvs))), int(rng.integers(row_bytes)),
                            int(rng.integers(8)))
        flipped = _flip_bit(e.runner, layer, slot, byte, bit)
        tails0, calls, found, rows_k = _tails(guard), [], False, []
        while not found and len(calls) < 3:
            before = _tails(guard)
            got = rows(life.step(f"flip {k}"))
            calls.append({"tails_before": before - tails0, "tails_after": _tails(guard) - tails0})
            rows_k += got
            found = any(r["slot"] == slot and "KV_DIGEST_MISMATCH" in r["reasons"] for r in got)
        overwritten = not np.array_equal(_row(e.runner, layer, slot), flipped)
        if not overwritten:
            _flip_bit(e.runner, layer, slot, byte, bit)  # back as it was
        campaign.append({"kind": kind, "slot": slot, "layer": layer, "byte": byte, "bit": bit,
                         "calls": calls, "found": found, "rows": rows_k,
                         "overwritten": overwritten})
    after = kti.violation_counts(guard).tolist()
    life.run("L rest", limit=60)
    guard.sweep()
    guard.manager.flush()
    out["after_campaign"] = {"before": after, "end": kti.violation_counts(guard).tolist()}
    out["end_report"] = _report(guard)
    print(json.dumps(out))


def trust_main() -> None:
    """What an operator does around a guard with a coverage window (4, the sweep every 2
    calls), besides serving: a second install over the guarded runner; the guard's readers and
    sweeps called from another thread while the main one serves (prefill, same-step and later
    prefix hits, the decode loop); a bit flipped in a cached block of layer 1 and found by a
    sweep called by hand, then ``flush()``; ``uninstall()`` twice; an install again over the
    warm prefix cache; a decode loop failing on the device after it took the carried state."""
    import threading

    window, interval = 4, 2
    life = Life(128, num_blocks=64, guarded=False)
    e, r = life.e, life.e.runner
    own = lambda: (r.model_fn, r.model.step_fn_no_options,  # noqa: E731
                   r.persistent_batch_manager.update_states,
                   r.__dict__.get("_execute_continue_decode"),
                   vars(r.compilation_manager).get("_precompile_continue_decode"))
    bare = own()
    life.install("all", coverage_window=window, sweep_interval=interval)
    g = life.guard
    out = {}
    guarded = own()
    try:
        kti.install(r, coverage_window=window, sweep_interval=interval)
        out["second_install"] = None
    except ValueError as err:
        out["second_install"] = {"error": str(err), "untouched": own() == guarded}

    errors, stop = [], threading.Event()
    calls = {"coverage": 0, "violation_counts": 0, "manager_coverage": 0, "sweep": 0}
    readers = [("coverage", g.coverage), ("violation_counts", lambda: kti.violation_counts(g)),
               ("manager_coverage", g.manager.coverage), ("sweep", g.sweep)]

    def reader():
        k = 0
        while not stop.is_set():
            name, call = readers[k % len(readers)]
            try:
                call()
                calls[name] += 1
            except Exception as err:  # noqa: BLE001  (every failure is the finding)
                errors.append(f"{name}: {type(err).__name__}: {err}"[:300])
            k += 1

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        life.prefix_hits_and_loops()
        for i in range(3):
            e.add(f"t{i}", [400 + 10 * i + k for k in range(24)], 12)
        life.run("t")
    finally:
        stop.set()
        thread.join()
    g.manager.flush()
    out["threads"] = {"errors": errors[:5], "n_errors": len(errors), "calls": calls,
                      "total": kti.violation_counts(g).tolist(), "share": g.coverage().share,
                      "loops": sum(1 for s in life.log if s["scheduled"] and all(
                          n == 4 for n in s["scheduled"].values()))}

    reports = len(life.reports)
    cached = sorted({b for chain in g.cached.prefixes(0) for b in chain})
    slot = cached[len(cached) // 2] * R.BLOCK_SIZE + 5
    _flip_bit(r, 1, slot, 37, 3)
    g.sweep()
    g.manager.flush()
    out["manual_sweep"] = {"slot": slot, "reported": [s for s, _ in life.reports[reports:]],
                           "manager_coverage": g.manager.coverage() is not None}
    _flip_bit(r, 1, slot, 37, 3)

    g.uninstall()
    g.uninstall()
    out["uninstall_twice"] = {"restored": own() == bare,
                              "marker": "_kvcanary_guard" in vars(r)}
    # A sweep through the uninstalled guard (a periodic thread holding it): its books stopped
    # following vLLM's blocks, which other requests' KV fills from here on. Refused: before,
    # it swept them all as corrupted, and a Remediator evicted healthy blocks.
    try:
        g.sweep()
        out["sweep_after_uninstall"] = "ran"
    except RuntimeError as err:
        out["sweep_after_uninstall"] = str(err)

    # Installed again over the warm prefix cache (not reset): KV the first guard's life wrote
    # has no canary in the new one, and requests hitting it must not be reported; a block one
    # of them writes after the install is guarded (a flip in it is found by a sweep).
    olds = []  # the guard's warnings that a step reads KV written before its canary

    class Olds(logging.Handler):
        def emit(self, record):
            if "written before the canary started" in record.getMessage():
                olds.append(record.getMessage())

    logging.getLogger("kvcanary_jax.integrations.tpu_inference.guard").addHandler(Olds())
    life.guard = None
    life.install("all", coverage_window=window, sweep_interval=interval)
    g = life.guard
    reports = len(life.reports)
    e.add("w0", list(range(100, 116)) + [41, 42, 43], 20)  # a's cached block, then its own
    e.add("w1", [400 + k for k in range(24)] + [5], 6)  # t0's first block
    life.step("w prefill")
    own = life.slot("w0", 17)
    life.run("w")
    g.sweep()
    g.manager.flush()
    clean = {"hits": {k: life.prefix_hits.get(k) for k in ("w0", "w1")},
             "counts": kti.violation_counts(g).tolist(), "share": g.coverage().share,
             "reported": [s for s, _ in life.reports[reports:]], "warned": len(olds)}
    _flip_bit(r, 1, own, 37, 3)
    g.sweep()
    g.manager.flush()
    out["warm_reinstall"] = dict(clean, own=own,
                                 found=[s for s, _ in life.reports[reports:]])
    _flip_bit(r, 1, own, 37, 3)
    loop = g._orig["continue"]
    restarts = []  # the guard's warnings that its canary starts afresh

    replaced = []  # the manager's warnings of a state swapped unannounced (none: a restart
    # hands the manager its fresh state as such)

    class Restarts(logging.Handler):
        def emit(self, record):
            if "starts afresh" in record.getMessage():
                restarts.append(record.getMessage()[:80])
            if "state was replaced" in record.getMessage():
                replaced.append(record.getMessage()[:120])

    logging.getLogger("kvcanary_jax.integrations.tpu_inference.guard").addHandler(Restarts())
    logging.getLogger("kvcanary_jax.runtime.manager").addHandler(Restarts())

    def failing(scheduler_output):  # what a device failure mid-loop leaves: the carry gone
        for leaf in jax.tree.leaves(r.kv_caches[-1].state):
            leaf.delete()
        raise RuntimeError("injected: the decode loop failed on the device")

    e.add("x", list(range(500, 520)), 12)
    raised = None
    for n in range(6):
        if n == 1:
            g._orig["continue"] = failing
        try:
            life.step(f"x {n}")
        except RuntimeError as err:
            raised = str(err)
            break
    g._orig["continue"] = loop
    counts = kti.violation_counts(g).tolist()
    out["loop_failure"] = {"raised": raised, "counts": counts,
                           "carried_left": any(isinstance(c, kti.Carried) for c in r.kv_caches),
                           "kv_arrays": len(r.kv_caches),
                           "manager_coverage": g.manager.coverage() is not None}

    def failing_tail(state, *args, **kwargs):  # a plain step failing on the device after
        for leaf in jax.tree.leaves(state):        # its TAIL took the state
            leaf.delete()
        raise RuntimeError("injected: the step failed on the device")

    from vllm.v1.request import RequestStatus

    e.scheduler.finish_requests("x", RequestStatus.FINISHED_ABORTED)
    jit, g._tail_jit = g._tail_jit, failing_tail
    e.add("z", list(range(700, 720)), 4)
    try:
        life.step("z prefill")
        raised = None
    except RuntimeError as err:
        raised = str(err)
    g._tail_jit = jit
    out["step_failure"] = {"raised": raised, "counts": kti.violation_counts(g).tolist(),
                           "manager_coverage": g.manager.coverage() is not None}
    # Serving on, the failed requests aborted: a new request served clean and covered.
    e.scheduler.finish_requests("z", RequestStatus.FINISHED_ABORTED)
    e.add("y", list(range(600, 630)), 8)
    life.run("y")
    g.sweep()
    g.manager.flush()
    out["served_on"] = {"counts": kti.violation_counts(g).tolist(), "share": g.coverage().share,
                        "restarts": restarts, "replaced": replaced}

    # A client sends an id again as soon as its request finished. The old request's last step
    # read a flipped byte; its rows are read back a step late, in the new request's first step:
    # reported for the old request, which the Remediator cannot abort any more, and the new
    # one, which read nothing of that step, served to its end.
    reports, aborted = len(life.reports), len(life.rem.aborted)
    e.add("q", list(range(800, 820)), 2)
    e.step()  # the prefill, its first token sampled
    slot = life.slot("q", 5)
    life.flip(slot)
    e.step()  # its last decode reads the flipped slot; "q" finishes
    e.add("q", list(range(900, 920)), 6)
    new_q = e.step()  # the new "q"'s prefill; the old one's rows read back
    life.run("q again")
    g.manager.flush()
    out["recycled_id"] = {
        "slot": slot, "aborted": life.rem.aborted[aborted:], "outputs": len(e.outputs["q"]),
        "new": [nr.req_id for nr in new_q.scheduled_new_reqs],
        "reported": sorted({(s, str(q), getattr(q, "incarnation", None))
                            for s, q in life.reports[reports:] if q is not None})}
    e.scheduler.shutdown()
    print(json.dumps(out))


def warm_up_main(dp_size: int = 1, forbid: bool = False) -> None:
    """A guard installed before the runner's own warm-up (``capture_model()``, which calls
    ``model_fn`` once per token bucket), then serving: prefills of several token buckets, a
    same-step prefix hit (the late split), decodes, a prompt longer than a step (chunked), a
    flipped K byte. Every call of the canary's jits counts the lowerings it missed (what
    ``VLLM_XLA_CHECK_RECOMPILATION`` watches): none may happen while serving. ``forbid``: the
    runner steps inside its own ``ForbidCompile`` (``VLLM_XLA_CHECK_RECOMPILATION=1``, which
    raises on any compilation inside a step): the whole life, the on-device decode loop,
    readbacks and sweeps included, compiles nothing inside a step."""
    import threading
    import time

    from jax._src.interpreters import pxla

    from tpu_inference import envs

    life = Life(128, num_blocks=40 * dp_size, guarded=False, dp_size=dp_size)
    e, r = life.e, life.e.runner
    if forbid:
        from tpu_inference.runner.utils import ForbidCompile
        r.maybe_forbid_compile = ForbidCompile()
    # Under the runner's check, with a coverage window and the stats line every step: the
    # readback's coverage count and coverage()'s are compiled in the warm-up too.
    life.install("all", sweep_interval=3, **(
        dict(coverage_window=4, stats_print_every_n_steps=1) if forbid else {}))
    g = life.guard
    out = {"paddings": list(r.num_tokens_paddings)}
    # An operator's thread sweeping while the runner warms up: each warm-up call donates the
    # KV, and the guard hands the new arrays to the runner before it lets the sweep in.
    stop, sweeps, errors = threading.Event(), [0], []

    def sweeper():
        while not stop.is_set():
            try:
                g.sweep()
                sweeps[0] += 1
            except Exception as err:  # noqa: BLE001  (reported, not raised, in this thread)
                errors.append(f"{type(err).__name__}: {err}")
            time.sleep(0.005)

    thread = threading.Thread(target=sweeper)
    os.environ["SKIP_JAX_PRECOMPILE"] = "0"
    thread.start()
    try:
        r.capture_model()
    finally:
        stop.set()
        thread.join()
        os.environ["SKIP_JAX_PRECOMPILE"] = "1"
    out["sweeps_during_warm_up"], out["sweep_errors"] = sweeps[0], errors[:3]
    out["skip_precompile"] = bool(envs.SKIP_JAX_PRECOMPILE)
    out["warmed"] = len(g._warmed)
    compiles = {"delta": 0, "head": 0, "tail": 0, "sweep": 0}
    calls = dict.fromkeys(compiles, 0)
    splits = []

    def misses():  # the cache's own count (inside ForbidCompile, under its wrapper)
        cached = pxla._cached_lowering_to_hlo
        return getattr(cached, "__wrapped__", cached).cache_info().misses

    def counted(name, fn):
        def call(*args, **kwargs):
            if name == "head":
                splits.append(kwargs["split"])
            before = misses()
            try:
                return fn(*args, **kwargs)
            finally:
                calls[name] += 1
                compiles[name] += misses() - before
        return call

    own, keywords = g._orig["model_fn"], set()

    def runner_step(*args, **kwargs):  # the runner's own step, as the guard calls it
        keywords.update(kwargs)
        return own(*args, **kwargs)

    g._orig["model_fn"] = runner_step
    g._delta_jit = counted("delta", g._delta_jit)
    g._head_jit = counted("head", g._head_jit)
    g._tail_jit = counted("tail", g._tail_jit)
    g._sweep_jit = counted("sweep", g._sweep_jit)
    own_loop = g._orig["continue"]

    def loop(*args, **kwargs):  # the runner's own decode loop, as the guard calls it
        calls["loop"] += 1
        return own_loop(*args, **kwargs)

    calls["loop"] = 0
    g._orig["continue"] = loop
    life.prefix_hits_and_loops()  # a same-step prefix hit, then a later one
    e.add("long", [300 + k for k in range(100)], 6)  # chunked over steps of 64 tokens
    e.add("short", [200 + k for k in range(5)], 20)
    life.run("long short")
    e.add("m", [250 + k for k in range(20)], 4)
    life.step("m prefill")
    s = life.slot("m", 3)
    life.flip(s)
    found = life.run("m flipped")
    g.manager.flush()
    out.update(forbid=type(r.maybe_forbid_compile).__name__, loops=r.enable_continue_decode,
               warmed_loop=g._warmed_loop)
    out.update(compiles=compiles, calls=calls, splits=sorted(set(splits)),
               runner_keywords=sorted(keywords),
               tokens=sorted({sum(x["scheduled"].values()) for x in life.log}),
               found=rows(found), flipped=s, violations=kti.violation_counts(g).tolist())
    if forbid:
        # A metrics thread's coverage() while a step runs (the runner's check is on for the
        # whole process then) compiles nothing.
        try:
            with r.maybe_forbid_compile:
                out["coverage_during_a_step"] = g.coverage().share
        except RuntimeError as err:
            out["coverage_during_a_step"] = str(err)
        # Last (the runner's step fails, and vLLM's scheduler is left with it): a step whose
        # shapes the warm-up did not compile (as after an install past the warm-up) is refused
        # before the guard launches anything; its state is the one it had.
        before = jax.tree.map(np.asarray, g.state)

        def refused(name, call):  # the error ``call`` raised, and whether the state was kept
            try:
                call()
                out[f"{name}_error"] = None
            except RuntimeError as err:
                out[f"{name}_error"] = str(err)
            out[f"{name}_state_kept"] = all(
                np.array_equal(a, np.asarray(b)) for a, b in zip(
                    jax.tree.leaves(before), jax.tree.leaves(g.state)))

        warmed, g._warmed = g._warmed, set()
        e.add("late", [400 + k for k in range(5)], 3)
        refused("unwarmed", lambda: life.step("unwarmed"))
        g._warmed = warmed
        # The same for the decode loop (a guard whose loop the warm-up did not reach).
        g._warmed_loop = False
        refused("unwarmed_loop", lambda: g._guarded_continue_decode(None))
        g._warmed_loop = True
    print(json.dumps(out))


def forbid_uninstall_main() -> None:
    """Under the runner's ``ForbidCompile`` (``VLLM_XLA_CHECK_RECOMPILATION=1``): a guard
    installed before ``capture_model()`` serves the on-device decode loop, then is uninstalled;
    the runner serves on, its own decode loop included, and nothing compiles inside its check
    (the guard's loop warm-up compiled the runner's own loop as well)."""
    from tpu_inference.runner.utils import ForbidCompile

    life = Life(128, num_blocks=40, guarded=False)
    e, r = life.e, life.e.runner
    r.maybe_forbid_compile = ForbidCompile()
    life.install("all")
    os.environ["SKIP_JAX_PRECOMPILE"] = "0"
    try:
        r.capture_model()
    finally:
        os.environ["SKIP_JAX_PRECOMPILE"] = "1"
    g, loops = life.guard, {"guarded": 0, "own": 0}
    guarded = g._orig["continue"]

    def guarded_loop(*args, **kwargs):
        loops["guarded"] += 1
        return guarded(*args, **kwargs)

    g._orig["continue"] = guarded_loop
    life.prefix_hits_and_loops()
    g.manager.flush()
    out = {"violations": kti.violation_counts(g).tolist()}
    g.uninstall()
    own = r._execute_continue_decode  # the runner's own method again

    def own_loop(*args, **kwargs):
        loops["own"] += 1
        return own(*args, **kwargs)

    r._execute_continue_decode = own_loop
    e.add("u1", [100 + k for k in range(20)], 9)
    e.add("u2", [50 + k for k in range(20)], 9)
    out.update(steps=len(e.run(40)), loops=loops,
               outputs={k: len(e.outputs.get(k, ())) for k in ("u1", "u2")})
    print(json.dumps(out))


def _row(runner, layer: int, slot: int) -> np.ndarray:
    """``slot``'s row of ``runner.kv_caches[layer]`` as bytes (one data shard)."""
    host = np.asarray(runner.kv_caches[layer])
    return host.reshape(host.shape[0] * host.shape[1], -1).view(np.uint8)[slot].copy()


def _flip_bit(runner, layer: int, slot: int, byte: int, bit: int) -> np.ndarray:
    """Flips bit ``bit`` of byte ``byte`` of ``slot``'s row in ``runner.kv_caches[layer]``
    (one data shard); returns the row's bytes after."""
    kv = runner.kv_caches[layer]
    host = np.asarray(kv).copy()
    rows_ = host.reshape(host.shape[0] * host.shape[1], -1).view(np.uint8)
    rows_[slot, byte] ^= np.uint8(1 << bit)
    runner.kv_caches[layer] = jax.device_put(host, kv.sharding)
    return rows_[slot].copy()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--raise-mode", action="store_true")
    ap.add_argument("--coverage-flips", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trust", action="store_true")
    ap.add_argument("--warm-up", action="store_true")
    ap.add_argument("--forbid-compile", action="store_true")
    ap.add_argument("--forbid-uninstall", action="store_true")
    args = ap.parse_args()
    if args.forbid_uninstall:
        return forbid_uninstall_main()
    if args.warm_up:
        return warm_up_main(args.dp, args.forbid_compile)
    if args.raise_mode:
        return raise_main()
    if args.trust:
        return trust_main()
    if args.coverage_flips:
        return coverage_main(args.head_dim, args.coverage_flips, args.seed)
    if args.dp > 1:
        return dp_main()
    life = Life(args.head_dim, num_blocks=14)
    e, out = life.e, {"head_dim": args.head_dim}
    out["xla_flags"] = {"before": _env_before, "after": _env_after}
    out["layout"] = life.guard.canary.layout.kind
    out["layers"] = list(life.guard.layers)
    out["num_shards"] = life.guard.canary.num_shards
    out["refused"] = life.refused
    prefix = list(range(100, 116))

    # --- the clean life
    life.prefix_hits_and_loops()
    if args.head_dim == 128:
        for i, r in enumerate(("p", "q", "r")):
            e.add(r, [200 + 10 * i + k for k in range(40)], 40)
        life.run("p q r", limit=80)
    life.guard.sweep()
    life.guard.manager.flush()
    out["clean_total"] = kti.violation_counts(life.guard).tolist()
    out["life"] = life.log
    out["prefix_hits"] = life.prefix_hits
    out["preempted"] = sorted(life.preempted)
    out["loops"] = sum(1 for s in life.log if s["scheduled"] and all(
        n == 4 for n in s["scheduled"].values()))
    out["outputs"] = e.outputs
    out["cached_chains"] = [list(c) for c in life.guard.cached.prefixes(0)]
    faults = out["faults"] = {}

    # --- a flipped K byte in a slot a running request reads (position 3); before it, f's
    # prefill called again through runner.model_fn, update_states not run again
    e.add("f", [300 + k for k in range(20)], 6)
    kept, guarded = [], e.runner.model_fn
    e.runner.model_fn = lambda *a, **k: (kept.append((a, k)), guarded(*a, **k))[1]
    life.step("f prefill")
    e.runner.model_fn = guarded
    ((call, call_kwargs),) = kept
    before = (life.guard.steps, kti.violation_counts(life.guard).tolist())
    replayed = e.runner.model_fn(call[0], e.runner.kv_caches, *call[2:], **call_kwargs)
    e.runner.kv_caches = list(replayed[0])
    faults["replay"] = {"before": before, "after": (life.guard.steps,
                                                    kti.violation_counts(life.guard).tolist())}
    s = life.slot("f", 3)
    life.flip(s)
    faults["flip"] = {"slot": s, "position": 3, "found": rows(life.step("f decode"))}
    life.run("f rest")
    if args.head_dim != 128:
        faults["real_data"] = real_data_modes(life)
        print(json.dumps(out))
        return

    # --- a wrong block-table entry (block 1 of g, positions 16..31) for one step
    e.add("g", [400 + k for k in range(36)], 6)
    life.step("g prefill")
    bt = e.runner.input_batch.block_table[0]
    row = e.runner.input_batch.req_id_to_index["g"]
    right = int(bt.block_table_cpu[row, 1])
    g_blocks = [int(b) for b in e.runner.requests["g"].block_ids[0]]
    wrong = next(b for b in range(1, e.runner.kv_caches[0].shape[0]) if b not in g_blocks)
    held = life.stamps(range(wrong * R.BLOCK_SIZE, (wrong + 1) * R.BLOCK_SIZE))
    bt.block_table_cpu[row, 1] = wrong
    reports, evicted = len(life.reports), len(life.rem.evicted)
    found = life.step("g decode, wrong table entry")
    bt.block_table_cpu[row, 1] = right
    faults["table"] = {"right": right, "wrong": wrong, "held": held,
                       "after": life.slot("g", 2 * R.BLOCK_SIZE), "found": rows(found),
                       "loop_steps": life.log[-1]["scheduled"]["g"],
                       "requests": sorted({str(r) for _, r in life.reports[reports:]}),
                       "evicted": life.rem.evicted[evicted:],
                       "aborted": "g" in life.rem.aborted}
    life.run("g rest")

    # --- a stale block reused: h fills a block with other tokens; i, hitting the cached block
    # of ``prefix``, is handed h's block instead (the scheduler's output altered)
    e.add("j", [60 + k for k in range(16)] + [1, 2], 2)
    life.run("j")
    e.add("h", [450 + k for k in range(16)] + [1, 2], 2)
    life.step("h prefill")
    h_block = int(e.runner.requests["h"].block_ids[0][0])
    life.run("h rest")
    e.add("i", [60 + k for k in range(16)] + [40, 41], 2)
    stale = faults["stale"] = {"stale_block": h_block}

    def swap(sched_out):
        for nr in sched_out.scheduled_new_reqs:
            if nr.req_id == "i":
                stale["right_block"], stale["computed"] = nr.block_ids[0][0], nr.num_computed_tokens
                nr.block_ids[0][0] = h_block

    life.tamper = swap
    found = life.step("i prefill, stale block")
    stale.update(found=rows(found), aborted="i" in life.rem.aborted,
                 evicted=list(life.rem.evicted))
    life.run("i rest")

    # --- the EOS lead: w learns the loop's tokens; w0 (interval 0) and w1 (interval 1) stop
    # at the second token the loop samples
    q = [480 + k for k in range(12)]
    e.add("w", q, 6)
    life.run("w")
    t = e.outputs["w"]
    pad = int(e.runner.pad_token_id)
    faults["eos"] = {"tokens": t, "pad": pad}
    for name, interval in (("w1", 1), ("w0", 0)):
        e.runner.eos_token_id = (t[2],)
        e.runner.continue_decode_eos_check_interval = interval
        e.add(name, q, 6)
        life.step(f"{name} prefill")
        s = life.slot(name, len(q) + 1)
        found = life.step(f"{name} decode loop, EOS at the loop's second token")
        faults["eos"][name] = {"slot": s, "position": len(q) + 1, "found": rows(found),
                               "outputs": list(e.outputs[name])}
        e.runner.eos_token_id = R.qwen3_config(128)["eos_token_id"]
        e.runner.continue_decode_eos_check_interval = 1
        life.run(f"{name} rest")
    faults["real_data"] = real_data_modes(life)

    # --- the guard's own sweep after every step (sweep_interval=1): after a plain step it reads
    # the KV the step returned (the runner stores it only after model_fn returns; it once read
    # the donated arrays and raised "Array has been deleted"), after a decode loop the KV the
    # loop stored
    life.install("all", sweep_interval=1)
    start = len(life.log)
    e.add("s1", prefix + [50, 51], 3)
    e.add("s2", [500 + k for k in range(20)], 6)
    life.run("sweep every step")
    e.add("s3", [500 + k for k in range(20)] + [9], 2)  # a prefix hit on s2's cached block
    life.run("sweep every step, prefix hit")
    life.guard.manager.flush()
    out["sweep_every_step"] = {"steps": life.guard.steps, "sweeps": life.guard.sweeps,
                               "total": kti.violation_counts(life.guard).tolist(),
                               "prefix_hit": life.prefix_hits.get("s3"),
                               "scheduled": [s["scheduled"] for s in life.log[start:]
                                             if s["scheduled"]]}
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
