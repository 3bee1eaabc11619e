"""The canary installed in sglang-jax's ``ModelRunner`` (0.0.2 and 0.1.0rc0).

:class:`ModelRunnerHook` replaces the runner's ``jitted_run_model`` (the hook sglang-jax's
``_forward`` calls) with the guarded step (:func:`guard_model_step`) around the runner's own
step body (:mod:`~kvcanary_jax.integrations.sglang_jax.runners`: found in the runner, never
re-implemented), over the same model definition, weights and pools; the runner keeps storing
the pools the step returns. On 0.1.0rc0 it also replaces ``jitted_run_and_sample``, the fused
decode step of ``forward_and_sample``, with the guarded fused body, so no step runs unguarded.
:class:`ManagedModelRunnerHook` adds a :func:`canary_manager` running the host side after every
step, and, when that raises, stores the step's new buffers in the runner's pools
(:func:`store_kv`, as the runner would have) before the error propagates.
"""

from __future__ import annotations

import logging

import numpy as np

from kvcanary_jax.integrations.sglang_jax.layout import SglangJaxCanary
from kvcanary_jax.integrations.sglang_jax.remediation import observe, request_resolver
from kvcanary_jax.integrations.sglang_jax.runners import RunnerApi, runner_api
from kvcanary_jax.integrations.sglang_jax.step import guard_model_step
from kvcanary_jax.integrations.sglang_jax.sweep import hold
from kvcanary_jax.integrations.sglang_jax.tokens import TokenDelta, TokenFeed
from kvcanary_jax.runtime import CanaryStateLost, CanaryViolationError
from kvcanary_jax.runtime.reporting import failure_line, state_consumed

__all__ = [
    "ModelRunnerHook",
    "ManagedModelRunnerHook",
    "store_kv",
]


def _slots_in_use(model_runner) -> int:
    """KV slots the runner's allocator has handed out (every data-parallel rank's), 0 where the
    allocator is not found or not one of sglang-jax's (``size``, ``available_size``)."""
    alloc = getattr(model_runner, "token_to_kv_pool_allocator", None)
    # 0.1.0rc0's SWA hybrid: its available_size() is the smaller of its two pools' (the sliding
    # window's is smaller by design); the full-attention pool's is the one to read.
    alloc = getattr(alloc, "full_attn_allocator", alloc)
    size = getattr(alloc, "size", None)
    if not isinstance(size, int) or not callable(getattr(alloc, "available_size", None)):
        return 0
    try:
        ranks = int(getattr(alloc, "dp_size", 1) or 1)
        if ranks == 1:
            return max(size - int(alloc.available_size()), 0)
        per_rank = size // ranks
        return sum(max(per_rank - int(alloc.available_size(dp_rank=r)), 0) for r in range(ranks))
    except Exception:  # noqa: BLE001  (an allocator of another shape: no warning, not a failure)
        return 0


def store_kv(model_runner, layers, forward_batch) -> None:
    """Store a step's new pool buffers in the runner, as sglang-jax's ``ModelRunner._forward``
    does after ``jitted_run_model``: 0.1.0rc0, ``memory_pools.replace_all(layers)`` (the step's
    pool-update dict, or the KV layers alone); 0.0.2, ``_set_kv_cache_after_forward`` (a runner
    without either: the pool's ``kv_buffer`` slice from ``start_layer``)."""
    pools = getattr(model_runner, "memory_pools", None)
    if hasattr(pools, "replace_all"):
        pools.replace_all(layers)
        return
    set_after = getattr(model_runner, "_set_kv_cache_after_forward", None)
    if set_after is not None:
        set_after(layers, forward_batch)
        return
    pool = model_runner.token_to_kv_pool
    start = getattr(pool, "start_layer", 0)
    pool.kv_buffer[start : start + len(layers)] = layers


logger = logging.getLogger(__name__)

