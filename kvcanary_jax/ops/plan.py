"""canary_plan: fill a VerifyPlan and a WritePlan for one forward step and one canary group.

SGLang's ``launch_canary_plan_kernels`` (same keyword arguments), as two Pallas kernels:
:mod:`~kvcanary_jax.ops.plan_offsets` (lengths, prefix sums, seeds, totals) then
:mod:`~kvcanary_jax.ops.plan_entries` (one verify entry per cached position). The combined result
on well-formed inputs equals SGLang's GPU path and its torch reference:

* verify arrays: entries ``[0, total_verify)`` (requests in batch order, positions ascending) when
  ``total_verify <= verify_capacity``; on overflow none of the four arrays is touched;
* ``verify_num_valid = min(total_verify, verify_capacity)``, ``enable = total_verify <= capacity``;
* ``write_offsets[0..bs]`` prefix sums of the write lengths, 0 past ``bs``;
  ``write_seed_slot_indices[0..bs)`` chain seeds, the rest untouched; ``write_num_valid_reqs = bs``;
* ``bs == 0``: ``verify_num_valid = 0``, ``enable = 1``, ``write_offsets`` all 0,
  ``write_num_valid_reqs = 0``, seeds and verify arrays untouched.

Where SGLang's GPU kernels and torch reference diverge we follow the kernels, and we stay in
bounds where the kernels would not (see the two kernel modules):

* an SWA LUT index past the LUT is clamped to ``lut_len - 1`` (the reference raises ValueError);
* ``req_to_token`` is read at SGLang's flat address ``rp * stride0 + col`` with no column bound (a
  prefix longer than the row reads the next row, as on the GPU; the reference raises IndexError);
  a cell outside the table (negative or too large ``rp``, ...) reads as 0, the unfilled-slot value;
* an expected-token read outside the pool (``valid_lens`` past the pool width) gives -1;
* no cap on ``bs`` (SGLang's GPU path: 4096), and ``bs > write_req_capacity`` raises SGLang's GPU
  error (the reference silently truncates).

Validation happens at trace time, before anything is launched, so nothing is written on error
(SGLang's GPU path raises the missing-``valid_lens`` error after its offsets kernel ran; we keep
its wording and its place in the check order, but raise it before launching).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp

from kvcanary_jax import _config
from kvcanary_jax.contracts import Contract, Rule, TensorMeta, meta_of
from kvcanary_jax.ops import plan_entries as _entries
from kvcanary_jax.ops import plan_offsets as _offsets
from kvcanary_jax.plans import VerifyPlan, WritePlan

__all__ = ["CONTRACT", "PlanLaunch", "plan_metas", "canary_plan", "canary_plan_reference"]


class PlanLaunch(NamedTuple):
    """Launch parameters of both kernels (static; defaults are the named constants of the kernel
    modules). Tests shrink the blocks to reach the multi-block and looping paths cheaply."""

    single_block_max: int = _offsets.SINGLE_BLOCK_MAX
    multi_block: int = _offsets.MULTI_BLOCK
    offsets_num_warps: int = _offsets.NUM_WARPS
    block_entries: int = _entries.BLOCK_ENTRIES
    max_programs: int = _entries.MAX_PROGRAMS
    entries_num_warps: int = _entries.NUM_WARPS

_API = "kv-canary: launch_canary_plan_kernels"


def _rule_swa_lut(metas, scalars):
    if scalars["swa_window_size"] > 0 and metas.get("full_to_swa_index_mapping") is None:
        return {}
    return None


def _rule_capacity(metas, scalars):
    m = metas.get("out_verify_slot_indices")
    n = m.shape[0] if m is not None and m.ndim else None
    if n is None or scalars["verify_capacity"] == n:
        return None
    return {"n": n}


# SGLang's GPU-path order (spec §8, §11.2/§11.3): SWA LUT presence, verify_capacity, the offsets
# kernel's checks, then the entries launcher's (missing valid_lens, then its C++ guards).
CONTRACT = Contract(
    op="canary_plan",
    checks=(
        Rule(_rule_swa_lut, _API + " requires full_to_swa_index_mapping when swa_window_size > 0"),
        Rule(
            _rule_capacity,
            _API + " verify_capacity={verify_capacity} does not match "
            "verify_plan_out.verify_slot_indices.shape[0]={n}",
        ),
        *_offsets.OFFSETS_CHECKS,
        *_entries.ENTRIES_CHECKS,
    ),
)

# SGLang validates a 1-element int64 placeholder under the name lut_tensor when there is no LUT.
_LUT_PLACEHOLDER = TensorMeta(shape=(1,), dtype="int64", strides=(1,), device=None,
                              framework="jax")


def plan_metas(tensors: Mapping[str, Any]) -> dict[str, TensorMeta | None]:
    """Metas for :data:`CONTRACT` from a mapping with keys ``req_pool_indices``, ``prefix_lens``,
    ``extend_seq_lens``, ``req_to_token``, ``full_to_swa_index_mapping``,
    ``req_to_verify_expected_tokens``, ``req_to_verify_expected_tokens_valid_lens`` and the plan
    fields under SGLang's launcher names (``out_verify_slot_indices``,
    ``out_verify_expected_tokens``, ``out_verify_expected_positions``,
    ``out_verify_prev_slot_indices``, ``out_verify_num_valid``, ``out_verify_enable``,
    ``out_write_offsets``, ``out_write_seed_slot_indices``, ``out_write_num_valid_reqs``); values
    are JAX arrays or torch tensors (or None). Adds ``lut_tensor`` as SGLang does."""
    metas = {k: (None if v is None else meta_of(v)) for k, v in tensors.items()}
    lut = metas.get("full_to_swa_index_mapping")
    if lut is None:
        anchor = metas.get("out_verify_slot_indices")
        lut = dataclasses.replace(_LUT_PLACEHOLDER, device=anchor.device if anchor else None,
                                framework=anchor.framework if anchor else "jax")
    metas["lut_tensor"] = lut
    return metas


def _tensors(vp: VerifyPlan, wp: WritePlan, **kw) -> dict[str, Any]:
    return dict(
        kw,
        out_verify_slot_indices=vp.verify_slot_indices,
        out_verify_expected_tokens=vp.verify_expected_tokens,
        out_verify_expected_positions=vp.verify_expected_positions,
        out_verify_prev_slot_indices=vp.verify_prev_slot_indices,
        out_verify_num_valid=vp.verify_num_valid,
        out_verify_enable=vp.enable,
        out_write_offsets=wp.write_offsets,
        out_write_seed_slot_indices=wp.write_seed_slot_indices,
        out_write_num_valid_reqs=wp.write_num_valid_reqs,
    )


def _validate(vp, wp, rpi, prefix, extend, rtt, lut, pool, valid_lens, *, swa_window_size,
              verify_capacity, req_to_token_stride0):
    metas = plan_metas(_tensors(
        vp, wp, req_pool_indices=rpi, prefix_lens=prefix, extend_seq_lens=extend,
        req_to_token=rtt, full_to_swa_index_mapping=lut, req_to_verify_expected_tokens=pool,
        req_to_verify_expected_tokens_valid_lens=valid_lens,
    ))
    CONTRACT.validate_metas(
        metas, swa_window_size=swa_window_size, verify_capacity=verify_capacity,
        req_to_token_stride0=req_to_token_stride0,
    )


def _empty_batch(vp: VerifyPlan, wp: WritePlan):
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


def _run(offsets_fn, entries_fn, vp, wp, rpi, prefix, extend, rtt, lut, pool, valid_lens, *,
         swa_window_size, verify_capacity, k):
    if rpi.shape[0] == 0:
        return _empty_batch(vp, wp)
    voff, wo, seeds, nv, en, wn = offsets_fn(
        rpi, prefix, extend, rtt, lut, wp.write_offsets, wp.write_seed_slot_indices,
        vp.verify_num_valid, vp.enable, wp.write_num_valid_reqs,
        swa_window_size=swa_window_size, verify_capacity=verify_capacity,
    )
    slots, toks, poss, prevs = entries_fn(
        rpi, prefix, rtt, lut, voff, en, pool, valid_lens, vp.verify_slot_indices,
        vp.verify_expected_tokens, vp.verify_expected_positions, vp.verify_prev_slot_indices,
        swa_window_size=swa_window_size, kv_token_id_vs_position_offset=k,
    )
    return (
        VerifyPlan(verify_slot_indices=slots, verify_expected_tokens=toks,
                   verify_expected_positions=poss, verify_prev_slot_indices=prevs,
                   verify_num_valid=nv, enable=en),
        WritePlan(write_offsets=wo, write_seed_slot_indices=seeds, write_num_valid_reqs=wn),
    )


@functools.partial(
    jax.jit,
    static_argnames=("swa_window_size", "verify_capacity", "kv_token_id_vs_position_offset",
                     "req_to_token_stride0", "interpret", "launch"),
)
def _plan_jit(vp, wp, rpi, prefix, extend, rtt, lut, pool, valid_lens, *, swa_window_size,
              verify_capacity, kv_token_id_vs_position_offset, req_to_token_stride0, interpret,
              launch=PlanLaunch()):
    """Validated plan. ``rtt`` (and ``pool``) may be compact ``[rows, row_pitch]`` bases whose
    pitch exceeds the logical width: reads use ``rp * row_pitch + col`` like SGLang's kernels, so
    a caller holding a strided view passes its base and gets the GPU's reads. The contract's
    stride check compares ``req_to_token_stride0`` against ``rtt``'s pitch."""
    _validate(vp, wp, rpi, prefix, extend, rtt, lut, pool, valid_lens,
              swa_window_size=swa_window_size, verify_capacity=verify_capacity,
              req_to_token_stride0=req_to_token_stride0)
    return _run(
        functools.partial(_offsets.plan_offsets, interpret=interpret,
                          num_warps=launch.offsets_num_warps,
                          single_block_max=launch.single_block_max,
                          multi_block=launch.multi_block),
        functools.partial(_entries.plan_entries, interpret=interpret,
                          block_entries=launch.block_entries, max_programs=launch.max_programs,
                          num_warps=launch.entries_num_warps),
        vp, wp, rpi, prefix, extend, rtt, lut, pool, valid_lens,
        swa_window_size=swa_window_size, verify_capacity=verify_capacity,
        k=kv_token_id_vs_position_offset,
    )


