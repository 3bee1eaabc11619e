"""Device time of the canary per step next to sglang-jax's own step, on the same pools.

    python -m bench.sglang_jax_step [--what kv,runner] [--bs 8,64] [--ctx 512,2048]
                                    [--iters 20] [--out DIR] [--smoke] [--glue] [--manager]
                                    [--tokens feed|full|full,feed]
                                    [--coverage-window N] [--sweep-interval K]

Needs Python >= 3.12 and sglang-jax 0.0.2 with the dependencies of the modules imported
(``requirements-sglang-jax.txt``; ``--glue`` also runs on 0.1.0rc0,
``requirements-sglang-jax-0.1.txt``, whose ``set_kv_buffer_legacy`` refuses the timed ``kv``
model's writes on this single-device mesh with Auto axes); set ``JAX_PLATFORMS`` (``cuda`` on
the H200, ``cpu`` for ``--smoke``). Both steps are sglang-jax's GPU/CPU paths: native
attention, KV written by ``MHATokenToKVPool.set_kv_buffer_legacy`` (its Pallas write kernel is
TPU-only).

What runs, per case (``what``, ``bs`` requests decoding with ``ctx`` cached tokens each):

* ``kv``: "the pool update + attention alone": per layer (4), K/V/Q from an embedding table of the
  batch's tokens, the write through the pool's ``set_kv_buffer_legacy`` and sglang-jax's
  ``forward_attention`` over ``cache_loc`` (8 query heads, 8 KV heads, head_dim 128, bf16).
* ``runner``: sglang-jax's ``ModelRunner`` on a random-weight Qwen2 (4 layers, hidden 1024, 8 heads,
  8 KV heads, head_dim 128, vocab 32000; dummy loader), ``model_runner.forward``.

The requests are built by sglang-jax's own ``Req`` / ``ScheduleBatch`` (token allocator, page
size 1): each prefilled alone (through the guarded step, so the canary holds every slot), then
``--iters`` decode batches prepared ahead (``prepare_for_decode``, ``get_model_worker_batch``,
``ForwardBatch.init_new``; tokens fixed, not sampled). From one snapshot of the pools and the
canary state, three timings over the same decode batches:

1. ``sglang_jax``: sglang-jax's step alone;
2. ``guarded``: the same step inside :func:`guard_model_step` (HEAD, model, TAIL in one jit) or,
   for ``runner``, with :class:`ModelRunnerHook` installed;
3. ``canary_only``: :func:`guard_model_step` around a model that writes nothing (the canary's own
   kernels: plan, HEAD verify + write, TAIL verify + write over the K strip of layer 0, and
   SGLang's scatter with ``--tokens full``).

``--tokens``: how the expected token ids reach the device: ``feed`` (default) keeps them there
between steps and sends each step's :class:`~kvcanary_jax.integrations.sglang_jax.TokenDelta`
(one id per request in decode), ``full`` sends every request's whole history each step
(:func:`~kvcanary_jax.integrations.sglang_jax.expected_tokens`); ``full,feed`` runs both, one
after the other in the same process.

``--coverage-window N`` (ours; 0, the default: SGLang's layer-0 K fingerprint alone): the canary
also digests every layer's K and V (docs/spec.md §17): each guarded and canary-only step stamps
the written slots' digests and checks about 1/N of the slots it reads. The sweep that bounds
cached slots is not part of a step: it is timed on its own (``sweep``: every request's cached
prompt, every layer, digest and SGLang's SWEEP fingerprint) and given per step at one sweep
every ``--sweep-interval`` steps (``sweep_per_step_us``; also the manager's stated interval with
``--manager``).

Device time per step from CUPTI (``bench.timing.device_time``: every kernel between two markers,
idle gaps excluded; wall clock on CPU). Replaying a decode batch is idempotent for both the KV and
the canary, so warm-up calls do not disturb the state; every guarded run must end with 0
violations. Reported: the three medians, ``share_pct = (guarded - sglang_jax) / guarded`` and
``canary_only / (sglang_jax + canary_only)``, both in percent. With a window the steps run after
a sweep of the prompts, as a server's do (the caller's sweep every K <= N steps checks the
prompts' slots, the steps leave them to it: docs/spec.md §17.2); ``canary_only_unswept`` is the
canary alone without it (the step N steps after a sweep), and ``over_bare_with_sweep_pct`` the
average step over the bare one with the sweep's share and that step's once every K. The decoded
tokens since the sweep are the steps' to check, so a step's cost grows with its distance from
the sweep: ``--iters`` at K - 4 (60 for K = 64; 3 warm-up steps come first) times the steps
across the whole interval, and the median is the middle one's; fewer time only the first.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import warnings

import importlib.metadata  # noqa: E402

# sglang-jax 0.0.2 registers its attention backends as pytrees itself, which flax >= 0.12.10
# does too unless told not to (tests/_sglang_jax_runner.py); 0.1.0rc0 relies on flax's. Set
# before flax is imported, so read from the installed package, not from its objects.
if importlib.metadata.version("sglang-jax").startswith("0.0."):
    os.environ.setdefault("FLAX_PYTREE_MODULE", "false")

import inspect  # noqa: E402
import types  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kvcanary_jax.bench import common, timing  # noqa: E402
from kvcanary_jax.integrations import sglang_jax as ksj  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 4, 8, 8, 128, 32000
QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": VOCAB,
    "hidden_size": HEADS * HEAD_DIM, "intermediate_size": 2816, "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
    "max_position_embeddings": 32768, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
    "bos_token_id": 1, "eos_token_id": 2,
}


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


def _v01() -> bool:
    """sglang-jax 0.1.0rc0 (its ``ScheduleBatch.init_new`` takes per-DP lists and ``dp_size``)."""
    from sgl_jax.srt.managers.schedule_batch import ScheduleBatch

    return "dp_size" in inspect.signature(ScheduleBatch.init_new).parameters


class Stack:
    """sglang-jax's pools, allocator and batches for ``bs`` requests of ``ctx`` tokens."""

    def __init__(self, what: str, bs: int, ctx: int, iters: int, tokens: str = "feed",
                 window: int = 0, sweep_interval: int = 0):
        from jax.sharding import Mesh

        self.what, self.bs, self.ctx, self.iters, self.tokens = what, bs, ctx, iters, tokens
        self.context_len = ctx + iters + 8
        total = bs * (ctx + iters) + 64
        self.mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "tensor"))
        self.cache_loc_bucket = bs * (ctx + iters)
        self.v01 = _v01()
        if what == "runner" and self.v01:
            raise NotImplementedError("kv-canary bench: --what runner runs sglang-jax 0.0.2's "
                                      "ModelRunner; with 0.1.0rc0 run --what kv (or --glue)")
        if what == "runner":
            self._init_runner(total)
        else:
            self._init_kv(total)
        self.canary = ksj.SglangJaxCanary.from_pools(self.req_pool, self.kv_pool, max_bs=bs,
                                                     incremental_tokens=tokens == "feed",
                                                     coverage_window=window,
                                                     sweep_interval=sweep_interval if window
                                                     else 0)
        # With a window the step hands the canary every layer it returns.
        self.layers = {"kv_layers": lambda out, pool: out[1]} if window else {}
        self.feed = ksj.TokenFeed(self.canary) if tokens == "feed" else None

    def _init_kv(self, total):
        from sgl_jax.srt.configs.model_config import MockModelConfig
        from sgl_jax.srt.mem_cache.allocator import TokenToKVPoolAllocator
        from sgl_jax.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

        self.req_pool = ReqToTokenPool(size=self.bs + 1, max_context_len=self.context_len)
        self.kv_pool = MHATokenToKVPool(size=total, page_size=1, dtype=jnp.bfloat16,
                                        head_num=KV_HEADS, head_dim=HEAD_DIM, layer_num=LAYERS,
                                        mesh=self.mesh)
        self.allocator = TokenToKVPoolAllocator(size=total, kvcache=self.kv_pool)
        self.model_config = MockModelConfig(num_heads=HEADS, head_dim=HEAD_DIM,
                                            num_kv_heads=KV_HEADS, context_len=self.context_len - 4,
                                            num_hidden_layers=LAYERS)
        self.model_config.vocab_size = VOCAB
        self.tree_cache = None
        if self.v01:  # what the server sets up at start: a tree cache, the cache_loc host buffer
            from sgl_jax.srt.mem_cache.chunk_cache import ChunkCache

            self.model_config.hf_config = types.SimpleNamespace(architectures=[])
            self.tree_cache = ChunkCache(self.req_pool, self.allocator, 1)
            self.req_pool.init_cache_loc_host_buffer(self.cache_loc_bucket)
        self.emb = jax.random.normal(jax.random.key(0), (VOCAB, HEADS * HEAD_DIM), jnp.bfloat16)

    def _init_runner(self, total):
        from flax import nnx
        from sgl_jax.srt.configs.model_config import ModelConfig
        from sgl_jax.srt.model_executor.model_runner import ModelRunner
        from sgl_jax.srt.server_args import ServerArgs

        model_dir = tempfile.mkdtemp()
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(QWEN2, f)
        device = os.environ.get("JAX_PLATFORMS", "cpu")
        args = ServerArgs(model_path=model_dir, device=device, load_format="dummy",
                          attention_backend="native", page_size=1, max_running_requests=self.bs,
                          max_total_tokens=total, tp_size=1, skip_server_warmup=True,
                          context_length=self.context_len - 4)
        with jax.set_mesh(self.mesh):
            self.runner = ModelRunner(
                model_config=ModelConfig(model_path=model_dir, dtype="bfloat16",
                                         context_length=self.context_len - 4),
                mem_fraction_static=0.8, tp_size=1, server_args=args, mesh=self.mesh,
                rngs=nnx.Rngs(0))
        self.req_pool = self.runner.req_to_token_pool
        self.kv_pool = self.runner.token_to_kv_pool
        self.allocator = self.runner.token_to_kv_pool_allocator
        self.model_config = self.runner.model_config

    # -- the model steps ------------------------------------------------------------------

    def kv_model(self, fb, pool, emb):
        """The pool update + native attention of every layer (sglang-jax's functions)."""
        from sgl_jax.srt.layers.attention.native_backend import forward_attention
        from sgl_jax.srt.model_executor.forward_batch_info import ForwardMode

        x = emb[fb.input_ids]
        q = x.reshape(-1, HEADS, HEAD_DIM)
        out = None
        for layer in range(LAYERS):
            k = (x * (layer + 1)).reshape(-1, KV_HEADS, HEAD_DIM)
            fused = pool.set_kv_buffer_legacy(layer, fb.out_cache_loc, k, -k)
            pool.kv_buffer[layer] = fused
            rows = fused.reshape(-1, 2 * KV_HEADS, HEAD_DIM)  # either layout, slot rows
            extend = fb.forward_mode != ForwardMode.DECODE
            if self.v01:
                out = forward_attention(q, rows[:, ::2, :], rows[:, 1::2, :], fb.seq_lens,
                                        fb.cache_loc, fb.extend_prefix_lens, fb.extend_seq_lens,
                                        HEADS, KV_HEADS, page_size=1, scale=HEAD_DIM ** -0.5,
                                        is_causal=extend, mode=fb.forward_mode)
            else:
                out = forward_attention(q, rows[:, ::2, :], rows[:, 1::2, :], fb.seq_lens,
                                        fb.cache_loc, fb.extend_prefix_lens, fb.extend_seq_lens,
                                        HEADS, KV_HEADS, HEAD_DIM ** -0.5, extend,
                                        fb.forward_mode)
            q = out.reshape(-1, HEADS, HEAD_DIM).astype(q.dtype)
        return out, list(pool.kv_buffer), None

    @staticmethod
    def idle_model(fb, pool, *_):
        return None, list(pool.kv_buffer), None

    # -- batches --------------------------------------------------------------------------

    def worker_batch(self, batch, bs_bucket, token_bucket, cache_bucket):
        from sgl_jax.srt.model_executor.forward_batch_info import ForwardBatch

        mwb = batch.get_model_worker_batch([token_bucket], [bs_bucket], [cache_bucket], 1)
        runner = getattr(self, "runner", None) or _NoRunner(self.mesh)
        fb = ForwardBatch.init_new(mwb, runner)
        if self.feed is not None:  # made in step order: every delta reaches its step in order
            return mwb, fb, self.feed.delta(batch.reqs, mwb)
        ids = ksj.expected_tokens(ksj.request_token_ids(batch.reqs), mwb.seq_lens, cache_bucket, 1)
        return mwb, fb, ids

    def build(self):
        """Requests, their prefill batches and the decode batches (host state advanced ahead)."""
        from sgl_jax.srt.managers.schedule_batch import Req, ScheduleBatch
        from sgl_jax.srt.sampling.sampling_params import SamplingParams

        rng = np.random.default_rng(0)
        self.prefills, self.reqs, running = [], [], None
        for r in range(self.bs):
            params = SamplingParams(max_new_tokens=self.iters + 4, temperature=0, ignore_eos=True)
            params.normalize(None)
            req = Req(rid=str(r), origin_input_text="", sampling_params=params,
                      origin_input_ids=rng.integers(3, VOCAB, self.ctx).tolist())
            req.fill_ids, req.extend_input_len = list(req.origin_input_ids), self.ctx
            self.reqs.append(req)
            ranks = {"reqs": [[req]], "dp_size": 1} if self.v01 else {"reqs": [req]}
            batch = ScheduleBatch.init_new(
                req_to_token_pool=self.req_pool, token_to_kv_pool_allocator=self.allocator,
                tree_cache=getattr(self, "tree_cache", None), model_config=self.model_config,
                enable_overlap=False, mesh=self.mesh, **ranks)
            batch.prepare_for_extend()
            self.prefills.append(self.worker_batch(batch, 1, self.ctx, self.ctx))
            req.output_ids.append(int(rng.integers(3, VOCAB)))
            batch.output_ids = np.array(req.output_ids[-1:], np.int32)
            if running is None:
                running = batch
            else:
                running.merge_batch(batch)
        self.decodes = []
        for _ in range(self.iters):
            running.prepare_for_decode()
            self.decodes.append(self.worker_batch(running, self.bs, self.bs, self.cache_loc_bucket))
            out = rng.integers(3, VOCAB, self.bs).astype(np.int32)
            for req, tok in zip(running.reqs, out.tolist()):
                req.output_ids.append(tok)
            running.output_ids = out

    def prompts(self) -> list[np.ndarray]:
        """Each request's prompt slots (written by its guarded prefill): the cached prefixes a
        sweep walks."""
        table = np.asarray(self.req_pool.req_to_token)
        return [table[r.req_pool_idx, :self.ctx].copy() for r in self.reqs]


