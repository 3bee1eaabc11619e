"""Serving runtime: the canary's device state and one jitted step per forward batch.

This composes the four ops the way SGLang's serving loop does (spec §13):

* **HEAD** (before the model forward): scatter the batch's token ids into the expected-token
  pool, plan each buffer group, then verify the prefix slots and write the new slots into the
  HEAD canary buffers. HEAD endpoints carry no real-KV sources (the KV is not written yet).
* the model forward writes the real KV bytes;
* **TAIL** (after the forward): verify and write again with the same plans into the TAIL canary
  buffers, now fingerprinting the real KV bytes of every verified and written slot.
* **SWEEP** (every few steps, outside the forward): verify every cached prefix (radix-cache rows or
  live rows) against the TAIL buffers with the token check off.

All device state lives in one :class:`CanaryState` pytree with capacity-sized buffers, so every
step of a server reuses a single compilation per batch bucket; the jitted entry points donate the
state, so XLA updates the canary buffers, ring and counters in place.

Buffer groups: ``FULL`` always; ``SWA`` when ``swa_window_size > 0`` (its canary slots are SWA pool
slots, addressed through the full->SWA LUT of length ``num_slots``; evicted entries map to 0). Each
group has a K half and, if ``enable_v_half``, a V half, each in a HEAD and a TAIL copy.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvcanary_jax import _config
from kvcanary_jax.ops.scatter import scatter_req_token_ids
from kvcanary_jax.plans import VerifyPlan, WritePlan

__all__ = [
    "CanaryConfig",
    "CanaryState",
    "ForwardBatch",
    "Violation",
    "TAG_NAMES",
    "init_state",
    "enable_chain_assert",
    "make_batch",
    "kv_sources",
    "canary_step_head",
    "canary_step_tail",
    "make_canary_step",
    "canary_sweep",
    "read_violations",
    "decode_ring",
    "reason_names",
    "read_counters",
    "violation_count",
]

# CanaryLaunchTag order (spec §1); duplicated as names so decoding never needs the device modules.
TAG_NAMES = (
    "HEAD_K_FULL", "HEAD_V_FULL", "TAIL_K_FULL", "TAIL_V_FULL", "SWEEP_K_FULL", "SWEEP_V_FULL",
    "HEAD_K_SWA", "HEAD_V_SWA", "TAIL_K_SWA", "TAIL_V_SWA", "SWEEP_K_SWA", "SWEEP_V_SWA",
)
_NUM_TAGS = len(TAG_NAMES)
_FAIL_REASON_NAMES = (
    (1, "VERIFY_CHAIN_HASH_MISMATCH"),
    (2, "VERIFY_POSITION_MISMATCH"),
    (4, "VERIFY_REAL_KV_HASH_MISMATCH"),
    (8, "WRITE_TOKEN_MISMATCH"),
    (16, "WRITE_POSITION_MISMATCH"),
    (32, "VERIFY_TOKEN_MISMATCH"),
)
_HASH_MODES = {"none": 0, "partial": 1, "all": 2}
CANARY_SLOT_BYTES = 32
VIOLATION_FIELDS = 8


def _api():
    """The device ops, imported at first trace (the step only exists once they do)."""
    from kvcanary_jax import consts, context
    from kvcanary_jax.ops import plan, verify, write

    return consts, context, plan.canary_plan, write.canary_write, verify.canary_verify


def _with_interpret(fn, interpret):
    if interpret is not None and "interpret" in inspect.signature(fn).parameters:
        return functools.partial(fn, interpret=interpret)
    return fn


# --------------------------------------------------------------------------------------------
# Configuration (static, hashable: part of the jit cache key)
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class CanaryConfig:
    """Sizes taken from the server's limits; everything is capacity-sized and fixed.

    ``max_reqs``: rows of ``req_to_token`` (row 0 is the padding row). ``context_len``: its
    columns. ``num_slots``: full KV pool slots (slot 0 is the dummy slot). ``max_bs`` and
    ``max_tokens``: the batch bucket (requests, flat tokens) every step is padded to.
    ``verify_capacity`` defaults to SGLang's 3 x pool slots, capped at what a batch can ask
    for (``max_bs * context_len``); ``write_req_capacity`` to ``max(max_bs, max_reqs)``.
    ``swa_window_size > 0`` adds the SWA group with ``swa_num_slots`` canary slots.
    """

    max_reqs: int
    context_len: int
    num_slots: int
    max_bs: int
    max_tokens: int
    verify_capacity: int | None = None
    write_req_capacity: int | None = None
    sweep_rows: int | None = None
    ring_capacity: int = 1024
    swa_window_size: int = 0
    swa_num_slots: int = 0
    enable_v_half: bool = False
    real_kv_hash_mode: str = "all"
    enable_verify_token_assert: bool = True
    enable_write_input_assert: bool = True
    kv_token_id_vs_position_offset: int = 0
    interpret: bool | None = None

    def __post_init__(self):
        if self.swa_window_size > 0 and self.swa_num_slots <= 0:
            raise ValueError("kv-canary runtime: an SWA group needs swa_num_slots > 0")
        if self.real_kv_hash_mode not in _HASH_MODES:
            raise ValueError(f"kv-canary runtime: unknown real_kv_hash_mode {self.real_kv_hash_mode!r}")

    @property
    def groups(self) -> tuple[str, ...]:
        return ("FULL", "SWA") if self.swa_window_size > 0 else ("FULL",)

    @property
    def halves(self) -> tuple[str, ...]:
        return ("K", "V") if self.enable_v_half else ("K",)

    @property
    def verify_cap(self) -> int:
        if self.verify_capacity is not None:
            return self.verify_capacity
        return max(1, min(3 * self.num_slots, self.max_bs * self.context_len))

    @property
    def write_cap(self) -> int:
        return self.write_req_capacity or max(self.max_bs, self.max_reqs)

    @property
    def sweep_cap_rows(self) -> int:
        return self.sweep_rows or self.max_reqs

    def group_slots(self, group: str) -> int:
        return self.num_slots if group == "FULL" else self.swa_num_slots

    def window(self, group: str) -> int:
        return self.swa_window_size if group == "SWA" else 0


def _tag(copy: str, half: str, group: str) -> int:
    return TAG_NAMES.index(f"{copy}_{half}_{group}")


# --------------------------------------------------------------------------------------------
# Device state
# --------------------------------------------------------------------------------------------


def _pytree(cls):
    fields = [f.name for f in dataclasses.fields(cls)]
    return jax.tree_util.register_dataclass(cls, data_fields=fields, meta_fields=[])


@_pytree
@dataclasses.dataclass(frozen=True, kw_only=True)
class CanaryState:
    """Everything the canary keeps on the device between steps.

    ``bufs``: canary buffers, uint8 ``[slots, 32]``, keyed ``"{HEAD|TAIL}_{K|V}_{FULL|SWA}"``.
    ``plans``: per group the (VerifyPlan, WritePlan) built by HEAD and reused by TAIL.
    ``slot_run_counters`` / ``kernel_run_counters``: int64 ``[12]`` indexed by launch tag.
    ``expected_tokens``: int32 ``[max_reqs, context_len]`` expected-token pool and
    ``expected_valid_lens`` int64 ``[max_reqs]`` (tokens known per row).
    """

    bufs: dict
    plans: dict
    violation_ring: jax.Array
    violation_write_index: jax.Array
    slot_run_counters: jax.Array
    kernel_run_counters: jax.Array
    expected_tokens: jax.Array
    expected_valid_lens: jax.Array
    enable_chain_position_assert: jax.Array


@_config.with_x64
def init_state(cfg: CanaryConfig, *, chain_position_assert: bool = True, device=None) -> CanaryState:
    """Zero-filled state sized from ``cfg``. The chain-position flag starts at 1 unless the
    caller still has warm-up / capture steps to run (then flip it with ``enable_chain_assert``)."""
    put = lambda x: jax.device_put(x, device)  # noqa: E731
    bufs = {}
    for group in cfg.groups:
        for copy in ("HEAD", "TAIL"):
            for half in cfg.halves:
                bufs[f"{copy}_{half}_{group}"] = put(
                    jnp.zeros((cfg.group_slots(group), CANARY_SLOT_BYTES), jnp.uint8)
                )
    plans = {
        g: (
            VerifyPlan.allocate(verify_capacity=cfg.verify_cap, device=device),
            WritePlan.allocate(write_req_capacity=cfg.write_cap, device=device),
        )
        for g in cfg.groups
    }
    return CanaryState(
        bufs=bufs,
        plans=plans,
        violation_ring=put(jnp.zeros((cfg.ring_capacity, VIOLATION_FIELDS), jnp.int64)),
        violation_write_index=put(jnp.zeros((1,), jnp.int32)),
        slot_run_counters=put(jnp.zeros((_NUM_TAGS,), jnp.int64)),
        kernel_run_counters=put(jnp.zeros((_NUM_TAGS,), jnp.int64)),
        expected_tokens=put(jnp.zeros((cfg.max_reqs, cfg.context_len), jnp.int32)),
        expected_valid_lens=put(jnp.zeros((cfg.max_reqs,), jnp.int64)),
        enable_chain_position_assert=put(jnp.full((1,), int(chain_position_assert), jnp.int32)),
    )


def enable_chain_assert(state: CanaryState, on: bool = True) -> CanaryState:
    """SGLang's ``mark_init_finished``: the flag is 0 during warm-up / graph capture."""
    return dataclasses.replace(
        state, enable_chain_position_assert=jnp.full((1,), int(on), jnp.int32)
    )


