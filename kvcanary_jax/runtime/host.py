"""Host side of the runtime: padding a scheduler's batch to the bucket, decoding the ring and the
counters. Nothing here traces or launches a device op."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from kvcanary_jax import _config, consts
from kvcanary_jax.context import check_write_index
from kvcanary_jax.runtime.state import CanaryConfig, CanaryState, ForwardBatch

__all__ = [
    "TAG_NAMES",
    "make_batch",
    "Violation",
    "reason_names",
    "decode_ring",
    "violation_count",
    "read_violations",
    "read_counters",
]

# Launch tags by index (the ring's kernel-kind field).
TAG_NAMES = tuple(t.name for t in consts.CanaryLaunchTag)

_WRITE_REASONS = consts.FailReason.WRITE_TOKEN_MISMATCH | consts.FailReason.WRITE_POSITION_MISMATCH


def make_batch(
    cfg: CanaryConfig,
    *,
    req_pool_indices: Sequence[int],
    prefix_lens: Sequence[int],
    extend_seq_lens: Sequence[int],
    all_ids: Sequence[Sequence[int]],
    input_ids: Sequence[int],
    positions: Sequence[int],
    out_cache_loc: Sequence[int],
    expected_input_tokens: Sequence[int] | None = None,
    expected_input_positions: Sequence[int] | None = None,
    as_numpy: bool = False,
) -> ForwardBatch:
    """Pad host lists to the config's bucket (requests in batch order, tokens concatenated in the
    same order, as SGLang's ForwardBatch)."""
    bs, nt = len(req_pool_indices), len(input_ids)
    if bs > cfg.max_bs or nt > cfg.max_tokens:
        raise ValueError(
            f"kv-canary runtime: batch of {bs} requests / {nt} tokens exceeds the bucket "
            f"({cfg.max_bs} / {cfg.max_tokens})"
        )

    def pad(vals, n, fill=0):
        out = np.full((n,), fill, np.int64)
        out[: len(vals)] = np.asarray(vals, np.int64).reshape(-1)
        return out

    lens = [len(a) for a in all_ids]
    flat = np.concatenate([np.asarray(a, np.int64).reshape(-1) for a in all_ids]) if bs else []
    offsets = np.zeros((cfg.max_bs + 1,), np.int64)
    offsets[1 : bs + 1] = np.cumsum(lens)
    offsets[bs + 1 :] = offsets[bs]
    fields = dict(
        req_pool_indices=pad(req_pool_indices, cfg.max_bs),
        prefix_lens=pad(prefix_lens, cfg.max_bs),
        extend_seq_lens=pad(extend_seq_lens, cfg.max_bs),
        all_ids_flat=pad(flat, cfg.max_bs * cfg.context_len),
        all_ids_offsets=offsets,
        input_ids=pad(input_ids, cfg.max_tokens),
        positions=pad(positions, cfg.max_tokens),
        out_cache_loc=pad(out_cache_loc, cfg.max_tokens, -1),
        expected_input_tokens=pad(
            input_ids if expected_input_tokens is None else expected_input_tokens, cfg.max_tokens
        ),
        expected_input_positions=pad(
            positions if expected_input_positions is None else expected_input_positions,
            cfg.max_tokens,
        ),
    )
    if as_numpy:
        return ForwardBatch(**fields)
    with _config.x64_scope():
        return ForwardBatch(**{k: jnp.asarray(v) for k, v in fields.items()})


@dataclasses.dataclass(frozen=True)
class Violation:
    """One decoded ring row (spec §3.2)."""

    index: int
    tag: str
    phase: str  # HEAD / TAIL / SWEEP
    half: str  # K / V
    group: str  # FULL / SWA
    op: str  # verify / write
    slot: int
    position: int
    stored_token: int
    expected_token: int
    stored_chain_hash: int
    expected_aux: int
    reason_bits: int
    reasons: tuple[str, ...]

    def __str__(self) -> str:
        return (
            f"[{self.index}] {self.tag} {self.op} slot={self.slot} pos={self.position} "
            f"token={self.stored_token} expected={self.expected_token} "
            f"reasons={'|'.join(self.reasons)}"
        )


def reason_names(bits: int) -> tuple[str, ...]:
    """SGLang's FailReason names of ``bits``, then ours (``PADDING_SLOT_NOT_ZERO``)."""
    names = tuple(r.name for r in consts.FailReason if bits & r)
    if bits & consts.PADDING_SLOT_NOT_ZERO:
        names += ("PADDING_SLOT_NOT_ZERO",)
    return names


def _check_write_index(write_index: int) -> int:
    return check_write_index(write_index, "kv-canary runtime:")


def decode_ring(ring: np.ndarray, write_index: int, *, start: int = 0) -> list[Violation]:
    """Rows ``[start, min(write_index, ring capacity))`` of a violation ring, decoded. Raises
    ValueError for a negative ``start`` and RuntimeError for a negative ``write_index`` (see
    :func:`violation_count`)."""
    if int(start) < 0:
        raise ValueError(f"kv-canary runtime: start must be a ring row >= 0, got {start}")
    write_index = _check_write_index(write_index)
    ring = np.asarray(ring)
    out = []
    for i in range(start, min(int(write_index), ring.shape[0])):
        kind, slot, pos, tok, exp_tok, chain, aux, bits = (int(x) for x in ring[i])
        tag = TAG_NAMES[kind] if 0 <= kind < len(TAG_NAMES) else f"UNKNOWN_{kind}"
        parts = tag.split("_")
        out.append(
            Violation(
                index=i, tag=tag, phase=parts[0], half=parts[1] if len(parts) > 1 else "?",
                group=parts[2] if len(parts) > 2 else "?",
                op="write" if bits & _WRITE_REASONS else "verify",
                slot=slot, position=pos, stored_token=tok, expected_token=exp_tok,
                stored_chain_hash=chain, expected_aux=aux, reason_bits=bits,
                reasons=reason_names(bits),
            )
        )
    return out


def violation_count(state: CanaryState) -> int:
    """Violations ever recorded (including ones dropped past the ring's capacity; the count
    saturates at 2**31 - 1).

    Raises RuntimeError when ``violation_write_index`` is negative: only something writing over
    the canary's own state can make it so, and while it stays negative no launch records a
    violation (the ring guard), so reading it as "no violation" would hide exactly that."""
    return _check_write_index(np.asarray(state.violation_write_index)[0])


def read_violations(state: CanaryState, *, start: int = 0) -> list[Violation]:
    """Copy the ring to the host and decode the rows from ``start`` (a row index >= 0) on.
    Raises as :func:`violation_count` and :func:`decode_ring`."""
    if int(start) < 0:
        raise ValueError(f"kv-canary runtime: start must be a ring row >= 0, got {start}")
    return decode_ring(np.asarray(state.violation_ring), violation_count(state), start=start)


def read_counters(state: CanaryState) -> dict[str, dict[str, int]]:
    """Per launch tag: kernel runs and slot runs (tags never launched are omitted)."""
    k = np.asarray(state.kernel_run_counters)
    s = np.asarray(state.slot_run_counters)
    return {
        name: {"kernel_runs": int(k[i]), "slot_runs": int(s[i])}
        for i, name in enumerate(TAG_NAMES)
        if k[i] or s[i]
    }
