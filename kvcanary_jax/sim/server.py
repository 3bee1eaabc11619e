"""A small simulated server driving the canary (the demo's engine).

The simulator follows SGLang's scheduler closely enough to exercise every path of the canary:
requests arrive with prompts that often share a "system prompt" (radix-cache style: a new request
reuses the KV slots of a cached prefix), are prefilled in chunks, decode one token per step,
finish, free their ``req_to_token`` row (rows are reused without being cleared) and leave their
tokens in the cache; the cache is evicted LRU when slots run out, so slots are reused too. With
``swa_window_size > 0`` a second (SWA) buffer group is addressed through a full->SWA LUT.

Tokens come from a deterministic oracle ``token(rid, position)`` (SGLang's token-oracle sampler),
which also supplies the write op's expected inputs. The "model" has ``num_layers`` attention
layers, each with a K and a V array per buffer group; its forward (:func:`make_forward`) writes
KV bytes derived from (token, position, layer, half) into every layer's bf16 K and V arrays
between the HEAD and TAIL canary launches. The KV is handed to the canary as every layer of each
group (``{group: {"layers": {"K": [...], "V": [...]}}}``, :mod:`kvcanary_jax.runtime.kv`):
SGLang's real-KV fingerprint reads layer 0, the coverage digest (``coverage_window``) every layer.

Fault hooks (``pre_step_hook``, ``post_sample_hook``, ``post_step_hook``, ``admit_hook``) are
one-shot callables the fault injectors of :mod:`kvcanary_jax.sim.faults` arm for a step.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kvcanary_jax import _config, hashing
from kvcanary_jax import runtime as rt

__all__ = ["SimConfig", "Request", "CacheEntry", "StepInfo", "Server", "make_forward", "kv_salt",
           "HALVES"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimConfig:
    """Server limits (small by default so the demo compiles and runs in seconds on a CPU)."""

    steps: int = 40
    seed: int = 0
    max_reqs: int = 12
    context_len: int = 48
    num_slots: int = 320
    max_bs: int = 6
    max_tokens: int = 32
    chunk_size: int = 12
    vocab: int = 32000
    kv_width: int = 32  # bf16 elements per slot, layer and K/V half (64 bytes)
    num_layers: int = 4
    # Ours: the coverage digest's window (0: off, SGLang's real-KV check of layer 0 only).
    coverage_window: int = 0
    swa_window_size: int = 8
    enable_v_half: bool = False
    sweep_interval: int = 4
    # The sweep walks running requests' decoded tokens too; False: their prompts only, as
    # SGLang's radix cache holds a request's output once it finishes.
    sweep_decoded: bool = True
    max_cache_entries: int = 6
    arrival_prob: float = 0.7
    share_prob: float = 0.7
    ring_capacity: int = 256
    real_kv_hash_mode: str = "all"
    kv_token_id_vs_position_offset: int = 0
    implementation: str | None = None
    # The runtime manager's mode ("log" / "raise"): the server runs its steps, sweeps and
    # reporting through kvcanary_jax.runtime.CanaryManager. None: the bare jitted step.
    kv_canary: str | None = None

    def __post_init__(self):
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0, got {self.steps}")
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.kv_canary is not None:
            self.manager_config()  # every bad setting refused here, before a server is built

    def manager_config(self) -> rt.ManagerConfig:
        """The manager's configuration: the mode, the real-KV mode and sweep interval as the
        flags give them; the ring and both token asserts as the simulator needs them (its fault
        kinds include wrong input tokens); no periodic stats (the demo prints its own report)."""
        if self.kv_canary not in ("log", "raise"):
            raise ValueError(f"kv-canary: the simulated server runs --kv-canary log or raise, "
                             f"got {self.kv_canary!r}")
        return rt.ManagerConfig(
            mode=self.kv_canary, real_data=self.real_kv_hash_mode,
            sweep_interval=self.sweep_interval, ring_capacity=self.ring_capacity,
            enable_verify_token_assert=True, enable_write_input_assert=True,
            stats_print_every_n_steps=0, draft_worker=self.kv_token_id_vs_position_offset == 1,
            coverage_window=self.coverage_window)

    def canary_config(self) -> rt.CanaryConfig:
        return rt.CanaryConfig(
            max_reqs=self.max_reqs,
            context_len=self.context_len,
            num_slots=self.num_slots,
            max_bs=self.max_bs,
            max_tokens=self.max_tokens,
            sweep_rows=self.max_reqs + self.max_cache_entries,
            ring_capacity=self.ring_capacity,
            swa_window_size=self.swa_window_size,
            swa_num_slots=self.num_slots if self.swa_window_size > 0 else 0,
            enable_v_half=self.enable_v_half,
            real_kv_hash_mode=self.real_kv_hash_mode,
            kv_token_id_vs_position_offset=self.kv_token_id_vs_position_offset,
            implementation=self.implementation,
            coverage_window=self.coverage_window,
            num_layers=self.num_layers,
            sweep_interval=self.sweep_interval,
        )


@dataclasses.dataclass
class Request:
    rid: int
    row: int
    prompt: list[int]
    max_new: int
    output: list[int] = dataclasses.field(default_factory=list)
    slots: list[int] = dataclasses.field(default_factory=list)  # KV written for these positions

    @property
    def all_ids(self) -> list[int]:
        return self.prompt + self.output

    @property
    def decoding(self) -> bool:
        return len(self.slots) >= len(self.prompt)


@dataclasses.dataclass
class CacheEntry:
    tokens: tuple[int, ...]
    slots: list[int]
    last_used: int


@dataclasses.dataclass
class StepInfo:
    step: int
    seconds: float
    num_reqs: int
    num_tokens: int
    violations: int
    swept: bool


HALVES = ("K", "V")


def _kv_values(ids, pos, width, salt):
    lane = jnp.arange(width, dtype=jnp.int64)[None, :]
    v = (ids[:, None] * 131 + pos[:, None] * 17 + lane * 3 + salt) % 251 - 125
    return v.astype(jnp.bfloat16)


def kv_salt(layer: int, half: str) -> int:
    """What sets one layer's and half's values apart (layer 0's K and V keep the values of the
    one-layer model this simulator had)."""
    return 7 + 101 * HALVES.index(half) + 1009 * layer


def make_forward(cfg: rt.CanaryConfig, width: int):
    """The "model": writes each token's K and V bytes (derived from token, position, layer and
    half) into its slot of every layer of every group; padding tokens (slot -1) go nowhere. It
    takes the KV as the server holds it (every layer, ``{group: {"layers": {"K": ..., "V":
    ...}}}``) or in SGLang's per-half form (``{group: {half: (arrays,)}}``, each array written as
    that half's layer 0)."""

    def forward(kv, batch, req_to_token, lut):
        loc = batch.out_cache_loc
        out = {}
        for group in cfg.groups:
            if group == "FULL":
                dst = jnp.where(loc < 0, cfg.num_slots, loc)
            else:
                dst = jnp.where(loc < 0, cfg.swa_num_slots, lut[jnp.clip(loc, 0, lut.shape[0] - 1)])

            def write(arrays, half, layered):
                return tuple(
                    a.at[dst].set(_kv_values(batch.input_ids, batch.positions, width,
                                             kv_salt(layer if layered else 0, half)), mode="drop")
                    for layer, a in enumerate(arrays))

            entry = kv[group]
            if "layers" in entry:
                out[group] = {"layers": {h: write(entry["layers"][h], h, True) for h in HALVES}}
            else:
                out[group] = {h: write(entry[h], h, False) for h in entry}
        return out

    return forward


