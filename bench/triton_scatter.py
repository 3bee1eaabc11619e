"""A plain Triton scatter of the 2-D (request x column tile) design, as a strong baseline.

SGLang's newer upstream scatter uses this design; SGLang 0.5.23's wheel ships the older
token-grid kernel (one owner search per token over all offsets), which is 10-60x slower on large
batches. Written here so our Pallas kernel is compared against the best Triton has to offer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The fastest of 15 (block, warps) variants for this kernel too (bench/tune_scatter.py).
BLOCK = 256


@triton.jit
def _scatter_2d_kernel(flat_ptr, offsets_ptr, rpi_ptr, pool_ptr, num_tokens, pool_stride0,
                       max_cols, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    c = tl.program_id(1)
    start = tl.load(offsets_ptr + r)
    end = tl.load(offsets_ptr + r + 1)
    write_len = tl.minimum(end - start, max_cols)
    col0 = c * BLOCK
    if col0 < write_len:
        cols = col0 + tl.arange(0, BLOCK)
        src = start + cols
        mask = (cols < write_len) & (src >= 0) & (src < num_tokens)
        vals = tl.load(flat_ptr + src, mask=mask, other=0)
        rp = tl.load(rpi_ptr + r)
        tl.store(pool_ptr + rp * pool_stride0 + cols, vals.to(tl.int32), mask=mask)


def scatter_2d(*, flat_in: torch.Tensor, offsets: torch.Tensor, req_pool_indices: torch.Tensor,
               pool_out: torch.Tensor) -> None:
    bs, num_tokens, max_cols = req_pool_indices.shape[0], flat_in.shape[0], pool_out.shape[1]
    span = min(max_cols, num_tokens)
    if bs == 0 or span == 0:
        return
    grid = (bs, triton.cdiv(span, BLOCK))
    _scatter_2d_kernel[grid](flat_in, offsets, req_pool_indices, pool_out, num_tokens,
                             pool_out.stride(0), max_cols, BLOCK=BLOCK, num_warps=4)
