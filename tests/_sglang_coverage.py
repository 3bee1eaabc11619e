"""SGLang 0.5.23's canary runtime over multi-layer KV pools, and a single-bit flip campaign in it
with every flip's detection step predicted on the host from the stated rule (docs/spec.md §17),
independently of the coverage code.

:class:`LayeredServer` is :class:`_sglang_runtime.ToyServer`'s serving loop (SGLang's
``CanaryManager``, its single-forward managers, sweep and reporter, driven as SGLang's
``ModelRunner.forward`` drives them) over a pool of several bf16 layers, K and V of a layer the two
halves of one allocation as SGLang's MHA pool lays them out, whose canary buffers SGLang's own
adapter attaches (``attach_mha``; ``attach_swa`` for an SWA pool: a FULL pool and an SWA pool of
their own layers, full slots mapped to SWA slots by a LUT). SGLang's perturbers are off: the
campaign's flips are the only corruption.

:func:`campaign`: between forward steps, flips are placed on live slots (a random bit of a random
byte of a random layer, K or V, of a slot a running request reads next or of a cached prefix no
running request holds, in either group), then the server steps on. Per forward ``T`` (counted
here, from 1) the host knows, from the batch and SGLang's documented plan rule, the slots the TAIL
verify plan of each group reads (each request's cached prefix; the SWA group's last
``swa_window`` positions, through the LUT), the slots the step writes, and, from the radix-cache
stand-in's walk, the slots the sweep walks. A flip's *first check* is the first of: the TAIL of a
forward ``T`` that reads its slot with ``slot % window == T % window``, or the first sweep that
walks it; a forward that rewrites the slot first erases it. Every flip must be reported (a ring
row with ``KV_DIGEST_MISMATCH``, under the group's ``TAIL_K`` or ``SWEEP_K`` tag) exactly at its
first check; no digest row may name a slot without a pending flip; SGLang's own rows are allowed
only where its layer-0 fingerprint reads a pending flip. A flip is restored once found; one whose
slot stopped being live is left out.
"""

from __future__ import annotations

import dataclasses
import importlib
import random

import numpy as np
import torch

from kvcanary_jax import consts
import _flip_campaign
from _sglang_runtime import ToyServer, ToyRadix

HALVES = ("K", "V")
_TAGS = consts.CanaryLaunchTag


class ToyMhaPool:
    """What SGLang's MHA adapter and the coverage read of ``MHATokenToKVPool``: ``k_buffer`` /
    ``v_buffer`` lists of ``[slots, heads, head_dim]`` bf16 layers (a layer's K and V the halves
    of one ``[2, slots, heads, head_dim]`` allocation), ``page_size``, and the buffer infos the
    adapter splices its canary buffers into."""

    def __init__(self, num_slots: int, layers: int, heads: int, head_dim: int, device):
        fused = [torch.zeros(2, num_slots, heads, head_dim, dtype=torch.bfloat16, device=device)
                 for _ in range(layers)]
        self.k_buffer = [f[0] for f in fused]
        self.v_buffer = [f[1] for f in fused]
        self.page_size = 1
        self.layer_num = layers

    def get_contiguous_buf_infos(self):
        bufs = self.k_buffer + self.v_buffer
        return [b.data_ptr() for b in bufs], [b.nbytes for b in bufs], [b[0].nbytes for b in bufs]

    def layer_bytes(self, layer: int, half: str) -> torch.Tensor:
        """Layer ``layer``'s K or V as rows of bytes (a view: writes go to the pool)."""
        t = (self.k_buffer if half == "K" else self.v_buffer)[layer]
        return t.view(torch.uint8).view(t.shape[0], -1)


class ToySwaPool:
    """What SGLang's SWA adapter and the coverage read of ``SWAKVPool``: a full and an SWA pool
    (each a :class:`ToyMhaPool`), the full-to-SWA LUT, and both buffer-info methods."""

    def __init__(self, full: ToyMhaPool, swa: ToyMhaPool, lut: torch.Tensor):
        self.full_kv_pool, self.swa_kv_pool = full, swa
        self.full_to_swa_index_mapping = lut
        self.page_size = 1

    def get_contiguous_buf_infos(self):
        return self.full_kv_pool.get_contiguous_buf_infos()

    def get_state_buf_infos(self):
        return self.swa_kv_pool.get_contiguous_buf_infos()