class Server:
    """Host-side scheduler state + the device-side canary state and KV pool."""

    def __init__(self, sim: SimConfig):
        self.sim = sim
        self.cfg = sim.canary_config()
        self.rng = np.random.default_rng(sim.seed)
        n_rows, n_slots = sim.max_reqs, sim.num_slots
        self.req_to_token = np.zeros((n_rows, sim.context_len), np.int32)
        self.lut = np.zeros((n_slots,), np.int64)  # full slot -> SWA slot (0 = none)
        self.free_rows = list(range(1, n_rows))
        self.free_slots = list(range(1, n_slots))
        self.free_swa = [int(s) for s in self.rng.permutation(np.arange(1, n_slots))]
        self.refs = np.zeros((n_slots,), np.int64)
        self.slot_content: dict[int, tuple[int, int]] = {}  # slot -> (token, position) written
        self.live: list[Request] = []
        self.cache: list[CacheEntry] = []
        self.next_rid = 1
        self.step_idx = 0
        self.system_prompts = [
            [int(t) for t in self.rng.integers(1, sim.vocab, size=int(self.rng.integers(8, 16)))]
            for _ in range(3)
        ]
        self.manager = None
        if sim.kv_canary is not None:
            self.manager = rt.CanaryManager(sim.manager_config(), self.cfg,
                                            forward=make_forward(self.cfg, sim.kv_width))
            self.manager.mark_init_finished()
            # The manager's ring capacity and real-KV mode are the flags'; the step's sizes too.
            self.cfg = self.manager.cfg
        else:
            self.state = rt.init_state(self.cfg)
        with _config.x64_scope():
            self.kv = {
                g: {"layers": {h: tuple(jnp.zeros((self.cfg.group_slots(g), sim.kv_width),
                                                  jnp.bfloat16) for _ in range(sim.num_layers))
                               for h in HALVES}}
                for g in self.cfg.groups
            }
        if self.manager is None:
            self.device_step = rt.make_canary_step(self.cfg, make_forward(self.cfg, sim.kv_width))
        # Fault hooks, set by the campaign for one step.
        self.pre_step_hook: Callable[[Server, list], None] | None = None
        self.post_sample_hook: Callable[[Server, list], None] | None = None
        self.post_step_hook: Callable[[Server, list], None] | None = None
        self.admit_hook: Callable[[Server], None] | None = None

    # ---------------------------------------------------------------- tokens
    def oracle_token(self, rid: int, position: int) -> int:
        h = hashing.to_u64(hashing.splitmix64_int((rid << 20) ^ position ^ (self.sim.seed << 40)))
        return 1 + h % (self.sim.vocab - 1)

    def expected_token(self, req: Request, position: int) -> int:
        return req.prompt[position] if position < len(req.prompt) else self.oracle_token(req.rid, position)

    # ---------------------------------------------------------------- slots
    def _ref(self, slots):
        for s in slots:
            self.refs[s] += 1

    def _unref(self, slots):
        for s in slots:
            self.refs[s] -= 1
            if self.refs[s] == 0:
                self.free_slots.append(s)
                if self.cfg.swa_window_size > 0:
                    self.free_swa.append(int(self.lut[s]))
                    self.lut[s] = 0

    def _evict_one(self) -> bool:
        if not self.cache:
            return False
        victim = min(self.cache, key=lambda e: e.last_used)
        self.cache.remove(victim)
        self._unref(victim.slots)
        return True

    def alloc_slots(self, n: int) -> list[int] | None:
        while len(self.free_slots) < n:
            if not self._evict_one():
                return None
        out = [self.free_slots.pop(0) for _ in range(n)]
        for s in out:
            self.refs[s] = 1
            if self.cfg.swa_window_size > 0:
                self.lut[s] = self.free_swa.pop(0)
        return out

    def cached_unused_slots(self) -> list[int]:
        live = {s for r in self.live for s in r.slots}
        return sorted({s for e in self.cache for s in e.slots} - live)

    def _insert_cache(self, tokens, slots):
        tokens = tuple(tokens)
        for e in self.cache:
            if e.tokens == tokens:
                e.last_used = self.step_idx
                return
        self._ref(slots)
        self.cache.append(CacheEntry(tokens=tokens, slots=list(slots), last_used=self.step_idx))
        while len(self.cache) > self.sim.max_cache_entries:
            self._evict_one()

    def match_prefix(self, prompt) -> tuple[int, CacheEntry | None]:
        best, best_e = 0, None
        for e in self.cache:
            n = 0
            for a, b in zip(e.tokens, prompt[:-1]):  # leave at least one token to prefill
                if a != b:
                    break
                n += 1
            if n > best:
                best, best_e = n, e
        return best, best_e

    # ---------------------------------------------------------------- admission
    def new_prompt(self) -> list[int]:
        rng = self.rng
        if rng.random() < self.sim.share_prob:
            base = self.system_prompts[int(rng.integers(len(self.system_prompts)))]
            return base + [int(t) for t in rng.integers(1, self.sim.vocab, size=int(rng.integers(2, 10)))]
        return [int(t) for t in rng.integers(1, self.sim.vocab, size=int(rng.integers(4, 20)))]

    def admit(self, prompt, *, row: int | None = None, entry: CacheEntry | None = None,
              skip_row_write_at: int | None = None):
        if not self.free_rows:
            return None
        row = self.free_rows.pop(0) if row is None else (self.free_rows.remove(row) or row)
        max_new = int(self.rng.integers(4, 12))
        max_new = min(max_new, self.sim.context_len - len(prompt) - 1)
        req = Request(rid=self.next_rid, row=row, prompt=list(prompt), max_new=max(1, max_new))
        self.next_rid += 1
        if entry is None:
            n, entry = self.match_prefix(prompt)
        else:
            n = min(len(entry.tokens), len(prompt) - 1)
        if entry is not None:
            entry.last_used = self.step_idx
            req.slots = list(entry.slots[:n])
            self._ref(req.slots)
            for j, s in enumerate(req.slots):
                if j != skip_row_write_at:
                    self.req_to_token[row, j] = s
        self.live.append(req)
        return req

    def maybe_admit(self):
        if self.admit_hook is not None:
            hook, self.admit_hook = self.admit_hook, None
            hook(self)
        if self.free_rows and self.rng.random() < self.sim.arrival_prob:
            self.admit(self.new_prompt())

    # ---------------------------------------------------------------- one step
    def schedule(self):
        """Decode requests first (one token each), then prefill chunks, within the bucket."""
        batch, budget = [], self.sim.max_tokens
        order = [r for r in self.live if r.decoding] + [r for r in self.live if not r.decoding]
        for req in order:
            if len(batch) == self.sim.max_bs or budget == 0:
                break
            known = len(req.all_ids)
            n = min(known - len(req.slots), self.sim.chunk_size, budget)
            if n <= 0:
                continue
            slots = self.alloc_slots(n)
            if slots is None:
                continue
            batch.append((req, slots))
            budget -= n
        return batch

    def build_batch(self, sched):
        rpi, pre, ext, all_ids, ids, pos, loc, exp_ids = [], [], [], [], [], [], [], []
        for req, slots in sched:
            p0 = len(req.slots)
            rpi.append(req.row)
            pre.append(p0)
            ext.append(len(slots))
            all_ids.append(req.all_ids)
            for k, s in enumerate(slots):
                p = p0 + k
                self.req_to_token[req.row, p] = s
                ids.append(req.all_ids[p])
                pos.append(p)
                loc.append(s)
                exp_ids.append(self.expected_token(req, p))
        return rt.make_batch(
            self.cfg, req_pool_indices=rpi, prefix_lens=pre, extend_seq_lens=ext,
            all_ids=all_ids, input_ids=ids, positions=pos, out_cache_loc=loc,
            expected_input_tokens=exp_ids, expected_input_positions=pos,
        )

    def device_tables(self):
        with _config.x64_scope():
            return jnp.asarray(self.req_to_token), jnp.asarray(self.lut)

    def prepare(self):
        """Admission, scheduling and the host-built batch of the coming forward."""
        self.maybe_admit()
        sched = self.schedule()
        batch = self.build_batch(sched)
        if self.pre_step_hook is not None:
            hook, self.pre_step_hook = self.pre_step_hook, None
            hook(self, sched)
        rtt, lut = self.device_tables()
        return sched, batch, rtt, lut

    def complete(self, sched, t0: float, *, poll: bool = True) -> StepInfo:
        """Sampling, finishing, the periodic sweep and the host poll of the violation count."""
        sampled = []
        for req, slots in sched:
            p0 = len(req.slots)
            for k, s in enumerate(slots):
                self.slot_content[s] = (req.all_ids[p0 + k], p0 + k)
            was_prefill = not req.decoding
            req.slots += slots
            if len(req.slots) == len(req.all_ids):
                if was_prefill:
                    self._insert_cache(req.prompt, req.slots[: len(req.prompt)])
                req.output.append(self.oracle_token(req.rid, len(req.all_ids)))
                sampled.append(req)
        if self.post_sample_hook is not None:
            hook, self.post_sample_hook = self.post_sample_hook, None
            hook(self, sampled)
        for req in list(self.live):
            if len(req.output) >= req.max_new or len(req.all_ids) >= self.sim.context_len:
                self.finish(req)
        if self.post_step_hook is not None:
            hook, self.post_step_hook = self.post_step_hook, None
            hook(self, sched)
        swept = self.sim.sweep_interval > 0 and (self.step_idx + 1) % self.sim.sweep_interval == 0
        if swept:
            self.sweep()
        n_viol = rt.violation_count(self.state) if poll else 0  # the host poll (syncs the step)
        info = StepInfo(step=self.step_idx, seconds=time.perf_counter() - t0, num_reqs=len(sched),
                        num_tokens=sum(len(s) for _, s in sched), violations=n_viol, swept=swept)
        self.step_idx += 1
        return info

    def coverage(self) -> rt.CoverageStats | None:
        """The coverage report now (``None`` with ``coverage_window`` 0)."""
        if self.manager is not None:
            return self.manager.coverage()
        return rt.coverage_stats(self.cfg, self.state, sweep_interval=self.sim.sweep_interval)

    @property
    def state(self):
        """The canary's device state (the manager's, when one runs the canary)."""
        return self.manager.state if self.manager is not None else self._state

    @state.setter
    def state(self, value):
        if self.manager is not None:
            self.manager.state = value
        else:
            self._state = value

    def step(self) -> StepInfo:
        t0 = time.perf_counter()
        sched, batch, rtt, lut = self.prepare()
        if self.manager is None:
            self.state, self.kv = self.device_step(self.state, self.kv, batch, rtt, lut)
            return self.complete(sched, t0)
        try:
            self.kv = self.manager.step(self.kv, batch, rtt, lut,
                                        requests=[r for r, _ in sched])
        except rt.CanaryViolationError as e:
            # Raise mode: finish the step's bookkeeping with the step's KV, then raise.
            self.kv = e.kv
            self.complete(sched, t0)
            raise
        return self.complete(sched, t0)

    def finish(self, req: Request):
        self._insert_cache(req.all_ids[: len(req.slots)], req.slots)
        self._unref(req.slots)
        self.live.remove(req)
        self.free_rows.append(req.row)  # the row keeps its stale contents

    def sweep_inputs(self):
        """The radix-cache walk as plan rows: every cache entry and every running request's
        cached prefix (its prompt only, with ``sweep_decoded`` off), one row each (row 0
        unused), padded to ``sweep_cap_rows`` rows."""
        n = self.cfg.sweep_cap_rows
        table = np.zeros((n + 1, self.sim.context_len), np.int32)
        lengths = np.zeros((n,), np.int64)
        rows = np.zeros((n,), np.int64)
        live = [r.slots if self.sim.sweep_decoded else r.slots[: len(r.prompt)]
                for r in self.live]
        entries = [e.slots for e in self.cache] + live
        for i, slots in enumerate(entries[:n]):
            table[i + 1, : len(slots)] = slots
            rows[i], lengths[i] = i + 1, len(slots)
        return table, rows, lengths

    def sweep(self):
        table, rows, lengths = self.sweep_inputs()
        if self.manager is not None:
            self.manager.sweep(table, rows, lengths, kv=self.kv, lut=self.lut)
            return
        with _config.x64_scope():
            self.state = rt.canary_sweep(
                self.cfg, self.state, rows_table=jnp.asarray(table), row_indices=jnp.asarray(rows),
                lengths=jnp.asarray(lengths), kv=self.kv, lut=jnp.asarray(self.lut),
            )

    # ---------------------------------------------------------------- checkpoints
    def snapshot(self):
        host = {k: copy.deepcopy(v) for k, v in self.__dict__.items()
                if k not in ("state", "_state", "manager", "kv", "device_step", "cfg", "sim")}
        dev = jax.tree.map(np.array, (self.state, self.kv))
        return host, dev

    def restore(self, snap):
        host, dev = snap
        for k, v in host.items():
            setattr(self, k, copy.deepcopy(v))
        with _config.x64_scope():
            self.state, self.kv = jax.tree.map(jnp.asarray, dev)
        if self.manager is not None:
            self.manager.resync()  # the restored state's ring is where reporting resumes