def _opt(x):
    return None if x is None else jnp.asarray(x)


@_config.with_x64
def canary_plan(
    *,
    verify_plan_out: VerifyPlan,
    write_plan_out: WritePlan,
    req_pool_indices: jax.Array,
    prefix_lens: jax.Array,
    extend_seq_lens: jax.Array,
    req_to_token: jax.Array,
    swa_window_size: int,
    full_to_swa_index_mapping: jax.Array | None,
    verify_capacity: int,
    req_to_verify_expected_tokens: jax.Array | None,
    req_to_verify_expected_tokens_valid_lens: jax.Array | None,
    kv_token_id_vs_position_offset: int,
    req_to_token_stride0: int | None = None,
    interpret: bool | None = None,
) -> tuple[VerifyPlan, WritePlan]:
    """Plan one step's verify entries and write ranges; returns the filled ``(VerifyPlan,
    WritePlan)``.

    Arguments are SGLang's ``launch_canary_plan_kernels``'s (int64 ``[bs]`` request vectors, int32
    ``req_to_token [max_reqs, max_seq_len]``, optional int64 LUT, optional int32 expected-token
    pool with int64 ``valid_lens [bs]``). ``swa_window_size``, ``verify_capacity`` and
    ``kv_token_id_vs_position_offset`` are static (one compilation per value, as SGLang's Triton
    constexprs).

    ``req_to_token_stride0``: SGLang's stride contract. SGLang addresses ``req_to_token`` with
    ``stride(0)`` and checks it; a JAX array is compact, so its row stride is ``shape[1]`` and a
    given value must equal it (else SGLang's ValueError). The torch bridge evaluates the same
    contract on the torch view, whose ``stride(0)`` may exceed ``shape[1]``, and passes the view's
    compact base, whose row pitch is that stride.

    Under ``jax.jit(..., donate_argnames=...)`` with both plans donated the kernels fill the plan
    buffers in place (every plan array is aliased input-to-output). Raises SGLang's errors (see
    :data:`CONTRACT`) at trace time.
    """
    if interpret is None:
        interpret = _config.default_interpret()
    return _plan_jit(
        verify_plan_out, write_plan_out, jnp.asarray(req_pool_indices), jnp.asarray(prefix_lens),
        jnp.asarray(extend_seq_lens), jnp.asarray(req_to_token), _opt(full_to_swa_index_mapping),
        _opt(req_to_verify_expected_tokens), _opt(req_to_verify_expected_tokens_valid_lens),
        swa_window_size=int(swa_window_size), verify_capacity=int(verify_capacity),
        kv_token_id_vs_position_offset=int(kv_token_id_vs_position_offset),
        req_to_token_stride0=None if req_to_token_stride0 is None else int(req_to_token_stride0),
        interpret=bool(interpret),
    )


