"""Every implementation against SGLang's outputs stored in ``tests/golden/`` (no torch needed),
and, where torch and SGLang are installed, those files against SGLang itself (rebuilt from the
suites' case builders and rerun), so they stay SGLang's."""

from __future__ import annotations

import numpy as np
import pytest

import _canary_support as support
import _golden
import _races
from _impls import implementations, in_reference_order


def _params():
    return [(op, impl) for op in _golden.OPS for impl in implementations(op)]


def _verify_rows_drawn(ours, case, before):
    """A verify launch whose ring overflowed, where programs claim rows concurrently: the rows
    that land are drawn from the launch's full set (the jnp reference on a ring with room for
    every row; it equals SGLang's wherever the golden cases check it)."""
    m = case["meta"]
    full, _ = support.run_verify(None, support.widened(before, len(case["slots"]) + 8),
                                 **{k: case[k] for k in _golden._VERIFY_ARRAYS},
                                 num_valid=m["num_valid"],
                                 check_token=m["check_token"], sources=_golden._get_sources(case),
                                 mode=m["mode"], reference=False, jnp_reference=True)
    return full


@pytest.mark.parametrize("op,impl", _params())
def test_goldens_match(op, impl):
    """Byte for byte where the implementation keeps request order (the golden launches include
    cross-request hazards, whose outcome only that order defines). On the GPU (``pallas_triton``)
    scatter and plan are exact too (their cases have no race); write is one outcome of some order
    of its requests (:mod:`_races`), verify exact but for its ring rows, a multiset (a draw from
    the launch's rows where the ring overflowed)."""
    _check_goldens(op, impl, in_reference_order(impl))


@pytest.mark.parametrize("op", ("write", "verify"))
def test_gpu_comparisons_accept_request_order(op):
    """The GPU's comparisons (above) run on the CPU too, over ``xla``'s results: request order is
    one of the outcomes they must accept (only a GPU run draws the others)."""
    _check_goldens(op, "xla", ordered=False)


def _check_goldens(op, impl, ordered):
    cases = _golden.load(op)
    assert cases
    for i, case in enumerate(cases):
        ours, want = _golden.run(op, case, impl)
        if op == "write":
            before = _golden.state(case, "in.")
            if ordered:
                support.assert_same(ours, want, before, ordered=True)
            else:
                _races.assert_write_outcome(ours, before, _golden.write_launch(case),
                                            _golden._get_sources(case), case["meta"]["mode"])
        elif op == "verify":
            before = _golden.state(case, "in.")
            uncapped = None
            if not ordered and support.rows_dropped(before, want):
                uncapped = _verify_rows_drawn(ours, case, before)
            support.assert_same(ours, want, before, ordered=ordered and uncapped is None,
                                uncapped=uncapped)
        else:
            for k, v in want.items():
                np.testing.assert_array_equal(np.asarray(ours[k]), v, err_msg=f"case {i} {k}")


@pytest.mark.parametrize("op", _golden.OPS)
def test_goldens_are_sglangs(sgl, op):
    """The committed cases are what the case builders and SGLang give today (rewrite them with
    ``python tests/_golden.py`` after changing a builder)."""
    bad = _golden.same(_golden.build(op, sgl), _golden.load(op))
    assert not bad, bad[:10]
