"""The per-slot KV digest (ours, docs/spec.md §16): :func:`digest_write` and :func:`digest_verify`
(:mod:`.base`: semantics and the jnp references), their implementations and public entries
(:mod:`.api`)."""

from kvcanary_jax.ops.digest.api import digest_verify, digest_write
from kvcanary_jax.ops.digest.base import digest_verify_reference, digest_write_reference

__all__ = ["digest_verify", "digest_verify_reference", "digest_write", "digest_write_reference"]
