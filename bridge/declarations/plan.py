"""The declaration of ``launch_canary_plan_kernels`` (:data:`PLAN`).

Fills both plans in place: the op's contract on the caller's tensors under SGLang's launcher names
(:func:`kvcanary_jax.ops.plan.contract.plan_metas`), then what SGLang's entries launcher requires
beyond its offsets kernel's checks; the values checked on request (rows of ``req_to_token``,
prefixes within its width, slots within the SWA table, the expected-token pool's cells the plan
reads within its rows and width); and the arguments: the request vectors at :func:`plan_lanes`
lanes with the batch size as an operand where the implementation takes it (see the package's
docstring). The step reuses the plan's tensors, checks, arguments and call (:func:`plan_tensors`,
:func:`plan_statics`, :func:`plan_scalars`, :func:`plan_validate`, :func:`plan_values`,
:func:`plan_args_at`, :data:`PLAN_RESULTS`, :func:`plan_call`).
"""

from __future__ import annotations

import torch

from kvcanary_jax.bridge.cache import CACHES
from kvcanary_jax.bridge.checks import require_tensors, torch_checks
from kvcanary_jax.bridge.declarations.shared import (
    VP_FIELDS,
    WP_FIELDS,
    Declaration,
    check_distinct_outputs,
    dense,
    fields_of,
    reader,
    impl_for,
    hashable,
    pitched,
    platform_of,
    rebuild,
    same_device,
)
from kvcanary_jax.bridge.dlpack import BridgeError
from kvcanary_jax.bridge.launcher import Arg
from kvcanary_jax import buckets
from kvcanary_jax import plans as _plans
from kvcanary_jax.ops import plan as _plan
from kvcanary_jax.ops.plan import base as _plan_base

__all__ = ["PLAN", "plan_fn", "plan_lanes", "plan_tensors", "plan_statics", "plan_scalars",
           "plan_validate",
           "plan_values", "plan_args_at", "PLAN_RESULTS", "plan_call"]

_PLAN_P = "kv-canary: launch_canary_plan_kernels"
_PLAN_IN = ("req_pool_indices", "prefix_lens", "extend_seq_lens", "req_to_token",
            "full_to_swa_index_mapping", "req_to_verify_expected_tokens",
            "req_to_verify_expected_tokens_valid_lens")


_VP_FIELDS = reader(VP_FIELDS, "verify_plan_out.")
_WP_FIELDS = reader(WP_FIELDS, "write_plan_out.")


def plan_tensors(kw):
    out = _VP_FIELDS(kw["verify_plan_out"])
    out.update(_WP_FIELDS(kw["write_plan_out"]))
    out.update({k: kw[k] for k in _PLAN_IN})
    out["num_reqs"] = _num_reqs(out["req_pool_indices"])
    return out


def _num_reqs(rpi):
    """The batch size as the plan's operand, on the batch's device (None where there is no
    batch to plan, or a device without kernels: the checks report those)."""
    if not isinstance(rpi, torch.Tensor) or rpi.ndim != 1:
        return None
    return CACHES.counts.view(rpi.device, rpi.shape[0])


def plan_statics(kw):
    """The plan's scalars in a call signature, each with its type (a float equal to an earlier
    call's integer must not reuse that call's checks, which refuse it)."""
    return tuple(hashable(kw[n]) for n in _plan.PLAN_SCALARS)


def plan_scalars(kw):
    """``(swa, cap, k)`` as ints, once :func:`plan_validate` has found them integers."""
    return tuple(int(kw[n]) for n in _plan.PLAN_SCALARS)


def plan_validate(kw, ts):
    required = {k: v for k, v in ts.items() if k.startswith(("verify_plan_out.",
                                                              "write_plan_out."))}
    required.update({k: ts[k] for k in _PLAN_IN[:4]})
    require_tensors(_PLAN_P, {**{k: ts[k] for k in _PLAN_IN[:4]}, **required})
    tensors = {k: ts[k] for k in _PLAN_IN}
    tensors.update({_plan_base.out_name(k.split(".", 1)[1]): v for k, v in required.items()
                    if "." in k})
    _plan.CONTRACT.validate_metas(
        _plan.plan_metas(tensors), req_to_token_stride0=None,
        **{n: kw[n] for n in _plan.PLAN_SCALARS},
    )
    # Torch-only: what SGLang's entries launcher requires beyond the offsets kernel's checks.
    torch_checks(
        "canary_plan", "out_verify_slot_indices",
        ("out_verify_slot_indices", "out_verify_expected_tokens",
         "out_verify_expected_positions", "out_verify_prev_slot_indices",
         "req_to_verify_expected_tokens_valid_lens"), (),
    ).validate({k: v for k, v in tensors.items() if v is not None})
    same_device("canary_plan", "out_verify_slot_indices", tensors)
    pool = ts["req_to_verify_expected_tokens"]
    if pool is not None and pool.stride(-1) != 1 and pool.numel() > 0:
        raise BridgeError(
            f"{_PLAN_P} req_to_verify_expected_tokens rows must be packed (stride(-1) == 1), "
            f"got strides {tuple(pool.stride())}"
        )
    check_distinct_outputs({k: v for k, v in ts.items() if "." in k})


