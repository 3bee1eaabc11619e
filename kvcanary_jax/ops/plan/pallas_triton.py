"""canary_plan through the Pallas kernels of :mod:`.pallas_triton_kernel` (Triton lowering on
CUDA GPUs; interpret mode too): the offsets kernel(s), then the entries kernel, every plan array
aliased input-to-output."""

from __future__ import annotations

import dataclasses
import functools

from kvcanary_jax.ops import _kernel_lib
from kvcanary_jax.ops.plan import base
from kvcanary_jax.ops.plan import pallas_triton_kernel as kernel
from kvcanary_jax.plans import VerifyPlan, WritePlan

__all__ = ["Config", "heuristics", "run"]


@dataclasses.dataclass(frozen=True)
class Config:
    """Launch parameters of both kernels (defaults: the kernel module's named constants).

    ``single_block_max``: largest batch of the one-program offsets path; ``multi_block``:
    requests per block above it; ``offsets_num_warps``; ``block_entries``: entries per program
    iteration (a power of two); ``max_programs``: the entries grid's cap (programs loop beyond
    it); ``entries_num_warps``; ``interpret``: Pallas interpret mode (any backend; what
    ``pallas_interpret`` runs)."""

    single_block_max: int = kernel.SINGLE_BLOCK_MAX
    multi_block: int = kernel.MULTI_BLOCK
    offsets_num_warps: int = kernel.OFFSETS_NUM_WARPS
    block_entries: int = kernel.BLOCK_ENTRIES
    max_programs: int = kernel.MAX_PROGRAMS
    entries_num_warps: int = kernel.ENTRIES_NUM_WARPS
    interpret: bool = False

    def __post_init__(self):
        _kernel_lib.check_interpret("canary_plan", self.interpret)
        pow2 = lambda n: n >= 1 and not n & (n - 1)  # noqa: E731
        if not (pow2(self.multi_block) and pow2(self.block_entries) and self.max_programs >= 1
                and self.single_block_max >= 1):
            raise ValueError(f"kv-canary: canary_plan: bad launch config {self} (multi_block and "
                             "block_entries powers of two, the rest >= 1)")


def heuristics(shapes) -> Config:
    return Config()


# The batch size may be an operand (``inputs.num_reqs``: base.batch_lanes).
TAKES_NUM_REQS = True


def run(vp: VerifyPlan, wp: WritePlan, inputs: base.PlanInputs, *, swa_window_size: int,
        verify_capacity: int, kv_token_id_vs_position_offset: int, config: Config):
    """``(VerifyPlan, WritePlan)`` filled (``bs >= 1``; the caller handles an empty batch).
    ``config.interpret``: Pallas interpret mode."""
    interpret = config.interpret
    offsets = functools.partial(
        kernel.plan_offsets, interpret=interpret, num_warps=config.offsets_num_warps,
        single_block_max=config.single_block_max, multi_block=config.multi_block)
    entries = functools.partial(
        kernel.plan_entries, interpret=interpret, block_entries=config.block_entries,
        max_programs=config.max_programs, num_warps=config.entries_num_warps)
    return base.compose(offsets, entries, vp, wp, inputs, swa_window_size=swa_window_size,
                        verify_capacity=verify_capacity,
                        kv_token_id_vs_position_offset=kv_token_id_vs_position_offset)
