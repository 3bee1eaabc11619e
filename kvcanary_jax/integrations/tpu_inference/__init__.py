"""The canary inside vLLM's TPU backend, tpu-inference 0.32 (``TPUModelRunner``), with no fork.

tpu-inference has no KV integrity check. :func:`install` guards a runner as it is (nothing here
imports ``tpu_inference`` or ``vllm`` until a guard is installed; attributes are read by name)
and runs kv-canary's HEAD -> model -> TAIL around every model step, the on-device decode loop's
included, as SGLang's runtime does around its forward (:mod:`kvcanary_jax.runtime`):

* :mod:`.layout`: the two KV layouts (RPA v3 with head_dim padded to 128 lanes; head_dim 64
  with K and V in one 128-lane row), recognised from the arrays and refused otherwise;
* :mod:`.device`: the step's batch derived on the device from ``AttentionMetadata`` (block
  tables, ``seq_lens``, ``query_start_loc``, ``request_distribution``, ``input_positions``,
  padding masked), the expected-token pool kept on the device, HEAD / TAIL / SWEEP per shard
  (one canary per data-parallel rank and per KV-head shard);
* :mod:`.host`: the request lifecycle (expected-id deltas, the fully written blocks the sweep
  re-verifies);
* :mod:`.guard`: the hooks (``model_fn``, ``persistent_batch_manager.update_states``) and the
  runtime manager (modes, reporting, agreement);
* :mod:`.loop`: the on-device decode loop's part of the guard (``model.step_fn_no_options``
  with the state in the loop's carry, ``_execute_continue_decode``, the loop's warm-up);
* :mod:`.remediation`: :class:`Remediator` (abort the request, evict its block from vLLM's
  prefix cache) and :class:`RequestId` (which request of an id a report's step ran).

Real-KV coverage: SGLang's fingerprint of one layer's K strips (``layer``, 0 by default;
``guard.layers`` names it), ``real_data`` ``none`` / ``partial`` / ``all``; and ours, the
coverage window (``coverage_window`` N, or ``SGLANG_KV_CANARY_COVERAGE_WINDOW``; docs/spec.md
§17): every byte of every layer's K and V of the slots steps read, verified within N steps, and
of the cached blocks at each sweep (``guard.coverage()`` reports the share).
"""

from kvcanary_jax.integrations.tpu_inference.device import TokenDelta, TpuInferenceCanary
from kvcanary_jax.integrations.tpu_inference.guard import (
    SUPPORTED_VERSIONS,
    Carried,
    TpuInferenceGuard,
    delta_jit,
    head_jit,
    install,
    read_violations,
    tail_jit,
    violation_counts,
)
from kvcanary_jax.integrations.tpu_inference.layout import SUPPORTED_LAYOUTS, KvLayout, kv_layout
from kvcanary_jax.integrations.tpu_inference.remediation import Remediator, RequestId

__all__ = [
    "install",
    "TpuInferenceGuard",
    "Remediator",
    "RequestId",
    "read_violations",
    "violation_counts",
    "TpuInferenceCanary",
    "TokenDelta",
    "Carried",
    "delta_jit",
    "head_jit",
    "tail_jit",
    "KvLayout",
    "kv_layout",
    "SUPPORTED_LAYOUTS",
    "SUPPORTED_VERSIONS",
]