class _NoRunner:
    """What ``ForwardBatch.init_new`` reads of a model runner (kv mode has none; 0.1.0rc0 also
    reads whether the model is an embedding or multimodal one)."""

    def __init__(self, mesh):
        self.mesh, self.attn_backend = mesh, None
        self.model_config = types.SimpleNamespace(
            is_embedding=False, hf_config=types.SimpleNamespace(architectures=[]))


def _run_case(what: str, bs: int, ctx: int, iters: int, manager: bool = False,
              tokens: str = "feed", window: int = 0, sweep_interval: int = 64) -> dict:
    from sgl_jax.srt.layers.logits_processor import LogitsMetadata

    st = Stack(what, bs, ctx, iters, tokens, window, sweep_interval)
    mesh, canary = st.mesh, st.canary
    # Installed before the requests take their slots (build() allocates every step's ahead),
    # as a server installs it before it serves.
    hook = ksj.ModelRunnerHook(canary, st.runner) if what == "runner" else None
    st.build()
    state = canary.init_state()

    if what == "runner":
        hook.state = state

        def runner_forward(mwb, fb, ids, guarded):
            if guarded:
                hook.expect(ids)
            with jax.set_mesh(mesh):
                out, _ = st.runner.forward(fb, LogitsMetadata.from_model_worker_batch(mwb, mesh))
            return out

        for mwb, fb, ids in st.prefills:
            runner_forward(mwb, fb, ids, True)
        state = hook.state
    else:
        guarded_kv = ksj.guard_model_step(canary, st.kv_model, batch_argnum=0, pool_argnum=1,
                                          fused_kv=lambda out, pool: out[1][0], **st.layers)
        plain_kv = jax.jit(st.kv_model, donate_argnums=1)
        for _, fb, ids in st.prefills:
            with jax.set_mesh(mesh):
                state, out = guarded_kv(state, fb, st.kv_pool, st.emb, expected=ids)
            st.kv_pool.kv_buffer = out[1]
    if int(ksj.violation_counts(state).sum()):
        raise RuntimeError("violations while filling the pools")
    snap_kv, snap_state = _copy(st.kv_pool.kv_buffer), _copy(state)
    result = {"what": what, "bs": bs, "ctx": ctx, "tokens": tokens,
              "verify_entries_per_step": bs * ctx, "coverage_window": window}
    unswept = None
    if window:
        # The steps are timed as a server sweeping every K steps runs them: fewer than N steps
        # after a sweep (which the steps then leave the prompts' slots to, when K <= N). The
        # step that comes N steps after a sweep checks its phase's share of them again: the
        # canary alone is timed that way too (``canary_only_unswept``, from the state before
        # the sweep), and counted once every K steps in ``over_bare_with_sweep_pct``.
        unswept = snap_state
        with jax.set_mesh(mesh):
            snap_state = ksj.sweep(canary, _copy(snap_state), snap_kv[0], st.prompts(),
                                   layers=_copy(snap_kv))
        if int(ksj.violation_counts(snap_state).sum()):
            raise RuntimeError("violations in the sweep of the filled pools")

    # 1. sglang-jax alone.
    st.kv_pool.kv_buffer = _copy(snap_kv)
    if what == "runner":
        hook.uninstall()

        def plain(i):
            runner_forward(*st.decodes[i % iters], False)
    else:
        def plain(i):
            _, fb, _ = st.decodes[i % iters]
            with jax.set_mesh(mesh):
                out = plain_kv(fb, st.kv_pool, st.emb)
            st.kv_pool.kv_buffer = out[1]

    sync = lambda: jax.block_until_ready(st.kv_pool.kv_buffer)  # noqa: E731
    result["sglang_jax"] = timing.device_time(plain, sync, iters=iters)

    # 2. The same step, guarded (with --manager: the runtime manager's host side after each
    # step, log mode: its readback staged with copy_to_host_async and read one step late).
    st.kv_pool.kv_buffer = _copy(snap_kv)
    # A window states the interval of the caller's sweeps (timed on their own, below).
    stated = {"sweep_interval": sweep_interval} if window else {}
    mgr = (ksj.canary_manager(canary, "log", stats_print_every_n_steps=0, **stated) if manager
           else None)
    if what == "runner":
        # The first hook's state goes on (resume=): the prompts' slots hold its stamps.
        hook = (ksj.ManagedModelRunnerHook(canary, st.runner, mgr, resume=hook) if mgr is not None
                else ksj.ModelRunnerHook(canary, st.runner, resume=hook))
        hook.state = _copy(snap_state)

        def guarded(i):
            runner_forward(*st.decodes[i % iters], True)

        sync_g = lambda: jax.block_until_ready((st.kv_pool.kv_buffer, hook.state))  # noqa: E731
    else:
        holder = {"state": _copy(snap_state)}

        def guarded(i):
            _, fb, ids = st.decodes[i % iters]
            with jax.set_mesh(mesh):
                holder["state"], out = guarded_kv(holder["state"], fb, st.kv_pool, st.emb,
                                                  expected=ids)
            st.kv_pool.kv_buffer = out[1]
            if mgr is not None:
                ksj.observe(mgr, canary, holder["state"])  # on any mesh

        sync_g = lambda: jax.block_until_ready((st.kv_pool.kv_buffer, holder["state"]))  # noqa: E731
    result["guarded"] = timing.device_time(guarded, sync_g, iters=iters)
    end_state = hook.state if what == "runner" else holder["state"]
    result["violations"] = int(ksj.violation_counts(end_state).sum())
    result["manager"] = manager
    if mgr is not None:
        mgr.flush()
    if what == "runner":
        hook.uninstall()

    # 3. The canary alone, around a model that writes nothing.
    st.kv_pool.kv_buffer = _copy(snap_kv)
    idle = ksj.guard_model_step(canary, st.idle_model, batch_argnum=0, pool_argnum=1,
                                fused_kv=lambda out, pool: out[1][0], **st.layers)
    only = {"state": _copy(snap_state)}

    def canary_only(i):
        _, fb, ids = st.decodes[i % iters]
        with jax.set_mesh(mesh):
            only["state"], out = idle(only["state"], fb, st.kv_pool, expected=ids)
        st.kv_pool.kv_buffer = out[1]

    result["canary_only"] = timing.device_time(
        canary_only, lambda: jax.block_until_ready(only["state"]), iters=iters)
    if window:
        st.kv_pool.kv_buffer = _copy(snap_kv)
        only["state"] = _copy(unswept)
        result["canary_only_unswept"] = timing.device_time(
            canary_only, lambda: jax.block_until_ready(only["state"]), iters=iters)
        result.update(_time_sweep(st, snap_kv, snap_state, iters, sweep_interval))
    base, g, c = (result[k]["median_us"] for k in ("sglang_jax", "guarded", "canary_only"))
    result["share_pct"] = 100.0 * (g - base) / g
    result["canary_only_share_pct"] = 100.0 * c / (base + c)
    if window:
        # Of K steps, those at least N steps after the sweep check their phase's prompt slots
        # again (max(0, K - N + 1) of them); the sweep's own time is spread over the K.
        k = sweep_interval
        again = max(0.0, result["canary_only_unswept"]["median_us"] - c) * max(0, k - window + 1)
        extra = (again + result["sweep"]["median_us"]) / k
        result["over_bare_with_sweep_pct"] = 100.0 * (g - base + extra) / base
    return result


