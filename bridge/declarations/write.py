"""The declaration of ``launch_canary_write_kernel`` (:data:`WRITE`).

Stamps canary records for the batch's written tokens, updating ``canary_buf``, the ring, write
index and counters in place: the op's contract on the context over the caller's tensors, one
device, distinct outputs; the values checked on request (the write index, the plan's offsets
inside ``input_ids`` and non-decreasing, its seeds and ``out_cache_loc`` inside the canary
buffer); and the arguments: the context fields write reads, the plan's arrays (its offsets
clamped to the tokens' true length), the token arrays at ``bucket(length)`` (the expected ones
only when asserted), the real-KV sources as bytes. The step reuses the checks, the token arrays'
names and the call (:func:`write_statics`, :func:`write_validate`, :func:`write_tensors`,
:data:`TOKENS`, :func:`token_names`, :func:`write_call`).
"""

from __future__ import annotations

import dataclasses

import torch

from kvcanary_jax.bridge.checks import check_range, require_tensors
from kvcanary_jax.bridge.declarations.shared import (
    WP_FIELDS,
    Declaration,
    check_distinct_outputs,
    context_from,
    ctx_args,
    ctx_for_checks,
    ctx_tensors,
    dense,
    fields_of,
    reader,
    impl_for,
    offsets_arg,
    platform_of,
    rebuild,
    required_of,
    same_device,
    source_args,
    source_statics,
)
from kvcanary_jax import buckets
from kvcanary_jax import plans as _plans
from kvcanary_jax.context import check_write_index
from kvcanary_jax.ops import write as _write
from kvcanary_jax.ops.write import base as _write_base
from kvcanary_jax.ops.write.base import WriteTokens

__all__ = ["WRITE", "write_fn", "write_statics", "write_validate", "write_tensors", "TOKENS",
           "token_names", "write_call"]

_WRITE_P = "kv-canary: launch_canary_write_kernel"
TOKENS = tuple(f.name for f in dataclasses.fields(WriteTokens))
_EXPECTED = ("expected_input_tokens", "expected_input_positions")  # present iff asserted


_PLAN_FIELDS = reader(WP_FIELDS, "plan.")


def write_tensors(kw):
    out = ctx_tensors(kw["context"], "write")
    out.update(_PLAN_FIELDS(kw["plan"]))
    out.update({k: kw[k] for k in TOKENS})
    return out


def write_statics(kw):
    c = kw["context"]
    return (int(c.kernel_kind), int(c.real_kv_hash_mode), bool(kw["enable_write_input_assert"]),
            source_statics(c))


def write_validate(kw, ts):
    require_tensors(_WRITE_P, {k: v for k, v in required_of(ts).items() if k not in _EXPECTED})
    if not kw["enable_write_input_assert"] and any(
            ts[k] is not None and not isinstance(ts[k], torch.Tensor) for k in _EXPECTED):
        # SGLang's check, which a non-tensor would not reach here (its metadata is read first).
        raise ValueError("kv-canary: expected input tensors must be None when "
                         "enable_write_input_assert=False")
    tokens = {k: ts[k] for k in TOKENS}
    if kw["enable_write_input_assert"] and any(tokens[k] is None for k in _EXPECTED):
        # SGLang's "required" error, in its place among the checks, whatever the other one is.
        tokens.update({k: None for k in _EXPECTED if not isinstance(tokens[k], torch.Tensor)})
    _write_base.validate(ctx_for_checks(kw["context"]), kw["plan"], WriteTokens(**tokens),
                         kw["enable_write_input_assert"])
    same_device("canary_write", "canary_buf", ts)
    check_distinct_outputs({k: ts[k] for k in _write_base.OUTPUTS})


def _write_values(kw, ts):
    plan, context = kw["plan"], kw["context"]
    check_write_index(context.violation_write_index[0], _WRITE_P)
    num_slots = int(context.canary_buf.shape[0])
    cap = int(plan.write_seed_slot_indices.shape[0])
    a = max(0, min(int(plan.write_num_valid_reqs[0]), cap))
    offs = plan.write_offsets[: a + 1]
    check_range(_WRITE_P, "plan.write_offsets", offs, 0, int(ts["input_ids"].shape[0]) + 1,
                "flat token positions")
    if bool((offs[1:] < offs[:-1]).any()):
        raise ValueError(f"{_WRITE_P} plan.write_offsets must be non-decreasing over the "
                         f"{a} valid requests")
    check_range(_WRITE_P, "plan.write_seed_slot_indices",
                plan.write_seed_slot_indices[:a].clamp(min=-1), -1, num_slots,
                "canary slots, negative = new chain")
    check_range(_WRITE_P, "out_cache_loc", ts["out_cache_loc"].clamp(min=-1), -1, num_slots,
                "canary slots, negative = skip")


def write_call(context, plan, named, *, check, platform):
    return _write.run(context, plan, rebuild(WriteTokens, named),
                      enable_write_input_assert=check, implementation=impl_for("write", platform))


def write_fn(named, *, sources, kind, mode, check, platform):
    context = context_from(named, op="write", kind=kind, mode=mode, sources=sources)
    out = write_call(context, rebuild(_plans.WritePlan, named, "plan."), named, check=check,
                     platform=platform)
    return fields_of(out, _write_base.OUTPUTS)


def _token_args(ts, names, b):
    return [dense(k, ts[k], shape=(b,)) for k in names if ts[k] is not None]


def _write_arguments(kw, ts):
    context = kw["context"]
    check = bool(kw["enable_write_input_assert"])
    n = int(ts["input_ids"].shape[0])
    b = buckets.bucket(n)
    args = ctx_args(ts, "write", _write_base.OUTPUTS)
    wo = ts["plan.write_offsets"]
    args.append(offsets_arg("plan.write_offsets", wo, n, b))
    args += [dense(f"plan.{k}", ts[f"plan.{k}"]) for k in WP_FIELDS[1:]]
    args += _token_args(ts, token_names(check), b)
    src_args, sources = source_args(context)
    args += src_args
    static = dict(sources=sources, kind=int(context.kernel_kind),
                  mode=int(context.real_kv_hash_mode), check=check,
                  platform=platform_of(context.canary_buf))
    return args, static, _write_base.OUTPUTS


def token_names(check: bool) -> tuple[str, ...]:
    """The token arrays a write hands over: the expected ones only when it asserts them."""
    return tuple(k for k in TOKENS if check or k not in _EXPECTED)


WRITE = Declaration(
    name="launch_canary_write_kernel", anchor="canary_buf", outputs=_write_base.OUTPUTS,
    tensors=write_tensors,
    statics=write_statics, validate=write_validate, skip=lambda kw, ts: False,
    check_values=_write_values, arguments=_write_arguments, fn=write_fn,
)
