"""The canary around sglang-jax's model step, over sglang-jax's own pools, batches and KV layout.

sglang-jax (``sgl_jax``, the JAX serving stack of SGLang) has no KV integrity check. This package
takes its objects as they are (nothing here imports ``sgl_jax``; attributes are read by name) and
runs kv-canary's HEAD -> model -> TAIL step around its jitted model step, exactly as SGLang's
runtime does around its forward (``kvcanary_jax.runtime``).

Its modules, one concern each (as SGLang's ``srt/kv_canary/runner/``); each one's docstring has
the details of its part:

* :mod:`~kvcanary_jax.integrations.sglang_jax.layout`: the fused KV buffers of both layouts as
  real-KV sources, and :class:`SglangJaxCanary`, the canary's static description;
* :mod:`~kvcanary_jax.integrations.sglang_jax.batch`: sglang-jax's ``ForwardBatch`` as the
  canary's batch and slot table, on the device;
* :mod:`~kvcanary_jax.integrations.sglang_jax.tokens`: the expected token ids on the host
  (:func:`expected_tokens`, :func:`host_table`, :class:`TokenFeed` and its :class:`TokenDelta`);
* :mod:`~kvcanary_jax.integrations.sglang_jax.step`: the guarded step
  (:func:`guard_model_step`), once per KV shard, and its cost;
* :mod:`~kvcanary_jax.integrations.sglang_jax.runners`: which sglang-jax version a
  ``ModelRunner`` is (0.0.2, 0.1.0rc0) and where its step body is (:func:`runner_api`);
* :mod:`~kvcanary_jax.integrations.sglang_jax.hooks`: the step installed in sglang-jax's
  ``ModelRunner`` (:class:`ModelRunnerHook`, :class:`ManagedModelRunnerHook`);
* :mod:`~kvcanary_jax.integrations.sglang_jax.hicache`: the canary of a KV page carried to host
  memory and back with it through 0.1.0rc0's HiCache (:class:`HiCacheHook`);
* :mod:`~kvcanary_jax.integrations.sglang_jax.sweep`: the sweep of radix-cached prefixes, and the
  violations each shard recorded;
* :mod:`~kvcanary_jax.integrations.sglang_jax.remediation`: the runtime manager over the state,
  the request a slot belongs to, its abort and the radix drop (:class:`Remediator`).
"""

from kvcanary_jax.integrations.sglang_jax.batch import canary_batch
from kvcanary_jax.integrations.sglang_jax.hicache import HiCacheHook
from kvcanary_jax.integrations.sglang_jax.hooks import (
    ManagedModelRunnerHook,
    ModelRunnerHook,
    store_kv,
)
from kvcanary_jax.integrations.sglang_jax.layout import (
    SglangJaxCanary,
    fused_kv_sources,
    layer_source,
    layer_sources,
)
from kvcanary_jax.integrations.sglang_jax.remediation import (
    Remediator,
    abort_pending,
    abort_request,
    canary_manager,
    coverage,
    observe,
    drop_radix_slot,
    request_resolver,
)
from kvcanary_jax.integrations.sglang_jax.runners import SUPPORTED_VERSIONS, RunnerApi, runner_api
from kvcanary_jax.integrations.sglang_jax.step import guard_model_step
from kvcanary_jax.integrations.sglang_jax.sweep import (
    ShardViolation,
    node_dp_rank,
    radix_prefixes,
    hold,
    read_violations,
    sweep,
    violation_counts,
)
from kvcanary_jax.integrations.sglang_jax.tokens import (
    DeltaBatch,
    RequestIds,
    TokenDelta,
    TokenFeed,
    expected_tokens,
    host_table,
    request_token_ids,
)

__all__ = [
    "SglangJaxCanary",
    "ShardViolation",
    "fused_kv_sources",
    "layer_source",
    "layer_sources",
    "canary_batch",
    "expected_tokens",
    "TokenFeed",
    "TokenDelta",
    "request_token_ids",
    "host_table",
    "guard_model_step",
    "ModelRunnerHook",
    "radix_prefixes",
    "sweep",
    "read_violations",
    "violation_counts",
    "canary_manager",
    "observe",
    "hold",
    "coverage",
    "request_resolver",
    "abort_request",
    "abort_pending",
    "drop_radix_slot",
    "Remediator",
    "ManagedModelRunnerHook",
    "store_kv",
    "RequestIds",
    "DeltaBatch",
    "SUPPORTED_VERSIONS",
    "RunnerApi",
    "runner_api",
    "node_dp_rank",
    "HiCacheHook",
]
