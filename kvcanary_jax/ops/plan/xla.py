"""canary_plan as plain XLA (``implementation="xla"``: CPU, TPU, GPU).

The semantics of :mod:`kvcanary_jax.ops.plan.base`, byte for byte, with its in-bounds choices
(SGLang's flat ``rp * row_pitch + col`` reads, out-of-table cells read as 0, the LUT index
clamped to ``lut_len - 1``, expected tokens outside the pool read as -1).

Shape of the computation, no per-request loop:

* offsets: the per-request lengths are elementwise, their offsets two cumsums, the seeds one
  gather of ``req_to_token`` (and one of the LUT);
* entries: each entry's owner request from segment ids: the first entry of every non-empty
  request is marked with the request's index (one scatter of ``bs`` marks) and a running maximum
  carries it over the request's entries; then positions, slots, predecessors and expected tokens
  are gathers.

:class:`Config` ``block``: 0 fills the whole verify capacity in one pass (entries past the live
total keep their contents through a select); a power of two walks only the live entries, in
blocks of that many (a serving plan's capacity is 3x the KV pool, its live total much smaller).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Mapping

import jax
import jax.numpy as jnp

from kvcanary_jax.ops import _xla_lib
from kvcanary_jax.ops.plan import base
from kvcanary_jax.plans import VerifyPlan, WritePlan

__all__ = ["Config", "heuristics", "plan_offsets", "plan_entries", "run"]


@dataclasses.dataclass(frozen=True)
class Config:
    """``block``: live entries per loop trip of the entries step; 0 = one pass over the
    capacity."""

    block: int = 0

    def __post_init__(self):
        if self.block < 0 or self.block & (self.block - 1):
            raise ValueError(f"kv-canary: plan xla block must be 0 or a power of two, "
                             f"got {self.block}")


ONE_PASS_MAX = 1 << 16


def heuristics(shapes: Mapping[str, int], backend: str | None = None) -> Config:
    """One pass on GPUs (XLA reads a loop's predicate back to the host every trip there) and for
    small plans; blocks of :data:`ONE_PASS_MAX` entries otherwise."""
    backend = backend or jax.default_backend()
    if backend == "gpu" or shapes["verify_capacity"] <= ONE_PASS_MAX:
        return Config(block=0)
    return Config(block=ONE_PASS_MAX)


def _read(table, rp, col, ok, other):
    """``table`` cells at SGLang's flat address ``rp * row_pitch + col`` (int64); addresses
    outside the table are never read and give ``other``."""
    rows, pitch = table.shape
    n = rows * pitch
    flat = rp * pitch + col
    ok = ok & (flat >= 0) & (flat < n)
    return _xla_lib.take(table.reshape(-1), flat, ok, other).astype(jnp.int64)


def _xlat(v, lut):
    """SWA LUT translation, index clamped to the LUT (SGLang's kernels); negatives pass."""
    if lut is None:
        return v
    return jnp.where(v < 0, v, _xla_lib.take(lut, jnp.clip(v, 0, lut.shape[0] - 1), True))


def plan_offsets(inputs: base.PlanInputs, vp: VerifyPlan, wp: WritePlan, *, swa_window_size,
                 verify_capacity) -> base.PlanOffsets:
    """The offsets half (:func:`kvcanary_jax.ops.plan.base.compose`, ``bs >= 1``); lanes at or
    past ``inputs.num_reqs`` are padding (:func:`kvcanary_jax.ops.plan.base.batch_lanes`)."""
    rpi, prefix, num_reqs = inputs.req_pool_indices, inputs.prefix_lens, inputs.num_reqs
    bs = rpi.shape[0]
    n = base.batch_lanes(num_reqs, bs)
    in_bs = True if num_reqs is None else jnp.arange(bs) < n
    active, vlen, wlen = base.lens(rpi, prefix, inputs.extend_seq_lens, in_bs, swa_window_size)
    zero = jnp.zeros((1,), jnp.int64)
    voff = jnp.concatenate([zero, jnp.cumsum(vlen)])
    wcum = jnp.concatenate([zero, jnp.cumsum(wlen)])
    if num_reqs is not None:
        wcum = jnp.where(jnp.arange(bs + 1) <= n, wcum, 0)
    wo = jax.lax.dynamic_update_slice(_xla_lib.overwrite(wp.write_offsets, 0), wcum, (0,))
    has_prefix = active & (prefix > 0)
    seed = _xlat(_read(inputs.req_to_token, rpi, prefix - 1, has_prefix, 0),
                 inputs.full_to_swa_index_mapping)
    seed = jnp.where(has_prefix & (wlen > 0), seed, -1)
    seeds = wp.write_seed_slot_indices
    if num_reqs is not None:
        seed = jnp.where(in_bs, seed, seeds[:bs])
    seeds = jax.lax.dynamic_update_slice(seeds, seed, (0,))
    total = voff[bs]
    overflow = total > verify_capacity
    return base.PlanOffsets(
        verify_offsets=voff,
        verify_num_valid=_xla_lib.overwrite(vp.verify_num_valid,
                                            jnp.where(overflow, verify_capacity, total)),
        enable=_xla_lib.overwrite(vp.enable, jnp.where(overflow, 0, 1)),
        write_plan=WritePlan(write_offsets=wo, write_seed_slot_indices=seeds,
                             write_num_valid_reqs=_xla_lib.overwrite(wp.write_num_valid_reqs, n)))


def _owners(voff, t0, n):
    """Owner request of entries ``t0 + [0, n)`` (valid below the total): the largest r with
    ``voff[r] <= t``, i.e. the non-empty request whose range holds t. Segment ids: a mark at
    each non-empty request's first entry, carried forward by a running maximum from the owner
    of ``t0``."""
    bs = voff.shape[0] - 1
    r = jnp.arange(bs, dtype=jnp.int32)
    start = voff[:bs] - t0
    marked = (voff[1:] > voff[:bs]) & (start >= 0) & (start < n)
    marks = jnp.full((n,), -1, jnp.int32).at[jnp.where(marked, start, n)].max(r, mode="drop")
    first = _xla_lib.count_below(voff[1:], jnp.asarray(t0, jnp.int64),
                                 inclusive=True).astype(jnp.int32)
    return jnp.maximum(jax.lax.cummax(marks), jnp.minimum(first, bs - 1))


def _entries_at(t, owner, inputs: base.PlanInputs, voff, *, swa_window_size, k, mask):
    """The four verify arrays' values (by field name) of entries ``t`` owned by ``owner``."""
    rp = inputs.req_pool_indices[owner]
    lut, pool = inputs.full_to_swa_index_mapping, inputs.req_to_verify_expected_tokens
    pos = base.window_start(inputs.prefix_lens[owner], swa_window_size) + (t - voff[owner])
    slot = _xlat(_read(inputs.req_to_token, rp, pos, mask, 0), lut)
    prev = jnp.where(pos > 0, _xlat(_read(inputs.req_to_token, rp, pos - 1, mask & (pos > 0), 0),
                                    lut), -1)
    if pool is None:
        tok = jnp.full(t.shape, -1, jnp.int64)
    else:
        sot = pos + k
        valid_lens = inputs.req_to_verify_expected_tokens_valid_lens
        tok = _read(pool, rp, sot, mask & (sot >= 0) & (sot < valid_lens[owner]), -1)
    return {"verify_slot_indices": slot, "verify_expected_tokens": tok,
            "verify_expected_positions": pos, "verify_prev_slot_indices": prev}


def plan_entries(inputs: base.PlanInputs, vp: VerifyPlan, verify_offsets, *, swa_window_size,
                 kv_token_id_vs_position_offset, block=0) -> VerifyPlan:
    """The entries half (:func:`kvcanary_jax.ops.plan.base.compose`, ``bs >= 1``): ``vp`` with
    entries ``[0, live)`` of its four arrays filled and the rest as given."""
    bs = inputs.req_pool_indices.shape[0]
    cap = vp.verify_slot_indices.shape[0]
    if cap == 0:
        return vp
    outs = {f: getattr(vp, f) for f in base.VERIFY_ARRAYS}
    live = jnp.where(vp.enable[0] != 0, jnp.minimum(verify_offsets[bs], cap), 0)
    at = functools.partial(_entries_at, inputs=inputs, voff=verify_offsets,
                           swa_window_size=swa_window_size, k=int(kv_token_id_vs_position_offset))
    if block == 0 or block >= cap:
        t = jnp.arange(cap, dtype=jnp.int64)
        m = t < live
        new = at(t, _owners(verify_offsets, 0, cap), mask=m)
        return dataclasses.replace(vp, **{f: jnp.where(m, new[f], outs[f]) for f in outs})

    # Live blocks only. The last block's slice is clamped to the capacity and may start below
    # the block boundary: entries there were written by the previous trip and are kept.
    def trip(carry):
        b, outs = carry
        lo = b * block
        start = jnp.minimum(lo, cap - block)
        t = start + jnp.arange(block, dtype=jnp.int64)
        m = (t >= lo) & (t < live)
        new = at(t, _owners(verify_offsets, start, block), mask=m)
        old = {f: jax.lax.dynamic_slice(o, (start,), (block,)) for f, o in outs.items()}
        return b + 1, {f: jax.lax.dynamic_update_slice(o, jnp.where(m, new[f], old[f]), (start,))
                       for f, o in outs.items()}

    nblocks = (live + block - 1) // block
    _, outs = jax.lax.while_loop(lambda c: c[0] < nblocks, trip, (jnp.zeros((), jnp.int64), outs))
    return dataclasses.replace(vp, **outs)


# The batch size may be an operand (``inputs.num_reqs``: base.batch_lanes).
TAKES_NUM_REQS = True


def run(vp: VerifyPlan, wp: WritePlan, inputs: base.PlanInputs, *, swa_window_size: int,
        verify_capacity: int, kv_token_id_vs_position_offset: int, config: Config):
    """``(VerifyPlan, WritePlan)`` filled (``bs >= 1``; no validation). ``req_to_token`` and the
    pool are ``[rows, row_pitch]`` tables (compact bases whose pitch may exceed the logical
    width)."""
    return base.compose(plan_offsets, functools.partial(plan_entries, block=config.block), vp, wp,
                        inputs, swa_window_size=swa_window_size, verify_capacity=verify_capacity,
                        kv_token_id_vs_position_offset=kv_token_id_vs_position_offset)
