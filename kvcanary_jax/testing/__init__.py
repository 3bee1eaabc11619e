"""Helpers for testing and benchmarking the ops: :mod:`kvcanary_jax.testing.cases` builds the
inputs of write and verify launches for JAX and torch, with the ops' own field names.

Nothing here runs at import of :mod:`kvcanary_jax`: import the module you need.
"""