def _time_sweep(st: Stack, snap_kv, snap_state, iters: int, interval: int) -> dict:
    """The sweep of every request's cached prompt (every layer's digest and SGLang's SWEEP
    fingerprint, ``canary.sweep_rows`` prefixes a launch), and its share of a step at one sweep
    every ``interval`` steps."""
    kv = _copy(snap_kv)
    held = {"state": _copy(snap_state)}
    prefixes = st.prompts()

    def sweep(_):
        with jax.set_mesh(st.mesh):
            held["state"] = ksj.sweep(st.canary, held["state"], kv[0], prefixes, layers=kv)

    timed = timing.device_time(sweep, lambda: jax.block_until_ready(held["state"]), iters=iters)
    return {"sweep": timed, "sweep_interval": interval,
            "sweep_per_step_us": timed["median_us"] / interval,
            "sweep_violations": int(ksj.violation_counts(held["state"]).sum())}


def glue(bs: int, ctx: int, tokens: str = "feed") -> dict:
    """The canary-only step (the ``kv`` stack, the idle model) lowered for CUDA with
    ``pallas_triton`` on any machine (an abstract H200 mesh): StableHLO op counts before XLA's
    passes. The custom calls are the canary's kernels; everything else is glue XLA launches
    around them (fused on the GPU, but each fusion, copy and loop trip is a launch)."""
    import collections
    import dataclasses
    import re

    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    st = Stack("kv", bs, ctx, 2, tokens)
    st.canary = dataclasses.replace(st.canary, implementation="pallas_triton")
    st.feed = ksj.TokenFeed(st.canary) if tokens == "feed" else None
    st.build()
    _, fb, ids = st.decodes[0]
    ids = ids.array if isinstance(ids, ksj.TokenDelta) else ids
    state = st.canary.init_state()
    h200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    mesh = AbstractMesh((1, 1), ("data", "tensor"), axis_types=(AxisType.Auto, AxisType.Auto),
                        abstract_device=h200)
    with jax.sharding.use_abstract_mesh(mesh), jax.enable_x64(True):
        canary = dataclasses.replace(st.canary, mesh=jax.sharding.get_abstract_mesh())
        idle = ksj.guard_model_step(canary, st.idle_model, batch_argnum=0, pool_argnum=1,
                                    fused_kv=lambda out, pool: out[1][0])
        specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
                             if isinstance(x, jax.Array) else x,
                             (state, ids, None, False, fb, st.kv_pool))
        text = idle.jitted.trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
    ops = collections.Counter(re.findall(r"= \"?((?:stablehlo|chlo)\.[a-z_]+)", text))
    return {"bs": bs, "ctx": ctx, "tokens": tokens, "kernels": ops.pop("stablehlo.custom_call", 0),
            "while_loops": ops.get("stablehlo.while", 0), "ops": dict(ops.most_common())}


