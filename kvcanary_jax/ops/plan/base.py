"""canary_plan: fill a VerifyPlan and a WritePlan for one forward step and one canary group.

SGLang's ``launch_canary_plan_kernels`` (same keyword arguments): its offsets half
(``launch_plan_offsets_kernel``) then its entries half (``launch_plan_entries_kernel``). For each
request ``r`` (``W = swa_window_size``, ``P = prefix_lens[r]``, ``E = extend_seq_lens[r]``,
``rp = req_pool_indices[r]``, ``active = rp != 0``)::

    window_start = max(P - W, 0) if W > 0 else 0
    verify_len   = max(P - window_start, 0) if active else 0
    write_len    = max(E, 0)                 if active else 0
    seed         = xlat(read(rp, P - 1))     if active and P > 0 and write_len > 0 else -1

``verify_offsets`` are the exclusive prefix sums of ``verify_len`` (total at ``bs``). Then, for
each flat entry ``t < total`` (requests in batch order, positions ascending)::

    r    = largest r with verify_offsets[r] <= t         (empty ranges own nothing)
    pos  = window_start(P) + (t - verify_offsets[r])
    slot = xlat(read(rp, pos))
    prev = xlat(read(rp, pos - 1)) if pos > 0 else -1      (no chain reset at an SWA window start)
    tok  = pool(rp, pos + k) if pool given and 0 <= pos + k < valid_lens[r] else -1

Results, on well-formed inputs equal to SGLang's GPU path and its torch reference:

* verify arrays: entry ``t`` gets ``(slot, tok, pos, prev)`` for ``t < total`` when
  ``total <= verify_capacity``; on overflow none of the four arrays is touched; entries
  ``[total, capacity)`` are untouched;
* ``verify_num_valid = min(total, verify_capacity)``, ``enable = total <= capacity``;
* ``write_offsets[0..bs]`` prefix sums of the write lengths, 0 past ``bs``;
  ``write_seed_slot_indices[0..bs)`` chain seeds, the rest untouched; ``write_num_valid_reqs = bs``
  (padding rows included);
* ``bs == 0``: ``verify_num_valid = 0``, ``enable = 1``, ``write_offsets`` all 0,
  ``write_num_valid_reqs = 0``, seeds and verify arrays untouched;
* ``verify_capacity == 0`` (a 0-entry verify plan): ``verify_num_valid = 0``, ``enable = 1``
  only when no request has a prefix to verify, and the write plan as usual (SGLang's reference
  and its GPU launcher accept it alike). :func:`sized_call` handles both sizes once for every
  implementation.

``read(rp, col)`` is SGLang's flat address ``rp * row_pitch + col`` into ``req_to_token`` with no
column bound, so where SGLang's GPU kernels read inside the table we return exactly what they
read (a position past the row width reads the next row, as on the GPU). A flat address outside
the table ``[0, rows * row_pitch)``, which SGLang's kernels would read out of bounds, is never
read: the cell reads as 0 (``TOKEN_TO_KV_SLOT_PADDING``, what SGLang's masked loads return).
``xlat`` maps a value ``v >= 0`` through the SWA LUT at ``min(v, lut_len - 1)`` (SGLang's kernels
clamp; its torch reference raises ValueError) and passes negative values through. The
expected-token pool is addressed the same way (``rp * pool_pitch + pos + k``, bounded by
``valid_lens`` only, as SGLang's kernel); an address outside the pool (SGLang's reference raises
IndexError) yields -1, the "skip the token check" sentinel, rather than a made-up token id.

``rtt`` (and ``pool``) may be compact ``[rows, row_pitch]`` bases whose pitch exceeds the logical
width: a caller holding a strided view passes its base and gets the GPU's reads. No cap on ``bs``
(SGLang's GPU path: 4096); ``bs > write_req_capacity`` raises SGLang's GPU error (the reference
silently truncates). Validation happens at trace time, before anything is launched, so nothing is
written on error (SGLang's GPU path raises the missing-``valid_lens`` error after its offsets
kernel ran; we keep its wording and its place in the check order, but raise it before
launching).

This module holds the batch and the offsets half's result as pytrees (:class:`PlanInputs`,
:class:`PlanOffsets`), the op's validation (its contract, :mod:`kvcanary_jax.ops.plan.contract`,
re-exported here), its static shapes (the keys of tuned launch configs), the composition of the
two halves that every implementation shares (:func:`compose`: each half takes the batch as
:class:`PlanInputs` and the plans as their dataclasses, and the offsets half hands the entries
half a :class:`PlanOffsets`), and the pure-jnp reference, the test oracle of every
implementation.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from kvcanary_jax import _config, consts
from kvcanary_jax.ops.plan.contract import (
    CONTRACT,
    ENTRIES_CHECKS,
    OFFSETS_CHECKS,
    out_name,
    plan_metas,
    row_stride,
)
from kvcanary_jax.plans import VerifyPlan, WritePlan

__all__ = [
    "CONTRACT",
    "OFFSETS_CHECKS",
    "ENTRIES_CHECKS",
    "plan_metas",
    "row_stride",
    "PlanInputs",
    "PlanOffsets",
    "VERIFY_ARRAYS",
    "out_name",
    "validate",
    "shapes",
    "window_start",
    "lens",
    "batch_lanes",
    "empty_batch",
    "sized_call",
    "compose",
    "offsets_reference",
    "entries_reference",
    "reference",
    "inputs_of",
    "canary_plan_reference",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanInputs:
    """The batch a plan reads, under SGLang's launcher names: int64 ``[bs]``
    ``req_pool_indices``, ``prefix_lens``, ``extend_seq_lens``; int32 ``req_to_token [rows,
    row_pitch]`` (a compact base whose pitch may exceed the logical width); the optional LUT,
    expected-token pool (int32 ``[rows, pitch]``) and its int64 ``valid_lens [bs]``; and
    ``num_reqs``, the batch size as an operand (int32 ``[1]``, see :func:`batch_lanes`), or
    None."""

    req_pool_indices: jax.Array
    prefix_lens: jax.Array
    extend_seq_lens: jax.Array
    req_to_token: jax.Array
    full_to_swa_index_mapping: jax.Array | None = None
    req_to_verify_expected_tokens: jax.Array | None = None
    req_to_verify_expected_tokens_valid_lens: jax.Array | None = None
    num_reqs: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanOffsets:
    """What the offsets half computes (see :func:`compose`): int64 ``verify_offsets [bs + 1]``,
    the exclusive prefix sums of the verify lengths (the total at ``bs``), which the entries half
    reads; the verify plan's ``verify_num_valid`` and ``enable``; and the filled ``write_plan``."""

    verify_offsets: jax.Array
    verify_num_valid: jax.Array
    enable: jax.Array
    write_plan: WritePlan


