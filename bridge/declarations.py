"""SGLang's kv-canary launchers declared as data for the generic launcher (:mod:`.launcher`).

A :class:`Declaration` says, for one launcher: its tensors by SGLang's names (read from the keyword
arguments and SGLang's dataclasses), its non-tensor arguments, its static checks (the ops' contracts
evaluated on the torch tensors: SGLang's classes, words and order, then the torch-only checks), its
opt-in value checks, when there is nothing to launch, and how the call becomes the arguments of one
array function over JAX arrays (:class:`~kvcanary_jax.bridge.launcher.Arg`: shape as lowered,
layout, in-place outputs) that calls the package's array-level entry points. The same function runs
through XLA on the DLPack path and is lowered to its Triton kernels on the direct path: one kernel
source.

Buckets (:mod:`kvcanary_jax.buckets`): scatter's ``flat_in`` and write's token arrays are lowered
at ``bucket(length)``; the offsets that index them are clamped to the true length by a torch op
on the call's stream (a per-call temporary), which keeps every read below the true length on
both paths. ``launch_canary_step`` buckets its scatter input only (its write offsets are computed
inside the step). The plan's request vectors are lowered at ``min(bucket(bs),
write_req_capacity)`` with the batch size as an operand (``num_reqs``: a device scalar from
:class:`kvcanary_jax.bridge.cache.Counts`): its kernels never read a request lane at or past it, so
the caller's shorter vectors are passed as they are on the direct path (staged on the DLPack path)
and the plan equals the unpadded one (:func:`kvcanary_jax.ops.plan.base.batch_lanes`).
"""

from __future__ import annotations

import dataclasses
import types
from typing import Callable

import torch

from kvcanary_jax.bridge.cache import CACHES
from kvcanary_jax.bridge.checks import check_range, require_tensors, torch_checks
from kvcanary_jax.bridge.dlpack import BridgeError
from kvcanary_jax.bridge.launcher import Arg
from kvcanary_jax import buckets, default_implementation
from kvcanary_jax import plans as _plans
from kvcanary_jax.context import RealKvSource, VerifyOrWriteContext, check_write_index
from kvcanary_jax.contracts import Contract, SameDevice, TensorMeta, meta_of
from kvcanary_jax.ops import plan as _plan
from kvcanary_jax.ops import scatter as _scatter
from kvcanary_jax.ops import verify as _verify
from kvcanary_jax.ops import write as _write
from kvcanary_jax.ops.plan import base as _plan_base
from kvcanary_jax.ops.scatter.base import ScatterInputs
from kvcanary_jax.ops.verify import base as _verify_base
from kvcanary_jax.ops.write import base as _write_base
from kvcanary_jax.ops.write.base import WriteTokens

__all__ = ["Declaration", "SCATTER", "PLAN", "VERIFY", "WRITE", "STEP"]


@dataclasses.dataclass(frozen=True)
class Declaration:
    """One launcher (see the module docstring). Every callable takes the call's keyword
    arguments (and the tensors dict that ``tensors`` returned)."""

    name: str
    anchor: str  # the tensor whose device the call runs on
    outputs: tuple[str, ...]  # in-place outputs that must not share memory (checked per address)
    tensors: Callable[[dict], dict]
    statics: Callable[[dict], tuple]
    validate: Callable[[dict, dict], None]
    skip: Callable[[dict, dict], bool]
    check_values: Callable[[dict, dict], None]
    # (kwargs, tensors) -> (args, static, results): ``results`` names the arguments the
    # function's outputs update (the launcher binds both by name, once per signature).
    arguments: Callable[..., tuple]
    fn: Callable  # fn(named arrays, **static) -> {argument name: its new value}
    # Tensors this call writes besides ``outputs`` (the step's expected-token pool when it
    # scatters): they must not share memory with any input either.
    also_written: Callable[[dict], tuple] = lambda kw: ()


# --------------------------------------------------------------------------------------------
# Shared pieces

