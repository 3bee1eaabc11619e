"""One canary per data-parallel shard: :mod:`kvcanary_jax.runtime.sharded`, importable from here as
before it moved into the runtime."""

from kvcanary_jax.runtime.sharded import (
    data_parallel_mesh,
    make_sharded_step,
    stack_shards,
    unstack_shard,
)

__all__ = ["stack_shards", "unstack_shard", "make_sharded_step", "data_parallel_mesh"]
