"""One canary per data-parallel shard (DP-attention servers).

With DP attention every data-parallel rank owns its own requests, ``req_to_token`` rows and KV
pool, so each rank runs its own canary. Here the per-rank states, KV pools, batches and tables are
stacked along a leading axis of size ``mesh.shape[axis]`` and sharded over that mesh axis; one
``shard_map`` runs the ordinary HEAD -> forward -> TAIL step on every shard's slice, with no
communication between shards (violation rings and counters are per shard, as in SGLang).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from kvcanary_jax import _config
from kvcanary_jax.runtime.rebase import Rebaser
from kvcanary_jax.runtime.state import CanaryConfig, state_jit
from kvcanary_jax.runtime.step import step_fn

__all__ = ["stack_shards", "unstack_shard", "make_sharded_step", "data_parallel_mesh"]


def data_parallel_mesh(num_devices: int | None = None, axis: str = "dp") -> Mesh:
    devices = jax.devices()[: num_devices or len(jax.devices())]
    return Mesh(devices, (axis,))


@_config.with_x64
def stack_shards(trees: Sequence, mesh: Mesh, axis: str = "dp"):
    """Stack per-shard pytrees (states, KV dicts, batches, tables) along a new leading axis and
    place shard ``i`` on device ``i`` of ``mesh``."""
    n = mesh.shape[axis]
    if len(trees) != n:
        raise ValueError(f"kv-canary sharded: {len(trees)} shards for a mesh axis of size {n}")
    sharding = NamedSharding(mesh, P(axis))
    stacked = jax.tree.map(lambda *xs: jnp.stack([jnp.asarray(x) for x in xs]), *trees)
    return jax.device_put(stacked, sharding)


def unstack_shard(tree, i: int):
    """Shard ``i`` of a stacked pytree (a host-side view, e.g. to decode its violation ring)."""
    return jax.tree.map(lambda x: x[i], tree)


def make_sharded_step(cfg: CanaryConfig, forward: Callable, mesh: Mesh, axis: str = "dp", *,
                      implementation: str | None = None):
    """The combined step of :func:`~kvcanary_jax.runtime.make_canary_step`, run per shard under
    ``shard_map``.

    Returns ``step(states, kvs, batches, req_to_tokens, luts) -> (states, kvs)`` over stacked
    pytrees (see :func:`stack_shards`); states and KV are donated. ``implementation`` overrides
    ``cfg.implementation``. As :func:`~kvcanary_jax.runtime.make_canary_step`'s, the step keeps
    the states' coverage step counters from wrapping (``step.rebaser``).
    """
    if implementation is not None:
        cfg = dataclasses.replace(cfg, implementation=implementation)
    one_shard = step_fn(cfg, forward)

    def per_shard(state, kv, batch, req_to_token, lut):
        take = functools.partial(jax.tree.map, lambda x: x[0])
        state, kv = one_shard(take(state), take(kv), take(batch), take(req_to_token), take(lut))
        put = functools.partial(jax.tree.map, lambda x: x[None])
        return put(state), put(kv)

    spec = P(axis)
    mapped = jax.shard_map(per_shard, mesh=mesh, in_specs=(spec,) * 5, out_specs=(spec, spec),
                           check_vma=False)
    jitted = state_jit(mapped, donate_argnums=(0, 1))
    rebaser = Rebaser(cfg)  # the stacked states' coverage step counters kept from wrapping

    @_config.entry_point
    def step(states, kvs, batches, req_to_tokens, luts):
        return jitted(rebaser(states), kvs, batches, req_to_tokens, luts)

    step.jitted = jitted
    step.cfg = cfg
    step.rebaser = rebaser
    return step
