"""The tpu-inference guard's on-device decode loop (``continue_decode``'s ``lax.while_loop``).

The canary's state travels in the loop's carry as a trailing entry of its ``kv_caches``
(:class:`Carried`: the loop passes ``kv_caches`` through untouched), and every iteration's step
runs HEAD -> the runner's step -> TAIL (:meth:`DecodeLoop._loop_step`, the guard's
``model.step_fn_no_options``). ``runner._execute_continue_decode`` appends the entry before the
loop and takes it back after (:meth:`DecodeLoop._continue_decode`); the loop's warm-up in
``capture_model()`` runs with a throwaway entry, so the loop compiles there over the carry it
serves with (:meth:`DecodeLoop._precompile_loop`): a runner that forbids compiling while it
steps (``VLLM_XLA_CHECK_RECOMPILATION=1``) serves the loop guarded.

:class:`DecodeLoop` is a part of :class:`~.guard.TpuInferenceGuard` (its base): it reads the
guard's runner, canary, state, books, jits and lock, and calls its host side.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvcanary_jax.integrations.tpu_inference import device

__all__ = ["Carried", "DecodeLoop"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Carried:
    """The canary's entry in the decode loop's ``kv_caches``: the packed state
    (:func:`~.device.pack_state`, the step's expected-id delta applied), each batch row's pool
    row + 1 (None without token checks) and the blocks' first slots written since the canary
    started (:class:`~.host.Unwritten`; None: every block the loop reads was)."""

    state: Any
    rows: Any = None
    unwritten: Any = None


class DecodeLoop:
    """The decode loop's part of :class:`~.guard.TpuInferenceGuard`."""

    def _loop_step(self, state_leaves, kv_caches, *args, **kwargs):
        step = self._orig["step_fn_no_options"]
        if not (isinstance(kv_caches, (list, tuple)) and kv_caches
                and isinstance(kv_caches[-1], Carried)):
            return step(state_leaves, kv_caches, *args, **kwargs)
        carried, real = kv_caches[-1], list(kv_caches[:-1])
        input_ids, md, _embeds, input_positions = args[0], args[1], args[2], args[3]
        model_x64 = bool(jax.config.read("jax_enable_x64"))

        def model(kv_in):
            with jax.enable_x64(model_x64):
                return step(state_leaves, kv_in, *args, **kwargs)

        with jax.enable_x64(True):
            state = device.unpack_state(carried.state, device.state_shapes(self.canary))
            state, out = device.guarded_step(self.canary, model, state, carried.rows, md,
                                             input_ids, input_positions, real,
                                             unwritten=carried.unwritten)
            new = Carried(state=device.pack_state(state), rows=carried.rows,
                          unwritten=carried.unwritten)
        return (list(out[0]) + [new], *out[1:])

    def _precompile_loop(self) -> None:
        """tpu-inference's warm-up of the on-device decode loop (``capture_model()`` calls
        ``compilation_manager._precompile_continue_decode``, which queues a run of the loop per
        request padding, then runs them): the queued runs go with a :class:`Carried` entry of
        a throwaway copy of the state in ``runner.kv_caches``, so the loop compiles over the
        carry it serves with, the canary's HEAD and TAIL in its step; the entry is taken back
        after (unpacked: that compiles too). When the runner forbids compiling while it steps,
        its own loop (its own step, no entry: what it runs after :meth:`uninstall`) is warmed
        first as well, whatever ``guard.warm_up``; ``guard.warm_up = False`` otherwise leaves
        the runner's own warm-up as it is."""
        runner, c = self.runner, self.canary
        with self._lock:
            if self._forbids:
                model = runner.model
                model.step_fn_no_options = self._orig["step_fn_no_options"]
                try:
                    self._orig["precompile_loop"]()  # queued with the runner's own step
                finally:
                    model.step_fn_no_options = self._loop_step
                runner.compilation_manager._flush_compilations()
            elif not self.warm_up:
                self._orig["precompile_loop"]()
            if not self.warm_up:
                return
            self._orig["precompile_loop"]()
            with self._context():
                rows = (self._placed(np.zeros((c.data_shards * c.max_reqs,), np.int32))
                        if c.token_checks else None)
                carried = Carried(state=self._pack(self.state), rows=rows,
                                  unwritten=jnp.copy(self._all_written))
            runner.kv_caches = list(runner.kv_caches) + [carried]
            try:
                runner.compilation_manager._flush_compilations()
            finally:
                kvs = list(runner.kv_caches)
                if kvs and isinstance(kvs[-1], Carried):
                    runner.kv_caches = kvs[:-1]
                    with jax.enable_x64(True):
                        jax.block_until_ready(self._unpack(kvs[-1].state))
            self._warmed_loop = True

    def _continue_decode(self, scheduler_output):
        with self._lock:
            if not self._prepared:
                return self._orig["continue"](scheduler_output)
            return self._guarded_continue_decode(scheduler_output)

    def _guarded_continue_decode(self, scheduler_output):
        runner = self.runner
        if self._forbids and not self._warmed_loop:
            # Said before anything runs: inside the runner's check the loop, compiled here over
            # the canary's carry, would raise mid-step.
            self._failed()
            raise RuntimeError(
                "kv-canary tpu-inference: the runner forbids compiling while it steps "
                "(VLLM_XLA_CHECK_RECOMPILATION=1), and its on-device decode loop was not "
                "compiled over the guard's state in the runner's warm-up: install the guard "
                "before capture_model(), keep guard.warm_up True, and let the warm-up run "
                "(SKIP_JAX_PRECOMPILE unset, enforce_eager off)")
        try:
            with self._context():
                pending, rows = self._apply_delta()
                packed = self._pack(self.state)
        except BaseException:
            self._failed()
            raise
        self.state = None  # donated into the loop's carry
        # The loop donates its whole carry: the kept all-written mask goes in as a copy.
        runner.kv_caches = list(runner.kv_caches) + [
            Carried(state=packed, rows=rows, unwritten=jnp.copy(self._unwritten_arg()))]
        failed = True
        try:
            out = self._orig["continue"](scheduler_output)
            failed = False
        except BaseException:
            self.book.reset()
            self._prepared = False
            raise
        finally:
            try:
                self._take_carried(failed)
            except BaseException:
                self.book.reset()
                self._prepared = False
                raise
            finally:
                self._restart_if_taken()
        self._after_step(pending)
        return out

    def _take_carried(self, failed: bool) -> None:
        """The loop's carried state back into ``self.state``, its entry out of the runner's
        ``kv_caches``. After a failed loop a carry it took with it (donated) is let go: the
        loop's own error goes on, not this one."""
        kvs = list(self.runner.kv_caches)
        if not (kvs and isinstance(kvs[-1], Carried)):
            return
        self.runner.kv_caches = kvs[:-1]
        try:
            with jax.enable_x64(True):
                self.state = self._unpack(kvs[-1].state)
        except Exception:
            if not failed:
                raise
