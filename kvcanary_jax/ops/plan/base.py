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

This module holds the op's contract, its static shapes (the keys of tuned launch configs), the
composition of the two halves that every implementation shares (:func:`compose`: each half takes
the batch as :class:`PlanInputs` and the plans as their dataclasses, and the offsets half hands
the entries half a :class:`PlanOffsets`), and the pure-jnp reference, the test oracle of every
implementation.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from kvcanary_jax import _config, consts
from kvcanary_jax.contracts import (
    Check,
    Contiguous,
    Contract,
    DType,
    NDim,
    Rule,
    TensorMeta,
    meta_of,
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

_API = "kv-canary: launch_canary_plan_kernels"
_ENTRIES = "kv-canary: launch_plan_entries_kernel"

# --------------------------------------------------------------------------------------------
# Contract. The offsets half: SGLang's offsets-kernel validation (docs/spec.md §11.3), in its
# order and words. The scratch tensor of SGLang's GPU path is internal here (and its 4097-entry minimum is
# SGLang's bs cap), so its checks are left out; the bs <= 4096 check does not exist (no cap).
# --------------------------------------------------------------------------------------------

_ORDER = (
    ("req_pool_indices", "int64"),
    ("prefix_lens", "int64"),
    ("extend_seq_lens", "int64"),
    ("req_to_token", "int32"),
    ("lut_tensor", "int64"),
    ("out_write_offsets", "int64"),
    ("out_write_seed_slot_indices", "int64"),
    ("out_verify_num_valid", "int32"),
    ("out_verify_enable", "int32"),
    ("out_write_num_valid_reqs", "int32"),
)

_DTYPE_MSG = "kv-canary: {name} must have dtype {expected}, got {dtype}"
_1D_MSG = "kv-canary: {name} must be 1-D, got shape {shape}"


def _len0(m: TensorMeta | None) -> int | None:
    return None if m is None or m.ndim < 1 else m.shape[0]


def _bs(metas) -> int:
    return _len0(metas.get("req_pool_indices")) or 0


def row_stride(m: TensorMeta) -> int:
    """``req_to_token.stride(0)`` as torch reports it; a compact JAX array's row pitch is its
    width, and an empty dimension counts as 1 as in torch's stride convention."""
    if m.framework == "jax" or m.strides is None:
        return max(m.shape[1], 1) if m.ndim >= 2 else 1
    return m.stride(0)


def _stride0(metas, scalars) -> int | None:
    s = scalars.get("req_to_token_stride0")
    if s is not None:
        return int(s)
    m = metas.get("req_to_token")
    return None if m is None or m.ndim < 2 else row_stride(m)


def _rule_write_offsets_positive(metas, scalars):
    n = _len0(metas.get("out_write_offsets"))
    return None if n is None or n > 0 else {"n": n}


def _rule_verify_capacity(metas, scalars):
    c = scalars["verify_capacity"]
    return None if c >= 0 else {"n": c}


def _rule_stride_positive(metas, scalars):
    s = _stride0(metas, scalars)
    return None if s is None or s > 0 else {"n": s}


def _rule_lut_nonempty(metas, scalars):
    m = metas.get("full_to_swa_index_mapping")
    return None if m is None or (m.shape[0] if m.ndim else 1) > 0 else {}


def _len_rule(name, expected_fn):
    def fails(metas, scalars):
        m = metas.get(name)
        if m is None:
            return None
        exp = expected_fn(metas, scalars)
        return None if m.shape[0] == exp else {"name": name, "exp": exp, "n": m.shape[0]}

    return fails


def _rule_lut_min_len(metas, scalars):
    m = metas.get("lut_tensor")
    if m is None:
        return None
    lut = metas.get("full_to_swa_index_mapping")
    lut_len = 0 if lut is None else (lut.shape[0] if lut.ndim else 1)
    need = max(lut_len, 1)
    return None if m.shape[0] >= need else {"need": need, "n": m.shape[0]}


def _rule_write_offsets_len(metas, scalars):
    wo, seeds = metas.get("out_write_offsets"), metas.get("out_write_seed_slot_indices")
    if wo is None or seeds is None:
        return None
    n, c = wo.shape[0], seeds.shape[0]
    return None if n == c + 1 else {"n": n, "c": c}


def _rule_bs_capacity(metas, scalars):
    seeds = metas.get("out_write_seed_slot_indices")
    if seeds is None:
        return None
    bs, c = _bs(metas), seeds.shape[0]
    return None if bs <= c else {"bs": bs, "c": c}


def _rule_stride_match(metas, scalars):
    a = scalars.get("req_to_token_stride0")
    m = metas.get("req_to_token")
    if a is None or m is None:
        return None
    b = row_stride(m)
    return None if int(a) == b else {"a": int(a), "b": b}


def _rule_same_device(metas, scalars):
    # SGLang allocates its scratch on the verify plan's device and checks everything against it.
    anchor = metas.get("out_verify_slot_indices")
    if anchor is None or anchor.device is None:
        return None
    for name, _ in _ORDER:
        m = metas.get(name)
        if m is not None and m.device is not None and m.device != anchor.device:
            return {"name": name, "dev": anchor.device, "dev2": m.device}
    return None


def _ndim_then_len(name: str, expected_fn) -> tuple[Check, ...]:
    return (
        NDim(name, 1, _1D_MSG),
        Rule(_len_rule(name, expected_fn), "kv-canary: {name} length must be {exp}, got {n}"),
    )


OFFSETS_CHECKS: tuple[Check, ...] = (
    *(Contiguous(name) for name, _ in _ORDER),
    *(DType(name, dt, _DTYPE_MSG, exc=ValueError) for name, dt in _ORDER),
    Rule(_rule_write_offsets_positive, "kv-canary: write_offsets_len must be positive, got {n}"),
    Rule(_rule_verify_capacity, "kv-canary: verify_capacity must be non-negative, got {n}"),
    Rule(_rule_stride_positive, "kv-canary: req_to_token_stride0 must be positive, got {n}"),
    Rule(_rule_lut_nonempty, "kv-canary: lut_len must be positive when has_swa_lut is True"),
    *_ndim_then_len("req_pool_indices", lambda m, s: _bs(m)),
    *_ndim_then_len("prefix_lens", lambda m, s: _bs(m)),
    *_ndim_then_len("extend_seq_lens", lambda m, s: _bs(m)),
    NDim("req_to_token", 2, "kv-canary: {name} must be 2-D, got shape {shape}"),
    NDim("lut_tensor", 1, _1D_MSG),
    Rule(_rule_lut_min_len, "kv-canary: lut_tensor length must be >= {need}, got {n}"),
    *_ndim_then_len("out_write_offsets", lambda m, s: m["out_write_offsets"].shape[0]),
    *_ndim_then_len(
        "out_write_seed_slot_indices", lambda m, s: m["out_write_seed_slot_indices"].shape[0]
    ),
    *_ndim_then_len("out_verify_num_valid", lambda m, s: 1),
    *_ndim_then_len("out_verify_enable", lambda m, s: 1),
    *_ndim_then_len("out_write_num_valid_reqs", lambda m, s: 1),
    Rule(
        _rule_write_offsets_len,
        "kv-canary: write_offsets_len must equal write_req_capacity + 1, got {n} and {c}",
    ),
    Rule(_rule_bs_capacity, "kv-canary: bs={bs} exceeds write_req_capacity={c}"),
    Rule(
        _rule_stride_match,
        "kv-canary: req_to_token_stride0={a} does not match req_to_token.stride(0)={b}",
    ),
    Rule(
        _rule_same_device,
        "kv-canary: {name} must be on out_verify_offsets_scratch's device {dev}, got {dev2}",
    ),
)


# The entries half: the missing-valid_lens error, then SGLang's C++ guards.


def _rule_valid_lens(metas, scalars):
    if metas.get("req_to_verify_expected_tokens") is not None and metas.get(
        "req_to_verify_expected_tokens_valid_lens"
    ) is None:
        return {}
    return None


def _guard(name, want_ndim, want_dtype, want_len=None):
    """SGLang's C++ tensor-matcher guards (RuntimeError; their wording is not a contract)."""

    def fails(metas, scalars):
        m = metas.get(name)
        if m is None:
            return None
        exp_len = None if want_len is None else want_len(metas, scalars)
        bad = m.ndim != want_ndim or m.dtype != want_dtype or (
            exp_len is not None and m.shape[0] != exp_len
        )
        if not bad:
            return None
        desc = f"{want_ndim}-D {m.fmt_dtype(want_dtype)}"
        if exp_len is not None:
            desc += f" of length {exp_len}"
        return {"name": name, "desc": desc, "shape": m.shape, "dtype": m.fmt_dtype()}

    return Rule(fails, _ENTRIES + " {name} must be {desc}, got shape {shape} dtype {dtype}",
                exc=RuntimeError)


def _entries_bs(metas, scalars):
    return metas.get("req_pool_indices").shape[0]


def _cap(metas, scalars):
    return scalars["verify_capacity"]


ENTRIES_CHECKS: tuple[Check, ...] = (
    Rule(
        _rule_valid_lens,
        _ENTRIES + " requires req_to_verify_expected_tokens_valid_lens when "
        "req_to_verify_expected_tokens is set",
    ),
    _guard("out_verify_slot_indices", 1, "int64", _cap),
    _guard("out_verify_expected_tokens", 1, "int64", _cap),
    _guard("out_verify_expected_positions", 1, "int64", _cap),
    _guard("out_verify_prev_slot_indices", 1, "int64", _cap),
    _guard("req_to_verify_expected_tokens", 2, "int32"),
    _guard("req_to_verify_expected_tokens_valid_lens", 1, "int64", _entries_bs),
)


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


# SGLang's GPU-path order (docs/spec.md §8, §11.2, §11.3): SWA LUT presence, verify_capacity,
# the offsets kernel's checks, then the entries launcher's (missing valid_lens, then its C++ guards).
CONTRACT = Contract(
    op="canary_plan",
    checks=(
        Rule(_rule_swa_lut, _API + " requires full_to_swa_index_mapping when swa_window_size > 0"),
        Rule(
            _rule_capacity,
            _API + " verify_capacity={verify_capacity} does not match "
            "verify_plan_out.verify_slot_indices.shape[0]={n}",
        ),
        *OFFSETS_CHECKS,
        *ENTRIES_CHECKS,
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


def out_name(field: str) -> str:
    """SGLang's launcher name of a plan field (its messages use them): ``out_<field>``, and
    ``out_verify_enable`` for ``enable``."""
    return "out_verify_enable" if field == "enable" else f"out_{field}"


def validate(vp: VerifyPlan, wp: WritePlan, inputs: PlanInputs, *, swa_window_size: int,
             verify_capacity: int, req_to_token_stride0: int | None) -> None:
    """:data:`CONTRACT` on the op's arrays (raises at trace time)."""
    tensors = {f.name: getattr(inputs, f.name) for f in dataclasses.fields(PlanInputs)
               if f.name != "num_reqs"}
    for plan in (vp, wp):
        tensors.update({out_name(f.name): getattr(plan, f.name)
                        for f in dataclasses.fields(type(plan))})
    CONTRACT.validate_metas(
        plan_metas(tensors), swa_window_size=swa_window_size, verify_capacity=verify_capacity,
        req_to_token_stride0=req_to_token_stride0,
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
    validate(verify_plan_out, write_plan_out, inputs, swa_window_size=int(swa_window_size),
             verify_capacity=int(verify_capacity),
             req_to_token_stride0=None if req_to_token_stride0 is None
             else int(req_to_token_stride0))
    return reference(verify_plan_out, write_plan_out, inputs,
                     swa_window_size=int(swa_window_size), verify_capacity=int(verify_capacity),
                     kv_token_id_vs_position_offset=int(kv_token_id_vs_position_offset))
