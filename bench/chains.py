"""Host-side (numpy) canary chains for benchmark inputs: many chains advanced in lockstep."""

from __future__ import annotations

import numpy as np

ANCHOR = np.uint64(0xC0FFEE1234567890)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def splitmix64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint64)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def mix3(a, b, c) -> np.ndarray:
    return splitmix64(splitmix64(splitmix64(a) ^ b.astype(np.uint64)) ^ c.astype(np.uint64))


def build(num_chains: int, length: int, num_slots: int, rng) -> dict:
    """``num_chains`` chains of ``length`` slots each at random distinct slots (never slot 0),
    with the canary rows a clean write would store. Returns the canary buffer (``canary_buf``,
    uint8 ``[num_slots, 32]``) and the verify plan's entry arrays in chain order (``entries``,
    named as :data:`kvcanary_jax.testing.cases.VERIFY_ENTRY_FIELDS`)."""
    n = num_chains * length
    slots = (rng.permutation(num_slots - 1)[:n] + 1).astype(np.int64).reshape(num_chains, length)
    tokens = rng.integers(0, 1 << 20, (num_chains, length)).astype(np.int64)
    positions = np.broadcast_to(np.arange(length, dtype=np.int64), (num_chains, length))
    prev_hash = np.empty((num_chains, length), np.uint64)
    h = np.full(num_chains, splitmix64(np.array([ANCHOR]))[0], np.uint64)
    for j in range(length):
        prev_hash[:, j] = h
        h = mix3(h, tokens[:, j], positions[:, j])
    rows = np.zeros((num_slots, 4), np.int64)
    rows[slots, 0] = tokens
    rows[slots, 1] = positions
    rows[slots, 2] = prev_hash.view(np.int64)
    prev = np.concatenate([np.full((num_chains, 1), -1, np.int64), slots[:, :-1]], axis=1)
    return {
        "canary_buf": rows.view(np.uint8).reshape(num_slots, 32),
        "entries": dict(verify_slot_indices=slots.reshape(-1),
                        verify_expected_tokens=tokens.reshape(-1),
                        verify_expected_positions=np.ascontiguousarray(positions).reshape(-1),
                        verify_prev_slot_indices=prev.reshape(-1)),
    }
