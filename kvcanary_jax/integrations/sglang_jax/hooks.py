"""The canary installed in sglang-jax 0.0.2's ``ModelRunner``.

:class:`ModelRunnerHook` replaces the runner's ``jitted_run_model`` (the hook sglang-jax's
``_forward`` calls) with the guarded step (:func:`guard_model_step`) over the same model
definition, weights and KV pool; the runner keeps storing the KV buffers the step returns.
:class:`ManagedModelRunnerHook` adds a :func:`canary_manager` running the host side after every
step, and, when that raises, stores the step's new buffers in the runner's pool
(:func:`store_kv`, as the runner would have) before the error propagates.
"""

from __future__ import annotations

import jax
import numpy as np

from kvcanary_jax.integrations.sglang_jax.layout import SglangJaxCanary
from kvcanary_jax.integrations.sglang_jax.remediation import request_resolver
from kvcanary_jax.integrations.sglang_jax.step import guard_model_step
from kvcanary_jax.integrations.sglang_jax.tokens import TokenDelta, TokenFeed
from kvcanary_jax.runtime import CanaryViolationError

__all__ = [
    "ModelRunnerHook",
    "ManagedModelRunnerHook",
    "store_kv",
]


def _run_model(model_def, model_state_def, model_state_leaves, forward_batch, token_to_kv_pool,
               logits_metadata):
    """sglang-jax 0.0.2's ``jitted_run_model`` body (``ModelRunner.initialize_jit``)."""
    from flax import nnx

    state = jax.tree_util.tree_unflatten(model_state_def, model_state_leaves)
    return nnx.merge(model_def, state)(forward_batch, token_to_kv_pool, logits_metadata)


def store_kv(model_runner, layers, forward_batch) -> None:
    """Store a step's new fused KV buffers in the runner's pool, as sglang-jax 0.0.2's
    ``ModelRunner._forward`` does after ``jitted_run_model`` (its
    ``_set_kv_cache_after_forward``; a runner without it: the pool's ``kv_buffer`` slice from
    ``start_layer``)."""
    set_after = getattr(model_runner, "_set_kv_cache_after_forward", None)
    if set_after is not None:
        set_after(layers, forward_batch)
        return
    pool = model_runner.token_to_kv_pool
    start = getattr(pool, "start_layer", 0)
    pool.kv_buffer[start : start + len(layers)] = layers


class ModelRunnerHook:
    """The canary installed in an sglang-jax 0.0.2 ``ModelRunner``.

    Replaces the runner's ``jitted_run_model`` (the hook sglang-jax's ``_forward`` calls) with the
    guarded step over the same model definition, weights and KV pool; the runner keeps storing
    the KV buffers the step returns. Before each ``model_runner.forward``, give the step's expected
    token ids with :meth:`expect` (with ``token_checks``): with ``token_rows``,
    ``hook.expect(hook.feed.delta(batch.reqs, model_worker_batch))``, else
    :func:`expected_tokens`. ``state`` is the canary's device state; ``feed`` its
    :class:`TokenFeed` (None without ``token_rows``). A step refused before it runs (a delta
    made for another batch, ...) leaves the runner's pool, the state and the feed as they were.
    """

    def __init__(self, canary: SglangJaxCanary, model_runner):
        from flax import nnx

        model_def, model_state = nnx.split(model_runner.model)
        leaves, state_def = jax.tree_util.tree_flatten(model_state)
        self.canary = canary
        self.state = canary.init_state()
        self.feed = TokenFeed(canary) if canary.token_rows is not None else None
        self._runner = model_runner
        self._model = (model_def, state_def, leaves)
        self._pending: dict = {}
        self._unguarded = model_runner.jitted_run_model
        self._step = guard_model_step(
            canary, _run_model, batch_argnum=3, pool_argnum=4, static_argnums=(1,),
            fused_kv=lambda out, pool: out[1][canary.layer - pool.start_layer])
        model_runner.jitted_run_model = self._run

    def expect(self, expected: np.ndarray | TokenDelta | None = None,
               table: np.ndarray | None = None) -> None:
        """The next step's :func:`expected_tokens` or :class:`TokenDelta` (and optional
        :func:`host_table`)."""
        self._pending = {"expected": expected, "table": table}

    def _run(self, forward_batch, logits_metadata):
        # A step refused before it runs donates nothing and records nothing in the feed: the
        # runner's pool, the state and the feed are as they were.
        model_def, state_def, leaves = self._model
        pending, self._pending = self._pending, {}
        self.state, out = self._step(self.state, model_def, state_def, leaves, forward_batch,
                                     self._runner.token_to_kv_pool, logits_metadata, **pending)
        return out

    def uninstall(self) -> None:
        """Give the runner its own ``jitted_run_model`` back."""
        self._runner.jitted_run_model = self._unguarded


class ManagedModelRunnerHook(ModelRunnerHook):
    """:class:`ModelRunnerHook` with a :func:`canary_manager` running the host side after every
    guarded step (``manager.observe``). Give each step's requests with
    ``expect(..., reqs=batch.reqs)`` so violations reach ``on_violation`` with their request.

    When the manager raises after a step (raise mode, the health and phase checks), the step
    has run and its new KV buffers are stored in the runner's pool (:func:`store_kv`) before the
    error propagates: the runner keeps serving-ready KV, and a ``CanaryViolationError`` carries
    the same buffers as ``kv``."""

    def __init__(self, canary: SglangJaxCanary, model_runner, manager):
        if not getattr(manager, "enabled", False):
            raise ValueError("kv-canary sglang-jax: the manager runs --kv-canary none: install no "
                             "hook at all (the canary is off)")
        super().__init__(canary, model_runner)
        self.manager = manager
        self._reqs = None

    def expect(self, expected: np.ndarray | TokenDelta | None = None,
               table: np.ndarray | None = None, *, reqs=None) -> None:
        super().expect(expected, table)
        self._reqs = reqs

    def _run(self, forward_batch, logits_metadata):
        out = super()._run(forward_batch, logits_metadata)
        reqs, self._reqs = self._reqs, None
        try:
            resolve = (request_resolver(reqs, self._runner.req_to_token_pool)
                       if reqs is not None else None)
            self.manager.observe(self.state, resolve=resolve)
        except BaseException as e:
            # The step ran: the pool passed in was donated, and the runner stores the step's
            # buffers only when this returns. Store them now, as the runner would, so it keeps
            # serving-ready KV, and hand them with the error as CanaryManager.step does.
            layers = out[1]
            store_kv(self._runner, layers, forward_batch)
            if isinstance(e, CanaryViolationError):
                e.kv = layers
            raise
        return out
