"""A model forward for tests and benchmarks of the runtime's step: every layer's K and V of each
new token, in the runtime's ``{"FULL": {"layers": {"K": (...), "V": (...)}}}`` form (the form the
coverage window digests; docs/spec.md §17)."""

from __future__ import annotations

import jax.numpy as jnp

__all__ = ["layered_kv", "write_every_layer"]


def layered_kv(slots: int = 16, width: int = 8, layers: int = 2, halves=("K", "V")) -> dict:
    """Zero-filled bf16 ``[slots, width]`` arrays, ``layers`` of them per half."""
    return {"FULL": {"layers": {h: tuple(jnp.zeros((slots, width), jnp.bfloat16)
                                         for _ in range(layers)) for h in halves}}}


def write_every_layer(kv, batch, rtt, lut):
    """``forward(kv, batch, req_to_token, lut) -> kv`` for :func:`kvcanary_jax.runtime.
    make_canary_step`: writes every layer's K and V of each new token (``out_cache_loc``; -1
    writes nothing), distinct bytes per layer and half (layer ``i``'s K holds ``input_id * (2i +
    1)``, its V one more)."""
    out = {}
    for half, arrays in kv["FULL"]["layers"].items():
        out[half] = tuple(
            a.at[jnp.where(batch.out_cache_loc < 0, a.shape[0], batch.out_cache_loc)].set(
                jnp.broadcast_to((batch.input_ids * (2 * i + 1) + (half == "V"))[:, None],
                                 (batch.out_cache_loc.shape[0], a.shape[1])).astype(a.dtype),
                mode="drop")
            for i, a in enumerate(arrays))
    return {"FULL": {"layers": out}}
