"""Torch bridge: SGLang-compatible kv-canary launchers running the package's Pallas kernels.

Code written against SGLang 0.5.23's ``sglang.kernels.ops.kv_canary`` runs unchanged against these
names: same keyword arguments, torch dtypes, checks and messages, in-place mutation of the output /
plan / context tensors, ``None`` returned. The bridge holds no kernel logic: each launcher is
declared once (:mod:`kvcanary_jax.bridge.declarations`: tensors, in-place outputs, non-tensor
arguments, contract) and run by one generic launcher (:mod:`kvcanary_jax.bridge.launcher`) on one of
two paths:

* ``triton_direct`` (CUDA tensors, the default there): the same Pallas kernels, lowered once per
  shape bucket to their Triton IR, compiled with the ``triton`` that torch ships and launched with
  the tensors' pointers on torch's current stream: no DLPack, no JAX dispatch, capturable by
  ``torch.cuda.graph`` (:mod:`kvcanary_jax.bridge.triton_direct`).
* ``dlpack`` (CPU tensors, and wherever the direct path is unavailable): tensors handed to JAX
  zero-copy over DLPack and the jitted function run by XLA (:mod:`kvcanary_jax.bridge.dlpack`,
  :mod:`kvcanary_jax.bridge.views`, :mod:`kvcanary_jax.bridge.streams`); refused under CUDA graph
  capture.

:func:`paths` says which path each launcher's last call took, and why not the direct one.

:func:`install_into_sglang` makes SGLang 0.5.23's own canary runtime (``sglang.srt.kv_canary``)
launch these kernels: it rebinds the four launcher names that runtime calls, checked against
SGLang's version and signatures first, and its handle restores them
(:mod:`kvcanary_jax.bridge.sglang_install`).

Where the bridge differs from SGLang's launchers, on purpose:

* Checks: every launcher raises SGLang's GPU-path errors (class and words, in SGLang's order)
  for CPU and CUDA tensors alike, all before anything runs. ``None`` where a tensor is required
  is a TypeError naming it; tensors on two devices are refused; a tensor on the ``meta`` device
  gets the bridge's own error.
* Values (negative or out-of-range indices, malformed offsets) are checked before launch for CPU
  tensors; on the GPU that would cost a device-to-host synchronisation per call, so it is opt-in
  there (:func:`set_value_checks`, ``KVCANARY_BRIDGE_VALUE_CHECKS=1``); the kernels stay in bounds
  either way.
* No ``bs + 1 <= 512`` cap on scatter, no ``bs <= 4096`` cap on plan.
* Views: a 2-D output or pool whose rows are strided (``pool[:, :n]``, ``pool[:, 2:6]``) works in
  place; a column slice with an offset whose rows the plan would read past its storage is refused
  with an error saying what to pass. A real-KV source may require grad and may be any row-strided
  view (``kv[:, 16:48]``). Other non-compact layouts are refused with an error naming the tensor.
* Shapes: token counts are bucketed (:mod:`kvcanary_jax.buckets`), so a serving loop whose token
  history grows every step compiles a logarithmic number of kernels; the plan's batch size is
  an operand of its kernels (:func:`kvcanary_jax.ops.plan.base.batch_lanes`), so its request
  vectors are bucketed too (``launch_canary_step``'s batch size is exact).
* :func:`launch_canary_step` (no SGLang counterpart) runs scatter + plan + verify + write of one
  endpoint in one call (one program of kernels).

Importing the bridge sets ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` unless the environment sets it,
so JAX does not reserve the GPU memory the hosting torch process needs.
"""

import os as _os

if __name__ != "kvcanary_jax.bridge":
    # Imported from a checkout's root as the folder's own name (``import bridge``): its modules
    # import each other as kvcanary_jax.bridge, so a second copy under this name would split the
    # caches and the classes (a BridgeError of one is not the other's).
    raise ImportError(f"the torch bridge is kvcanary_jax.bridge, not {__name__!r}: "
                      "`import kvcanary_jax.bridge as bridge` (from a checkout, after "
                      "`pip install -e .`)")

