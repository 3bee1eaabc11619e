"""scatter_req_token_ids: the op (:mod:`.base`), its implementations and its public entry
(:mod:`.api`)."""

from kvcanary_jax.ops.scatter.api import run, scatter_req_token_ids
from kvcanary_jax.ops.scatter.base import CONTRACT, ScatterInputs, scatter_req_token_ids_reference

__all__ = ["CONTRACT", "ScatterInputs", "run", "scatter_req_token_ids",
           "scatter_req_token_ids_reference"]
