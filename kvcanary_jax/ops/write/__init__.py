"""canary_write: the op (:mod:`.base`), its implementations and its public entry (:mod:`.api`)."""

from kvcanary_jax.ops.write.api import canary_write, run
from kvcanary_jax.ops.write.base import CONTRACT, WriteTokens, canary_write_reference

__all__ = ["CONTRACT", "WriteTokens", "canary_write", "canary_write_reference", "run"]
