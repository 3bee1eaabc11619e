"""kv-canary constants, as SGLang 0.5.23 defines them (``consts`` and the verify module).

Values are part of the on-device ABI (canary slot layout, violation-record layout, fail-reason
bits), so they must equal SGLang's exactly; the tests compare them against the oracle.
"""

from __future__ import annotations

from enum import IntEnum, IntFlag
from typing import Final

__all__ = [
    "PADDING_SLOT_NOT_ZERO",
    "KV_DIGEST_MISMATCH",
    "MAX_DIGEST_SOURCES",
    "CANARY_CHAIN_ANCHOR",
    "REQ_POOL_IDX_PADDING",
    "TOKEN_TO_KV_SLOT_PADDING",
    "CANARY_FIELDS_PER_SLOT",
    "CANARY_FIELD_TOKEN",
    "CANARY_FIELD_POSITION",
    "CANARY_FIELD_PREV_HASH",
    "CANARY_FIELD_REAL_KV_HASH",
    "CANARY_SLOT_BYTES",
    "VIOLATION_FIELDS",
    "VIOLATION_FIELD_KERNEL_KIND",
    "VIOLATION_FIELD_SLOT_IDX",
    "VIOLATION_FIELD_POSITION",
    "VIOLATION_FIELD_STORED_TOKEN",
    "VIOLATION_FIELD_EXPECTED_TOKEN",
    "VIOLATION_FIELD_STORED_CHAIN_HASH",
    "VIOLATION_FIELD_EXPECTED_AUX",
    "VIOLATION_FIELD_FAIL_REASON_BITS",
    "VIOLATION_WRITE_INDEX_MAX",
    "MAX_REAL_KV_SOURCES",
    "REAL_KV_SOURCE_FIELDS_PER_ENTRY",
    "REAL_KV_SOURCE_FIELD_PAGE_SIZE",
    "REAL_KV_SOURCE_FIELD_NUM_BYTES_PER_TOKEN",
    "REAL_KV_SOURCE_FIELD_READ_BYTES",
    "FailReason",
    "RealKvHashMode",
    "CanaryLaunchTag",
]

CANARY_CHAIN_ANCHOR: Final[int] = 0xC0FFEE1234567890

REQ_POOL_IDX_PADDING: Final[int] = 0
# KV slot 0 takes padded tokens' dummy writes and is what a zero-initialised req_to_token holds, so
# verify never checks slot 0 and treats a predecessor 0 as "no chain check".
TOKEN_TO_KV_SLOT_PADDING: Final[int] = 0

CANARY_FIELDS_PER_SLOT: Final[int] = 4
CANARY_FIELD_TOKEN: Final[int] = 0
CANARY_FIELD_POSITION: Final[int] = 1
CANARY_FIELD_PREV_HASH: Final[int] = 2
CANARY_FIELD_REAL_KV_HASH: Final[int] = 3
CANARY_SLOT_BYTES: Final[int] = CANARY_FIELDS_PER_SLOT * 8

VIOLATION_FIELDS: Final[int] = 8
VIOLATION_FIELD_KERNEL_KIND: Final[int] = 0
VIOLATION_FIELD_SLOT_IDX: Final[int] = 1
VIOLATION_FIELD_POSITION: Final[int] = 2
VIOLATION_FIELD_STORED_TOKEN: Final[int] = 3
VIOLATION_FIELD_EXPECTED_TOKEN: Final[int] = 4
VIOLATION_FIELD_STORED_CHAIN_HASH: Final[int] = 5
VIOLATION_FIELD_EXPECTED_AUX: Final[int] = 6
VIOLATION_FIELD_FAIL_REASON_BITS: Final[int] = 7
# The write index is int32: it saturates here instead of wrapping to a negative value (which
# SGLang's kernels would then use as a row; see the ring guard in kvcanary_jax.ops._kernel_lib).
VIOLATION_WRITE_INDEX_MAX: Final[int] = 2**31 - 1

MAX_REAL_KV_SOURCES: Final[int] = 4
REAL_KV_SOURCE_FIELDS_PER_ENTRY: Final[int] = 3
REAL_KV_SOURCE_FIELD_PAGE_SIZE: Final[int] = 0
REAL_KV_SOURCE_FIELD_NUM_BYTES_PER_TOKEN: Final[int] = 1
REAL_KV_SOURCE_FIELD_READ_BYTES: Final[int] = 2


# Ours, not SGLang's (so not a FailReason member, which mirrors SGLang's enum exactly): the
# runtime's padding-slot guard (kvcanary_jax.runtime.manager) found a nonzero byte in slot 0 of
# the real KV. Its ring row: the SWEEP tag of the half and group, slot 0, position -1, and the
# count of nonzero bytes in the stored-token field.
PADDING_SLOT_NOT_ZERO: Final[int] = 1 << 16

# Ours, not SGLang's (docs/spec.md §16): digest_verify found a slot whose KV digest, recomputed
# from every source's bytes, differs from the one digest_write stored. Its ring row: the launch's
# kernel kind, the slot, the entry's position, 0, 0, the stored digest, the recomputed digest.
KV_DIGEST_MISMATCH: Final[int] = 1 << 17

# The most sources one digest launch takes (ours; one per layer and half of a large model, with
# room to spare). The count is static: every source is a separate buffer argument of the kernels.
MAX_DIGEST_SOURCES: Final[int] = 512


class FailReason(IntFlag):
    VERIFY_CHAIN_HASH_MISMATCH = 1 << 0
    VERIFY_POSITION_MISMATCH = 1 << 1
    VERIFY_REAL_KV_HASH_MISMATCH = 1 << 2
    WRITE_TOKEN_MISMATCH = 1 << 3
    WRITE_POSITION_MISMATCH = 1 << 4
    VERIFY_TOKEN_MISMATCH = 1 << 5


class RealKvHashMode(IntEnum):
    NONE = 0
    PARTIAL = 1
    ALL = 2


class CanaryLaunchTag(IntEnum):
    """One tag per (head | tail | sweep) x (K | V) x (FULL | SWA) launch; stamped into records."""

    HEAD_K_FULL = 0
    HEAD_V_FULL = 1
    TAIL_K_FULL = 2
    TAIL_V_FULL = 3
    SWEEP_K_FULL = 4
    SWEEP_V_FULL = 5
    HEAD_K_SWA = 6
    HEAD_V_SWA = 7
    TAIL_K_SWA = 8
    TAIL_V_SWA = 9
    SWEEP_K_SWA = 10
    SWEEP_V_SWA = 11