# Field names read off the package's pytrees: a field declared there is bound by its name.
_VP = tuple(f.name for f in dataclasses.fields(_plans.VerifyPlan))
_WP = tuple(f.name for f in dataclasses.fields(_plans.WritePlan))
# Every array field of the context (each op hands over those it reads: ``array_fields(op)``).
_CTX_FIELDS = tuple(dict.fromkeys(VerifyOrWriteContext.array_fields("verify")
                                  + VerifyOrWriteContext.array_fields("write")))


def _platform(t) -> str:
    """The JAX platform whose default implementation runs the op for tensor ``t``'s device
    (the launcher replaces it by the DLPack path's device platform, or "cuda" on the direct
    path, whose functions must lower to Pallas Triton kernels)."""
    return "cuda" if t.device.type == "cuda" else "cpu"


def _impl(op: str, platform: str) -> str:
    return default_implementation(op, platform)


# Binding by name: each argument's name is its path in the op's pytrees (a context field,
# ``plan.<field>``, ``real_kv_sources[i].tensor``, a token array's name), and each output comes
# back under the name of the argument it updates.

def _rebuild(cls, named: dict, prefix: str = ""):
    """The pytree ``cls`` from the arrays bound as ``prefix + field`` (None where no argument
    holds a field: an optional array left out, or a field the op does not read)."""
    return cls(**{f.name: named.get(prefix + f.name) for f in dataclasses.fields(cls)})


def _fields(obj, names, prefix: str = "") -> dict:
    return {prefix + k: getattr(obj, k) for k in names}


def _context(named: dict, *, op: str, kind: int, mode: int, sources: tuple):
    """The op's :class:`~kvcanary_jax.context.VerifyOrWriteContext` from the arrays bound by
    name; ``sources``: the static :class:`~kvcanary_jax.context.RealKvSource` s whose tensors
    are bound as ``real_kv_sources[i].tensor``."""
    return VerifyOrWriteContext(
        **{k: named.get(k) for k in _CTX_FIELDS}, kernel_kind=kind, real_kv_hash_mode=mode,
        real_kv_sources=tuple(dataclasses.replace(s, tensor=named[f"real_kv_sources[{i}].tensor"])
                              for i, s in enumerate(sources)))


def _dense(name, t, *, out=False, shape=None, clamp=None) -> Arg:
    return Arg(name=name, shape=tuple(t.shape) if shape is None else shape, dtype=t.dtype,
               out=out, clamp=clamp)


def _pitched(name, t, *, out, check_fits: bool) -> Arg:
    """A 2-D view with packed rows, as its base ``[rows, stride(0)]`` from its first element.
    ``check_fits``: the op reads the base's full rows (not only the view's columns), so the base
    must lie inside the storage (checked on every call: it depends on the storage offset)."""
    rows, cols = int(t.shape[0]), int(t.shape[1])
    pitch = int(t.stride(0)) if rows > 1 else max(cols, int(t.stride(0)))
    if t.is_contiguous() or rows == 0:
        pitch = cols
    elif t.stride(1) != 1 or pitch < cols:
        raise BridgeError(
            f"kv-canary bridge: {name} is a strided view (shape={tuple(t.shape)}, "
            f"strides={tuple(t.stride())}) the kernels cannot address (they step rows by "
            f"stride(0) over packed columns); pass {name}.contiguous() and copy the result back"
        )
    return Arg(name=name, shape=(rows, pitch), dtype=t.dtype, layout="pitched", out=out,
               cols=cols, whole_rows=check_fits)


def _source_arg(i, s) -> tuple[Arg, RealKvSource]:
    """A real-KV source as the bytes its kernels read, from the view's first element, and its
    static description: the view as uint8 rows (row stride, row count), with its tensor bound
    by name when the function runs."""
    t = s.tensor
    item = t.element_size()
    rows = int(t.shape[0])
    stride_bytes = int(t.stride(0)) * item
    need = 0 if rows == 0 else (rows - 1) * stride_bytes + int(s.page_size) * int(
        s.num_bytes_per_token)
    name = f"real_kv_sources[{i}].tensor"
    view = TensorMeta(shape=(rows, int(t.shape[1]) * item), dtype="uint8",
                      strides=(stride_bytes, 1), device=None, framework="torch")
    static = RealKvSource(tensor=None, page_size=int(s.page_size),
                          num_bytes_per_token=int(s.num_bytes_per_token),
                          read_bytes=int(s.read_bytes), view=view)
    return Arg(name=name, shape=(max(need, 8),), dtype=torch.uint8, layout="bytes"), static


