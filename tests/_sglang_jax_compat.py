"""What the sglang-jax harnesses do differently under sglang-jax 0.0.2 and 0.1.0rc0 (imported by
the scripts after they set XLA_FLAGS; nothing here sets up JAX).

The version is read from sglang-jax's own objects, as the integration reads it: 0.1.0rc0's
``ScheduleBatch.init_new`` takes per-DP request lists and ``dp_size``. What differs:

* ``ScheduleBatch.init_new(reqs: list[list[Req]], ..., dp_size)`` (0.1.0rc0) against
  ``init_new(reqs: list[Req], ...)`` (0.0.2): :func:`schedule_batch` takes per-DP lists and
  flattens them for 0.0.2 (which has no DP);
* the mesh: 0.1.0rc0's ``create_device_mesh`` builds two axes, ``("data", "tensor")``, with
  ``AxisType.Explicit``; 0.0.2's three (``data``, ``tensor``, ``expert``). :func:`mesh` builds
  the ``("data", "tensor")`` mesh each version's pools expect;
* 0.1.0rc0's scheduler releases a finished request with ``release_kv_cache``
  (:func:`release_finished`), 0.0.2's with ``cache_finished_req``;
* 0.1.0rc0's ``_merge_cache_loc`` writes ``cache_loc`` into a host buffer the
  ``ReqToTokenPool`` keeps (``init_cache_loc_host_buffer``, sized by the server at start), and
  every ``ModelWorkerBatch`` gets a view of it: on the CPU, ``ForwardBatch.init_new`` may place
  that view without a copy, so the next batch rewrites the ``cache_loc`` of a ``ForwardBatch``
  made before it. A harness that keeps a ``ForwardBatch`` past the next
  ``get_model_worker_batch`` (a replay) makes it with :func:`forward_batch`;
* 0.1.0rc0's ``ForwardBatch.init_new`` reads the runner's ``model_config.hf_config`` and
  ``is_embedding`` besides its mesh (:func:`runner_stand_in` gives both), and its
  ``get_model_worker_batch`` the model config's ``hf_config`` (:func:`prepare_model_config`).
"""

from __future__ import annotations

import inspect
import types

import jax
import numpy as np
from sgl_jax.srt.managers.schedule_batch import ScheduleBatch

V01 = "dp_size" in inspect.signature(ScheduleBatch.init_new).parameters
VERSION = "0.1.0rc0" if V01 else "0.0.2"


def mesh(devices, *, dp: int = 1) -> jax.sharding.Mesh:
    """A ``("data", "tensor")`` mesh of ``devices``, ``dp`` along ``data`` (0.1.0rc0's own
    ``create_device_mesh``: Explicit axes; 0.0.2: a plain mesh, as its pools take it)."""
    devices = list(devices)
    if V01:
        from sgl_jax.srt.utils.mesh_utils import create_device_mesh

        return create_device_mesh(ici_parallelism=[dp, -1], dcn_parallelism=[1, 1],
                                  devices=devices)
    return jax.sharding.Mesh(np.array(devices).reshape(dp, -1), ("data", "tensor"))


def runner_mesh(devices, *, auto_data: bool = False) -> jax.sharding.Mesh:
    """The mesh a ``ModelRunner`` gets from the server (tensor parallel over ``devices``;
    0.1.0rc0: Explicit axes, or with ``auto_data`` its ``data`` axis Auto)."""
    from sgl_jax.srt.utils.mesh_utils import create_device_mesh

    if V01:
        mesh_ = create_device_mesh(ici_parallelism=[1, -1], dcn_parallelism=[1, 1],
                                   devices=devices)
        if auto_data:
            mesh_ = jax.sharding.Mesh(mesh_.devices, mesh_.axis_names, axis_types=(
                jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit))
        return mesh_
    return create_device_mesh(ici_parallelism=[-1, len(devices), 1], dcn_parallelism=[1, 1, 1],
                              devices=devices)


def schedule_batch(reqs_per_dp, *, dp_size: int = 1, **kwargs) -> ScheduleBatch:
    """``ScheduleBatch.init_new`` with per-DP request lists (``reqs_per_dp[d]``: rank ``d``'s)."""
    if V01:
        return ScheduleBatch.init_new(reqs=[list(r) for r in reqs_per_dp], dp_size=dp_size,
                                      **kwargs)
    if dp_size != 1:
        raise ValueError(f"sglang-jax 0.0.2 has no data parallelism (dp_size={dp_size})")
    return ScheduleBatch.init_new(reqs=[r for rank in reqs_per_dp for r in rank], **kwargs)


