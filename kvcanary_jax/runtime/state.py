"""The canary's configuration and device state, and the padded batch a step consumes.

:class:`CanaryConfig` sizes everything from the server's limits (static and hashable: part of the
jit cache key). :class:`CanaryState` is one pytree with capacity-sized buffers, so every step of a
server reuses a single compilation per batch bucket. :class:`ForwardBatch` is one forward pass,
padded on the host (:func:`kvcanary_jax.runtime.host.make_batch`) to the config's bucket.

Buffer groups: ``FULL`` always; ``SWA`` when ``swa_window_size > 0`` (its canary slots are SWA pool
slots, addressed through the full->SWA LUT of length ``num_slots``; evicted entries map to 0). Each
group has a K half and, if ``enable_v_half``, a V half, each in a HEAD and a TAIL copy.

Coverage (ours, ``coverage_window > 0``; docs/spec.md §17): :class:`CoverageState` adds, per
group, the per-slot KV digest of every layer's K and V (:mod:`kvcanary_jax.runtime.coverage`) and
the per-slot step counters the coverage report is measured from.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from kvcanary_jax import _config, consts
from kvcanary_jax.ops._registry import IMPLEMENTATIONS
from kvcanary_jax.plans import VerifyPlan, WritePlan

__all__ = [
    "CanaryConfig",
    "CanaryState",
    "CoverageState",
    "SlotCoverage",
    "ForwardBatch",
    "init_state",
    "init_state_stacked",
    "state_bytes",
    "check_state",
    "check_state_any",
    "enable_chain_assert",
    "launch_tags",
    "tag",
    "state_jit",
]

def state_jit(fun=None, /, **kwargs):
    """``jax.jit(fun, keep_unused=True, **kwargs)``: the jit of every function that donates a
    canary state (usable as a decorator, bare or with arguments).

    JAX pairs donated inputs with outputs by shape and dtype, in order, after dropping the inputs
    a function does not read. A step that overwrites a state leaf without reading it (coverage's
    digest byte count, a sweep's step stamp) would have that input dropped, and every later leaf
    of its shape would then pair with its neighbour's output: XLA moves them into place with a
    copy each (6 of the 9 copies a step of ``make_canary_step`` with the coverage window, about
    1 us each on an H200). Kept, each leaf pairs with its own output and is updated in place."""
    if fun is None:
        return lambda f: jax.jit(f, keep_unused=True, **kwargs)
    return jax.jit(fun, keep_unused=True, **kwargs)


_HASH_MODES = tuple(m.name.lower() for m in consts.RealKvHashMode)
_OPTIONAL_SIZES = ("verify_capacity", "write_req_capacity", "sweep_rows", "num_layers",
                   "swa_num_layers")


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

    Coverage (ours): ``coverage_window`` N >= 1 digests every layer's K and V of each slot a step
    writes and verifies, at step T's TAIL, the read slots with ``slot % N == T % N`` (0: off,
    SGLang's behaviour). ``num_layers``: the KV layers of each group (the FULL group's; the SWA
    group's is ``swa_num_layers``, default the same), required with a window: a step whose KV
    holds another count of layers is refused, so no layer goes unverified unnoticed.
    ``sweep_interval``: the steps between the caller's sweeps (0: none, or no fixed schedule).
    With a window N and a sweep at least every N steps, a TAIL leaves out of its check the read
    slots of the FULL group whose content the last sweep checked, fewer than N steps before
    (the next sweep checks them within the window; docs/spec.md §17.2), and the coverage report
    counts a cached slot verified while the last sweep is at most that many steps old (the
    window where none is stated; §17.4). The manager sets it from its own ``sweep_interval``.
    ``sweep_in_steps``: whether that interval counts steps, one TAIL each (False: calls of an
    integration whose call may run several TAILs, tpu-inference's on-device decode loop; the
    steps then keep every read slot's check, and the report does not age the sweep).
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
    coverage_window: int = 0
    num_layers: int | None = None
    swa_num_layers: int | None = None
    sweep_interval: int = 0
    sweep_in_steps: bool = True

    def __post_init__(self):
        # Our rule, first: sizes are integers (4.5 or True was taken and failed, or was
        # truncated, far from here; "16" failed with an unrelated comparison TypeError).
        for field in ("max_reqs", "context_len", "num_slots", "max_bs", "max_tokens",
                      "verify_capacity", "write_req_capacity", "sweep_rows", "ring_capacity",
                      "swa_window_size", "swa_num_slots", "kv_token_id_vs_position_offset",
                      "coverage_window", "num_layers", "swa_num_layers", "sweep_interval"):
            value = getattr(self, field)
            if value is None and field in _OPTIONAL_SIZES:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"kv-canary runtime: CanaryConfig.{field} must be an int, got "
                                f"{type(value).__name__} {value!r}")
        for field in ("swa_window_size", "swa_num_slots"):
            if getattr(self, field) < 0:
                raise ValueError(f"kv-canary runtime: {field} must be >= 0 (0: no SWA group), "
                                 f"got {getattr(self, field)}")
        # SGLang's runtime refuses the same sizes when it allocates (CanaryLaunchCapacities,
        # ViolationLog), in these words; the field is named where SGLang's name differs.
        for sgl_name, field in (("req_to_token_pool_size", "max_reqs"),
                                ("max_seq_len_per_req", "context_len"),
                                ("pool_slot_count", "num_slots"),
                                ("per_forward_verify_capacity", "verify_capacity"),
                                ("per_forward_write_req_capacity", "write_req_capacity"),
                                ("per_forward_write_entry_capacity", "max_tokens"),
                                ("ViolationLog ring_capacity", "ring_capacity")):
            value = getattr(self, field)
            if value is not None and value <= 0:
                where = "" if sgl_name.endswith(field) else f" (CanaryConfig.{field})"
                raise ValueError(f"kv-canary: {sgl_name} must be positive, got {value}{where}")
        # Our rule: a size past MAX_SIZE is refused here (one of 2**63 failed deep in JAX with a
        # TypeError, and products of such sizes past int64 aborted the process in XLA's shape
        # arithmetic); init_state then refuses a state no device holds before allocating it.
        for field in _SIZES:
            value = getattr(self, field)
            if value is not None and value > MAX_SIZE:
                raise ValueError(f"kv-canary runtime: CanaryConfig.{field} must be at most "
                                 f"2**40 ({MAX_SIZE:,}), got {value:,}: no device holds a "
                                 "canary that large")
        # The same bound on the step counts and the offset the device adds (int64 arithmetic).
        for field in ("sweep_interval", "kv_token_id_vs_position_offset"):
            value = getattr(self, field)
            if value is not None and abs(value) > MAX_SIZE:
                raise ValueError(f"kv-canary runtime: CanaryConfig.{field} must be within "
                                 f"2**40 of 0, got {value:,}")
        for field in ("max_bs", "sweep_rows"):
            value = getattr(self, field)
            if value is not None and value <= 0:
                raise ValueError(f"kv-canary runtime: {field} must be positive, got {value}")
        if self.swa_window_size > 0 and self.swa_num_slots <= 0:
            raise ValueError("kv-canary runtime: an SWA group needs swa_num_slots > 0")
        if self.real_kv_hash_mode not in _HASH_MODES:
            raise ValueError(
                f"kv-canary runtime: unknown real_kv_hash_mode {self.real_kv_hash_mode!r}")
        if self.implementation is not None and self.implementation not in IMPLEMENTATIONS:
            raise ValueError(f"kv-canary runtime: unknown implementation {self.implementation!r};"
                             f" known: {', '.join(IMPLEMENTATIONS)}")
        self._check_coverage()

    def _check_coverage(self):
        if not isinstance(self.sweep_in_steps, bool):
            raise TypeError("kv-canary runtime: CanaryConfig.sweep_in_steps must be a bool, got "
                            f"{type(self.sweep_in_steps).__name__} {self.sweep_in_steps!r}")
        if self.sweep_interval < 0:
            raise ValueError("kv-canary runtime: sweep_interval must be >= 0 (0: no fixed "
                             f"schedule), got {self.sweep_interval}")
        if self.coverage_window < 0:
            raise ValueError("kv-canary runtime: coverage_window must be >= 0 (0: off), got "
                             f"{self.coverage_window}")
        if self.coverage_window > MAX_COVERAGE_WINDOW:
            raise ValueError(f"kv-canary runtime: coverage_window must be at most "
                             f"{MAX_COVERAGE_WINDOW} steps (the int32 step counters keep that "
                             f"many exact), got {self.coverage_window}")
        for field in ("num_layers", "swa_num_layers"):
            value = getattr(self, field)
            if value is not None and value < 1:
                raise ValueError(f"kv-canary runtime: {field} must be >= 1 (the KV layers of a "
                                 f"group), got {value}")
        if self.swa_num_layers is not None and self.swa_window_size == 0:
            raise ValueError("kv-canary runtime: swa_num_layers is the SWA group's layer count, "
                             "but there is no SWA group (swa_window_size 0)")
        if self.coverage_window > 0 and self.num_layers is None:
            raise ValueError(
                f"kv-canary runtime: coverage_window {self.coverage_window} digests every layer "
                "of the KV: set num_layers (the KV layers of each group), so that a step whose "
                "KV misses a layer is refused instead of leaving that layer unverified")

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

    @property
    def sweep_covers_reads(self) -> bool:
        """A sweep runs at least every ``coverage_window`` steps: a read slot the last sweep
        checked is left out of the TAILs' checks until N steps after that sweep."""
        return self.sweep_in_steps and 0 < self.sweep_interval <= self.coverage_window

    def layers(self, group: str) -> int | None:
        """The KV layers of ``group`` (``None``: not stated)."""
        if group == "SWA" and self.swa_num_layers is not None:
            return self.swa_num_layers
        return self.num_layers


def tag(copy: str, half: str, group: str) -> consts.CanaryLaunchTag:
    """The launch tag of ``{HEAD|TAIL|SWEEP}_{K|V}_{FULL|SWA}``."""
    return consts.CanaryLaunchTag[f"{copy}_{half}_{group}"]


# The longest coverage window: the int32 step counters are rebased to keep this many steps exact
# (kvcanary_jax.runtime.rebase).
MAX_COVERAGE_WINDOW = 2**29

# The per-slot step counters of :class:`SlotCoverage`, the columns of its ``steps`` (int32, -1:
# never).
SLOT_STEPS = ("written_at", "read_from", "read_at", "checked_at", "swept_at")
# Its launch counters (int64 [1]): the digest launches, apart from SGLang's per-tag counters.
DIGEST_RUNS = ("tail_slot_runs", "tail_kernel_runs", "sweep_slot_runs", "sweep_kernel_runs")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class SlotCoverage:
    """The coverage state of one buffer group (docs/spec.md §17).

    ``digest``: int64 ``[slots]``, each slot's KV digest (every layer's K and V) as its last
    write left it. Steps are numbered from 1 (TAILs run under this state); ``steps``: int32
    ``[slots, 5]``, per slot the step counters of :data:`SLOT_STEPS` in that order, -1 for never
    (one array, so that a TAIL stamps them all in one scatter; each is also a property, a view
    of its column): ``written_at`` the step whose TAIL stamped its digest (a slot never stamped
    has no digest to check, and is not checked), ``read_from`` / ``read_at`` the first and last
    step of its current run of consecutive TAIL reads, ``checked_at`` the step of its last
    digest check (a TAIL's or a sweep's), ``swept_at`` the step of the last sweep that walked
    it. ``digest_bytes``: int64 ``[1]``, the KV bytes a digest covers per slot.
    ``tail_slot_runs`` ... ``sweep_kernel_runs``: int64 ``[1]``, slots checked and launches of the
    TAIL and SWEEP digest checks.
    """

    digest: jax.Array
    steps: jax.Array
    digest_bytes: jax.Array
    tail_slot_runs: jax.Array
    tail_kernel_runs: jax.Array
    sweep_slot_runs: jax.Array
    sweep_kernel_runs: jax.Array

    def column(self, name: str) -> jax.Array:
        """One step counter (a name of :data:`SLOT_STEPS`) of every slot: ``[..., slots]``."""
        if name not in SLOT_STEPS:
            raise ValueError(f"kv-canary runtime: no step counter {name!r}; SlotCoverage's are "
                             f"{', '.join(SLOT_STEPS)}")
        return self.steps[..., SLOT_STEPS.index(name)]

    written_at = property(lambda self: self.column("written_at"))
    read_from = property(lambda self: self.column("read_from"))
    read_at = property(lambda self: self.column("read_at"))
    checked_at = property(lambda self: self.column("checked_at"))
    swept_at = property(lambda self: self.column("swept_at"))


def _refuse_step_keywords(init):
    """SlotCoverage's ``__init__``, refusing the separate step-counter arrays it took before
    they became the columns of ``steps`` with a message saying how to build it now."""

    @functools.wraps(init)
    def __init__(self, *args, **fields):
        old = [f for f in SLOT_STEPS if f in fields]
        if old:
            raise TypeError(
                f"SlotCoverage takes its step counters as one int32 array steps=[slots, "
                f"{len(SLOT_STEPS)}], columns {', '.join(SLOT_STEPS)} in that order (-1: "
                f"never), not {', '.join(f + '=' for f in old)}: pass steps=jnp.stack(["
                f"{', '.join(SLOT_STEPS)}], axis=-1)")
        init(self, *args, **fields)

    return __init__


SlotCoverage.__init__ = _refuse_step_keywords(SlotCoverage.__init__)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class CoverageState:
    """``groups``: a :class:`SlotCoverage` per buffer group; ``step``: int32 ``[1]``, the TAILs
    run so far (step T's TAIL checks the slots with ``slot % window == T % window``);
    ``last_sweep``: int32 ``[1]``, the step of the last sweep (-1: none yet)."""

    groups: dict
    step: jax.Array
    last_sweep: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class CanaryState:
    """Everything the canary keeps on the device between steps.

    ``bufs``: canary buffers, uint8 ``[slots, 32]``, keyed ``"{HEAD|TAIL}_{K|V}_{FULL|SWA}"``.
    ``plans``: per group the (VerifyPlan, WritePlan) built by HEAD and reused by TAIL.
    ``slot_run_counter_by_tag`` / ``kernel_run_counter_by_tag``: int64 ``[1]`` per launch tag the
    config launches (:func:`launch_tags`), keyed by tag name: the buffers the kernels update in
    place (one array each, as SGLang's one-element views of its per-tag tensors; a slice of a
    ``[12]`` array would cost a copy in and a copy back around every launch).
    ``slot_run_counters`` / ``kernel_run_counters``: those as int64 ``[12]`` indexed by launch
    tag (0 for tags never launched); a leading shard axis is kept.
    ``expected_tokens``: int32 ``[max_reqs, context_len]`` expected-token pool and
    ``expected_valid_lens`` int64 ``[max_reqs]`` (tokens known per row).
    ``coverage``: the :class:`CoverageState` of ``coverage_window > 0`` (``None`` when off).
    """

    bufs: dict
    plans: dict
    violation_ring: jax.Array
    violation_write_index: jax.Array
    slot_run_counter_by_tag: dict
    kernel_run_counter_by_tag: dict
    expected_tokens: jax.Array
    expected_valid_lens: jax.Array
    enable_chain_position_assert: jax.Array
    coverage: CoverageState | None = None

    @property
    def slot_run_counters(self) -> jax.Array:
        return _by_tag(self.slot_run_counter_by_tag)

    @property
    def kernel_run_counters(self) -> jax.Array:
        return _by_tag(self.kernel_run_counter_by_tag)


@_config.with_x64
def _by_tag(rows: dict) -> jax.Array:
    """Per-tag ``[..., 1]`` counters as one ``[..., 12]`` array in tag order (zeros elsewhere)."""
    like = next(iter(rows.values()))
    return jnp.concatenate(
        [rows[t.name] if t.name in rows else jnp.zeros_like(like)
         for t in consts.CanaryLaunchTag], axis=-1)


def launch_tags(cfg: CanaryConfig) -> tuple[str, ...]:
    """The launch tags a step or sweep of ``cfg`` uses: ``{HEAD|TAIL|SWEEP}_{half}_{group}``."""
    return tuple(f"{copy}_{half}_{group}" for copy in ("HEAD", "TAIL", "SWEEP")
                 for group in cfg.groups for half in cfg.halves)


# The fields that size the state's arrays (or index them), and the most each may be.
_SIZES = ("max_reqs", "context_len", "num_slots", "max_bs", "max_tokens", "verify_capacity",
          "write_req_capacity", "sweep_rows", "ring_capacity", "swa_window_size",
          "swa_num_slots", "num_layers", "swa_num_layers")
MAX_SIZE = 1 << 40
# A state past this many bytes is refused before anything is allocated (no device holds it).
_MAX_STATE_BYTES = 1 << 48


@_config.with_x64
def init_state(cfg: CanaryConfig, *, chain_position_assert: bool = True,
               device=None) -> CanaryState:
    """Zero-filled state sized from ``cfg``. The chain-position flag starts at 1 unless the
    caller still has warm-up / capture steps to run (then flip it with ``enable_chain_assert``).
    Raises MemoryError, naming the state's largest buffers and the fields that size them, where
    the device cannot hold it (before allocating anything where no device could)."""
    total, message = _state_parts(cfg)
    if total > _MAX_STATE_BYTES:
        raise MemoryError(message)
    try:
        return _build_state(cfg, chain_position_assert, device)
    except Exception as e:  # XLA's allocator says RESOURCE_EXHAUSTED, as a runtime error
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        detail = str(e).strip().splitlines()[0]
    # Raised outside the handler: the failed allocation's traceback (and the buffers its frames
    # hold) is let go, not kept alive by the error a caller may hold while it retries.
    raise MemoryError(f"{message} (XLA: {detail})")


@_config.with_x64
def init_state_stacked(cfg: CanaryConfig, shards: int, sharding=None, *,
                       chain_position_assert: bool = True) -> CanaryState:
    """``shards`` zero states of ``cfg`` stacked on a leading axis, built where ``sharding``
    places them: each device allocates its own shards only (stacking states built on one device
    first put every shard there). ``sharding``: None (the default device), or a
    ``jax.sharding.NamedSharding`` whose spec splits the leading axis over mesh axes whose
    devices divide ``shards`` (or, for one state, none: every device holds it). Raises
    ValueError / TypeError for other arguments, and
    MemoryError as :func:`init_state` does."""
    if isinstance(shards, bool) or not isinstance(shards, numbers.Integral) or shards < 1:
        raise ValueError(f"kv-canary runtime: init_state_stacked shards must be a positive int, "
                         f"got {shards!r}")
    shards = int(shards)
    if shards > MAX_SIZE:
        raise ValueError(f"kv-canary runtime: init_state_stacked shards must be at most 2**40, "
                         f"got {shards:,}")
    if sharding is not None:
        if not isinstance(sharding, NamedSharding):
            raise TypeError("kv-canary runtime: init_state_stacked sharding must be None or a "
                            f"jax.sharding.NamedSharding over the shards' axis, got "
                            f"{type(sharding).__name__} {sharding!r}")
        spec = tuple(sharding.spec)
        axes = spec[0] if spec else None
        axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        split = math.prod(sharding.mesh.shape[a] for a in axes)
        # Unsplit (replicated on every device) only a single state.
        if (not axes and shards != 1) or shards % split:
            raise ValueError(
                f"kv-canary runtime: init_state_stacked sharding {sharding.spec} must split the "
                f"leading axis of {shards} shards over mesh axes whose devices divide it (mesh "
                f"{dict(sharding.mesh.shape)}): each device builds its own shards")
    total, message = _state_parts(cfg)
    if shards * total > _MAX_STATE_BYTES:
        raise MemoryError(_stacked(message, shards, total))

    def build():
        one = _build_state(cfg, chain_position_assert, None)
        return jax.tree.map(lambda x: jnp.broadcast_to(x[None], (shards,) + x.shape), one)

    try:
        return jax.jit(build, out_shardings=sharding)()
    except Exception as e:  # as in init_state
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        detail = str(e).strip().splitlines()[0]
    raise MemoryError(f"{_stacked(message, shards, total)} (XLA: {detail})")


def _stacked(message: str, shards: int, total: int) -> str:
    if shards == 1:
        return message
    return (f"{message}, or shards ({shards:,} states, {shards * total:,} B in all, each "
            "device holding its share)")


@_config.with_x64
def state_bytes(cfg: CanaryConfig) -> int:
    """The bytes the state of ``cfg`` needs (from its shapes: nothing is allocated)."""
    if not isinstance(cfg, CanaryConfig):
        raise TypeError(f"kv-canary runtime: state_bytes takes a CanaryConfig, got "
                        f"{type(cfg).__name__}")
    return _state_parts(cfg)[0]


@_config.with_x64
def _state_parts(cfg: CanaryConfig) -> tuple[int, str]:
    """:func:`state_bytes`, and the message that refuses such a state, naming its largest parts
    and the fields that size them."""
    shapes = jax.eval_shape(lambda: _build_state(cfg, True, None))
    size = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))  # noqa: E731
    parts = {
        f"the violation ring (ring_capacity {cfg.ring_capacity:,} rows of "
        f"{consts.VIOLATION_FIELDS * 8} B)": size(shapes.violation_ring),
        f"the expected-token pool (max_reqs {cfg.max_reqs:,} x context_len "
        f"{cfg.context_len:,}, int32)": size(shapes.expected_tokens),
        f"the plans (verify_capacity {cfg.verify_cap:,} entries, write_req_capacity "
        f"{cfg.write_cap:,} requests)": size(shapes.plans),
    }
    for group in cfg.groups:
        field = "num_slots" if group == "FULL" else "swa_num_slots"
        bufs = {k: v for k, v in shapes.bufs.items() if k.endswith(f"_{group}")}
        parts[f"the {group} canary buffers ({len(bufs)} of {field} "
              f"{cfg.group_slots(group):,} x {consts.CANARY_SLOT_BYTES} B)"] = size(bufs)
        if shapes.coverage is not None:
            parts[f"the {group} coverage counters ({field} {cfg.group_slots(group):,} slots, "
                  "coverage_window > 0)"] = size(shapes.coverage.groups[group])
    total = size(shapes)
    largest = sorted(parts.items(), key=lambda kv: -kv[1])
    listed = "; ".join(f"{name}: {n:,} B" for name, n in largest if n and 100 * n >= total)
    return total, (f"kv-canary: the canary's state does not fit the device's memory: it needs "
                   f"{total:,} B, most of it {listed}; lower the fields named")


