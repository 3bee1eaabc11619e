"""``python -m kvcanary_jax.bench`` and, from a checkout's root, ``python -m bench``."""

from kvcanary_jax.bench.run import main

# The usage line names the command as typed: python -m bench or python -m kvcanary_jax.bench.
raise SystemExit(main(prog=f"python -m {__spec__.name.rpartition('.')[0]}"))