def _source_statics(context) -> tuple:
    return tuple((int(s.page_size), int(s.num_bytes_per_token), int(s.read_bytes))
                 for s in context.real_kv_sources)


def _ctx_for_checks(context):
    """SGLang's context as the ops' contracts read it: the package's context over the torch
    tensors, each source as its tensor and the torch view's metadata."""
    return VerifyOrWriteContext(
        **{k: getattr(context, k, None) for k in _CTX_FIELDS}, kernel_kind=context.kernel_kind,
        real_kv_hash_mode=context.real_kv_hash_mode,
        real_kv_sources=tuple(types.SimpleNamespace(tensor=s.tensor, meta=meta_of(s.tensor))
                              for s in context.real_kv_sources))


def _same_device(op, anchor, tensors: dict):
    present = {k: v for k, v in tensors.items() if isinstance(v, torch.Tensor)}
    Contract(op=op, checks=(SameDevice(anchor, tuple(present)),)).validate(present)


def check_distinct_outputs(outputs: dict) -> None:
    """Two in-place outputs sharing memory cannot both be donated (and SGLang's kernels would
    race on them): refuse, naming both."""
    spans = []
    for name, t in outputs.items():
        if t is None or t.numel() == 0:
            continue
        lo = t.data_ptr()
        last = (t.shape[0] - 1) * t.stride(0) + (t[0].numel() if t.dim() > 1 else 1)
        hi = lo + last * t.element_size()
        for other, (a, b) in spans:
            if lo < b and a < hi and t.device == outputs[other].device:
                raise BridgeError(
                    f"kv-canary bridge: {name} and {other} share memory; in-place outputs must "
                    "be distinct tensors"
                )
        spans.append((name, (lo, hi)))


def _offsets(name, t, n: int, b: int) -> Arg:
    """Offsets indexing a token array of true length ``n`` lowered at bucket ``b``: clamped to
    ``min(offsets, n)`` per call where ``b > n``, so every range loses exactly its indices at or
    past ``n``, which the ops never read (see :mod:`kvcanary_jax.buckets`)."""
    return _dense(name, t, clamp=n if b != n else None)


# --------------------------------------------------------------------------------------------
# scatter

_SP = "kv-canary: scatter_req_token_ids"
_SCATTER_TORCH = torch_checks(
    "scatter_req_token_ids", "pool_out", ("flat_in", "offsets", "req_pool_indices"),
    ("flat_in", "offsets", "req_pool_indices", "pool_out"))


def _scatter_tensors(kw):
    return {k: kw[k] for k in ("flat_in", "offsets", "req_pool_indices", "pool_out")}


def _scatter_validate(kw, ts):
    require_tensors(_SP, ts)
    _scatter.CONTRACT.validate(ts)
    _SCATTER_TORCH.validate(ts)


def _scatter_skip(kw, ts):
    return ts["req_pool_indices"].shape[0] == 0 or ts["flat_in"].shape[0] == 0


def _scatter_values(kw, ts):
    pool, offsets = ts["pool_out"], ts["offsets"]
    num_tokens = int(ts["flat_in"].shape[0])
    check_range(_SP, "req_pool_indices", ts["req_pool_indices"], 0, int(pool.shape[0]),
                "rows of pool_out")
    check_range(_SP, "offsets", offsets, 0, num_tokens + 1, "flat_in positions")
    if bool((offsets[1:] < offsets[:-1]).any()):
        raise ValueError(f"{_SP} offsets must be non-decreasing, got {offsets.tolist()}")


def _scatter_args(flat_in, offsets, rpi, pool_name, pool):
    """Scatter's arguments, ``flat_in`` bucketed; ``pool`` may be a view with strided rows (only
    its columns are written, so its base may run past the storage on the direct path)."""
    n = int(flat_in.shape[0])
    b = buckets.bucket(n)
    args = [
        _dense("flat_in", flat_in, shape=(b,)),
        _offsets("offsets", offsets, n, b),
        _dense("req_pool_indices", rpi),
        _pitched(pool_name, pool, out=True, check_fits=False),
    ]
    return args