def _build_state(cfg: CanaryConfig, chain_position_assert: bool, device) -> CanaryState:
    put = lambda x: jax.device_put(x, device)  # noqa: E731
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
        slot_run_counter_by_tag={t: put(jnp.zeros((1,), jnp.int64)) for t in launch_tags(cfg)},
        kernel_run_counter_by_tag={t: put(jnp.zeros((1,), jnp.int64))
                                   for t in launch_tags(cfg)},
        expected_tokens=put(jnp.zeros((cfg.max_reqs, cfg.context_len), jnp.int32)),
        expected_valid_lens=put(jnp.zeros((cfg.max_reqs,), jnp.int64)),
        enable_chain_position_assert=put(jnp.full((1,), int(chain_position_assert), jnp.int32)),
        coverage=_init_coverage(cfg, put) if cfg.coverage_window else None,
    )


def _init_coverage(cfg: CanaryConfig, put) -> CoverageState:
    def group(slots):
        zero = {f: put(jnp.zeros((1,), jnp.int64)) for f in DIGEST_RUNS + ("digest_bytes",)}
        return SlotCoverage(digest=put(jnp.zeros((slots,), jnp.int64)),
                            steps=put(jnp.full((slots, len(SLOT_STEPS)), -1, jnp.int32)), **zero)

    return CoverageState(groups={g: group(cfg.group_slots(g)) for g in cfg.groups},
                         step=put(jnp.zeros((1,), jnp.int32)),
                         last_sweep=put(jnp.full((1,), -1, jnp.int32)))


