"""Case builders the benchmarks and the tests share: one home for each piece of a launch that both
build (as tokamax's ``arg_specs`` serve its tests and benchmarks), so a field added to a context or
a plan is added here once.

Nothing here draws random numbers: callers draw their own arrays (with their own seeds) and hand
them in, so a builder's output is exactly what the inline copy it replaces gave. torch is imported
only by the torch builders."""

from __future__ import annotations

import numpy as np

__all__ = ["jax_verify_plan", "torch_context"]


def jax_verify_plan(slots, tokens, positions, prev, num_valid: int, enable: int = 1):
    """Our ``VerifyPlan`` over int64 copies of the four entry arrays (any integer sequences), with
    ``verify_num_valid = [num_valid]`` and ``enable = [enable]`` (int32). Call it under
    ``jax.enable_x64(True)``: the entry arrays are int64."""
    import jax.numpy as jnp

    import kvcanary_jax as kc

    def i64(x):
        return jnp.asarray(np.asarray(x, np.int64), jnp.int64)

    return kc.VerifyPlan(
        verify_slot_indices=i64(slots),
        verify_expected_tokens=i64(tokens),
        verify_expected_positions=i64(positions),
        verify_prev_slot_indices=i64(prev),
        verify_num_valid=jnp.asarray([num_valid], jnp.int32),
        enable=jnp.asarray([enable], jnp.int32))


def torch_context(cls, *, canary_buf, kernel_kind, real_kv_hash_mode, ring: int,
                  real_kv_sources=(), ring_fill: int = 0, device=None):
    """A torch ``VerifyOrWriteContext`` of ``cls`` (the bridge's or SGLang's) over ``canary_buf``:
    a ring of ``ring`` rows filled with ``ring_fill``, write index and counters 0, the
    chain-position check on. ``device``: that of the ring and counters (default: the canary's)."""
    import torch

    dev = canary_buf.device if device is None else device
    return cls(
        canary_buf=canary_buf,
        kernel_kind=kernel_kind,
        violation_ring=torch.full((ring, 8), ring_fill, dtype=torch.int64, device=dev),
        violation_write_index=torch.zeros(1, dtype=torch.int32, device=dev),
        slot_run_counter=torch.zeros(1, dtype=torch.int64, device=dev),
        kernel_run_counter=torch.zeros(1, dtype=torch.int64, device=dev),
        real_kv_sources=real_kv_sources,
        real_kv_hash_mode=real_kv_hash_mode,
        enable_chain_position_assert=torch.ones(1, dtype=torch.int32, device=dev),
    )
