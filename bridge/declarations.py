"""SGLang's kv-canary launchers declared as data for the generic launcher (:mod:`bridge.launcher`).

A :class:`Declaration` says, for one launcher: its tensors by SGLang's names (read from the
keyword arguments and SGLang's dataclasses), its non-tensor arguments, its static checks (the
ops' contracts evaluated on the torch tensors: SGLang's classes, words and order, then the
torch-only checks), its opt-in value checks, when there is nothing to launch, and how the call
becomes the arguments of one array function over JAX arrays (:class:`~bridge.launcher.Arg`:
shape as lowered, layout, in-place outputs) that calls the package's array-level entry points.
The same function runs through XLA on the DLPack path and is lowered to its Triton kernels on the
direct path: one kernel source.

Buckets (:mod:`kvcanary_jax.buckets`): scatter's ``flat_in`` and write's token arrays are lowered
at ``bucket(length)``; the offsets that index them are clamped to the true length by a torch op
on the call's stream (a per-call temporary), which keeps every read below the true length on
both paths. ``launch_canary_step`` buckets its scatter input only (its write offsets are computed
inside the step). The plan's request vectors are lowered at ``min(bucket(bs),
write_req_capacity)`` with the batch size as an operand (``num_reqs``: a device scalar from
:class:`bridge.cache.Counts`): its kernels never read a request lane at or past it, so the
caller's shorter vectors are passed as they are on the direct path (staged on the DLPack path)
and the plan equals the unpadded one (:func:`kvcanary_jax.ops.plan.base.batch_lanes`).
"""

from __future__ import annotations

import dataclasses
import types
from typing import Callable

import torch

from bridge.cache import CACHES
from bridge.checks import check_range, require_tensors, torch_checks
from bridge.dlpack import BridgeError
from bridge.launcher import Arg
from kvcanary_jax import buckets, default_implementation
from kvcanary_jax import plans as _plans
from kvcanary_jax.context import SourceSpec, check_write_index
from kvcanary_jax.contracts import Contract, SameDevice, meta_of
from kvcanary_jax.ops import plan as _plan
from kvcanary_jax.ops import scatter as _scatter
from kvcanary_jax.ops import verify as _verify
from kvcanary_jax.ops import write as _write
from kvcanary_jax.ops.verify import base as _verify_base
from kvcanary_jax.ops.write import base as _write_base

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
    arguments: Callable[..., tuple]  # (kwargs, tensors) -> (args, static, results)
    fn: Callable  # fn(*arrays, **static) -> outputs, in the order of ``results``
    # Tensors this call writes besides ``outputs`` (the step's expected-token pool when it
    # scatters): they must not share memory with any input either.
    also_written: Callable[[dict], tuple] = lambda kw: ()


# --------------------------------------------------------------------------------------------
# Shared pieces

_VP = ("verify_slot_indices", "verify_expected_tokens", "verify_expected_positions",
       "verify_prev_slot_indices", "verify_num_valid", "enable")
_WP = ("write_offsets", "write_seed_slot_indices", "write_num_valid_reqs")
_CTX_OUT = ("violation_ring", "violation_write_index", "slot_run_counter", "kernel_run_counter")
_PLAN_OUT_NAMES = {  # SGLang's launcher names for the plan fields (its messages use them)
    "verify_slot_indices": "out_verify_slot_indices",
    "verify_expected_tokens": "out_verify_expected_tokens",
    "verify_expected_positions": "out_verify_expected_positions",
    "verify_prev_slot_indices": "out_verify_prev_slot_indices",
    "verify_num_valid": "out_verify_num_valid",
    "enable": "out_verify_enable",
    "write_offsets": "out_write_offsets",
    "write_seed_slot_indices": "out_write_seed_slot_indices",
    "write_num_valid_reqs": "out_write_num_valid_reqs",
}


def _platform(t) -> str:
    """The JAX platform whose default implementation runs the op for tensor ``t``'s device
    (the launcher replaces it by the DLPack path's device platform, or "cuda" on the direct
    path, whose functions must lower to Pallas Triton kernels)."""
    return "cuda" if t.device.type == "cuda" else "cpu"


def _impl(op: str, platform: str) -> str:
    return default_implementation(op, platform)


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


