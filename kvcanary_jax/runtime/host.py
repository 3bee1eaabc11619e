"""Host side of the runtime: padding a scheduler's batch to the bucket, decoding the ring and the
counters. Nothing here traces or launches a device op."""

from __future__ import annotations

import dataclasses
import numbers
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
# Our reason bits, beside SGLang's FailReason (kvcanary_jax.consts).
_OUR_REASONS = ("PADDING_SLOT_NOT_ZERO", "KV_DIGEST_MISMATCH")


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
    same order, as SGLang's ForwardBatch).

    Raises ValueError, before anything is built, for lists that disagree (padding them would
    make the next correct step report false violations, or turn a request's token check off
    without a word). These rules are ours, SGLang's scheduler holds them by construction:

    * ``prefix_lens``, ``extend_seq_lens`` and ``all_ids`` have one entry per request, and
      ``positions``, ``out_cache_loc`` (and the ``expected_input_*`` lists when given) one per
      token of ``input_ids``; ``extend_seq_lens`` sum to the number of tokens;
    * ``req_pool_indices`` are distinct rows in ``[1, max_reqs)`` (row 0 is the padding row,
      whose token check is always off);
    * lengths are >= 0, every request's history ``all_ids[r]`` covers at least its
      ``prefix_lens[r] + extend_seq_lens[r]`` tokens (the positions verified now and next
      step), and at most ``context_len``;
    * ``out_cache_loc`` entries are slots in ``[0, num_slots)`` (a slot outside is never
      written, so never checked).
    """
    bs, nt = len(req_pool_indices), len(input_ids)
    if bs > cfg.max_bs or nt > cfg.max_tokens:
        raise ValueError(
            f"kv-canary runtime: batch of {bs} requests / {nt} tokens exceeds the bucket "
            f"({cfg.max_bs} / {cfg.max_tokens})"
        )
    _check_batch_lists(cfg, req_pool_indices=req_pool_indices, prefix_lens=prefix_lens,
                       extend_seq_lens=extend_seq_lens, all_ids=all_ids, input_ids=input_ids,
                       positions=positions, out_cache_loc=out_cache_loc,
                       expected_input_tokens=expected_input_tokens,
                       expected_input_positions=expected_input_positions)

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


def _ints(name: str, values) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1 or not (arr.size == 0 or np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"kv-canary runtime: make_batch {name} must be a 1-D list of ints, got shape "
                         f"{arr.shape} dtype {arr.dtype}")
    return arr.astype(np.int64)


def _check_batch_lists(cfg: CanaryConfig, **lists) -> None:
    """make_batch's rules (see its docstring)."""
    msg = "kv-canary runtime: make_batch"
    bs, nt = len(lists["req_pool_indices"]), len(lists["input_ids"])
    per_req = ("prefix_lens", "extend_seq_lens", "all_ids")
    per_tok = ("positions", "out_cache_loc", "expected_input_tokens", "expected_input_positions")
    for name in per_req + per_tok:
        if lists[name] is None:
            continue
        want, what = (bs, "req_pool_indices") if name in per_req else (nt, "input_ids")
        if len(lists[name]) != want:
            raise ValueError(f"{msg} {name} has {len(lists[name])} entries, {what} has {want}: "
                             "one entry per " + ("request" if name in per_req else "token"))
    arr = {n: _ints(n, lists[n]) for n in ("req_pool_indices", "prefix_lens", "extend_seq_lens",
                                           "input_ids", "positions", "out_cache_loc")}
    for n in ("expected_input_tokens", "expected_input_positions"):
        if lists[n] is not None:
            _ints(n, lists[n])
    rows = arr["req_pool_indices"]
    for r in range(bs):
        if not 1 <= rows[r] < cfg.max_reqs:
            raise ValueError(f"{msg} req_pool_indices[{r}] must be a row in [1, {cfg.max_reqs}) "
                             f"(row 0 is the padding row), got {rows[r]}")
    if np.unique(rows).shape[0] != bs:
        dup = next(int(x) for x in rows if (rows == x).sum() > 1)
        raise ValueError(f"{msg} req_pool_indices must be distinct, row {dup} appears twice or more")
    for name in ("prefix_lens", "extend_seq_lens"):
        neg = np.nonzero(arr[name] < 0)[0]
        if neg.size:
            raise ValueError(f"{msg} {name}[{neg[0]}] must be >= 0, got {arr[name][neg[0]]}")
    total = int(arr["extend_seq_lens"].sum())
    if total != nt:
        raise ValueError(f"{msg} extend_seq_lens sum to {total}, input_ids has {nt} tokens")
    for r, ids in enumerate(lists["all_ids"]):
        n = _ints(f"all_ids[{r}]", ids).shape[0]
        need = int(arr["prefix_lens"][r] + arr["extend_seq_lens"][r])
        if not need <= n <= cfg.context_len:
            raise ValueError(
                f"{msg} all_ids[{r}] has {n} token ids; a request's history covers its "
                f"prefix_lens + extend_seq_lens ({need}) and at most context_len "
                f"({cfg.context_len})")
    loc = arr["out_cache_loc"]
    bad = np.nonzero((loc < 0) | (loc >= cfg.num_slots))[0]
    if bad.size:
        raise ValueError(f"{msg} out_cache_loc[{bad[0]}] must be a slot in [0, {cfg.num_slots}), "
                         f"got {loc[bad[0]]}")


@dataclasses.dataclass(frozen=True)
class Violation:
    """One decoded ring row (docs/spec.md §3.2)."""

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
    """SGLang's FailReason names of ``bits``, then ours (``PADDING_SLOT_NOT_ZERO``,
    ``KV_DIGEST_MISMATCH``)."""
    names = tuple(r.name for r in consts.FailReason if bits & r)
    for name in _OUR_REASONS:
        if bits & getattr(consts, name):
            names += (name,)
    return names


def _check_start(start) -> None:
    if isinstance(start, bool) or not isinstance(start, numbers.Integral):
        raise TypeError(f"kv-canary runtime: start must be an int (a ring row), got "
                        f"{type(start).__name__} {start!r}")
    if start < 0:
        raise ValueError(f"kv-canary runtime: start must be a ring row >= 0, got {start}")


def _check_write_index(write_index: int) -> int:
    return check_write_index(write_index, "kv-canary runtime:")


def decode_ring(ring: np.ndarray, write_index: int, *, start: int = 0) -> list[Violation]:
    """Rows ``[start, min(write_index, ring capacity))`` of a violation ring, decoded. Raises
    ValueError for a negative ``start`` and RuntimeError for a negative ``write_index`` (see
    :func:`violation_count`)."""
    _check_start(start)
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
    _check_start(start)
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
