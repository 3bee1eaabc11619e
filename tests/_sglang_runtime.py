"""A toy server around SGLang 0.5.23's own canary runtime (``sglang.srt.kv_canary``).

:class:`ToyServer` builds SGLang's ``CanaryManager`` over a toy KV pool (one FULL buffer group:
K and V canary buffers for HEAD and TAIL, the K pool as the real-KV source) with SGLang's
perturbers switched on, and runs a deterministic serving loop through it exactly as SGLang's
``ModelRunner.forward`` does: ``with_ops_outside_graph`` (expected-token scatter, perturbers,
sweep, violation / health / stats pumps) around ``with_active_single_forward_manager(0)`` around
the patched ``model.forward`` (``pre_ops_maybe_inside_graph``: plan + HEAD verify/write; the
model writes its KV; ``post_ops_maybe_inside_graph``: TAIL verify/write). Requests are admitted
(prefill, sometimes in two chunks), decoded, finished into a radix-cache stand-in that the sweep
and the unused-cache perturber walk, and evicted.

Whatever launches the kernels (SGLang's launchers, or the bridge after
``bridge.install_into_sglang()``), a run with the same seed makes the same choices: the workload
has its own generator, and the perturbers draw from ``torch`` and ``random``, seeded at the start
of :meth:`ToyServer.run`. :meth:`ToyServer.run` returns, per step, the violations appended that
step and the canary state after it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import types

import torch

from kvcanary_jax import oracle

KV_BYTES = 64  # bytes of K (and of V) per slot: the real-KV source's row


class _Mode:
    """SGLang's ForwardMode as the canary runtime asks it."""

    def __init__(self, name):
        self.name = name

    def is_decode_or_idle(self):
        return self.name == "decode"

    def is_decode(self):
        return self.name == "decode"

    def is_target_verify(self):
        return False

    def is_draft_extend_v2(self):
        return False

    def is_extend(self):
        return self.name == "extend"


class ToyRadix:
    """What the walker and the sweep read of SGLang's radix cache: the cached chains' slots."""

    def __init__(self, cls, req_to_token_pool, device):
        self.obj = cls()  # the walker checks the type
        self.obj.req_to_token_pool = req_to_token_pool
        self.obj.tree_core = self
        self.chains: list[list[int]] = []
        self.device = device

    def walk_for_kv_canary(self, *, unlocked_only, swa_resident_only):
        slots, positions, prev = [], [], []
        for chain in self.chains:
            for p, s in enumerate(chain):
                slots.append(s)
                positions.append(p)
                prev.append(chain[p - 1] if p else -1)
        t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
        return types.SimpleNamespace(slot_indices=t(slots), positions=t(positions),
                                     prev_slot_indices=t(prev))


@dataclasses.dataclass
class _Req:
    row: int
    tokens: list[int]  # the whole sequence it will have
    slots: list[int] = dataclasses.field(default_factory=list)  # slots of the tokens written

    @property
    def written(self):
        return len(self.slots)