# --------------------------------------------------------------------------------------------
# Forward batch (host-built, padded to the config's bucket)
# --------------------------------------------------------------------------------------------


@_pytree
@dataclasses.dataclass(frozen=True, kw_only=True)
class ForwardBatch:
    """One forward pass, padded to ``max_bs`` requests and ``max_tokens`` flat tokens.

    Padding rows have ``req_pool_indices == 0``; padding tokens have ``out_cache_loc == -1``
    (never written). ``all_ids_flat`` / ``all_ids_offsets`` are each request's prompt + output
    ids (the expected-token snapshot; its per-request length is the plan's ``valid_lens``).
    """

    req_pool_indices: jax.Array  # int64 [max_bs]
    prefix_lens: jax.Array  # int64 [max_bs]
    extend_seq_lens: jax.Array  # int64 [max_bs]
    all_ids_flat: jax.Array  # int64 [max_bs * context_len]
    all_ids_offsets: jax.Array  # int64 [max_bs + 1]
    input_ids: jax.Array  # int64 [max_tokens]
    positions: jax.Array  # int64 [max_tokens]
    out_cache_loc: jax.Array  # int64 [max_tokens]
    expected_input_tokens: jax.Array  # int64 [max_tokens]
    expected_input_positions: jax.Array  # int64 [max_tokens]


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


