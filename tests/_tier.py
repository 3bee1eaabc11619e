"""Test tiers: how many random cases a fuzz test draws, and how a failing case is reported.

The fast tier (the default, the README's test command) keeps every test function and every
parametrization and draws a few dozen cases per fuzz, as SGLang's own pull-request tier does (one
seed, 30 to 50 iterations). ``--long`` restores the full counts, with the same seeds: the first
cases of a long run are the fast run's cases. The README lists each count that moved.

Every fuzz states its seed (printed, shown by pytest on failure) and wraps each case in
:func:`case`, so a failure names the case that reproduces it."""

from __future__ import annotations

import contextlib

LONG = False  # set from --long by conftest.pytest_configure, before any test module is imported


def n(fast: int, long: int) -> int:
    """``long`` cases under ``--long``, else ``fast``."""
    return long if LONG else fast


def counts(fast, long):
    """:func:`n` over sequences (per-bucket counts)."""
    return list(long) if LONG else list(fast)


def seeded(name: str, seed, cases: int) -> None:
    print(f"[fuzz] {name}: seed {seed}, {cases} cases ({'long' if LONG else 'fast'} tier)")


@contextlib.contextmanager
def case(name: str, seed, index: int, **detail):
    """Adds ``name``, ``seed``, the case's index and ``detail`` to an exception raised inside, so
    the failure says how to rerun it (the same seed draws the same cases in order)."""
    try:
        yield
    except BaseException as e:  # re-raised: only annotated
        extra = "".join(f", {k}={v!r}" for k, v in detail.items())
        e.add_note(f"[fuzz] failing case: {name} seed={seed} case #{index}{extra} "
                   f"(tier: {'long' if LONG else 'fast'})")
        raise


def cases(name: str, seed, count: int):
    """``for i in _tier.cases(name, seed, count): with _tier.case(name, seed, i): ...`` in one:
    prints the seed once, yields the case indices."""
    seeded(name, seed, count)
    yield from range(count)

