"""canary_plan's contract, as data (:mod:`kvcanary_jax.contracts`) evaluated at trace time, before
anything is launched, so that nothing is written on error.

:data:`CONTRACT` is SGLang's GPU-path validation in its order, classes and words
(docs/spec.md §8, §11.2, §11.3): the SWA LUT's presence and ``verify_capacity`` (then, beyond
SGLang, the scalars as integers within int64: a ``TypeError`` or ``ValueError`` naming the first
that is not), then the offsets half's checks (:data:`OFFSETS_CHECKS`, its offsets kernel's
validation), then the entries half's (:data:`ENTRIES_CHECKS`: the missing ``valid_lens`` error,
then its launcher's C++ tensor guards). The checks read tensor metas by SGLang's launcher
names: :func:`plan_metas` builds them from JAX arrays or torch tensors (the bridge checks the
caller's tensors with the same contract), adding SGLang's ``lut_tensor``; :func:`out_name` is a
plan field's launcher name and :func:`row_stride` ``req_to_token``'s row stride as torch reports
it.
:func:`kvcanary_jax.ops.plan.base.validate` applies the contract to the op's pytrees.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Mapping

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

__all__ = [
    "CONTRACT",
    "PLAN_SCALARS",
    "OFFSETS_CHECKS",
    "ENTRIES_CHECKS",
    "plan_metas",
    "row_stride",
    "out_name",
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
        return s
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
    return None if a == b else {"a": a, "b": b}


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
    if n is None:
        return None
    try:  # SGLang's own comparison, whatever the value (a 0-d tensor equal to n passes it)
        same = bool(scalars["verify_capacity"] == n)
    except (TypeError, ValueError, RuntimeError):  # an array of several values
        same = False
    return None if same else {"n": n}


PLAN_SCALARS = ("swa_window_size", "verify_capacity", "kv_token_id_vs_position_offset")


def _given_scalars(scalars):
    """The plan's scalars given, with ``req_to_token_stride0`` where the caller passed one."""
    out = [(n, scalars[n]) for n in PLAN_SCALARS if n in scalars]
    if scalars.get("req_to_token_stride0") is not None:
        out.append(("req_to_token_stride0", scalars["req_to_token_stride0"]))
    return out


def _rule_integers(metas, scalars):
    """The first of the plan's scalars that is not an integer. SGLang's launcher truncates a float
    window or offset with ``int()``, and its reference computes positions with it; the kernels
    here compile per value, so a float or a tensor must never stand for an integer."""
    for name, v in _given_scalars(scalars):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            return {"name": name, "got": f"{type(v).__name__} {v!r}"}
    return None


def _rule_int64(metas, scalars):
    """An integer past int64 would fail inside JAX's argument parsing, with no word of which."""
    for name, v in _given_scalars(scalars):
        if not -(1 << 63) <= int(v) < (1 << 63):
            return {"name": name, "got": int(v)}
    return None


# SGLang's GPU-path order (docs/spec.md §8, §11.2, §11.3): SWA LUT presence, verify_capacity,
# (ours: the scalars' types and range), the offsets kernel's checks, then the entries
# launcher's (missing valid_lens, then its C++ guards).
CONTRACT = Contract(
    op="canary_plan",
    checks=(
        Rule(_rule_swa_lut, _API + " requires full_to_swa_index_mapping when swa_window_size > 0"),
        Rule(
            _rule_capacity,
            _API + " verify_capacity={verify_capacity} does not match "
            "verify_plan_out.verify_slot_indices.shape[0]={n}",
        ),
        Rule(_rule_integers, _API + " {name} must be an int, got {got}", TypeError),
        Rule(_rule_int64, _API + " {name} must fit in int64, got {got}"),
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


def out_name(field: str) -> str:
    """SGLang's launcher name of a plan field (its messages use them): ``out_<field>``, and
    ``out_verify_enable`` for ``enable``."""
    return "out_verify_enable" if field == "enable" else f"out_{field}"