def reqs_of(batch) -> list:
    """The batch's requests in batch order (every DP rank's, rank after rank)."""
    if V01:
        return [r for info in batch.reqs_info for r in (info.reqs or [])]
    return list(batch.reqs)


def reqs_per_dp(batch) -> list[list]:
    """The batch's requests per DP rank (0.0.2: one rank)."""
    if V01:
        return [list(info.reqs or []) for info in batch.reqs_info]
    return [list(batch.reqs)]


def set_output_ids(batch, per_dp) -> None:
    """The step's sampled ids, where ``prepare_for_decode`` takes the next input ids from:
    each DP rank's ``reqs_info[d].output_ids`` (0.1.0rc0), the batch's ``output_ids`` (0.0.2)."""
    if V01:
        for info, out in zip(batch.reqs_info, per_dp):
            info.output_ids = out
    else:
        (batch.output_ids,) = per_dp


def prepare_req_pool(req_pool, cache_loc_len: int) -> None:
    """0.1.0rc0: the host buffer ``cache_loc`` is merged into (the server sizes it at start)."""
    if V01:
        req_pool.init_cache_loc_host_buffer(cache_loc_len)


def forward_batch(mwb, runner):
    """``ForwardBatch.init_new(mwb, runner)`` on a ``cache_loc`` of its own: one the next
    ``get_model_worker_batch`` cannot rewrite (0.1.0rc0's is a view of the pool's host buffer,
    which the CPU client may alias, as it may any host array it is handed: then whether a
    replay sees its own batch's slots or the next batch's depends on that buffer's alignment)."""
    from sgl_jax.srt.model_executor.forward_batch_info import ForwardBatch

    mwb.cache_loc = np.array(mwb.cache_loc, copy=True)
    return ForwardBatch.init_new(mwb, runner)


def no_prefix_cache(req_pool, allocator, page_size: int):
    """The tree cache of a server without prefix caching: 0.1.0rc0 allocates through it
    (``ChunkCache``), 0.0.2 takes None."""
    if not V01:
        return None
    from sgl_jax.srt.mem_cache.chunk_cache import ChunkCache

    return ChunkCache(req_pool, allocator, page_size)


def match_len(tree_cache, token_ids, dp_rank: int = 0) -> int:
    """How many of ``token_ids`` the radix cache holds (0.1.0rc0's ``match_prefix`` takes a
    ``MatchPrefixParams`` of a ``RadixKey``; 0.0.2's the ids)."""
    if V01:
        from sgl_jax.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sgl_jax.srt.mem_cache.radix_cache import RadixKey

        key = RadixKey(list(token_ids), None, dp_rank)
        return len(tree_cache.match_prefix(MatchPrefixParams(key=key)).device_indices)
    return len(tree_cache.match_prefix(list(token_ids)).device_indices)


def matched_slots(tree_cache, token_ids, dp_rank: int = 0) -> np.ndarray:
    """The slots the radix cache holds for ``token_ids``' cached prefix."""
    if V01:
        from sgl_jax.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sgl_jax.srt.mem_cache.radix_cache import RadixKey

        key = RadixKey(list(token_ids), None, dp_rank)
        return np.asarray(tree_cache.match_prefix(MatchPrefixParams(key=key)).device_indices)
    return np.asarray(tree_cache.match_prefix(list(token_ids)).device_indices)


def release_finished(req, tree_cache) -> None:
    """The scheduler's release of a finished request: its KV into the radix cache, its
    ``req_to_token`` row freed (0.1.0rc0: ``mem_cache.common.release_kv_cache``, which also frees
    an over-allocated tail; 0.0.2: ``cache_finished_req`` does it all)."""
    if V01:
        from sgl_jax.srt.mem_cache.common import release_kv_cache

        release_kv_cache(req, tree_cache)
    else:
        tree_cache.cache_finished_req(req)


def prepare_model_config(model_config) -> None:
    """0.1.0rc0's ``get_model_worker_batch`` asks the model config whether the architecture is
    multimodal (``hf_config.architectures``), which ``MockModelConfig`` lacks: none."""
    if V01 and not hasattr(model_config, "hf_config"):
        model_config.hf_config = types.SimpleNamespace(architectures=[])


def runner_stand_in(mesh_):
    """What ``ForwardBatch.init_new`` reads of a ``ModelRunner`` (no attention backend: the
    harness's stand-in model does not attend)."""
    config = types.SimpleNamespace(is_embedding=False,
                                   hf_config=types.SimpleNamespace(architectures=[]))
    return types.SimpleNamespace(mesh=mesh_, attn_backend=None, model_config=config)