def _scatter_call(inputs: ScatterInputs, *, max_cols, platform):
    return _scatter.run(inputs, max_cols=max_cols, implementation=_impl("scatter", platform))


def scatter_fn(named, *, max_cols, platform):
    # The arguments are named after ScatterInputs' fields; the pool comes back as pool_out.
    return {"pool_out": _scatter_call(_rebuild(ScatterInputs, named), max_cols=max_cols,
                                      platform=platform)}


def _scatter_arguments(kw, ts):
    pool = ts["pool_out"]
    args = _scatter_args(ts["flat_in"], ts["offsets"], ts["req_pool_indices"], "pool_out", pool)
    return args, dict(max_cols=int(pool.shape[1]), platform=_platform(pool)), ("pool_out",)


SCATTER = Declaration(
    name="launch_scatter_req_token_ids_kernel", anchor="pool_out", outputs=("pool_out",),
    tensors=_scatter_tensors,
    statics=lambda kw: (), validate=_scatter_validate, skip=_scatter_skip,
    check_values=_scatter_values, arguments=_scatter_arguments, fn=scatter_fn,
)


# --------------------------------------------------------------------------------------------
# plan

_PLAN_P = "kv-canary: launch_canary_plan_kernels"
_PLAN_IN = ("req_pool_indices", "prefix_lens", "extend_seq_lens", "req_to_token",
            "full_to_swa_index_mapping", "req_to_verify_expected_tokens",
            "req_to_verify_expected_tokens_valid_lens")




def _plan_tensors(kw):
    vp, wp = kw["verify_plan_out"], kw["write_plan_out"]
    out = _fields(vp, _VP, "verify_plan_out.")
    out.update(_fields(wp, _WP, "write_plan_out."))
    out.update({k: kw[k] for k in _PLAN_IN})
    out["num_reqs"] = _num_reqs(out["req_pool_indices"])
    return out


def _num_reqs(rpi):
    """The batch size as the plan's operand, on the batch's device (None where there is no
    batch to plan, or a device without kernels: the checks report those)."""
    if not isinstance(rpi, torch.Tensor) or rpi.ndim != 1:
        return None
    return CACHES.counts.view(rpi.device, rpi.shape[0])


def _plan_statics(kw):
    return (int(kw["swa_window_size"]), int(kw["verify_capacity"]),
            int(kw["kv_token_id_vs_position_offset"]))


def _plan_validate(kw, ts):
    required = {k: v for k, v in ts.items() if k.startswith(("verify_plan_out.",
                                                              "write_plan_out."))}
    required.update({k: ts[k] for k in _PLAN_IN[:4]})
    require_tensors(_PLAN_P, {**{k: ts[k] for k in _PLAN_IN[:4]}, **required})
    tensors = {k: ts[k] for k in _PLAN_IN}
    tensors.update({_plan_base.out_name(k.split(".", 1)[1]): v for k, v in required.items()
                    if "." in k})
    _plan.CONTRACT.validate_metas(
        _plan.plan_metas(tensors), swa_window_size=int(kw["swa_window_size"]),
        verify_capacity=int(kw["verify_capacity"]), req_to_token_stride0=None,
    )
    # Torch-only: what SGLang's entries launcher requires beyond the offsets kernel's checks.
    torch_checks(
        "canary_plan", "out_verify_slot_indices",
        ("out_verify_slot_indices", "out_verify_expected_tokens",
         "out_verify_expected_positions", "out_verify_prev_slot_indices",
         "req_to_verify_expected_tokens_valid_lens"), (),
    ).validate({k: v for k, v in tensors.items() if v is not None})
    _same_device("canary_plan", "out_verify_slot_indices", tensors)
    pool = ts["req_to_verify_expected_tokens"]
    if pool is not None and pool.stride(-1) != 1 and pool.numel() > 0:
        raise BridgeError(
            f"{_PLAN_P} req_to_verify_expected_tokens rows must be packed (stride(-1) == 1), "
            f"got strides {tuple(pool.stride())}"
        )
    check_distinct_outputs({k: v for k, v in ts.items() if "." in k})


