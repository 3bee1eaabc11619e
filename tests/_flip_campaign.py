"""A single-bit flip campaign in the demo's simulated server, with every flip's detection step
predicted on the host from the stated rule (docs/spec.md §17), independently of the coverage code.

One compiled run: between steps, flips are placed on live slots (a random bit of a random byte of
a random layer, K or V, of a slot of a running request's prefix or of a cached prefix no request
uses, in either buffer group), then the server steps on. After each step the host reads:

* the step's TAIL verify plans (SGLang's plan op, built by HEAD): the slots step ``t`` read;
* the sweep's plan, rebuilt here with the plan op from the rows the sweep walked;
* the ring: digest rows (``KV_DIGEST_MISMATCH``) name the group (their launch tag) and the slot.

A flip's *first check* is the first of: the TAIL of a step ``t`` that reads its slot with
``slot % window == t % window`` (``t`` counted here, from 1), unless the sweep runs at least
every ``window`` steps and the last one checked the slot fewer than ``window`` steps before
(:class:`Checks`), or the first sweep after it that walks its slot. Every flip must be
reported exactly at its first check (no earlier, no later, no miss), and no digest row may name a slot without a pending flip. A flip is restored once found;
one whose slot a forward rewrites before any check (evicted, reallocated) was erased, and one
never checked by the end is left out (its slot stopped being live).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kvcanary_jax import _config, consts
from kvcanary_jax import runtime as rt
from kvcanary_jax import sim as sm
from kvcanary_jax.ops.plan import canary_plan
from kvcanary_jax.plans import VerifyPlan, WritePlan


@dataclasses.dataclass
class Flip:
    group: str
    slot: int
    layer: int
    half: str
    byte: int
    bit: int
    kind: str  # "used" or "cached"
    placed: int  # the first step that can see it
    predicted: tuple | None = None  # (step, "TAIL" | "SWEEP"): the first check
    detected: tuple | None = None
    erased: bool = False
    reads: list = dataclasses.field(default_factory=list)  # steps whose TAIL read its slot
    walks: list = dataclasses.field(default_factory=list)  # steps whose sweep walked it


@dataclasses.dataclass
class Result:
    flips: list
    false_alarms: list
    other_rows: list
    steps: int
    left_to_sweep: int = 0  # slots a TAIL left to the sweep (docs/spec.md §17.2)

    @property
    def detected(self):
        return [f for f in self.flips if f.detected is not None]

    def problems(self) -> list[str]:
        """Every way the run broke the rule, one line each (empty: it held)."""
        out = [f"false alarm: {r}" for r in self.false_alarms]
        out += [f"unexpected ring row: {r}" for r in self.other_rows]
        for f in self.flips:
            if f.erased and f.detected is None:
                continue
            if f.detected != f.predicted:
                out.append(f"{f}: detected {f.detected}, first check {f.predicted}")
        return out


def _group_slots(srv, group, full_slots):
    if group == "FULL":
        return {int(s) for s in full_slots if s > 0}
    return {int(srv.lut[s]) for s in full_slots if s > 0 and srv.lut[s] > 0}


class Checks:
    """The digest checks the stated rule gives (docs/spec.md §17.2), kept on the host from the
    plans alone: which read slots a TAIL checks, and when each slot was last checked."""

    def __init__(self, cfg: rt.CanaryConfig):
        self.window = cfg.coverage_window
        # The FULL group only: the SWA group's read window slides past what a sweep walked.
        self.left_to_sweep = {g: 0 < cfg.sweep_interval <= cfg.coverage_window and not
                              cfg.window(g) for g in cfg.groups}
        self.last_check: dict = {}  # (group, slot) -> step
        self.last_sweep = -1
        self.written_at: dict = {}  # (group, slot) -> the step that last wrote it (stamped)
        self.left = 0  # phase checks left to the sweep

    @property
    def stamped(self):
        return self.written_at.keys()

    def _left(self, t: int, key) -> bool:
        # The slot's content (written at or before the last sweep) checked by that sweep.
        return (self.left_to_sweep[key[0]] and self.last_sweep >= 0
                and t - self.last_sweep < self.window
                and self.last_check.get(key, -1) >= self.last_sweep
                and self.written_at[key] <= self.last_sweep)

    def tail(self, t: int, group: str, reads, written) -> set:
        """The slots step ``t``'s TAIL checks among ``reads``; ``written`` (the step's) are
        stamped after it."""
        phase = {s for s in reads if s % self.window == t % self.window
                 and (group, s) in self.stamped}
        out = {s for s in phase if not self._left(t, (group, s))}
        self.left += len(phase) - len(out)
        for s in out:
            self.last_check[(group, s)] = t
        self.written_at.update(((group, s), t) for s in written)
        return out

    def sweep(self, t: int, walked: dict) -> None:
        """The sweep after step ``t`` walked ``walked[group]``."""
        for group, slots in walked.items():
            for s in slots:
                if (group, s) in self.stamped:
                    self.last_check[(group, s)] = t
        self.last_sweep = t


def _windowed(srv, group, slots):
    """The positions of a prefix a plan of ``group`` verifies: all, or the SWA window's."""
    if group == "SWA":
        return list(enumerate(slots))[max(0, len(slots) - srv.sim.swa_window_size):]
    return list(enumerate(slots))


