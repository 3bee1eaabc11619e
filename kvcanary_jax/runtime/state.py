"""The canary's configuration and device state, and the padded batch a step consumes.

:class:`CanaryConfig` sizes everything from the server's limits (static and hashable: part of the
jit cache key). :class:`CanaryState` is one pytree with capacity-sized buffers, so every step of a
server reuses a single compilation per batch bucket. :class:`ForwardBatch` is one forward pass,
padded on the host (:func:`kvcanary_jax.runtime.host.make_batch`) to the config's bucket.

Buffer groups: ``FULL`` always; ``SWA`` when ``swa_window_size > 0`` (its canary slots are SWA pool
slots, addressed through the full->SWA LUT of length ``num_slots``; evicted entries map to 0). Each
group has a K half and, if ``enable_v_half``, a V half, each in a HEAD and a TAIL copy.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvcanary_jax import _config, consts
from kvcanary_jax.ops._registry import IMPLEMENTATIONS
from kvcanary_jax.plans import VerifyPlan, WritePlan

__all__ = [
    "CanaryConfig",
    "CanaryState",
    "ForwardBatch",
    "init_state",
    "enable_chain_assert",
    "tag",
]

_HASH_MODES = tuple(m.name.lower() for m in consts.RealKvHashMode)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CanaryConfig:
    """Sizes taken from the server's limits; everything is capacity-sized and fixed.

    ``max_reqs``: rows of ``req_to_token`` (row 0 is the padding row). ``context_len``: its
    columns. ``num_slots``: full KV pool slots (slot 0 is the dummy slot). ``max_bs`` and
    ``max_tokens``: the batch bucket (requests, flat tokens) every step is padded to.
    ``verify_capacity`` defaults to SGLang's 3 x pool slots, capped at what a batch can ask
    for (``max_bs * context_len``); ``write_req_capacity`` to ``max(max_bs, max_reqs)``.
    ``swa_window_size > 0`` adds the SWA group with ``swa_num_slots`` canary slots.
    ``real_kv_hash_mode``: ``"none"``, ``"partial"`` or ``"all"``. ``implementation``: what every
    op of the step runs (``"xla"``, ``"pallas_triton"``, ...; default: the platform's, see
    :mod:`kvcanary_jax.ops._registry`).
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
    implementation: str | None = None

    def __post_init__(self):
        if self.swa_window_size > 0 and self.swa_num_slots <= 0:
            raise ValueError("kv-canary runtime: an SWA group needs swa_num_slots > 0")
        if self.real_kv_hash_mode not in _HASH_MODES:
            raise ValueError(
                f"kv-canary runtime: unknown real_kv_hash_mode {self.real_kv_hash_mode!r}")
        if self.implementation is not None and self.implementation not in IMPLEMENTATIONS:
            raise ValueError(f"kv-canary runtime: unknown implementation {self.implementation!r};"
                             f" known: {', '.join(IMPLEMENTATIONS)}")

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

    @property
    def hash_mode(self) -> consts.RealKvHashMode:
        return consts.RealKvHashMode[self.real_kv_hash_mode.upper()]

    def group_slots(self, group: str) -> int:
        return self.num_slots if group == "FULL" else self.swa_num_slots

    def window(self, group: str) -> int:
        return self.swa_window_size if group == "SWA" else 0


def tag(copy: str, half: str, group: str) -> consts.CanaryLaunchTag:
    """The launch tag of ``{HEAD|TAIL|SWEEP}_{K|V}_{FULL|SWA}``."""
    return consts.CanaryLaunchTag[f"{copy}_{half}_{group}"]


@jax.tree_util.register_dataclass
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
def init_state(cfg: CanaryConfig, *, chain_position_assert: bool = True,
               device=None) -> CanaryState:
    """Zero-filled state sized from ``cfg``. The chain-position flag starts at 1 unless the
    caller still has warm-up / capture steps to run (then flip it with ``enable_chain_assert``)."""
    put = lambda x: jax.device_put(x, device)  # noqa: E731
    num_tags = len(consts.CanaryLaunchTag)
    bufs = {}
    for group in cfg.groups:
        for copy in ("HEAD", "TAIL"):
            for half in cfg.halves:
                bufs[f"{copy}_{half}_{group}"] = put(
                    jnp.zeros((cfg.group_slots(group), consts.CANARY_SLOT_BYTES), jnp.uint8)
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
        violation_ring=put(jnp.zeros((cfg.ring_capacity, consts.VIOLATION_FIELDS), jnp.int64)),
        violation_write_index=put(jnp.zeros((1,), jnp.int32)),
        slot_run_counters=put(jnp.zeros((num_tags,), jnp.int64)),
        kernel_run_counters=put(jnp.zeros((num_tags,), jnp.int64)),
        expected_tokens=put(jnp.zeros((cfg.max_reqs, cfg.context_len), jnp.int32)),
        expected_valid_lens=put(jnp.zeros((cfg.max_reqs,), jnp.int64)),
        enable_chain_position_assert=put(jnp.full((1,), int(chain_position_assert), jnp.int32)),
    )


def enable_chain_assert(state: CanaryState, on: bool = True) -> CanaryState:
    """SGLang's ``mark_init_finished``: the flag is 0 during warm-up / graph capture."""
    return dataclasses.replace(
        state, enable_chain_position_assert=jnp.full((1,), int(on), jnp.int32)
    )


@jax.tree_util.register_dataclass
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
