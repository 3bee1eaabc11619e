"""The canary runtime a server holds: SGLang 0.5.23's ``CanaryManager`` and its guards, in JAX.

:class:`CanaryManager` owns the canary's device state and runs, per forward step, what SGLang's
runtime (``sglang/srt/kv_canary/runner/``) runs around its kernels. It orchestrates these parts:

* **the device side** (:mod:`~kvcanary_jax.runtime.device`): HEAD -> the model forward -> TAIL in
  one ``jax.jit`` with the state and the KV donated (:meth:`CanaryManager.step`), or HEAD and TAIL
  around a forward the server runs itself (:meth:`~CanaryManager.head` / :meth:`~CanaryManager.
  tail`), or only the host side after a step the server jitted itself
  (:meth:`~CanaryManager.observe`, e.g. the sglang-jax hook); the sweep (``sweep.py``) of the
  attached radix walk every ``sweep_interval`` steps, with our padding-slot guard;
* **readback one step late** (:mod:`~kvcanary_jax.runtime.readback`, ``future_tensor.py``): each
  step's readback is read after the *next* step is dispatched, so the step never waits on the
  host and the host never waits on the step it just launched;
* **reporting** (:mod:`~kvcanary_jax.runtime.reporting`, ``violation_reporter.py``): rows from the
  last reported one on, SGLang's message format, the ring overflow flagged; ``log`` logs each
  through :mod:`logging` (logger ``kvcanary_jax.runtime.manager``), ``raise`` raises
  :class:`CanaryViolationError` (a ``RuntimeError``);
* **health and phase checks** (:mod:`~kvcanary_jax.runtime.health`): launch health ("canary path
  is not executing"), the phase check (SGLang's ``SimplePhaseChecker``, on once
  :meth:`~CanaryManager.mark_init_finished` ran), the overflow warner, the periodic stats (with
  the coverage window's report, :meth:`~CanaryManager.coverage`, counted on the device after a
  stats step and read with its readback);
* **agreement** (:mod:`~kvcanary_jax.runtime.agreement`, ours): the decision to raise is agreed
  before anyone raises, over a device mesh inside the step and across processes through
  jax.distributed's key-value store, within ``agreement_timeout_s``;
* **remediation** (ours): ``on_violation(report)`` gets each new violation with the request it
  belongs to (the ring row's slot mapped back through the step's batch), before a raise;
* **draft workers**: ``ManagerConfig(draft_worker=True)`` sets SGLang's
  ``kv_token_id_vs_position_offset=1`` and leaves the sweep tags out of the health check (SGLang
  attaches the radix cache to the target worker only); run one manager per draft step.

**The guarantees.** Each violation (ring row) is reported exactly once, in every mode:

* across raises: a raise reports its rows, later rows are reported (logged, or raised) as they
  come, and no row is raised twice; a phase error is reported once (the growth of the device's
  counter, not its level);
* across closes: :meth:`~CanaryManager.flush` and :meth:`~CanaryManager.close` report the pending
  readback *and* what a sweep (the last step's, or an explicit :meth:`~CanaryManager.sweep`)
  found after it;
* across state swaps: a state that does not continue the one reported so far (its write index
  or run counters went back: a fresh ``init_state()`` handed to ``observe``) is reported from
  row 0; :meth:`~CanaryManager.resync` resumes a restored checkpoint from its write index;
* across failed steps: an error raised by a step carries that step's KV (``kv``: the KV passed
  in was donated), whatever failed (a check, the agreement, a callback that raised, wrapped in
  :class:`CanaryCallbackError`), and every violation of the step is still logged (log mode) or
  carried (``reports``);
* across threads: every public method holds one lock, so calls from several threads run one at
  a time, each readback is consumed once, and no call sees a donated state.

What the manager cannot honour it refuses where the mistake is made, with a ``ValueError`` before
anything is donated: sizes whose real-KV mode, token asserts or draft offset contradict the
config; a ``requests=`` list that is not one request per row of the batch.

Mode ``none`` builds no state and traces nothing of the canary: :meth:`CanaryManager.step` runs
the forward alone (it still checks, across processes, that every process runs the same mode).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvcanary_jax import _config, consts
from kvcanary_jax.runtime import coverage as _coverage
from kvcanary_jax.runtime import health
from kvcanary_jax.runtime.agreement import Agreement, AgreementFailure, Finding
from kvcanary_jax.runtime.config import ManagerConfig
from kvcanary_jax.runtime.device import DeviceSteps, check_state_any
from kvcanary_jax.runtime.readback import Readbacks, Staged
from kvcanary_jax.runtime.rebase import Rebaser
from kvcanary_jax.runtime.reporting import (
    PADDING_SLOT_NOT_ZERO,
    CanaryAgreementError,
    CanaryCallbackError,
    CanaryStateLost,
    CanaryViolationError,
    Reporter,
    StepContext,
    failure_line,
    state_consumed,
    ViolationReport,
    format_violation,
    logger,
)
from kvcanary_jax.runtime.state import CanaryConfig


__all__ = [
    "CanaryManager",
    "CanaryViolationError",
    "CanaryCallbackError",
    "CanaryAgreementError",
    "CanaryStateLost",
    "ViolationReport",
    "PADDING_SLOT_NOT_ZERO",
    "format_violation",
    "check_state_any",
]

_SIZES_DEFAULTS = {f.name: f.default for f in dataclasses.fields(CanaryConfig)}


def _settings_over_sizes(config: ManagerConfig) -> dict:
    """The :class:`CanaryConfig` fields the manager's config decides: field -> (the config's
    value, how to name that setting)."""
    c = config
    return {
        "ring_capacity": (c.ring_capacity, None),  # a capacity: the config's, always
        "real_kv_hash_mode": (c.real_data, f"real_data (--kv-canary-real-data) {c.real_data!r}"),
        "enable_verify_token_assert": (
            c.enable_verify_token_assert, "enable_verify_token_assert "
            f"(SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT) {c.enable_verify_token_assert}"),
        "enable_write_input_assert": (
            c.enable_write_input_assert, "enable_write_input_assert "
            f"(SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT) {c.enable_write_input_assert}"),
        "kv_token_id_vs_position_offset": (
            c.kv_token_id_vs_position_offset,
            f"draft_worker {c.draft_worker} (offset {c.kv_token_id_vs_position_offset})"),
        "coverage_window": (c.coverage_window, "coverage_window (--kv-canary-coverage-window / "
                            f"SGLANG_KV_CANARY_COVERAGE_WINDOW) {c.coverage_window}"),
        "sweep_interval": (c.sweep_interval, "sweep_interval (--kv-canary-sweep-interval) "
                           f"{c.sweep_interval}"),
    }


def _sizes_for(config: ManagerConfig, sizes: CanaryConfig) -> CanaryConfig:
    """``sizes`` with the settings the config decides. A sizes field left at CanaryConfig's
    default asks for nothing; one set otherwise must say what the config says (a real-KV mode
    the flags turned off would miss a flipped KV byte, a draft offset without a draft worker
    gives false alarms)."""
    taken = _settings_over_sizes(config)
    for field, (value, setting) in taken.items():
        asked = getattr(sizes, field)
        if setting is None or asked == _SIZES_DEFAULTS[field] or asked == value:
            continue
        raise ValueError(
            f"kv-canary: the sizes ask for CanaryConfig.{field}={asked!r}, but the manager's "
            f"config has {setting}, and the manager runs what its config says: set the config "
            f"to match, or leave {field} at its default ({_SIZES_DEFAULTS[field]!r}) in the sizes")
    if config.coverage_window and sizes.num_layers is None:
        raise ValueError(
            f"kv-canary: --kv-canary-coverage-window {config.coverage_window} digests every layer "
            "of the KV: the sizes must state CanaryConfig.num_layers (the KV layers of each "
            "group), so that a step whose KV misses a layer is refused")
    return dataclasses.replace(sizes, **{field: value for field, (value, _) in taken.items()})


def _serialized(method):
    """One call at a time on a manager (see the module docstring: threads)."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


