"""``launch_canary_plan_kernels``, ``launch_canary_write_kernel``, ``launch_canary_verify_kernel``
over torch tensors (SGLang's names and keywords), and the fused ``launch_canary_step``.

Each launcher: required tensors present; the op's contract (declared once in the op module)
evaluated on the torch tensors, so checks, order, classes and messages are SGLang's; torch-only
checks (contiguity, one device); opt-in value checks; then memory handed to JAX and the package's
jitted implementation called with the outputs donated (see :mod:`bridge._interop`).
"""

from __future__ import annotations

import functools
import types

import jax
import torch

from bridge import _fast
from bridge import _interop as io
from bridge._common import (
    Validated,
    check_range,
    isig,
    require_tensors,
    sig,
    torch_checks,
    value_checks_enabled,
)
from bridge._scatter import check_scatter
from kvcanary_jax import plans as _plans
from kvcanary_jax.contracts import Contract, SameDevice, meta_of
from kvcanary_jax.ops import _registry
from kvcanary_jax.ops import plan as _plan
from kvcanary_jax.ops import scatter as _scatter
from kvcanary_jax.ops import verify as _verify
from kvcanary_jax.ops import write as _write
from kvcanary_jax.ops.verify import base as _verify_base
from kvcanary_jax.ops.write import base as _write_base

__all__ = [
    "launch_canary_plan_kernels",
    "launch_canary_write_kernel",
    "launch_canary_verify_kernel",
    "launch_canary_step",
]

_PLAN_P = "kv-canary: launch_canary_plan_kernels"
_WRITE_P = "kv-canary: launch_canary_write_kernel"
_VERIFY_P = "kv-canary: launch_canary_verify_kernel"

_VP_FIELDS = ("verify_slot_indices", "verify_expected_tokens", "verify_expected_positions",
              "verify_prev_slot_indices", "verify_num_valid", "enable")
_WP_FIELDS = ("write_offsets", "write_seed_slot_indices", "write_num_valid_reqs")
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
_CTX_OUT = ("violation_ring", "violation_write_index", "slot_run_counter", "kernel_run_counter")


# --------------------------------------------------------------------------------------------
# Jitted adapters: donate the outputs, take the fence as an operand, call the package's impls.


def _impl(op: str, platform: str) -> str:
    """What an op runs for tensors on ``platform`` (the tensors' device, not JAX's default)."""
    return _registry.default_implementation(op, platform)


@functools.partial(
    jax.jit,
    static_argnames=("swa_window_size", "verify_capacity", "k", "platform"),
    donate_argnums=(0, 1), keep_unused=True,
)
def _plan_adapter(vp, wp, rpi, prefix, extend, rtt, lut, pool, valid_lens, fence, *,
                  swa_window_size, verify_capacity, k, platform):
    del fence
    return _plan.run(
        vp, wp, rpi, prefix, extend, rtt, lut, pool, valid_lens, swa_window_size=swa_window_size,
        verify_capacity=verify_capacity, kv_token_id_vs_position_offset=k,
        implementation=_impl("plan", platform),
    )


def _verify_call(ctx, vp, bufs, *, specs, kind, mode, check_token, platform):
    return _verify.run(
        canary_buf=ctx["canary_buf"], violation_ring=ctx["violation_ring"],
        violation_write_index=ctx["violation_write_index"],
        slot_run_counter=ctx["slot_run_counter"], kernel_run_counter=ctx["kernel_run_counter"],
        verify_slot_indices=vp.verify_slot_indices,
        verify_expected_tokens=vp.verify_expected_tokens,
        verify_expected_positions=vp.verify_expected_positions,
        verify_prev_slot_indices=vp.verify_prev_slot_indices,
        verify_num_valid=vp.verify_num_valid, enable=vp.enable,
        sources=tuple(zip(bufs, specs)), kernel_kind=kind, real_kv_hash_mode=mode,
        check_verify_expected_token=check_token, implementation=_impl("verify", platform),
    )


def _write_call(ctx, wp, ids, pos, ocl, etok, epos, bufs, *, specs, kind, mode, check_input,
                platform):
    return _write.run(
        canary_buf=ctx["canary_buf"], violation_ring=ctx["violation_ring"],
        violation_write_index=ctx["violation_write_index"],
        slot_run_counter=ctx["slot_run_counter"], kernel_run_counter=ctx["kernel_run_counter"],
        enable_chain_position_assert=ctx["enable_chain_position_assert"],
        write_offsets=wp.write_offsets, write_seed_slot_indices=wp.write_seed_slot_indices,
        write_num_valid_reqs=wp.write_num_valid_reqs, input_ids=ids, positions=pos,
        out_cache_loc=ocl, expected_input_tokens=etok, expected_input_positions=epos,
        sources=tuple(zip(bufs, specs)), kernel_kind=kind, real_kv_hash_mode=mode,
        enable_write_input_assert=check_input, implementation=_impl("write", platform),
    )


