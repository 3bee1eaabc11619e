"""The guarded model step: HEAD -> sglang-jax's model -> TAIL in one ``jax.jit``, once per KV
shard.

**Sharding: one canary per KV shard.** sglang-jax shards each layer buffer over its head
dimension (0.0.2: ``P(None, "tensor")``; 0.1.0rc0: ``P("data", None, "tensor", None, None)``), so
every device of a DP rank holds every slot of that rank but only its own heads. The canary runs
once per shard, under ``shard_map``: each shard keeps its own state (canary buffers, plans, ring,
counters: stacked along a leading axis sharded over the KV's DP and head mesh axes), reads its
rank's batch segment, and fingerprints the first K strip(s) of *its own* heads. This is what
SGLang does under tensor parallelism (each TP rank has its own canary over its own KV shard), and
the alternative (one canary on replicated slot metadata with a sharded source) does not work
here: the fingerprint chains the bytes of one slot through a non-linear hash, so a shard cannot
hash its part alone and combine; a replicated kernel would make XLA gather the sharded buffer
onto every device each step, and it would only ever fingerprint the heads of one shard. Per shard
costs no communication and covers every device's KV. The price: the metadata checks run on every
shard (in parallel, no wall-time cost), 32 bytes per slot per canary buffer per shard, and a
metadata fault is reported once per head shard (:func:`read_violations` says which shard reported
what). With data parallelism (0.1.0rc0, ``dp_size > 1``, the slot dimension sharded over
``data``) each rank owns its slots and its batch segment: each rank's canaries see that segment
only (split on the device, no host work), as :func:`kvcanary_jax.make_sharded_step` runs one
canary per rank.

**The step.** :func:`guard_model_step` wraps a jitted model step: one ``jax.jit`` runs
HEAD (scatter, plan, verify + write) -> the model -> TAIL (verify + write with the plans HEAD
built, fingerprinting the model's new canary-layer buffer), with the canary state and the KV pool
donated. The model is traced under the caller's own 64-bit setting; only the canary runs with
64-bit types. :func:`sweep` re-verifies prefixes held by the radix cache (:func:`radix_prefixes`)
against the TAIL buffers between steps.

Shapes follow sglang-jax's buckets (``bs``, tokens, ``cache_loc`` length): one compilation per
bucket, as the model step itself. Warm-up / precompile batches go through the unguarded step.

**Cost per step**, besides the canary's own ops (SGLang's: HEAD and TAIL each verify every cached
position of the batch and write every new one): the slot table, ``(bs + 1) * context_len`` int32
gathered from ``cache_loc`` on the device (no host transfer), and the expected ids: with
``token_rows``, one int32 array of ``bs`` + the token bucket from the host (decode), its scatter
into the kept pool and the batch's rows of the pool gathered (``(bs + 1) * context_len``);
without, one int32 array the size of ``cache_loc`` from the host every step (23 us of a 64 x
2,048 decode step on the H200), compacted on the device and scattered into the pool by SGLang's
scatter. ``bench/sglang_jax_step.py`` measures the whole against sglang-jax's step.

**Coverage** (ours, ``canary.coverage_window``; docs/spec.md §17): the step also hands the
runtime every layer of the pool (``kv_layers``), each shard its own heads of every layer, whole
slot rows read in place. TAIL stamps the digest of the slots the step wrote (after the model
wrote them) and checks it for the read slots of this step's phase; the cost is the bytes read:
every layer of the written slots, and every layer of about 1/N of the read slots.

:func:`per_shard`, :func:`kv_dict` and :func:`shard_kv` (the per-shard execution and the fused
buffers as the runtime's KV) serve the sweep and the HiCache hook as well.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from kvcanary_jax import _config
from kvcanary_jax.integrations.sglang_jax.batch import device_batch, fed_pool
from kvcanary_jax.integrations.sglang_jax.layout import (
    SglangJaxCanary,
    fused_kv_sources,
    layer_source,
    layer_sources,
    require_int,
)
from kvcanary_jax.integrations.sglang_jax.tokens import TokenDelta
from kvcanary_jax.runtime.kv import digest_reads_rows
from kvcanary_jax.runtime.rebase import Rebaser
from kvcanary_jax.runtime.state import state_jit
from kvcanary_jax.runtime.step import head, tail

__all__ = [
    "guard_model_step",
    "per_shard",
    "kv_dict",
    "shard_kv",
]


def _first(tree):
    return jax.tree.map(lambda x: x[0], tree)


def _stack1(tree):
    return jax.tree.map(lambda x: x[None], tree)


def per_shard(canary: SglangJaxCanary, fn, state, *, rank=None, shared=None, kv=None,
              stacked=None):
    """Run ``fn(shard_state, rank_inputs, shared, local_kv, shard_stacked) -> (shard_state,
    extra)`` once per canary shard, under ``shard_map`` over the canary's mesh; returns the
    stacked states and extras. ``state`` and ``stacked`` are stacked per shard; ``rank`` is
    split in equal segments over the DP axes (each rank's batch segment; whole without DP);
    ``shared`` is replicated; ``kv`` is a fused buffer, each shard its local block."""
    if not canary.axes:
        st, extra = fn(_first(state), rank, shared, kv,
                       None if stacked is None else _first(stacked))
        return _stack1(st), _stack1(extra)

    def body(st, rk, sh, local, stk):
        st, extra = fn(_first(st), rk, sh, local, None if stk is None else _first(stk))
        return _stack1(st), _stack1(extra)

    spec = P(canary.axes)
    rank_spec = P(canary.dp_axes) if canary.dp_axes else P()
    kv_spec = P() if kv is None else canary.kv_spec
    specs = (spec, rank_spec, P(), kv_spec, spec)
    args = tuple(_placed(canary.mesh, x, sp) for x, sp in
                 zip((state, rank, shared, kv, stacked), specs))
    return jax.shard_map(body, mesh=canary.mesh, in_specs=specs, out_specs=(spec, spec),
                         check_vma=False)(*args)


def _placed(mesh, tree, spec):
    """``tree``'s arrays laid out as ``spec`` over ``mesh`` (inside the jit). sglang-jax
    0.1.0rc0 builds its mesh with Explicit axes, where ``shard_map`` takes only inputs already
    sharded as its ``in_specs`` say (host arrays, e.g. the expected ids, arrive unsharded):
    resharded there; a constraint on other meshes."""
    sharding = NamedSharding(mesh, spec)
    explicit = all(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ()))
    place = jax.sharding.reshard if explicit else jax.lax.with_sharding_constraint
    return jax.tree.map(lambda x: place(x, sharding), tree)


def kv_dict(canary: SglangJaxCanary, local):
    """The runtime's KV of one shard: ``local`` is the canary layer's local block, or with a
    coverage window ``(that block, every layer's local block)``: SGLang's fingerprint over the
    canary layer's K strips, and every layer's whole slot rows for the digest (fused layers,
    ``{"layers": {"KV": [...]}}``)."""
    if not canary.coverage_window:
        return {"FULL": {"K": list(fused_kv_sources(local, k_heads=canary.k_heads))}}
    buffer, layers = local
    return {"FULL": {"K": list(fused_kv_sources(buffer, k_heads=canary.k_heads)),
                     "layers": {"KV": [_layer(canary, b) for b in layers]}}}


def _layer(canary: SglangJaxCanary, buffer):
    """One layer's digest sources (:func:`kvcanary_jax.runtime.kv.digest_reads_rows`)."""
    if digest_reads_rows(canary.implementation, buffer):
        return layer_sources(buffer)
    return layer_source(buffer)


def shard_kv(canary: SglangJaxCanary, buffer, layers):
    """What :func:`per_shard` takes as ``kv`` (each leaf split as the pool is): the canary
    layer's fused buffer, and with a coverage window every layer's (checked: a missing list, or
    one without ``num_layers`` buffers, is a ValueError naming the setting)."""
    if not canary.coverage_window:
        return buffer
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
        raise ValueError(
            f"kv-canary sglang-jax: coverage_window {canary.coverage_window} digests every "
            "layer of the pool: hand every layer's fused buffer (the pool's kv_buffer list), "
            f"got {type(layers).__name__}")
    if len(layers) != canary.num_layers:
        raise ValueError(
            f"kv-canary sglang-jax: {len(layers)} layer buffer(s) handed over, the canary's "
            f"num_layers is {canary.num_layers}: every layer of the pool is digested (a missing "
            "one would go unverified)")
    return buffer, tuple(layers)


def _no_lut():
    return jnp.zeros((1,), jnp.int64)  # the runtime's placeholder when there is no SWA group


# The ForwardBatch fields the canary reads (both versions have them): each DP rank's segment is
# handed to its canary; the rest of the batch (attention metadata, LoRA, ...) stays the model's.
_BATCH_FIELDS = ("input_ids", "req_pool_indices", "seq_lens", "out_cache_loc", "positions",
                 "cache_loc", "extend_prefix_lens", "extend_seq_lens")


def _batch_fields(forward_batch) -> dict:
    return {name: getattr(forward_batch, name) for name in _BATCH_FIELDS}


def _resolved_ids(ids, future_map):
    """Input ids with sglang-jax's future placeholders (negative: ``-i`` is entry ``i`` of the
    future token map) resolved, as ``jitted_run_and_sample`` resolves them (clamped: no read
    out of bounds)."""
    top = future_map.shape[0] - 1
    return jnp.where(ids < 0, future_map[jnp.clip(-ids, 0, top)].astype(ids.dtype), ids)


def _head(canary: SglangJaxCanary, state, mode, fields, expected, table, future_map):
    cfg = canary.config

    def fn(st, rank, fut, _kv, _stacked):
        f, exp, tab = rank
        if fut is not None:
            f = {**f, "input_ids": _resolved_ids(f["input_ids"], fut)}
        b, cache_table, fed = device_batch(canary, _LocalBatch(mode, f), exp)
        pool = None
        if fed is not None:
            seq = b.all_ids_offsets[1:] - b.all_ids_offsets[:-1]
            st, pool = fed_pool(canary, st, seq, fed)
        st = head(cfg, st, b, cache_table if tab is None else tab, _no_lut(), expected_pool=pool)
        return st, b

    return per_shard(canary, fn, state, rank=(fields, expected, table), shared=future_map)


def _tail(canary: SglangJaxCanary, state, batches, kv):
    cfg = canary.config

    def fn(st, _rank, _shared, local, b):
        return tail(cfg, st, b, _no_lut(), kv_dict(canary, local)), None

    state, _ = per_shard(canary, fn, state, kv=kv, stacked=batches)
    return state


class _LocalBatch:
    """One DP rank's segment of the batch fields, read by :func:`device_batch` as a
    ``ForwardBatch``."""

    def __init__(self, forward_mode, fields: dict):
        self.forward_mode = forward_mode
        self.__dict__.update(fields)


def guard_model_step(canary: SglangJaxCanary, model_step: Callable, *, batch_argnum: int,
                     pool_argnum: int, fused_kv: Callable[[Any, Any], jax.Array],
                     static_argnums: Sequence[int] = (), future_map_argnum: int | None = None,
                     kv_layers: Callable[[Any, Any], Sequence[jax.Array]] | None = None):
    """Wrap sglang-jax's jitted model step with the canary: HEAD before it, TAIL after it.

    ``model_step(*args)`` is the model call (sglang-jax 0.0.2: ``ModelRunner``'s
    ``jitted_run_model(model_def, model_state_def, model_state_leaves, forward_batch,
    token_to_kv_pool, logits_metadata)``; 0.1.0rc0: the same over ``memory_pools``, or its
    fused ``jitted_run_and_sample``), ``args[batch_argnum]`` its ``ForwardBatch`` and
    ``args[pool_argnum]`` its KV pool (0.1.0rc0: its ``MemoryPools``); ``fused_kv(out, pool)``
    picks the canary layer's new fused buffer from the step's output (0.0.2: ``out[1][layer]``;
    0.1.0rc0: ``out[1]["token_to_kv_pool"][layer]``). ``future_map_argnum``: the argument holding
    sglang-jax's future token map (the fused decode step), whose entries resolve the batch's
    negative input ids for the canary as the step resolves them. ``kv_layers(out, pool)``
    (required with ``canary.coverage_window``, refused without): every layer's new fused buffer
    (0.0.2: ``out[1]``; 0.1.0rc0: ``out[1]["token_to_kv_pool"]``), digested at TAIL (the slots
    the step wrote are stamped, a share of those it read checked). Returns ``step(state, *args,
    expected=None, table=None) -> (state, out)``, one ``jax.jit`` with the canary state and the
    pool donated (use the buffers ``out`` returns, as sglang-jax does). ``expected``:
    :func:`expected_tokens` (required with ``token_checks``); ``table``: :func:`host_table` to
    plan from ``req_to_token`` instead of ``cache_loc``. With ``dp_size > 1`` every batch array,
    ``expected`` and ``table`` are split in ``dp_size`` equal segments, one per DP rank, each
    checked by that rank's canary.
    """
    named = {"batch_argnum": batch_argnum, "pool_argnum": pool_argnum}
    if future_map_argnum is not None:
        named["future_map_argnum"] = future_map_argnum
    for name, value in named.items():
        require_int(name, value)
        if value < 0:
            raise ValueError(f"kv-canary sglang-jax: {name} must be >= 0 (an index into the "
                             f"model step's positional arguments), got {value}")
    # What each argument number names, for the errors: "the batch and the KV pool" (and "the
    # future map" when one is given).
    what = {"batch_argnum": "the batch", "pool_argnum": "the KV pool",
            "future_map_argnum": "the future map"}
    things = [what[n] for n in named]
    things = " and ".join(things) if len(things) == 2 else f"{things[0]}, {things[1]} and {things[2]}"
    names = list(named)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if named[a] == named[b]:
                raise ValueError(f"kv-canary sglang-jax: {a} and {b} are both {named[a]}; "
                                 f"{things} are different arguments")
    if set(named.values()) & set(static_argnums):
        raise ValueError(f"kv-canary sglang-jax: {things} cannot be static arguments "
                         f"(static_argnums={tuple(static_argnums)})")
    if not callable(model_step) or not callable(fused_kv):
        raise TypeError("kv-canary sglang-jax: model_step and fused_kv must be callables")
    if canary.coverage_window and not callable(kv_layers):
        raise ValueError(
            f"kv-canary sglang-jax: coverage_window {canary.coverage_window} digests every layer "
            "of the pool: pass kv_layers=(out, pool) -> every layer's new fused buffer (0.0.2: "
            'out[1]; 0.1.0rc0: out[1]["token_to_kv_pool"])')
    if kv_layers is not None and not canary.coverage_window:
        raise ValueError("kv-canary sglang-jax: kv_layers is read by the coverage window only, "
                         "and this canary has coverage_window=0: set it on the canary, or drop "
                         "kv_layers")
    nfixed = 4  # state, expected, table, model_x64

    def traced(state, expected, table, model_x64, *args):
        fb = args[batch_argnum]
        fut = None if future_map_argnum is None else args[future_map_argnum]
        state, batches = _head(canary, state, fb.forward_mode, _batch_fields(fb), expected,
                               table, fut)
        with jax.enable_x64(model_x64):
            out = model_step(*args)
        pool = args[pool_argnum]
        layers = kv_layers(out, pool) if kv_layers is not None else None
        state = _tail(canary, state, batches, shard_kv(canary, fused_kv(out, pool), layers))
        return state, out

    jitted = state_jit(
        traced,
        static_argnums=(3,) + tuple(nfixed + a for a in static_argnums),
        donate_argnums=(0, nfixed + pool_argnum),
    )
    rebaser = Rebaser(canary.config)  # the coverage step counters kept from wrapping

    @_config.entry_point
    def step(state, *args, expected=None, table=None):
        if len(args) <= max(named.values()):
            raise TypeError(f"kv-canary sglang-jax: the model step takes {named}, got "
                            f"{len(args)} arguments")
        fb = args[batch_argnum]
        state = rebaser(state)
        array, sent = _expected_array(canary, expected, state, fb)
        _check_segments(canary, fb, array, table)
        new_state, out = jitted(state, array, table, _config.caller_had_x64(), *args)
        if sent is not None:  # dispatched: the state it returned holds the delta's ids
            sent.feed.commit(sent, state, new_state)
        return new_state, out

    step.jitted = jitted
    step.rebaser = rebaser
    return step


def _check_segments(canary: SglangJaxCanary, forward_batch, expected, table) -> None:
    """With data parallelism every batch array splits in ``dp_size`` equal segments (sglang-jax
    pads each rank's to the same size): refuse one that does not, before anything runs."""
    dp = canary.dp_size
    if dp == 1:
        return
    sizes = {name: getattr(forward_batch, name).shape[0] for name in _BATCH_FIELDS
             if getattr(forward_batch, name, None) is not None}
    if expected is not None:
        sizes["expected"] = expected.shape[0]
    if table is not None:
        sizes["table"] = table.shape[0]
    odd = {name: n for name, n in sizes.items() if n % dp}
    if odd:
        raise ValueError(f"kv-canary sglang-jax: with {dp} data-parallel ranks every batch "
                         f"array splits in {dp} equal segments (one per rank); {odd} do not")


def _expected_array(canary: SglangJaxCanary, expected, state, forward_batch):
    """The step's ``expected`` as the jitted step takes it, and the :class:`TokenDelta` to
    commit once the step is dispatched (None without ``token_rows``)."""
    if canary.token_rows is not None:  # implies token_checks (checked when it is built)
        if not isinstance(expected, TokenDelta):
            raise TypeError("kv-canary sglang-jax: this canary keeps token ids on the device "
                            "(token_rows): give each step a TokenFeed's delta, got "
                            f"{type(expected).__name__}")
        if expected.feed.canary != canary:
            raise ValueError("kv-canary sglang-jax: the TokenDelta comes from the feed of "
                             "another canary")
        sent = expected.feed.prepare(expected, state, forward_batch)
        return sent.array, sent
    if isinstance(expected, TokenDelta):
        raise TypeError("kv-canary sglang-jax: a TokenDelta needs a canary with token_rows; "
                        "this one takes expected_tokens(...)")
    return expected, None