# --------------------------------------------------------------------------------------------
# The step
# --------------------------------------------------------------------------------------------


def kv_sources(kv: Sequence[jax.Array] | None, *, read_bytes: int | None = None):
    """Real-KV sources over 2-D KV arrays ``[slots, width]`` of any dtype (bf16 in the demo),
    viewed as bytes: one slot per row, page size 1."""
    if not kv:
        return ()
    _, context, *_ = _api()
    out = []
    for arr in kv:
        b = arr if arr.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(arr, jnp.uint8)
        b = b.reshape(arr.shape[0], -1)
        nbytes = int(b.shape[1])
        out.append(
            context.RealKvSource(
                tensor=b, page_size=1, num_bytes_per_token=nbytes,
                read_bytes=nbytes if read_bytes is None else read_bytes,
            )
        )
    return tuple(out)


def _context(cfg, state, buf_key, tag, sources):
    consts, context, *_ = _api()
    mode = _HASH_MODES[cfg.real_kv_hash_mode] if sources else 0
    return context.VerifyOrWriteContext(
        canary_buf=state.bufs[buf_key],
        kernel_kind=consts.CanaryLaunchTag(tag),
        violation_ring=state.violation_ring,
        violation_write_index=state.violation_write_index,
        slot_run_counter=state.slot_run_counters[tag : tag + 1],
        kernel_run_counter=state.kernel_run_counters[tag : tag + 1],
        real_kv_sources=tuple(sources),
        real_kv_hash_mode=consts.RealKvHashMode(mode),
        enable_chain_position_assert=state.enable_chain_position_assert,
    )