def _layout(cfg: CanaryConfig) -> dict:
    """``{path: (shape, dtype, why)}`` of every buffer :func:`init_state` allocates for ``cfg``
    (``why``: the config fields the shape comes from)."""
    out = {}
    for group in cfg.groups:
        slots = "num_slots" if group == "FULL" else "swa_num_slots"
        for copy in ("HEAD", "TAIL"):
            for half in cfg.halves:
                out[f"bufs[{copy}_{half}_{group}]"] = (
                    (cfg.group_slots(group), consts.CANARY_SLOT_BYTES), "uint8",
                    f"{slots}={cfg.group_slots(group)}")
        vc = f"verify capacity {cfg.verify_cap}"
        wc = f"write request capacity {cfg.write_cap}"
        for f in ("verify_slot_indices", "verify_expected_tokens", "verify_expected_positions",
                  "verify_prev_slot_indices"):
            out[f"plans[{group}][0].{f}"] = ((cfg.verify_cap,), "int64", vc)
        out[f"plans[{group}][0].verify_num_valid"] = ((1,), "int32", "one element")
        out[f"plans[{group}][0].enable"] = ((1,), "int32", "one element")
        out[f"plans[{group}][1].write_offsets"] = ((cfg.write_cap + 1,), "int64", wc + " + 1")
        out[f"plans[{group}][1].write_seed_slot_indices"] = ((cfg.write_cap,), "int64", wc)
        out[f"plans[{group}][1].write_num_valid_reqs"] = ((1,), "int32", "one element")
    out["violation_ring"] = ((cfg.ring_capacity, consts.VIOLATION_FIELDS), "int64",
                             f"ring_capacity={cfg.ring_capacity}")
    out["violation_write_index"] = ((1,), "int32", "one element")
    for t in launch_tags(cfg):
        out[f"slot_run_counter_by_tag[{t}]"] = ((1,), "int64", "one element")
        out[f"kernel_run_counter_by_tag[{t}]"] = ((1,), "int64", "one element")
    out["expected_tokens"] = ((cfg.max_reqs, cfg.context_len), "int32",
                              f"max_reqs={cfg.max_reqs}, context_len={cfg.context_len}")
    out["expected_valid_lens"] = ((cfg.max_reqs,), "int64", f"max_reqs={cfg.max_reqs}")
    out["enable_chain_position_assert"] = ((1,), "int32", "one element")
    if cfg.coverage_window:
        for group in cfg.groups:
            slots = "num_slots" if group == "FULL" else "swa_num_slots"
            why = f"{slots}={cfg.group_slots(group)}, coverage_window={cfg.coverage_window}"
            at = f"coverage.groups[{group}]"
            out[f"{at}.digest"] = ((cfg.group_slots(group),), "int64", why)
            out[f"{at}.steps"] = ((cfg.group_slots(group), len(SLOT_STEPS)), "int32", why)
            for f in DIGEST_RUNS + ("digest_bytes",):
                out[f"{at}.{f}"] = ((1,), "int64", "one element")
        out["coverage.step"] = ((1,), "int32", "one element")
        out["coverage.last_sweep"] = ((1,), "int32", "one element")
    return out