def _source_arg(i, s) -> tuple[Arg, SourceSpec]:
    """A real-KV source as the bytes its kernels read, from the view's first element."""
    t = s.tensor
    item = t.element_size()
    rows = int(t.shape[0])
    stride_bytes = int(t.stride(0)) * item
    need = 0 if rows == 0 else (rows - 1) * stride_bytes + int(s.page_size) * int(
        s.num_bytes_per_token)
    spec = SourceSpec(word_offset=0, row_stride_words=stride_bytes // 8, num_rows=rows,
                      page_size=int(s.page_size), nbpt_words=int(s.num_bytes_per_token) // 8,
                      read_words=int(s.read_bytes) // 8)
    arg = Arg(name=f"real_kv_sources[{i}].tensor", shape=(max(need, 8),), dtype=torch.uint8,
              layout="bytes")
    return arg, spec


def _source_statics(context) -> tuple:
    return tuple((int(s.page_size), int(s.num_bytes_per_token), int(s.read_bytes))
                 for s in context.real_kv_sources)


class _SourceMeta:
    """What the ops' contracts read of a source: the torch view's metadata."""

    __slots__ = ("meta",)

    def __init__(self, tensor):
        self.meta = meta_of(tensor)


def _ctx_for_checks(context):
    return types.SimpleNamespace(
        canary_buf=context.canary_buf, violation_ring=context.violation_ring,
        violation_write_index=context.violation_write_index,
        slot_run_counter=context.slot_run_counter, kernel_run_counter=context.kernel_run_counter,
        enable_chain_position_assert=context.enable_chain_position_assert,
        real_kv_sources=tuple(_SourceMeta(s.tensor) for s in context.real_kv_sources),
    )


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


def scatter_fn(flat_in, offsets, rpi, pool, *, max_cols, platform):
    return (_scatter.run(flat_in, offsets, rpi, pool, max_cols=max_cols,
                         implementation=_impl("scatter", platform)),)


def _scatter_arguments(kw, ts):
    pool = ts["pool_out"]
    args = _scatter_args(ts["flat_in"], ts["offsets"], ts["req_pool_indices"], "pool_out", pool)
    return args, dict(max_cols=int(pool.shape[1]), platform=_platform(pool)), (3,)


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


_VP_OUT = tuple((f"verify_plan_out.{k}", k) for k in _VP)
_WP_OUT = tuple((f"write_plan_out.{k}", k) for k in _WP)
_VP_IN = tuple((f"plan.{k}", k) for k in _VP)
_WP_IN = tuple((f"plan.{k}", k) for k in _WP)


def _plan_tensors(kw):
    vp, wp = kw["verify_plan_out"], kw["write_plan_out"]
    out = {name: getattr(vp, k) for name, k in _VP_OUT}
    out.update({name: getattr(wp, k) for name, k in _WP_OUT})
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
    tensors.update({_PLAN_OUT_NAMES[k.split(".", 1)[1]]: v for k, v in required.items()
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


def _plan_args(ts, lanes: int, has_n: bool):
    """The plan's arguments in :func:`plan_fn`'s order; absent optionals are left out (the
    static ``has`` says which are present). Request vectors at ``lanes``, with the ``num_reqs``
    operand last when ``has_n`` (see :func:`plan_lanes`)."""
    args = [_dense(f"verify_plan_out.{k}", ts[f"verify_plan_out.{k}"], out=True) for k in _VP]
    args += [_dense(f"write_plan_out.{k}", ts[f"write_plan_out.{k}"], out=True) for k in _WP]
    args += [_dense(k, ts[k], shape=(lanes,)) for k in ("req_pool_indices", "prefix_lens",
                                                         "extend_seq_lens")]
    args.append(_dense("req_to_token", ts["req_to_token"]))
    has = []
    for k in ("full_to_swa_index_mapping", "req_to_verify_expected_tokens",
              "req_to_verify_expected_tokens_valid_lens"):
        t = ts[k]
        has.append(t is not None)
        if t is None:
            continue
        if k == "req_to_verify_expected_tokens":
            args.append(_pitched(k, t, out=False, check_fits=True))
        else:
            args.append(_dense(k, t, shape=(lanes,) if k.endswith("valid_lens") else None))
    if has_n:
        args.append(_dense("num_reqs", ts["num_reqs"]))
    return args, tuple(has)


def _plan_call(arrays, has, *, swa, cap, k, platform, config=None, has_n=False):
    vp = _plans.VerifyPlan(**dict(zip(_VP, arrays[:6])))
    wp = _plans.WritePlan(**dict(zip(_WP, arrays[6:9])))
    rpi, prefix, extend, rtt = arrays[9:13]
    rest = iter(arrays[13:])
    lut, pool, valid = (next(rest) if h else None for h in has)
    num_reqs = next(rest) if has_n else None
    return _plan.run(vp, wp, rpi, prefix, extend, rtt, lut, pool, valid, swa_window_size=swa,
                     verify_capacity=cap, kv_token_id_vs_position_offset=k,
                     implementation=_impl("plan", platform), config=config, num_reqs=num_reqs)


def plan_fn(*arrays, has, swa, cap, k, platform, config=None, has_n=False):
    """``config``: the implementation's launch configuration (tests shrink its blocks);
    ``has_n``: the last array is the ``num_reqs`` operand."""
    vp, wp = _plan_call(arrays, has, swa=swa, cap=cap, k=k, platform=platform, config=config,
                        has_n=has_n)
    return tuple(getattr(vp, f) for f in _VP) + tuple(getattr(wp, f) for f in _WP)


def _plan_arguments(kw, ts):
    platform = _platform(ts["verify_plan_out.verify_slot_indices"])
    lanes, has_n = plan_lanes(ts, platform)
    args, has = _plan_args(ts, lanes, has_n)
    swa, cap, k = _plan_statics(kw)
    static = dict(has=has, swa=swa, cap=cap, k=k, platform=platform, has_n=has_n)
    return args, static, tuple(range(9))


PLAN = Declaration(
    name="launch_canary_plan_kernels", anchor="verify_plan_out.verify_slot_indices",
    outputs=tuple(f"verify_plan_out.{k}" for k in _VP) + tuple(f"write_plan_out.{k}" for k in _WP),
    tensors=_plan_tensors, statics=_plan_statics, validate=_plan_validate,
    skip=lambda kw, ts: False, check_values=_plan_values, arguments=_plan_arguments, fn=plan_fn,
)


# --------------------------------------------------------------------------------------------
# verify

_VERIFY_P = "kv-canary: launch_canary_verify_kernel"


_SOURCE_NAMES = tuple(f"real_kv_sources[{i}].tensor" for i in range(8))


def _ctx_tensors(context, *, with_cpa: bool) -> dict:
    out = {"canary_buf": context.canary_buf}
    out.update({k: getattr(context, k) for k in _CTX_OUT})
    if with_cpa:
        out["enable_chain_position_assert"] = context.enable_chain_position_assert
    sources = context.real_kv_sources
    if sources:
        # More than MAX_REAL_KV_SOURCES is refused by the contract, named like the others.
        out.update({(_SOURCE_NAMES[i] if i < 8 else f"real_kv_sources[{i}].tensor"): s.tensor
                    for i, s in enumerate(sources)})
    return out


def _verify_tensors(kw):
    out = _ctx_tensors(kw["context"], with_cpa=False)
    plan = kw["plan"]
    out.update({name: getattr(plan, k) for name, k in _VP_IN})
    return out


def _verify_statics(kw):
    c = kw["context"]
    return (int(c.kernel_kind), int(c.real_kv_hash_mode),
            bool(kw["check_verify_expected_token"]), _source_statics(c))


def _verify_validate(kw, ts):
    require_tensors(_VERIFY_P, ts)
    plan = kw["plan"]
    _verify_base.validate(_ctx_for_checks(kw["context"]),
                          types.SimpleNamespace(**{k: getattr(plan, k) for k in _VP}))
    _same_device("canary_verify", "canary_buf", ts)
    check_distinct_outputs({k: ts[k] for k in _CTX_OUT})


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


def _ctx_args(ts, *, canary_out: bool, with_cpa: bool):
    args = [_dense("canary_buf", ts["canary_buf"], out=canary_out)]
    args += [_dense(k, ts[k], out=True) for k in _CTX_OUT]
    if with_cpa:
        args.append(_dense("enable_chain_position_assert", ts["enable_chain_position_assert"]))
    return args


def _source_args(context):
    pairs = [_source_arg(i, s) for i, s in enumerate(context.real_kv_sources)]
    return [a for a, _ in pairs], tuple(s for _, s in pairs)


def _verify_call(ctx, vp, srcs, *, specs, kind, mode, check, platform):
    return _verify.run(
        canary_buf=ctx[0], violation_ring=ctx[1], violation_write_index=ctx[2],
        slot_run_counter=ctx[3], kernel_run_counter=ctx[4],
        **dict(zip(_VP, vp)), sources=tuple(zip(srcs, specs)), kernel_kind=kind,
        real_kv_hash_mode=mode, check_verify_expected_token=check,
        implementation=_impl("verify", platform),
    )


def verify_fn(*arrays, specs, kind, mode, check, platform):
    return tuple(_verify_call(arrays[:5], arrays[5:11], arrays[11:], specs=specs, kind=kind,
                              mode=mode, check=check, platform=platform))


def _verify_arguments(kw, ts):
    context = kw["context"]
    args = _ctx_args(ts, canary_out=False, with_cpa=False)
    args += [_dense(f"plan.{k}", ts[f"plan.{k}"]) for k in _VP]
    src_args, specs = _source_args(context)
    args += src_args
    static = dict(specs=specs, kind=int(context.kernel_kind), mode=int(context.real_kv_hash_mode),
                  check=bool(kw["check_verify_expected_token"]),
                  platform=_platform(context.canary_buf))
    return args, static, (1, 2, 3, 4)


VERIFY = Declaration(
    name="launch_canary_verify_kernel", anchor="canary_buf", outputs=_CTX_OUT,
    tensors=_verify_tensors,
    statics=_verify_statics, validate=_verify_validate, skip=lambda kw, ts: False,
    check_values=_verify_values, arguments=_verify_arguments, fn=verify_fn,
)


# --------------------------------------------------------------------------------------------
# write

_WRITE_P = "kv-canary: launch_canary_write_kernel"
_TOKENS = ("input_ids", "positions", "out_cache_loc")
_EXPECTED = ("expected_input_tokens", "expected_input_positions")


def _write_tensors(kw):
    out = _ctx_tensors(kw["context"], with_cpa=True)
    plan = kw["plan"]
    out.update({name: getattr(plan, k) for name, k in _WP_IN})
    out.update({k: kw[k] for k in _TOKENS + _EXPECTED})
    return out


def _write_statics(kw):
    c = kw["context"]
    return (int(c.kernel_kind), int(c.real_kv_hash_mode), bool(kw["enable_write_input_assert"]),
            _source_statics(c))


def _write_validate(kw, ts):
    required = {k: v for k, v in ts.items() if k not in _EXPECTED}
    require_tensors(_WRITE_P, required)
    plan = kw["plan"]
    _write_base.validate(_ctx_for_checks(kw["context"]),
                         types.SimpleNamespace(**{k: getattr(plan, k) for k in _WP}),
                         ts["input_ids"], ts["positions"], ts["out_cache_loc"],
                         kw["enable_write_input_assert"], ts["expected_input_tokens"],
                         ts["expected_input_positions"])
    _same_device("canary_write", "canary_buf", ts)
    check_distinct_outputs({k: ts[k] for k in ("canary_buf",) + _CTX_OUT})


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


def _write_call(ctx, cpa, wp, toks, expected, srcs, *, specs, kind, mode, check, platform):
    ids, pos, ocl = toks
    etok, epos = expected if check else (None, None)
    return _write.run(
        canary_buf=ctx[0], violation_ring=ctx[1], violation_write_index=ctx[2],
        slot_run_counter=ctx[3], kernel_run_counter=ctx[4], enable_chain_position_assert=cpa,
        **dict(zip(_WP, wp)), input_ids=ids, positions=pos, out_cache_loc=ocl,
        expected_input_tokens=etok, expected_input_positions=epos,
        sources=tuple(zip(srcs, specs)), kernel_kind=kind, real_kv_hash_mode=mode,
        enable_write_input_assert=check, implementation=_impl("write", platform),
    )


def write_fn(*arrays, specs, kind, mode, check, platform):
    n_exp = 2 if check else 0
    return tuple(_write_call(arrays[:5], arrays[5], arrays[6:9], arrays[9:12],
                             arrays[12:12 + n_exp], arrays[12 + n_exp:], specs=specs, kind=kind,
                             mode=mode, check=check, platform=platform))


def _token_args(ts, names, b):
    return [_dense(k, ts[k], shape=(b,)) for k in names if ts[k] is not None]


def _write_arguments(kw, ts):
    context = kw["context"]
    check = bool(kw["enable_write_input_assert"])
    n = int(ts["input_ids"].shape[0])
    b = buckets.bucket(n)
    args = _ctx_args(ts, canary_out=True, with_cpa=True)
    wo = ts["plan.write_offsets"]
    args.append(_offsets("plan.write_offsets", wo, n, b))
    args += [_dense(f"plan.{k}", ts[f"plan.{k}"]) for k in _WP[1:]]
    args += _token_args(ts, _TOKENS + (_EXPECTED if check else ()), b)
    src_args, specs = _source_args(context)
    args += src_args
    static = dict(specs=specs, kind=int(context.kernel_kind), mode=int(context.real_kv_hash_mode),
                  check=check, platform=_platform(context.canary_buf))
    return args, static, (0, 1, 2, 3, 4)


WRITE = Declaration(
    name="launch_canary_write_kernel", anchor="canary_buf", outputs=("canary_buf",) + _CTX_OUT,
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
    out.update(_ctx_tensors(kw["context"], with_cpa=True))
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


def _step_scatter_tensors(kw):
    return dict(flat_in=kw["expected_token_ids"], offsets=kw["expected_token_offsets"],
                req_pool_indices=kw["req_pool_indices"],
                pool_out=kw["req_to_verify_expected_tokens"])


def _step_write_kw(kw):
    return dict(context=kw["context"], plan=kw["write_plan_out"],
                **{k: kw[k] for k in _TOKENS + _EXPECTED},
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


def step_fn(*arrays, scatter_cols, has, swa, cap, k, specs, kind, mode, check_token,
            check_input, platform):
    it = iter(arrays)
    take = lambda n: [next(it) for _ in range(n)]  # noqa: E731
    if scatter_cols is not None:
        flat, offs = take(2)
    plan_arrays = take(13 + sum(has))
    ctx = take(5)
    cpa = next(it)
    toks = take(3)
    expected = take(2) if check_input else []
    srcs = list(it)
    if scatter_cols is not None:
        # The scatter writes the expected-token pool, which the plan then reads.
        pool_pos = 13 + has[0]
        pool = _scatter.run(flat, offs, plan_arrays[9], plan_arrays[pool_pos],
                            max_cols=scatter_cols, implementation=_impl("scatter", platform))
        plan_arrays[pool_pos] = pool
    vp, wp = _plan_call(plan_arrays, has, swa=swa, cap=cap, k=k, platform=platform)
    vfields = tuple(getattr(vp, f) for f in _VP)
    wfields = tuple(getattr(wp, f) for f in _WP)
    ring, widx, sctr, kctr = _verify_call(ctx, vfields, srcs, specs=specs, kind=kind, mode=mode,
                                          check=check_token, platform=platform)
    outs = _write_call((ctx[0], ring, widx, sctr, kctr), cpa, wfields, toks, expected, srcs,
                       specs=specs, kind=kind, mode=mode, check=check_input, platform=platform)
    pool_out = (plan_arrays[13 + has[0]],) if scatter_cols is not None else ()
    return vfields + wfields + tuple(outs) + pool_out


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
    first_plan = len(args)
    # The step's batch size stays exact: its write plan feeds write in the same program.
    plan_args, has = _plan_args(ts, int(ts["req_pool_indices"].shape[0]), False)
    if do_scatter:  # the pool is written by the scatter: an in-place output of the step
        i = first_plan + 13 + has[0]
        plan_args[i - first_plan] = _pitched("req_to_verify_expected_tokens", pool, out=True,
                                             check_fits=True)
    args += plan_args
    args += _ctx_args(ts, canary_out=True, with_cpa=True)
    check_input = bool(kw["enable_write_input_assert"])
    args += [_dense(k, ts[k]) for k in _TOKENS + (_EXPECTED if check_input else ())]
    src_args, specs = _source_args(context)
    args += src_args
    swa, cap, k = _plan_statics(kw)
    static = dict(scatter_cols=int(pool.shape[1]) if do_scatter else None, has=has, swa=swa,
                  cap=cap, k=k, specs=specs, kind=int(context.kernel_kind),
                  mode=int(context.real_kv_hash_mode),
                  check_token=bool(kw["check_verify_expected_token"]), check_input=check_input,
                  platform=_platform(context.canary_buf))
    ctx0 = first_plan + len(plan_args)
    results = tuple(range(first_plan, first_plan + 9)) + tuple(range(ctx0, ctx0 + 5))
    if do_scatter:
        results += (first_plan + 13 + has[0],)
    return args, static, results


STEP = Declaration(
    name="launch_canary_step", anchor="canary_buf",
    outputs=("canary_buf",) + _CTX_OUT + PLAN.outputs, tensors=_step_tensors,
    statics=_step_statics, validate=_step_validate, skip=lambda kw, ts: False,
    check_values=_step_values, arguments=_step_arguments, fn=step_fn,
    also_written=lambda kw: ("req_to_verify_expected_tokens",) if _do_scatter(kw) else (),
)