@functools.partial(
    jax.jit, static_argnames=("specs", "kind", "mode", "check_token", "platform"),
    donate_argnums=(1,), keep_unused=True,
)
def _verify_adapter(canary_buf, outs, vp, bufs, fence, *, specs, kind, mode, check_token,
                    platform):
    del fence
    ctx = dict(zip(_CTX_OUT, outs), canary_buf=canary_buf)
    return _verify_call(ctx, vp, bufs, specs=specs, kind=kind, mode=mode,
                        check_token=check_token, platform=platform)


@functools.partial(
    jax.jit, static_argnames=("specs", "kind", "mode", "check_input", "platform"),
    donate_argnums=(0,), keep_unused=True,
)
def _write_adapter(outs, cpa, wp, ids, pos, ocl, etok, epos, bufs, fence, *, specs, kind, mode,
                   check_input, platform):
    del fence
    ctx = dict(zip(("canary_buf",) + _CTX_OUT, outs), enable_chain_position_assert=cpa)
    return _write_call(ctx, wp, ids, pos, ocl, etok, epos, bufs, specs=specs, kind=kind,
                       mode=mode, check_input=check_input, platform=platform)


# --------------------------------------------------------------------------------------------
# Shared helpers


def _opt_input(t, name, info, key=None):
    return None if t is None else io.import_input(t, name, info, key)


def _plan_outputs(vp_t, wp_t, key, info):
    outs = {k: io.import_output(v, k, info, kk)
            for (k, v), kk in zip(vp_t.items(), key[0])}
    outs.update({k: io.import_output(v, k, info, kk)
                 for (k, v), kk in zip(wp_t.items(), key[1])})
    return outs


def _pool_input(t, info, key=None):
    """The expected-token pool is only read, at ``rp * row_pitch + col`` like SGLang's kernel: a
    row-strided view is passed as its compact base (its pitch is the view's stride(0))."""
    if t is None:
        return None
    return io.import_output(t, "req_to_verify_expected_tokens", info, key).array


def _plan_results(vp, wp) -> tuple:
    """A plan's result arrays in the order of ``_plan_outputs`` (verify fields, write fields)."""
    return (*(getattr(vp, k) for k in _VP_FIELDS), *(getattr(wp, k) for k in _WP_FIELDS))


def _fields(obj, names):
    return {n: getattr(obj, n) for n in names}


class _SourceMeta:
    """What the ops' contracts read of a source: the torch view's metadata."""

    __slots__ = ("meta",)

    def __init__(self, tensor):
        self.meta = meta_of(tensor)


def _ctx_for_checks(context, **extra):
    return types.SimpleNamespace(
        canary_buf=context.canary_buf, violation_ring=context.violation_ring,
        violation_write_index=context.violation_write_index,
        slot_run_counter=context.slot_run_counter, kernel_run_counter=context.kernel_run_counter,
        enable_chain_position_assert=context.enable_chain_position_assert,
        real_kv_sources=tuple(_SourceMeta(s.tensor) for s in context.real_kv_sources), **extra,
    )


def _ctx_tensors(context) -> dict:
    return dict(canary_buf=context.canary_buf, **_fields(context, _CTX_OUT),
                enable_chain_position_assert=context.enable_chain_position_assert)


def _ctx_sig(context) -> tuple:
    return (sig(context.canary_buf), tuple(sig(getattr(context, k)) for k in _CTX_OUT),
            isig(context.enable_chain_position_assert),
            tuple((isig(s.tensor), s.page_size, s.num_bytes_per_token, s.read_bytes)
                  for s in context.real_kv_sources),
            int(context.kernel_kind), int(context.real_kv_hash_mode))


def _same_device(op, anchor, tensors: dict):
    present = {k: v for k, v in tensors.items() if v is not None}
    Contract(op=op, checks=(SameDevice(anchor, tuple(present)),)).validate(present)


# --------------------------------------------------------------------------------------------
# Plan


_PLAN_OK = Validated()
_VERIFY_OK = Validated()
_WRITE_OK = Validated()
_STEP_OK = Validated()
_PLAN_FAST = _fast.new_fast_path()
_VERIFY_FAST = _fast.new_fast_path()
_WRITE_FAST = _fast.new_fast_path()
_STEP_FAST = _fast.new_fast_path()


def _src_statics(context) -> tuple:
    return tuple((int(s.page_size), int(s.num_bytes_per_token), int(s.read_bytes))
                 for s in context.real_kv_sources)


def _src_tensors(context) -> tuple:
    return tuple(s.tensor for s in context.real_kv_sources)


