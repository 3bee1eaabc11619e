"""One module per op: the Pallas kernel body, its jitted wrapper, its pure-jnp reference and its
contract (see :mod:`kvcanary_jax.contracts`)."""
