"""The bridge's launchers, SGLang 0.5.23's names and keywords (see :mod:`kvcanary_jax.bridge`),
and the KV digest's (ours, in SGLang's style): each runs its declaration
(:mod:`kvcanary_jax.bridge.declarations`) through the generic
:class:`~kvcanary_jax.bridge.launcher.Launcher`. Importable from :mod:`kvcanary_jax.bridge`;
:mod:`kvcanary_jax.bridge.sglang_install` binds SGLang's names to them."""

from kvcanary_jax.bridge import declarations as _decl
from kvcanary_jax.bridge.launcher import Launcher as _Launcher

__all__ = [
    "launch_scatter_req_token_ids_kernel",
    "launch_canary_plan_kernels",
    "launch_canary_write_kernel",
    "launch_canary_verify_kernel",
    "launch_canary_step",
    "launch_kv_digest_write",
    "launch_kv_digest_verify",
]

_SCATTER = _Launcher(_decl.SCATTER)
_PLAN = _Launcher(_decl.PLAN)
_VERIFY = _Launcher(_decl.VERIFY)
_WRITE = _Launcher(_decl.WRITE)
_STEP = _Launcher(_decl.STEP)
_DIGEST_WRITE = _Launcher(_decl.DIGEST_WRITE)
_DIGEST_VERIFY = _Launcher(_decl.DIGEST_VERIFY)


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


def launch_kv_digest_write(*, digest_buf, slots, sources) -> None:
    """Store the KV digest of every slot of ``slots`` into ``digest_buf``, in place (ours:
    docs/spec.md §16; :func:`kvcanary_jax.digest_write` on torch tensors).

    ``digest_buf`` int64 ``[num_slots]``; ``slots`` int64 ``[n]`` (negative: padding, skipped; at
    or past ``num_slots``: skipped); ``sources``: 1 to 512 real-KV sources over torch tensors
    (SGLang's ``RealKvSource`` or the bridge's; e.g. every layer's K and V of a KV pool, each
    ``layer.view(torch.uint8).view(slots, -1)``), every byte of each slot's strip hashed. All on
    one device."""
    _DIGEST_WRITE(digest_buf=digest_buf, slots=slots, sources=sources)


def launch_kv_digest_verify(*, context, slots, positions, num_valid, phase, window,
                            sources) -> None:
    """Check the stored digests of the selected entries' slots; records each mismatch in the
    context's ring (SGLang's 8 fields, reason ``KV_DIGEST_MISMATCH``) and updates its write
    index and counters in place (ours: docs/spec.md §16; :func:`kvcanary_jax.digest_verify` on
    torch tensors).

    ``context``: a :class:`~kvcanary_jax.bridge.DigestContext` (or any object with its fields);
    ``slots``, ``positions`` int64 ``[capacity]``; ``num_valid``, ``phase`` int32 ``[1]`` (device
    values: the entries below ``num_valid[0]`` whose slot ``s`` has ``s % window == phase[0] mod
    window`` are checked, slot 0 and slots outside the buffer never); ``window`` a static int
    >= 1; ``sources`` as :func:`launch_kv_digest_write` (the same ones the digests were written
    with)."""
    _DIGEST_VERIFY(context=context, slots=slots, positions=positions, num_valid=num_valid,
                   phase=phase, window=window, sources=sources)