def validate(vp: VerifyPlan, wp: WritePlan, inputs: PlanInputs, *, swa_window_size: int,
             verify_capacity: int, req_to_token_stride0: int | None,
             kv_token_id_vs_position_offset: int = 0) -> None:
    """:data:`CONTRACT` on the op's arrays (raises at trace time)."""
    tensors = {f.name: getattr(inputs, f.name) for f in dataclasses.fields(PlanInputs)
               if f.name != "num_reqs"}
    for plan in (vp, wp):
        tensors.update({out_name(f.name): getattr(plan, f.name)
                        for f in dataclasses.fields(type(plan))})
    CONTRACT.validate_metas(
        plan_metas(tensors), swa_window_size=swa_window_size, verify_capacity=verify_capacity,
        req_to_token_stride0=req_to_token_stride0,
        kv_token_id_vs_position_offset=kv_token_id_vs_position_offset,
    )


def shapes(vp: VerifyPlan, wp: WritePlan, inputs: PlanInputs) -> dict[str, int]:
    """The static sizes a launch configuration may depend on."""
    lut, pool = inputs.full_to_swa_index_mapping, inputs.req_to_verify_expected_tokens
    return {"bs": int(inputs.req_pool_indices.shape[0]),
            "verify_capacity": int(vp.verify_slot_indices.shape[0]),
            "write_capacity": int(wp.write_seed_slot_indices.shape[0]),
            "rows": int(inputs.req_to_token.shape[0]),
            "row_pitch": int(inputs.req_to_token.shape[1]),
            "lut_len": 0 if lut is None else int(lut.shape[0]),
            "pool_pitch": 0 if pool is None else int(pool.shape[1])}


# --------------------------------------------------------------------------------------------
# Shared by every implementation


def window_start(prefix, swa_window_size: int):
    if swa_window_size > 0:
        return jnp.maximum(prefix - swa_window_size, 0)
    return jnp.zeros_like(prefix)