class CanaryManager:
    """The canary of one model worker (see the module docstring).

    ``config``: a :class:`ManagerConfig` (SGLang's flags and environment variables).
    ``sizes``: a :class:`~kvcanary_jax.runtime.CanaryConfig` with the server's limits; its
    ring capacity, real-KV mode, token asserts and draft offset are the config's (a sizes value
    other than CanaryConfig's default that contradicts the config is refused).
    ``forward(kv, batch, req_to_token, lut) -> kv``: the model forward :meth:`step` runs
    between HEAD and TAIL. ``on_violation(report)``: the remediation callback.
    ``mesh`` / ``axis``: one canary per data-parallel shard over that mesh axis (states, KV,
    batches and tables stacked along a leading axis, :func:`kvcanary_jax.stack_shards`), the
    error flag max-reduced over the axis inside the step.
    ``allocate``: build the state now (``False``: :meth:`observe` hands it in).
    Every bad setting raises ``ValueError`` here, before anything is allocated.
    """

    def __init__(self, config: ManagerConfig, sizes: CanaryConfig | None = None, *,
                 forward: Callable | None = None,
                 on_violation: Callable[[ViolationReport], None] | None = None,
                 mesh: jax.sharding.Mesh | None = None, axis: str = "dp",
                 allocate: bool = True):
        if not isinstance(config, ManagerConfig):
            raise ValueError(f"kv-canary: config must be a ManagerConfig, got "
                             f"{type(config).__name__}")
        if on_violation is not None and not callable(on_violation):
            raise ValueError("kv-canary: on_violation must be callable")
        if forward is not None and not callable(forward):
            raise ValueError("kv-canary: forward must be callable")
        self._config = config
        self._forward = forward
        self._on_violation = on_violation
        self._mesh, self._axis = mesh, axis
        self._lock = threading.RLock()
        self.step_count = 0
        self.sweep_passes = 0
        self._rebaser = None
        self.state = None
        self.cfg = None
        self._radix_walk = None
        self._last_sweep_step = -1
        self._warned_no_walk = False
        self._steps_itself = allocate  # False once observe() runs: the server steps (and sweeps)
        self._unread = False  # a launch ran since the last staged readback (a sweep, a HEAD)
        self._head_table = (None, None)  # (the host table HEAD was given, its device copy)
        self._lost = ""  # why the manager holds no state (a step failed on the device), or ""
        self._init_finished = False  # mark_init_finished() was called
        if mesh is not None and axis not in mesh.shape:
            raise ValueError(f"kv-canary: axis {axis!r} is not an axis of the mesh "
                             f"(axes: {', '.join(mesh.axis_names)})")
        if mesh is not None and any(d.process_index != jax.process_index()
                                    for d in mesh.devices.flat):
            # Each process reads back its own shards; across processes the host agreement
            # (agree_across_processes) is the one that decides.
            raise ValueError("kv-canary: the mesh spans devices of other processes; build one "
                             "manager per process over its local devices (processes agree "
                             "through agree_across_processes)")
        if config.enabled and not isinstance(sizes, CanaryConfig):
            raise ValueError(f"kv-canary: mode {config.mode!r} needs sizes=CanaryConfig(...) "
                             f"(the server's limits), got {type(sizes).__name__}")
        cfg = _sizes_for(config, sizes) if config.enabled else None
        self._rank = jax.process_index()
        # Every process, mode none included, checks the others run its settings.
        self._agreement = Agreement(config)
        self._agreement.check_settings(config)
        with _config.x64_scope():
            self._lut_dummy = jnp.zeros((1,), jnp.int64)
        if not config.enabled:
            self._forward_jit = jax.jit(forward, donate_argnums=(0,)) if forward else None
            return
        self.cfg = cfg
        self._device = DeviceSteps(cfg, forward, guard=config.padding_guard, mesh=mesh,
                                   axis=axis)
        self._readbacks = Readbacks(cfg)
        # The state the manager steps keeps its int32 step counters from wrapping (observe():
        # the server's own step does, see runtime.rebase).
        self._rebaser = Rebaser(cfg)
        self._reporter = Reporter(cfg.ring_capacity, self._rank)
        self._health = health.LaunchHealth(config, cfg)
        self._phase_check = health.PhaseCheck()
        self._overflow = health.OverflowWarner(cfg)
        self._phase_epoch = 0
        with _config.x64_scope():
            self._phase = health.initial_phase(False)
            if allocate:
                # Chain-position assert off until mark_init_finished (SGLang: warm-up steps and
                # graph capture feed synthetic positions that trip it).
                self.state = self._device.zero_state(chain_position_assert=False)

    # ---------------------------------------------------------------------- public surface
    @property
    def config(self) -> ManagerConfig:
        """The :class:`ManagerConfig` the manager was built with (read-only: its jits, its
        health checks and its sweep schedule were built from it; build a new manager for
        another)."""
        return self._config

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    @property
    def state(self):
        """The canary's device state (stacked per shard over a mesh), ``None`` until there is one.
        A state set from outside (a restored checkpoint) has its step counter read at the next
        step, for the rebase that keeps it from wrapping (runtime.rebase)."""
        return self._state

    @state.setter
    def state(self, value) -> None:
        lost = getattr(self, "_lost", "")  # (unset while __init__ sets the first state)
        self._state = value
        self._lost = ""
        if self._rebaser is not None:
            self._rebaser.reset()
        if lost and value is not None and _is_fresh(value):
            # The state a failed step took is gone, and this is a new one (init_state), as the
            # error asks: reported from its first row without the replaced-state warning. A
            # checkpoint is left to the reporter: one that continues what was reported goes on
            # from there; an older one is reported again, with the warning naming resync().
            self._report_from_zero(value)

    @property
    def lock(self) -> threading.RLock:
        """The lock every public method holds. A server that donates the state the manager holds
        (an integration's own jitted step) holds it too, from the donating call until the new
        state is handed over (:meth:`observe`, :meth:`hold`), so that no call from another
        thread reads a donated state."""
        return self._lock

    @_serialized
    def hold(self, state, *, fresh: bool = False) -> None:
        """The server's state after launches of its own between steps (a sweep it ran): held
        from now on (:meth:`coverage` reads it), and what they found is reported by the next
        step's readback or by :meth:`flush` / :meth:`close`. ``fresh``: a new state
        (``init_state()``, an integration's restart after a failed step) that does not continue
        the one held: reported from its first row, after the readback still pending, without the
        replaced-state warning (which is for a state swapped unannounced)."""
        self._require_enabled("hold")
        self.state = state
        self._unread = True
        if fresh:
            self._report_from_zero(state)

    def _report_from_zero(self, state) -> None:
        """The reporting of ``state`` from its first row, after the readback still pending."""
        zero = (np.zeros(np.shape(state.violation_write_index), np.int64),
                np.zeros(np.shape(state.kernel_run_counters), np.int64))
        staged = self._readbacks.staged
        if staged is not None:
            staged.rebase = zero
        else:
            self._rebase(*zero)

    @_serialized
    def coverage(self) -> _coverage.CoverageStats | None:
        """The coverage report of the state now (``coverage_window``; ``None`` when off): the
        window, the sweep interval (the bound for cached slots), the share of live KV bytes
        verified in the window. A device reduction and a host read: not for the hot path (the
        stats line carries the same report one step late, without waiting)."""
        if not self.enabled or self._device.coverage is None or self.state is None:
            return None
        with _config.x64_scope():
            host, write_index = jax.device_get((self._device.coverage(self.state),
                                                self.state.violation_write_index))
        return _coverage.from_counts(self.cfg, host, sweep_interval=self.config.sweep_interval,
                                     write_index=write_index)

    @property
    def overflow_count_total(self) -> int:
        """Verify plans skipped over their capacity so far (the overflow warner's total)."""
        return self._overflow.total if self.enabled else 0

    @_serialized
    def mark_init_finished(self) -> None:
        """SGLang's ``mark_init_finished``: warm-up is over; the chain-position assert and the
        phase check are on from the next step."""
        if not self.enabled:
            return
        with _config.x64_scope():
            if self.state is not None:  # observe mode without a state yet: the server's own
                on = jnp.ones_like(self.state.enable_chain_position_assert)
                self.state = dataclasses.replace(self.state, enable_chain_position_assert=on)
            self._phase = health.initial_phase(True)
        self._init_finished = True
        self._phase_epoch += 1  # a new phase array: its error count starts from 0

    @_serialized
    def attach_radix_cache(self, walk: Callable[[], tuple]) -> None:
        """SGLang's ``attach_radix_cache``: ``walk()`` returns the sweep's ``(rows_table,
        row_indices, lengths)`` (see :func:`kvcanary_jax.runtime.canary_sweep`), called every
        ``sweep_interval`` steps. A draft worker's manager takes none (SGLang sweeps on the
        target worker only)."""
        if not callable(walk):
            raise ValueError("kv-canary: attach_radix_cache needs a callable returning "
                             "(rows_table, row_indices, lengths)")
        if self.config.draft_worker:
            raise ValueError("kv-canary: a draft worker's manager runs no sweep (SGLang attaches "
                             "the radix cache to the target worker only)")
        if self.config.sweep_interval == 0:
            raise ValueError("kv-canary: attach_radix_cache with --kv-canary-sweep-interval 0: "
                             "the sweep never runs")
        self._radix_walk = walk

    @_serialized
    def step(self, kv, batch, req_to_token, lut=None, *, requests: Sequence | None = None,
             resolve: Callable | None = None):
        """One forward step: HEAD -> ``forward`` -> TAIL (state and ``kv`` donated), the sweep
        when due, then the host side (the previous step's readback). Returns the new ``kv``.
        ``requests``: the batch's requests in batch order, one per row whose
        ``req_pool_indices`` is not 0 (checked: one small read of those indices), handed to
        ``on_violation`` with the violations of their slots (or ``resolve(slot, violation) ->
        request``). Any error raised after the step ran is a :class:`CanaryViolationError`
        carrying the step's KV (``kv``)."""
        if not self.enabled:
            if self._forward_jit is None:
                raise ValueError("kv-canary: step() needs the manager built with forward=")
            # Under the same 64-bit scope as the canary modes, so the forward traces alike.
            with _config.x64_scope():
                return self._forward_jit(kv, batch, req_to_token, self._lut(lut))
        if self._device.fused is None:
            raise ValueError("kv-canary: step() needs the manager built with forward=; use "
                             "head()/tail() around a forward you run yourself")
        if requests is not None and self._mesh is not None:
            raise ValueError("kv-canary: requests= maps slots through one batch; over a mesh "
                             "(stacked batches) pass resolve=(slot, violation) -> request")
        self._check_requests(batch, requests)
        self._require_state("step")
        with _config.x64_scope():
            if self._reads_tables(requests, resolve):
                req_to_token, lut = _held(req_to_token), _held(lut)
            self._state = self._rebaser(self._state)
            self._state, self._phase, kv, rb = self._on_device(
                "step", self._device.fused, self.state, self._phase, kv, batch, req_to_token,
                self._lut(lut))
            try:
                self._after_step(rb, kv, lut, self._context(batch, req_to_token, lut, requests,
                                                            resolve))
            except CanaryViolationError as e:
                # The KV passed in was donated: the error carries the step's new KV, so a server
                # that survives the raise (remediation) keeps serving from it.
                e.kv = kv
                raise
            except Exception as e:
                error = CanaryViolationError(
                    f"kv-canary: the host side of step {self.step_count} failed after the step "
                    f"ran ({type(e).__name__}: {e}); the step's KV is attached (the KV passed "
                    "in was donated)", step=self.step_count)
                error.kv = kv
                raise error from e
        return kv

    @_serialized
    def head(self, batch, req_to_token, lut=None) -> None:
        """HEAD before a forward the server runs itself (state donated)."""
        self._require_enabled("head")
        self._require_state("head")
        with _config.x64_scope():
            # A host table as the device array the HEAD takes anyway: the TAIL's report reads
            # it one step late, where the TAIL is handed the same table (not over a mesh, whose
            # reports go through resolve=, which reads no table).
            table = req_to_token if self._mesh is not None else _held(req_to_token)
            self._state = self._rebaser(self._state)
            self._state, self._phase = self._on_device("head", self._device.head, self._state,
                                                       self._phase, batch, table,
                                                       self._lut(lut))
        self._head_table = (req_to_token, table) if table is not req_to_token else (None, None)
        self._unread = True

    @_serialized
    def abort_step(self) -> None:
        """The forward between :meth:`head` and :meth:`tail` failed and the server drops the
        step (to retry it, say): no TAIL runs for it. What its HEAD verified stays and is
        reported with the next readback; its tokens get their canaries when a later TAIL writes
        them. Without it, the next HEAD is a phase error (two HEADs), raised in every mode.
        Nothing to do after a TAIL."""
        self._require_enabled("abort_step")
        self._head_table = (None, None)
        with _config.x64_scope():
            self._phase = self._phase.at[0].set(jnp.int32(health.IDLE))

    @_serialized
    def tail(self, batch, kv, lut=None, *, req_to_token=None, requests=None,
             resolve=None) -> None:
        """TAIL after that forward (fingerprinting ``kv``, not donated), then the sweep when due
        and the host side, as :meth:`step`."""
        self._require_enabled("tail")
        self._check_requests(batch, requests)
        self._require_state("tail")
        with _config.x64_scope():
            given, held = self._head_table
            self._head_table = (None, None)
            if self._reads_tables(requests, resolve):
                if req_to_token is not None and req_to_token is given:
                    req_to_token = held  # HEAD's copy of this host table: no second copy
                elif isinstance(req_to_token, np.ndarray):
                    req_to_token = req_to_token.copy()  # read one step late: the server's may
                    # have changed by then
                lut = _held(lut)
            self._state, self._phase, rb = self._on_device("tail", self._device.tail,
                                                           self._state, self._phase, batch,
                                                           self._lut(lut), kv)
            self._after_step(rb, kv, lut, self._context(batch, req_to_token, lut, requests,
                                                        resolve))

    def _reads_tables(self, requests, resolve) -> bool:
        """Whether a report of this step reads its tables (one step late): ``requests=``
        without ``resolve=``, on one device. Only then is a host table held as the step had it
        (a device copy kept until the readback)."""
        return requests is not None and resolve is None and self._mesh is None

    def _require_state(self, what: str) -> None:
        if self._lost:
            raise CanaryStateLost(f"kv-canary: {what}() has no canary state: {self._lost}. Set "
                                  "manager.state first: a checkpoint of it, or runtime."
                                  "init_state(manager.cfg) over a KV pool that holds no "
                                  "request's KV yet (a fresh state has no canary for cached "
                                  "slots: every check of them would report)")

    def _on_device(self, what: str, launch: Callable, *args):
        """``launch(*args)``; where it raises after taking the state (donated: a failure at run
        time, not while tracing), the manager holds no state from then on
        (:class:`CanaryStateLost`)."""
        try:
            return launch(*args)
        except Exception as e:
            if not state_consumed(self._state):
                raise  # traced or refused before running: the state is as it was
            self._state = None
            # The phase array went with it (donated too): a new one, as the step left it.
            with _config.x64_scope():
                self._phase = health.initial_phase(self._init_finished)
            self._phase_epoch += 1
            self._lost = (f"{what}() at step {self.step_count} failed on the device after "
                          f"taking it ({failure_line(e)})")
            gone = " and the KV passed in" if what == "step" else ""
            raise CanaryStateLost(f"kv-canary: {self._lost}; the canary's state{gone} went with "
                                  "it (donated). The manager holds no state until one is set "
                                  "(manager.state = ...)") from e

    @_serialized
    def observe(self, state=None, *, requests=None, resolve=None):
        """The host side only, after a step the server jitted itself (its state, possibly
        stacked per shard): stage this step's readback, consume the previous one. No sweep (the
        server runs its own). A state that does not continue the previous one (a fresh
        ``init_state()``) is reported from its first row. Returns nothing; raises as
        :meth:`step`."""
        self._require_enabled("observe")
        self._steps_itself = False  # the server's step, and its sweep: an attached walk never runs
        if state is not None:
            self.state = state
        if self.state is None:
            raise ValueError("kv-canary: observe() needs the server's canary state: "
                             "observe(state)")
        with _config.x64_scope():
            rb = self._device.observe(self.state, self._phase)
            self._after_step(rb, None, None, self._context(requests=requests, resolve=resolve),
                             sweep=False)

    @_serialized
    def compile_observe(self, state=None) -> None:
        """Compile what :meth:`observe` runs on the device for ``state``'s shapes (default: the
        state held), and with a coverage window the stats line's count, running nothing: for a
        server's warm-up, when it forbids compiling while it steps. Call it where
        :meth:`observe` will be called (the same mesh context): a jit's cache is keyed by it."""
        self._require_enabled("compile_observe")
        state = self.state if state is None else state
        if state is None:
            raise ValueError("kv-canary: compile_observe() needs the server's canary state: "
                             "compile_observe(state)")
        with _config.x64_scope():
            self._device.compile_observe(state, self._phase)

    @_serialized
    def sweep(self, rows_table, row_indices, lengths, *, kv, lut=None) -> None:
        """Run the sweep now over the given rows (the same arrays the attached walk returns),
        for a server that keeps its own sweep schedule (``attach_radix_cache`` runs it every
        ``sweep_interval`` steps instead). Counts as a sweep pass; what it finds is reported by
        the next step, or by :meth:`flush` / :meth:`close`."""
        self._require_enabled("sweep")
        if self.config.sweep_interval == 0:
            raise ValueError("kv-canary: sweep() with --kv-canary-sweep-interval 0")
        problem = _walk_problem(rows_table, row_indices, lengths)
        if problem:
            raise ValueError(f"kv-canary: sweep(): {problem}; the sweep did not run")
        self._run_sweep(kv, lut, lambda: (rows_table, row_indices, lengths))

    @_serialized
    def resync(self) -> None:
        """After the state was replaced (``manager.state = restored``, a checkpoint whose rows
        were reported already): resume reporting from its current write index (a host read: not
        for the hot path). The readback still pending, the state's before, is reported first,
        under the bookkeeping it was taken with. The next step reads the state's step counter
        too (a restored state may be near the wrap its rebase prevents: runtime.rebase)."""
        self._require_enabled("resync")
        self._rebaser.reset()
        rebase = (np.asarray(jax.device_get(self.state.violation_write_index)),
                  np.asarray(jax.device_get(self.state.kernel_run_counters)))
        staged = self._readbacks.staged
        if staged is not None:
            staged.rebase = rebase
        else:
            self._rebase(*rebase)

    @_serialized
    def flush(self) -> None:
        """Report what is still unreported now (end of serving, tests): the pending readback
        (waits for the last step), then, when a sweep or a HEAD ran after it, a readback of the
        state as it is. Both run even when the first raises (raise mode, a failing
        ``on_violation``): one error then carries the violations of both."""
        if not self.enabled:
            return
        pending = self._readbacks.take()
        first = None
        if pending is not None:
            try:
                self._consume(pending)
            except CanaryAgreementError:
                raise  # the processes no longer step together: no second exchange
            except CanaryViolationError as e:
                first = e  # the readback of the state as it is still runs: raised after it
        if self._unread and self.state is not None:
            self._unread = False
            with _config.x64_scope():
                rb = self._device.observe(self.state, self._phase)
            try:
                self._consume(Staged(self.step_count, rb, self._context(), final=True))
            except CanaryViolationError as e:
                if first is None:
                    raise
                raise _merged(first, e)
            except Exception as e:
                if first is not None:
                    e.add_note(f"(after the pending readback raised: {first})")
                raise
        if first is not None:
            raise first

    def close(self) -> None:
        """End of serving: :meth:`flush`."""
        self.flush()

    # ------------------------------------------------------------------------- internals
    def _require_enabled(self, what):
        if not self.enabled:
            raise ValueError(f"kv-canary: {what}() with --kv-canary none (the canary is off)")

    def _lut(self, lut):
        return self._lut_dummy if lut is None else lut

    def _active_tags(self):
        return self._health.active_tags()

    def _context(self, batch=None, req_to_token=None, lut=None, requests=None, resolve=None):
        return StepContext(batch, req_to_token, lut, requests, resolve,
                           phase_epoch=self._phase_epoch)

    @staticmethod
    def _check_requests(batch, requests) -> None:
        """``requests``: one per real row of ``batch``, or remediation would be handed another
        row's request (refused before anything is donated)."""
        if requests is None:
            return
        if isinstance(requests, (str, bytes)) or not hasattr(requests, "__len__"):
            raise ValueError("kv-canary: requests= must be a sequence of the batch's requests, "
                             f"got {type(requests).__name__}")
        rows = np.asarray(jax.device_get(batch.req_pool_indices)).reshape(-1)
        real = int(np.count_nonzero(rows))
        if len(requests) != real:
            raise ValueError(
                f"kv-canary: requests= has {len(requests)} entries, the batch has {real} "
                "requests (rows whose req_pool_indices is not 0): one request per row, in batch "
                "order, or remediation would be handed another row's request")

    def _rebase(self, write_index, kernel_runs) -> None:
        self._reporter.rebase(write_index, kernel_runs)
        self._health.rebase(kernel_runs)

    def _sweep_due(self) -> bool:
        interval = self.config.sweep_interval
        if interval == 0:
            return False
        c = self.step_count
        if self._last_sweep_step >= 0 and c - self._last_sweep_step < interval:
            return False
        self._last_sweep_step = c
        if self._radix_walk is None and self.sweep_passes == 0 and c >= interval \
                and not self._warned_no_walk and not self.config.draft_worker:
            # A second due sweep and none has run: nothing walks the radix cache (no walk
            # attached, no sweep() of the server's own yet), so its cached slots go unchecked.
            self._warned_no_walk = True
            health_line = (", and the launch-health check will report the SWEEP tags as stalled"
                           if interval <= self.config.health_check_every_n_steps else "")
            logger.warning(
                "kv-canary: sweep_interval %d asks for a sweep every %d steps, but none has run "
                "in the first %d steps (no radix walk is attached with attach_radix_cache, and "
                "no sweep() came): cached slots are not checked and not counted in the "
                "coverage report%s", interval, interval, c, health_line)
        return self._radix_walk is not None

    def _run_sweep(self, kv, lut, walk):
        try:
            table, rows, lengths = walk()
        except Exception as e:
            raise CanaryCallbackError(
                f"kv-canary: the radix walk (attach_radix_cache) raised {e!r} at step "
                f"{self.step_count}; the sweep did not run", callback="radix_walk",
                step=self.step_count) from e
        problem = _walk_problem(table, rows, lengths)
        if problem:
            raise CanaryCallbackError(
                f"kv-canary: the radix walk (attach_radix_cache) returned {problem} at step "
                f"{self.step_count}; the sweep did not run", callback="radix_walk",
                step=self.step_count)
        with _config.x64_scope():
            args = [jnp.asarray(table, jnp.int32), jnp.asarray(rows, jnp.int64),
                    jnp.asarray(lengths, jnp.int64), self._lut(lut)]
            if self._mesh is not None:
                # One walk per shard: the walk returns stacked arrays, or one shard's arrays
                # repeated on every shard.
                if args[0].ndim == 2:
                    args[:3] = [self._device.stack(a) for a in args[:3]]
                if args[3].ndim == 1:
                    args[3] = self._device.stack(args[3])
            self._state = self._device.sweep(self._state, *args, kv)
        self._unread = True
        self.sweep_passes += 1
        logger.info("[canary] sweep succeeded %d times (last_step=%d)", self.sweep_passes,
                    self.step_count)

    def _after_step(self, rb, kv, lut, ctx, *, sweep=True):
        # SGLang's _post_ops_outside_graph: sweep, count the step, then the delayed handlers.
        self._unread = False  # rb covers every launch so far
        walk_failed = None
        if sweep and kv is not None and self._sweep_due():
            try:
                self._run_sweep(kv, lut, self._radix_walk)
            except CanaryCallbackError as e:
                walk_failed = e  # raised once the step is counted and its readback staged
        self.step_count += 1
        if self._device.coverage is not None and health.stats_due(self.config, self.step_count):
            rb = {**rb, "coverage": self._device.coverage(self.state)}  # after the sweep, if any
        previous = self._readbacks.stage(Staged(self.step_count, rb, ctx))
        if previous is not None:
            try:
                self._consume(previous)
            except CanaryViolationError as e:
                if walk_failed is not None:
                    e.add_note(str(walk_failed))
                raise
        if walk_failed is not None:
            raise walk_failed

    def _consume(self, staged: Staged) -> None:
        host = self._readbacks.words(staged)
        step_no, ctx = staged.step, staged.context
        write_index = host["write_index"].reshape(-1)
        phase_errors = self._phase_check.growth(host["phase"], ctx.phase_epoch)
        if not staged.final:
            self._overflow.warn(host["verify_enable"])
        # Over a mesh, the flag the step max-reduced over the mesh axis says whether any shard
        # has any violation: none, no ring to scan.
        any_errored = "errored" not in host or bool(np.max(host["errored"]))
        reports, negative, unrecorded = self._reporter.new_rows(
            step_no, write_index, host["kernel_runs"], any_errored=any_errored,
            ring=lambda: self._readbacks.ring(staged, write_index.size))
        stalled = []
        if not staged.final:
            stalled = self._health.stalled(step_no, host["kernel_runs"])
            counts = self._readbacks.coverage(staged)
            health.log_stats(self.config, step_no, slot_runs=host["slot_runs"],
                             write_index=write_index, sweep_passes=self.sweep_passes,
                             active_tags=len(self._health.active_tags()),
                             coverage=None if counts is None else _coverage.from_counts(
                                 self.cfg, counts, sweep_interval=self.config.sweep_interval,
                                 write_index=write_index))
        # Remediation: the callback sees every new violation, with its request, before a raise.
        failure = None
        if reports:
            reports, failure = self._reporter.hand_over(
                reports, ctx, log=self.config.mode == "log", on_violation=self._on_violation)
        if staged.rebase is not None:
            self._rebase(*staged.rebase)
        self._decide(step_no, reports, stalled, phase_errors, negative, failure, unrecorded)

    def _decide(self, step_no, reports, stalled, phase_errors, negative, failure, unrecorded):
        raise_mode = self.config.mode == "raise"
        first = reports[0].violation if reports else None
        first_tag = "" if first is None else (
            first.tag if first.tag in consts.CanaryLaunchTag.__members__ else "?")
        mine = Finding(
            step=step_no, new_violations=len(reports) if raise_mode else 0,
            first_slot=first.slot if first else -1, first_tag=first_tag,
            first_shard=reports[0].shard if reports else -1, stalled_tags=len(stalled),
            phase_errors=phase_errors, negative_index=len(negative),
            # A full ring drops the rows of later violations: in raise mode they raise, counted
            # (logged in every mode), or a server serving on past a long incident goes blind.
            unrecorded=sum(n for _, n, _ in unrecorded) if raise_mode else 0)
        detail = [health.stalled_message(stalled, step_no)] if stalled else []
        if any(t.startswith("SWEEP") for t in stalled) and (
                self._radix_walk is None or not self._steps_itself):
            # (observe mode: the server's own step, and its own sweep: an attached walk never
            # runs there)
            how = ("no radix walk is attached (attach_radix_cache) and sweep() was not called"
                   if self._steps_itself else "the server's own sweep (an integration's: "
                   "sglang_jax.sweep, the tpu-inference guard's) did not run or was not handed "
                   "to this manager")
            detail.append(f"kv-canary: no sweep ran since the previous check: {how}, while "
                          f"sweep_interval {self.config.sweep_interval} asks for a sweep every "
                          f"{self.config.sweep_interval} steps")
        if phase_errors:
            detail.append(health.phase_message(phase_errors))
        detail += negative
        if raise_mode:
            detail += [r.message for r in reports] + [m for _, _, m in unrecorded]
        if failure is not None:
            detail.insert(0, f"kv-canary: {failure.callback} raised {failure.error!r} on the "
                             f"violations of step {step_no} (carried here, each logged in log "
                             "mode and handed to every other on_violation call)")
        cause = failure.error if failure is not None else None
        try:
            everyone = self._agreement.exchange(mine)
        except AgreementFailure as e:
            raise CanaryAgreementError("\n".join([f"kv-canary agreement: {e.reason}"] + detail),
                                       peers=e.peers, step=step_no, reports=reports) from cause
        ranks, lines = {}, []
        for rank, f in everyone.items():
            where = f"rank {rank}" + (f" shard {f.first_shard}" if self._mesh is not None else "")
            if f.new_violations:
                ranks[rank] = (f.new_violations, f.first_slot, f.first_tag)
                lines.append(f"kv-canary: {where}: {f.new_violations} new violation(s) at step "
                             f"{step_no}, first slot_idx={f.first_slot} "
                             f"launch_tag={f.first_tag}")
            if f.stalled_tags:
                lines.append(f"kv-canary: rank {rank}: {f.stalled_tags} launch tag(s) stopped "
                             "running")
            if f.phase_errors:
                lines.append(f"kv-canary: rank {rank}: phase check failed {f.phase_errors} "
                             "time(s)")
            if f.negative_index:
                lines.append(f"kv-canary: rank {rank}: violation_write_index is negative")
            if f.unrecorded:
                lines.append(f"kv-canary: rank {rank}: {f.unrecorded} violation(s) at step "
                             f"{step_no} not recorded: the violation ring is full")
        if failure is not None:
            raise CanaryCallbackError("\n".join(detail[:1] + lines + detail[1:]),
                                      callback=failure.callback, step=step_no, reports=reports,
                                      ranks=ranks) from cause
        if any(f.raises for f in everyone.values()):
            raise CanaryViolationError("\n".join(lines + detail), step=step_no,
                                       reports=reports if raise_mode else (), ranks=ranks)


