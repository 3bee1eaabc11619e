"""Coverage in SGLang 0.5.23's own canary runtime: every layer's K and V of every live slot of its
KV pool verified within a window of steps (ours, not SGLang's; docs/spec.md §17, in SGLang's
runtime), installed by ``install_into_sglang(coverage_window=N)``
(:mod:`kvcanary_jax.bridge.sglang_install`).

SGLang's real-KV fingerprint reads layer 0 only (its pool adapters build the sources from
``k_buffer[0]`` and ``v_buffer[0]``). With a window N >= 1, each of SGLang's buffer groups (the
MHA pool's FULL group; an SWA pool's FULL and SWA groups) also keeps a per-slot KV digest over
every layer of that group's pool, K then V of layer 0, 1, ... (``k_buffer[l]``, ``v_buffer[l]``
as rows of bytes; :func:`launch_kv_digest_write` / :func:`launch_kv_digest_verify`,
docs/spec.md §16), launched where SGLang's runtime launches its own kernels:

* **TAIL verify** of the group's K half (``TAIL_K_FULL`` / ``TAIL_K_SWA``, after the model wrote
  its KV): the group's step counter ``T`` (a device int32, +1 per TAIL) advances, and the digest
  of the plan's entries whose slot ``s`` has ``s % N == T % N`` is checked (the plan HEAD built:
  each request's cached prefix; an overflowed plan checks nothing, as SGLang's verify);
* **TAIL write** of the group's K half: the digest of the slots the step wrote (SGLang's
  ``out_cache_loc``, through the SWA LUT for the SWA group, as SGLang passes it) is stamped;
* **sweep** of the group's K half (``SWEEP_K_*``): every entry of the sweep's plan (the cached
  prefixes the radix walk lists), whatever the phase.

The digests start as the digest of all-zero KV (SGLang allocates its pools zero-filled, and a
slot's all-zero bytes digest to the same value whatever the slot: the salts depend on the word's
place in the strip only), so a slot no forward has written since the install is checked against
zeros, without a per-slot mask on the step's path: bytes that appear in it otherwise are reported.
The V half's launches are left alone (the digest covers both halves), and so are HEAD's. A
sweep's plan (sized by what the walk found) is padded to its bucket (:mod:`kvcanary_jax.buckets`,
entries -1: skipped), so sweeps compile a logarithmic number of shapes.

A mismatch is a row of SGLang's own violation ring (its 8 fields: the launch tag, slot, position,
0, 0, stored digest, recomputed digest, reason ``KV_DIGEST_MISMATCH`` = 1 << 17), so SGLang's
violation manager logs or raises it like its own; its reporter labels the reason ``kv_digest``
(:meth:`SglangCoverage.formatter`: its rows are formatted by SGLang's own function, ours by
:func:`kvcanary_jax.runtime.reporting.format_violation`). The digest launches count in the
coverage's own counters (:meth:`SglangCoverage.stats`), so SGLang's per-tag counters, its health
check and its stats keep their meaning.

Where the layers come from: SGLang's MHA and SWA adapters attach the canary buffers to a pool and
then splice them into its buffer infos (``patch_buf_info_method(pool, group=...)``); that call
hands over the pool and the group, and the group is registered there (:meth:`attach_hook`), or by
:meth:`SglangCoverage.register` for a group built otherwise. Refused with a
:class:`~kvcanary_jax.bridge.dlpack.BridgeError` naming ``coverage_window``, never a silent
drop to less coverage: when a pool is attached, a pool without ``k_buffer`` / ``v_buffer`` lists
of layers, a quantized pool (its scale buffers would go unchecked), a layer that does not hold
exactly the group's slots as rows of bytes (a paged HND or vectorised layout), more than 256
layers; when the manager is built (:meth:`manager_hook`), a group that was not registered (an
adapter other than SGLang's MHA and SWA ones, e.g. DeepSeek-V4's, or a group attached before the
install) or a manager without a sweep (``sweep_interval`` 0: cached slots would never be
checked); at a launch, a group that was not registered (the manager was built before the
install).

Not supported: KV a server copies into slots without a forward (HiCache load-back,
PD-disaggregation transfers) carries SGLang's canary rows with it but not the digest, so such a
slot is checked against what a forward last wrote there (or zeros) and reported; do not combine
the window with those.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import torch

from kvcanary_jax import buckets, consts, hashing
from kvcanary_jax.bridge.dlpack import BridgeError
from kvcanary_jax.bridge.entry_points import launch_kv_digest_verify, launch_kv_digest_write
from kvcanary_jax.bridge.types import DigestContext, RealKvSource
from kvcanary_jax.runtime import reporting

__all__ = ["SglangCoverage", "GroupCoverage", "layer_sources", "zero_kv_digest", "TAIL_K_TAGS",
           "SWEEP_K_TAGS"]

_TAGS = consts.CanaryLaunchTag
TAIL_K_TAGS = {"FULL": int(_TAGS.TAIL_K_FULL), "SWA": int(_TAGS.TAIL_K_SWA)}
SWEEP_K_TAGS = {"FULL": int(_TAGS.SWEEP_K_FULL), "SWA": int(_TAGS.SWEEP_K_SWA)}
_TAIL_GROUP = {tag: group for group, tag in TAIL_K_TAGS.items()}
_SWEEP_GROUP = {tag: group for group, tag in SWEEP_K_TAGS.items()}
_HALVES = ("k", "v")


def _int64(n: int, device) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.int64, device=device)


def _where(setting: str) -> str:
    return f"kv-canary bridge: {setting}"


def layer_sources(pool, group, *, setting: str) -> tuple[RealKvSource, ...]:
    """Every layer of the pool that SGLang's buffer ``group`` guards, as digest sources in layer
    order, K then V of each (:mod:`module docstring <kvcanary_jax.bridge.sglang_coverage>`):
    an SWA pool's FULL group reads its ``full_kv_pool``, its SWA group its ``swa_kv_pool``."""
    kind = group.kind.name
    sub, where = pool, type(pool).__name__
    if hasattr(pool, "full_kv_pool") and hasattr(pool, "swa_kv_pool"):
        sub = pool.full_kv_pool if kind == "FULL" else pool.swa_kv_pool
        where += ".full_kv_pool" if kind == "FULL" else ".swa_kv_pool"
    layers = {h: getattr(sub, f"{h}_buffer", None) for h in _HALVES}
    if not all(isinstance(v, (list, tuple)) and len(v) > 0 for v in layers.values()):
        raise BridgeError(
            f"{_where(setting)} covers pools whose layers are k_buffer and v_buffer lists "
            f"(SGLang's MHA and SWA pools); {where} ({type(sub).__name__}) has "
            f"k_buffer={type(layers['k']).__name__}, v_buffer={type(layers['v']).__name__}")
    if len(layers["k"]) != len(layers["v"]):
        raise BridgeError(f"{_where(setting)}: {where} has {len(layers['k'])} K layers and "
                          f"{len(layers['v'])} V layers")
    scales = [f"{h}_scale_buffer" for h in _HALVES if getattr(sub, f"{h}_scale_buffer", None)
              is not None]
    if scales:
        raise BridgeError(f"{_where(setting)} does not cover quantized KV pools: {where} has "
                          f"{' and '.join(scales)}, whose bytes the digest would not check")
    if 2 * len(layers["k"]) > consts.MAX_DIGEST_SOURCES:
        raise BridgeError(f"{_where(setting)}: {where} has {len(layers['k'])} layers; the digest "
                          f"takes at most {consts.MAX_DIGEST_SOURCES // 2} (K and V each)")
    num_slots = int(group.k_tail.shape[0])
    out = []
    for layer in range(len(layers["k"])):
        for h in _HALVES:
            t = layers[h][layer]
            name = f"{where}.{h}_buffer[{layer}]"
            if not isinstance(t, torch.Tensor) or t.dim() < 2 or int(t.shape[0]) != num_slots:
                raise BridgeError(
                    f"{_where(setting)}: {name} must hold the {kind} group's {num_slots} slots "
                    f"as its rows, got {getattr(t, 'shape', type(t).__name__)} (a paged layout "
                    "whose rows are pages is not covered)")
            try:
                rows = t.view(torch.uint8).view(num_slots, -1)
            except RuntimeError as e:
                raise BridgeError(f"{_where(setting)}: {name} (shape {tuple(t.shape)}, strides "
                                  f"{tuple(t.stride())}) is not one run of bytes per slot: {e}"
                                  ) from None
            width = int(rows.shape[1])
            try:
                out.append(RealKvSource(tensor=rows, page_size=1, num_bytes_per_token=width,
                                        read_bytes=width))
            except ValueError as e:
                raise BridgeError(f"{_where(setting)}: {name} as a digest source: {e}") from None
    return tuple(out)


