"""The guard installed in a tpu-inference 0.32 ``TPUModelRunner``, with no fork.

:func:`install` checks the runner (its version, the attributes the guard wraps, the features it
does not cover, the canary layer's KV layout) and refuses what it cannot guard, before it
changes anything. Then it wraps four attributes of that runner instance, and one of its
compilation manager:

* ``runner.persistent_batch_manager.update_states``: after the runner's own update, the step's
  batch order, its expected-id delta (:class:`~.host.TokenBook`) and the blocks it writes
  (:class:`~.host.CachedBlocks`);
* ``runner.model_fn`` (every step but the on-device decode loop): HEAD (a jit of the canary's)
  -> the runner's own ``model_fn``, as it compiled it -> TAIL (another), the canary state
  donated through both. With token checks HEAD writes the step's expected ids into the state's
  pool with the step's own, in one pass; a delta bigger than the step's token count (a prompt
  whose prefix the cache holds, a chunked prompt's first chunk) goes into the pool first, by a
  third, small jit. The model is never compiled again for the canary: the canary's jits are
  keyed by the step's token bucket (HEAD and TAIL, each with or without the late split) and
  the delta's id bucket, and compile in the runner's own warm-up
  (``capture_model()``) when the guard is installed before it. Only a step ``update_states``
  described is guarded (its batch rows, expected ids and block owners come from there); any
  other call (a warm-up, a second call of the same step) runs the runner's own ``model_fn``,
  and so does ``_execute_continue_decode``;
* ``runner.model.step_fn_no_options``, the step ``continue_decode`` calls in its
  ``lax.while_loop``: HEAD -> step -> TAIL in every iteration, the canary state travelling in
  the loop's carry as a trailing entry of its ``kv_caches`` (a :class:`Carried`: the loop
  passes ``kv_caches`` through untouched). A call without that entry (a warm-up the guard
  did not reach) runs the step unguarded;
* ``runner._execute_continue_decode``: appends the :class:`Carried` entry to
  ``runner.kv_caches`` for the loop and takes it back after (everything else that walks
  ``runner.kv_caches`` never sees it);
* ``runner.compilation_manager._precompile_continue_decode`` (the warm-up of the loop, in
  ``capture_model()``): its runs go with a :class:`Carried` entry, so that the loop compiles
  there over the carry it serves with (:meth:`TpuInferenceGuard._precompile_loop`).

After every guarded step the guard runs the host side: the runtime manager
(:class:`~kvcanary_jax.runtime.CanaryManager` in observe mode: SGLang's modes, readback one step
late, reporting, launch health, agreement across processes, ``on_violation`` with the request
each violation belongs to) and, every ``sweep_interval`` steps, the sweep of cached blocks.
:class:`~.remediation.Remediator` aborts the request and evicts its block from vLLM's prefix
cache.

Install after ``load_model()`` and ``initialize_kv_cache()`` and before ``capture_model()``:
its warm-up calls ``model_fn`` once per token bucket, unguarded (no step described), and the
guard compiles its jits for each then (:meth:`TpuInferenceGuard._warm`; installed later, they
compile at their first use while serving). Install before the runner serves: the guard has
no canary for KV written before it (an install over a warm prefix cache, a second install after
``uninstall``, a restart after a failed step), so the steps and the sweep leave those slots
unchecked, and out of the coverage report, until vLLM hands their block out again
(:class:`~.host.Unwritten`). A block written after them chains from their empty canary: should
vLLM evict such an old block before the later one behind it (it frees a request's tail blocks
first) and a request then read both again, recomputed, the chain check at the later block's
first slot would report; reset vLLM's prefix cache (``scheduler.reset_prefix_cache()``) before
installing to rule that out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
import logging
import numbers
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from kvcanary_jax.consts import MAX_DIGEST_SOURCES
from kvcanary_jax.integrations.tpu_inference import device, host, layout as _layout
from kvcanary_jax.integrations.tpu_inference.loop import Carried, DecodeLoop
from kvcanary_jax.integrations.tpu_inference.remediation import _INCARNATIONS, Remediator, RequestId
from kvcanary_jax.runtime import CanaryManager, CanaryViolationError, ManagerConfig
from kvcanary_jax.runtime.config import env_value
from kvcanary_jax.runtime.reporting import state_consumed
from kvcanary_jax.runtime.kv import digest_reads_rows
from kvcanary_jax.runtime.rebase import Rebaser
from kvcanary_jax.runtime.state import state_jit

__all__ = ["SUPPORTED_VERSIONS", "Carried", "TpuInferenceGuard", "install", "read_violations",
           "violation_counts", "delta_jit", "head_jit", "tail_jit"]

logger = logging.getLogger(__name__)

SUPPORTED_VERSIONS = ("0.32",)
_WRAPPED = ("model_fn", "model.step_fn_no_options", "persistent_batch_manager.update_states",
            "_execute_continue_decode", "kv_caches", "layer_name_to_kvcache_index",
            "input_batch.token_ids_cpu", "input_batch.num_tokens_no_spec", "requests", "mesh",
            "max_num_reqs", "dp_size", "model_config", "vllm_config", "state_leaves")


def _get(obj, dotted):
    for name in dotted.split("."):
        obj = getattr(obj, name)
    return obj


def _check_runner(runner) -> None:
    installed = getattr(runner, "__dict__", {}).get("_kvcanary_guard")
    if installed is not None:
        raise ValueError("kv-canary tpu-inference: this runner is guarded already (a guard is "
                         "installed and was not uninstalled): call its uninstall() first, or "
                         "keep it")
    try:
        version = importlib.metadata.version("tpu-inference")
    except importlib.metadata.PackageNotFoundError:
        version = None
    if version is None or not version.startswith(tuple(v + "." for v in SUPPORTED_VERSIONS)):
        raise ValueError(f"kv-canary tpu-inference: found tpu-inference {version}; supported: "
                         f"{', '.join(v + '.x' for v in SUPPORTED_VERSIONS)}")
    missing = []
    for name in _WRAPPED:
        try:
            _get(runner, name)
        except AttributeError:
            missing.append(name)
    if missing:
        raise ValueError(f"kv-canary tpu-inference: {type(runner).__name__} has no "
                         f"{', '.join(missing)}: not a TPUModelRunner of tpu-inference "
                         f"{'/'.join(SUPPORTED_VERSIONS)}")
    refused = {
        "speculative decoding": getattr(runner, "speculative_config", None) is not None,
        "pipeline parallelism": not (getattr(runner, "is_first_rank", True)
                                     and getattr(runner, "is_last_rank", True)),
        "prefill context parallelism": getattr(runner, "pcp_preprocessor", None) is not None,
    }
    found = [k for k, v in refused.items() if v]
    if found:
        raise NotImplementedError(f"kv-canary tpu-inference: the runner uses {', '.join(found)}, "
                                  "which the guard does not cover (rejected drafts and other "
                                  "KV writers are out of its view)")
    # VLLM_XLA_CHECK_RECOMPILATION: the runner runs every step inside ForbidCompile, which
    # raises on any JAX compilation there (in any thread, while a step runs). Every program a
    # normal step runs (HEAD, TAIL, the delta, the sweep, the readback) and coverage()'s count
    # compile in the runner's warm-up (TpuInferenceGuard._warm; a step of shapes it did not
    # compile is refused before it launches anything), and so does the decode loop over the
    # carry with the canary's entry, through the warm-up of the runner's compilation manager
    # (TpuInferenceGuard._precompile_loop): a runner without that warm-up is refused.
    if (_forbids_compiling(runner) and getattr(runner, "enable_continue_decode", False)
            and not callable(getattr(getattr(runner, "compilation_manager", None),
                                     "_precompile_continue_decode", None))):
        raise NotImplementedError(
            "kv-canary tpu-inference: the runner forbids compilation while it steps "
            "(VLLM_XLA_CHECK_RECOMPILATION=1) and runs the on-device decode loop "
            "(enable_continue_decode), but has no compilation_manager."
            "_precompile_continue_decode: the guard compiles the loop over its state there, "
            "and without it the loop would compile at its first use, inside that check. "
            "Install with VLLM_XLA_CHECK_RECOMPILATION unset or 0, or without "
            "enable_continue_decode")


def _forbids_compiling(runner) -> bool:
    """Whether the runner steps inside ``ForbidCompile`` (``VLLM_XLA_CHECK_RECOMPILATION=1``)."""
    return type(getattr(runner, "maybe_forbid_compile", None)).__name__ == "ForbidCompile"


def _check_layers(runner, index: int, name: str, window: int) -> int:
    """With a coverage window every array of ``runner.kv_caches`` is digested: each must be
    laid out as the canary layer's (shape, dtype, placement); returns how many there are."""
    kvs = list(runner.kv_caches)
    ref = kvs[index]
    for i, kv in enumerate(kvs):
        if (tuple(kv.shape), kv.dtype, getattr(kv, "sharding", None)) != (
                tuple(ref.shape), ref.dtype, ref.sharding):
            raise ValueError(
                f"kv-canary tpu-inference: coverage_window {window} digests every layer's KV "
                f"as {name}'s layout, but runner.kv_caches[{i}] is {tuple(kv.shape)} "
                f"{jnp.dtype(kv.dtype).name} placed {getattr(kv, 'sharding', None)} and {name}'s "
                f"is {tuple(ref.shape)} {jnp.dtype(ref.dtype).name} placed {ref.sharding} "
                "(caches of several layouts, e.g. hybrid or MLA models, are not covered): "
                "leave coverage_window at 0 for SGLang's layer-0 fingerprint")
    return len(kvs)