def _plan_values(kw, ts):
    rpi, prefix, rtt = ts["req_pool_indices"], ts["prefix_lens"], ts["req_to_token"]
    check_range(_PLAN_P, "req_pool_indices", rpi, 0, int(rtt.shape[0]), "rows of req_to_token")
    width = int(rtt.shape[1])
    bad = (rpi != 0) & (prefix > width)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"{_PLAN_P} prefix_lens[{i}]={int(prefix[i])} exceeds req_to_token's "
                         f"width {width}")


def plan_lanes(ts, platform: str) -> tuple[int, bool]:
    """The request lanes the plan is lowered for, and whether the batch size is an operand:
    ``min(bucket(bs), write_req_capacity)`` and True where the implementation takes it, else
    ``bs`` and False."""
    bs = int(ts["req_pool_indices"].shape[0])
    if bs == 0 or ts.get("num_reqs") is None or \
            not _plan.takes_num_reqs(_impl("plan", platform)):
        return bs, False
    cap = int(ts["write_plan_out.write_seed_slot_indices"].shape[0])
    return min(buckets.bucket(bs), cap), True


def _plan_args(ts, lanes: int, has_n: bool) -> list[Arg]:
    """The plan's arguments; absent optionals are left out (the function finds no argument of
    that name). Request vectors at ``lanes``, with the ``num_reqs`` operand last when ``has_n``
    (see :func:`plan_lanes`)."""
    args = [_dense(f"verify_plan_out.{k}", ts[f"verify_plan_out.{k}"], out=True) for k in _VP]
    args += [_dense(f"write_plan_out.{k}", ts[f"write_plan_out.{k}"], out=True) for k in _WP]
    args += [_dense(k, ts[k], shape=(lanes,)) for k in ("req_pool_indices", "prefix_lens",
                                                         "extend_seq_lens")]
    args.append(_dense("req_to_token", ts["req_to_token"]))
    for k in ("full_to_swa_index_mapping", "req_to_verify_expected_tokens",
              "req_to_verify_expected_tokens_valid_lens"):
        t = ts[k]
        if t is None:
            continue
        if k == "req_to_verify_expected_tokens":
            args.append(_pitched(k, t, out=False, check_fits=True))
        else:
            args.append(_dense(k, t, shape=(lanes,) if k.endswith("valid_lens") else None))
    if has_n:
        args.append(_dense("num_reqs", ts["num_reqs"]))
    return args


# The plan's outputs, by the names of the arguments they update.
_PLAN_RESULTS = tuple(f"verify_plan_out.{k}" for k in _VP) + tuple(f"write_plan_out.{k}"
                                                                    for k in _WP)


def _plan_call(named, *, swa, cap, k, platform, config=None):
    return _plan.run(_rebuild(_plans.VerifyPlan, named, "verify_plan_out."),
                     _rebuild(_plans.WritePlan, named, "write_plan_out."),
                     _rebuild(_plan.PlanInputs, named), swa_window_size=swa, verify_capacity=cap,
                     kv_token_id_vs_position_offset=k, implementation=_impl("plan", platform),
                     config=config)


def plan_fn(named, *, swa, cap, k, platform, config=None):
    """``config``: the implementation's launch configuration (tests shrink its blocks)."""
    vp, wp = _plan_call(named, swa=swa, cap=cap, k=k, platform=platform, config=config)
    return {**_fields(vp, _VP, "verify_plan_out."), **_fields(wp, _WP, "write_plan_out.")}


def _plan_arguments(kw, ts):
    platform = _platform(ts["verify_plan_out.verify_slot_indices"])
    lanes, has_n = plan_lanes(ts, platform)
    swa, cap, k = _plan_statics(kw)
    static = dict(swa=swa, cap=cap, k=k, platform=platform)
    return _plan_args(ts, lanes, has_n), static, _PLAN_RESULTS