def _try_replay(fp, context, statics: tuple, tensors: tuple):
    """Complete a call's signature with its real-KV sources and replay the call where it was
    recorded (:mod:`bridge._fast`); returns ``(replayed, statics, tensors)``."""
    if context.real_kv_sources:
        tensors += _src_tensors(context)
        statics += _src_statics(context)
    b = fp.get(statics, tensors)
    done = b is not None and not value_checks_enabled(b.info.torch_device) and b.run()
    return done, statics, tensors


def _plan_key(vp_t, wp_t, rpi, prefix, extend, rtt, lut, pool, valid_lens, swa_window_size,
              verify_capacity) -> tuple:
    """Everything the plan's static checks depend on (shared by the plan launcher and the fused
    step, which reuses its pieces for the other launchers' keys)."""
    return (tuple(sig(v) for v in vp_t.values()), tuple(sig(v) for v in wp_t.values()),
            isig(rpi), isig(prefix), isig(extend), isig(rtt), isig(lut), sig(pool),
            isig(valid_lens), int(swa_window_size), int(verify_capacity))


def _check_plan(*, verify_plan_out, write_plan_out, req_pool_indices, prefix_lens,
                extend_seq_lens, req_to_token, swa_window_size, full_to_swa_index_mapping,
                verify_capacity, req_to_verify_expected_tokens,
                req_to_verify_expected_tokens_valid_lens):
    vp_t = _fields(verify_plan_out, _VP_FIELDS)
    wp_t = _fields(write_plan_out, _WP_FIELDS)
    key = _plan_key(vp_t, wp_t, req_pool_indices, prefix_lens, extend_seq_lens, req_to_token,
                    full_to_swa_index_mapping, req_to_verify_expected_tokens,
                    req_to_verify_expected_tokens_valid_lens, swa_window_size, verify_capacity)
    if key not in _PLAN_OK:
        required = dict(req_pool_indices=req_pool_indices, prefix_lens=prefix_lens,
                        extend_seq_lens=extend_seq_lens, req_to_token=req_to_token)
        required.update({f"verify_plan_out.{k}": v for k, v in vp_t.items()})
        required.update({f"write_plan_out.{k}": v for k, v in wp_t.items()})
        require_tensors(_PLAN_P, required)
        tensors = dict(
            req_pool_indices=req_pool_indices, prefix_lens=prefix_lens,
            extend_seq_lens=extend_seq_lens, req_to_token=req_to_token,
            full_to_swa_index_mapping=full_to_swa_index_mapping,
            req_to_verify_expected_tokens=req_to_verify_expected_tokens,
            req_to_verify_expected_tokens_valid_lens=req_to_verify_expected_tokens_valid_lens,
            **{_PLAN_OUT_NAMES[k]: v for k, v in {**vp_t, **wp_t}.items()},
        )
        _plan.CONTRACT.validate_metas(
            _plan.plan_metas(tensors), swa_window_size=int(swa_window_size),
            verify_capacity=int(verify_capacity), req_to_token_stride0=None,
        )
        # Torch-only: what SGLang's entries launcher requires beyond the offsets kernel's checks.
        torch_checks(
            "canary_plan", "out_verify_slot_indices",
            ("out_verify_slot_indices", "out_verify_expected_tokens",
             "out_verify_expected_positions", "out_verify_prev_slot_indices",
             "req_to_verify_expected_tokens_valid_lens"),
            (),
        ).validate({k: v for k, v in tensors.items() if v is not None})
        _same_device("canary_plan", "out_verify_slot_indices", tensors)
        pool = req_to_verify_expected_tokens
        if pool is not None and pool.stride(-1) != 1 and pool.numel() > 0:
            raise io.BridgeError(
                f"{_PLAN_P} req_to_verify_expected_tokens rows must be packed (stride(-1) == 1), "
                f"got strides {tuple(pool.stride())}"
            )
        io.check_distinct_outputs({f"verify_plan_out.{k}": v for k, v in vp_t.items()}
                                  | {f"write_plan_out.{k}": v for k, v in wp_t.items()})
        _PLAN_OK.add(key)
    if value_checks_enabled(verify_plan_out.verify_slot_indices.device):
        active = req_pool_indices != 0
        check_range(_PLAN_P, "req_pool_indices", req_pool_indices, 0, int(req_to_token.shape[0]),
                    "rows of req_to_token")
        width = int(req_to_token.shape[1])
        bad = active & (prefix_lens > width)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"{_PLAN_P} prefix_lens[{i}]={int(prefix_lens[i])} exceeds req_to_token's width "
                f"{width}"
            )
    return vp_t, wp_t, key


