"""The device step: the four ops composed the way SGLang's serving loop runs them
(docs/spec.md §13).

* **HEAD** (before the model forward): scatter the batch's token ids into the expected-token
  pool, plan each buffer group, then verify the prefix slots and write the new slots into the
  HEAD canary buffers. HEAD endpoints carry no real-KV sources (the KV is not written yet).
* the model forward writes the real KV bytes;
* **TAIL** (after the forward): verify and write again with the same plans into the TAIL canary
  buffers, now fingerprinting the real KV bytes of every verified and written slot.
* **SWEEP** (every few steps, outside the forward): verify every cached prefix (radix-cache rows or
  live rows) against the TAIL buffers with the token check off.
* **coverage** (ours, ``cfg.coverage_window > 0``; :mod:`kvcanary_jax.runtime.coverage`): TAIL
  also stamps the KV digest (every layer's K and V) of the slots the step wrote and checks it
  for a rotating share of the slots it read; the sweep checks it for every slot it walks.

The KV a step takes (``kv``) is described in :mod:`kvcanary_jax.runtime.kv`: SGLang's real-KV
sources per half, or every layer of each group (SGLang's fingerprint then reads layer 0).

The jitted entry points donate the state, so XLA updates the canary buffers, ring and counters in
place. Every op runs ``cfg.implementation`` (see :class:`~kvcanary_jax.runtime.state.CanaryConfig`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp

from kvcanary_jax import _config, consts
from kvcanary_jax.context import VerifyOrWriteContext
from kvcanary_jax.ops.plan import canary_plan
from kvcanary_jax.ops.scatter import scatter_req_token_ids
from kvcanary_jax.ops.verify import canary_verify
from kvcanary_jax.ops.write import api as write_api
from kvcanary_jax.ops.write import base as write_base
from kvcanary_jax.ops.write.base import WriteTokens
from kvcanary_jax.plans import VerifyPlan, WritePlan
from kvcanary_jax.runtime import coverage
from kvcanary_jax.runtime.kv import as_kv_dict, kv_sources, translate
from kvcanary_jax.runtime.rebase import Rebaser
from kvcanary_jax.runtime.state import (CanaryConfig, CanaryState, ForwardBatch, check_state,
                                        state_jit, tag)

__all__ = [
    "kv_sources",
    "head",
    "tail",
    "step_fn",
    "sweep",
    "as_kv_dict",
    "canary_step_head",
    "canary_step_tail",
    "make_canary_step",
    "canary_sweep",
]


def _context(cfg, state, buf_key, t, sources):
    return VerifyOrWriteContext(
        canary_buf=state.bufs[buf_key],
        kernel_kind=t,
        violation_ring=state.violation_ring,
        violation_write_index=state.violation_write_index,
        slot_run_counter=state.slot_run_counter_by_tag[t.name],
        kernel_run_counter=state.kernel_run_counter_by_tag[t.name],
        real_kv_sources=tuple(sources),
        real_kv_hash_mode=cfg.hash_mode if sources else consts.RealKvHashMode.NONE,
        enable_chain_position_assert=state.enable_chain_position_assert,
    )


def _absorb(state, ctx, buf_key, t):
    bufs = dict(state.bufs)
    bufs[buf_key] = ctx.canary_buf
    return dataclasses.replace(
        state,
        bufs=bufs,
        violation_ring=ctx.violation_ring,
        violation_write_index=ctx.violation_write_index,
        slot_run_counter_by_tag={**state.slot_run_counter_by_tag, t.name: ctx.slot_run_counter},
        kernel_run_counter_by_tag={**state.kernel_run_counter_by_tag,
                                   t.name: ctx.kernel_run_counter},
    )


def _verify_then_write(cfg, state, batch, group, copy, sources_by_half, lut):
    vplan, wplan = state.plans[group]
    loc = translate(group, batch.out_cache_loc, lut)
    for half in cfg.halves:
        key, t = f"{copy}_{half}_{group}", tag(copy, half, group)
        srcs = sources_by_half.get(half, ())
        # One context through both launches (verify returns the ring, write index and counters
        # write takes); the tag's counters are whole state buffers, updated in place.
        ctx = canary_verify(
            context=_context(cfg, state, key, t, srcs),
            plan=vplan,
            check_verify_expected_token=cfg.enable_verify_token_assert,
            implementation=cfg.implementation,
        )
        assert_inputs = cfg.enable_write_input_assert
        tokens = WriteTokens(
            input_ids=batch.input_ids,
            positions=batch.positions,
            out_cache_loc=loc,
            expected_input_tokens=batch.expected_input_tokens if assert_inputs else None,
            expected_input_positions=batch.expected_input_positions if assert_inputs else None,
        )
        # canary_write's checks, and its array-level run: the batch's token arrays may be int32
        # (write_base.NARROW_TOKENS), widened by the kernel, not by a convert kernel each.
        write_base.validate(ctx, wplan, write_base.checked_as(tokens), assert_inputs)
        ctx = write_api.run(ctx, wplan, tokens, enable_write_input_assert=assert_inputs,
                            implementation=cfg.implementation)
        state = _absorb(state, ctx, key, t)
    return state


def head(cfg: CanaryConfig, state: CanaryState, batch: ForwardBatch, req_to_token: jax.Array,
         lut: jax.Array, *, expected_pool: jax.Array | None = None,
         valid_lens: jax.Array | None = None, fresh_chains: bool = False) -> CanaryState:
    """The HEAD half of a step, traceable (call inside a jit): scatter the expected tokens, plan
    every group, HEAD verify + write. ``lut``: the full->SWA LUT (any 1-element array without
    an SWA group). Raises ValueError (while tracing) for a state that does not fit ``cfg``.

    ``expected_pool``: an int32 ``[rows, context_len]`` expected-token pool the caller laid out
    already, row ``batch.req_pool_indices[r]`` holding request ``r``'s ids up to its
    ``all_ids_offsets`` length (an integration that keeps the ids on the device between steps);
    the scatter is skipped and ``state.expected_tokens`` / ``expected_valid_lens`` are left as
    they are (the caller keeps them). ``valid_lens`` (with ``expected_pool`` only): those
    lengths, one per batch row (``[max_bs]``, taken as int64), where the caller has them; given,
    ``all_ids_offsets`` is not read, and a caller need not sum the lengths only for the plan to
    difference them (default: the differences of ``all_ids_offsets``).

    ``fresh_chains`` (static): a write whose chain seed is slot 0 starts a new chain from the
    anchor instead (SGLang reads slot 0 as a real seed): for a caller whose ``req_to_token``
    holds 0 for the slots it has no canary for (KV written before the canary started), whose
    verify entries are then skipped and whose successor's chain check is off."""
    check_state(cfg, state)
    if valid_lens is None:
        valid_lens = batch.all_ids_offsets[1:] - batch.all_ids_offsets[:-1]
    elif expected_pool is None:
        raise ValueError("kv-canary runtime: valid_lens is for an expected_pool caller")
    else:
        valid_lens = jnp.asarray(valid_lens).astype(jnp.int64)
    pool = None
    if expected_pool is not None:
        if not cfg.enable_verify_token_assert:
            raise ValueError("kv-canary runtime: expected_pool needs enable_verify_token_assert")
        pool = expected_pool
    elif cfg.enable_verify_token_assert:
        pool = scatter_req_token_ids(
            flat_in=batch.all_ids_flat,
            offsets=batch.all_ids_offsets,
            req_pool_indices=batch.req_pool_indices,
            pool_out=state.expected_tokens,
            implementation=cfg.implementation,
        )
        rows = batch.req_pool_indices
        # Padding rows point at row 0 with length 0; keep row 0 at 0 whatever order they land.
        lens = state.expected_valid_lens.at[rows].set(jnp.where(rows != 0, valid_lens, 0))
        state = dataclasses.replace(state, expected_tokens=pool, expected_valid_lens=lens)
    plans = dict(state.plans)
    for group in cfg.groups:
        vplan, wplan = canary_plan(
            verify_plan_out=plans[group][0],
            write_plan_out=plans[group][1],
            req_pool_indices=batch.req_pool_indices,
            prefix_lens=batch.prefix_lens,
            extend_seq_lens=batch.extend_seq_lens,
            req_to_token=req_to_token,
            swa_window_size=cfg.window(group),
            full_to_swa_index_mapping=lut if group == "SWA" else None,
            verify_capacity=cfg.verify_cap,
            req_to_verify_expected_tokens=pool,
            req_to_verify_expected_tokens_valid_lens=valid_lens if pool is not None else None,
            kv_token_id_vs_position_offset=cfg.kv_token_id_vs_position_offset,
            implementation=cfg.implementation,
        )
        if fresh_chains:
            seeds = wplan.write_seed_slot_indices
            wplan = dataclasses.replace(wplan, write_seed_slot_indices=jnp.where(
                seeds == consts.TOKEN_TO_KV_SLOT_PADDING, -1, seeds))
        plans[group] = (vplan, wplan)
    state = dataclasses.replace(state, plans=plans)
    for group in cfg.groups:
        state = _verify_then_write(cfg, state, batch, group, "HEAD", {}, lut)
    return state