def lens(rpi, prefix, extend, in_bs, swa_window_size: int):
    """``(active, verify_len, write_len)`` of each request (``in_bs``: lanes that are requests)."""
    active = in_bs & (rpi != consts.REQ_POOL_IDX_PADDING)
    vlen = jnp.where(active, jnp.maximum(prefix - window_start(prefix, swa_window_size), 0), 0)
    wlen = jnp.where(active, jnp.maximum(extend, 0), 0)
    return active, vlen, wlen


def batch_lanes(num_reqs, bs: int):
    """How many of the ``bs`` request lanes are the batch: ``bs`` (a Python int) without
    ``num_reqs``, else ``num_reqs[0]`` clamped to ``[0, bs]`` (a traced int64; the clamp keeps a
    bad count in bounds). With ``num_reqs``, lanes at or past it are padding that the plan never
    reads: their verify and write lengths are 0, ``write_offsets`` is 0 from index
    ``num_reqs + 1`` on, their seeds are untouched and ``write_num_valid_reqs = num_reqs``, so
    a batch padded to a bucket plans exactly as the unpadded batch (one compilation per bucket
    instead of per batch size)."""
    if num_reqs is None:
        return bs
    return jnp.clip(jnp.asarray(num_reqs).reshape(-1)[0].astype(jnp.int64), 0, bs)


def empty_batch(vp: VerifyPlan, wp: WritePlan) -> tuple[VerifyPlan, WritePlan]:
    """The result of a ``bs == 0`` plan (see the module docstring)."""
    return (
        VerifyPlan(
            verify_slot_indices=vp.verify_slot_indices,
            verify_expected_tokens=vp.verify_expected_tokens,
            verify_expected_positions=vp.verify_expected_positions,
            verify_prev_slot_indices=vp.verify_prev_slot_indices,
            verify_num_valid=jnp.zeros_like(vp.verify_num_valid),
            enable=jnp.ones_like(vp.enable),
        ),
        WritePlan(
            write_offsets=jnp.zeros_like(wp.write_offsets),
            write_seed_slot_indices=wp.write_seed_slot_indices,
            write_num_valid_reqs=jnp.zeros_like(wp.write_num_valid_reqs),
        ),
    )


# The verify plan's arrays, one entry per position (what the entries half fills).
VERIFY_ARRAYS = ("verify_slot_indices", "verify_expected_tokens", "verify_expected_positions",
                 "verify_prev_slot_indices")


def sized_call(fn, vp: VerifyPlan, wp: WritePlan, inputs: PlanInputs, **kw):
    """``fn(vp, wp, inputs, **kw)`` (an implementation's ``run``, or the reference), with the
    zero sizes of the module docstring handled first: no implementation gets an empty batch or
    an empty verify plan. A 0-entry plan is run as a 1-entry scratch plan with the static
    ``verify_capacity`` of 0, whose ``enable`` keeps that entry unwritten; the input's empty
    arrays are returned with the computed ``verify_num_valid`` and ``enable``."""
    if inputs.req_pool_indices.shape[0] == 0:
        return empty_batch(vp, wp)
    if vp.verify_slot_indices.shape[0] != 0:
        return fn(vp, wp, inputs, **kw)
    scratch = VerifyPlan(
        **{f: jnp.zeros((1,), getattr(vp, f).dtype) for f in VERIFY_ARRAYS},
        verify_num_valid=vp.verify_num_valid, enable=vp.enable)
    out_vp, out_wp = fn(scratch, wp, inputs, **kw)
    return dataclasses.replace(out_vp, **{f: getattr(vp, f) for f in VERIFY_ARRAYS}), out_wp


def compose(offsets_fn: Callable, entries_fn: Callable, vp: VerifyPlan, wp: WritePlan,
            inputs: PlanInputs, *, swa_window_size: int, verify_capacity: int,
            kv_token_id_vs_position_offset: int):
    """The plan from its two halves (``bs >= 1``)::

        offsets_fn(inputs, vp, wp, *, swa_window_size, verify_capacity) -> PlanOffsets
        entries_fn(inputs, vp, verify_offsets, *, swa_window_size,
                   kv_token_id_vs_position_offset) -> VerifyPlan

    The offsets half fills the write plan and the verify plan's ``verify_num_valid`` and
    ``enable`` and computes the verify offsets (:class:`PlanOffsets`); the entries half gets the
    verify plan with those two and returns it with its four arrays (:data:`VERIFY_ARRAYS`)
    filled. ``inputs.num_reqs`` (see :func:`batch_lanes`) matters to the offsets half only:
    requests at or past it get empty ranges there, so ``verify_offsets`` is flat from
    ``num_reqs`` on and the entries half, which finds each entry's request in it, never picks
    one of them.
    """
    offsets = offsets_fn(inputs, vp, wp, swa_window_size=swa_window_size,
                         verify_capacity=verify_capacity)
    vp = dataclasses.replace(vp, verify_num_valid=offsets.verify_num_valid, enable=offsets.enable)
    vp = entries_fn(inputs, vp, offsets.verify_offsets, swa_window_size=swa_window_size,
                    kv_token_id_vs_position_offset=kv_token_id_vs_position_offset)
    return vp, offsets.write_plan


