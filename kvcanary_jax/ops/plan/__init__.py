"""canary_plan: the op (:mod:`.base`), its contract (:mod:`.contract`), its implementations and its
public entry (:mod:`.api`)."""

from kvcanary_jax.ops.plan.api import canary_plan, run, takes_num_reqs
from kvcanary_jax.ops.plan.base import PlanInputs, canary_plan_reference
from kvcanary_jax.ops.plan.contract import CONTRACT, PLAN_SCALARS, plan_metas

__all__ = ["CONTRACT", "PLAN_SCALARS", "PlanInputs", "canary_plan", "canary_plan_reference",
           "plan_metas", "run", "takes_num_reqs"]