def plan_values(kw, ts):
    """The rows the plan reads: an active request (``req_pool_indices[r] != 0``) with a prefix
    reads ``req_to_token`` at its row, columns ``[0, prefix_lens[r])``; SGLang's reference
    raises past the table (and wraps a negative row), where the kernels would read zeros. A
    request without a prefix reads nothing there, so its row is not checked (the reference
    accepts it too)."""
    rpi, prefix, rtt = ts["req_pool_indices"], ts["prefix_lens"], ts["req_to_token"]
    rows = int(rtt.shape[0])
    bad = (rpi != 0) & (prefix > 0) & ((rpi < 0) | (rpi >= rows))
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"{_PLAN_P} req_pool_indices[{i}]={int(rpi[i])} is outside [0, {rows}) "
                         "(rows of req_to_token)")
    width = int(rtt.shape[1])
    bad = (rpi != 0) & (prefix > width)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"{_PLAN_P} prefix_lens[{i}]={int(prefix[i])} exceeds req_to_token's "
                         f"width {width}")
    _lut_values(kw, ts)
    _pool_values(kw, ts)


def _lut_values(kw, ts) -> None:
    """The SWA table's entries the plan reads: the slot of every verified position and of its
    predecessor (columns ``[max(start - 1, 0), prefix_lens[r])`` of an active request's row;
    the write's seed is the last of them) goes through ``full_to_swa_index_mapping``. SGLang's
    reference raises past the table, in its words; its kernels, and these, clamp to the last
    entry, so that slot would be checked against another slot's canary."""
    lut, rpi = ts.get("full_to_swa_index_mapping"), ts["req_pool_indices"]
    prefix = ts["prefix_lens"]
    active = (rpi != 0) & (prefix > 0)
    if lut is None or not bool(active.any()):
        return
    rtt, n, swa = ts["req_to_token"], int(lut.shape[0]), int(kw["swa_window_size"])
    start = (prefix - swa).clamp(min=0) if swa > 0 else torch.zeros_like(prefix)
    cols = torch.arange(int(rtt.shape[1]), device=rtt.device)
    rows = rtt[torch.where(active, rpi, 0)].to(torch.int64)  # active rows: checked above
    read = active[:, None] & (cols >= (start - 1).clamp(min=0)[:, None]) & \
        (cols < prefix[:, None])
    bad = read & (rows >= n)
    if not bool(bad.any()):
        return
    r = int(bad.any(1).nonzero()[0, 0])
    for p in range(int(start[r]), int(prefix[r])):  # the reference's order: slot, predecessor
        for q in (p, p - 1):
            if q >= 0 and int(rows[r, q]) >= n:
                raise ValueError(f"kv-canary: SWA slot {int(rows[r, q])} is outside "
                                 f"full_to_swa_index_mapping length {n}")


def _pool_values(kw, ts) -> None:
    """The expected-token pool's cells the plan reads: for an active request ``r``, columns
    ``position + kv_token_id_vs_position_offset`` of row ``req_pool_indices[r]``, for each
    verified position, those in ``[0, valid_lens[r])``. SGLang's reference indexes the pool
    there (an IndexError past it); the kernels would read another row's tokens past the width,
    or none past the last row, each without a word."""
    pool = ts.get("req_to_verify_expected_tokens")
    lens = ts.get("req_to_verify_expected_tokens_valid_lens")
    rpi = ts["req_pool_indices"]
    if pool is None or lens is None or rpi.numel() == 0:
        return
    prefix, lens = ts["prefix_lens"].to(torch.int64), lens.to(torch.int64)
    swa, off = int(kw["swa_window_size"]), int(kw["kv_token_id_vs_position_offset"])
    start = (prefix - swa).clamp(min=0) if swa > 0 else torch.zeros_like(prefix)
    lo, hi = (start + off).clamp(min=0), torch.minimum(prefix + off, lens)
    reads = (rpi != 0) & (hi > lo)
    rows, width = int(pool.shape[0]), int(pool.shape[1])
    bad = reads & (rpi >= rows)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"{_PLAN_P} req_pool_indices[{i}]={int(rpi[i])} is outside [0, {rows}) "
                         "(rows of req_to_verify_expected_tokens)")
    bad = reads & (hi > width)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"{_PLAN_P} req_to_verify_expected_tokens_valid_lens[{i}]={int(lens[i])} reads past "
            f"req_to_verify_expected_tokens's width {width} (prefix_lens[{i}]={int(prefix[i])}, "
            f"kv_token_id_vs_position_offset={off})")