def _absorb(state, ctx, buf_key, tag):
    bufs = dict(state.bufs)
    bufs[buf_key] = ctx.canary_buf
    return dataclasses.replace(
        state,
        bufs=bufs,
        violation_ring=ctx.violation_ring,
        violation_write_index=ctx.violation_write_index,
        slot_run_counters=state.slot_run_counters.at[tag].set(ctx.slot_run_counter[0]),
        kernel_run_counters=state.kernel_run_counters.at[tag].set(ctx.kernel_run_counter[0]),
    )


def _translate(cfg, group, loc, lut):
    """Full-pool slots -> the group's canary slots (negative = skip, passes through)."""
    if group == "FULL":
        return loc
    safe = jnp.clip(loc, 0, lut.shape[0] - 1)
    return jnp.where(loc < 0, loc, lut[safe])


def _verify_then_write(cfg, state, batch, group, copy, sources_by_half, lut):
    _, _, _, canary_write, canary_verify = _api()
    canary_write = _with_interpret(canary_write, cfg.interpret)
    canary_verify = _with_interpret(canary_verify, cfg.interpret)
    vplan, wplan = state.plans[group]
    loc = _translate(cfg, group, batch.out_cache_loc, lut)
    for half in cfg.halves:
        key, tag = f"{copy}_{half}_{group}", _tag(copy, half, group)
        srcs = sources_by_half.get(half, ())
        ctx = canary_verify(
            context=_context(cfg, state, key, tag, srcs),
            plan=vplan,
            check_verify_expected_token=cfg.enable_verify_token_assert,
        )
        state = _absorb(state, ctx, key, tag)
        assert_inputs = cfg.enable_write_input_assert
        ctx = canary_write(
            context=_context(cfg, state, key, tag, srcs),
            plan=wplan,
            input_ids=batch.input_ids,
            positions=batch.positions,
            out_cache_loc=loc,
            enable_write_input_assert=assert_inputs,
            expected_input_tokens=batch.expected_input_tokens if assert_inputs else None,
            expected_input_positions=batch.expected_input_positions if assert_inputs else None,
        )
        state = _absorb(state, ctx, key, tag)
    return state


def _head_impl(cfg, state, batch, req_to_token, lut):
    _, _, canary_plan, _, _ = _api()
    canary_plan = _with_interpret(canary_plan, cfg.interpret)
    valid_lens = batch.all_ids_offsets[1:] - batch.all_ids_offsets[:-1]
    pool = None
    if cfg.enable_verify_token_assert:
        pool = scatter_req_token_ids(
            flat_in=batch.all_ids_flat,
            offsets=batch.all_ids_offsets,
            req_pool_indices=batch.req_pool_indices,
            pool_out=state.expected_tokens,
            interpret=cfg.interpret,
        )
        rows = batch.req_pool_indices
        # Padding rows point at row 0 with length 0; keep row 0 at 0 whatever order they land.
        lens = state.expected_valid_lens.at[rows].set(jnp.where(rows != 0, valid_lens, 0))
        state = dataclasses.replace(state, expected_tokens=pool, expected_valid_lens=lens)
    plans = dict(state.plans)
    for group in cfg.groups:
        vplan, wplan = canary_plan(
            verify_plan_out=plans[group][0],
            write_plan_out=plans[group][1],
            req_pool_indices=batch.req_pool_indices,
            prefix_lens=batch.prefix_lens,
            extend_seq_lens=batch.extend_seq_lens,
            req_to_token=req_to_token,
            swa_window_size=cfg.window(group),
            full_to_swa_index_mapping=lut if group == "SWA" else None,
            verify_capacity=cfg.verify_cap,
            req_to_verify_expected_tokens=pool,
            req_to_verify_expected_tokens_valid_lens=valid_lens if pool is not None else None,
            kv_token_id_vs_position_offset=cfg.kv_token_id_vs_position_offset,
        )
        plans[group] = (vplan, wplan)
    state = dataclasses.replace(state, plans=plans)
    for group in cfg.groups:
        state = _verify_then_write(cfg, state, batch, group, "HEAD", {}, lut)
    return state


