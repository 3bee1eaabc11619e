"""Helpers for testing and benchmarking the ops: :mod:`kvcanary_jax.testing.cases` builds the
inputs of write and verify launches for JAX and torch, with the ops' own field names;
:mod:`kvcanary_jax.testing.forward` a model forward that writes every layer's K and V, for the
runtime's step.

Nothing here runs at import of :mod:`kvcanary_jax`: import the module you need.
"""