def _buffers(state: CanaryState) -> dict:
    out = {}
    for key, buf in state.bufs.items():
        out[f"bufs[{key}]"] = buf
    for group, (vp, wp) in state.plans.items():
        for f in dataclasses.fields(vp):
            out[f"plans[{group}][0].{f.name}"] = getattr(vp, f.name)
        for f in dataclasses.fields(wp):
            out[f"plans[{group}][1].{f.name}"] = getattr(wp, f.name)
    for field in ("slot_run_counter_by_tag", "kernel_run_counter_by_tag"):
        for t, arr in getattr(state, field).items():
            out[f"{field}[{t}]"] = arr
    for name in ("violation_ring", "violation_write_index", "expected_tokens",
                 "expected_valid_lens", "enable_chain_position_assert"):
        out[name] = getattr(state, name)
    cov = state.coverage
    if cov is not None:
        for group, sc in cov.groups.items():
            for f in dataclasses.fields(sc):
                out[f"coverage.groups[{group}].{f.name}"] = getattr(sc, f.name)
        out["coverage.step"] = cov.step
        out["coverage.last_sweep"] = cov.last_sweep
    return out


def check_state(cfg: CanaryConfig, state: CanaryState) -> None:
    """Refuse a state that does not fit ``cfg`` (ValueError naming the buffer, its size and the
    size the config needs): a state built for another config would make the step skip writes
    (slots past a smaller canary buffer) and report false corruption on the next step. Works on
    arrays and on tracers (shapes only), so the step functions call it while tracing."""
    want = _layout(cfg)
    have = _buffers(state)
    if set(have) != set(want):
        missing = sorted(set(want) - set(have))
        extra = sorted(set(have) - set(want))
        raise ValueError(
            "kv-canary runtime: the state does not fit its config: "
            + "; ".join(filter(None, (missing and f"missing {', '.join(missing)}",
                                      extra and f"unexpected {', '.join(extra)}")))
            + " (groups and halves come from swa_window_size and enable_v_half, the coverage "
            "buffers from coverage_window); build it with init_state(cfg)")
    for path, (shape, dtype, why) in want.items():
        arr = have[path]
        got_shape, got_dtype = tuple(arr.shape), jnp.dtype(arr.dtype).name
        if got_shape != shape or got_dtype != dtype:
            raise ValueError(
                f"kv-canary runtime: the state does not fit its config: {path} is "
                f"{got_dtype} {got_shape}, the config needs {dtype} {shape} ({why}); build the "
                "state with init_state(cfg)")


