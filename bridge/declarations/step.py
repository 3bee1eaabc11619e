"""The declaration of ``launch_canary_step`` (:data:`STEP`): (scatter) + plan + verify + write
in one function.

Every launcher's static checks run first (nothing runs if one fails), from the other four
declarations; the values checked on request are the scatter's and the plan's, and the caller's
token arrays as the write launcher checks them (the verify and write plans are produced by this
very call). The arguments are the four's, the expected-token pool an in-place output when the
step scatters into it, the plan's batch size exact (its write plan feeds write in the same
program).
"""

from __future__ import annotations

import torch

from kvcanary_jax.bridge.checks import check_range
from kvcanary_jax.bridge.declarations.plan import (
    PLAN,
    PLAN_RESULTS,
    plan_args_at,
    plan_call,
    plan_scalars,
    plan_statics,
    plan_tensors,
    plan_validate,
    plan_values,
)
from kvcanary_jax.bridge.declarations.scatter import (
    scatter_call,
    scatter_skip,
    scatter_validate,
    scatter_values,
)
from kvcanary_jax.bridge.declarations.shared import (
    VP_FIELDS,
    WP_FIELDS,
    Declaration,
    context_from,
    count_arg,
    ctx_args,
    ctx_tensors,
    dense,
    fields_of,
    pitched,
    platform_of,
    same_device,
    source_args,
)
from kvcanary_jax.bridge.declarations.verify import verify_call, verify_tensors, verify_validate
from kvcanary_jax.bridge.declarations.write import (
    TOKENS,
    token_names,
    write_call,
    write_statics,
    write_tensors,
    write_validate,
)
from kvcanary_jax import buckets
from kvcanary_jax.context import check_write_index
from kvcanary_jax.ops.scatter.base import ScatterInputs
from kvcanary_jax.ops.write import base as _write_base

__all__ = ["STEP", "step_fn"]

_STEP_EXTRA = ("input_ids", "positions", "out_cache_loc", "expected_token_ids",
               "expected_token_offsets", "expected_input_tokens", "expected_input_positions")


def _step_tensors(kw):
    # The bucketed history first (STEP.bucketed).
    out = {"expected_token_ids": kw["expected_token_ids"]}
    out.update(plan_tensors(kw))
    out.update(ctx_tensors(kw["context"], "write"))
    out.update({k: kw[k] for k in _STEP_EXTRA})
    return out


def _step_statics(kw):
    return (plan_statics(kw), write_statics(kw), bool(kw["check_verify_expected_token"]))


def _do_scatter(kw) -> bool:
    return kw["expected_token_ids"] is not None or kw["expected_token_offsets"] is not None


def _step_validate(kw, ts):
    if _do_scatter(kw):
        if kw["req_to_verify_expected_tokens"] is None:
            raise ValueError(
                "kv-canary: launch_canary_step scatters expected_token_ids into "
                "req_to_verify_expected_tokens, which is None"
            )
        scatter_validate(kw, _step_scatter_tensors(kw))
    plan_validate(kw, plan_tensors(kw))
    verify_validate(dict(context=kw["context"], plan=kw["verify_plan_out"],
                         check_verify_expected_token=kw["check_verify_expected_token"]),
                    verify_tensors(dict(context=kw["context"], plan=kw["verify_plan_out"])))
    wkw = _step_write_kw(kw)
    write_validate(wkw, write_tensors(wkw))
    same_device("canary_step", "canary_buf",
                dict(canary_buf=kw["context"].canary_buf,
                     req_pool_indices=kw["req_pool_indices"],
                     verify_slot_indices=kw["verify_plan_out"].verify_slot_indices))


# The step's scatter reads the step's own arguments: each ScatterInputs field and the step
# argument (SGLang's launch_canary_step name) bound to it.
_STEP_SCATTER = dict(flat_in="expected_token_ids", offsets="expected_token_offsets",
                     req_pool_indices="req_pool_indices",
                     pool_out="req_to_verify_expected_tokens")


def _step_scatter_tensors(kw):
    return {field: kw[name] for field, name in _STEP_SCATTER.items()}


def _step_write_kw(kw):
    return dict(context=kw["context"], plan=kw["write_plan_out"],
                **{k: kw[k] for k in TOKENS},
                enable_write_input_assert=kw["enable_write_input_assert"])


