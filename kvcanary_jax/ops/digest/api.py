"""The public digest ops: validate once, bind the sources, pick the implementation and its launch
config, run it.

One registered op (``digest``), two functions: :func:`digest_write` and :func:`digest_verify`
share their hashing, their source binding and every kernel building block, so each
implementation is one module (``Config``, ``heuristics``, and ``run(function, ...)`` with
``function`` in :data:`FUNCTIONS`), as the registry keys one package per op. A tuned table's key
tells the two apart by the ``verify`` shape (0 or 1).
"""

from __future__ import annotations

import functools

import jax

from kvcanary_jax import _config
from kvcanary_jax.context import DigestContext
from kvcanary_jax.ops import _registry
from kvcanary_jax.ops.digest import base

__all__ = ["OP", "FUNCTIONS", "digest_write", "digest_verify", "write", "verify"]

OP = _registry.standard_op("digest")

# The functions every implementation module's ``run`` dispatches on.
FUNCTIONS = ("write", "verify")


@functools.partial(jax.jit, static_argnames=("implementation", "config"))
def _write(digest_buf, slots, sources, *, implementation, config):
    if slots.shape[0] == 0 or digest_buf.shape[0] == 0:
        return digest_buf
    return OP.run(implementation, "write", digest_buf, slots, sources, config=config)


@functools.partial(jax.jit, static_argnames=("window", "implementation", "config"))
def _verify(context, slots, positions, num_valid, phase, sources, *, window, implementation,
            config):
    run = functools.partial(OP.run, implementation, "verify", config=config, window=window)
    out = base.sized_verify(lambda ctx, *a: run(ctx, *a, sources), context, slots, positions,
                            num_valid, phase)
    # Only the updated fields leave the jit: one returned unchanged would be copied by XLA.
    return {k: getattr(out, k) for k in base.OUTPUTS}


def write(digest_buf, slots, sources: base.BoundSources, *, implementation: str | None = None,
          config=None):
    """Array-level write of bound sources, without the contract's checks; ``slots`` int64 or
    int32 (a server's own slot array, read as it is: no convert kernel)."""
    impl = OP.select(implementation, config=config, args=(digest_buf, slots))
    cfg = OP.config(impl, base.shapes(digest_buf.shape[0], slots.shape[0], sources,
                                      verify=False), config)
    return _write(digest_buf, slots, sources, implementation=impl, config=cfg)


def verify(context: DigestContext, slots, positions, num_valid, phase,
           sources: base.BoundSources, *, window: int, implementation: str | None = None,
           config=None) -> DigestContext:
    """Array-level verify of bound sources, without the contract's checks."""
    impl = OP.select(implementation, config=config, args=(context.digest_buf, slots))
    cfg = OP.config(impl, base.shapes(context.digest_buf.shape[0], slots.shape[0], sources,
                                      verify=True, window=window), config)
    return context.replace(**_verify(context, slots, positions, num_valid, phase, sources,
                                     window=window, implementation=impl, config=cfg))


@_config.entry_point
def digest_write(digest_buf: jax.Array, slots: jax.Array, sources, *,
                 implementation: str | None = None, config=None) -> jax.Array:
    """Store the KV digest of every valid slot of ``slots``; returns the new ``digest_buf``
    (semantics: :mod:`kvcanary_jax.ops.digest.base`, docs/spec.md §16).

    ``digest_buf`` int64 ``[num_slots]``; ``slots`` int64 ``[n]`` (negative: padding, skipped;
    at or past ``num_slots``: skipped); ``sources``: a tuple of 1 to 512
    :class:`~kvcanary_jax.RealKvSource` (one per layer and half, or per fused K/V layer), each
    hashed over all of its ``read_bytes``. Under ``jax.jit(..., donate_argnums=0)`` the update is
    in place.

    ``implementation``: ``"xla"``, ``"pallas_triton"``, ``"pallas_interpret"``,
    ``"pallas_mosaic_tpu"`` (default: the platform's, see :mod:`kvcanary_jax.ops._registry`);
    ``config``: that implementation's ``Config`` (default: the device kind's tuned table, else
    heuristics). Raises TypeError / ValueError at trace time for bad arguments.
    """
    bound = base.validate_write(digest_buf, slots, sources)
    return write(digest_buf, slots, bound, implementation=implementation, config=config)


@_config.entry_point
def digest_verify(context: DigestContext, slots: jax.Array, positions: jax.Array,
                  num_valid: jax.Array, phase: jax.Array, *, window: int, sources,
                  implementation: str | None = None, config=None) -> DigestContext:
    """Check the digests of the selected entries' slots; returns the updated context (semantics:
    :mod:`kvcanary_jax.ops.digest.base`, docs/spec.md §16).

    An entry ``e < num_valid[0]`` (int32 ``[1]``, clamped to the capacity) is selected when its
    slot ``s = slots[e]`` (int64) is in ``(0, num_slots)`` and ``s % window == phase[0]`` (int32
    ``[1]``, a device scalar, taken mod ``window``; ``window`` a static int >= 1: 1 checks every
    entry). A selected entry whose recomputed digest differs from ``digest_buf[s]`` records
    ``(kernel_kind, s, positions[e], 0, 0, stored, recomputed, KV_DIGEST_MISMATCH)``. The
    returned context carries the new ring, write index and counters (``slot_run_counter`` +=
    entries checked, ``kernel_run_counter`` += 1); under ``jax.jit(..., donate_argnums=0)`` the
    update is in place. ``implementation`` / ``config``: as :func:`digest_write`.
    """
    bound = base.validate_verify(context, slots, positions, num_valid, phase, window, sources)
    return verify(context, slots, positions, num_valid, phase, bound, window=window,
                  implementation=implementation, config=config)
