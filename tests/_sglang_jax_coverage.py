"""A single-bit flip campaign in sglang-jax's own pools, with the coverage window on (run as a
script: the 2-device CPU mesh is set before JAX starts; prints one JSON document that
tests/test_sglang_jax_coverage.py checks).

The world of tests/_sglang_jax_life.py (sglang-jax 0.0.2 or 0.1.0rc0: its ``ReqToTokenPool``,
``MHATokenToKVPool`` or the 5-D stand-in, allocators, ``RadixCache``, ``Req``, ``ScheduleBatch``,
the stand-in model writing every layer's K and V through the pool's write path), with the canary
built with ``coverage_window`` N: every step hands it every layer of the pool, and the radix
cache is swept every ``--sweep`` steps. A scheduler loop admits requests (prompts sharing
prefixes, so the radix cache serves some of them and holds others' finished KV, evicted when the
pool runs short and handed out again), decodes, finishes. Two lives on the same compiled step:

* **clean**: no flip. Nothing may be reported, and the manager (``canary_manager`` through
  ``observe``) must find every live KV byte verified at every step (a share of 1).
* **flips**: before each step after the warm-up, ``--flips`` single-bit flips, each a random bit
  of a random byte of a random layer, K or V, of a random head (so of a random KV shard), in a
  slot a running request reads (``used``) or a slot only the radix cache holds (``cached``), one
  pending flip per slot. After each step the host reads each shard's TAIL verify plan (the slots
  the step read) and the slots the sweep walked, and predicts each flip's first check from the
  stated rule (docs/spec.md §17.3), independently of the coverage code: the TAIL of a step ``t``
  that reads its slot with ``slot % N == t % N`` (with ``--leave-to-sweep``, the canary told its
  sweep runs every ``--sweep`` <= N steps: unless the last sweep checked the slot fewer than N
  steps before), or the first sweep that walks it. Every flip
  must be reported exactly there, by the shard that holds its head, with ``KV_DIGEST_MISMATCH``
  (no earlier, no later, no miss, no other shard); no digest row may name a slot without a
  pending flip; the only other rows allowed are SGLang's own real-KV rows for a pending flip in
  the fingerprinted bytes (layer 0's K strip of the shard's first head). A flip is restored once
  reported; one whose slot a forward rewrites first (evicted and handed out again) was erased,
  one never checked by the end (its slot stopped being live) is left out.

The manager observes the flip life too: it must report exactly the digest rows the ring holds.

    python tests/_sglang_jax_coverage.py --page-size 1 --kv-write legacy --window 3 --sweep 5
    python tests/_sglang_jax_coverage.py --page-size 4 --layout head --kv-write head ...
    python tests/_sglang_jax_coverage.py --dp 2 --kv-write kernel ...   (0.1.0rc0)
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import logging
import os
import sys
import types

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_HERE), _HERE]

import _sglang_jax_life as life  # noqa: E402  (sets the 2-device mesh before JAX starts)
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

import _sglang_jax_compat as compat  # noqa: E402
import _flip_campaign as fc  # noqa: E402
from kvcanary_jax import consts  # noqa: E402
from kvcanary_jax.integrations import sglang_jax as ksj  # noqa: E402

# Prompts share these prefixes (radix hits), then a few tokens of their own.
BASES = ([11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 23, 24, 25, 26], [31, 32, 33, 34])
HALVES = ("K", "V")
DIGEST = consts.KV_DIGEST_MISMATCH


@dataclasses.dataclass
class Flip:
    rank: int
    slot: int
    layer: int
    half: str
    head: int
    byte: int
    bit: int
    kind: str  # "used" or "cached"
    shard: int  # the canary shard holding its head
    placed: int  # the first step that can see it
    predicted: tuple | None = None  # (step, "TAIL" | "SWEEP"): the first check, by the rule
    detected: tuple | None = None
    erased: bool = False
    reads: list = dataclasses.field(default_factory=list)  # steps whose TAIL read its slot


class Campaign:
    def __init__(self, a, *, step_fn=None):
        self.a = a
        self.w = life.World(a.page_size, a.pool_size, a.layout, a.kv_write, a.tokens, a.dp,
                            req_rows=life.MAX_BS + 1, coverage_window=a.window,
                            ring_capacity=4096,
                            **({"sweep_interval": a.sweep} if a.leave_to_sweep else {}))
        if step_fn is not None:  # the same compiled step for both lives
            self.w.step_fn = step_fn
        self.canary = self.w.canary
        self.rng = np.random.default_rng(a.seed)
        self.running = None
        self.rid = 0
        self.reports = []
        self.manager = ksj.canary_manager(self.canary, "log", on_violation=self.reports.append,
                                          sweep_interval=a.sweep, stats_print_every_n_steps=5)

    # -- the scheduler ------------------------------------------------------------------------

    def per_rank(self) -> list[list]:
        if self.running is None:
            return [[] for _ in range(self.a.dp)]
        return compat.reqs_per_dp(self.running)

    def _pages(self, n: int) -> int:
        ps = self.a.page_size
        return -(-n // ps) * ps

    def _fits(self, reqs, total: int) -> bool:
        """Whether the running requests' whole lives and a new one fit in the rank's pool
        (everything else the pool holds is the radix cache's, evicted on demand)."""
        held = sum(self._pages(len(r.origin_input_ids) + r.sampling_params.max_new_tokens)
                   for r in reqs)
        return held + self._pages(total) + self.a.page_size <= self.a.pool_size

    def new_request(self, rank: int):
        rng = self.rng
        base = BASES[int(rng.integers(len(BASES)))]
        prompt = base[:int(rng.integers(2, len(base) + 1))] + \
            rng.integers(100, 990, int(rng.integers(1, 6))).tolist()
        self.rid += 1
        req = self.w.new_req(str(self.rid), prompt, int(rng.integers(3, 11)), dp_rank=rank)
        return req

    def step(self, t: int):
        """One scheduler step: a prefill of one new request, or a decode of the running batch.
        Returns the model worker batch."""
        w, dp, per_rank = self.w, self.a.dp, self.per_rank()
        needy = [d for d in range(dp) if not per_rank[d]]
        # The life's batch buckets are the whole batch's: with DP each rank fills its share.
        roomy = [d for d in range(dp) if len(per_rank[d]) < life.MAX_BS // dp
                 and self._fits(per_rank[d], 13 + 10)]
        if needy or (roomy and self.rng.random() < 0.3):
            d = needy[0] if needy else roomy[int(self.rng.integers(len(roomy)))]
            req = self.new_request(d)
            new = w.extend_batch([[req] if i == d else [] for i in range(dp)] if dp > 1
                                 else [req])
            mwb, _, _ = w.live_step(f"{t} prefill {req.rid}", new, extend=True)
            if self.running is None or self.running.is_empty():
                self.running = new
            else:
                self.running.merge_batch(new)
            return mwb
        self.running.prepare_for_decode()
        mwb, _, _ = w.live_step(f"{t} decode", self.running, extend=False)
        self.running.filter_batch()
        return mwb

    # -- what is live, what a step read and wrote ---------------------------------------------

    def live(self) -> tuple[list[set], list[set]]:
        """Per rank: the slots running requests read (their written positions), and the slots
        only the radix cache holds."""
        table = np.asarray(self.w.req_pool.req_to_token)
        used = []
        for reqs in self.per_rank():
            slots = set()
            for r in reqs:
                n = len(r.origin_input_ids) + len(r.output_ids) - 1
                slots |= set(table[r.req_pool_idx, :n].tolist())
            used.append(slots - {0})
        cached = [set(s for p in pre for s in p.tolist()) - used[d] - {0}
                  for d, pre in enumerate(self.prefixes())]
        return used, cached

    def prefixes(self) -> list[list]:
        if self.a.dp == 1:
            return [ksj.radix_prefixes(self.w.tree)]
        return ksj.radix_prefixes(self.w.tree, dp_size=self.a.dp)

    def reads(self) -> list[list]:
        """Per rank, the slots the last step's TAIL verify read (its plan, built by HEAD; a
        slot two requests share is read twice)."""
        vplan = self.w.state.plans["FULL"][0]
        slots, n, enable = (np.asarray(jax.device_get(x)) for x in (
            vplan.verify_slot_indices, vplan.verify_num_valid, vplan.enable))
        out = []
        for d in range(self.a.dp):
            i = d * self.canary.head_shards
            got = slots[i, :int(n[i, 0])] if int(enable[i, 0]) else np.zeros((0,), np.int64)
            out.append([int(s) for s in got if s > 0])
        return out

    def written(self, mwb) -> list[set]:
        loc = np.asarray(mwb.out_cache_loc).reshape(self.a.dp, -1)
        return [set(int(s) for s in row if s >= 0) for row in loc]

    def sweep(self) -> list[set]:
        prefixes = self.prefixes()
        w = self.w
        w.state = ksj.sweep(self.canary, w.state, w.kv_pool.kv_buffer[0],
                            prefixes if self.a.dp > 1 else prefixes[0],
                            layers=w.kv_pool.kv_buffer)
        return [set(s for p in pre for s in p.tolist() if s > 0) for pre in prefixes]

    def observe(self):
        ksj.observe(self.manager, self.canary, self.w.state)

    # -- flips --------------------------------------------------------------------------------

    def new_flip(self, t, pending) -> Flip | None:
        rng, c = self.rng, self.canary
        kind = ("used", "cached")[int(rng.integers(2))]
        rank = int(rng.integers(self.a.dp))
        used, cached = self.live()
        free = sorted(s for s in (used if kind == "used" else cached)[rank]
                      if (rank, s) not in pending)
        if not free:
            return None
        head = int(rng.integers(life.HEADS))
        half = HALVES[int(rng.integers(2))]
        rows_per_shard = 2 * life.HEADS // c.head_shards
        return Flip(rank=rank, slot=free[int(rng.integers(len(free)))],
                    layer=int(rng.integers(life.LAYERS)), half=half, head=head,
                    byte=int(rng.integers(2 * life.HEAD_DIM)), bit=int(rng.integers(8)),
                    kind=kind, shard=rank * c.head_shards + (2 * head) // rows_per_shard,
                    placed=t)

    def toggle(self, flips) -> None:
        """Flip (or flip back) each flip's bit in the live pool, one host round trip a layer."""
        by_layer = collections.defaultdict(list)
        for f in flips:
            by_layer[f.layer].append(f)
        pool = self.w.kv_pool
        for layer, fs in by_layer.items():
            buf = pool.kv_buffer[layer]
            words = life._slot_rows(buf).copy()
            for f in fs:
                row = f.rank * self.canary.num_slots + f.slot  # the buffer's rows are global
                words[row, 2 * f.head + HALVES.index(f.half), f.byte // 2] ^= np.uint16(
                    1 << (8 * (f.byte % 2) + f.bit))
            pool.kv_buffer[layer] = life._put_rows(words, buf)

    def fingerprinted(self, f: Flip, shard: int) -> bool:
        """Whether ``f`` lies in the bytes SGLang's own check reads on ``shard``: K of the
        canary layer, the shard's first head (``k_heads`` 1)."""
        first = (shard % self.canary.head_shards) * (life.HEADS // self.canary.head_shards)
        return (f.shard == shard and f.layer == self.canary.layer and f.half == "K"
                and f.head == first)


def run(a, *, flips: bool, step_fn=None) -> tuple[dict, object]:
    c = Campaign(a, step_fn=step_fn)
    window = a.window
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("kvcanary_jax")
    level = logger.level
    logger.setLevel(logging.INFO)  # the stats line is logged at INFO
    logger.addHandler(handler)
    out = {"num_shards": c.canary.num_shards, "head_shards": c.canary.head_shards,
           "num_layers": c.canary.num_layers, "kv_shape": list(c.w.kv_pool.kv_buffer[0].shape),
           "kv_spec": str(c.w.kv_pool.kv_buffer[0].sharding.spec), "flips": [],
           "false_alarms": [], "wrong_shard": [], "other_rows": [], "digest_rows": [],
           "shares": [], "live_bytes": [], "tail_checks": [], "steps": a.steps}
    pending: dict = {}
    tail_runs = np.zeros(c.canary.num_shards, np.int64)
    # The rule's checks, per DP rank (the demo campaign's predictor, over the canary's config).
    checks = [fc.Checks(c.canary.config) for _ in range(a.dp)]

    with jax.set_mesh(c.w.mesh):
        for t in range(1, a.steps + 1):
            if flips and t > a.warmup:
                placed = []
                for _ in range(a.flips):
                    f = c.new_flip(t, pending)
                    if f is not None:
                        pending[(f.rank, f.slot)] = f
                        placed.append(f)
                c.toggle(placed)
                out["flips"] += placed
            before = ksj.violation_counts(c.w.state)
            mwb = c.step(t)
            read_lists, written = c.reads(), c.written(mwb)
            reads = [set(r) for r in read_lists]
            walked = c.sweep() if t % a.sweep == 0 else None
            # Step t's TAIL checked exactly the read slots the rule gives, on every shard.
            tail = [checks[r].tail(t, "FULL", reads[r], written[r]) for r in range(a.dp)]
            if walked is not None:
                for r in range(a.dp):
                    checks[r].sweep(t, {"FULL": walked[r]})
            runs = np.asarray(jax.device_get(
                c.w.state.coverage.groups["FULL"].tail_slot_runs)).reshape(-1)
            want = [sum(1 for s in read_lists[i // c.canary.head_shards]
                        if s in tail[i // c.canary.head_shards])
                    for i in range(c.canary.num_shards)]
            if (runs - tail_runs).tolist() != want:
                out["tail_checks"].append((t, (runs - tail_runs).tolist(), want))
            tail_runs = runs
            # The first check of each pending flip, by the stated rule.
            for (rank, slot), f in pending.items():
                if slot in reads[rank]:
                    f.reads.append(t)
                if f.predicted is not None:
                    continue
                if slot in written[rank]:
                    f.erased = True
                elif slot in tail[rank]:
                    f.predicted = (t, "TAIL")
                elif walked is not None and slot in walked[rank]:
                    f.predicted = (t, "SWEEP")
            for sv in ksj.read_violations(c.w.state, start=before):
                v, rank = sv.violation, c.canary.dp_rank(sv.shard)
                f = pending.get((rank, v.slot))
                row = (t, sv.shard, str(v))
                if v.reason_bits & DIGEST:
                    out["digest_rows"].append([sv.shard, v.slot, v.phase, v.reasons])
                    if f is None:
                        out["false_alarms"].append(row)
                    elif f.shard != sv.shard:
                        out["wrong_shard"].append(row)
                    elif f.detected is None:
                        f.detected = (t, v.phase)
                elif not (v.reasons == ("VERIFY_REAL_KV_HASH_MISMATCH",) and f is not None
                          and c.fingerprinted(f, sv.shard)):
                    out["other_rows"].append(row)
            c.observe()
            if not flips:
                cov = ksj.coverage(c.manager, c.canary)
                out["live_bytes"].append(cov.live_bytes)
                if cov.live_bytes:
                    out["shares"].append(cov.verified_bytes / cov.live_bytes)
            done = [k for k, f in pending.items() if f.detected is not None or f.erased]
            c.toggle([pending[k] for k in done if not pending[k].erased])
            for k in done:
                del pending[k]
        c.manager.flush()
    out["left_to_sweep"] = sum(ch.left for ch in checks)
    logger.removeHandler(handler)
    logger.setLevel(level)
    counts = ksj.violation_counts(c.w.state)
    out["ring_overflow"] = bool(np.any(counts > c.canary.ring_capacity))
    # Flips whose slot was never checked again stopped being live: left out.
    out["flips"] = [dataclasses.asdict(f) for f in out["flips"]
                    if f.detected is not None or f.predicted is not None or f.erased]
    out["manager_digest_rows"] = [[r.shard, r.violation.slot, r.violation.phase,
                                   list(r.violation.reasons)] for r in c.reports
                                  if r.violation.reason_bits & DIGEST]
    out["manager_other_reports"] = len(c.reports) - len(out["manager_digest_rows"])
    out["stats_lines"] = [ln for ln in lines if "coverage_window=" in ln][-2:]
    out["prefills"] = sum(1 for e in c.w.log if e["mode"] == "extend")
    return out, c.w.step_fn


def main(a) -> None:
    clean, step_fn = run(a, flips=False)
    flipped, _ = run(a, flips=True, step_fn=step_fn)
    json.dump({"clean": clean, "flips": flipped, "window": a.window, "sweep": a.sweep,
               "leave_to_sweep": a.leave_to_sweep,
               "version": compat.VERSION}, sys.stdout, default=list)


if __name__ == "__main__":
    if not hasattr(pltpu, "TPUMemorySpace"):
        pltpu.TPUMemorySpace = types.SimpleNamespace(ANY=pl.ANY)
    p = argparse.ArgumentParser()
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--pool-size", type=int, default=72)
    p.add_argument("--layout", choices=("pool", "head"), default="pool")
    p.add_argument("--kv-write", choices=("kernel", "legacy", "head"), default="legacy")
    p.add_argument("--tokens", choices=("full", "feed"), default="feed")
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--window", type=int, default=3)
    p.add_argument("--sweep", type=int, default=5)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--flips", type=int, default=6)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--leave-to-sweep", action="store_true",
                   help="tell the canary the sweep's interval (SglangJaxCanary.sweep_interval)")
    main(p.parse_args())