def launch_canary_plan_kernels(
    *,
    verify_plan_out,
    write_plan_out,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    swa_window_size: int,
    full_to_swa_index_mapping: torch.Tensor | None,
    verify_capacity: int,
    req_to_verify_expected_tokens: torch.Tensor | None,
    req_to_verify_expected_tokens_valid_lens: torch.Tensor | None,
    kv_token_id_vs_position_offset: int,
) -> None:
    """Fill ``verify_plan_out`` and ``write_plan_out`` in place (SGLang's GPU-path semantics,
    checks and messages; no ``bs <= 4096`` cap). Plans may be the bridge's or SGLang's
    dataclasses."""
    vp, wp = verify_plan_out, write_plan_out
    tensors = (vp.verify_slot_indices, vp.verify_expected_tokens, vp.verify_expected_positions,
               vp.verify_prev_slot_indices, vp.verify_num_valid, vp.enable, wp.write_offsets,
               wp.write_seed_slot_indices, wp.write_num_valid_reqs, req_pool_indices,
               prefix_lens, extend_seq_lens, req_to_token, full_to_swa_index_mapping,
               req_to_verify_expected_tokens, req_to_verify_expected_tokens_valid_lens)
    statics = (id(tensors[0]), swa_window_size, verify_capacity, kv_token_id_vs_position_offset)
    b = _PLAN_FAST.get(statics, tensors)
    if b is not None and not value_checks_enabled(b.info.torch_device) and b.run():
        return
    vp_t, wp_t, key = _check_plan(
        verify_plan_out=verify_plan_out, write_plan_out=write_plan_out,
        req_pool_indices=req_pool_indices, prefix_lens=prefix_lens,
        extend_seq_lens=extend_seq_lens, req_to_token=req_to_token,
        swa_window_size=swa_window_size, full_to_swa_index_mapping=full_to_swa_index_mapping,
        verify_capacity=verify_capacity,
        req_to_verify_expected_tokens=req_to_verify_expected_tokens,
        req_to_verify_expected_tokens_valid_lens=req_to_verify_expected_tokens_valid_lens,
    )
    info = io.device_info(verify_plan_out.verify_slot_indices)
    with io.x64_scope():
        fence = io.fence(info)
        outs = _plan_outputs(vp_t, wp_t, key, info)
        vp = _plans.VerifyPlan(**{k: outs[k].array for k in _VP_FIELDS})
        wp = _plans.WritePlan(**{k: outs[k].array for k in _WP_FIELDS})
        args = (
            vp, wp,
            io.import_input(req_pool_indices, "req_pool_indices", info),
            io.import_input(prefix_lens, "prefix_lens", info),
            io.import_input(extend_seq_lens, "extend_seq_lens", info),
            io.import_input(req_to_token, "req_to_token", info),
            _opt_input(full_to_swa_index_mapping, "full_to_swa_index_mapping", info),
            _pool_input(req_to_verify_expected_tokens, info, key[7]),
            _opt_input(req_to_verify_expected_tokens_valid_lens,
                       "req_to_verify_expected_tokens_valid_lens", info),
        )
        static = dict(swa_window_size=int(swa_window_size), verify_capacity=int(verify_capacity),
                      k=int(kv_token_id_vs_position_offset), platform=info.platform)
        _fast.full_call(_PLAN_FAST, statics, tensors, info, adapter=_plan_adapter, args=args,
                        fence=fence, static=static, donate=(0, 1), outs=tuple(outs.values()),
                        results_of=lambda r: _plan_results(*r))


# --------------------------------------------------------------------------------------------
# Verify


def _check_verify(context, plan, *, values=True):
    vp_t = _fields(plan, _VP_FIELDS)
    key = (_ctx_sig(context), tuple(isig(v) for v in vp_t.values()))
    if key not in _VERIFY_OK:
        required = {"canary_buf": context.canary_buf, **_fields(context, _CTX_OUT)}
        required.update({f"plan.{k}": v for k, v in vp_t.items()})
        required.update({f"real_kv_sources[{i}].tensor": s.tensor
                         for i, s in enumerate(context.real_kv_sources)})
        require_tensors(_VERIFY_P, required)
        _verify_base.validate(_ctx_for_checks(context), types.SimpleNamespace(**vp_t))
        _same_device("canary_verify", "canary_buf", required)
        io.check_distinct_outputs(_fields(context, _CTX_OUT))
        _VERIFY_OK.add(key)
    if values and value_checks_enabled(context.canary_buf.device) and int(plan.enable[0]) != 0:
        n = max(0, min(int(plan.verify_num_valid[0]), int(plan.verify_slot_indices.shape[0])))
        num_slots = int(context.canary_buf.shape[0])
        check_range(_VERIFY_P, "plan.verify_slot_indices", plan.verify_slot_indices[:n], 0,
                    num_slots, "canary slots")
        prev = plan.verify_prev_slot_indices[:n]
        check_range(_VERIFY_P, "plan.verify_prev_slot_indices", prev.clamp(min=-1), -1,
                    num_slots, "canary slots, negative = chain head")
    return key