# The guarded steps' argument positions: the runner's own order.
_MODEL_ARGS = {"batch_argnum": 3, "pool_argnum": 4, "static_argnums": (1,)}
# jitted_run_and_sample(model_def, model_state_def, leaves, forward_batch, memory_pools,
# logits_metadata, sampler_def, sampler_state_def, sampler_leaves, use_sort_for_toppk_minp,
# rng_step, sampling_metadata, future_token_ids_map)
_FUSED_ARGS = {"batch_argnum": 3, "pool_argnum": 4, "static_argnums": (1, 7, 9),
               "future_map_argnum": 12}
_GUARDED = {"jitted_run_model": "_run", "jitted_run_and_sample": "_run_and_sample"}
_FUSED_UPDATES = 2  # the pool updates' place in jitted_run_and_sample's result


class ModelRunnerHook:
    """The canary installed in an sglang-jax ``ModelRunner`` (0.0.2 or 0.1.0rc0, read from the
    runner: another version is refused here, with what was found).

    Replaces the runner's ``jitted_run_model`` (the hook sglang-jax's ``_forward`` calls), and on
    0.1.0rc0 its fused ``jitted_run_and_sample``, with the guarded step over the runner's own
    body, model definition, weights and pools; the runner keeps storing the buffers the step
    returns. Before each ``model_runner.forward`` (or ``forward_and_sample``), give the step's
    expected token ids with :meth:`expect` (with ``token_checks``): with ``token_rows``,
    ``hook.expect(hook.feed.delta(reqs, model_worker_batch))`` (``reqs``: ``batch.reqs``, or per
    DP rank ``[info.reqs for info in batch.reqs_info]``), else :func:`expected_tokens`.
    With the canary's ``coverage_window`` both guarded steps hand it every layer of the pool
    they return (sweep with ``sweep(..., layers=runner.token_to_kv_pool.kv_buffer)``).
    ``state`` is the canary's device state; ``feed`` its :class:`TokenFeed` (None without
    ``token_rows``); ``version`` the sglang-jax version found. A step refused before it runs (a
    delta made for another batch, ...) leaves the runner's pools, the state and the feed as they
    were.

    A step that fails on the device after taking the donated state (and the runner's pools)
    raises :class:`~kvcanary_jax.runtime.CanaryStateLost`; the hook refuses every later step
    with it (its state went with the step): install a new hook, over a pool that holds no
    request's KV.

    A new hook starts a new state: KV already in the pool was written under no canary of its,
    and every step that reads it would report it. Install before the runner serves; to install
    again on a serving runner (after :meth:`uninstall`), pass ``resume=`` the previous hook: the
    new one takes over its state and feed. A hook installed without ``resume`` on a runner whose
    allocator has slots in use logs a warning saying so.
    """

    def __init__(self, canary: SglangJaxCanary, model_runner, *, resume=None):
        if resume is not None:
            if not isinstance(resume, ModelRunnerHook):
                raise TypeError("kv-canary sglang-jax: resume= takes the previous "
                                f"ModelRunnerHook, got {type(resume).__name__}")
            if resume.canary is not canary and resume.canary != canary:
                raise ValueError("kv-canary sglang-jax: resume= takes a hook of the same canary "
                                 "(its state is laid out for that canary's sizes)")
            if resume._installed or resume._resumed:
                raise ValueError(
                    "kv-canary sglang-jax: resume= takes a hook that was uninstalled and not "
                    "resumed already (" + ("it is still installed: call its uninstall() first"
                                           if resume._installed else "another hook took over "
                                           "its state") + ")")
        api = runner_api(model_runner)  # refuses a runner that has a hook installed
        self.canary = canary
        self.version = api.version
        self._installed, self._resumed = True, False
        self._lost = ""  # why the hook holds no state (a step failed on the device), or ""
        if resume is not None:
            self.state, self.feed = resume.state, resume.feed
            resume._resumed = True
        else:
            self.state = canary.init_state()
            self.feed = TokenFeed(canary) if canary.token_rows is not None else None
            in_use = _slots_in_use(model_runner)
            if in_use:
                logger.warning(
                    "kv-canary sglang-jax: the runner's allocator has %d KV slot(s) in use "
                    "before this hook's canary: every step that reads one written before it (a "
                    "prefix-cache hit, a running request) will report violations. Install "
                    "before the runner serves, flush the radix cache first, or pass resume= "
                    "the previous hook", in_use)
        self._api: RunnerApi = api
        self._runner = model_runner
        self._pending: dict = {}
        self._unguarded = {"jitted_run_model": model_runner.jitted_run_model}
        layer = canary.layer
        # With a coverage window the TAIL digests every layer of the pool the step returns.
        every = {}
        if canary.coverage_window:
            every = {"kv_layers": lambda out, pools: api.kv_layers(out[1])}
        self._step = guard_model_step(
            canary, api.run_model, **_MODEL_ARGS, **every,
            fused_kv=lambda out, pools: api.canary_layer(out[1], pools, layer))
        model_runner.jitted_run_model = self._run
        self._fused = None
        if api.run_and_sample is not None and api.sampler is not None:
            if canary.coverage_window:
                every = {"kv_layers": lambda out, pools: api.kv_layers(out[_FUSED_UPDATES])}
            self._fused = guard_model_step(
                canary, api.run_and_sample, **_FUSED_ARGS, **every,
                fused_kv=lambda out, pools: api.canary_layer(out[_FUSED_UPDATES], pools, layer))
            self._unguarded["jitted_run_and_sample"] = model_runner.jitted_run_and_sample
            model_runner.jitted_run_and_sample = self._run_and_sample

    def expect(self, expected: np.ndarray | TokenDelta | None = None,
               table: np.ndarray | None = None) -> None:
        """The next step's :func:`expected_tokens` or :class:`TokenDelta` (and optional
        :func:`host_table`)."""
        self._pending = {"expected": expected, "table": table}

    def _guarded(self, step, *args, **pending):
        """``step(state, *args)``: the new state kept, the output returned. A step refused before
        it runs donates nothing and records nothing in the feed (the runner's pools, the state
        and the feed are as they were); one that fails on the device after taking the state
        leaves the hook without one (:class:`CanaryStateLost`, here and at every later step)."""
        if self._lost:
            raise CanaryStateLost(f"kv-canary sglang-jax: this hook has no canary state: "
                                  f"{self._lost}. Install a new hook over a pool that holds no "
                                  "request's KV")
        try:
            self.state, out = step(self.state, *args, **pending)
        except Exception as e:
            if not state_consumed(self.state):
                raise  # traced or refused before it ran: the state is as it was
            self._lost = f"a step failed on the device after taking it ({failure_line(e)})"
            self.state = None
            raise CanaryStateLost(f"kv-canary sglang-jax: {self._lost}; the canary's state and "
                                  "the runner's pools passed in went with it (donated)") from e
        return out

    def _run(self, forward_batch, logits_metadata):
        api = self._api
        pending, self._pending = self._pending, {}
        return self._guarded(self._step, api.model_def, api.model_state_def, api.leaves(),
                             forward_batch, api.pools(), logits_metadata, **pending)

    def _run_and_sample(self, forward_batch, logits_metadata, sampling_metadata, future_map):
        # As 0.1.0rc0's run_and_sample_wrapper: one sampler step per call, the weights and
        # pools as the runner holds them now.
        api, runner = self._api, self._runner
        runner._sampler_step += 1
        sampler_def, sampler_state_def, sampler_leaves = api.sampler
        pending, self._pending = self._pending, {}
        return self._guarded(
            self._fused, api.model_def, api.model_state_def, api.leaves(), forward_batch,
            api.pools(), logits_metadata, sampler_def, sampler_state_def, sampler_leaves,
            runner.use_sort_for_toppk_minp, runner._sampler_step, sampling_metadata, future_map,
            **pending)

    def uninstall(self) -> None:
        """Give the runner its own steps back (the hook keeps its state and feed, for
        ``resume=``)."""
        if not self._installed:
            return  # again: another hook may own the runner now
        for name, fn in self._unguarded.items():
            if getattr(self._runner, name) == getattr(self, _GUARDED[name]):
                setattr(self._runner, name, fn)
        self._installed = False