class ToyServer:
    def __init__(self, *, device="cpu", num_slots=96, max_reqs=6, context_len=24,
                 enable_v_half=True, seed=0, perturb_prob=0.06, warmup_steps=3,
                 sweep_interval=4, verify_token=True):
        rt = oracle.load_runtime()
        self.rt, self.device, self.seed = rt, torch.device(device), seed
        verify = rt.kernels.verify
        self.num_slots, self.max_reqs, self.context_len = num_slots, max_reqs, context_len
        dev = self.device
        self.k_pool = torch.zeros(num_slots, KV_BYTES, dtype=torch.uint8, device=dev)
        self.v_pool = torch.zeros(num_slots, KV_BYTES, dtype=torch.uint8, device=dev)
        bufs = [torch.zeros(num_slots, 32, dtype=torch.uint8, device=dev) for _ in range(4)]
        source = verify.RealKvSource(tensor=self.k_pool, page_size=1,
                                     num_bytes_per_token=KV_BYTES, read_bytes=16)
        source_v = verify.RealKvSource(tensor=self.v_pool, page_size=1,
                                       num_bytes_per_token=KV_BYTES, read_bytes=16)
        bg = rt.buffer_group
        self.group = bg.CanaryBufferGroup(
            kind=bg.PoolKind.FULL, k_head=bufs[0], k_tail=bufs[1],
            v_head=bufs[2] if enable_v_half else None, v_tail=bufs[3] if enable_v_half else None,
            real_kv_sources_k=(source,), real_kv_sources_v=(source_v,) if enable_v_half else (),
            swa_index_lut=None, kv_token_id_vs_position_offset=0)
        self.req_to_token_pool = types.SimpleNamespace(
            req_to_token=torch.zeros(max_reqs, context_len, dtype=torch.int32, device=dev),
            max_context_len=context_len, size=max_reqs)
        cfg = rt.config
        self.config = cfg.CanaryConfig(
            mode=cfg.CanaryMode.LOG, ring_capacity=512, sweep_interval=sweep_interval,
            real_kv_hash_mode=rt.kernels.consts.RealKvHashMode.PARTIAL,
            enable_write_input_assert=False, enable_verify_token_assert=verify_token,
            stats_print_every_n_steps=0)
        pc = rt.perturb_config
        self.perturb = pc.PerturbConfig(
            req_to_token_prob=perturb_prob, real_kv_used_prob=perturb_prob,
            real_kv_unused_cache_prob=perturb_prob, real_kv_post_forward_prob=perturb_prob,
            target_group_kind=pc.TargetGroupKind.FULL, warmup_steps=warmup_steps)
        self.caps = rt.capacities.CanaryLaunchCapacities(
            per_forward_verify_capacity=3 * num_slots, per_forward_write_req_capacity=max_reqs,
            per_forward_write_entry_capacity=4 * context_len)

    # -- the run ---------------------------------------------------------------------------------

    def run(self, steps: int, on_step=None) -> list[dict]:
        """Build a CanaryManager and serve ``steps`` forward steps; per step, the violations
        appended (ring rows) and the canary state after it. ``on_step(step, manager)``, when
        given, runs after each step."""
        torch.manual_seed(self.seed)
        random.seed(self.seed)
        rng = random.Random(1000 + self.seed)
        for t in (self.k_pool, self.v_pool, self.req_to_token_pool.req_to_token,
                  self.group.k_head, self.group.k_tail):
            t.zero_()
        for t in (self.group.v_head, self.group.v_tail):
            if t is not None:
                t.zero_()
        manager = self.rt.manager.CanaryManager(
            config=self.config, perturb_config=self.perturb, buffer_groups=(self.group,),
            device=self.device, req_to_token_pool=self.req_to_token_pool,
            launch_capacities=self.caps)
        radix = ToyRadix(self.rt.radix_walker.UnifiedRadixCache, self.req_to_token_pool,
                       self.device)
        manager.attach_radix_cache(radix.obj)
        manager.mark_init_finished()
        self.manager = manager
        state = manager._device_state
        if state.req_to_verify_expected_tokens is not None:
            # torch.empty in SGLang: rows the scatter has not written yet are never read (the
            # plan stops at each request's snapshot length), but a state compared whole must
            # start equal.
            state.req_to_verify_expected_tokens.zero_()
        free_rows = list(range(1, self.max_reqs))  # row 0 and slot 0: SGLang's padding
        free_slots = list(range(1, self.num_slots))
        running: list[_Req] = []
        seen = 0
        out = []
        for step in range(steps):
            batch = self._schedule(rng, running, free_rows, free_slots, radix)
            if batch is not None:
                self._forward(manager, batch)
            n = int(state.violation_log.violation_write_index[0])
            ring = state.violation_log.violation_ring
            out.append({
                "step": step,
                "mode": None if batch is None else batch.forward_mode.name,
                "violations": ring[seen:min(n, ring.shape[0])].tolist(),
                "write_index": n,
                "kernel_run_counters": state.kernel_run_counters.tolist(),
                "slot_run_counters": state.slot_run_counters.tolist(),
                "canary": {name: getattr(self.group, name).clone()
                           for name in ("k_head", "k_tail", "v_head", "v_tail")
                           if getattr(self.group, name) is not None},
                "expected_tokens": (None if state.req_to_verify_expected_tokens is None else
                                    state.req_to_verify_expected_tokens.clone()),
            })
            seen = min(n, ring.shape[0])
            if on_step is not None:
                on_step(step, manager)
        return out

    def run_graphed(self, decode_steps: int, *, bs: int = 4, prompt: int = 6,
                    graph: bool = True, capture=None) -> list[dict]:
        """``bs`` requests prefilled eagerly, then decoded ``decode_steps`` times through one
        CUDA graph captured as SGLang's decode graph runner captures it: the patched
        ``model.forward`` (``pre_ops_maybe_inside_graph``, the model, ``post_ops_...``) under
        ``torch.cuda.graph`` with static batch tensors (warmed up first on padding rows, before
        ``mark_init_finished``), each replay inside ``with_ops_outside_graph``.
        ``graph=False``: the same steps eagerly (the baseline). ``capture(fn)``: what captures
        ``fn`` and returns an object whose ``replay()`` replays it (default: the CUDA graph
        above; a CPU test passes one that reruns ``fn`` on the static tensors). Returns
        :meth:`run`'s records."""
        torch.manual_seed(self.seed)
        random.seed(self.seed)
        rng = random.Random(2000 + self.seed)
        dev = self.device
        manager = self.rt.manager.CanaryManager(
            config=self.config, perturb_config=self.perturb, buffer_groups=(self.group,),
            device=dev, req_to_token_pool=self.req_to_token_pool, launch_capacities=self.caps)
        self.manager = manager
        state = manager._device_state
        if state.req_to_verify_expected_tokens is not None:
            state.req_to_verify_expected_tokens.zero_()
        i64 = lambda x: torch.tensor(x, dtype=torch.int64, device=dev)  # noqa: E731
        # The graph's inputs: padding rows (req_pool_indices 0, slot 0) while warming up. The
        # snapshot lengths are a device tensor the captured plan input copies from (the
        # expected-token scatter outside the graph reads them too).
        static = types.SimpleNamespace(
            forward_mode=_Mode("decode"), spec_info=None, batch_size=bs,
            req_pool_indices=i64([0] * bs), seq_lens=i64([1] * bs), positions=i64([0] * bs),
            input_ids=i64([0] * bs), out_cache_loc=i64([0] * bs), extend_prefix_lens=None,
            extend_seq_lens=None, req_all_ids_flat=None, req_all_ids_lens=i64([0] * bs),
            global_num_token_non_padded_cpu=None)

        def forward_in_graph():
            pre = manager.pre_ops_maybe_inside_graph(static)
            self._model_forward(static)
            manager.post_ops_maybe_inside_graph(static, pre)

        g = None
        if graph and capture is not None:
            with manager.with_active_single_forward_manager(0):
                g = capture(forward_in_graph)
        elif graph:
            with manager.with_active_single_forward_manager(0):
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):  # first calls compile; nothing is captured yet
                        forward_in_graph()
                torch.cuda.current_stream().wait_stream(side)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    forward_in_graph()
        manager.mark_init_finished()
        for t in (self.k_pool, self.v_pool, self.req_to_token_pool.req_to_token):
            t.zero_()
        for name in ("k_head", "k_tail", "v_head", "v_tail"):
            if getattr(self.group, name) is not None:
                getattr(self.group, name).zero_()
        for t in (state.violation_log.violation_ring, state.violation_log.violation_write_index,
                  state.kernel_run_counters, state.slot_run_counters):
            t.zero_()
        radix = ToyRadix(self.rt.radix_walker.UnifiedRadixCache, self.req_to_token_pool, dev)
        manager.attach_radix_cache(radix.obj)
        free_slots = list(range(1, self.num_slots))
        reqs = [_Req(row=1 + i, tokens=[rng.randint(1, 30000) for _ in range(self.context_len)])
                for i in range(bs)]
        out, seen = [], 0
        for step in range(decode_steps + 1):
            if step == 0:
                batch = self._extend([(r, prompt) for r in reqs], free_slots)
                self._forward(manager, batch)
            else:
                batch = self._decode(reqs, free_slots)
                if g is None:
                    self._forward(manager, batch)
                else:
                    for f in ("req_pool_indices", "seq_lens", "positions", "input_ids",
                              "out_cache_loc"):
                        getattr(static, f).copy_(getattr(batch, f))
                    static.req_all_ids_flat = batch.req_all_ids_flat
                    static.req_all_ids_lens.copy_(batch.req_all_ids_lens)
                    with manager.with_ops_outside_graph(
                            single_forward_indices=[0], maybe_inaccurate_forward_batch=static), \
                            manager.with_active_single_forward_manager(0):
                        g.replay()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            n = int(state.violation_log.violation_write_index[0])
            ring = state.violation_log.violation_ring
            out.append({
                "step": step, "mode": batch.forward_mode.name,
                "violations": ring[seen:min(n, ring.shape[0])].tolist(), "write_index": n,
                "kernel_run_counters": state.kernel_run_counters.tolist(),
                "slot_run_counters": state.slot_run_counters.tolist(),
                "canary": {name: getattr(self.group, name).clone()
                           for name in ("k_head", "k_tail", "v_head", "v_tail")
                           if getattr(self.group, name) is not None},
                "expected_tokens": (None if state.req_to_verify_expected_tokens is None else
                                    state.req_to_verify_expected_tokens.clone()),
            })
            seen = min(n, ring.shape[0])
            if step % 5 == 4:  # the requests' finished prefixes, for the sweep to walk
                radix.chains = [list(r.slots[:-1]) for r in reqs]
        return out

    def _schedule(self, rng, running, free_rows, free_slots, radix):
        """The next batch: admit (prefill, possibly the first chunk of two), continue a chunked
        prefill, or decode every running request; finish and evict as it goes."""
        # Finish requests that reached their length: their chains go to the radix cache.
        for r in [r for r in running if r.written == len(r.tokens)]:
            running.remove(r)
            radix.chains.append(list(r.slots))
            free_rows.append(r.row)
        # Evict the oldest cached chains when slots run short.
        while len(free_slots) < self.context_len and radix.chains:
            free_slots.extend(radix.chains.pop(0))
        chunked = [r for r in running if 0 < r.written < len(r.tokens) and
                   getattr(r, "chunk_left", 0)]
        if chunked:
            r = chunked[0]
            n = r.chunk_left
            r.chunk_left = 0
            return self._extend([(r, n)], free_slots)
        if free_rows and (not running or rng.random() < 0.35):
            row = free_rows.pop(0)
            length = rng.randint(6, self.context_len - 2)
            prompt = rng.randint(2, min(8, length - 2))
            r = _Req(row=row, tokens=[rng.randint(1, 30000) for _ in range(length)])
            r.prompt = prompt
            if prompt >= 4 and rng.random() < 0.5:  # chunked prefill: two extends
                r.chunk_left = prompt - prompt // 2
                prompt = prompt // 2
            running.append(r)
            return self._extend([(r, prompt)], free_slots)
        decoding = [r for r in running if r.written >= getattr(r, "prompt", 1)]
        if not decoding:
            return None
        return self._decode(decoding, free_slots)

    def _take(self, r, n, free_slots):
        got = [free_slots.pop(0) for _ in range(n)]
        start = r.written
        r.slots.extend(got)
        self.req_to_token_pool.req_to_token[r.row, start:start + n] = torch.tensor(got)
        return start, got

    def _batch(self, mode, reqs, starts, news):
        dev = self.device
        i64 = lambda x: torch.tensor(x, dtype=torch.int64, device=dev)  # noqa: E731
        input_ids, positions, locs = [], [], []
        for r, start, slots in zip(reqs, starts, news):
            input_ids += r.tokens[start:start + len(slots)]
            positions += list(range(start, start + len(slots)))
            locs += slots
        # What the scheduler snapshots: each request's tokens so far (prompt + outputs).
        known = [r.tokens[:start + len(slots)] for r, start, slots in zip(reqs, starts, news)]
        return types.SimpleNamespace(
            forward_mode=_Mode(mode), spec_info=None, batch_size=len(reqs),
            req_pool_indices=i64([r.row for r in reqs]),
            seq_lens=i64([s + len(n) for s, n in zip(starts, news)]),
            extend_prefix_lens=i64(starts) if mode == "extend" else None,
            extend_seq_lens=i64([len(n) for n in news]) if mode == "extend" else None,
            positions=i64(positions), input_ids=i64(input_ids), out_cache_loc=i64(locs),
            req_all_ids_flat=torch.tensor([t for k in known for t in k], dtype=torch.int64),
            req_all_ids_lens=torch.tensor([len(k) for k in known], dtype=torch.int64),
            global_num_token_non_padded_cpu=None)

    def _extend(self, items, free_slots):
        starts, news = [], []
        for r, n in items:
            start, got = self._take(r, n, free_slots)
            starts.append(start)
            news.append(got)
        return self._batch("extend", [r for r, _ in items], starts, news)

    def _decode(self, reqs, free_slots):
        starts, news = [], []
        for r in reqs:
            start, got = self._take(r, 1, free_slots)
            starts.append(start)
            news.append(got)
        return self._batch("decode", reqs, starts, news)

    def _model_forward(self, batch):
        """The model writes each token's K and V (bytes from its id and position)."""
        locs = batch.out_cache_loc
        val = (batch.input_ids * 31 + batch.positions * 7)[:, None] + \
            torch.arange(KV_BYTES, device=locs.device)[None, :]
        self.k_pool[locs] = (val % 251).to(torch.uint8)
        self.v_pool[locs] = ((val * 3) % 241).to(torch.uint8)

    def _forward(self, manager, batch):
        with manager.with_ops_outside_graph(single_forward_indices=[0],
                                            maybe_inaccurate_forward_batch=batch), \
                manager.with_active_single_forward_manager(0):
            with manager.model_forward_bracket_scope():
                pre = manager.pre_ops_maybe_inside_graph(batch)
                self._model_forward(batch)
                manager.post_ops_maybe_inside_graph(batch, pre)