def _candidates(srv, group, kind):
    """Slots of ``group`` a flip may go to: a running request's prefix, or a cached prefix no
    running request holds (the positions its group's plans read)."""
    lists = ([r.slots for r in srv.live] if kind == "used"
             else [e.slots for e in srv.cache])
    used = {s for r in srv.live for s in r.slots}
    out = set()
    for slots in lists:
        for _, s in _windowed(srv, group, slots):
            if kind == "cached" and s in used:
                continue
            out |= _group_slots(srv, group, [s])
    return sorted(out)


def plan_slots(vplan) -> np.ndarray:
    """The slots a verify plan reads (entries below its count, plan enabled, slot 0 left out)."""
    n, enable = int(np.asarray(vplan.verify_num_valid)[0]), int(np.asarray(vplan.enable)[0])
    slots = np.asarray(vplan.verify_slot_indices)[:n] if enable else np.zeros((0,), np.int64)
    return slots[slots > 0]


@_config.with_x64
def _sweep_slots(cfg, table, rows, lengths, lut, group):
    """The slots the sweep's plan of ``group`` walks (the plan op on the sweep's rows)."""
    n = rows.shape[0]
    cap = max(1, n * table.shape[1])
    vplan, _ = canary_plan(
        verify_plan_out=VerifyPlan.allocate(verify_capacity=cap),
        write_plan_out=WritePlan.allocate(write_req_capacity=max(1, n)),
        req_pool_indices=jnp.asarray(rows), prefix_lens=jnp.asarray(lengths),
        extend_seq_lens=jnp.zeros_like(jnp.asarray(lengths)), req_to_token=jnp.asarray(table),
        swa_window_size=cfg.window(group),
        full_to_swa_index_mapping=jnp.asarray(lut) if group == "SWA" else None,
        verify_capacity=cap, req_to_verify_expected_tokens=None,
        req_to_verify_expected_tokens_valid_lens=None, kv_token_id_vs_position_offset=0,
        implementation="xla")
    return set(int(s) for s in plan_slots(vplan))


