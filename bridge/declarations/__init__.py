"""SGLang's kv-canary launchers declared as data for the generic launcher
(:mod:`kvcanary_jax.bridge.launcher`).

A :class:`Declaration` says, for one launcher: its tensors by SGLang's names (read from the keyword
arguments and SGLang's dataclasses), its non-tensor arguments, its static checks (the ops' contracts
evaluated on the torch tensors: SGLang's classes, words and order, then the torch-only checks), its
opt-in value checks, when there is nothing to launch, and how the call becomes the arguments of one
array function over JAX arrays (:class:`~kvcanary_jax.bridge.launcher.Arg`: shape as lowered,
layout, in-place outputs) that calls the package's array-level entry points. The same function runs
through XLA on the DLPack path and is lowered to its Triton kernels on the direct path: one kernel
source.

Buckets (:mod:`kvcanary_jax.buckets`): scatter's ``flat_in`` and write's token arrays are lowered
at ``bucket(length)``. The scatter's kernel reads the true length (an int64 ``[1]``, a row of the
bridge's never-freed table of lengths: ``Arg.length_of``) and reads the offsets as at most that,
so a call signature holds the history's bucket, not its length (``Declaration.bucketed``: the
history SGLang scatters grows every step, and keeps its prepared call); the write's
offsets are clamped to the true length by a torch op on the call's stream (a per-call
temporary). Either keeps every read below the true length on both paths. ``launch_canary_step``
buckets its scatter input only (its write offsets are computed inside the step). The plan's request vectors are lowered at ``min(bucket(bs),
write_req_capacity)`` with the batch size as an operand (``num_reqs``: a device scalar from
:class:`kvcanary_jax.bridge.cache.Counts`): its kernels never read a request lane at or past it, so
the caller's shorter vectors are passed as they are on the direct path (staged on the DLPack path)
and the plan equals the unpadded one (:func:`kvcanary_jax.ops.plan.base.batch_lanes`).

Its modules: one per launcher, as the ops are laid out, and the pieces they share (each one's
docstring has the details of its part):

* :mod:`~kvcanary_jax.bridge.declarations.shared`: the :class:`Declaration` record and what the
  declarations share (binding by name, the arguments' forms, the context's tensors, the checks
  every launcher runs);
* :mod:`~kvcanary_jax.bridge.declarations.scatter`: :data:`SCATTER`,
  ``launch_scatter_req_token_ids_kernel``;
* :mod:`~kvcanary_jax.bridge.declarations.plan`: :data:`PLAN`, ``launch_canary_plan_kernels``;
* :mod:`~kvcanary_jax.bridge.declarations.verify`: :data:`VERIFY`,
  ``launch_canary_verify_kernel``;
* :mod:`~kvcanary_jax.bridge.declarations.write`: :data:`WRITE`, ``launch_canary_write_kernel``;
* :mod:`~kvcanary_jax.bridge.declarations.step`: :data:`STEP`, ``launch_canary_step``, the four
  in one function, from the pieces of the other four;
* :mod:`~kvcanary_jax.bridge.declarations.digest`: :data:`DIGEST_WRITE`, :data:`DIGEST_VERIFY`,
  ``launch_kv_digest_write`` and ``launch_kv_digest_verify`` (ours: the per-slot KV digest of
  every source, docs/spec.md §16).
"""

from kvcanary_jax.bridge.declarations.digest import (
    DIGEST_VERIFY,
    DIGEST_WRITE,
    digest_verify_fn,
    digest_write_fn,
)
from kvcanary_jax.bridge.declarations.plan import PLAN, plan_fn, plan_lanes
from kvcanary_jax.bridge.declarations.scatter import SCATTER, scatter_fn
from kvcanary_jax.bridge.declarations.shared import Declaration, check_distinct_outputs
from kvcanary_jax.bridge.declarations.step import STEP, step_fn
from kvcanary_jax.bridge.declarations.verify import VERIFY, verify_fn
from kvcanary_jax.bridge.declarations.write import WRITE, write_fn

__all__ = ["Declaration", "SCATTER", "PLAN", "VERIFY", "WRITE", "STEP", "DIGEST_WRITE",
           "DIGEST_VERIFY", "check_distinct_outputs", "scatter_fn", "plan_fn", "plan_lanes",
           "verify_fn", "write_fn", "step_fn", "digest_write_fn", "digest_verify_fn"]
