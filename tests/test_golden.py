"""Every implementation against SGLang's outputs stored in ``tests/golden/`` (no torch needed),
and, where torch and SGLang are installed, those files against SGLang itself (rebuilt from the
suites' case builders and rerun), so they stay SGLang's."""

from __future__ import annotations

import numpy as np
import pytest

import _canary_support as S
import _golden as G
from _impls import implementations, in_reference_order


def _params():
    return [(op, impl) for op in G.OPS for impl in implementations(op)
            if in_reference_order(impl)]


@pytest.mark.parametrize("op,impl", _params())
def test_goldens_match(op, impl):
    """Byte for byte, ring rows in order (the golden launches include cross-request hazards,
    which only implementations that keep the reference's order define)."""
    cases = G.load(op)
    assert cases
    for i, case in enumerate(cases):
        ours, want = G.run(op, case, impl)
        if op in ("write", "verify"):
            S.assert_same(ours, want, G.state(case, "in."), ordered=True)
        else:
            for k, v in want.items():
                np.testing.assert_array_equal(np.asarray(ours[k]), v, err_msg=f"case {i} {k}")


@pytest.mark.parametrize("op", G.OPS)
def test_goldens_are_sglangs(sgl, op):
    """The committed cases are what the case builders and SGLang give today (rewrite them with
    ``python tests/_golden.py`` after changing a builder)."""
    bad = G.same(G.build(op, sgl), G.load(op))
    assert not bad, bad[:10]
