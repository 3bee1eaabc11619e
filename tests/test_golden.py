"""Every implementation against SGLang's outputs stored in ``tests/golden/`` (no torch needed),
and, where torch and SGLang are installed, those files against SGLang itself (rebuilt from the
suites' case builders and rerun), so they stay SGLang's."""

from __future__ import annotations

import numpy as np
import pytest

import _canary_support as support
import _golden
import _races
import _tier
import _write_races
from _impls import implementations, in_reference_order


def _params():
    return [(op, impl) for op in _golden.OPS for impl in implementations(op)]


@pytest.mark.parametrize("op,impl", _params())
def test_goldens_match(op, impl):
    """Byte for byte where the implementation keeps request order (the golden launches include
    cross-request hazards, whose outcome only that order defines). On the GPU (``pallas_triton``)
    scatter and plan are exact too (their cases have no race); write and verify as outcomes of
    some execution of their racing programs (:mod:`_write_races`, :mod:`_races`), of which
    SGLang's result must be one, and exact wherever no race is drawn."""
    _check_goldens(op, impl, in_reference_order(impl))


@pytest.mark.parametrize("op", ("write", "verify"))
def test_gpu_comparisons_accept_request_order(op):
    """The GPU's comparisons (above) run on the CPU too, over ``xla``'s results: request order is
    one of the outcomes they must accept (only a GPU run draws the others)."""
    _check_goldens(op, "xla", ordered=False)


@pytest.mark.parametrize("op", ("write", "verify"))
def test_gpu_comparisons_read_the_goldens(op, monkeypatch):
    """The GPU's comparisons use SGLang's stored outputs: a golden whose output is corrupted
    (one canary byte of a write, a verify's counter or a ring row) fails, case by case."""
    rng = np.random.default_rng(41)
    for i, case in enumerate(_golden.load(op)):
        bad = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in case.items()}
        bad["meta"] = dict(case["meta"])
        if op == "write":
            slot = int(rng.integers(bad["out.canary"].shape[0]))
            bad["out.canary"][slot, int(rng.integers(32))] ^= 0x5A
        elif i % 2 and case["meta"]["out.widx"] > case["meta"]["in.widx"] >= 0 and \
                case["meta"]["in.widx"] < len(case["out.ring"]):
            bad["out.ring"][case["meta"]["in.widx"], 5] += 1
        else:
            bad["meta"]["out.sctr"] += 1
        monkeypatch.setattr(_golden, "load", lambda _, bad=bad: [bad])
        with pytest.raises(AssertionError), _tier.case(f"corrupted {op} golden", 41, i):
            _check_goldens(op, "xla", ordered=False)


def _check_goldens(op, impl, ordered):
    cases = _golden.load(op)
    assert cases
    for i, case in enumerate(cases):
        with _tier.case(f"{op} golden", "stored", i, implementation=impl):
            _check_golden_case(op, case, impl, ordered)


def _check_golden_case(op, case, impl, ordered):
    """One golden case on ``impl``: exact (``ordered``), or as the GPU's comparison."""
    ours, want = _golden.run(op, case, impl)
    if op not in ("write", "verify"):
        for k, v in want.items():
            np.testing.assert_array_equal(np.asarray(ours[k]), v, err_msg=k)
        return
    before = _golden.state(case, "in.")
    if ordered:
        support.assert_same(ours, want, before)
        return
    m = case["meta"]
    if op == "write":
        launch, sources = _golden.write_launch(case), _golden.case_sources(case)
        # SGLang's result (request order) is one outcome; ours must be one too.
        sglang = _write_races.assert_write_outcome(want, before, launch, sources, m["mode"])
        _write_races.assert_write_outcome(ours, before, launch, sources, m["mode"])
        if not _write_races.write_races(before, launch):
            # No race drawn: SGLang's canary, counters and index exactly, and its ring too
            # unless two requests' claims could land in another order.
            np.testing.assert_array_equal(ours.canary, want.canary)
            assert (ours.widx, ours.sctr, ours.kctr) == (want.widx, want.sctr, want.kctr)
            if sum(bool(w.rows) for w in sglang.walks.values()) <= 1:
                np.testing.assert_array_equal(ours.ring, want.ring)
    else:
        launch = _golden.verify_launch(case)
        claims = _races.assert_verify_outcome(want, before, **launch)
        _races.assert_verify_outcome(ours, before, claims=claims, **launch)


@pytest.mark.parametrize("op", _golden.OPS)
def test_goldens_are_sglangs(sgl, op):
    """The committed cases are what the case builders and SGLang give today (rewrite them with
    ``python tests/_golden.py`` after changing a builder)."""
    bad = _golden.same(_golden.build(op, sgl), _golden.load(op))
    assert not bad, bad[:10]