class LayeredServer(ToyServer):
    """:class:`ToyServer`'s loop over a pool of ``layers`` bf16 layers (``swa_window`` > 0: an
    SWA pool with ``swa_layers`` layers beside), its canary attached by SGLang's adapter (inside
    an active ``install_into_sglang(coverage_window=N)``, the coverage sees it there)."""

    def __init__(self, *, layers=4, heads=2, head_dim=8, swa_window=0, swa_layers=2,
                 hash_mode="NONE", sweep_interval=7, seed=0, num_slots=160, context_len=28,
                 max_reqs=6, ring=1 << 14, device="cpu"):
        super().__init__(device=str(device), num_slots=num_slots, max_reqs=max_reqs,
                         context_len=context_len,
                         seed=seed, perturb_prob=0.0, sweep_interval=sweep_interval,
                         verify_token=False)
        rt, dev = self.rt, self.device
        self.config = dataclasses.replace(
            self.config, ring_capacity=ring,
            real_kv_hash_mode=rt.kernels.consts.RealKvHashMode[hash_mode])
        self.swa_window = swa_window
        alloc = importlib.import_module("sglang.srt.kv_canary.pool_patcher.buffer_alloc")
        read_bytes = alloc.resolve_real_kv_read_bytes(self.config)
        self.pools = {"FULL": ToyMhaPool(num_slots, layers, heads, head_dim, dev)}
        if swa_window:
            # Every full slot but 0 has an SWA slot of its own (a permutation), SGLang's
            # trailing -1 after them.
            perm = torch.randperm(num_slots - 1, generator=torch.Generator().manual_seed(seed))
            self.lut = torch.cat([torch.zeros(1, dtype=torch.int64), perm + 1,
                                  torch.tensor([-1])])
            self.lut_host, self.lut = self.lut, self.lut.to(dev)
            self.pools["SWA"] = ToyMhaPool(num_slots, swa_layers, heads, head_dim, dev)
            pool = ToySwaPool(self.pools["FULL"], self.pools["SWA"], self.lut)
            adapter = importlib.import_module("sglang.srt.kv_canary.pool_patcher.adapters.swa")
            groups = adapter.attach_swa(pool=pool, device=dev, read_bytes=read_bytes,
                                        kv_token_id_vs_position_offset=0)
        else:
            self.lut = self.lut_host = None
            pool = self.pools["FULL"]
            adapter = importlib.import_module("sglang.srt.kv_canary.pool_patcher.adapters.mha")
            groups = adapter.attach_mha(pool=pool, device=dev, read_bytes=read_bytes,
                                        kv_token_id_vs_position_offset=0)
        self.pool = pool
        self.groups = {g.kind.name: g for g in groups}
        self.group = self.groups["FULL"]

    def group_slots(self, group: str, full_slots) -> list[int]:
        """``full_slots`` as ``group``'s slots (through the LUT for SWA; 0 left out)."""
        slots = [int(s) for s in full_slots if s > 0]
        if group == "SWA":
            lut = self.lut_host
            return [int(lut[s]) for s in slots if int(lut[s]) > 0]
        return slots

    def _model_forward(self, batch):
        """Every layer's K and V of each written token (bytes from its id, position, layer)."""
        locs = batch.out_cache_loc
        base = (batch.input_ids * 31 + batch.positions * 7)[:, None]
        for group, pool in self.pools.items():
            at = locs if group == "FULL" else self.lut[locs]
            for layer in range(pool.layer_num):
                for h, half in enumerate(HALVES):
                    rows = pool.layer_bytes(layer, half)
                    val = base * (2 * layer + h + 3) + \
                        torch.arange(rows.shape[1], device=locs.device)[None, :]
                    rows[at] = (val % 251).to(torch.uint8)

    def manager(self):
        return self.rt.manager.CanaryManager(
            config=self.config, perturb_config=self.perturb,
            buffer_groups=tuple(self.groups.values()), device=self.device,
            req_to_token_pool=self.req_to_token_pool, launch_capacities=self.caps,
            swa_window_size=self.swa_window)


Flip = _flip_campaign.Flip  # one flip, its predicted and its actual first check (steps are forwards)


@dataclasses.dataclass
class Result:
    flips: list
    false_alarms: list
    other_rows: list
    sglang_rows: int  # SGLang's own rows of layer-0 flips (its fingerprint reads layer 0)
    forwards: int
    sweeps: int
    checked: dict  # per group, TAIL and SWEEP: the entries the rule says each launch checks

    @property
    def detected(self):
        return [f for f in self.flips if f.detected is not None]

    def problems(self) -> list[str]:
        out = [f"false alarm: {r}" for r in self.false_alarms]
        out += [f"unexpected ring row: {r}" for r in self.other_rows]
        out += [f"{f}: detected {f.detected}, first check {f.predicted}" for f in self.flips
                if not (f.erased and f.detected is None) and f.detected != f.predicted]
        return out


def _flip(server, f: Flip) -> None:
    server.pools[f.group].layer_bytes(f.layer, f.half)[f.slot, f.byte] ^= 1 << f.bit


def _window_of(server, group, slots):
    """The positions of a prefix ``group``'s TAIL plan reads: all, or the SWA window's."""
    if group == "SWA":
        return slots[max(0, len(slots) - server.swa_window):]
    return slots


