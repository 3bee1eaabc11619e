"""kvcanary-jax: SGLang's KV-cache canary (kv-canary) as JAX/Pallas kernels."""

from kvcanary_jax import _config  # noqa: F401  (filters the Triton-lowering notice first)
from kvcanary_jax.ops.scatter import scatter_req_token_ids, scatter_req_token_ids_reference

__version__ = "0.1.0"

__all__ = [
    "scatter_req_token_ids",
    "scatter_req_token_ids_reference",
]
