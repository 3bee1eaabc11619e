"""canary_verify: the op (:mod:`.base`), its implementations and its public entry (:mod:`.api`)."""

from kvcanary_jax.ops.verify.api import canary_verify, run
from kvcanary_jax.ops.verify.base import CONTRACT, canary_verify_reference

__all__ = ["CONTRACT", "canary_verify", "canary_verify_reference", "run"]
