"""Test tiers: how many random cases a fuzz test draws, and how a failing case is reported.

The fast tier (the default, the README's test command) keeps every test function and every
parametrization and draws a few dozen cases per fuzz, as SGLang's own pull-request tier does (one
seed, 30 to 50 iterations). ``--long`` restores the full counts, with the same seeds: the first
cases of a long run are the fast run's cases. The README lists each count that moved.

Every fuzz states its seed (printed, shown by pytest on failure) and wraps each case in
:func:`case`, so a failure names the case that reproduces it. A fuzz that checks it covered every
kind of case it needs does so through :class:`Coverage`, which also gives its short runs (TPU
interpret mode's few cases) cases of every kind."""

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



# A fuzz of fewer cases than this (TPU interpret mode's, in the fast tier) draws its cases until
# they cover every kind its coverage check needs, running only those (:class:`Coverage`).
FULL_FUZZ = 10
# How many cases such a fuzz draws at most looking for the kinds it lacks.
MOST_DRAWS = 64


class Coverage:
    """The kinds of case a fuzz must run (e.g. hostile and clean ones, races drawn), counted as
    it runs them; :meth:`check` asserts that each ran. A fuzz of ``count`` cases runs them all;
    a short one (under :data:`FULL_FUZZ` cases: TPU interpret mode's) draws the same stream but
    runs only the cases that add a kind not yet run, until every kind has run, so that the same
    check holds where that parametrization runs.

    ``for i in cover.draws(): ...; if cover.wants(**kinds): <run the case>; cover.ran(**kinds)``,
    then ``cover.check()``."""

    def __init__(self, name: str, seed, count: int, kinds):
        self.name, self.seed, self.count = name, seed, count
        self.counts = dict.fromkeys(kinds, 0)
        self.runs = 0
        self.short = count < FULL_FUZZ

    def draws(self):
        """The indices of the cases to draw (printing the seed once)."""
        if not self.short:
            yield from cases(self.name, self.seed, self.count)
            return
        seeded(self.name + " (the cases that cover each kind)", self.seed, MOST_DRAWS)
        for i in range(MOST_DRAWS):
            if all(self.counts.values()):
                return
            yield i

    def wants(self, **kinds) -> bool:
        """Whether to run a drawn case of ``kinds`` (kind -> whether the case is one)."""
        return not self.short or any(kinds[k] and not self.counts[k] for k in self.counts)

    def ran(self, **kinds) -> None:
        self.runs += 1
        for k in self.counts:
            self.counts[k] += bool(kinds[k])

    def check(self) -> None:
        missing = [k for k, n in self.counts.items() if not n]
        assert not missing, (f"{self.name}: no case of kind {missing} among the {self.runs} "
                             f"run (kinds run: {self.counts})")