def tail(cfg: CanaryConfig, state: CanaryState, batch: ForwardBatch, lut: jax.Array,
         kv) -> CanaryState:
    """The TAIL half of a step, traceable: TAIL verify + write with the plans HEAD built,
    fingerprinting ``kv`` (:mod:`kvcanary_jax.runtime.kv`), then the coverage digest (with
    ``cfg.coverage_window``). Raises ValueError (while tracing) for a state that does not fit
    ``cfg``, or a KV that does not fit it."""
    check_state(cfg, state)
    halves = as_kv_dict(cfg, kv)
    for group in cfg.groups:
        srcs = {h: kv_sources(halves[group][h]) for h in cfg.halves}
        state = _verify_then_write(cfg, state, batch, group, "TAIL", srcs, lut)
    if cfg.coverage_window:
        state = coverage.at_tail(cfg, state, batch, lut, kv)
    return state


def step_fn(cfg: CanaryConfig, forward: Callable):
    """``fn(state, kv, batch, req_to_token, lut) -> (state, kv)``: HEAD -> ``forward`` -> TAIL,
    traceable (what :func:`make_canary_step` jits, and what a sharded step maps per shard)."""

    def fn(state, kv, batch, req_to_token, lut):
        state = head(cfg, state, batch, req_to_token, lut)
        kv = forward(kv, batch, req_to_token, lut)
        return tail(cfg, state, batch, lut, kv), kv

    return fn