def check_state_any(cfg: CanaryConfig, state) -> None:
    """:func:`check_state` for a state or a stack of per-shard states (leading axis)."""
    if not isinstance(cfg, CanaryConfig):
        raise TypeError(f"kv-canary runtime: expected a CanaryConfig, got {type(cfg).__name__}")
    if not isinstance(state, CanaryState):
        raise TypeError(f"kv-canary runtime: expected a CanaryState (init_state(cfg)), got "
                        f"{type(state).__name__}")
    if state.violation_write_index.ndim == 2:
        # One shard's shapes, not its arrays: indexing a concrete array would run a gather (and
        # on an Explicit mesh, sglang-jax 0.1's, needs an out_sharding).
        state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), state)
    check_state(cfg, state)


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
    ``input_ids``, ``positions`` and ``out_cache_loc`` may be int32 (a server's own arrays, as
    sglang-jax's are): the kernels widen them as they read them.
    """

    req_pool_indices: jax.Array  # int64 [max_bs]
    prefix_lens: jax.Array  # int64 [max_bs]
    extend_seq_lens: jax.Array  # int64 [max_bs]
    all_ids_flat: jax.Array  # int64 [max_bs * context_len]
    all_ids_offsets: jax.Array  # int64 [max_bs + 1]
    input_ids: jax.Array  # int64 (or int32) [max_tokens]
    positions: jax.Array  # int64 (or int32) [max_tokens]
    out_cache_loc: jax.Array  # int64 (or int32) [max_tokens]
    expected_input_tokens: jax.Array  # int64 [max_tokens]
    expected_input_positions: jax.Array  # int64 [max_tokens]