def _verify_launch(context, plan, check_verify_expected_token, info, key):
    bufs, specs = io.import_sources(context.real_kv_sources, info)
    outs = {k: io.import_output(getattr(context, k), k, info, kk)
            for k, kk in zip(_CTX_OUT, key[0][1])}
    vp = _plans.VerifyPlan(**{k: io.import_input(getattr(plan, k), f"plan.{k}", info)
                              for k in _VP_FIELDS})
    return outs, dict(
        canary_buf=io.import_input(context.canary_buf, "canary_buf", info, key[0][0]),
        outs=tuple(o.array for o in outs.values()), vp=vp, bufs=bufs, specs=specs,
        kind=int(context.kernel_kind), mode=int(context.real_kv_hash_mode),
        check_token=bool(check_verify_expected_token), platform=info.platform,
    )


def launch_canary_verify_kernel(*, context, plan, check_verify_expected_token: bool) -> None:
    """Verify one canary buffer against a VerifyPlan; updates the context's ring, write index
    and counters in place (``canary_buf`` is only read)."""
    c = context
    tensors = (c.canary_buf, c.violation_ring, c.violation_write_index, c.slot_run_counter,
               c.kernel_run_counter, plan.verify_slot_indices, plan.verify_expected_tokens,
               plan.verify_expected_positions, plan.verify_prev_slot_indices,
               plan.verify_num_valid, plan.enable)
    statics = (id(c.canary_buf), c.kernel_kind, c.real_kv_hash_mode,
               check_verify_expected_token)
    done, statics, tensors = _try_replay(_VERIFY_FAST, c, statics, tensors)
    if done:
        return
    key = _check_verify(context, plan)
    info = io.device_info(context.canary_buf)
    with io.x64_scope():
        fence = io.fence(info)
        outs, kw = _verify_launch(context, plan, check_verify_expected_token, info, key)
        args = (kw.pop("canary_buf"), kw.pop("outs"), kw.pop("vp"), kw.pop("bufs"))
        _fast.full_call(_VERIFY_FAST, statics, tensors, info, adapter=_verify_adapter,
                        args=args, fence=fence, static=kw, donate=(1,),
                        outs=tuple(outs.values()))


# --------------------------------------------------------------------------------------------
# Write


def _check_write(context, plan, input_ids, positions, out_cache_loc, enable_write_input_assert,
                 expected_input_tokens, expected_input_positions, *, values=True):
    wp_t = _fields(plan, _WP_FIELDS)
    key = (_ctx_sig(context), tuple(isig(v) for v in wp_t.values()), isig(input_ids),
           isig(positions), isig(out_cache_loc), bool(enable_write_input_assert),
           isig(expected_input_tokens), isig(expected_input_positions))
    if key not in _WRITE_OK:
        required = {**_ctx_tensors(context), **{f"plan.{k}": v for k, v in wp_t.items()},
                    "input_ids": input_ids, "positions": positions,
                    "out_cache_loc": out_cache_loc}
        required.update({f"real_kv_sources[{i}].tensor": s.tensor
                         for i, s in enumerate(context.real_kv_sources)})
        require_tensors(_WRITE_P, required)
        _write_base.validate(_ctx_for_checks(context), types.SimpleNamespace(**wp_t), input_ids,
                             positions, out_cache_loc, enable_write_input_assert,
                             expected_input_tokens, expected_input_positions)
        _same_device("canary_write", "canary_buf",
                     {**required, "expected_input_tokens": expected_input_tokens,
                      "expected_input_positions": expected_input_positions})
        io.check_distinct_outputs({"canary_buf": context.canary_buf,
                                   **_fields(context, _CTX_OUT)})
        _WRITE_OK.add(key)
    if values and value_checks_enabled(context.canary_buf.device):
        num_slots = int(context.canary_buf.shape[0])
        cap = int(plan.write_seed_slot_indices.shape[0])
        a = max(0, min(int(plan.write_num_valid_reqs[0]), cap))
        offs = plan.write_offsets[: a + 1]
        check_range(_WRITE_P, "plan.write_offsets", offs, 0, int(input_ids.shape[0]) + 1,
                    "flat token positions")
        if bool((offs[1:] < offs[:-1]).any()):
            raise ValueError(f"{_WRITE_P} plan.write_offsets must be non-decreasing over the "
                             f"{a} valid requests")
        check_range(_WRITE_P, "plan.write_seed_slot_indices",
                    plan.write_seed_slot_indices[:a].clamp(min=-1), -1, num_slots,
                    "canary slots, negative = new chain")
        check_range(_WRITE_P, "out_cache_loc", out_cache_loc.clamp(min=-1), -1, num_slots,
                    "canary slots, negative = skip")
    return key