class ManagedModelRunnerHook(ModelRunnerHook):
    """:class:`ModelRunnerHook` with a :func:`canary_manager` running the host side after every
    guarded step (``manager.observe``), the fused decode step's too. Give each step's requests
    with ``expect(..., reqs=batch.reqs)`` (per DP rank: the ranks' lists) so violations reach
    ``on_violation`` with their request.

    When the manager raises after a step (raise mode, the health and phase checks), the step
    has run and its new KV buffers are stored in the runner's pool (:func:`store_kv`) before the
    error propagates: the runner keeps serving-ready KV, and a ``CanaryViolationError`` carries
    the same buffers as ``kv``."""

    def __init__(self, canary: SglangJaxCanary, model_runner, manager, *, resume=None):
        if not getattr(manager, "enabled", False):
            raise ValueError("kv-canary sglang-jax: the manager runs --kv-canary none: install no "
                             "hook at all (the canary is off)")
        previous = getattr(resume, "manager", None)
        if resume is not None and previous is not None and previous is not manager \
                and not getattr(resume, "_installed", False):
            # Another manager had the state: it reports its last step's readback first (before
            # anything is installed here: in raise mode that may raise).
            previous.flush()
        super().__init__(canary, model_runner, resume=resume)
        self.manager = manager
        self._reqs = None
        if resume is not None and previous is not manager:
            # This one reads the state's ring from where it stands (its rows were reported, or,
            # from an unmanaged hook, were the caller's to read), not from row 0.
            try:
                with manager.lock:
                    hold(manager, canary, self.state)
                    manager.resync()
            except BaseException:
                self.uninstall()  # the runner keeps its own steps, as before this call
                self._installed, resume._resumed = False, False
                raise

    def expect(self, expected: np.ndarray | TokenDelta | None = None,
               table: np.ndarray | None = None, *, reqs=None) -> None:
        super().expect(expected, table)
        self._reqs = reqs

    # Each guarded step holds the manager's lock from the call that donates the state until the
    # manager holds the new one: the manager's calls from another thread (coverage(), flush())
    # never read a donated state.
    def _run(self, forward_batch, logits_metadata):
        with self.manager.lock:
            out = self._lost_with_manager(super()._run, forward_batch, logits_metadata)
            self._observe(out[1], forward_batch)
        return out

    def _run_and_sample(self, forward_batch, logits_metadata, sampling_metadata, future_map):
        with self.manager.lock:
            out = self._lost_with_manager(super()._run_and_sample, forward_batch,
                                          logits_metadata, sampling_metadata, future_map)
            self._observe(out[_FUSED_UPDATES], forward_batch)
        return out

    def _lost_with_manager(self, run, *args):
        try:
            return run(*args)
        except CanaryStateLost:
            self.manager.state = None  # it held the state the step took: nothing to read now
            raise

    def _observe(self, updates, forward_batch) -> None:
        reqs, self._reqs = self._reqs, None
        try:
            resolve = (request_resolver(reqs, self._runner.req_to_token_pool)
                       if reqs is not None else None)
            observe(self.manager, self.canary, self.state, resolve=resolve)
        except BaseException as e:
            # The step ran: the pools passed in were donated, and the runner stores the step's
            # buffers only when this returns. Store them now, as the runner would, so it keeps
            # serving-ready KV, and hand the KV layers with the error as CanaryManager.step does.
            store_kv(self._runner, updates, forward_batch)
            if isinstance(e, CanaryViolationError):
                e.kv = self._api.kv_layers(updates)
            raise