def campaign(server: LayeredServer, *, steps: int, flips_per_step: int, window: int, seed: int,
             warmup: int = 6) -> Result:
    """Serve ``steps`` scheduler steps, placing ``flips_per_step`` flips before each after
    ``warmup`` (module docstring). ``window``: the installed coverage window."""
    torch.manual_seed(seed)
    random.seed(seed)
    rng = random.Random(1000 + seed)
    flip_rng = np.random.default_rng(seed)
    for pool in server.pools.values():
        for layer in range(pool.layer_num):
            for half in HALVES:
                pool.layer_bytes(layer, half).zero_()
    server.req_to_token_pool.req_to_token.zero_()
    manager = server.manager()
    radix = ToyRadix(server.rt.radix_walker.UnifiedRadixCache, server.req_to_token_pool,
                   server.device)
    walked: list = []
    walk = radix.walk_for_kv_canary

    def recording_walk(**kw):  # what the sweep walked
        out = walk(**kw)
        walked.append([int(s) for s in out.slot_indices])
        return out

    radix.walk_for_kv_canary = recording_walk
    manager.attach_radix_cache(radix.obj)
    manager.mark_init_finished()
    log = manager._device_state.violation_log
    free_rows = list(range(1, server.max_reqs))
    free_slots = list(range(1, server.num_slots))
    running: list = []
    flips, pending = [], {}
    false_alarms, other_rows, sglang_rows = [], [], 0
    checked = {g: {"TAIL": 0, "SWEEP": 0} for g in server.groups}
    seen = forwards = sweeps = 0
    for step in range(steps):
        if forwards >= warmup:
            for _ in range(flips_per_step):
                group = rng.choice(sorted(server.groups))
                kind = rng.choice(("used", "cached"))
                used = {s for r in running for s in r.slots}
                lists = ([list(_window_of(server, group, r.slots)) for r in running]
                         if kind == "used" else radix.chains)
                cands = sorted({s for full in lists for s in server.group_slots(group, full)
                                if kind == "used" or s not in server.group_slots(group, used)})
                cands = [s for s in cands if (group, s) not in pending]
                if not cands:
                    continue
                pool = server.pools[group]
                f = Flip(group=group, slot=rng.choice(cands),
                         layer=int(flip_rng.integers(pool.layer_num)),
                         half=HALVES[int(flip_rng.integers(2))],
                         byte=int(flip_rng.integers(pool.layer_bytes(0, "K").shape[1])),
                         bit=int(flip_rng.integers(8)), kind=kind, placed=forwards + 1)
                _flip(server, f)
                flips.append(f)
                pending[(group, f.slot)] = f
        batch = server._schedule(rng, running, free_rows, free_slots, radix)
        if batch is None:
            continue
        forwards += 1
        t = forwards
        # What the TAIL plans read: each request's cached prefix (the SWA window of it).
        new = batch.extend_seq_lens.tolist() if batch.extend_seq_lens is not None else \
            [1] * batch.batch_size
        rtt = server.req_to_token_pool.req_to_token
        reads = {g: set() for g in server.groups}
        for row, seq, n in zip(batch.req_pool_indices.tolist(), batch.seq_lens.tolist(), new):
            prefix = rtt[row, :seq - n].tolist()
            for g in server.groups:
                reads[g] |= set(server.group_slots(g, _window_of(server, g, prefix)))
        written = {g: set(server.group_slots(g, batch.out_cache_loc.tolist()))
                   for g in server.groups}
        walked.clear()
        server._forward(manager, batch)
        swept = {g: set(server.group_slots(g, walked[0])) for g in server.groups} \
            if walked else None
        sweeps += swept is not None
        for g in server.groups:
            checked[g]["TAIL"] += sum(1 for s in reads[g] if s % window == t % window)
            checked[g]["SWEEP"] += len(swept[g]) if swept else 0

        for (g, slot), f in pending.items():
            if f.predicted is not None:
                continue
            if slot in reads[g] and slot % window == t % window:
                f.predicted = (t, "TAIL")
            elif slot in written[g]:
                f.erased = True
            elif swept is not None and slot in swept[g]:
                f.predicted = (t, "SWEEP")

        n = int(log.violation_write_index[0])
        assert n <= log.violation_ring.shape[0], "ring full: raise LayeredServer(ring=...)"
        for row in log.violation_ring[seen:n].tolist():
            tag, slot, bits = _TAGS(row[consts.VIOLATION_FIELD_KERNEL_KIND]), \
                row[consts.VIOLATION_FIELD_SLOT_IDX], row[consts.VIOLATION_FIELD_FAIL_REASON_BITS]
            copy, half, g = tag.name.split("_")
            if bits & consts.KV_DIGEST_MISMATCH:
                f = pending.get((g, slot))
                if f is None or half != "K" or copy == "HEAD":
                    false_alarms.append((t, row))
                elif f.detected is None:
                    f.detected = (t, copy)
            elif bits == consts.FailReason.VERIFY_REAL_KV_HASH_MISMATCH and any(
                    f.group == g and f.slot == slot and f.layer == 0 and f.half == half
                    for f in pending.values()):
                sglang_rows += 1  # SGLang's own check reads its half's layer 0
            else:
                other_rows.append((t, row))
        seen = n
        for key, f in list(pending.items()):
            if f.detected is not None:
                if not f.erased:
                    _flip(server, f)  # restored
                del pending[key]
            elif f.erased:
                del pending[key]
    kept = [f for f in flips if f.detected is not None or f.predicted is not None or f.erased]
    return Result(flips=kept, false_alarms=false_alarms, other_rows=other_rows,
                  sglang_rows=sglang_rows, forwards=forwards, sweeps=sweeps, checked=checked)