def _write_launch(context, plan, input_ids, positions, out_cache_loc, enable_write_input_assert,
                  expected_input_tokens, expected_input_positions, info, key):
    bufs, specs = io.import_sources(context.real_kv_sources, info)
    ckey = key[0]
    outs = {"canary_buf": io.import_output(context.canary_buf, "canary_buf", info, ckey[0])}
    outs.update({k: io.import_output(getattr(context, k), k, info, kk)
                 for k, kk in zip(_CTX_OUT, ckey[1])})
    wp = _plans.WritePlan(**{k: io.import_input(getattr(plan, k), f"plan.{k}", info)
                             for k in _WP_FIELDS})
    return outs, dict(
        outs=tuple(o.array for o in outs.values()),
        cpa=io.import_input(context.enable_chain_position_assert, "enable_chain_position_assert",
                            info),
        wp=wp,
        ids=io.import_input(input_ids, "input_ids", info),
        pos=io.import_input(positions, "positions", info),
        ocl=io.import_input(out_cache_loc, "out_cache_loc", info),
        etok=_opt_input(expected_input_tokens, "expected_input_tokens", info),
        epos=_opt_input(expected_input_positions, "expected_input_positions", info),
        bufs=bufs, specs=specs, kind=int(context.kernel_kind),
        mode=int(context.real_kv_hash_mode), check_input=bool(enable_write_input_assert),
        platform=info.platform,
    )


def launch_canary_write_kernel(
    *,
    context,
    plan,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    out_cache_loc: torch.Tensor,
    enable_write_input_assert: bool,
    expected_input_tokens: torch.Tensor | None,
    expected_input_positions: torch.Tensor | None,
) -> None:
    """Stamp canary records for the batch's written tokens; updates ``canary_buf``, the ring,
    write index and counters in place."""
    c = context
    tensors = (c.canary_buf, c.violation_ring, c.violation_write_index, c.slot_run_counter,
               c.kernel_run_counter, c.enable_chain_position_assert, plan.write_offsets,
               plan.write_seed_slot_indices, plan.write_num_valid_reqs, input_ids, positions,
               out_cache_loc, expected_input_tokens, expected_input_positions)
    statics = (id(c.canary_buf), c.kernel_kind, c.real_kv_hash_mode, enable_write_input_assert)
    done, statics, tensors = _try_replay(_WRITE_FAST, c, statics, tensors)
    if done:
        return
    key = _check_write(context, plan, input_ids, positions, out_cache_loc,
                       enable_write_input_assert, expected_input_tokens,
                       expected_input_positions)
    info = io.device_info(context.canary_buf)
    with io.x64_scope():
        fence = io.fence(info)
        outs, kw = _write_launch(context, plan, input_ids, positions, out_cache_loc,
                                 enable_write_input_assert, expected_input_tokens,
                                 expected_input_positions, info, key)
        args = (kw.pop("outs"), kw.pop("cpa"), kw.pop("wp"), kw.pop("ids"), kw.pop("pos"),
                kw.pop("ocl"), kw.pop("etok"), kw.pop("epos"), kw.pop("bufs"))
        _fast.full_call(_WRITE_FAST, statics, tensors, info, adapter=_write_adapter,
                        args=args, fence=fence, static=kw, donate=(0,),
                        outs=tuple(outs.values()))


# --------------------------------------------------------------------------------------------
# Fused step


@functools.partial(
    jax.jit,
    static_argnames=("scatter_cols", "do_scatter", "swa_window_size", "verify_capacity", "k",
                     "specs", "kind", "mode", "check_token", "check_input", "platform"),
    donate_argnums=(0, 1, 2, 3), keep_unused=True,
)
def _step_adapter(pool, vp, wp, outs, flat_in, flat_offsets, rpi, prefix, extend, rtt, lut,
                  valid_lens, cpa, ids, pos, ocl, etok, epos, bufs, fence, *, scatter_cols,
                  do_scatter, swa_window_size, verify_capacity, k, specs, kind, mode,
                  check_token, check_input, platform):
    del fence
    if do_scatter:
        pool = _scatter.run(flat_in, flat_offsets, rpi, pool, max_cols=scatter_cols,
                            implementation=_impl("scatter", platform))
    vp, wp = _plan.run(
        vp, wp, rpi, prefix, extend, rtt, lut, pool, valid_lens,
        swa_window_size=swa_window_size, verify_capacity=verify_capacity,
        kv_token_id_vs_position_offset=k, implementation=_impl("plan", platform),
    )
    canary = outs[0]
    vouts = _verify_call(dict(zip(_CTX_OUT, outs[1:]), canary_buf=canary), vp, bufs, specs=specs,
                         kind=kind, mode=mode, check_token=check_token, platform=platform)
    wouts = _write_call(dict(zip(_CTX_OUT, vouts), canary_buf=canary,
                             enable_chain_position_assert=cpa),
                        wp, ids, pos, ocl, etok, epos, bufs, specs=specs, kind=kind, mode=mode,
                        check_input=check_input, platform=platform)
    return pool, vp, wp, tuple(wouts)