def _as_kv_dict(cfg, kv):
    """Accept ``{"FULL": {"K": [arrays], "V": [arrays]}, ...}`` or ``{"FULL": ([K], [V])}``."""
    out = {}
    for g in cfg.groups:
        entry = kv[g]
        if isinstance(entry, Mapping):
            out[g] = {h: tuple(entry[h]) for h in cfg.halves}
        else:
            out[g] = {h: tuple(entry[i]) for i, h in enumerate(("K", "V")) if h in cfg.halves}
    return out


def _tail_impl(cfg, state, batch, lut, kv):
    kv = _as_kv_dict(cfg, kv)
    for group in cfg.groups:
        srcs = {h: kv_sources(kv[group][h]) for h in cfg.halves}
        state = _verify_then_write(cfg, state, batch, group, "TAIL", srcs, lut)
    return state


def _sweep_impl(cfg, state, rows_table, row_indices, lengths, lut, kv):
    _, _, canary_plan, _, canary_verify = _api()
    canary_plan = _with_interpret(canary_plan, cfg.interpret)
    canary_verify = _with_interpret(canary_verify, cfg.interpret)
    kv = _as_kv_dict(cfg, kv)
    n = row_indices.shape[0]
    cap = max(1, n * rows_table.shape[1])
    for group in cfg.groups:
        vplan, _ = canary_plan(
            verify_plan_out=VerifyPlan.allocate(verify_capacity=cap),
            write_plan_out=WritePlan.allocate(write_req_capacity=n),
            req_pool_indices=row_indices,
            prefix_lens=lengths,
            extend_seq_lens=jnp.zeros_like(lengths),
            req_to_token=rows_table,
            swa_window_size=cfg.window(group),
            full_to_swa_index_mapping=lut if group == "SWA" else None,
            verify_capacity=cap,
            req_to_verify_expected_tokens=None,
            req_to_verify_expected_tokens_valid_lens=None,
            kv_token_id_vs_position_offset=0,
        )
        for half in cfg.halves:
            tag = _tag("SWEEP", half, group)
            key = f"TAIL_{half}_{group}"  # SWEEP endpoints read the TAIL buffers
            ctx = canary_verify(
                context=_context(cfg, state, key, tag, kv_sources(kv[group][half])),
                plan=vplan,
                check_verify_expected_token=False,
            )
            state = _absorb(state, ctx, key, tag)
    return state


def _lut_or_dummy(lut):
    return jnp.zeros((1,), jnp.int64) if lut is None else lut


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("state",))
def _head_jit(state, batch, req_to_token, lut, *, cfg):
    return _head_impl(cfg, state, batch, req_to_token, lut)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("state",))
def _tail_jit(state, batch, lut, kv, *, cfg):
    return _tail_impl(cfg, state, batch, lut, kv)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("state",))
def _sweep_jit(state, rows_table, row_indices, lengths, lut, kv, *, cfg):
    return _sweep_impl(cfg, state, rows_table, row_indices, lengths, lut, kv)