def run(sim: sm.SimConfig, *, steps: int, flips_per_step: int, seed: int,
        warmup: int = 6) -> Result:
    """Run ``steps`` steps of a bare-step server (no manager: the host reads the state between
    steps), placing ``flips_per_step`` flips before each step after ``warmup``."""
    assert sim.kv_canary is None and sim.coverage_window > 0
    srv = sm.Server(sim)
    cfg, window = srv.cfg, sim.coverage_window
    rng = np.random.default_rng(seed)
    swept = {}

    walk = srv.sweep_inputs

    def recording_walk():  # what the sweep walked, with the LUT it translated through
        table, rows, lengths = walk()
        swept.update(table=table.copy(), rows=rows.copy(), lengths=lengths.copy(),
                     lut=srv.lut.copy())
        return table, rows, lengths

    srv.sweep_inputs = recording_walk
    flips, pending, false_alarms, other_rows = [], {}, [], []
    checks = Checks(cfg)
    for t in range(1, steps + 1):
        if t > warmup:
            for _ in range(flips_per_step):
                group = cfg.groups[int(rng.integers(len(cfg.groups)))]
                kind = ("used", "cached")[int(rng.integers(2))]
                free = [s for s in _candidates(srv, group, kind) if (group, s) not in pending]
                if not free:
                    continue
                slot = free[int(rng.integers(len(free)))]
                f = Flip(group=group, slot=slot, layer=int(rng.integers(sim.num_layers)),
                         half=sm.HALVES[int(rng.integers(2))],
                         byte=int(rng.integers(2 * sim.kv_width)), bit=int(rng.integers(8)),
                         kind=kind, placed=t)
                sm.flip_kv_bit(srv, f.group, f.slot, f.layer, f.half, f.byte, f.bit)
                flips.append(f)
                pending[(group, slot)] = f
        sched, batch, rtt, lut = srv.prepare()
        written = {g: _group_slots(srv, g, [s for _, ss in sched for s in ss]) for g in cfg.groups}
        srv.state, srv.kv = srv.device_step(srv.state, srv.kv, batch, rtt, lut)
        reads = {g: set(int(s) for s in plan_slots(srv.state.plans[g][0])) for g in cfg.groups}
        swept.clear()
        srv.complete(sched, 0.0, poll=False)  # sweeps after step t when it is due
        walked = {g: _sweep_slots(cfg, swept["table"], swept["rows"], swept["lengths"],
                                  swept["lut"], g) for g in cfg.groups} if swept else None
        tail = {g: checks.tail(t, g, reads[g], written.get(g, ())) for g in cfg.groups}
        if walked is not None:
            checks.sweep(t, walked)

        # The first check of each pending flip, by the stated rule.
        for (group, slot), f in pending.items():
            if slot in reads[group]:
                f.reads.append(t)
            if walked is not None and slot in walked[group]:
                f.walks.append(t)
            if f.predicted is not None:
                continue
            if group in written and slot in written[group]:
                f.erased = True  # rewritten by the forward before any check
            elif slot in tail[group]:
                f.predicted = (t, "TAIL")
            elif walked is not None and slot in walked[group]:
                f.predicted = (t, "SWEEP")

        # What the ring says, then an empty ring for the next step.
        state = srv.state
        for v in rt.read_violations(state):
            if v.reason_bits & consts.KV_DIGEST_MISMATCH:
                f = pending.get((v.group, v.slot))
                if f is None:
                    false_alarms.append((t, str(v)))
                elif f.detected is None:
                    f.detected = (t, v.phase)
            elif not (v.reasons == ("VERIFY_REAL_KV_HASH_MISMATCH",)
                      and any(f.group == v.group and f.slot == v.slot and f.layer == 0
                              and f.half == v.half for f in pending.values())):
                other_rows.append((t, str(v)))  # SGLang's check reads its half's layer 0 only
        srv.state = dataclasses.replace(state, violation_write_index=jnp.zeros((1,), jnp.int32))

        for key, f in list(pending.items()):
            if f.detected is not None:
                if not f.erased:
                    sm.flip_kv_bit(srv, f.group, f.slot, f.layer, f.half, f.byte, f.bit)
                del pending[key]
            elif f.erased:
                del pending[key]
    jax.block_until_ready(srv.state)
    # Flips still pending whose slot was never checked again stopped being live: left out.
    kept = [f for f in flips if f.detected is not None or f.predicted is not None or f.erased]
    return Result(flips=kept, false_alarms=false_alarms, other_rows=other_rows, steps=steps,
                  left_to_sweep=checks.left)