# --------------------------------------------------------------------------------------------
# Pure-jnp reference


def offsets_reference(inputs: PlanInputs, vp: VerifyPlan, wp: WritePlan, *, swa_window_size,
                      verify_capacity) -> PlanOffsets:
    """The offsets half (see :func:`compose`)."""
    del vp  # its verify_num_valid and enable are overwritten
    rpi, prefix, req_to_token = inputs.req_pool_indices, inputs.prefix_lens, inputs.req_to_token
    lut = inputs.full_to_swa_index_mapping
    bs = rpi.shape[0]
    n = batch_lanes(inputs.num_reqs, bs)
    in_bs = jnp.arange(bs) < n
    _, vlen, wlen = lens(rpi, prefix, inputs.extend_seq_lens, in_bs, swa_window_size)
    voff = jnp.concatenate([jnp.zeros((1,), jnp.int64), jnp.cumsum(vlen)])
    wcum = jnp.concatenate([jnp.zeros((1,), jnp.int64), jnp.cumsum(wlen)])
    wcum = jnp.where(jnp.arange(bs + 1) <= n, wcum, 0)
    new_wo = jnp.zeros_like(wp.write_offsets).at[: bs + 1].set(wcum)
    total_v = voff[bs]
    rows, pitch = req_to_token.shape
    has_prefix = in_bs & (rpi != consts.REQ_POOL_IDX_PADDING) & (prefix > 0)
    flat = rpi * pitch + (prefix - 1)
    ok = has_prefix & (flat >= 0) & (flat < rows * pitch)
    cells = req_to_token.reshape(-1)
    raw = jnp.where(ok, cells[jnp.clip(flat, 0, max(rows * pitch - 1, 0))] if rows * pitch else 0,
                    0).astype(jnp.int64)
    if lut is not None:
        raw = jnp.where(raw < 0, raw, lut[jnp.clip(raw, 0, lut.shape[0] - 1)])
    seed = jnp.where(has_prefix & (wlen > 0), raw, -1)
    seeds = wp.write_seed_slot_indices
    new_seeds = seeds.at[:bs].set(jnp.where(in_bs, seed, seeds[:bs])) if bs else seeds
    overflow = total_v > verify_capacity
    return PlanOffsets(
        verify_offsets=voff,
        verify_num_valid=jnp.where(overflow, verify_capacity, total_v).astype(jnp.int32).reshape(1),
        enable=jnp.where(overflow, 0, 1).astype(jnp.int32).reshape(1),
        write_plan=WritePlan(write_offsets=new_wo, write_seed_slot_indices=new_seeds,
                             write_num_valid_reqs=jnp.full((1,), n, jnp.int32)))


