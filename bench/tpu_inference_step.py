"""The tpu-inference canary's cost: the guarded step next to the bare step through a real
``TPUModelRunner`` (device time), and the guarded step compiled with libtpu for TPU topologies.

    JAX_PLATFORMS= python -m bench.tpu_inference_step [--bs 8,64] [--ctx 512,2048]  # on a GPU
                                                         [--iters 20] [--out DIR] [--smoke]
                                                         [--coverage-window 0,64]
    ncu --profile-from-start off -k regex:kvcanary --set full -o FILE \
        python -m bench.tpu_inference_step --bs 64 --ctx 2048 --iters 2 --ncu   # its kernels
    JAX_PLATFORMS=cpu python -m bench.tpu_inference_step --compile v5e:2x2,v6e:2x2
                                                         [--head-dim 128,64] [--bare] [--out DIR]
                                                         [--coverage-window 0,64]

``--coverage-window``: the guard's coverage windows, a case (or compile) each (0: SGLang's
layer-0 fingerprint only; N: every layer's K and V digested too, docs/spec.md §17). The timed
step is the guarded step alone: the sweep of cached blocks the window needs runs between steps,
every ``sweep_interval`` of them (the bench's guard: every ``window`` calls), and is timed on its
own (``sweep``, and ``sweep_per_step_us`` at one sweep every ``window`` steps).

Needs Python 3.12, jax 0.11.2 and ``requirements-tpu-inference.txt`` (``pip install --no-deps
-r``); ``--compile`` also needs libtpu (``pip install "jax[tpu]==0.11.2"``). The runner is the
tests' (``tests/_tpu_inference_runner.py``: a random-weight Qwen3 from a local ``config.json``,
vLLM's scheduler, the patches a machine without a TPU needs).

**Timing** (default). tpu-inference's attention is a Pallas kernel for TPUs only (RPA v3, Mosaic):
on a GPU the runner runs the tests' jnp stand-in of it (same KV layout, same slot rule; a gather
of each token's whole context, so the model step is slower than a real kernel's and the canary's
share smaller). The model: Qwen3, 4 layers, hidden 1024, 8 heads, 8 KV heads, head_dim 128, vocab
32000 (sglang-jax's bench model, ``bench/sglang_jax_step.py``; ``--layers`` sets its depth). Per
case, ``bs`` requests of ``ctx`` prompt tokens are prefilled through the runner with the guard
installed (so the canary holds every slot), then one decode step's ``runner.model_fn``
arguments are kept and replayed (the same KV written again, the same stamps: idempotent), timed
three ways:

1. ``bare``: the runner's own ``model_fn`` (the model's step jit);
2. ``guarded``: the guard's step as :func:`~kvcanary_jax.integrations.tpu_inference.install`
   runs it: the expected-id delta's jit, HEAD's, the runner's own ``model_fn`` and TAIL's, the
   canary state donated through them;
3. ``canary_only``: the same without the model (HEAD, the step's delta written in its one pass
   with the step's own ids, and TAIL);
4. with ``--delta-jit``, ``canary_only_delta_jit``: the canary alone with the delta applied by
   its own jit before HEAD (what the guard does with a delta bigger than the step's tokens):
   what HEAD's one pass saves;
5. with ``--one-jit``, ``guarded_one_jit``: the delta's jit, then HEAD -> the model's
   options-free step -> TAIL traced as one jit (:func:`~kvcanary_jax.integrations.
   tpu_inference.device.guarded_step`, what the decode loop runs each iteration, and how the
   guard ran normal steps until f4b6569): what splitting HEAD and TAIL from the model's own jit
   costs on the device.

Device time per call from CUPTI (``bench.timing.device_time``; wall clock on CPU). Reported: the
medians, ``share_pct = (guarded - bare) / guarded`` and ``canary_only / (bare + canary_only)``;
every guarded run must end with 0 violations.

**Compiling** (``--compile``). The guard's jits at a serving size (256 requests of up to 8,192
tokens, 8,192 tokens a step, a 1M-slot cache: 65,536 blocks of 16; the tests' Qwen3, 2 layers,
2 KV heads) are traced with abstract arguments placed on one device of each TPU topology
(``jax.experimental.topologies``) and compiled by libtpu: the expected-id delta's (8,192 ids),
HEAD's (one pass, and split in two: ``head split``) and TAIL's (one pass): ``ok`` or the
compiler's message, the seconds (trace, lower, compile) and ``memory_analysis()``. The model is
not in them (the guard runs the runner's own step between HEAD and TAIL); ``--bare`` adds the
model's step, the real RPA kernel in it (its TPU generation given, the host being a CPU), with
its TPU compiler options, for comparison. Nothing runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import pathlib
import sys
import time
import warnings

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the runner harness: tests/_tpu_inference_runner.py
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # others may hold libtpu's lockfile

import _tpu_inference_runner as harness  # noqa: E402  (sets the TPU identity variables first)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from kvcanary_jax.bench import common, timing  # noqa: E402
from kvcanary_jax.integrations import tpu_inference as kti  # noqa: E402
from kvcanary_jax.integrations.tpu_inference import device as kdevice  # noqa: E402
from kvcanary_jax.integrations.tpu_inference import host as khost  # noqa: E402

BENCH_MODEL = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 4,
               "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 32000}
BLOCK = harness.BLOCK_SIZE
# The compile's serving size.
SERVING = {"reqs": 256, "context": 8192, "tokens": 8192, "blocks": 1 << 16}
TOPOLOGIES = ("v5e:2x2", "v6e:2x2")
MEMORY = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
          "temp_size_in_bytes", "generated_code_size_in_bytes")


# ------------------------------------------------------------------------------------ timing
@dataclasses.dataclass
class Decode:
    """A decode step as the runner ran it: ``runner.model_fn``'s arguments and the guard's
    expected-id delta (the batch's pool rows; its ids are set again by a replay: idempotent)."""

    args: tuple
    delta: kti.TokenDelta
    pending: object  # the host's PendingDelta, for HEAD's delta (host.head_delta)


def bench_model(layers: int | None = None) -> dict:
    """The bench's Qwen3 (``layers``: its depth, 4 unless given; 28 is Qwen3-0.6B's)."""
    return {**BENCH_MODEL, **({"num_hidden_layers": layers} if layers else {})}


def _fill(bs: int, ctx: int, iters: int, smoke: bool, window: int = 0,
          layers: int | None = None):
    """A runner with the guard, ``bs`` requests prefilled, and the next decode step's call."""
    blocks_per_req = -(-(ctx + 4 * iters + 2 * BLOCK) // BLOCK)
    model = None if smoke else bench_model(layers)
    vocab = (model or harness.qwen3_config(128))["vocab_size"]
    chunk = max(64, min(512, bs * ctx))  # the stand-in attention gathers each token's context
    prefill_steps = -(-bs * ctx // chunk)
    e = harness.Engine(num_blocks=bs * (blocks_per_req + -(-prefill_steps // BLOCK)) + 8,
                       max_num_seqs=bs, max_num_batched_tokens=chunk, continue_decode=False,
                       max_model_len=(blocks_per_req + -(-prefill_steps // BLOCK)) * BLOCK,
                       model=model, prefix_caching=False)
    bare = e.runner.model_fn
    guard = kti.install(e.runner, mode="log", real_data="all", coverage_window=window,
                        sweep_interval=window)
    plans, plan = [], guard.book.plan
    guard.book.plan = lambda runner, order: plans.append(plan(runner, order)) or plans[-1]
    rng = np.random.default_rng(0)
    for r in range(bs):
        # Requests decode while others still prefill (vLLM schedules decodes first): enough
        # tokens that none finishes before the kept decode step.
        e.add(f"r{r}", rng.integers(3, vocab, ctx).tolist(), prefill_steps + 4 * iters)
    while any(n > 1 for n in e.step().num_scheduled_tokens.values()):
        pass  # prefill (chunked), then one decode step has run
    kept, guarded = [], e.runner.model_fn
    e.runner.model_fn = lambda *a, **k: (kept.append(a), guarded(*a, **k))[1]
    out = e.step()
    e.runner.model_fn = guarded
    if sorted(out.num_scheduled_tokens.values()) != [1] * bs:
        raise RuntimeError(f"the kept step is not {bs} decodes: {out.num_scheduled_tokens}")
    p = plans[-1]
    delta = kti.TokenDelta(rows=jnp.asarray(p.rows), starts=jnp.asarray(p.starts),
                           counts=jnp.asarray(p.counts), ids=jnp.asarray(p.ids))
    return e, guard, bare, Decode(kept[0][:11], delta, p)


def _violations(state) -> int:
    return int(np.asarray(state.violation_write_index)[:, 0].sum())


def run_case(bs: int, ctx: int, iters: int, smoke: bool = False, window: int = 0,
             ncu: bool = False, one_jit: bool = False, delta_jit: bool = False,
             layers: int | None = None) -> dict:
    """One case's row. ``ncu``: nothing timed; the canary-only step runs ``iters`` times
    between ``cudaProfilerStart`` and ``cudaProfilerStop`` (for ``ncu --profile-from-start
    off``: the bench's own CUPTI profiler and Nsight Compute's cannot share a process)."""
    e, guard, bare, decode = _fill(bs, ctx, iters, smoke, window, layers)
    step = e.runner.model.step_fn_no_options
    runner, canary = e.runner, guard.canary
    guard.manager.flush()
    if _violations(guard.state):
        raise RuntimeError("violations while filling the cache")
    seq_lens = np.asarray(decode.args[3].seq_lens)[:bs]
    row = {"bs": bs, "ctx": ctx, "coverage_window": window, "cached_tokens": {"min": int(seq_lens.min()) - 1,
                                                   "max": int(seq_lens.max()) - 1},
           "verify_entries_per_step": int(seq_lens.sum()),
           "attention": "jnp stand-in (RPA v3 is TPU-only)",
           "model": "tests' Qwen3" if smoke else bench_model(layers)}
    late = jnp.zeros((canary.data_shards * canary.max_reqs,), jnp.int32)

    def with_kv(args):
        return (args[0], runner.kv_caches, *args[2:])

    def bare_step(i):
        runner.kv_caches = list(bare(*with_kv(decode.args))[0])

    def timed_guarded(with_model: bool, inline: bool = True):
        holder = {"state": jax.tree.map(jnp.copy, guard.state)}
        run = _guarded_run(holder, canary, guard, runner, decode, late, with_kv,
                           bare if with_model else None, inline)
        result = timing.device_time(run, lambda: jax.block_until_ready(
            (runner.kv_caches, holder["state"])), iters=iters)
        return result, _violations(holder["state"])

    if ncu:
        return _profiled(row, canary, guard, runner, decode, late, with_kv, iters)
    row["bare"] = timing.device_time(bare_step, lambda: jax.block_until_ready(runner.kv_caches),
                                     iters=iters)
    row["guarded"], row["violations"] = timed_guarded(True)
    row["canary_only"], idle_violations = timed_guarded(False)
    if delta_jit:
        row["canary_only_delta_jit"], more = timed_guarded(False, inline=False)
        idle_violations += more
    if one_jit:
        holder = {"state": jax.tree.map(jnp.copy, guard.state)}
        run = _one_jit_run(holder, canary, guard, runner, decode, late, with_kv, step)
        row["guarded_one_jit"] = timing.device_time(run, lambda: jax.block_until_ready(
            (runner.kv_caches, holder["state"])), iters=iters)
        row["violations"] += _violations(holder["state"])
    row["violations"] += idle_violations
    if window:
        row.update(_time_sweep(guard, runner, iters, window))
    base, g, c = (row[k]["median_us"] for k in ("bare", "guarded", "canary_only"))
    row["share_pct"] = 100.0 * (g - base) / g
    row["canary_only_share_pct"] = 100.0 * c / (base + c)
    return row


def _with_delta(state, delta, canary):
    """``state`` with the step's expected-id delta applied, as the guard applies it (its own
    jit; call under x64)."""
    pool, valid = kti.delta_jit(state.expected_tokens, state.expected_valid_lens, delta,
                                canary=canary)
    return dataclasses.replace(state, expected_tokens=pool, expected_valid_lens=valid)


def _guarded_run(holder, canary, guard, runner, decode, late, with_kv, model, inline=True):
    """One guarded step as the guard runs it (``model`` None: no model between HEAD and TAIL),
    on ``holder["state"]``. ``inline`` False: the delta applied by its own jit first, HEAD
    then given a delta of no ids (the guard's path for a delta bigger than the step)."""
    md = kdevice.metadata(decode.args[3])
    ids, pos, delta = decode.args[2], decode.args[5], decode.delta
    unwritten = guard._all_written  # the step reads no KV from before the canary
    n = canary.data_shards
    rows, starts, counts, head_ids, fits = khost.head_delta(decode.pending, n, ids.shape[0] // n,
                                                            canary.context_len)
    if not inline:
        rows, starts, counts, head_ids = khost.applied_head_delta(
            decode.pending, n, ids.shape[0] // n, canary.context_len)
    separate = not (inline and fits)
    head_delta = kti.TokenDelta(*(jnp.asarray(x) for x in (rows, starts, counts, head_ids)))

    def run(i):
        with jax.enable_x64(True):
            st = _with_delta(holder["state"], delta, canary) if separate else holder["state"]
            st, passes = kti.head_jit(st, head_delta, late, unwritten, md, ids, pos,
                                      canary=canary, split=False)
        if model is not None:
            runner.kv_caches = list(model(*with_kv(decode.args))[0])
        with jax.enable_x64(True):
            holder["state"] = kti.tail_jit(st, passes, kdevice.kv_arg(canary, runner.kv_caches),
                                           ids, pos, canary=canary)
    return run


def _one_jit_run(holder, canary, guard, runner, decode, late, with_kv, step):
    """The delta's jit, then HEAD -> ``step`` (the model's options-free step) -> TAIL as one
    jit, on ``holder["state"]``."""
    ids, pos, delta = decode.args[2], decode.args[5], decode.delta
    unwritten = guard._all_written
    shardings = [c.sharding for c in runner.kv_caches]
    state_sharding = NamedSharding(canary.mesh, P(canary.axes or None))

    model_x64 = bool(jax.config.read("jax_enable_x64"))

    def traced(state, rows, late, unwritten, state_leaves, kv, input_ids, md, *rest):
        def model(kv_in):
            with jax.enable_x64(model_x64):  # the model traced as the runner traces it
                return step(state_leaves, kv_in, input_ids, md, *rest)
        return kdevice.guarded_step(canary, model, state, rows, md, input_ids, rest[1],
                                    list(kv), late, False, unwritten)

    # Static: the layer map and the two rank flags (the runner's own jit's).
    jitted = jax.jit(traced, static_argnums=(10, 13, 14), donate_argnums=(0, 5),
                     keep_unused=True,
                     out_shardings=(state_sharding, (shardings, None, None, None)))

    def run(i):
        with jax.enable_x64(True):
            st = _with_delta(holder["state"], delta, canary)
            args = with_kv(decode.args)
            holder["state"], out = jitted(st, delta.rows, late, unwritten, args[0],
                                          list(args[1]), *args[2:])
        runner.kv_caches = list(out[0])
    return run


def _profiled(row, canary, guard, runner, decode, late, with_kv, iters: int) -> dict:
    import torch

    holder = {"state": jax.tree.map(jnp.copy, guard.state)}
    step = _guarded_run(holder, canary, guard, runner, decode, late, with_kv, None)

    def run():
        step(0)
        jax.block_until_ready((runner.kv_caches, holder["state"]))

    run()  # compiled outside the profiled range
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for _ in range(iters):
        run()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    row["profiled_calls"] = iters
    row["violations"] = _violations(holder["state"])
    return row


def _time_sweep(guard, runner, iters: int, interval: int) -> dict:
    """The guard's sweep (every cached chain of blocks: SGLang's SWEEP fingerprint and, with a
    window, every layer's digest), on a copy of the state, and its share of a step at one sweep
    every ``interval`` steps (the bench's guard sweeps every ``window`` calls)."""
    kept = guard.state
    guard.state = jax.tree.map(jnp.copy, kept)
    try:
        timed = timing.device_time(lambda i: guard.sweep(), lambda: jax.block_until_ready(
            guard.state), iters=iters)
        violations = _violations(guard.state)
    finally:
        guard.state = kept
    blocks = sum(len(chain) for r in range(guard.canary.data_shards)
                 for chain in guard.cached.prefixes(r))
    return {"sweep": timed, "sweep_interval": interval, "swept_blocks": blocks,
            "sweep_per_step_us": timed["median_us"] / interval, "sweep_violations": violations}


# ----------------------------------------------------------------------------------- compile
def _pretend_tpu(device) -> None:
    """The RPA kernel asks ``jax.devices()`` for its TPU generation and tuning table: give it
    the topology's (the host is a CPU)."""
    from tpu_inference.kernels.ragged_paged_attention.v3 import (
        kernel, kernel_hd64, tuned_block_sizes, tuned_block_sizes_hd64, util)

    kind = device.device_kind  # "TPU v5 lite", "TPU v6 lite"
    version = int(kind.split()[1][1:])
    name = f"TPU v{version}{'e' if kind.endswith(' lite') else ''}"
    for mod in (kernel, kernel_hd64, tuned_block_sizes, tuned_block_sizes_hd64, util):
        if hasattr(mod, "get_tpu_version"):
            mod.get_tpu_version = lambda: version
        if hasattr(mod, "get_device_name"):
            mod.get_device_name = lambda num_devices=None: name


def _abstract_model(config, mesh):
    """The model's options-free step and its state, abstract, on ``mesh`` (the runner's
    ``run_model_impl``; its parameters replicated: a one-device mesh)."""
    from flax import nnx
    from tpu_inference.models.common import model_loader

    cls = model_loader._get_model_architecture(config.model_config.hf_config)
    config.model_config.dtype = jnp.bfloat16
    with jax.set_mesh(mesh):
        model = nnx.eval_shape(lambda: cls(config, jax.random.key(0), mesh))
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    replicated = NamedSharding(mesh, P())
    leaves = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated) for x in leaves)

    def step(state_leaves, kv_caches, *args):
        return nnx.merge(graphdef, jax.tree.unflatten(treedef, state_leaves))(kv_caches, *args)

    return step, leaves


def _compiled(jitted, args, mesh) -> dict:
    t0 = time.perf_counter()
    try:
        # A canary jit (a function returning its trace) traces and compiles under x64; the
        # model's step under the process's own setting, as the runner's.
        canary = not hasattr(jitted, "trace")
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), jax.enable_x64(
                canary or jax.config.read("jax_enable_x64")):
            traced = jitted(*args) if canary else jitted.trace(*args)
            compiled = traced.lower(lowering_platforms=("tpu",)).compile()
    except Exception as e:  # noqa: BLE001  (the report names every failure)
        text = str(e)
        at = text.find("Mosaic failed")
        text = text[at:] if at >= 0 else f"{type(e).__name__}: {text}"
        return {"ok": False, "seconds": round(time.perf_counter() - t0, 1),
                "error": "\n".join(text.splitlines()[:3])}
    memory = compiled.memory_analysis()
    return {"ok": True, "seconds": round(time.perf_counter() - t0, 1),
            **{k: int(getattr(memory, k, 0) or 0) for k in MEMORY}}


def compile_rows(topologies, head_dims, bare: bool = False, windows=(0,)) -> list[dict]:
    """Per topology and head_dim: the guarded step of each coverage window (and with ``bare``
    the bare step) compiled."""
    from jax.experimental import topologies as topo
    from tpu_inference.layers.common.attention_metadata import AttentionMetadata

    n, ctx, t, blocks = (SERVING[k] for k in ("reqs", "context", "tokens", "blocks"))
    rows = []
    config = None
    for head_dim, topology in itertools.product(head_dims, topologies):
        device = topo.get_topology_desc(platform="tpu", topology_name=topology).devices[0]
        _pretend_tpu(device)
        mesh = Mesh(np.array([device]).reshape(1, 1), ("data", "model"))
        if config is None or config.model_config.hf_text_config.head_dim != head_dim:
            config = harness.vllm_config(head_dim=head_dim, max_num_seqs=n, max_model_len=ctx,
                                         max_num_batched_tokens=t)
        step, leaves = _abstract_model(config, mesh)
        hf = config.model_config.hf_text_config
        kv_heads = hf.num_key_value_heads
        packing = 2  # bf16
        rows_ = -(-(kv_heads if head_dim == 64 else 2 * kv_heads) // packing)
        shape = (blocks, BLOCK, rows_, packing, -(-head_dim // 128) * 128)
        spec = P("data", None, "model", None, None)  # the runner's (its 2-D mesh)
        kv_sharding = NamedSharding(mesh, spec)
        kv = [jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=kv_sharding)
              for _ in range(hf.num_hidden_layers)]
        layout = kti.kv_layout(shape, jnp.bfloat16, head_dim=head_dim, kv_heads=kv_heads,
                               head_shards=1, block_size=BLOCK)
        rep = NamedSharding(mesh, P())
        i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32, sharding=rep)  # noqa: E731
        md = AttentionMetadata(input_positions=i32(t), block_tables=i32(n * ctx // BLOCK),
                               seq_lens=i32(n), query_start_loc=i32(n + 1),
                               request_distribution=i32(3))
        layer_map = tuple((f"layer.{i}", i) for i in range(len(kv)))
        model_args = (leaves, kv, i32(t), md, None, i32(t), layer_map, None, None, True, True)
        options = dict(harness.TPU_STEP_OPTIONS) or None
        base = {"topology": topology, "device_kind": device.device_kind, "head_dim": head_dim,
                "layout": layout.kind, "kv_shape": list(shape), **SERVING}
        for window in windows:
            canary = kti.TpuInferenceCanary(
                layout=layout, layer_index=0, layers=("layer.0",), num_slots=blocks * BLOCK,
                max_reqs=n, max_blocks=ctx // BLOCK, pool_rows=2 * n, mesh=mesh, kv_spec=spec,
                implementation="pallas_mosaic_tpu", coverage_window=window,
                num_layers=len(kv) if window else None)
            for name, jitted, args in _canary_jits(canary, mesh, md, kv, n, t):
                rows.append({**base, "step": name, "coverage_window": window,
                             **_compiled(jitted, args, mesh)})
                print(_fmt(rows[-1]), flush=True)
        if bare:
            jitted = jax.jit(step, static_argnums=(6, 9, 10), donate_argnums=1,
                             out_shardings=([kv_sharding] * len(kv), None, None, None),
                             compiler_options=options)
            rows.append({**base, "step": "bare", **_compiled(jitted, model_args, mesh)})
            print(_fmt(rows[-1]), flush=True)
    return rows


def _canary_jits(canary, mesh, md, kv, n: int, t: int):
    """``(name, jit, abstract args)`` of the guard's jits at this size: the delta (``t`` ids),
    HEAD (one pass and split; its delta of ``t`` ids) and TAIL (one pass)."""
    state_sharding = NamedSharding(mesh, P(canary.axes or None))
    rep = NamedSharding(mesh, P())
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32, sharding=rep)  # noqa: E731
    placed = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=state_sharding)  # noqa: E731
    with jax.enable_x64(True):
        state = jax.tree.map(placed, kdevice.state_shapes(canary))
        delta = kti.TokenDelta(rows=i32(n), starts=i32(n), counts=i32(n), ids=i32(t, 3))
        unwritten = i32(SERVING["blocks"])
        head_delta = kti.TokenDelta(rows=i32(n), starts=i32(n), counts=i32(n), ids=i32(t, 3))
        head_args = (state, head_delta, i32(n), unwritten, kdevice.metadata(md), i32(t), i32(t))
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            passes = jax.tree.map(placed, kti.head_jit.trace(
                *head_args, canary=canary, split=False).out_info[1])
    yield ("delta", lambda *a: kti.delta_jit.trace(*a, canary=canary),
           (state.expected_tokens, state.expected_valid_lens, delta))
    for split in (False, True):
        yield ("head split" if split else "head",
               lambda *a, split=split: kti.head_jit.trace(*a, canary=canary, split=split),
               head_args)
    yield ("tail", lambda *a: kti.tail_jit.trace(*a, canary=canary),
           (state, passes, kdevice.kv_arg(canary, kv), i32(t), i32(t)))


def _fmt(row: dict) -> str:
    step = row["step"] + (f" w{row['coverage_window']}" if row.get("coverage_window") else "")
    head = f"{row['topology']:9s} head_dim {row['head_dim']:3d} {step:11s}"
    if not row["ok"]:
        return f"{head} ERROR ({row['seconds']} s): {row['error'].splitlines()[0]}"
    mib = {k: row[k] / 2**20 for k in MEMORY}
    return (f"{head} ok {row['seconds']:6.1f} s  arg {mib['argument_size_in_bytes']:8.1f} MiB "
            f"out {mib['output_size_in_bytes']:8.1f} alias {mib['alias_size_in_bytes']:8.1f} "
            f"temp {mib['temp_size_in_bytes']:8.1f} code {mib['generated_code_size_in_bytes']:6.1f}"
            " MiB")


# -------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    with warnings.catch_warnings():
        # CPU backends cannot donate every buffer the steps donate; expected (the caller's
        # filters are restored on return).
        warnings.filterwarnings("ignore", message=".*donated buffers.*")
        return _main(argv)


def _main(argv) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bs", default="8,64")
    p.add_argument("--ctx", default="512,2048")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--smoke", action="store_true",
                   help="the tests' tiny Qwen3 at bs 2 / ctx 16 (CPU check of the script)")
    p.add_argument("--compile", default="",
                   help="TPU topologies to compile the guarded step for (e.g. v5e:2x2,v6e:2x2)")
    p.add_argument("--head-dim", default="128,64", help="--compile: the layouts (128, 64)")
    p.add_argument("--bare", action="store_true", help="--compile: the bare step too")
    p.add_argument("--coverage-window", default="0",
                   help="the guard's coverage windows, a case each (0: off; e.g. 0,64)")
    p.add_argument("--out", default=None, help="a directory for tpu_inference_step.json")
    p.add_argument("--layers", type=int, default=None,
                   help="the timed model's depth (4 unless given; 28 is Qwen3-0.6B's): with "
                        "--coverage-window 0 the canary reads layer 0's KV at any depth, "
                        "while the step grows with it")
    p.add_argument("--one-jit", action="store_true",
                   help="also time HEAD -> model -> TAIL traced as one jit (guarded_one_jit)")
    p.add_argument("--delta-jit", action="store_true",
                   help="also time the canary alone with the delta through its own jit "
                        "(canary_only_delta_jit)")
    p.add_argument("--ncu", action="store_true",
                   help="time nothing: run the canary-only step --iters times inside "
                        "cudaProfilerStart/Stop, for ncu --profile-from-start off")
    a = p.parse_args(argv)
    if a.ncu and (a.compile or a.out):
        p.error("--ncu times nothing (the kernels run for an outside profiler): it takes "
                "neither --compile nor --out")
    windows = [int(w) for w in a.coverage_window.split(",")]
    harness.patch_for_cpu(stand_in_attention=not a.compile)
    errors, rows = [], []
    if a.compile:
        rows = compile_rows(a.compile.split(","), [int(h) for h in a.head_dim.split(",")],
                            bare=a.bare, windows=windows)
        errors = [f"{r['topology']} head_dim {r['head_dim']} {r['step']} window "
                  f"{r.get('coverage_window', 0)}: {r['error']}" for r in rows if not r["ok"]]
    else:
        if a.smoke:
            a.bs, a.ctx, a.iters = "2", "16", 3
        for bs, ctx, window in itertools.product((int(x) for x in a.bs.split(",")),
                                                 (int(x) for x in a.ctx.split(",")), windows):
            try:
                row = run_case(bs, ctx, a.iters, a.smoke, window, ncu=a.ncu,
                               one_jit=a.one_jit, delta_jit=a.delta_jit, layers=a.layers)
            except Exception as e:  # one failing case must not hide the others
                errors.append(f"bs={bs} ctx={ctx} window={window}: {type(e).__name__}: {e}")
                print(errors[-1], file=sys.stderr)
                continue
            rows.append(row)
            if a.ncu:
                print(f"bs={bs:3d} ctx={ctx:5d} window {window:3d}  {a.iters} canary-only calls "
                      f"profiled, violations {row['violations']}", flush=True)
                continue
            print(f"bs={bs:3d} ctx={ctx:5d} window {window:3d}  bare {row['bare']['median_us']:9.1f} us  guarded "
                  f"{row['guarded']['median_us']:9.1f} us  canary alone "
                  f"{row['canary_only']['median_us']:8.1f} us  share {row['share_pct']:5.1f}% / "
                  f"{row['canary_only_share_pct']:5.1f}%  violations {row['violations']}"
                  + (f"  sweep {row['sweep']['median_us']:.1f} us ({row['swept_blocks']} blocks, "
                     f"{row['sweep_per_step_us']:.1f} a step)" if window else "")
                  + (f"  one jit {row['guarded_one_jit']['median_us']:.1f} us"
                     if a.one_jit else "")
                  + (f"  canary alone, delta's own jit "
                     f"{row['canary_only_delta_jit']['median_us']:.1f} us"
                     if a.delta_jit else ""), flush=True)
    result = {"environment": common.environment(), "rows": rows, "errors": errors}
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "tpu_inference_step.json"), "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    print(json.dumps({"rows": rows, "errors": errors}))
    bad = errors or any(r.get("violations") or r.get("sweep_violations") for r in rows)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
