"""The declaration of ``launch_scatter_req_token_ids_kernel`` (:data:`SCATTER`).

Each request's int64 tokens into its int32 row of ``pool_out``, in place: SGLang's checks (the
op's contract, then the torch-only ones), the values checked on request (rows, offsets inside
``flat_in``, non-decreasing), and the arguments: ``flat_in`` at ``bucket(length)`` with its true
length beside it (the kernel reads the offsets as at most that length; a call signature holds the
bucket, so the history SGLang scatters, longer every step, keeps one prepared call), ``pool_out``
a view whose rows may be strided. The step reuses the
checks and the call (:func:`scatter_validate`, :func:`scatter_skip`, :func:`scatter_values`,
:func:`scatter_call`).
"""

from __future__ import annotations

from kvcanary_jax.bridge.checks import check_range, require_tensors, torch_checks
from kvcanary_jax.bridge.declarations.shared import (
    Declaration,
    count_arg,
    dense,
    impl_for,
    pitched,
    platform_of,
    rebuild,
)
from kvcanary_jax import buckets
from kvcanary_jax.ops import scatter as _scatter
from kvcanary_jax.ops.scatter.base import ScatterInputs

__all__ = ["SCATTER", "scatter_fn", "scatter_validate", "scatter_skip", "scatter_values",
           "scatter_call"]

_SP = "kv-canary: scatter_req_token_ids"
_SCATTER_TORCH = torch_checks(
    "scatter_req_token_ids", "pool_out", ("flat_in", "offsets", "req_pool_indices"),
    ("flat_in", "offsets", "req_pool_indices", "pool_out"))


def _scatter_tensors(kw):
    return {k: kw[k] for k in ("flat_in", "offsets", "req_pool_indices", "pool_out")}


def scatter_validate(kw, ts):
    require_tensors(_SP, ts)
    _scatter.CONTRACT.validate(ts)
    _SCATTER_TORCH.validate(ts)


def scatter_skip(kw, ts):
    return ts["req_pool_indices"].shape[0] == 0 or ts["flat_in"].shape[0] == 0


def scatter_values(kw, ts):
    pool, offsets = ts["pool_out"], ts["offsets"]
    num_tokens = int(ts["flat_in"].shape[0])
    check_range(_SP, "req_pool_indices", ts["req_pool_indices"], 0, int(pool.shape[0]),
                "rows of pool_out")
    check_range(_SP, "offsets", offsets, 0, num_tokens + 1, "flat_in positions")
    if bool((offsets[1:] < offsets[:-1]).any()):
        raise ValueError(f"{_SP} offsets must be non-decreasing, got {offsets.tolist()}")


def _scatter_args(flat_in, offsets, rpi, pool_name, pool):
    """Scatter's arguments, ``flat_in`` bucketed; ``pool`` may be a view with strided rows (only
    its columns are written, so its base may run past the storage on the direct path)."""
    b = buckets.bucket(int(flat_in.shape[0]))
    args = [
        dense("flat_in", flat_in, shape=(b,)),
        count_arg("num_tokens", "flat_in"),
        dense("offsets", offsets),
        dense("req_pool_indices", rpi),
        pitched(pool_name, pool, out=True, check_fits=False),
    ]
    return args


def scatter_call(inputs: ScatterInputs, *, max_cols, platform, num_tokens=None):
    """``num_tokens``: ``flat_in``'s true length (an int64 ``[1]``; ``flat_in`` is a bucket)."""
    return _scatter.run(inputs, max_cols=max_cols, implementation=impl_for("scatter", platform),
                        num_tokens=num_tokens)


def scatter_fn(named, *, max_cols, platform):
    # The arguments are named after ScatterInputs' fields (and num_tokens); the pool comes back
    # as pool_out.
    return {"pool_out": scatter_call(rebuild(ScatterInputs, named), max_cols=max_cols,
                                     platform=platform, num_tokens=named.get("num_tokens"))}


def _scatter_arguments(kw, ts):
    pool = ts["pool_out"]
    args = _scatter_args(ts["flat_in"], ts["offsets"], ts["req_pool_indices"], "pool_out", pool)
    return args, dict(max_cols=int(pool.shape[1]), platform=platform_of(pool)), ("pool_out",)


SCATTER = Declaration(
    name="launch_scatter_req_token_ids_kernel", anchor="pool_out", outputs=("pool_out",),
    tensors=_scatter_tensors, bucketed=1,  # flat_in, first
    statics=lambda kw: (), validate=scatter_validate, skip=scatter_skip,
    check_values=scatter_values, arguments=_scatter_arguments, fn=scatter_fn,
)