# JAX would otherwise reserve most of the GPU's memory at its first use, starving the torch
# process hosting the bridge; an explicit setting by the user wins.
_os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from kvcanary_jax.bridge import declarations as _decl  # noqa: E402
from kvcanary_jax.bridge.cache import clear_cache  # noqa: E402
from kvcanary_jax.bridge.checks import set_value_checks, value_checks  # noqa: E402
from kvcanary_jax.bridge.dlpack import BridgeError, stats  # noqa: E402
from kvcanary_jax.bridge.launcher import Launcher as _Launcher  # noqa: E402
from kvcanary_jax.bridge.launcher import direct_enabled, paths, set_direct  # noqa: E402
from kvcanary_jax.bridge.sglang_install import SglangInstall, install_into_sglang  # noqa: E402
from kvcanary_jax.bridge.streams import set_stream_sync, stream_sync  # noqa: E402
from kvcanary_jax.bridge.types import (  # noqa: E402
    CANARY_SLOT_BYTES,
    MAX_REAL_KV_SOURCES,
    CanaryLaunchTag,
    RealKvHashMode,
    RealKvSource,
    VerifyOrWriteContext,
    VerifyPlan,
    WritePlan,
)

__all__ = [
    "launch_scatter_req_token_ids_kernel",
    "launch_canary_plan_kernels",
    "launch_canary_write_kernel",
    "launch_canary_verify_kernel",
    "launch_canary_step",
    "VerifyPlan",
    "WritePlan",
    "VerifyOrWriteContext",
    "RealKvSource",
    "CanaryLaunchTag",
    "RealKvHashMode",
    "CANARY_SLOT_BYTES",
    "MAX_REAL_KV_SOURCES",
    "BridgeError",
    "clear_cache",
    "stats",
    "paths",
    "install_into_sglang",
    "SglangInstall",
    "set_direct",
    "direct_enabled",
    "set_stream_sync",
    "stream_sync",
    "set_value_checks",
    "value_checks",
]

_SCATTER = _Launcher(_decl.SCATTER)
_PLAN = _Launcher(_decl.PLAN)
_VERIFY = _Launcher(_decl.VERIFY)
_WRITE = _Launcher(_decl.WRITE)
_STEP = _Launcher(_decl.STEP)


def launch_scatter_req_token_ids_kernel(*, flat_in, offsets, req_pool_indices, pool_out) -> None:
    """Scatter each request's int64 tokens into its int32 row of ``pool_out``, in place.

    Same keywords, dtypes, checks (order, classes, messages) and in-place semantics as SGLang
    0.5.23's launcher, without its ``bs + 1 <= 512`` cap. ``pool_out`` may be a view whose rows
    are strided (``pool[:, :n]``, ``pool[:, 2:6]``); columns outside the view are never written.
    """
    _SCATTER(flat_in=flat_in, offsets=offsets, req_pool_indices=req_pool_indices,
             pool_out=pool_out)


def launch_canary_plan_kernels(*, verify_plan_out, write_plan_out, req_pool_indices, prefix_lens,
                               extend_seq_lens, req_to_token, swa_window_size,
                               full_to_swa_index_mapping, verify_capacity,
                               req_to_verify_expected_tokens,
                               req_to_verify_expected_tokens_valid_lens,
                               kv_token_id_vs_position_offset) -> None:
    """Fill ``verify_plan_out`` and ``write_plan_out`` in place (SGLang's GPU-path semantics,
    checks and messages; no ``bs <= 4096`` cap). Plans may be the bridge's or SGLang's
    dataclasses."""
    _PLAN(verify_plan_out=verify_plan_out, write_plan_out=write_plan_out,
          req_pool_indices=req_pool_indices, prefix_lens=prefix_lens,
          extend_seq_lens=extend_seq_lens, req_to_token=req_to_token,
          swa_window_size=swa_window_size, full_to_swa_index_mapping=full_to_swa_index_mapping,
          verify_capacity=verify_capacity,
          req_to_verify_expected_tokens=req_to_verify_expected_tokens,
          req_to_verify_expected_tokens_valid_lens=req_to_verify_expected_tokens_valid_lens,
          kv_token_id_vs_position_offset=kv_token_id_vs_position_offset)


