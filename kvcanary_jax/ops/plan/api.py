"""The public plan: validate once, pick the implementation and its launch config, run it."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from kvcanary_jax import _config
from kvcanary_jax.ops import _registry
from kvcanary_jax.ops.plan import base
from kvcanary_jax.ops.plan.base import PlanInputs
from kvcanary_jax.plans import VerifyPlan, WritePlan

__all__ = ["OP", "run", "canary_plan"]

OP = _registry.standard_op("plan")


@functools.partial(
    jax.jit,
    static_argnames=("swa_window_size", "verify_capacity", "kv_token_id_vs_position_offset",
                     "implementation", "config"),
)
def _run(vp, wp, inputs, *, swa_window_size, verify_capacity, kv_token_id_vs_position_offset,
         implementation, config):
    return base.sized_call(functools.partial(OP.run, implementation, config=config), vp, wp,
                           inputs, swa_window_size=swa_window_size,
                           verify_capacity=verify_capacity,
                           kv_token_id_vs_position_offset=kv_token_id_vs_position_offset)


def takes_num_reqs(implementation: str) -> bool:
    """Whether ``implementation``'s kernels take the batch size as an operand (``num_reqs``):
    ``xla``, ``pallas_triton`` and ``pallas_interpret`` do; ``pallas_mosaic_tpu`` compiles per
    batch size (its module says so: ``TAKES_NUM_REQS``)."""
    return OP.module(implementation).TAKES_NUM_REQS


@_config.entry_point
def run(vp: VerifyPlan, wp: WritePlan, inputs: PlanInputs, *, swa_window_size: int,
        verify_capacity: int, kv_token_id_vs_position_offset: int,
        implementation: str | None = None, config=None) -> tuple[VerifyPlan, WritePlan]:
    """Array-level plan, without the contract's checks (the torch bridge checks the same contract
    on its tensors). ``inputs.req_to_token`` (and the pool) may be compact ``[rows, row_pitch]``
    bases of strided views (see :mod:`kvcanary_jax.ops.plan.base`); the optional inputs may be
    None. Returns the filled plans, every array aliased to the input plans'.
    ``implementation`` / ``config`` / ``inputs.num_reqs``: as :func:`canary_plan`."""
    impl = OP.select(implementation, config=config,
                     args=(inputs.req_pool_indices, inputs.req_to_token))  # the target: see select
    if inputs.num_reqs is not None:
        if not takes_num_reqs(impl):
            raise ValueError(
                f"kv-canary: canary_plan: implementation {impl!r} compiles per batch size and "
                "takes no num_reqs; pass the unpadded request vectors")
        inputs = dataclasses.replace(
            inputs, num_reqs=jnp.asarray(inputs.num_reqs, jnp.int32).reshape(1))
    cfg = OP.config(impl, base.shapes(vp, wp, inputs), config)
    return _run(vp, wp, inputs, swa_window_size=int(swa_window_size),
                verify_capacity=int(verify_capacity),
                kv_token_id_vs_position_offset=int(kv_token_id_vs_position_offset),
                implementation=impl, config=cfg)


@_config.entry_point
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
    implementation: str | None = None,
    config=None,
    num_reqs=None,
) -> tuple[VerifyPlan, WritePlan]:
    """Plan one step's verify entries and write ranges; returns the filled ``(VerifyPlan,
    WritePlan)`` (semantics: :mod:`kvcanary_jax.ops.plan.base`).

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

    ``implementation``: ``"xla"``, ``"pallas_triton"``, ``"pallas_interpret"``, ... (default: the
    platform's, see :mod:`kvcanary_jax.ops._registry`); ``config``: that implementation's
    ``Config`` (default: the device kind's tuned table, else heuristics).

    ``num_reqs``: the batch size as a runtime operand (an int or a one-element integer array,
    traced or not) when the request vectors (``req_pool_indices``, ``prefix_lens``,
    ``extend_seq_lens``, ``valid_lens``) are padded to a bucket: requests at or past it are
    never read and the plans equal those of the unpadded batch, so a serving loop compiles once
    per bucket (:func:`kvcanary_jax.ops.plan.base.batch_lanes`; ``pallas_mosaic_tpu`` compiles
    per batch size and refuses it). The checks use the padded vectors' length as ``bs``.

    Under ``jax.jit(..., donate_argnames=...)`` with both plans donated the plan buffers are
    filled in place (every plan array is aliased input-to-output). Raises SGLang's errors (see
    :data:`kvcanary_jax.ops.plan.contract.CONTRACT`) at trace time.
    """
    inputs = base.inputs_of(req_pool_indices, prefix_lens, extend_seq_lens, req_to_token,
                            full_to_swa_index_mapping, req_to_verify_expected_tokens,
                            req_to_verify_expected_tokens_valid_lens)
    base.validate(verify_plan_out, write_plan_out, inputs, swa_window_size=swa_window_size,
                  verify_capacity=verify_capacity,
                  req_to_token_stride0=req_to_token_stride0,
                  kv_token_id_vs_position_offset=kv_token_id_vs_position_offset)
    return run(verify_plan_out, write_plan_out, dataclasses.replace(inputs, num_reqs=num_reqs),
               swa_window_size=swa_window_size, verify_capacity=verify_capacity,
               kv_token_id_vs_position_offset=kv_token_id_vs_position_offset,
               implementation=implementation, config=config)
