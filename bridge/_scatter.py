"""``launch_scatter_req_token_ids_kernel`` over torch tensors (SGLang's name and keywords)."""

from __future__ import annotations

import functools

import jax
import torch

from bridge import _fast
from bridge import _interop as io
from bridge._common import (
    Validated,
    check_range,
    isig,
    require_tensors,
    sig,
    torch_checks,
    value_checks_enabled,
)
from kvcanary_jax.ops import _registry
from kvcanary_jax.ops import scatter as _op

__all__ = ["launch_scatter_req_token_ids_kernel", "scatter_adapter"]

_P = "kv-canary: scatter_req_token_ids"
_NAMES = ("flat_in", "offsets", "req_pool_indices", "pool_out")
# SGLang's Triton kernel indexes the three 1-D inputs densely and steps pool rows by stride(0):
# the inputs must be contiguous, the pool only needs unit column stride.
_TORCH = torch_checks(
    "scatter_req_token_ids", "pool_out", ("flat_in", "offsets", "req_pool_indices"), _NAMES
)


@functools.partial(
    jax.jit, static_argnames=("max_cols", "platform"), donate_argnums=(3,), keep_unused=True
)
def scatter_adapter(flat_in, offsets, req_pool_indices, pool_out, fence, *, max_cols, platform):
    del fence  # an operand only so that the computation waits on its ready event
    return _op.run(flat_in, offsets, req_pool_indices, pool_out, max_cols=max_cols,
                   implementation=_registry.default_implementation("scatter", platform))


_VALIDATED = Validated()
_FAST = _fast.new_fast_path()


def check_scatter(*, flat_in, offsets, req_pool_indices, pool_out):
    """All checks of the launcher; returns the tensors' signatures (cache keys), or None when
    there is nothing to launch."""
    key = (isig(flat_in), isig(offsets), isig(req_pool_indices), sig(pool_out))
    if key not in _VALIDATED:
        tensors = dict(flat_in=flat_in, offsets=offsets, req_pool_indices=req_pool_indices,
                       pool_out=pool_out)
        require_tensors(_P, tensors)
        _op.CONTRACT.validate(tensors)
        _TORCH.validate(tensors)
        _VALIDATED.add(key)
    bs, num_tokens = int(req_pool_indices.shape[0]), int(flat_in.shape[0])
    if bs == 0 or num_tokens == 0:
        return None
    if value_checks_enabled(pool_out.device):
        check_range(_P, "req_pool_indices", req_pool_indices, 0, int(pool_out.shape[0]),
                    "rows of pool_out")
        check_range(_P, "offsets", offsets, 0, num_tokens + 1, "flat_in positions")
        if bool((offsets[1:] < offsets[:-1]).any()):
            raise ValueError(f"{_P} offsets must be non-decreasing, got {offsets.tolist()}")
    return key


def launch_scatter_req_token_ids_kernel(
    *,
    flat_in: torch.Tensor,
    offsets: torch.Tensor,
    req_pool_indices: torch.Tensor,
    pool_out: torch.Tensor,
) -> None:
    """Scatter each request's int64 tokens into its int32 row of ``pool_out``, in place.

    Same keywords, dtypes, checks (order, classes, messages) and in-place semantics as SGLang
    0.5.23's launcher, without its ``bs + 1 <= 512`` cap. ``pool_out`` may be a view whose rows
    are strided (``pool[:, :n]``); columns outside the view are never written.
    """
    tensors = (flat_in, offsets, req_pool_indices, pool_out)
    b = _FAST.get(id(pool_out), tensors)
    if b is not None and not value_checks_enabled(b.info.torch_device) and b.run():
        return
    key = check_scatter(flat_in=flat_in, offsets=offsets, req_pool_indices=req_pool_indices,
                        pool_out=pool_out)
    if key is None:
        return
    info = io.device_info(pool_out)
    with io.x64_scope():
        fence = io.fence(info)
        pool = io.import_output(pool_out, "pool_out", info, key[3])
        args = (io.import_input(flat_in, "flat_in", info),
                io.import_input(offsets, "offsets", info),
                io.import_input(req_pool_indices, "req_pool_indices", info),
                pool.array)
        static = dict(max_cols=pool.cols, platform=info.platform)
        _fast.full_call(_FAST, id(pool_out), tensors, info, adapter=scatter_adapter, args=args,
                        fence=fence, static=static, donate=(3,), outs=(pool,),
                        results_of=lambda r: (r,))
