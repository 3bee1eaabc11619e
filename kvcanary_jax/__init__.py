"""kvcanary-jax: SGLang's KV-cache canary (kv-canary) as JAX/Pallas kernels."""

from kvcanary_jax import _config  # noqa: F401  (filters the Triton-lowering notice first)
from kvcanary_jax.ops.plan import canary_plan, canary_plan_reference
from kvcanary_jax.ops.scatter import scatter_req_token_ids, scatter_req_token_ids_reference
from kvcanary_jax.plans import VerifyPlan, WritePlan

__version__ = "0.1.0"

__all__ = [
    "VerifyPlan",
    "WritePlan",
    "canary_plan",
    "canary_plan_reference",
    "scatter_req_token_ids",
    "scatter_req_token_ids_reference",
]