def zero_kv_digest(sources) -> int:
    """The digest of a slot whose every source byte is 0 (the same for every slot)."""
    zeros = [np.zeros((1, s.read_bytes), np.uint8) for s in sources]
    return int(hashing.digest_np(zeros)[0])


@dataclasses.dataclass(eq=False)
class GroupCoverage:
    """One buffer group's digest state, on its device: the digests (of zero KV until a TAIL
    write stamps a slot), the step counter of its TAIL launches, a zero phase (the sweep's), and
    the digest launches' counters (entries checked, launches) of TAIL and sweep."""

    group: str  # "FULL" or "SWA"
    k_tail: torch.Tensor  # the group's key: SGLang's TAIL and SWEEP K launches name this buffer
    sources: tuple
    digest: torch.Tensor
    step: torch.Tensor
    zero_phase: torch.Tensor
    tail_slot_runs: torch.Tensor
    tail_kernel_runs: torch.Tensor
    sweep_slot_runs: torch.Tensor
    sweep_kernel_runs: torch.Tensor

    @classmethod
    def allocate(cls, group, sources) -> "GroupCoverage":
        dev, n = group.k_tail.device, int(group.k_tail.shape[0])
        i32 = lambda: torch.zeros(1, dtype=torch.int32, device=dev)  # noqa: E731
        return cls(group=group.kind.name, k_tail=group.k_tail, sources=sources,
                   digest=torch.full((n,), zero_kv_digest(sources), dtype=torch.int64,
                                     device=dev),
                   step=i32(), zero_phase=i32(), tail_slot_runs=_int64(1, dev),
                   tail_kernel_runs=_int64(1, dev), sweep_slot_runs=_int64(1, dev),
                   sweep_kernel_runs=_int64(1, dev))


