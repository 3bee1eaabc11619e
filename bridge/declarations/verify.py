"""The declaration of ``launch_canary_verify_kernel`` (:data:`VERIFY`).

Verifies one canary buffer against a verify plan, updating the context's ring, write index and
counters in place: the op's contract on the context over the caller's tensors, one device,
distinct outputs; the values checked on request (the write index, the plan's slots inside the
canary buffer); and the arguments: the context fields verify reads, the plan's arrays, the real-KV
sources as bytes. The step reuses the checks and the call (:func:`verify_validate`,
:func:`verify_tensors`, :func:`verify_call`).
"""

from __future__ import annotations

from kvcanary_jax.bridge.checks import check_range, require_tensors
from kvcanary_jax.bridge.declarations.shared import (
    VP_FIELDS,
    Declaration,
    check_distinct_outputs,
    context_from,
    ctx_args,
    ctx_for_checks,
    ctx_tensors,
    dense,
    fields_of,
    impl_for,
    platform_of,
    reader,
    rebuild,
    required_of,
    same_device,
    source_args,
    source_statics,
)
from kvcanary_jax import plans as _plans
from kvcanary_jax.context import check_write_index
from kvcanary_jax.ops import verify as _verify
from kvcanary_jax.ops.verify import base as _verify_base

__all__ = ["VERIFY", "verify_fn", "verify_validate", "verify_tensors", "verify_call"]

_VERIFY_P = "kv-canary: launch_canary_verify_kernel"


_PLAN_FIELDS = reader(VP_FIELDS, "plan.")


def verify_tensors(kw):
    out = ctx_tensors(kw["context"], "verify")
    out.update(_PLAN_FIELDS(kw["plan"]))
    return out


def _verify_statics(kw):
    c = kw["context"]
    return (int(c.kernel_kind), int(c.real_kv_hash_mode),
            bool(kw["check_verify_expected_token"]), source_statics(c))


def verify_validate(kw, ts):
    require_tensors(_VERIFY_P, required_of(ts))
    _verify_base.validate(ctx_for_checks(kw["context"]), kw["plan"])
    same_device("canary_verify", "canary_buf", ts)
    check_distinct_outputs({k: ts[k] for k in _verify_base.OUTPUTS})


def _verify_values(kw, ts):
    plan, context = kw["plan"], kw["context"]
    check_write_index(context.violation_write_index[0], _VERIFY_P)
    if int(plan.enable[0]) == 0:
        return
    n = max(0, min(int(plan.verify_num_valid[0]), int(plan.verify_slot_indices.shape[0])))
    num_slots = int(context.canary_buf.shape[0])
    check_range(_VERIFY_P, "plan.verify_slot_indices", plan.verify_slot_indices[:n], 0,
                num_slots, "canary slots")
    check_range(_VERIFY_P, "plan.verify_prev_slot_indices",
                plan.verify_prev_slot_indices[:n].clamp(min=-1), -1, num_slots,
                "canary slots, negative = chain head")


def verify_call(context, plan, *, check, platform):
    return _verify.run(context, plan, check_verify_expected_token=check,
                       implementation=impl_for("verify", platform))


def verify_fn(named, *, sources, kind, mode, check, platform):
    context = context_from(named, op="verify", kind=kind, mode=mode, sources=sources)
    out = verify_call(context, rebuild(_plans.VerifyPlan, named, "plan."), check=check,
                      platform=platform)
    return fields_of(out, _verify_base.OUTPUTS)


def _verify_arguments(kw, ts):
    context = kw["context"]
    args = ctx_args(ts, "verify", _verify_base.OUTPUTS)
    args += [dense(f"plan.{k}", ts[f"plan.{k}"]) for k in VP_FIELDS]
    src_args, sources = source_args(context)
    args += src_args
    static = dict(sources=sources, kind=int(context.kernel_kind),
                  mode=int(context.real_kv_hash_mode),
                  check=bool(kw["check_verify_expected_token"]),
                  platform=platform_of(context.canary_buf))
    return args, static, _verify_base.OUTPUTS


VERIFY = Declaration(
    name="launch_canary_verify_kernel", anchor="canary_buf", outputs=_verify_base.OUTPUTS,
    tensors=verify_tensors,
    statics=_verify_statics, validate=verify_validate, skip=lambda kw, ts: False,
    check_values=_verify_values, arguments=_verify_arguments, fn=verify_fn,
)