def compare_runs(a: list[dict], b: list[dict], *, ordered: bool = True) -> None:
    """Assert two runs equal step by step: violations, counters, canary buffers, expected pool.
    ``ordered=False``: each step's violation rows as multisets (GPU kernels append them in the
    order their atomics run)."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        step = x["step"]
        assert x["mode"] == y["mode"], step
        vx, vy = x["violations"], y["violations"]
        if not ordered:
            vx, vy = sorted(map(tuple, vx)), sorted(map(tuple, vy))
        assert vx == vy, f"step {step}: violations differ"
        assert x["write_index"] == y["write_index"], step
        assert x["kernel_run_counters"] == y["kernel_run_counters"], step
        assert x["slot_run_counters"] == y["slot_run_counters"], step
        for name in x["canary"]:
            assert torch.equal(x["canary"][name], y["canary"][name]), f"step {step}: {name}"
        if x["expected_tokens"] is not None:
            assert torch.equal(x["expected_tokens"], y["expected_tokens"]), step


@contextlib.contextmanager
def sglang_references():
    """SGLang's runtime launching SGLang's own torch references of its four kernels (any device;
    the GPU baseline where SGLang's CUDA kernels are not compiled in the process)."""
    rt = oracle.load_runtime()
    k = rt.kernels
    names = {
        (rt.expected_tokens, "launch_scatter_req_token_ids_kernel"):
            k.scatter_ref.scatter_req_token_ids_torch_reference,
        (rt.kernel_launcher, "launch_canary_plan_kernels"):
            k.plan_ref.launch_canary_plan_kernels_torch_reference,
        (rt.endpoint, "launch_canary_verify_kernel"):
            k.verify_ref.launch_canary_verify_kernel_torch_reference,
        (rt.endpoint, "launch_canary_write_kernel"):
            k.write_ref.launch_canary_write_kernel_torch_reference,
    }
    saved = {key: getattr(*key) for key in names}
    for (module, name), fn in names.items():
        setattr(module, name, fn)
    try:
        yield
    finally:
        for (module, name), fn in saved.items():
            setattr(module, name, fn)


@contextlib.contextmanager
def sglang_launchers_on_cpu():
    """SGLang's own launchers as its runtime calls them on CPU tensors: plan, verify and write
    fall back to their torch references by themselves; the scatter launcher is a Triton kernel
    only, so for the CPU its name in the runtime holds SGLang's own torch reference of it
    (``sglang.test.kernels.kv_canary``) for the duration."""
    rt = oracle.load_runtime()
    module = rt.expected_tokens
    launcher = module.launch_scatter_req_token_ids_kernel
    reference = rt.kernels.scatter_ref.scatter_req_token_ids_torch_reference
    module.launch_scatter_req_token_ids_kernel = reference
    try:
        yield
    finally:
        module.launch_scatter_req_token_ids_kernel = launcher