PLAN = Declaration(
    name="launch_canary_plan_kernels", anchor="verify_plan_out.verify_slot_indices",
    outputs=_PLAN_RESULTS,
    tensors=_plan_tensors, statics=_plan_statics, validate=_plan_validate,
    skip=lambda kw, ts: False, check_values=_plan_values, arguments=_plan_arguments, fn=plan_fn,
)


# --------------------------------------------------------------------------------------------
# verify

_VERIFY_P = "kv-canary: launch_canary_verify_kernel"


_SOURCE_NAMES = tuple(f"real_kv_sources[{i}].tensor" for i in range(8))
# The context fields each op reads (the context's declaration says), looked up once; a field
# declared with a default may be missing from the caller's context (read as None, not handed
# over).
_CTX_READ = {op: VerifyOrWriteContext.array_fields(op) for op in ("verify", "write")}
_CTX_OPTIONAL = VerifyOrWriteContext.optional_fields()
# Per op: (required fields, optional fields), split once so a call reads each without a test.
_CTX_SPLIT = {op: (tuple(k for k in f if k not in _CTX_OPTIONAL),
                   tuple(k for k in f if k in _CTX_OPTIONAL)) for op, f in _CTX_READ.items()}


def _required(ts: dict) -> dict:
    """The tensors a launcher requires: all but the optional context fields left absent."""
    return {k: v for k, v in ts.items() if v is not None or k not in _CTX_OPTIONAL}


def _ctx_tensors(context, op: str) -> dict:
    required, optional = _CTX_SPLIT[op]
    out = {k: getattr(context, k) for k in required}
    if optional:
        out.update({k: getattr(context, k, None) for k in optional})
    sources = context.real_kv_sources
    if sources:
        # More than MAX_REAL_KV_SOURCES is refused by the contract, named like the others.
        out.update({(_SOURCE_NAMES[i] if i < 8 else f"real_kv_sources[{i}].tensor"): s.tensor
                    for i, s in enumerate(sources)})
    return out


def _verify_tensors(kw):
    out = _ctx_tensors(kw["context"], "verify")
    out.update(_fields(kw["plan"], _VP, "plan."))
    return out


def _verify_statics(kw):
    c = kw["context"]
    return (int(c.kernel_kind), int(c.real_kv_hash_mode),
            bool(kw["check_verify_expected_token"]), _source_statics(c))


def _verify_validate(kw, ts):
    require_tensors(_VERIFY_P, _required(ts))
    _verify_base.validate(_ctx_for_checks(kw["context"]), kw["plan"])
    _same_device("canary_verify", "canary_buf", ts)
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


def _ctx_args(ts, op: str, outputs: tuple[str, ...]) -> list[Arg]:
    return [_dense(k, ts[k], out=k in outputs) for k in _CTX_READ[op] if ts[k] is not None]


def _source_args(context):
    pairs = [_source_arg(i, s) for i, s in enumerate(context.real_kv_sources)]
    return [a for a, _ in pairs], tuple(s for _, s in pairs)


def _verify_call(context, plan, *, check, platform):
    return _verify.run(context, plan, check_verify_expected_token=check,
                       implementation=_impl("verify", platform))


def verify_fn(named, *, sources, kind, mode, check, platform):
    context = _context(named, op="verify", kind=kind, mode=mode, sources=sources)
    out = _verify_call(context, _rebuild(_plans.VerifyPlan, named, "plan."), check=check,
                       platform=platform)
    return _fields(out, _verify_base.OUTPUTS)


def _verify_arguments(kw, ts):
    context = kw["context"]
    args = _ctx_args(ts, "verify", _verify_base.OUTPUTS)
    args += [_dense(f"plan.{k}", ts[f"plan.{k}"]) for k in _VP]
    src_args, sources = _source_args(context)
    args += src_args
    static = dict(sources=sources, kind=int(context.kernel_kind),
                  mode=int(context.real_kv_hash_mode),
                  check=bool(kw["check_verify_expected_token"]),
                  platform=_platform(context.canary_buf))
    return args, static, _verify_base.OUTPUTS


VERIFY = Declaration(
    name="launch_canary_verify_kernel", anchor="canary_buf", outputs=_verify_base.OUTPUTS,
    tensors=_verify_tensors,
    statics=_verify_statics, validate=_verify_validate, skip=lambda kw, ts: False,
    check_values=_verify_values, arguments=_verify_arguments, fn=verify_fn,
)


