"""Shape buckets: a bounded number of compilations for a serving loop whose shapes change every step.

JAX and Triton compile a kernel per shape. A server's token counts change every step (the token
history that the expected-token scatter reads grows by the batch size every decode step; the
tokens a write stamps vary with prefill and speculative decoding), so a loop that passes its
arrays as they come compiles without bound. :func:`bucket` rounds a length up to a power of two
above a floor: over lengths up to ``n`` a loop then compiles at most ``log2(n / FLOOR) + 1``
shapes per op.

Padding that the ops mask through their offsets and counts (so the results equal those of the
unpadded arrays, untouched memory included):

=========  =========================================  ========================================
op         padded argument (to ``bucket(len)``)        what keeps the padding out
=========  =========================================  ========================================
scatter    ``flat_in`` (any fill)                      ``offsets`` clamped to the true length:
                                                       ``min(offsets, len(flat_in))``
write      ``input_ids``, ``positions``,               ``plan.write_offsets`` clamped to the
           ``out_cache_loc``, ``expected_input_*``     true token count (tokens past it are
           (any fill)                                  never read); or ``out_cache_loc`` padded
                                                       with -1 (a skipped slot)
=========  =========================================  ========================================

The clamp is exact: the ops never read a token at or past the true length (scatter leaves its
cell untouched; write skips it), and ``min(offset, n)`` removes exactly those indices from every
range, in order. In a JAX serving loop::

    n = flat.shape[0]
    flat_b = kc.buckets.pad(flat, kc.buckets.bucket(n))
    pool = kc.scatter_req_token_ids(flat_in=flat_b, offsets=jnp.minimum(offsets, n), ...)

(``n`` a traced value or a Python int: neither changes the compiled shape.) The torch bridge
applies the same rule to the same arguments (``bridge``; ``launch_canary_step`` buckets its
scatter input only: its write offsets are computed inside the step).

Batch sizes: the plan writes ``write_num_valid_reqs = bs`` and zeroes ``write_offsets`` past
``bs``, so a padded batch alone gives a different plan. Pass the true batch size as the plan's
``num_reqs`` operand (``kc.canary_plan(..., num_reqs=n)`` with the request vectors padded to
``bucket(n)``, any fill): lanes at or past it are never read and the plan equals the unpadded
one (``xla`` and the Pallas kernels; ``pallas_mosaic_tpu`` compiles per batch size). The torch
bridge does this for the plan launcher.
"""

from __future__ import annotations

__all__ = ["FLOOR", "bucket", "pad", "num_buckets"]

FLOOR = 64


def _length(name: str, value) -> int:
    """An integer (Python or numpy, not bool): ``int()`` would round 64.5 down (a bucket below
    the length) and parse "65"."""
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"kv-canary: {name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def bucket(n: int, floor: int = FLOOR) -> int:
    """The smallest power of two ``>= n`` and ``>= floor``; 0 for 0 (zero sizes are no-ops).
    Raises TypeError for a length that is not an integer, ValueError for a negative one."""
    n = _length("a length", n)
    floor = _length("floor", floor)
    if n < 0:
        raise ValueError(f"kv-canary: a length cannot be negative, got {n}")
    if n == 0:
        return 0
    b = max(floor, 1)
    b = 1 << (b - 1).bit_length()
    return max(b, 1 << (n - 1).bit_length())


def num_buckets(n_max: int, floor: int = FLOOR) -> int:
    """How many distinct buckets lengths ``1..n_max`` fall into."""
    n_max = _length("n_max", n_max)
    if n_max <= 0:
        return 0
    return (bucket(n_max, floor).bit_length() - bucket(1, floor).bit_length()) + 1


def pad(x, size: int, fill=0, axis: int = 0):
    """``x`` padded with ``fill`` along ``axis`` to ``size`` (a JAX or numpy array)."""
    import jax.numpy as jnp

    x = jnp.asarray(x)
    extra = _length("size", size) - x.shape[axis]
    if extra < 0:
        raise ValueError(f"kv-canary: cannot pad length {x.shape[axis]} down to {size}")
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=fill)
