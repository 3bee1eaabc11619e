"""SGLang-compatible torch dataclasses: VerifyPlan, WritePlan, VerifyOrWriteContext, RealKvSource;
and ours beside them, DigestContext (the KV digest's launch context, docs/spec.md §16).

Same field names, frozen/slotted/keyword-only dataclasses, ``allocate()``, ``allocation_bytes()``
and ``zero_for_testing_()`` as SGLang 0.5.23, holding torch tensors, so serving code written
against SGLang constructs them unchanged. The launchers read these fields by name, so SGLang's own
dataclass instances are accepted as well.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcanary_jax.consts import (
    CANARY_SLOT_BYTES,
    VIOLATION_FIELDS,
    MAX_REAL_KV_SOURCES,
    CanaryLaunchTag,
    RealKvHashMode,
)
from kvcanary_jax.context import SOURCE_CONTRACT
from kvcanary_jax.contracts import meta_of

__all__ = [
    "CanaryLaunchTag",
    "RealKvHashMode",
    "RealKvSource",
    "VerifyOrWriteContext",
    "DigestContext",
    "VerifyPlan",
    "WritePlan",
    "CANARY_SLOT_BYTES",
    "MAX_REAL_KV_SOURCES",
]

@dataclass(frozen=True, slots=True, kw_only=True)
class RealKvSource:
    """Real KV bytes folded into the fingerprint: for slot ``s`` the bytes
    ``tensor[s // page_size, (s % page_size) * num_bytes_per_token :][:num_bytes_per_token]`` of
    ``tensor`` viewed as uint8 rows; rows are stepped by ``tensor.stride(0)``."""

    tensor: torch.Tensor
    page_size: int
    num_bytes_per_token: int
    read_bytes: int

    def __post_init__(self) -> None:
        # SGLang's construction checks, in its order and words, declared once with the JAX API.
        SOURCE_CONTRACT.validate_metas(
            {"tensor": meta_of(self.tensor)},
            page_size=self.page_size,
            num_bytes_per_token=self.num_bytes_per_token,
            read_bytes=self.read_bytes,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class VerifyOrWriteContext:
    """Shared verify/write launch context (SGLang's fields): canary buffer uint8
    ``[num_slots, slot_stride_bytes]``, launch tag, violation ring int64 ``[cap, 8]``, write index
    int32 ``[1]``, counters int64 ``[1]``, real-KV sources, hash mode, chain-position flag int32
    ``[1]``."""

    canary_buf: torch.Tensor
    kernel_kind: CanaryLaunchTag
    violation_ring: torch.Tensor
    violation_write_index: torch.Tensor
    slot_run_counter: torch.Tensor
    kernel_run_counter: torch.Tensor
    real_kv_sources: tuple[RealKvSource, ...]
    real_kv_hash_mode: RealKvHashMode
    enable_chain_position_assert: torch.Tensor


@dataclass(frozen=True, slots=True, kw_only=True)
class VerifyPlan:
    """Flat verify entries (SGLang's fields); only the first ``verify_num_valid[0]`` are read and
    ``enable[0] == 0`` skips the verify."""

    verify_slot_indices: torch.Tensor
    verify_expected_tokens: torch.Tensor
    verify_expected_positions: torch.Tensor
    verify_prev_slot_indices: torch.Tensor
    verify_num_valid: torch.Tensor
    enable: torch.Tensor

    @staticmethod
    def allocation_bytes(verify_capacity: int) -> int:
        return 4 * verify_capacity * torch.int64.itemsize + 2 * torch.int32.itemsize

    @classmethod
    def allocate(cls, *, verify_capacity: int, device: torch.device) -> "VerifyPlan":
        if verify_capacity <= 0:
            raise ValueError(
                f"kv-canary: VerifyPlan verify_capacity must be positive, got {verify_capacity}"
            )

        def e64():
            return torch.empty(verify_capacity, dtype=torch.int64, device=device)

        return cls(
            verify_slot_indices=e64(),
            verify_expected_tokens=e64(),
            verify_expected_positions=e64(),
            verify_prev_slot_indices=e64(),
            verify_num_valid=torch.empty(1, dtype=torch.int32, device=device),
            enable=torch.ones(1, dtype=torch.int32, device=device),
        )

    def zero_for_testing_(self) -> "VerifyPlan":
        self.verify_slot_indices.zero_()
        self.verify_expected_tokens.fill_(-1)
        self.verify_expected_positions.zero_()
        self.verify_prev_slot_indices.zero_()
        self.verify_num_valid.zero_()
        self.enable.zero_()
        return self


@dataclass(frozen=True, slots=True, kw_only=True)
class WritePlan:
    """Per-request write ranges and chain seeds (SGLang's fields)."""

    write_offsets: torch.Tensor
    write_seed_slot_indices: torch.Tensor
    write_num_valid_reqs: torch.Tensor

    @staticmethod
    def allocation_bytes(write_req_capacity: int) -> int:
        return (2 * write_req_capacity + 1) * torch.int64.itemsize + torch.int32.itemsize

    @classmethod
    def allocate(cls, *, write_req_capacity: int, device: torch.device) -> "WritePlan":
        if write_req_capacity <= 0:
            raise ValueError(
                "kv-canary: WritePlan write_req_capacity must be positive, got "
                f"{write_req_capacity}"
            )
        return cls(
            write_offsets=torch.empty(write_req_capacity + 1, dtype=torch.int64, device=device),
            write_seed_slot_indices=torch.empty(write_req_capacity, dtype=torch.int64,
                                                device=device),
            write_num_valid_reqs=torch.empty(1, dtype=torch.int32, device=device),
        )

    def zero_for_testing_(self) -> "WritePlan":
        self.write_offsets.zero_()
        self.write_seed_slot_indices.zero_()
        self.write_num_valid_reqs.zero_()
        return self


@dataclass(frozen=True, slots=True, kw_only=True)
class DigestContext:
    """Launch context of ``launch_kv_digest_verify`` (ours, not SGLang's; docs/spec.md §16): the
    per-slot KV digests int64 ``[num_slots]``, the launch tag stamped into the rows it records
    (an int in ``[0, 2**31)``, e.g. a :class:`CanaryLaunchTag`), the violation ring int64
    ``[cap, 8]`` and its write index int32 ``[1]`` (SGLang's ``ViolationLog`` may be passed: the
    rows are SGLang's 8 fields), and its own counters int64 ``[1]``. Any object with these fields
    is accepted by the launcher."""

    digest_buf: torch.Tensor
    kernel_kind: int
    violation_ring: torch.Tensor
    violation_write_index: torch.Tensor
    slot_run_counter: torch.Tensor
    kernel_run_counter: torch.Tensor

    @classmethod
    def allocate(cls, *, num_slots: int, device: torch.device, kernel_kind: int = 0,
                 ring_capacity: int = 1024) -> "DigestContext":
        """Zero-filled digests, ring and counters on ``device``."""
        return cls(
            digest_buf=torch.zeros(num_slots, dtype=torch.int64, device=device),
            kernel_kind=kernel_kind,
            violation_ring=torch.zeros(ring_capacity, VIOLATION_FIELDS, dtype=torch.int64,
                                       device=device),
            violation_write_index=torch.zeros(1, dtype=torch.int32, device=device),
            slot_run_counter=torch.zeros(1, dtype=torch.int64, device=device),
            kernel_run_counter=torch.zeros(1, dtype=torch.int64, device=device),
        )