def _merged(first: CanaryViolationError, second: CanaryViolationError) -> CanaryViolationError:
    """One error for two readbacks that both raised (``flush``): the more specific of the two
    (an agreement failure, then a failing callback, then a violation), carrying both's
    violations in order and each rank's counts summed; the other's message as a note."""
    def weight(e):
        if isinstance(e, CanaryAgreementError):
            return 2
        return int(isinstance(e, CanaryCallbackError))

    keep, other = (second, first) if weight(second) > weight(first) else (first, second)
    keep.reports = tuple(first.reports) + tuple(second.reports)
    ranks = dict(first.ranks)
    for rank, (n, slot, tag) in second.ranks.items():
        ranks[rank] = (ranks[rank][0] + n, *ranks[rank][1:]) if rank in ranks else (n, slot, tag)
    keep.ranks = ranks
    keep.add_note(str(other))
    return keep


def _is_fresh(state) -> bool:
    """Whether ``state`` recorded nothing yet (``init_state``): no violation, no launch. A host
    read of two small arrays."""
    index, runs = jax.device_get((state.violation_write_index, state.kernel_run_counters))
    return not np.any(np.asarray(index)) and not np.any(np.asarray(runs))


def _held(x):
    """A host (numpy) table as the device array the step takes anyway: the report reads the
    step's table one step late, when the server may have rewritten its own (a recycled row
    would name another request, or none)."""
    return jnp.asarray(x) if isinstance(x, np.ndarray) else x