def plan_lanes(ts, platform: str) -> tuple[int, bool]:
    """The request lanes the plan is lowered for, and whether the batch size is an operand:
    ``min(bucket(bs), write_req_capacity)`` and True where the implementation takes it, else
    ``bs`` and False."""
    bs = int(ts["req_pool_indices"].shape[0])
    if bs == 0 or ts.get("num_reqs") is None or \
            not _plan.takes_num_reqs(impl_for("plan", platform)):
        return bs, False
    cap = int(ts["write_plan_out.write_seed_slot_indices"].shape[0])
    return min(buckets.bucket(bs), cap), True


def plan_args_at(ts, lanes: int, has_n: bool) -> list[Arg]:
    """The plan's arguments; absent optionals are left out (the function finds no argument of
    that name). Request vectors at ``lanes``, with the ``num_reqs`` operand last when ``has_n``
    (see :func:`plan_lanes`)."""
    args = [dense(f"verify_plan_out.{k}", ts[f"verify_plan_out.{k}"], out=True) for k in VP_FIELDS]
    args += [dense(f"write_plan_out.{k}", ts[f"write_plan_out.{k}"], out=True) for k in WP_FIELDS]
    args += [dense(k, ts[k], shape=(lanes,)) for k in ("req_pool_indices", "prefix_lens",
                                                       "extend_seq_lens")]
    args.append(dense("req_to_token", ts["req_to_token"]))
    for k in ("full_to_swa_index_mapping", "req_to_verify_expected_tokens",
              "req_to_verify_expected_tokens_valid_lens"):
        t = ts[k]
        if t is None:
            continue
        if k == "req_to_verify_expected_tokens":
            args.append(pitched(k, t, out=False, check_fits=True))
        else:
            args.append(dense(k, t, shape=(lanes,) if k.endswith("valid_lens") else None))
    if has_n:
        args.append(dense("num_reqs", ts["num_reqs"]))
    return args


# The plan's outputs, by the names of the arguments they update.
PLAN_RESULTS = tuple(f"verify_plan_out.{k}" for k in VP_FIELDS) + tuple(f"write_plan_out.{k}"
                                                                        for k in WP_FIELDS)


def plan_call(named, *, swa, cap, k, platform, config=None):
    return _plan.run(rebuild(_plans.VerifyPlan, named, "verify_plan_out."),
                     rebuild(_plans.WritePlan, named, "write_plan_out."),
                     rebuild(_plan.PlanInputs, named), swa_window_size=swa, verify_capacity=cap,
                     kv_token_id_vs_position_offset=k, implementation=impl_for("plan", platform),
                     config=config)


def plan_fn(named, *, swa, cap, k, platform, config=None):
    """``config``: the implementation's launch configuration (tests shrink its blocks)."""
    vp, wp = plan_call(named, swa=swa, cap=cap, k=k, platform=platform, config=config)
    return {**fields_of(vp, VP_FIELDS, "verify_plan_out."),
            **fields_of(wp, WP_FIELDS, "write_plan_out.")}


def _plan_arguments(kw, ts):
    platform = platform_of(ts["verify_plan_out.verify_slot_indices"])
    lanes, has_n = plan_lanes(ts, platform)
    swa, cap, k = plan_scalars(kw)
    static = dict(swa=swa, cap=cap, k=k, platform=platform)
    return plan_args_at(ts, lanes, has_n), static, PLAN_RESULTS


PLAN = Declaration(
    name="launch_canary_plan_kernels", anchor="verify_plan_out.verify_slot_indices",
    outputs=PLAN_RESULTS,
    tensors=plan_tensors, statics=plan_statics, validate=plan_validate,
    skip=lambda kw, ts: False, check_values=plan_values, arguments=_plan_arguments, fn=plan_fn,
)
