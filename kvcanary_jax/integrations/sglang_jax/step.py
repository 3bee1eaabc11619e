"""The guarded model step: HEAD -> sglang-jax's model -> TAIL in one ``jax.jit``, once per KV
shard.

**Sharding: one canary per KV shard.** sglang-jax 0.0.2 shards each layer buffer over its head
dimension (``P(None, "tensor")``; HEAD: ``P("data", None, "tensor", None, None)``), so every
device holds every slot but only its own heads. The canary runs once per shard, under
``shard_map``: each shard keeps its own state (canary buffers, plans, ring, counters: stacked
along a leading axis sharded over the KV's head-dimension mesh axes), reads the replicated batch,
and fingerprints the first K strip(s) of *its own* heads. This is what SGLang does under tensor
parallelism (each TP rank has its own canary over its own KV shard), and the alternative (one
canary on replicated slot metadata with a sharded source) does not work here: the fingerprint
chains the bytes of one slot through a non-linear hash, so a shard cannot hash its part alone and
combine; a replicated kernel would make XLA gather the sharded buffer onto every device each step,
and it would only ever fingerprint the heads of one shard. Per shard costs no communication and
covers every device's KV. The price: the metadata checks run on every shard (in parallel, no
wall-time cost), 32 bytes per slot per canary buffer per shard, and a metadata fault is reported
once per shard (:func:`read_violations` says which shard reported what). A buffer whose slot
dimension is sharded over a mesh axis of size > 1 (HEAD's data-parallel attention) is refused:
there each rank owns its slots and its own batch segment; run one canary per rank
(:func:`kvcanary_jax.make_sharded_step`).

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

:func:`per_shard` and :func:`kv_dict` (the per-shard execution and the fused buffer as the
canary's real-KV sources) serve the sweep as well.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kvcanary_jax import _config
from kvcanary_jax.integrations.sglang_jax.batch import device_batch, fed_pool
from kvcanary_jax.integrations.sglang_jax.layout import (
    SglangJaxCanary,
    fused_kv_sources,
    require_int,
)
from kvcanary_jax.integrations.sglang_jax.tokens import TokenDelta
from kvcanary_jax.runtime.step import head, tail

__all__ = [
    "guard_model_step",
    "per_shard",
    "kv_dict",
]


def _first(tree):
    return jax.tree.map(lambda x: x[0], tree)


def _stack1(tree):
    return jax.tree.map(lambda x: x[None], tree)


def per_shard(canary: SglangJaxCanary, fn, state, replicated, kv=None):
    """Run ``fn(shard_state, replicated, local_kv)`` once per KV shard; returns stacked states."""
    if not canary.axes:
        return _stack1(fn(_first(state), replicated, kv))

    def body(st, rep, local):
        return _stack1(fn(_first(st), rep, local))

    spec = P(canary.axes)
    kv_spec = P() if kv is None else canary.kv_spec
    return jax.shard_map(body, mesh=canary.mesh, in_specs=(spec, P(), kv_spec), out_specs=spec,
                         check_vma=False)(state, replicated, kv)


def kv_dict(canary: SglangJaxCanary, local_buffer):
    return {"FULL": {"K": list(fused_kv_sources(local_buffer, k_heads=canary.k_heads))}}


def _no_lut():
    return jnp.zeros((1,), jnp.int64)  # the runtime's placeholder when there is no SWA group


def _head(canary: SglangJaxCanary, state, batch, table, fed=None):
    cfg = canary.config

    def fn(st, rep, _):
        b, t, f = rep
        pool = None
        if f is not None:
            seq = b.all_ids_offsets[1:] - b.all_ids_offsets[:-1]
            st, pool = fed_pool(canary, st, seq, f)
        return head(cfg, st, b, t, _no_lut(), expected_pool=pool)

    return per_shard(canary, fn, state, (batch, table, fed))


def _tail(canary: SglangJaxCanary, state, batch, kv_buffer):
    cfg = canary.config
    return per_shard(canary, lambda st, b, kv: tail(cfg, st, b, _no_lut(), kv_dict(canary, kv)),
                      state, batch, kv_buffer)


def guard_model_step(canary: SglangJaxCanary, model_step: Callable, *, batch_argnum: int,
                     pool_argnum: int, fused_kv: Callable[[Any, Any], jax.Array],
                     static_argnums: Sequence[int] = ()):
    """Wrap sglang-jax's jitted model step with the canary: HEAD before it, TAIL after it.

    ``model_step(*args)`` is the model call (sglang-jax 0.0.2: ``ModelRunner``'s
    ``jitted_run_model(model_def, model_state_def, model_state_leaves, forward_batch,
    token_to_kv_pool, logits_metadata)``), ``args[batch_argnum]`` its ``ForwardBatch`` and
    ``args[pool_argnum]`` its KV pool; ``fused_kv(out, pool)`` picks the canary layer's new fused
    buffer from the step's output (0.0.2: ``out[1][layer]``). Returns
    ``step(state, *args, expected=None, table=None) -> (state, out)``, one ``jax.jit`` with the
    canary state and the pool donated (use the buffers ``out`` returns, as sglang-jax does).
    ``expected``: :func:`expected_tokens` (required with ``token_checks``); ``table``:
    :func:`host_table` to plan from ``req_to_token`` instead of ``cache_loc``.
    """
    for name, value in (("batch_argnum", batch_argnum), ("pool_argnum", pool_argnum)):
        require_int(name, value)
        if value < 0:
            raise ValueError(f"kv-canary sglang-jax: {name} must be >= 0 (an index into the "
                             f"model step's positional arguments), got {value}")
    if batch_argnum == pool_argnum:
        raise ValueError(f"kv-canary sglang-jax: batch_argnum and pool_argnum are both "
                         f"{batch_argnum}; the batch and the KV pool are different arguments")
    if batch_argnum in static_argnums or pool_argnum in static_argnums:
        raise ValueError("kv-canary sglang-jax: the batch and the KV pool cannot be static "
                         f"arguments (static_argnums={tuple(static_argnums)})")
    if not callable(model_step) or not callable(fused_kv):
        raise TypeError("kv-canary sglang-jax: model_step and fused_kv must be callables")
    nfixed = 4  # state, expected, table, model_x64

    def traced(state, expected, table, model_x64, *args):
        batch, cache_table, fed = device_batch(canary, args[batch_argnum], expected)
        state = _head(canary, state, batch, cache_table if table is None else table, fed)
        with jax.enable_x64(model_x64):
            out = model_step(*args)
        state = _tail(canary, state, batch, fused_kv(out, args[pool_argnum]))
        return state, out

    jitted = jax.jit(
        traced,
        static_argnums=(3,) + tuple(nfixed + a for a in static_argnums),
        donate_argnums=(0, nfixed + pool_argnum),
    )

    @_config.entry_point
    def step(state, *args, expected=None, table=None):
        if len(args) <= max(batch_argnum, pool_argnum):
            raise TypeError(f"kv-canary sglang-jax: the model step takes its batch at "
                            f"{batch_argnum} and its KV pool at {pool_argnum}, got "
                            f"{len(args)} arguments")
        array, sent = _expected_array(canary, expected, state, args[batch_argnum])
        new_state, out = jitted(state, array, table, _config.caller_had_x64(), *args)
        if sent is not None:  # dispatched: the state it returned holds the delta's ids
            sent.feed.commit(sent, state, new_state)
        return new_state, out

    step.jitted = jitted
    return step


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