def main(argv=None) -> int:
    with warnings.catch_warnings():
        # CPU backends cannot donate every buffer the steps donate; expected (the caller's
        # filters are restored on return).
        warnings.filterwarnings("ignore", message=".*donated buffers.*")
        return _main(argv)


def _main(argv) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--what", default="kv,runner")
    p.add_argument("--bs", default="8,64")
    p.add_argument("--ctx", default="512,2048")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true", help="tiny sizes (CPU check of the script)")
    p.add_argument("--manager", action="store_true",
                   help="run the guarded step with the runtime manager (log mode) after it")
    p.add_argument("--tokens", default="feed",
                   help="feed (the ids kept on the device, deltas sent), full (whole histories "
                        "every step), or full,feed (both, in this order)")
    p.add_argument("--coverage-window", type=int, default=0, metavar="N",
                   help="the canary also digests every layer's K and V, checking about 1/N of "
                        "the read slots a step (0: off, SGLang's fingerprint alone)")
    p.add_argument("--sweep-interval", type=int, default=64, metavar="K",
                   help="with a window: the steps between sweeps the sweep's time is spread "
                        "over (default 64)")
    p.add_argument("--glue", action="store_true",
                   help="print the canary-only step's op counts, lowered for CUDA (any machine; "
                        "first --bs / --ctx), as JSON, and time nothing")
    a = p.parse_args(argv)
    if a.smoke:
        a.bs, a.ctx, a.iters = "2", "16", 3
    if a.glue:
        print(json.dumps(glue(int(a.bs.split(",")[0]), int(a.ctx.split(",")[0]),
                              a.tokens.split(",")[0])))
        return 0
    tokens = a.tokens.split(",")
    if not tokens or any(t not in ("feed", "full") for t in tokens):
        p.error(f"--tokens takes feed, full or both (comma-separated), got {a.tokens!r}")
    if a.coverage_window < 0:
        p.error(f"argument --coverage-window: must be >= 0 (0: off), got {a.coverage_window}")
    if a.sweep_interval < 1:
        p.error(f"argument --sweep-interval: must be >= 1, got {a.sweep_interval}")
    rows, errors = [], []
    cases = itertools.product(a.what.split(","), (int(x) for x in a.bs.split(",")),
                              (int(x) for x in a.ctx.split(",")), tokens)
    for what, bs, ctx, tok in cases:
        try:
            row = _run_case(what, bs, ctx, a.iters, manager=a.manager, tokens=tok,
                            window=a.coverage_window, sweep_interval=a.sweep_interval)
        except Exception as e:  # one failing case must not hide the others
            errors.append(f"{what} bs={bs} ctx={ctx} tokens={tok}: {type(e).__name__}: {e}")
            print(errors[-1], file=sys.stderr)
            continue
        rows.append(row)
        print(f"{what:6s} bs={bs:3d} ctx={ctx:5d} {tok:4s}  sglang-jax "
              f"{row['sglang_jax']['median_us']:9.1f} us  guarded "
              f"{row['guarded']['median_us']:9.1f} us  canary alone "
              f"{row['canary_only']['median_us']:8.1f} us  share "
              f"{row['share_pct']:5.1f}% / {row['canary_only_share_pct']:5.1f}%  "
              f"violations {row['violations']}" + (
                  f"  window {row['coverage_window']}: sweep {row['sweep']['median_us']:.1f} us "
                  f"= {row['sweep_per_step_us']:.2f} us/step, canary alone "
                  f"{row['canary_only_unswept']['median_us']:.1f} us N steps after a sweep, "
                  f"over bare with the sweep {row['over_bare_with_sweep_pct']:.2f}%"
                  if row["coverage_window"] else ""),
              flush=True)
    result = {"environment": common.environment(), "rows": rows, "errors": errors}
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "sglang_jax_step.json"), "w") as f:
            json.dump(result, f, indent=1)
    bad = errors or any(r["violations"] or r.get("sweep_violations") for r in rows)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