def _bucketed(plan) -> tuple[torch.Tensor, torch.Tensor]:
    """A sweep plan's slots and positions padded to the bucket of its capacity (slots -1)."""
    slots, positions = plan.verify_slot_indices, plan.verify_expected_positions
    n = int(slots.shape[0])
    b = buckets.bucket(n)
    if b == n:
        return slots, positions
    padded = (torch.full((b,), -1, dtype=slots.dtype, device=slots.device),
              torch.zeros(b, dtype=positions.dtype, device=positions.device))
    padded[0][:n].copy_(slots)
    padded[1][:n].copy_(positions)
    return padded


class SglangCoverage:
    """The coverage of one install: the window, the registered groups, and the hooks the install
    binds into SGLang's runtime (module docstring)."""

    def __init__(self, window: int):
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise BridgeError(f"kv-canary bridge: coverage_window must be an int >= 1 (0: off), "
                              f"got {window!r}")
        self.window = window
        self.setting = f"coverage_window={window}"
        self._groups: dict[int, GroupCoverage] = {}
        self._lock = threading.Lock()

    # -- groups ----------------------------------------------------------------------------------

    def register(self, pool, group) -> GroupCoverage:
        """Cover SGLang buffer ``group`` (a ``CanaryBufferGroup``) with every layer of ``pool``
        (the pool SGLang attached it to: an MHA pool, or the SWA pool of an SWA group); what the
        attach hook does, for a group built otherwise. Registering a group again replaces its
        state."""
        cov = GroupCoverage.allocate(group, layer_sources(pool, group, setting=self.setting))
        with self._lock:
            self._groups[id(group.k_tail)] = cov
        return cov

    def groups(self) -> tuple[GroupCoverage, ...]:
        with self._lock:
            return tuple(self._groups.values())

    def _group_of(self, context, group: str) -> GroupCoverage:
        cov = self._groups.get(id(context.canary_buf))
        if cov is None or cov.k_tail is not context.canary_buf:
            raise BridgeError(
                f"kv-canary bridge: {self.setting} is on, but SGLang's {group} buffer group of "
                "this launch was never registered (its canary was built before "
                "install_into_sglang(), or its pool is not one the coverage reads): install "
                "before the model runner builds its canary, or register(pool, group)")
        return cov

    def stats(self) -> dict:
        """Per registered group (``"FULL"``, ``"SWA"``; a second manager's groups ``"FULL#1"``
        ...): the TAIL steps counted, the layers and digest bytes a slot, and the entries checked
        and launches of TAIL and sweep (a device-to-host read: not for the hot path)."""
        out: dict[str, dict] = {}
        for cov in self.groups():
            key, i = cov.group, 1
            while key in out:
                key, i = f"{cov.group}#{i}", i + 1
            out[key] = dict(
                window=self.window, steps=int(cov.step[0]), layers=len(cov.sources) // 2,
                bytes_per_slot=sum(s.read_bytes for s in cov.sources),
                tail_slot_runs=int(cov.tail_slot_runs[0]),
                tail_kernel_runs=int(cov.tail_kernel_runs[0]),
                sweep_slot_runs=int(cov.sweep_slot_runs[0]),
                sweep_kernel_runs=int(cov.sweep_kernel_runs[0]))
        return out

    # -- the launches ----------------------------------------------------------------------------

    def _verify(self, cov: GroupCoverage, context, slots, positions, plan, *, tag, phase,
                window, counters):
        slot_runs, kernel_runs = counters
        launch_kv_digest_verify(
            context=DigestContext(digest_buf=cov.digest, kernel_kind=tag,
                                  violation_ring=context.violation_ring,
                                  violation_write_index=context.violation_write_index,
                                  slot_run_counter=slot_runs, kernel_run_counter=kernel_runs),
            slots=slots, positions=positions,
            # An overflowed plan (enable 0) checks nothing, as SGLang's verify.
            num_valid=torch.where(plan.enable != 0, plan.verify_num_valid, 0),
            phase=phase, window=window, sources=cov.sources)

    def after_verify(self, context, plan) -> None:
        """After SGLang's verify launch of ``context``: TAIL K checks a phase of its plan, a
        sweep K every entry of its plan; other launches nothing."""
        tag = int(context.kernel_kind)
        if tag in _TAIL_GROUP:
            cov = self._group_of(context, _TAIL_GROUP[tag])
            cov.step.add_(1)
            # The plan as it is: its capacity is the manager's, the same every step.
            self._verify(cov, context, plan.verify_slot_indices, plan.verify_expected_positions,
                         plan, tag=tag, phase=cov.step, window=self.window,
                         counters=(cov.tail_slot_runs, cov.tail_kernel_runs))
        elif tag in _SWEEP_GROUP:
            cov = self._group_of(context, _SWEEP_GROUP[tag])
            self._verify(cov, context, *_bucketed(plan), plan, tag=tag, phase=cov.zero_phase,
                         window=1, counters=(cov.sweep_slot_runs, cov.sweep_kernel_runs))

    def after_write(self, context, out_cache_loc) -> None:
        """After SGLang's write launch of ``context``: TAIL K stamps the written slots."""
        tag = int(context.kernel_kind)
        if tag in _TAIL_GROUP:
            cov = self._group_of(context, _TAIL_GROUP[tag])
            launch_kv_digest_write(digest_buf=cov.digest, slots=out_cache_loc,
                                   sources=cov.sources)

    # -- the hooks the install binds (each keeps the signature of what it replaces) --------------

    def verify_launcher(self, launch):
        """``launch_canary_verify_kernel`` as the endpoints call it: ``launch``, then the
        coverage."""
        def launch_canary_verify_kernel(*, context, plan, check_verify_expected_token):
            launch(context=context, plan=plan,
                   check_verify_expected_token=check_verify_expected_token)
            self.after_verify(context, plan)
        return launch_canary_verify_kernel

    def write_launcher(self, launch):
        """``launch_canary_write_kernel`` as the endpoints call it: ``launch``, then the
        coverage."""
        def launch_canary_write_kernel(*, context, plan, input_ids, positions, out_cache_loc,
                                       enable_write_input_assert, expected_input_tokens,
                                       expected_input_positions):
            launch(context=context, plan=plan, input_ids=input_ids, positions=positions,
                   out_cache_loc=out_cache_loc,
                   enable_write_input_assert=enable_write_input_assert,
                   expected_input_tokens=expected_input_tokens,
                   expected_input_positions=expected_input_positions)
            self.after_write(context, out_cache_loc)
        return launch_canary_write_kernel

    def attach_hook(self, splice):
        """SGLang's adapters' ``patch_buf_info_method`` (``splice``): it receives the pool and
        each group the adapter built; the group is registered, then SGLang's splice runs."""
        def patch_buf_info_method(pool, *, method_name, group, has_v_half, page_size):
            self.register(pool, group)
            return splice(pool, method_name=method_name, group=group, has_v_half=has_v_half,
                          page_size=page_size)
        return patch_buf_info_method

    def manager_hook(self, orchestrator):
        """The ``SweepOrchestrator`` a ``CanaryManager`` builds in its constructor, with its
        config and buffer groups: refused unless the manager sweeps and every group is
        registered."""
        def SweepOrchestrator(*, config, device_state, buffer_groups, endpoints,  # noqa: N802
                              swa_window_size, outer_step_counter_getter):
            if int(config.sweep_interval) <= 0:
                raise BridgeError(
                    f"kv-canary bridge: {self.setting} needs SGLang's sweep "
                    f"(--kv-canary-sweep-interval > 0, got {config.sweep_interval}): cached slots "
                    "that no request reads would never be checked")
            for group in buffer_groups:
                cov = self._groups.get(id(group.k_tail))
                if cov is None or cov.k_tail is not group.k_tail:
                    raise BridgeError(
                        f"kv-canary bridge: {self.setting}: SGLang's {group.kind.name} buffer "
                        "group of this CanaryManager was attached to a pool the coverage did not "
                        "see (its adapter is not SGLang's MHA or SWA one, or it was attached "
                        "before install_into_sglang()); not covered")
            return orchestrator(config=config, device_state=device_state,
                                buffer_groups=buffer_groups, endpoints=endpoints,
                                swa_window_size=swa_window_size,
                                outer_step_counter_getter=outer_step_counter_getter)
        return SweepOrchestrator

    @staticmethod
    def formatter(format_violation):
        """SGLang's reporter's ``_format_violation``: its own rows as it formats them, digest rows
        by :func:`kvcanary_jax.runtime.reporting.format_violation` (reason ``kv_digest``)."""
        def _format_violation(*, row, total, ring_overflow, step_when_pumped):
            if int(row[consts.VIOLATION_FIELD_FAIL_REASON_BITS]) & consts.KV_DIGEST_MISMATCH:
                return reporting.format_violation(row, total=total, ring_overflow=ring_overflow,
                                                  step_when_pumped=step_when_pumped)
            return format_violation(row=row, total=total, ring_overflow=ring_overflow,
                                    step_when_pumped=step_when_pumped)
        return _format_violation