def _walk_problem(rows_table, row_indices, lengths) -> str | None:
    """What makes a sweep's rows unusable, or None. A prefix longer than its table's row (its
    plan would read past the row, SGLang's unbounded read, and overflow the sweep's capacity,
    which then checks nothing) and a row index outside the table (its slots would be read from
    no row) are refused before anything runs: a sweep that checks less than it was given must
    not count as a sweep (the coverage report and the steps' left-to-the-sweep rule rely on
    it). A host read of the row indices and lengths (a sweep runs every few steps)."""
    shape = tuple(np.shape(rows_table))  # the table itself may be the live pool: not copied
    rows, lens = np.asarray(row_indices), np.asarray(lengths)
    if len(shape) < 2 or rows.shape != lens.shape:
        return (f"rows_table of shape {shape} (rows x columns, per shard stacked), "
                f"row_indices of shape {rows.shape} and lengths of shape {lens.shape} (the same)")
    width, height = shape[-1], shape[-2]
    long = np.nonzero(lens > width)
    if long[0].size:
        at = tuple(int(i[0]) for i in long)
        return (f"a prefix of {int(lens[at])} slots (lengths{list(at)}) for a table of {width} "
                f"columns")
    bad = np.nonzero((rows < 0) | (rows >= height))
    if bad[0].size:
        at = tuple(int(i[0]) for i in bad)
        return f"row index {int(rows[at])} (row_indices{list(at)}) for a table of {height} rows"
    return None