def launch_canary_step(
    *,
    context,
    verify_plan_out,
    write_plan_out,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    out_cache_loc: torch.Tensor,
    swa_window_size: int = 0,
    full_to_swa_index_mapping: torch.Tensor | None = None,
    verify_capacity: int | None = None,
    req_to_verify_expected_tokens: torch.Tensor | None = None,
    req_to_verify_expected_tokens_valid_lens: torch.Tensor | None = None,
    kv_token_id_vs_position_offset: int = 0,
    expected_token_ids: torch.Tensor | None = None,
    expected_token_offsets: torch.Tensor | None = None,
    check_verify_expected_token: bool = False,
    enable_write_input_assert: bool = False,
    expected_input_tokens: torch.Tensor | None = None,
    expected_input_positions: torch.Tensor | None = None,
) -> None:
    """One canary step of one endpoint in one compiled call: (scatter) + plan + verify + write.

    Equivalent to, in this order (SGLang's serving flow, spec section 13)::

        if expected_token_ids is not None:   # token verification: refresh the expected pool
            launch_scatter_req_token_ids_kernel(flat_in=expected_token_ids,
                offsets=expected_token_offsets, req_pool_indices=req_pool_indices,
                pool_out=req_to_verify_expected_tokens)
        launch_canary_plan_kernels(verify_plan_out=..., write_plan_out=..., req_pool_indices=...,
            prefix_lens=..., extend_seq_lens=..., req_to_token=..., swa_window_size=...,
            full_to_swa_index_mapping=..., verify_capacity=..., req_to_verify_expected_tokens=...,
            req_to_verify_expected_tokens_valid_lens=..., kv_token_id_vs_position_offset=...)
        launch_canary_verify_kernel(context=context, plan=verify_plan_out,
            check_verify_expected_token=check_verify_expected_token)
        launch_canary_write_kernel(context=context, plan=write_plan_out, input_ids=...,
            positions=..., out_cache_loc=..., enable_write_input_assert=...,
            expected_input_tokens=..., expected_input_positions=...)

    with every launcher's static checks run first (nothing runs if one fails). Value checks of
    the verify / write plans are skipped: the plan is produced by this very call. All outputs
    (expected pool, both plans, canary buffer, ring, write index, counters) are updated in place.
    ``verify_capacity`` defaults to the verify plan's capacity.
    """
    if verify_capacity is None:
        verify_capacity = int(verify_plan_out.verify_slot_indices.shape[0])
    c, vp, wp = context, verify_plan_out, write_plan_out
    tensors = (
        c.canary_buf, c.violation_ring, c.violation_write_index, c.slot_run_counter,
        c.kernel_run_counter, c.enable_chain_position_assert, vp.verify_slot_indices,
        vp.verify_expected_tokens, vp.verify_expected_positions, vp.verify_prev_slot_indices,
        vp.verify_num_valid, vp.enable, wp.write_offsets, wp.write_seed_slot_indices,
        wp.write_num_valid_reqs, req_pool_indices, prefix_lens, extend_seq_lens, req_to_token,
        input_ids, positions, out_cache_loc, full_to_swa_index_mapping,
        req_to_verify_expected_tokens, req_to_verify_expected_tokens_valid_lens,
        expected_token_ids, expected_token_offsets, expected_input_tokens,
        expected_input_positions,
    )
    statics = (id(c.canary_buf), c.kernel_kind, c.real_kv_hash_mode, swa_window_size,
               verify_capacity, kv_token_id_vs_position_offset, check_verify_expected_token,
               enable_write_input_assert)
    done, statics, tensors = _try_replay(_STEP_FAST, c, statics, tensors)
    if done:
        return
    do_scatter = expected_token_ids is not None or expected_token_offsets is not None
    vp_t = _fields(verify_plan_out, _VP_FIELDS)
    wp_t = _fields(write_plan_out, _WP_FIELDS)
    # The static checks of all four launchers depend on these signatures only: a step repeated
    # on the same buffers (the serving loop) evaluates them once.
    pk = _plan_key(vp_t, wp_t, req_pool_indices, prefix_lens, extend_seq_lens, req_to_token,
                   full_to_swa_index_mapping, req_to_verify_expected_tokens,
                   req_to_verify_expected_tokens_valid_lens, swa_window_size, verify_capacity)
    wk = (_ctx_sig(context), pk[1], isig(input_ids), isig(positions), isig(out_cache_loc),
          bool(enable_write_input_assert), isig(expected_input_tokens),
          isig(expected_input_positions))
    skey = (isig(expected_token_ids), isig(expected_token_offsets), pk[2], pk[7]) \
        if do_scatter else None
    step_key = (pk, wk, skey, bool(check_verify_expected_token))
    if step_key in _STEP_OK and not value_checks_enabled(context.canary_buf.device):
        do_scatter = do_scatter and expected_token_ids.shape[0] > 0 and \
            req_pool_indices.shape[0] > 0
    else:
        if do_scatter:
            if req_to_verify_expected_tokens is None:
                raise ValueError(
                    "kv-canary: launch_canary_step scatters expected_token_ids into "
                    "req_to_verify_expected_tokens, which is None"
                )
            do_scatter = check_scatter(
                flat_in=expected_token_ids, offsets=expected_token_offsets,
                req_pool_indices=req_pool_indices, pool_out=req_to_verify_expected_tokens,
            ) is not None
        _check_plan(
            verify_plan_out=verify_plan_out, write_plan_out=write_plan_out,
            req_pool_indices=req_pool_indices, prefix_lens=prefix_lens,
            extend_seq_lens=extend_seq_lens, req_to_token=req_to_token,
            swa_window_size=swa_window_size,
            full_to_swa_index_mapping=full_to_swa_index_mapping,
            verify_capacity=verify_capacity,
            req_to_verify_expected_tokens=req_to_verify_expected_tokens,
            req_to_verify_expected_tokens_valid_lens=req_to_verify_expected_tokens_valid_lens,
        )
        _check_verify(context, verify_plan_out, values=False)
        _check_write(context, write_plan_out, input_ids, positions, out_cache_loc,
                     enable_write_input_assert, expected_input_tokens,
                     expected_input_positions, values=False)
        _same_device("canary_step", "canary_buf",
                     dict(canary_buf=context.canary_buf, req_pool_indices=req_pool_indices,
                          verify_slot_indices=verify_plan_out.verify_slot_indices))
        _STEP_OK.add(step_key)
    info = io.device_info(context.canary_buf)
    ck = wk[0]
    with io.x64_scope():
        fence = io.fence(info)
        pool = (None if req_to_verify_expected_tokens is None else
                io.import_output(req_to_verify_expected_tokens, "req_to_verify_expected_tokens",
                                 info, pk[7]))
        plan_outs = _plan_outputs(vp_t, wp_t, pk, info)
        ctx_outs = {"canary_buf": io.import_output(context.canary_buf, "canary_buf", info,
                                                   ck[0])}
        ctx_outs.update({k: io.import_output(getattr(context, k), k, info, kk)
                         for k, kk in zip(_CTX_OUT, ck[1])})
        bufs, specs = io.import_sources(context.real_kv_sources, info)
        args = (
            None if pool is None else pool.array,
            _plans.VerifyPlan(**{k: plan_outs[k].array for k in _VP_FIELDS}),
            _plans.WritePlan(**{k: plan_outs[k].array for k in _WP_FIELDS}),
            tuple(o.array for o in ctx_outs.values()),
            io.import_input(expected_token_ids, "expected_token_ids", info)
            if do_scatter else None,
            io.import_input(expected_token_offsets, "expected_token_offsets", info)
            if do_scatter else None,
            io.import_input(req_pool_indices, "req_pool_indices", info),
            io.import_input(prefix_lens, "prefix_lens", info),
            io.import_input(extend_seq_lens, "extend_seq_lens", info),
            io.import_input(req_to_token, "req_to_token", info),
            _opt_input(full_to_swa_index_mapping, "full_to_swa_index_mapping", info),
            _opt_input(req_to_verify_expected_tokens_valid_lens,
                       "req_to_verify_expected_tokens_valid_lens", info),
            io.import_input(context.enable_chain_position_assert, "enable_chain_position_assert",
                            info),
            io.import_input(input_ids, "input_ids", info),
            io.import_input(positions, "positions", info),
            io.import_input(out_cache_loc, "out_cache_loc", info),
            _opt_input(expected_input_tokens, "expected_input_tokens", info),
            _opt_input(expected_input_positions, "expected_input_positions", info),
            bufs,
        )
        static = dict(
            scatter_cols=None if pool is None else pool.cols, do_scatter=do_scatter,
            swa_window_size=int(swa_window_size), verify_capacity=int(verify_capacity),
            k=int(kv_token_id_vs_position_offset), specs=specs, kind=int(context.kernel_kind),
            mode=int(context.real_kv_hash_mode),
            check_token=bool(check_verify_expected_token),
            check_input=bool(enable_write_input_assert), platform=info.platform,
        )
        # Results in the order of the outputs: plan fields, context buffers, expected pool.
        _fast.full_call(
            _STEP_FAST, statics, tensors, info, adapter=_step_adapter, args=args, fence=fence,
            static=static, donate=(0, 1, 2, 3),
            outs=(*plan_outs.values(), *ctx_outs.values(), *(() if pool is None else (pool,))),
            results_of=lambda r: (*_plan_results(r[1], r[2]), *r[3],
                                  *(() if pool is None else (r[0],))))
