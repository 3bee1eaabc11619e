"""VerifyPlan and WritePlan: the plan op's outputs, consumed by verify and write.

Registered pytrees (frozen, keyword-only dataclasses with SGLang's field names), so they pass
through ``jax.jit``, donation and ``shard_map`` untouched. The plan op returns new plans; with the
plans donated, XLA fills the same buffers in place.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvcanary_jax import _config

__all__ = ["VerifyPlan", "WritePlan"]


def _pytree(cls):
    fields = [f.name for f in dataclasses.fields(cls)]
    return jax.tree_util.register_dataclass(cls, data_fields=fields, meta_fields=[])


@_pytree
@dataclasses.dataclass(frozen=True, kw_only=True)
class VerifyPlan:
    """One verify entry per cached position; only the first ``verify_num_valid`` are read.

    Fields (as SGLang's ``VerifyPlan``): ``verify_slot_indices``, ``verify_expected_tokens``,
    ``verify_expected_positions``, ``verify_prev_slot_indices`` (int64 ``[verify_capacity]``),
    ``verify_num_valid`` and ``enable`` (int32 ``[1]``; ``enable == 0`` skips the verify).
    """

    verify_slot_indices: jax.Array
    verify_expected_tokens: jax.Array
    verify_expected_positions: jax.Array
    verify_prev_slot_indices: jax.Array
    verify_num_valid: jax.Array
    enable: jax.Array

    @property
    def verify_capacity(self) -> int:
        return int(self.verify_slot_indices.shape[0])

    @staticmethod
    def allocation_bytes(verify_capacity: int) -> int:
        return 4 * verify_capacity * 8 + 2 * 4

    @classmethod
    @_config.with_x64
    def allocate(cls, *, verify_capacity: int, device=None) -> "VerifyPlan":
        """Capacity-sized plan. SGLang leaves the arrays uninitialised (``torch.empty``); JAX has
        no such buffers, so they start at zero; ``enable`` starts at 1 as in SGLang."""
        if verify_capacity <= 0:
            raise ValueError(
                f"kv-canary: VerifyPlan verify_capacity must be positive, got {verify_capacity}"
            )
        z64 = lambda: jax.device_put(jnp.zeros((verify_capacity,), jnp.int64), device)  # noqa: E731
        return cls(
            verify_slot_indices=z64(),
            verify_expected_tokens=z64(),
            verify_expected_positions=z64(),
            verify_prev_slot_indices=z64(),
            verify_num_valid=jax.device_put(jnp.zeros((1,), jnp.int32), device),
            enable=jax.device_put(jnp.ones((1,), jnp.int32), device),
        )

    @_config.with_x64
    def zero_for_testing(self) -> "VerifyPlan":
        """SGLang's ``zero_for_testing_``: slots 0, expected tokens -1, positions 0, prev slots 0,
        num_valid 0, enable 0 (returns a new plan)."""
        c = self.verify_capacity
        return VerifyPlan(
            verify_slot_indices=jnp.zeros((c,), jnp.int64),
            verify_expected_tokens=jnp.full((c,), -1, jnp.int64),
            verify_expected_positions=jnp.zeros((c,), jnp.int64),
            verify_prev_slot_indices=jnp.zeros((c,), jnp.int64),
            verify_num_valid=jnp.zeros((1,), jnp.int32),
            enable=jnp.zeros((1,), jnp.int32),
        )


@_pytree
@dataclasses.dataclass(frozen=True, kw_only=True)
class WritePlan:
    """Per-request write ranges and chain seeds.

    Fields (as SGLang's ``WritePlan``): ``write_offsets`` int64 ``[write_req_capacity + 1]``
    (request r owns flat tokens ``[write_offsets[r], write_offsets[r + 1])``),
    ``write_seed_slot_indices`` int64 ``[write_req_capacity]`` (-1 = new chain from the anchor),
    ``write_num_valid_reqs`` int32 ``[1]``.
    """

    write_offsets: jax.Array
    write_seed_slot_indices: jax.Array
    write_num_valid_reqs: jax.Array

    @property
    def write_req_capacity(self) -> int:
        return int(self.write_seed_slot_indices.shape[0])

    @staticmethod
    def allocation_bytes(write_req_capacity: int) -> int:
        return (2 * write_req_capacity + 1) * 8 + 4

    @classmethod
    @_config.with_x64
    def allocate(cls, *, write_req_capacity: int, device=None) -> "WritePlan":
        if write_req_capacity <= 0:
            raise ValueError(
                f"kv-canary: WritePlan write_req_capacity must be positive, got {write_req_capacity}"
            )
        return cls(
            write_offsets=jax.device_put(jnp.zeros((write_req_capacity + 1,), jnp.int64), device),
            write_seed_slot_indices=jax.device_put(
                jnp.zeros((write_req_capacity,), jnp.int64), device
            ),
            write_num_valid_reqs=jax.device_put(jnp.zeros((1,), jnp.int32), device),
        )

    @_config.with_x64
    def zero_for_testing(self) -> "WritePlan":
        c = self.write_req_capacity
        return WritePlan(
            write_offsets=jnp.zeros((c + 1,), jnp.int64),
            write_seed_slot_indices=jnp.zeros((c,), jnp.int64),
            write_num_valid_reqs=jnp.zeros((1,), jnp.int32),
        )
