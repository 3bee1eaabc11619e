"""canary_plan as two Mosaic TPU kernels (implementation ``"pallas_mosaic_tpu"``): the offsets
kernel, then the entries kernel, every plan array aliased input-to-output.

Semantics and bounds choices: those of the plan op (SGLang's ``launch_canary_plan_kernels``; the
offsets and entries halves as documented in the op's base module). The kernels, their named state
and their array-level halves (:func:`plan_offsets`, :func:`plan_entries`) live in
:mod:`.pallas_mosaic_tpu_kernel`, which also describes how they work; this module holds the
launch config, its heuristics and the op's entry point.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

from kvcanary_jax.ops import _tpu_lib as tpu
from kvcanary_jax.ops.plan import base
from kvcanary_jax.ops.plan.pallas_mosaic_tpu_kernel import (BLOCK, SEED_BATCH, SMEM_BUDGET,
                                                            plan_entries, plan_offsets)
from kvcanary_jax.plans import VerifyPlan, WritePlan

__all__ = ["Config", "heuristics", "run", "plan_offsets", "plan_entries", "SEED_BATCH", "BLOCK",
           "SMEM_BUDGET"]


@dataclasses.dataclass(frozen=True)
class Config(tpu.BlockConfig):
    """``block``: plan entries per output block (a multiple of 512); the rest:
    :class:`kvcanary_jax.ops._tpu_lib.Config`."""

    OP: ClassVar[str] = "canary_plan"
    block: int = BLOCK


def heuristics(shapes) -> Config:
    cap = int(shapes.get("verify_capacity", BLOCK))
    return Config(block=min(BLOCK, tpu.pad_to(max(cap, 1), tpu.PAIR_TILE)))


# The kernels compile per batch size: no ``inputs.num_reqs`` (api.run refuses one).
TAKES_NUM_REQS = False


def run(vp: VerifyPlan, wp: WritePlan, inputs: base.PlanInputs, *, swa_window_size: int,
        verify_capacity: int, kv_token_id_vs_position_offset: int, config: Config):
    """``(VerifyPlan, WritePlan)`` filled (``bs >= 1``; the caller handles an empty batch);
    every plan array is aliased to its input."""
    return base.compose(
        functools.partial(plan_offsets, config=config),
        functools.partial(plan_entries, config=config),
        vp, wp, inputs, swa_window_size=swa_window_size, verify_capacity=verify_capacity,
        kv_token_id_vs_position_offset=kv_token_id_vs_position_offset)