def _sweep(cfg, state, rows_table, row_indices, lengths, lut, kv):
    check_state(cfg, state)
    halves = as_kv_dict(cfg, kv)
    n = row_indices.shape[0]
    cap = max(1, n * rows_table.shape[1])
    plans = {}
    for group in cfg.groups:
        # SGLang's sweep plans hold max(1, n) rows; with no row the plan is an empty batch.
        vplan, _ = canary_plan(
            verify_plan_out=VerifyPlan.allocate(verify_capacity=cap),
            write_plan_out=WritePlan.allocate(write_req_capacity=max(1, n)),
            req_pool_indices=row_indices,
            prefix_lens=lengths,
            extend_seq_lens=jnp.zeros_like(lengths),
            req_to_token=rows_table,
            swa_window_size=cfg.window(group),
            full_to_swa_index_mapping=lut if group == "SWA" else None,
            verify_capacity=cap,
            req_to_verify_expected_tokens=None,
            req_to_verify_expected_tokens_valid_lens=None,
            kv_token_id_vs_position_offset=0,
            implementation=cfg.implementation,
        )
        plans[group] = vplan
        for half in cfg.halves:
            t = tag("SWEEP", half, group)
            key = f"TAIL_{half}_{group}"  # SWEEP endpoints read the TAIL buffers
            ctx = canary_verify(
                context=_context(cfg, state, key, t, kv_sources(halves[group][half])),
                plan=vplan,
                check_verify_expected_token=False,
                implementation=cfg.implementation,
            )
            state = _absorb(state, ctx, key, t)
    if cfg.coverage_window:
        state = coverage.at_sweep(cfg, state, plans, kv)
    return state


def sweep(cfg: CanaryConfig, state: CanaryState, rows_table, row_indices, lengths, lut,
          kv) -> CanaryState:
    """The SWEEP launches, traceable (call inside a jit): what :func:`canary_sweep` runs."""
    return _sweep(cfg, state, rows_table, row_indices, lengths, lut, kv)


