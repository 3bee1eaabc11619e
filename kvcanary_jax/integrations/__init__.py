"""Adapters from serving stacks' own objects (pools, batches, model steps) to the canary runtime.

Each adapter imports nothing from its serving stack: it reads the stack's objects by attribute, so
``import kvcanary_jax`` never needs the stack installed.
"""