# --------------------------------------------------------------------------------------------
# write

_WRITE_P = "kv-canary: launch_canary_write_kernel"
_TOKENS = tuple(f.name for f in dataclasses.fields(WriteTokens))
_EXPECTED = ("expected_input_tokens", "expected_input_positions")  # present iff asserted


def _write_tensors(kw):
    out = _ctx_tensors(kw["context"], "write")
    out.update(_fields(kw["plan"], _WP, "plan."))
    out.update({k: kw[k] for k in _TOKENS})
    return out


def _write_statics(kw):
    c = kw["context"]
    return (int(c.kernel_kind), int(c.real_kv_hash_mode), bool(kw["enable_write_input_assert"]),
            _source_statics(c))


def _write_validate(kw, ts):
    require_tensors(_WRITE_P, {k: v for k, v in _required(ts).items() if k not in _EXPECTED})
    _write_base.validate(_ctx_for_checks(kw["context"]), kw["plan"],
                         WriteTokens(**{k: ts[k] for k in _TOKENS}),
                         kw["enable_write_input_assert"])
    _same_device("canary_write", "canary_buf", ts)
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


def _write_call(context, plan, named, *, check, platform):
    return _write.run(context, plan, _rebuild(WriteTokens, named),
                      enable_write_input_assert=check, implementation=_impl("write", platform))


def write_fn(named, *, sources, kind, mode, check, platform):
    context = _context(named, op="write", kind=kind, mode=mode, sources=sources)
    out = _write_call(context, _rebuild(_plans.WritePlan, named, "plan."), named, check=check,
                      platform=platform)
    return _fields(out, _write_base.OUTPUTS)


def _token_args(ts, names, b):
    return [_dense(k, ts[k], shape=(b,)) for k in names if ts[k] is not None]


def _write_arguments(kw, ts):
    context = kw["context"]
    check = bool(kw["enable_write_input_assert"])
    n = int(ts["input_ids"].shape[0])
    b = buckets.bucket(n)
    args = _ctx_args(ts, "write", _write_base.OUTPUTS)
    wo = ts["plan.write_offsets"]
    args.append(_offsets("plan.write_offsets", wo, n, b))
    args += [_dense(f"plan.{k}", ts[f"plan.{k}"]) for k in _WP[1:]]
    args += _token_args(ts, _token_names(check), b)
    src_args, sources = _source_args(context)
    args += src_args
    static = dict(sources=sources, kind=int(context.kernel_kind),
                  mode=int(context.real_kv_hash_mode), check=check,
                  platform=_platform(context.canary_buf))
    return args, static, _write_base.OUTPUTS


def _token_names(check: bool) -> tuple[str, ...]:
    """The token arrays a write hands over: the expected ones only when it asserts them."""
    return tuple(k for k in _TOKENS if check or k not in _EXPECTED)


WRITE = Declaration(
    name="launch_canary_write_kernel", anchor="canary_buf", outputs=_write_base.OUTPUTS,
    tensors=_write_tensors,
    statics=_write_statics, validate=_write_validate, skip=lambda kw, ts: False,
    check_values=_write_values, arguments=_write_arguments, fn=write_fn,
)


# --------------------------------------------------------------------------------------------
# The fused step: (scatter) + plan + verify + write in one function

_STEP_EXTRA = ("input_ids", "positions", "out_cache_loc", "expected_token_ids",
               "expected_token_offsets", "expected_input_tokens", "expected_input_positions")


def _step_tensors(kw):
    out = _plan_tensors(kw)
    out.update(_ctx_tensors(kw["context"], "write"))
    out.update({k: kw[k] for k in _STEP_EXTRA})
    return out


def _step_statics(kw):
    return (_plan_statics(kw), _write_statics(kw), bool(kw["check_verify_expected_token"]))


def _do_scatter(kw) -> bool:
    return kw["expected_token_ids"] is not None or kw["expected_token_offsets"] is not None


