"""The canary's ops, one package each (``scatter``, ``plan``, ``write``, ``verify``).

Each package holds ``base.py`` (the op's contract, static shapes and pure-jnp reference, the
oracle of every implementation), one module per implementation (``pallas_triton.py``, which also
serves ``pallas_interpret``; ``xla.py``; ...) and ``api.py`` (the public function: validate, pick
the implementation and its launch config, call it). :mod:`._registry` chooses implementations and
configs; :mod:`._kernel_lib` holds what the implementations share, :mod:`._contract_lib` the
contract rules write and verify share.
"""