def _step_values(kw, ts):
    if _do_scatter(kw) and not scatter_skip(kw, _step_scatter_tensors(kw)):
        scatter_values(kw, _step_scatter_tensors(kw))
    plan_values(kw, ts)
    # The verify and write plans are produced by this very call: their values are not checked,
    # but the caller's token arrays are, as the write launcher checks them (the write offsets
    # the plan derives from extend_seq_lens index input_ids; out_cache_loc holds canary slots):
    # a token past input_ids or a slot past the buffer would be skipped without a word.
    step = "kv-canary: launch_canary_step"
    rpi, extend = ts["req_pool_indices"], ts["extend_seq_lens"]
    total = int(torch.where(rpi != 0, extend.clamp(min=0), 0).sum()) if rpi.numel() else 0
    n = int(ts["input_ids"].shape[0])
    if total > n:
        raise ValueError(f"{step} extend_seq_lens of the active requests (req_pool_indices != 0) "
                         f"sum to {total}, more than the {n} tokens of input_ids")
    check_range(step, "out_cache_loc", ts["out_cache_loc"].clamp(min=-1), -1,
                int(kw["context"].canary_buf.shape[0]), "canary slots, negative = skip")
    check_write_index(kw["context"].violation_write_index[0], step)


def step_fn(named, *, scatter_cols, swa, cap, k, sources, kind, mode, check_token,
            check_input, platform):
    if scatter_cols is not None:
        # The scatter writes the expected-token pool, which the plan then reads.
        inputs = ScatterInputs(**{field: named[name] for field, name in _STEP_SCATTER.items()})
        named = dict(named, req_to_verify_expected_tokens=scatter_call(
            inputs, max_cols=scatter_cols, platform=platform,
            num_tokens=named.get("expected_token_count")))
    vp, wp = plan_call(named, swa=swa, cap=cap, k=k, platform=platform)
    context = context_from(named, op="write", kind=kind, mode=mode, sources=sources)
    context = verify_call(context, vp, check=check_token, platform=platform)
    context = write_call(context, wp, named, check=check_input, platform=platform)
    out = {**fields_of(vp, VP_FIELDS, "verify_plan_out."),
           **fields_of(wp, WP_FIELDS, "write_plan_out."),
           **fields_of(context, _write_base.OUTPUTS)}
    if scatter_cols is not None:
        out["req_to_verify_expected_tokens"] = named["req_to_verify_expected_tokens"]
    return out


def _step_arguments(kw, ts):
    context = kw["context"]
    args = []
    do_scatter = _do_scatter(kw) and not scatter_skip(kw, _step_scatter_tensors(kw))
    pool = ts["req_to_verify_expected_tokens"]
    if do_scatter:
        flat = ts["expected_token_ids"]
        b = buckets.bucket(int(flat.shape[0]))
        args.append(dense("expected_token_ids", flat, shape=(b,)))
        args.append(count_arg("expected_token_count", "expected_token_ids"))
        args.append(dense("expected_token_offsets", ts["expected_token_offsets"]))
    # The step's batch size stays exact: its write plan feeds write in the same program.
    plan_args = plan_args_at(ts, int(ts["req_pool_indices"].shape[0]), False)
    if do_scatter:  # the pool is written by the scatter: an in-place output of the step
        plan_args = [pitched(a.name, pool, out=True, check_fits=True)
                     if a.name == "req_to_verify_expected_tokens" else a for a in plan_args]
    args += plan_args
    args += ctx_args(ts, "write", _write_base.OUTPUTS)
    check_input = bool(kw["enable_write_input_assert"])
    args += [dense(k, ts[k]) for k in token_names(check_input)]
    src_args, sources = source_args(context)
    args += src_args
    swa, cap, k = plan_scalars(kw)
    static = dict(scatter_cols=int(pool.shape[1]) if do_scatter else None, swa=swa, cap=cap,
                  k=k, sources=sources, kind=int(context.kernel_kind),
                  mode=int(context.real_kv_hash_mode),
                  check_token=bool(kw["check_verify_expected_token"]), check_input=check_input,
                  platform=platform_of(context.canary_buf))
    results = PLAN_RESULTS + _write_base.OUTPUTS
    if do_scatter:
        results += ("req_to_verify_expected_tokens",)
    return args, static, results


STEP = Declaration(
    name="launch_canary_step", anchor="canary_buf",
    outputs=_write_base.OUTPUTS + PLAN.outputs, tensors=_step_tensors, bucketed=1,
    statics=_step_statics, validate=_step_validate, skip=lambda kw, ts: False,
    check_values=_step_values, arguments=_step_arguments, fn=step_fn,
    also_written=lambda kw: ("req_to_verify_expected_tokens",) if _do_scatter(kw) else (),
    may_also_write=("req_to_verify_expected_tokens",),
)