def launch_canary_verify_kernel(*, context, plan, check_verify_expected_token) -> None:
    """Verify one canary buffer against a VerifyPlan; updates the context's ring, write index
    and counters in place (``canary_buf`` is only read)."""
    _VERIFY(context=context, plan=plan, check_verify_expected_token=check_verify_expected_token)


def launch_canary_write_kernel(*, context, plan, input_ids, positions, out_cache_loc,
                               enable_write_input_assert, expected_input_tokens,
                               expected_input_positions) -> None:
    """Stamp canary records for the batch's written tokens; updates ``canary_buf``, the ring,
    write index and counters in place."""
    _WRITE(context=context, plan=plan, input_ids=input_ids, positions=positions,
           out_cache_loc=out_cache_loc, enable_write_input_assert=enable_write_input_assert,
           expected_input_tokens=expected_input_tokens,
           expected_input_positions=expected_input_positions)


def launch_canary_step(*, context, verify_plan_out, write_plan_out, req_pool_indices,
                       prefix_lens, extend_seq_lens, req_to_token, input_ids, positions,
                       out_cache_loc, swa_window_size=0, full_to_swa_index_mapping=None,
                       verify_capacity=None, req_to_verify_expected_tokens=None,
                       req_to_verify_expected_tokens_valid_lens=None,
                       kv_token_id_vs_position_offset=0, expected_token_ids=None,
                       expected_token_offsets=None, check_verify_expected_token=False,
                       enable_write_input_assert=False, expected_input_tokens=None,
                       expected_input_positions=None) -> None:
    """One canary step of one endpoint in one call: (scatter) + plan + verify + write.

    Equivalent to, in this order (SGLang's serving flow)::

        if expected_token_ids is not None:   # token verification: refresh the expected pool
            launch_scatter_req_token_ids_kernel(flat_in=expected_token_ids,
                offsets=expected_token_offsets, req_pool_indices=req_pool_indices,
                pool_out=req_to_verify_expected_tokens)
        launch_canary_plan_kernels(verify_plan_out=..., write_plan_out=..., ...)
        launch_canary_verify_kernel(context=context, plan=verify_plan_out,
            check_verify_expected_token=check_verify_expected_token)
        launch_canary_write_kernel(context=context, plan=write_plan_out, input_ids=...,
            positions=..., out_cache_loc=..., enable_write_input_assert=...,
            expected_input_tokens=..., expected_input_positions=...)

    with every launcher's static checks run first (nothing runs if one fails). Value checks of
    the verify / write plans are skipped: the plan is produced by this very call; the caller's
    token arrays are checked as the write launcher checks them (``out_cache_loc`` inside the
    canary buffer, the active requests' ``extend_seq_lens`` within ``input_ids``). Unlike the
    sequence, the step refuses an expected-token pool that shares memory with
    ``req_to_token`` (or any other input) when it scatters: our rule, see
    :func:`kvcanary_jax.bridge.checks.check_outputs_apart_from_inputs`. All outputs
    (expected pool, both plans, canary buffer, ring, write index, counters) are updated in place.
    ``verify_capacity`` defaults to the verify plan's capacity.
    """
    if verify_capacity is None:
        verify_capacity = int(verify_plan_out.verify_slot_indices.shape[0])
    _STEP(context=context, verify_plan_out=verify_plan_out, write_plan_out=write_plan_out,
          req_pool_indices=req_pool_indices, prefix_lens=prefix_lens,
          extend_seq_lens=extend_seq_lens, req_to_token=req_to_token, input_ids=input_ids,
          positions=positions, out_cache_loc=out_cache_loc, swa_window_size=swa_window_size,
          full_to_swa_index_mapping=full_to_swa_index_mapping, verify_capacity=verify_capacity,
          req_to_verify_expected_tokens=req_to_verify_expected_tokens,
          req_to_verify_expected_tokens_valid_lens=req_to_verify_expected_tokens_valid_lens,
          kv_token_id_vs_position_offset=kv_token_id_vs_position_offset,
          expected_token_ids=expected_token_ids, expected_token_offsets=expected_token_offsets,
          check_verify_expected_token=check_verify_expected_token,
          enable_write_input_assert=enable_write_input_assert,
          expected_input_tokens=expected_input_tokens,
          expected_input_positions=expected_input_positions)