def _step_validate(kw, ts):
    if _do_scatter(kw):
        if kw["req_to_verify_expected_tokens"] is None:
            raise ValueError(
                "kv-canary: launch_canary_step scatters expected_token_ids into "
                "req_to_verify_expected_tokens, which is None"
            )
        _scatter_validate(kw, _step_scatter_tensors(kw))
    _plan_validate(kw, _plan_tensors(kw))
    _verify_validate(dict(context=kw["context"], plan=kw["verify_plan_out"],
                          check_verify_expected_token=kw["check_verify_expected_token"]),
                     _verify_tensors(dict(context=kw["context"], plan=kw["verify_plan_out"])))
    wkw = _step_write_kw(kw)
    _write_validate(wkw, _write_tensors(wkw))
    _same_device("canary_step", "canary_buf",
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
                **{k: kw[k] for k in _TOKENS},
                enable_write_input_assert=kw["enable_write_input_assert"])


def _step_values(kw, ts):
    if _do_scatter(kw) and not _scatter_skip(kw, _step_scatter_tensors(kw)):
        _scatter_values(kw, _step_scatter_tensors(kw))
    _plan_values(kw, ts)
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
        named = dict(named, req_to_verify_expected_tokens=_scatter_call(
            inputs, max_cols=scatter_cols, platform=platform))
    vp, wp = _plan_call(named, swa=swa, cap=cap, k=k, platform=platform)
    context = _context(named, op="write", kind=kind, mode=mode, sources=sources)
    context = _verify_call(context, vp, check=check_token, platform=platform)
    context = _write_call(context, wp, named, check=check_input, platform=platform)
    out = {**_fields(vp, _VP, "verify_plan_out."), **_fields(wp, _WP, "write_plan_out."),
           **_fields(context, _write_base.OUTPUTS)}
    if scatter_cols is not None:
        out["req_to_verify_expected_tokens"] = named["req_to_verify_expected_tokens"]
    return out


def _step_arguments(kw, ts):
    context = kw["context"]
    args = []
    do_scatter = _do_scatter(kw) and not _scatter_skip(kw, _step_scatter_tensors(kw))
    pool = ts["req_to_verify_expected_tokens"]
    if do_scatter:
        flat = ts["expected_token_ids"]
        n = int(flat.shape[0])
        b = buckets.bucket(n)
        args.append(_dense("expected_token_ids", flat, shape=(b,)))
        offs = ts["expected_token_offsets"]
        args.append(_offsets("expected_token_offsets", offs, n, b))
    # The step's batch size stays exact: its write plan feeds write in the same program.
    plan_args = _plan_args(ts, int(ts["req_pool_indices"].shape[0]), False)
    if do_scatter:  # the pool is written by the scatter: an in-place output of the step
        plan_args = [_pitched(a.name, pool, out=True, check_fits=True)
                     if a.name == "req_to_verify_expected_tokens" else a for a in plan_args]
    args += plan_args
    args += _ctx_args(ts, "write", _write_base.OUTPUTS)
    check_input = bool(kw["enable_write_input_assert"])
    args += [_dense(k, ts[k]) for k in _token_names(check_input)]
    src_args, sources = _source_args(context)
    args += src_args
    swa, cap, k = _plan_statics(kw)
    static = dict(scatter_cols=int(pool.shape[1]) if do_scatter else None, swa=swa, cap=cap,
                  k=k, sources=sources, kind=int(context.kernel_kind),
                  mode=int(context.real_kv_hash_mode),
                  check_token=bool(kw["check_verify_expected_token"]), check_input=check_input,
                  platform=_platform(context.canary_buf))
    results = _PLAN_RESULTS + _write_base.OUTPUTS
    if do_scatter:
        results += ("req_to_verify_expected_tokens",)
    return args, static, results


STEP = Declaration(
    name="launch_canary_step", anchor="canary_buf",
    outputs=_write_base.OUTPUTS + PLAN.outputs, tensors=_step_tensors,
    statics=_step_statics, validate=_step_validate, skip=lambda kw, ts: False,
    check_values=_step_values, arguments=_step_arguments, fn=step_fn,
    also_written=lambda kw: ("req_to_verify_expected_tokens",) if _do_scatter(kw) else (),
)