def _canary(runner, *, layer: int, k_heads: int, token_checks: bool, ring_capacity: int,
            real_data: str, sweep_rows: int, implementation,
            coverage_window: int = 0) -> device.TpuInferenceCanary:
    names = dict(runner.layer_name_to_kvcache_index)
    name = f"layer.{layer}"
    if name not in names:
        raise ValueError(f"kv-canary tpu-inference: no KV cache for {name} (layers: "
                         f"{', '.join(sorted(names))})")
    index = names[name]
    kv = runner.kv_caches[index]
    sharding = getattr(kv, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        raise ValueError(f"kv-canary tpu-inference: {name}'s KV cache is not placed with a "
                         f"NamedSharding (found {type(sharding).__name__})")
    mesh, spec = sharding.mesh, sharding.spec
    spec = P(*(tuple(spec) + (None,) * (5 - len(tuple(spec)))))
    hf = runner.model_config.hf_text_config
    kv_heads = int(runner.model_config.get_total_num_kv_heads())
    head_dim = int(getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    head_axes = [a for a in device._axes(tuple(spec)[2])]
    head_shards = int(np.prod([mesh.shape[a] for a in head_axes])) if head_axes else 1
    data_axes = [a for a in device._axes(tuple(spec)[0])]
    data_shards = int(np.prod([mesh.shape[a] for a in data_axes])) if data_axes else 1
    if data_shards != runner.dp_size:
        raise ValueError(f"kv-canary tpu-inference: {name}'s blocks are split over {data_shards} "
                         f"data shards but the runner has dp_size {runner.dp_size}")
    cache_heads = max(kv_heads, head_shards)  # GQA heads replicated to the head shards
    block_size = int(runner.cache_config.block_size)
    lay = _layout.kv_layout(kv.shape, kv.dtype, head_dim=head_dim, kv_heads=cache_heads,
                            head_shards=head_shards, block_size=block_size, k_heads=k_heads,
                            where=f"{name}'s KV cache")
    max_reqs = int(getattr(runner, "attn_max_num_seqs", runner.max_num_reqs)) // runner.dp_size
    max_blocks = int(runner.input_batch.block_table[0].max_num_blocks_per_req)
    num_layers = _check_layers(runner, index, name, coverage_window) if coverage_window else None
    # The digest's sources of a layer: for the TPU kernel a 128-lane row each, else the row.
    strips = lay.row_elems // lay.lanes if digest_reads_rows(implementation, kv) else 1
    if num_layers and num_layers * strips > MAX_DIGEST_SOURCES:
        raise ValueError(
            f"kv-canary tpu-inference: coverage_window {coverage_window} cannot cover "
            f"{num_layers} layers: a slot's digest takes at most {MAX_DIGEST_SOURCES} sources, "
            f"and each layer gives {strips} (the TPU kernel's: a 128-lane row each of a KV "
            "shard's slot; elsewhere one)")
    return device.TpuInferenceCanary(
        layout=lay, layer_index=index, layers=(name,),
        num_slots=_layout.local_slots(kv.shape, data_shards), max_reqs=max_reqs,
        max_blocks=max_blocks, pool_rows=2 * int(runner.max_num_reqs), mesh=mesh, kv_spec=spec,
        k_heads=k_heads, token_checks=token_checks, sweep_rows=sweep_rows,
        ring_capacity=ring_capacity, real_kv_hash_mode=real_data,
        implementation=implementation, coverage_window=coverage_window, num_layers=num_layers)


class TpuInferenceGuard(DecodeLoop):
    """The installed guard (:func:`install` builds it). ``state``: the canary's stacked device
    state; ``canary``: its :class:`~.device.TpuInferenceCanary`; ``manager``: the runtime
    manager; ``book`` / ``cached``: the host side; ``layers``: the layers whose real KV
    SGLang's fingerprint reads (with a coverage window the digest reads every layer:
    :meth:`coverage`); ``steps``: guarded steps run (a decode loop counts once);
    ``warm_up``: whether the runner's warm-up calls compile the canary's jits
    (:meth:`_warm`; default True)."""

    def __init__(self, runner, canary: device.TpuInferenceCanary, manager: CanaryManager,
                 sweep_interval: int):
        self.runner, self.canary, self.manager = runner, canary, manager
        self.sweep_interval = sweep_interval
        self.layers = canary.layers
        self.state = canary.init_state()
        self.book = host.TokenBook(pool_rows=canary.pool_rows, max_reqs=canary.max_reqs,
                                   dp_size=canary.data_shards, context_len=canary.context_len)
        self.cached = host.CachedBlocks(dp_size=canary.data_shards,
                                        block_size=canary.layout.block_size)
        self.unwritten = self._unwritten()
        self._reads_old = False  # the step described reads KV written before the canary
        self._said_old = False  # the warning that steps read such KV, once a canary
        self.steps = 0
        # The coverage step counters kept from wrapping; a call here may run a whole on-device
        # decode loop, many TAILs: its step is read every 2**12 calls, not every 2**20.
        self._rebaser = Rebaser(canary.config, every=2**12)
        self.sweeps = 0
        self._pending = None
        self._prepared = False  # update_states described the step the runner runs next
        self._sweep_due = False  # sweep() asked for one while a step was described
        self._owners: list[dict[int, str]] = []
        # Request id -> its incarnation: a number drawn when vLLM schedules a request of that id
        # for the first time since the id's last request finished (a preempted request resumed,
        # which vLLM's v2 runner gets as a new one, keeps its number), dropped when it finishes;
        # the step's owners keep the numbers of the requests they name.
        self._incarnations: dict[str, int] = {}
        self._owner_incarnations: dict[str, int] = {}
        self._late = np.zeros((canary.data_shards * canary.max_reqs,), np.int32)
        self._orig = {"model_fn": runner.model_fn,
                      "step_fn_no_options": runner.model.step_fn_no_options,
                      "update_states": runner.persistent_batch_manager.update_states,
                      "continue": runner._execute_continue_decode}
        # Whether a call of the runner's warm-up compiles the canary's jits for its shapes
        # (:meth:`_warm`), and the shapes done.
        self.warm_up = True
        self._replicated = NamedSharding(canary.mesh, P())
        self._warmed: set = set()
        self._warmed_ids = self._warmed_sweep = self._warmed_observe = False
        self._warmed_loop = False  # the decode loop compiled over the canary's carry
        # VLLM_XLA_CHECK_RECOMPILATION=1: the warm-up compiles the sweep whatever the interval
        # (a sweep() asked for from another thread runs after a step, inside the check).
        self._forbids = _forbids_compiling(runner)
        # The step's three jits besides the runner's own (attributes: a test injects failures).
        self._delta_jit, self._head_jit, self._tail_jit = delta_jit, head_jit, tail_jit
        self._sweep_jit = _sweep_jit
        # The unwritten mask of a step that reads no KV written before the canary started (every
        # block as written: nothing masked), kept on the device: the step's jits take one always.
        self._all_written = self._placed(np.zeros(
            (canary.data_shards * (canary.num_slots // canary.layout.block_size),), np.int32))
        self._pack = jax.jit(device.pack_state)
        self._unpack = jax.jit(lambda p: device.unpack_state(p, device.state_shapes(canary)))
        # One lock with the manager's: from a step's donating call until the manager holds the
        # new state, no call from another thread (coverage(), sweep(), the manager's own, the
        # module's readers) sees a donated state.
        self._lock = manager.lock
        self.installed = True
        runner.persistent_batch_manager.update_states = self._update_states
        runner.model_fn = self._model_fn
        runner.model.step_fn_no_options = self._loop_step
        runner._execute_continue_decode = self._continue_decode
        compilation = getattr(runner, "compilation_manager", None)
        if callable(getattr(compilation, "_precompile_continue_decode", None)):
            self._orig["precompile_loop"] = compilation._precompile_continue_decode
            self._own_precompile_loop = "_precompile_continue_decode" in getattr(
                compilation, "__dict__", {})
            compilation._precompile_continue_decode = self._precompile_loop
        runner._kvcanary_guard = self

    def _context(self):
        """Where the canary's jits are traced and called: under x64 and the canary's mesh
        (``jax.set_mesh``), whatever the caller's (tpu-inference sets its mesh around some
        calls and not others: a jit's cache is keyed by it, and a warmed jit would miss)."""
        stack = contextlib.ExitStack()
        stack.enter_context(jax.enable_x64(True))
        stack.enter_context(jax.set_mesh(self.canary.mesh))
        return stack

    def _unwritten(self) -> host.Unwritten:
        c = self.canary
        return host.Unwritten(dp_size=c.data_shards, num_blocks=c.num_slots // c.layout.block_size,
                              block_size=c.layout.block_size)

    def _placed(self, host_array) -> jax.Array:
        """A step's host array on the device as the canary's jits take it (and :meth:`_warm`
        declares it): replicated on the canary's mesh."""
        return jax.device_put(host_array, self._replicated)

    def _unwritten_arg(self):
        """The step's :func:`~.device.step_batch` ``unwritten`` (all 0 where it reads no KV
        written before the canary started: the same shape either way, one compile)."""
        if self._reads_old:
            return self._placed(self.unwritten.first.reshape(-1))
        return self._all_written

    def uninstall(self) -> None:
        """Give the runner its own functions back (a second call does nothing)."""
        with self._lock:
            if not self.installed:
                return
            r = self.runner
            r.model_fn = self._orig["model_fn"]
            r.model.step_fn_no_options = self._orig["step_fn_no_options"]
            r.persistent_batch_manager.update_states = self._orig["update_states"]
            del r._execute_continue_decode  # the class's method again
            if "precompile_loop" in self._orig:  # the method the runner had, back
                if self._own_precompile_loop:
                    r.compilation_manager._precompile_continue_decode = \
                        self._orig["precompile_loop"]
                else:
                    del r.compilation_manager._precompile_continue_decode
            del r._kvcanary_guard
            self.installed = False

    # ----------------------------------------------------------------- request lifecycle
    def _update_states(self, scheduler_output, *args, **kwargs):
        with self._lock:  # the books a sweep from another thread walks
            return self._update_books(scheduler_output, *args, **kwargs)

    def _update_books(self, scheduler_output, *args, **kwargs):
        for req_id in scheduler_output.finished_req_ids or ():
            self._incarnations.pop(req_id, None)
        out = self._orig["update_states"](scheduler_output, *args, **kwargs)
        self.book.finish(scheduler_output.finished_req_ids)
        for new in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
            if new.req_id not in self._incarnations:  # not a preempted request resumed
                self._incarnations[new.req_id] = next(_INCARNATIONS)
        if not scheduler_output.total_num_scheduled_tokens:
            return out
        order = host.batch_order(self.runner, scheduler_output, self.canary.data_shards)
        self.cached.observe(self.runner, order)
        self._reads_old = self.unwritten.observe(self.runner, order)
        if self._reads_old and not self._said_old:
            self._said_old = True
            logger.warning("kv-canary tpu-inference: a step reads KV written before the canary "
                           "started (an install over a warm prefix cache, a restart): it is "
                           "left unchecked, and out of the coverage report, until vLLM hands "
                           "its block out again (reset vLLM's prefix cache before installing "
                           "to guard it from the first step)")
        self._owners = host.block_owners(self.runner, order)
        self._owner_incarnations = {r: self._incarnations.get(r) for rank in order for r in rank}
        self._pending = self.book.plan(self.runner, order) if self.canary.token_checks else None
        self._late = host.late_requests(self.runner, order, scheduler_output,
                                        self.canary.max_reqs, self.canary.layout.block_size)
        self._prepared = True
        return out

    def _apply_delta(self):
        """The step's expected-id delta into the state's pool (a jit of its own, keyed by the
        delta's id bucket; call under x64); returns ``(pending, its rows)`` (``(None, None)``
        without token checks)."""
        pending = self._pending
        if pending is None:
            return None, None
        put = self._placed
        delta = device.TokenDelta(rows=put(pending.rows), starts=put(pending.starts),
                                  counts=put(pending.counts), ids=put(pending.ids))
        st = self.state
        pool, valid = self._delta_jit(st.expected_tokens, st.expected_valid_lens, delta,
                                      canary=self.canary)
        self.state = dataclasses.replace(st, expected_tokens=pool, expected_valid_lens=valid)
        return pending, delta.rows

    def _head_delta(self, input_ids):
        """The step's delta as HEAD takes it (:func:`.host.head_delta`: one that does not fit
        the step's tokens is applied first by its own jit; call under x64); returns ``(pending,
        the TokenDelta)`` (``(None, None)`` without token checks)."""
        pending = self._pending
        if pending is None:
            return None, None
        c = self.canary
        rows, starts, counts, ids, fits = host.head_delta(
            pending, c.data_shards, input_ids.shape[0] // c.data_shards, c.context_len)
        if not fits:
            self._apply_delta()
        put = self._placed
        return pending, device.TokenDelta(rows=put(rows), starts=put(starts),
                                          counts=put(counts), ids=put(ids))

    def _failed(self) -> None:
        self.book.reset()
        self._pending = None
        self._prepared = False
        self._restart_if_taken()

    def _model_fn(self, state_leaves, kv_caches, input_ids, attn_metadata, inputs_embeds,
                  input_positions, layer_map, lora_metadata, intermediate_tensors, is_first_rank,
                  is_last_rank, **kwargs):
        with self._lock:  # a sweep from another thread must not read the KV it donates
            if not self._prepared:  # no step described (a warm-up, a replay): not guarded
                out = self._orig["model_fn"](state_leaves, kv_caches, input_ids, attn_metadata,
                                             inputs_embeds, input_positions, layer_map,
                                             lora_metadata, intermediate_tensors, is_first_rank,
                                             is_last_rank, **kwargs)
                self._hand_over(kv_caches, out)
                if self.warm_up:
                    self._warm(input_ids, attn_metadata, input_positions, out[0])
                return out
            return self._guarded_model_fn(state_leaves, kv_caches, input_ids, attn_metadata,
                                          inputs_embeds, input_positions, layer_map,
                                          lora_metadata, intermediate_tensors, is_first_rank,
                                          is_last_rank, **kwargs)

    def _hand_over(self, kv_caches, out) -> None:
        """The step's new KV into ``runner.kv_caches`` before the lock is let go: the runner
        stores it only after ``model_fn`` returns, and until then its ``kv_caches`` are the
        donated (deleted) arrays, which a sweep from another thread would read. A raise after
        this (mode "raise", a callback's error) leaves the runner a live cache too. A call over
        other arrays than the runner's (a replay of kept ones) hands nothing over."""
        if len(kv_caches) == len(self.runner.kv_caches) and all(
                a is b for a, b in zip(kv_caches, self.runner.kv_caches)):
            self.runner.kv_caches = list(out[0])

    @staticmethod
    def _shape_key(input_ids, attn_metadata, input_positions) -> tuple:
        """What the canary's jits of a step are compiled for: its arrays' shapes, dtypes and
        placements."""
        return tuple((tuple(x.shape), x.dtype, getattr(x, "sharding", None))
                     for x in (input_ids, input_positions, *device.metadata(attn_metadata)))

    def _warm(self, input_ids, attn_metadata, input_positions, kv_caches) -> None:
        """Compile the canary's jits for a step of these shapes, running nothing: HEAD with and
        without the late split and TAIL after each; once, the delta's for every id bucket up to
        the pool's size, the readback each step stages (and with a coverage window the count
        :meth:`coverage` reads) and, with a ``sweep_interval`` or when the runner forbids
        compiling while it steps, the sweep's. tpu-inference's warm-up (``capture_model()``)
        calls ``model_fn`` once per token bucket: a guard installed before it serves with every
        jit compiled (``guard.warm_up = False``: none). A call whose metadata the canary does
        not take compiles nothing."""
        c = self.canary
        md = device.metadata(attn_metadata)
        key = self._shape_key(input_ids, attn_metadata, input_positions)
        if key in self._warmed or md[0].shape[0] != c.data_shards * c.max_reqs:
            return  # done, or not a step's metadata (step_batch would refuse it)
        # Declared as the steps place them (:meth:`_placed`): replicated on the canary's mesh.
        placed = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32,
                                   sharding=self._replicated)
        per_row = placed((c.data_shards * c.max_reqs,))
        with self._context():
            state, kv = self.state, device.kv_arg(c, list(kv_caches))
            # HEAD's delta: as many ids as the step has tokens (:meth:`_head_delta`).
            delta = device.TokenDelta(rows=per_row, starts=per_row, counts=per_row,
                                      ids=placed((input_ids.shape[0], 3)))
            for split in (False, True):
                head = self._head_jit.lower(
                    state, delta if c.token_checks else None, per_row,
                    placed(self._all_written.shape), md, input_ids, input_positions, canary=c,
                    split=split).compile()
                self._tail_jit.lower(state, head.out_info[1], kv, input_ids, input_positions,
                                     canary=c).compile()
            if c.token_checks and not self._warmed_ids:
                n = host.MIN_IDS
                while n <= host.next_bucket(c.max_reqs * c.context_len):
                    delta = device.TokenDelta(rows=per_row, starts=per_row, counts=per_row,
                                              ids=placed((c.data_shards * n, 3)))
                    self._delta_jit.lower(state.expected_tokens, state.expected_valid_lens,
                                          delta, canary=c).compile()
                    n *= 2
                self._warmed_ids = True
            if self.manager is not None and not self._warmed_observe:
                # The readback each guarded step stages (observe()), as _after_step calls it,
                # and the count coverage() reads, as it calls it.
                self.manager.compile_observe(state)
                if c.coverage_window:
                    from kvcanary_jax.runtime.coverage import _counts_jit
                    _counts_jit.lower(c.config, state).compile()
                self._warmed_observe = True
            if (self.sweep_interval or self._forbids) and not self._warmed_sweep:
                # The sweep's one shape.
                n, shards = c.sweep_rows, c.data_shards
                wide = functools.partial(jax.ShapeDtypeStruct, (shards, n), jnp.int64,
                                         sharding=self._replicated)
                self._sweep_jit.lower(state, placed((shards, n + 1, c.context_len)), wide(),
                                      wide(), kv, canary=c).compile()
                self._warmed_sweep = True
        # Recorded once compiled: a compile that failed (raised out of the warm-up, before
        # serving) is tried again by the next call of these shapes.
        self._warmed.add(key)

    def _guarded_model_fn(self, state_leaves, kv_caches, input_ids, attn_metadata, inputs_embeds,
                          input_positions, layer_map, lora_metadata, intermediate_tensors,
                          is_first_rank, is_last_rank, **kwargs):
        c = self.canary
        if self._forbids and self._shape_key(input_ids, attn_metadata,
                                             input_positions) not in self._warmed:
            # Said before anything runs: inside the runner's check, the first jit of the guard
            # compiled here would raise mid-step.
            self._failed()
            raise RuntimeError(
                "kv-canary tpu-inference: the runner forbids compiling while it steps "
                "(VLLM_XLA_CHECK_RECOMPILATION=1), and the guard's programs for this step's "
                f"shapes ({input_ids.shape[0]} tokens) were not compiled in the runner's "
                "warm-up: install the guard before capture_model(), keep guard.warm_up True, "
                "and let the warm-up run (SKIP_JAX_PRECOMPILE unset, enforce_eager off); it "
                "compiles them for every token bucket")
        try:
            with self._context():
                pending, delta = self._head_delta(input_ids)
                self.state, passes = self._head_jit(
                    self.state, delta, self._placed(self._late), self._unwritten_arg(),
                    device.metadata(attn_metadata), input_ids, input_positions, canary=c,
                    split=bool(self._late.any()))
        except BaseException:
            self._failed()
            raise
        try:
            # The runner's own step, its keywords (shared_attention_metadata, ...) passed on:
            # called as its warm-up called it, it runs what the warm-up compiled.
            out = self._orig["model_fn"](state_leaves, kv_caches, input_ids, attn_metadata,
                                         inputs_embeds, input_positions, layer_map,
                                         lora_metadata, intermediate_tensors, is_first_rank,
                                         is_last_rank, **kwargs)
        except BaseException:
            # HEAD stamped the step's slots, and the step wrote no KV there: the canary starts
            # afresh rather than check them.
            self.state = None
            self._failed()
            raise
        # The step's own KV handed over first: the sweep reads it, and a raise leaves the
        # runner a live cache (the error carries it too).
        self._hand_over(kv_caches, out)
        try:
            with self._context():
                self.state = self._tail_jit(self.state, passes, device.kv_arg(c, list(out[0])),
                                            input_ids, input_positions, canary=c)
        except BaseException:
            self._failed()
            raise
        self._after_step(pending, out[0])
        return out

    def _restart_if_taken(self) -> None:
        """After a failed step: a state the step took (donated, or never handed back) is gone;
        the canary starts afresh (blocks written before read as unstamped, and are reported as
        after a new install), and says so."""
        if self.state is None or state_consumed(self.state):
            logger.warning("kv-canary tpu-inference: a failed step took the canary's state with "
                           "it; the canary starts afresh (KV written before this point has no "
                           "canary: it is left unchecked until vLLM hands its block out again)")
            self.state = self.canary.init_state()
            # The blocks cached so far have no canary now: the sweep walks only blocks written
            # from here on, and the steps leave the slots written before unchecked.
            self.cached = host.CachedBlocks(dp_size=self.canary.data_shards,
                                            block_size=self.canary.layout.block_size)
            self.unwritten = self._unwritten()
            self._said_old = False
            if self.manager is not None:  # it held the state the step took
                self.manager.hold(self.state, fresh=True)

    # ------------------------------------------------------------------- host side
    def incarnation(self, req_id: str) -> int | None:
        """The incarnation (:class:`RequestId`) of the request vLLM runs under ``req_id`` now,
        or None where none runs."""
        return self._incarnations.get(str(req_id))

    def _resolve(self, owners, incarnations=None):
        """The manager's ``resolve(slot, violation)``: the request whose block table maps the
        slot's block in the step (a :class:`RequestId`, with its incarnation in
        ``incarnations``), or, where requests of several data-parallel ranks do (each rank
        numbers its own blocks), ``((rank, request), ...)`` (the
        :class:`~.remediation.Remediator` picks the report's rank). A block several requests of
        a rank share (a cached prefix) gives a ring row per request that read the slot: those
        rows get its holders in turn (the k-th call for a slot the k-th holder, cycling), so
        every one of them is reported."""
        incarnations = incarnations or {}
        bs = self.canary.layout.block_size
        calls: dict[int, int] = {}

        def resolve(slot, violation=None):
            block = int(slot) // bs
            holders = [(rank, mine[block]) for rank, mine in enumerate(owners) if block in mine]
            if not holders:
                return None
            k = calls.get(int(slot), 0)
            calls[int(slot)] = k + 1
            found = tuple((rank, RequestId(r, incarnations.get(r)))
                          for rank, r in ((rank, reqs[k % len(reqs)]) for rank, reqs in holders))
            return found[0][1] if len(found) == 1 else found
        return resolve

    def _after_step(self, pending, kv_caches=None) -> None:
        """``kv_caches``: the step's KV (default: the runner's). A violation raised here
        carries it (``CanaryViolationError.kv``), as :meth:`CanaryManager.step`'s do."""
        kv_caches = self.runner.kv_caches if kv_caches is None else kv_caches
        if pending is not None:
            self.book.commit(pending)
        self._pending = None
        self._prepared = False
        self.steps += 1
        self.state = self._rebaser(self.state)
        try:
            # The sweep first, as the manager's own step runs it: the readback the manager
            # stages now holds its launches (with a coverage window the manager's launch-health
            # check expects the SWEEP tags between two checks) and its findings.
            if self._sweep_due or (self.sweep_interval
                                   and self.steps % self.sweep_interval == 0):
                self._sweep_due = False
                self._sweep(kv_caches)
            if self.manager is not None:
                # Under the canary's mesh, as the warm-up compiled it (a jit's cache is keyed
                # by the mesh context).
                with jax.set_mesh(self.canary.mesh):
                    self.manager.observe(self.state, resolve=self._resolve(
                        self._owners, self._owner_incarnations))
        except CanaryViolationError as e:
            if e.kv is None:
                e.kv = kv_caches
            raise

    def sweep(self) -> None:
        """Re-verify every cached chain of blocks now (the SWEEP tags, token check off; with a
        coverage window, the digest of every layer of their slots too). What it finds is
        reported by the next step, or by the manager's ``flush()`` / ``close()``. Called from
        another thread while the runner is between a step's ``update_states`` and its model
        call, it runs right after that step instead (the blocks the step is about to write are
        listed already, with no canary yet). Before the first guarded step it does nothing (no
        slot is stamped yet). Refused once the guard is uninstalled: its books no longer follow
        vLLM's blocks, which hold other requests' KV by then."""
        with self._lock:
            if not self.installed:
                raise RuntimeError(
                    "kv-canary tpu-inference: sweep() of an uninstalled guard: its list of cached "
                    "blocks stopped following vLLM's at uninstall(), and blocks handed out since "
                    "hold KV this guard never saw (they would all read as corrupted); sweep "
                    "through the guard installed now")
            if self._prepared:
                # Between a step's update_states and its model call (another thread's call):
                # the books already list the blocks the step is about to write, which hold no
                # canary yet. The sweep runs right after that step, before its readback.
                self._sweep_due = True
                return
            if not self.steps:
                # No guarded step yet: nothing is stamped, so there is nothing to sweep. (And
                # the runner's warm-up, capture_model(), donates its KV in calls the guard does
                # not wrap: its arrays may be deleted at this very moment.)
                return
            self._sweep_due = False  # this one serves a sweep asked for earlier too
            self._sweep(self.runner.kv_caches)
            if self.manager is not None:
                self.manager.hold(self.state)

    def coverage(self):
        """The coverage window's report of the state now
        (:class:`~kvcanary_jax.runtime.coverage.CoverageStats`: the share of live KV bytes,
        every layer's K and V, verified within the window; ``None`` without a window). A
        device computation and a host read: for the stats line and on request, not every
        step."""
        if not self.canary.coverage_window:
            return None
        from kvcanary_jax.runtime.coverage import coverage_stats

        # Under the canary's mesh, as the warm-up compiled its count (a jit's cache is keyed by
        # the mesh context).
        with self._lock, jax.set_mesh(self.canary.mesh):
            return coverage_stats(self.canary.config, self.state,
                                  sweep_interval=self.sweep_interval)

    def _sweep(self, kv_caches) -> None:
        c = self.canary
        n, ctx = c.sweep_rows, c.context_len
        per_rank = [self.cached.prefixes(r) for r in range(c.data_shards)]
        launches = max(1, max(-(-len(p) // n) for p in per_rank))
        kv = device.kv_arg(c, list(kv_caches))
        for launch in range(launches):
            tables = np.zeros((c.data_shards, n + 1, ctx), np.int32)
            rows = np.zeros((c.data_shards, n), np.int64)
            lengths = np.zeros((c.data_shards, n), np.int64)
            for rank, chains in enumerate(per_rank):
                for i, chain in enumerate(chains[launch * n:(launch + 1) * n]):
                    slots = self.unwritten.tables(chain, rank)  # KV written before: slot 0
                    tables[rank, i + 1, :slots.shape[0]] = slots
                    rows[rank, i], lengths[rank, i] = i + 1, slots.shape[0]
            with self._context():
                self.state = self._sweep_jit(self.state, self._placed(tables),
                                             self._placed(rows), self._placed(lengths), kv,
                                             canary=c)
        self.sweeps += 1
        if self.manager is not None:
            self.manager.sweep_passes += 1  # the stats line's count


def _delta_impl(pool, valid, delta, *, canary):
    return device.delta_step(canary, pool, valid, delta)


def _head_impl(state, delta, late, unwritten, md, input_ids, input_positions, *, canary, split):
    return device.head_step(canary, state, delta, md, input_ids, input_positions, late, split,
                            unwritten)


def _tail_impl(state, passes, kv, input_ids, input_positions, *, canary):
    return device.tail_step(canary, state, passes, kv, input_ids, input_positions)


def _sweep_impl(state, tables, rows, lengths, kv, *, canary):
    return device.sweep_step(canary, state, tables, rows.reshape(-1), lengths.reshape(-1), kv)


# A normal step runs ``_head_jit``, the runner's own step and ``_tail_jit`` (and first, with a
# delta too big for HEAD, ``_delta_jit``): the model is never compiled again for the canary,
# and the canary's jits are keyed by the step's token bucket (HEAD and TAIL, each with or
# without the late split) or the delta's id bucket only.
#
# ``delta_jit(pool, valid, delta, canary=)`` -> ``(pool, valid)`` (:func:`~.device.delta_step`;
# the state's two pool leaves donated), ``head_jit(state, delta, late, unwritten, md,
# input_ids, input_positions, canary=, split=)`` -> ``(state, passes)``
# (:func:`~.device.head_step`, ``delta`` a :class:`~.device.TokenDelta` of as many ids as the
# step has tokens, or None without token checks, ``md`` :func:`~.device.metadata`'s) and
# ``tail_jit(state, passes, kv, input_ids, input_positions, canary=)`` -> ``state``
# (:func:`~.device.tail_step`, ``kv`` :func:`~.device.kv_arg`'s of the step's new KV), the
# state donated; call under x64.
delta_jit = jax.jit(_delta_impl, static_argnames=("canary",), donate_argnums=(0, 1))
head_jit = state_jit(_head_impl, static_argnames=("canary", "split"), donate_argnums=(0,))
tail_jit = state_jit(_tail_impl, static_argnames=("canary",), donate_argnums=(0,))
_sweep_jit = state_jit(_sweep_impl, static_argnames=("canary",), donate_argnums=(0,))


def install(runner, *, mode: str = "log", real_data: str = "all", sweep_interval: int = 0,
            token_checks: bool | None = None, layer: int = 0, k_heads: int = 1,
            sweep_rows: int = 16,
            on_violation: Callable | None = None, implementation: str | None = None,
            coverage_window: int | None = None, **manager_fields) -> TpuInferenceGuard:
    """Guard ``runner`` (a tpu-inference 0.32 ``TPUModelRunner``). ``mode`` / ``real_data``:
    SGLang's ``--kv-canary`` and ``--kv-canary-real-data`` (``none``/``partial``/``all``: the
    first 16 bytes or the whole K strip of layer ``layer``'s first ``k_heads`` heads);
    ``sweep_interval``: every N guarded steps, re-verify the cached blocks (0: never);
    ``coverage_window`` (ours; default ``SGLANG_KV_CANARY_COVERAGE_WINDOW``, else 0: off):
    N >= 1 also verifies every byte of every layer's K and V of the slots steps read within
    N steps, and of the cached blocks at each sweep (it needs ``sweep_interval`` > 0; the
    report: :meth:`TpuInferenceGuard.coverage`, and the manager's stats line);
    ``token_checks``: check the written and read token ids against the requests' own (needs
    ``async_scheduling=False``; default True, or what ``SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_
    ASSERT`` and ``SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT`` say where either is set: the
    guard checks both or neither, so they must agree); ``on_violation``: the remediation
    callback (:class:`~.remediation.Remediator`, bound to this guard here); ``manager_fields``:
    other :class:`~kvcanary_jax.runtime.ManagerConfig` fields. The ``SGLANG_KV_CANARY_*``
    variables set the manager's other fields, as SGLang's ``CanaryConfig.from_env`` reads them
    (``ring_capacity``, ``stats_print_every_n_steps``); an argument wins over a variable.
    Everything is checked here, before the runner is touched."""
    fields = {f.name for f in dataclasses.fields(ManagerConfig)}
    for name in manager_fields:
        if name in _TOKEN_ASSERTS:
            raise TypeError(f"kv-canary tpu-inference: install() sets {name} from token_checks "
                            "(the guard checks the written and the read tokens together): pass "
                            "token_checks=True or False")
        if name == "environ" or name.startswith("kv_canary") or name not in fields:
            raise TypeError(f"kv-canary tpu-inference: install() got an unexpected keyword "
                            f"argument {name!r} (mode, real_data and sweep_interval are its "
                            "own; the SGLANG_KV_CANARY_* variables are read from os.environ; "
                            "other keywords are ManagerConfig's fields)")
    if token_checks is None:
        token_checks = _token_checks_from_env()
    elif not isinstance(token_checks, (bool, np.bool_)):
        raise ValueError(f"kv-canary tpu-inference: token_checks must be True or False, got "
                         f"{token_checks!r}")
    token_checks = bool(token_checks)
    window_from_env = coverage_window is None
    if window_from_env:
        coverage_window = env_value("coverage_window") or 0
    sweep_interval, layer, k_heads, sweep_rows, coverage_window = (
        _whole(name, value, least) for name, value, least in (
            ("sweep_interval", sweep_interval, 0), ("layer", layer, 0), ("k_heads", k_heads, 1),
            ("sweep_rows", sweep_rows, 1), ("coverage_window", coverage_window, 0)))
    if isinstance(mode, str) and mode.strip().lower() == "none":
        raise ValueError("kv-canary tpu-inference: mode 'none' installs no guard (the canary is "
                         "off): leave the runner as it is")
    if manager_fields.get("draft_worker"):
        raise ValueError("kv-canary tpu-inference: draft_worker is SGLang's draft model's manager "
                         "(its token ids one position ahead); the guard runs on the target "
                         "runner, and a runner with speculative decoding is refused: leave it "
                         "off")
    if manager_fields.get("padding_guard"):
        raise ValueError("kv-canary tpu-inference: padding_guard checks SGLang's padding slot in "
                         "the manager's own sweep, which the guard does not run (its sweep is "
                         "its own): leave it off")
    if coverage_window and not sweep_interval:
        origin = " (from SGLANG_KV_CANARY_COVERAGE_WINDOW)" if window_from_env else ""
        raise ValueError(
            f"kv-canary tpu-inference: coverage_window {coverage_window}{origin} verifies the "
            f"slots steps read within {coverage_window} steps and the cached blocks at each of "
            "the guard's sweeps: pass sweep_interval=K > 0 (without a sweep, cached blocks no "
            "request reads would never be verified)")
    # The manager's sweep interval is the bound the coverage report states for cached blocks;
    # without a window the guard's sweep is its own, as before.
    config = ManagerConfig.from_env(kv_canary=mode, kv_canary_real_data=real_data,
                                    kv_canary_sweep_interval=sweep_interval if coverage_window
                                    else 0,
                                    enable_verify_token_assert=token_checks,
                                    enable_write_input_assert=token_checks,
                                    coverage_window=coverage_window, **manager_fields)
    _check_runner(runner)
    if token_checks and runner.vllm_config.scheduler_config.async_scheduling:
        raise NotImplementedError(
            "kv-canary tpu-inference: token checks need async_scheduling=False (under async "
            "scheduling the host does not know the token a step writes); pass "
            "token_checks=False or turn async scheduling off")
    canary = _canary(runner, layer=layer, k_heads=k_heads, token_checks=token_checks,
                     ring_capacity=config.ring_capacity, real_data=real_data,
                     sweep_rows=sweep_rows, implementation=implementation,
                     coverage_window=coverage_window)
    remediator = on_violation if isinstance(on_violation, Remediator) else None
    if remediator is not None and remediator.guard is not None and remediator.guard.installed:
        raise ValueError("kv-canary tpu-inference: on_violation is a Remediator serving another "
                         "installed guard (it maps a report's slot to that guard's blocks): "
                         "build one Remediator per guard")
    manager = CanaryManager(config, canary.config, on_violation=on_violation, allocate=False)
    guard = TpuInferenceGuard(runner, canary, manager, sweep_interval)
    if remediator is not None:
        remediator.guard = guard  # its block size, ranks and request incarnations
    return guard


# The two token asserts of SGLang's config, set together by install's token_checks.
_TOKEN_ASSERTS = ("enable_verify_token_assert", "enable_write_input_assert")


def _token_checks_from_env() -> bool:
    """install's ``token_checks`` where it is not passed: True, unless SGLang's token-assert
    variables say otherwise (both the same)."""
    said = {name: env_value(name) for name in _TOKEN_ASSERTS}
    said = {name: v for name, v in said.items() if v is not None}
    if not said:
        return True
    if len(set(said.values())) > 1:
        raise ValueError(
            "kv-canary tpu-inference: SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT and "
            "SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT differ; the guard checks the written "
            "and the read token ids together: set both the same, or pass token_checks")
    return bool(next(iter(said.values())))


def _whole(name: str, value, least: int) -> int:
    """``value`` as a Python int (numpy's integers too), refused unless an integer >= ``least``
    (a bool or a float is not one)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or \
            value < least:
        raise ValueError(f"kv-canary tpu-inference: {name} must be an int >= {least}, got "
                         f"{value!r}")
    return int(value)


def violation_counts(guard: TpuInferenceGuard) -> np.ndarray:
    """Violations ever recorded, per shard."""
    with guard._lock:
        return np.asarray(guard.state.violation_write_index)[:, 0].astype(np.int64)


def read_violations(guard: TpuInferenceGuard, *, start=0) -> list[tuple[int, Any]]:
    """``(shard, Violation)`` for every ring row from ``start`` on (one index for every shard,
    or one per shard)."""
    from kvcanary_jax.runtime import decode_ring

    with guard._lock:
        ring = np.asarray(guard.state.violation_ring)
        counts = violation_counts(guard)
    starts = np.broadcast_to(np.asarray(start, np.int64), counts.shape)
    return [(i, v) for i in range(ring.shape[0])
            for v in decode_ring(ring[i], int(counts[i]), start=int(starts[i]))]