@functools.partial(
    jax.jit,
    static_argnames=("swa_window_size", "verify_capacity", "kv_token_id_vs_position_offset",
                     "req_to_token_stride0"),
)
def _plan_reference_jit(vp, wp, rpi, prefix, extend, rtt, lut, pool, valid_lens, *,
                        swa_window_size, verify_capacity, kv_token_id_vs_position_offset,
                        req_to_token_stride0):
    _validate(vp, wp, rpi, prefix, extend, rtt, lut, pool, valid_lens,
              swa_window_size=swa_window_size, verify_capacity=verify_capacity,
              req_to_token_stride0=req_to_token_stride0)
    return _run(
        _offsets.plan_offsets_reference, _entries.plan_entries_reference,
        vp, wp, rpi, prefix, extend, rtt, lut, pool, valid_lens,
        swa_window_size=swa_window_size, verify_capacity=verify_capacity,
        k=kv_token_id_vs_position_offset,
    )


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
    """Pure-jnp :func:`canary_plan` (same validation, results and documented choices)."""
    return _plan_reference_jit(
        verify_plan_out, write_plan_out, jnp.asarray(req_pool_indices), jnp.asarray(prefix_lens),
        jnp.asarray(extend_seq_lens), jnp.asarray(req_to_token), _opt(full_to_swa_index_mapping),
        _opt(req_to_verify_expected_tokens), _opt(req_to_verify_expected_tokens_valid_lens),
        swa_window_size=int(swa_window_size), verify_capacity=int(verify_capacity),
        kv_token_id_vs_position_offset=int(kv_token_id_vs_position_offset),
        req_to_token_stride0=None if req_to_token_stride0 is None else int(req_to_token_stride0),
    )
