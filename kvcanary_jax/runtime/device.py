"""The manager's device side: what each of its calls runs in one ``jax.jit``.

* **the fused step** (:func:`fused`): HEAD -> the model forward -> TAIL with the state, the phase
  and the KV donated, returning the step's readback (:func:`~kvcanary_jax.runtime.readback.
  readback`) in buffers of its own;
* **HEAD alone** and **TAIL alone** (:func:`head_only`, :func:`tail_only`), around a forward the
  server runs itself (TAIL returns the readback);
* **the sweep** (:func:`sweep_fn`), with **the padding-slot guard** (ours): slot 0 of the real KV
  (the padding slot SGLang's and sglang-jax's allocators never hand out) must stay all zero; a
  nonzero byte appends a ring row with reason ``PADDING_SLOT_NOT_ZERO`` (bit 16, ours);
* **the readback of a state** (:func:`observe_fn`): for a step the server jitted itself, and for
  a readback taken by ``flush()`` after a sweep;
* **the coverage counts** (:func:`kvcanary_jax.runtime.coverage.counts`, with a coverage window):
  for the stats line and ``coverage()``, summed over the shards of a stacked state.

Every step updates the phase array of :mod:`kvcanary_jax.runtime.health`. :class:`DeviceSteps`
holds the jitted callables of one manager: without a mesh, module-level jits keyed by ``(cfg,
forward, guard)``, so managers of one config share their compilations (a server restarts its
manager, tests build many); over a mesh, each runs per shard under ``shard_map`` (states, KV,
batches and tables stacked along a leading axis), the phase replicated per shard, and the
readback's error flag max-reduced over the mesh axis inside the step (the agreement within the
process).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from kvcanary_jax import consts
from kvcanary_jax.runtime import coverage as _coverage
from kvcanary_jax.runtime import step as _step
from kvcanary_jax.runtime.health import AFTER_HEAD, IDLE, phase_update
from kvcanary_jax.runtime.readback import readback, word_fields
from kvcanary_jax.runtime.sharded import stack_shards
from kvcanary_jax.runtime.state import (CanaryConfig, CanaryState, check_state_any, init_state,
                                        init_state_stacked, state_jit, tag)

__all__ = [
    "fused",
    "head_only",
    "tail_only",
    "sweep_fn",
    "observe_fn",
    "padding_guard",
    "check_state_any",
    "DeviceSteps",
]


def _append_row(ring, write_index, row):
    """Append one ring row under the ring guard the kernels use: a negative write index records
    nothing and stays; past the capacity only the count grows (saturating at int32 max)."""
    idx = write_index[0]
    cap = ring.shape[0]
    ok = (idx >= 0) & (idx < cap)
    ring = ring.at[jnp.where(ok, idx, cap)].set(row, mode="drop")
    grown = jnp.minimum(idx.astype(jnp.int64) + 1, 2**31 - 1).astype(jnp.int32)
    return ring, jnp.where(idx >= 0, grown, idx).reshape(1)


def _slot0_bytes(src) -> jax.Array:
    """The bytes of the padding row of a real-KV array (slot 0; page 0 of a paged source)."""
    tensor = getattr(src, "tensor", src)
    row = tensor[0]
    if row.dtype != jnp.uint8:
        row = jax.lax.bitcast_convert_type(row, jnp.uint8)
    return row.reshape(-1)


def padding_guard(cfg: CanaryConfig, state: CanaryState, kv) -> CanaryState:
    """One ring row per real-KV array whose slot 0 has a nonzero byte (``stored_token``: how
    many), under the SWEEP tag of its half and group."""
    kv = _step.as_kv_dict(cfg, kv)
    ring, wi = state.violation_ring, state.violation_write_index
    for group in cfg.groups:
        for half in cfg.halves:
            for src in kv[group][half]:
                nonzero = jnp.sum((_slot0_bytes(src) != 0).astype(jnp.int64))
                row = jnp.array([int(tag("SWEEP", half, group)), 0, -1, 0, 0, 0, 0,
                                 consts.PADDING_SLOT_NOT_ZERO], jnp.int64).at[3].set(nonzero)
                new_ring, new_wi = _append_row(ring, wi, row)
                ring = jnp.where(nonzero > 0, new_ring, ring)
                wi = jnp.where(nonzero > 0, new_wi, wi)
    return dataclasses.replace(state, violation_ring=ring, violation_write_index=wi)


def fused(state, phase, kv, batch, rtt, lut, *, cfg, forward):
    state = _step.head(cfg, state, batch, rtt, lut)
    phase = phase_update(phase, IDLE, AFTER_HEAD)
    kv = forward(kv, batch, rtt, lut)
    state = _step.tail(cfg, state, batch, lut, kv)
    phase = phase_update(phase, AFTER_HEAD, IDLE)
    return state, phase, kv, readback(cfg, state, phase)


def head_only(state, phase, batch, rtt, lut, *, cfg):
    state = _step.head(cfg, state, batch, rtt, lut)
    return state, phase_update(phase, IDLE, AFTER_HEAD)


def tail_only(state, phase, batch, lut, kv, *, cfg):
    state = _step.tail(cfg, state, batch, lut, kv)
    phase = phase_update(phase, AFTER_HEAD, IDLE)
    return state, phase, readback(cfg, state, phase)


def sweep_fn(state, rows_table, row_indices, lengths, lut, kv, *, cfg, guard):
    state = _step.sweep(cfg, state, rows_table, row_indices, lengths, lut, kv)
    return padding_guard(cfg, state, kv) if guard else state


def observe_fn(state, phase, *, cfg):
    check_state_any(cfg, state)
    return readback(cfg, state, phase)


_fused_jit = state_jit(fused, static_argnames=("cfg", "forward"), donate_argnums=(0, 1, 2))
_head_jit = state_jit(head_only, static_argnames=("cfg",), donate_argnums=(0, 1))
_tail_jit = state_jit(tail_only, static_argnames=("cfg",), donate_argnums=(0, 1))
_sweep_jit = state_jit(sweep_fn, static_argnames=("cfg", "guard"), donate_argnums=(0,))
_observe_jit = jax.jit(observe_fn, static_argnames=("cfg",))
_coverage_jit = jax.jit(_coverage.counts, static_argnums=0)


class DeviceSteps:
    """The jitted calls of one manager (see the module docstring): ``fused`` (``None`` without
    a forward), ``head``, ``tail``, ``sweep``, ``observe``, ``coverage`` (``None`` without a
    coverage window); and ``stack(tree)``, one tree repeated on every shard (identity without a
    mesh)."""

    def __init__(self, cfg: CanaryConfig, forward: Callable | None, *, guard: bool,
                 mesh: jax.sharding.Mesh | None = None, axis: str = "dp"):
        self.cfg, self._mesh, self._axis = cfg, mesh, axis
        self.shards = 1 if mesh is None else mesh.shape[axis]
        # Reductions over the (stacked) state: the same call with or without a mesh.
        self.coverage = functools.partial(_coverage_jit, cfg) if cfg.coverage_window else None
        if mesh is None:
            self.fused = (functools.partial(_fused_jit, cfg=cfg, forward=forward)
                          if forward is not None else None)
            self.head = functools.partial(_head_jit, cfg=cfg)
            self.tail = functools.partial(_tail_jit, cfg=cfg)
            self.sweep = functools.partial(_sweep_jit, cfg=cfg, guard=guard)
            self.observe = functools.partial(_observe_jit, cfg=cfg)
            return
        self.fused = None
        if forward is not None:
            self.fused = state_jit(
                self._shard_phase(functools.partial(fused, cfg=cfg, forward=forward), 6, True),
                donate_argnums=(0, 1, 2))
        self.head = state_jit(self._shard_phase(functools.partial(head_only, cfg=cfg), 5, False),
                              donate_argnums=(0, 1))
        self.tail = state_jit(self._shard_phase(functools.partial(tail_only, cfg=cfg), 5, True),
                              donate_argnums=(0, 1))
        self.sweep = state_jit(self._wrap_shards(
            functools.partial(sweep_fn, cfg=cfg, guard=guard), 6, False), donate_argnums=(0,))
        self.observe = jax.jit(functools.partial(observe_fn, cfg=cfg))

    def compile_observe(self, state, phase) -> None:
        """Compile ``observe`` (and, with a coverage window, ``coverage``) for these arrays,
        running nothing: ahead of a server's steps, where compiling is not allowed."""
        for fn, args in ((self.observe, (state, phase)),
                         *(((self.coverage, (state,)),) if self.coverage is not None else ())):
            if isinstance(fn, functools.partial):  # a jit of the module's, its cfg bound
                fn.func.lower(*fn.args, *args, **fn.keywords).compile()
            else:
                fn.lower(*args).compile()

    def zero_state(self, **kw):
        """A zero state of the config for every shard of the mesh, each built on its own device
        (:func:`~kvcanary_jax.runtime.state.init_state_stacked`); one state without a mesh."""
        if self._mesh is None:
            return init_state(self.cfg, **kw)
        return init_state_stacked(self.cfg, self.shards,
                                  NamedSharding(self._mesh, P(self._axis)), **kw)

    def stack(self, tree):
        """``tree`` repeated on every shard of the mesh (``tree`` itself without one)."""
        if self._mesh is None:
            return tree
        return stack_shards([tree] * self.shards, self._mesh, self._axis)

    def _wrap_shards(self, fn, n_in, reduce_flag):
        """``fn`` per shard under ``shard_map`` over stacked inputs."""
        axis = self._axis
        write_index = word_fields(self.cfg, mesh=False)["write_index"]

        def per_shard(*args):
            take = functools.partial(jax.tree.map, lambda x: x[0])
            put = functools.partial(jax.tree.map, lambda x: x[None])
            outs = fn(*(take(a) for a in args))
            if reduce_flag:
                *rest, rb = outs
                # The agreement inside the step: every shard's readback carries the max of the
                # error flags and every shard's write index.
                words = rb["words"]
                errored = jax.lax.pmax((words[:, write_index] != 0).astype(jnp.int64), axis)
                rb = dict(rb, words=jnp.concatenate([words, errored], axis=1))
                outs = (*rest, rb)
            return put(outs)

        spec = P(axis)
        return jax.shard_map(per_shard, mesh=self._mesh, in_specs=(spec,) * n_in,
                             out_specs=spec, check_vma=False)

    def _shard_phase(self, fn, n_in, has_readback):
        """Wrap ``fn(state, phase, ...)`` for the mesh: the phase array is replicated per shard
        (stacked inside), and shard 0's copy comes back."""
        wrapped = self._wrap_shards(fn, n_in, has_readback)
        n = self.shards

        def outer(state, phase, *rest):
            stacked = jnp.broadcast_to(phase, (n,) + phase.shape)
            outs = wrapped(state, stacked, *rest)
            return (outs[0], outs[1][0], *outs[2:])

        return outer