def entries_reference(inputs: PlanInputs, vp: VerifyPlan, verify_offsets, *, swa_window_size,
                      kv_token_id_vs_position_offset) -> VerifyPlan:
    """The entries half (see :func:`compose`)."""
    rpi, prefix, lut = inputs.req_pool_indices, inputs.prefix_lens, inputs.full_to_swa_index_mapping
    pool = inputs.req_to_verify_expected_tokens
    bs = rpi.shape[0]
    capacity = vp.verify_slot_indices.shape[0]
    total = verify_offsets[bs]
    live = jnp.where(vp.enable[0] != 0, jnp.minimum(total, capacity), 0)
    t = jnp.arange(capacity, dtype=jnp.int64)
    r = jnp.clip(jnp.searchsorted(verify_offsets[:bs], t, side="right") - 1, 0, bs - 1)
    rp = rpi[r]
    pos = window_start(prefix[r], swa_window_size) + (t - verify_offsets[r])

    def read(table, col, ok, other):
        n = table.size
        flat = rp * table.shape[1] + col
        ok = ok & (flat >= 0) & (flat < n)
        if n == 0:
            return jnp.full(t.shape, other, jnp.int64)
        v = table.reshape(-1)[jnp.clip(flat, 0, n - 1)].astype(jnp.int64)
        return jnp.where(ok, v, other)

    def xl(v):
        if lut is None:
            return v
        return jnp.where(v < 0, v, lut[jnp.clip(v, 0, lut.shape[0] - 1)])

    slot = xl(read(inputs.req_to_token, pos, True, 0))
    prev = jnp.where(pos > 0, xl(read(inputs.req_to_token, pos - 1, pos > 0, 0)), -1)
    if pool is not None:
        sot = pos + int(kv_token_id_vs_position_offset)
        valid_lens = inputs.req_to_verify_expected_tokens_valid_lens
        tok = read(pool, sot, (sot >= 0) & (sot < valid_lens[r]), -1)
    else:
        tok = jnp.full(t.shape, -1, jnp.int64)
    m = t < live
    new = {"verify_slot_indices": slot, "verify_expected_tokens": tok,
           "verify_expected_positions": pos, "verify_prev_slot_indices": prev}
    return dataclasses.replace(vp, **{f: jnp.where(m, new[f], getattr(vp, f))
                                      for f in VERIFY_ARRAYS})


@functools.partial(
    jax.jit,
    static_argnames=("swa_window_size", "verify_capacity", "kv_token_id_vs_position_offset"),
)
def reference(vp: VerifyPlan, wp: WritePlan, inputs: PlanInputs, *, swa_window_size,
              verify_capacity, kv_token_id_vs_position_offset):
    """The array-level reference (no validation)."""
    return sized_call(functools.partial(compose, offsets_reference, entries_reference), vp, wp,
                      inputs, swa_window_size=swa_window_size, verify_capacity=verify_capacity,
                      kv_token_id_vs_position_offset=kv_token_id_vs_position_offset)


def inputs_of(req_pool_indices, prefix_lens, extend_seq_lens, req_to_token,
              full_to_swa_index_mapping, req_to_verify_expected_tokens,
              req_to_verify_expected_tokens_valid_lens) -> PlanInputs:
    """The public entries' batch arguments as :class:`PlanInputs` of JAX arrays."""
    opt = lambda x: None if x is None else jnp.asarray(x)  # noqa: E731
    return PlanInputs(
        req_pool_indices=jnp.asarray(req_pool_indices), prefix_lens=jnp.asarray(prefix_lens),
        extend_seq_lens=jnp.asarray(extend_seq_lens), req_to_token=jnp.asarray(req_to_token),
        full_to_swa_index_mapping=opt(full_to_swa_index_mapping),
        req_to_verify_expected_tokens=opt(req_to_verify_expected_tokens),
        req_to_verify_expected_tokens_valid_lens=opt(req_to_verify_expected_tokens_valid_lens))


@_config.with_x64
def canary_plan_reference(
    *,
    verify_plan_out: VerifyPlan,
    write_plan_out: WritePlan,
    req_pool_indices,
    prefix_lens,
    extend_seq_lens,
    req_to_token,
    swa_window_size: int,
    full_to_swa_index_mapping,
    verify_capacity: int,
    req_to_verify_expected_tokens,
    req_to_verify_expected_tokens_valid_lens,
    kv_token_id_vs_position_offset: int,
    req_to_token_stride0: int | None = None,
) -> tuple[VerifyPlan, WritePlan]:
    """Pure-jnp :func:`kvcanary_jax.canary_plan` (same validation, results and choices)."""
    inputs = inputs_of(req_pool_indices, prefix_lens, extend_seq_lens, req_to_token,
                       full_to_swa_index_mapping, req_to_verify_expected_tokens,
                       req_to_verify_expected_tokens_valid_lens)
    validate(verify_plan_out, write_plan_out, inputs, swa_window_size=swa_window_size,
             verify_capacity=verify_capacity,
             req_to_token_stride0=req_to_token_stride0,
             kv_token_id_vs_position_offset=kv_token_id_vs_position_offset)
    return reference(verify_plan_out, write_plan_out, inputs,
                     swa_window_size=int(swa_window_size), verify_capacity=int(verify_capacity),
                     kv_token_id_vs_position_offset=int(kv_token_id_vs_position_offset))