@_config.with_x64
def canary_step_head(cfg: CanaryConfig, state: CanaryState, batch: ForwardBatch, *,
                     req_to_token: jax.Array, lut: jax.Array | None = None) -> CanaryState:
    """Before the model forward: scatter expected tokens, plan every group, HEAD verify + write.
    ``state`` is donated (do not reuse the argument)."""
    return _head_jit(state, batch, req_to_token, _lut_or_dummy(lut), cfg=cfg)


@_config.with_x64
def canary_step_tail(cfg: CanaryConfig, state: CanaryState, batch: ForwardBatch, *, kv,
                     lut: jax.Array | None = None) -> CanaryState:
    """After the model forward: TAIL verify + write with the plans HEAD built, fingerprinting
    ``kv`` (``{"FULL": {"K": [arrays], "V": [arrays]}, "SWA": ...}``, rows = the group's slots)."""
    return _tail_jit(state, batch, _lut_or_dummy(lut), kv, cfg=cfg)


def make_canary_step(cfg: CanaryConfig, forward: Callable):
    """One jitted function for HEAD -> ``forward`` -> TAIL.

    ``forward(kv, batch, req_to_token, lut) -> kv`` is the model forward (it writes the real KV of
    ``batch.out_cache_loc``). Returns ``step(state, kv, batch, req_to_token, lut) -> (state, kv)``
    with the state and the KV donated.
    """

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def _step(state, kv, batch, req_to_token, lut):
        state = _head_impl(cfg, state, batch, req_to_token, lut)
        kv = forward(kv, batch, req_to_token, lut)
        state = _tail_impl(cfg, state, batch, lut, kv)
        return state, kv

    @_config.with_x64
    def step(state, kv, batch, req_to_token, lut=None):
        return _step(state, kv, batch, req_to_token, _lut_or_dummy(lut))

    step.jitted = _step
    return step


@_config.with_x64
def canary_sweep(cfg: CanaryConfig, state: CanaryState, *, rows_table: jax.Array,
                 row_indices: jax.Array, lengths: jax.Array, kv,
                 lut: jax.Array | None = None) -> CanaryState:
    """Verify every listed prefix against the TAIL buffers (SWEEP tags, token check off).

    ``rows_table`` is an int32 slot table shaped like ``req_to_token`` (the live pool itself, or
    rows built from a radix-cache walk); ``row_indices`` int64 ``[n]`` selects rows (0 = unused
    entry) and ``lengths`` int64 ``[n]`` how many leading slots of each row are cached. Keep ``n``
    fixed across calls so the sweep compiles once.
    """
    return _sweep_jit(state, rows_table, row_indices, lengths, _lut_or_dummy(lut), kv, cfg=cfg)


# --------------------------------------------------------------------------------------------
# Host side: decoding the ring and the counters
# --------------------------------------------------------------------------------------------


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
    return tuple(name for bit, name in _FAIL_REASON_NAMES if bits & bit)


def decode_ring(ring: np.ndarray, write_index: int, *, start: int = 0) -> list[Violation]:
    ring = np.asarray(ring)
    out = []
    for i in range(start, min(int(write_index), ring.shape[0])):
        kind, slot, pos, tok, exp_tok, chain, aux, bits = (int(x) for x in ring[i])
        tag = TAG_NAMES[kind] if 0 <= kind < _NUM_TAGS else f"UNKNOWN_{kind}"
        parts = tag.split("_")
        out.append(
            Violation(
                index=i, tag=tag, phase=parts[0], half=parts[1] if len(parts) > 1 else "?",
                group=parts[2] if len(parts) > 2 else "?",
                op="write" if bits & (8 | 16) else "verify",
                slot=slot, position=pos, stored_token=tok, expected_token=exp_tok,
                stored_chain_hash=chain, expected_aux=aux, reason_bits=bits,
                reasons=reason_names(bits),
            )
        )
    return out


def violation_count(state: CanaryState) -> int:
    """Violations ever recorded (including ones dropped past the ring's capacity)."""
    return int(np.asarray(state.violation_write_index)[0])


def read_violations(state: CanaryState, *, start: int = 0) -> list[Violation]:
    """Copy the ring to the host and decode the rows from ``start`` on."""
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
