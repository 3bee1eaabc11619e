"""kvcanary-jax: SGLang's KV-cache canary (kv-canary) for JAX: XLA and Pallas implementations.

Ops (keyword arguments as SGLang's launchers; each returns its updated outputs and updates them
in place under ``jax.jit`` with donation): :func:`scatter_req_token_ids`, :func:`canary_plan`,
:func:`canary_write`, :func:`canary_verify`; and ours beside them, the per-slot KV digest of
every source's bytes (:func:`digest_write`, :func:`digest_verify`, with :class:`DigestContext`).
Each takes ``implementation=`` (see :func:`implementations_available`) and ``config=``, and has a
pure-jnp ``*_reference``.
Runtime for a serving loop: :class:`CanaryConfig`, :func:`init_state`, :func:`make_canary_step`,
:func:`canary_sweep`, :func:`read_violations` (see :mod:`kvcanary_jax.runtime`).
"""

# The console script's Ctrl-C handling starts here, before JAX is imported (kvcanary_jax._interrupt).
from kvcanary_jax import _interrupt

if _interrupt.is_console_script():
    _interrupt.install()

from kvcanary_jax import buckets  # noqa: E402  (after the interrupt handler, on purpose)
from kvcanary_jax._config import quiet_triton_lowering
from kvcanary_jax.consts import (
    CANARY_CHAIN_ANCHOR,
    CanaryLaunchTag,
    FailReason,
    RealKvHashMode,
)
from kvcanary_jax.context import DigestContext, RealKvSource, VerifyOrWriteContext
from kvcanary_jax.hashing import mix3, splitmix64
from kvcanary_jax.ops._registry import (
    IMPLEMENTATIONS,
    FallbackWarning,
    default_implementation,
    implementations_available,
)
from kvcanary_jax.ops.digest import (
    digest_verify,
    digest_verify_reference,
    digest_write,
    digest_write_reference,
)
from kvcanary_jax.ops.plan import canary_plan, canary_plan_reference
from kvcanary_jax.ops.scatter import scatter_req_token_ids, scatter_req_token_ids_reference
from kvcanary_jax.ops.verify import canary_verify, canary_verify_reference
from kvcanary_jax.ops.write import canary_write, canary_write_reference
from kvcanary_jax.plans import VerifyPlan, WritePlan
from kvcanary_jax.runtime import (
    CanaryConfig,
    CanaryManager,
    CanaryViolationError,
    ManagerConfig,
    CanaryState,
    ForwardBatch,
    Violation,
    canary_step_head,
    canary_step_tail,
    canary_sweep,
    init_state,
    init_state_stacked,
    make_batch,
    make_canary_step,
    read_counters,
    read_violations,
    violation_count,
)
from kvcanary_jax.runtime.sharded import make_sharded_step

__version__ = "0.1.0"

__all__ = [
    "buckets",
    "IMPLEMENTATIONS",
    "FallbackWarning",
    "default_implementation",
    "implementations_available",
    "quiet_triton_lowering",
    "CanaryConfig",
    "CanaryManager",
    "CanaryViolationError",
    "ManagerConfig",
    "CanaryState",
    "ForwardBatch",
    "Violation",
    "canary_step_head",
    "canary_step_tail",
    "canary_sweep",
    "canary_verify_reference",
    "canary_write_reference",
    "init_state",
    "init_state_stacked",
    "make_batch",
    "make_canary_step",
    "make_sharded_step",
    "read_counters",
    "read_violations",
    "violation_count",
    "CANARY_CHAIN_ANCHOR",
    "CanaryLaunchTag",
    "FailReason",
    "RealKvHashMode",
    "RealKvSource",
    "VerifyOrWriteContext",
    "DigestContext",
    "VerifyPlan",
    "WritePlan",
    "canary_plan",
    "canary_plan_reference",
    "canary_verify",
    "canary_write",
    "digest_verify",
    "digest_verify_reference",
    "digest_write",
    "digest_write_reference",
    "mix3",
    "scatter_req_token_ids",
    "scatter_req_token_ids_reference",
    "splitmix64",
]