def _lut_or_dummy(lut):
    return jnp.zeros((1,), jnp.int64) if lut is None else lut


@state_jit(static_argnames=("cfg",), donate_argnames=("state",))
def _head_jit(state, batch, req_to_token, lut, *, cfg):
    return head(cfg, state, batch, req_to_token, lut)


@state_jit(static_argnames=("cfg",), donate_argnames=("state",))
def _tail_jit(state, batch, lut, kv, *, cfg):
    return tail(cfg, state, batch, lut, kv)


@state_jit(static_argnames=("cfg",), donate_argnames=("state",))
def _sweep_jit(state, rows_table, row_indices, lengths, lut, kv, *, cfg):
    return _sweep(cfg, state, rows_table, row_indices, lengths, lut, kv)


@_config.entry_point
def canary_step_head(cfg: CanaryConfig, state: CanaryState, batch: ForwardBatch, *,
                     req_to_token: jax.Array, lut: jax.Array | None = None) -> CanaryState:
    """Before the model forward: scatter expected tokens, plan every group, HEAD verify + write.
    ``state`` is donated (do not reuse the argument)."""
    return _head_jit(state, batch, req_to_token, _lut_or_dummy(lut), cfg=cfg)


@_config.entry_point
def canary_step_tail(cfg: CanaryConfig, state: CanaryState, batch: ForwardBatch, *, kv,
                     lut: jax.Array | None = None) -> CanaryState:
    """After the model forward: TAIL verify + write with the plans HEAD built, fingerprinting
    ``kv`` (``{"FULL": {"K": [arrays], "V": [arrays]}, "SWA": ...}``, rows = the group's slots;
    or every layer, ``{"FULL": {"layers": {"K": [...], "V": [...]}}}``: see
    :mod:`kvcanary_jax.runtime.kv`), then the coverage digest."""
    return _tail_jit(state, batch, _lut_or_dummy(lut), kv, cfg=cfg)


def make_canary_step(cfg: CanaryConfig, forward: Callable, *, implementation: str | None = None):
    """One jitted function for HEAD -> ``forward`` -> TAIL.

    ``forward(kv, batch, req_to_token, lut) -> kv`` is the model forward (it writes the real KV of
    ``batch.out_cache_loc``). Returns ``step(state, kv, batch, req_to_token, lut) -> (state, kv)``
    with the state and the KV donated. ``implementation`` overrides ``cfg.implementation``.
    With a coverage window, the step keeps the state's int32 step counters from wrapping
    (:class:`~kvcanary_jax.runtime.rebase.Rebaser`: a host read every 2**20 calls).
    A state that does not fit ``cfg`` (:func:`~kvcanary_jax.runtime.check_state`) is refused
    with a ValueError when the step is traced, before anything runs or is donated.
    """
    if implementation is not None:
        cfg = dataclasses.replace(cfg, implementation=implementation)
    jitted = state_jit(step_fn(cfg, forward), donate_argnums=(0, 1))
    rebaser = Rebaser(cfg)

    @_config.entry_point
    def step(state, kv, batch, req_to_token, lut=None):
        return jitted(rebaser(state), kv, batch, req_to_token, _lut_or_dummy(lut))

    step.jitted = jitted
    step.cfg = cfg
    step.rebaser = rebaser
    return step


@_config.entry_point
def canary_sweep(cfg: CanaryConfig, state: CanaryState, *, rows_table: jax.Array,
                 row_indices: jax.Array, lengths: jax.Array, kv,
                 lut: jax.Array | None = None) -> CanaryState:
    """Verify every listed prefix against the TAIL buffers (SWEEP tags, token check off), and
    (with ``cfg.coverage_window``) the KV digest of every slot of those prefixes.

    ``rows_table`` is an int32 slot table shaped like ``req_to_token`` (the live pool itself, or
    rows built from a radix-cache walk); ``row_indices`` int64 ``[n]`` selects rows (0 = unused
    entry) and ``lengths`` int64 ``[n]`` how many leading slots of each row are cached. Keep ``n``
    fixed across calls so the sweep compiles once.
    """
    return _sweep_jit(state, rows_table, row_indices, lengths, _lut_or_dummy(lut), kv, cfg=cfg)
