"""The plan's two halves, named: every implementation's offsets and entries halves take the batch as
:class:`PlanInputs` and the plans as their dataclasses, hand over a :class:`PlanOffsets`, and
each agrees with the reference's half, every field compared (untouched tails included: the plans
start filled with a marker).

Each implementation's ``run`` composes its halves with its own launch config through
:func:`kvcanary_jax.ops.plan.base.compose`; here that composition is watched, outside any jit, and
each half it was given is run on its own against the reference's. (The whole plan against SGLang
and the jnp reference: tests/test_plan.py.)
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from kvcanary_jax import _config
from kvcanary_jax.ops.plan import api as plan_api
from kvcanary_jax.ops.plan import base as plan_base
from kvcanary_jax.ops.plan.base import PlanInputs, PlanOffsets
from kvcanary_jax.plans import VerifyPlan, WritePlan
import _impls
from _impls import with_tpu

MARK = -9999
STATICS = dict(swa_window_size=4, verify_capacity=24, kv_token_id_vs_position_offset=1)


def _batch(num_reqs):
    """Four request lanes (the third one padding), with an SWA LUT and an expected-token pool;
    with ``num_reqs`` the last lane is past the batch."""
    rng = np.random.default_rng(41)
    i64 = lambda x: jnp.asarray(x, jnp.int64)  # noqa: E731
    return PlanInputs(
        req_pool_indices=i64([1, 2, 0, 3]), prefix_lens=i64([6, 1, 3, 9]),
        extend_seq_lens=i64([2, 3, 1, 1]),
        req_to_token=jnp.asarray(rng.integers(0, 40, (5, 16)), jnp.int32),
        full_to_swa_index_mapping=i64(rng.integers(0, 60, 40)),
        req_to_verify_expected_tokens=jnp.asarray(rng.integers(0, 1000, (5, 16)), jnp.int32),
        req_to_verify_expected_tokens_valid_lens=i64([8, 2, 3, 16]),
        num_reqs=None if num_reqs is None else jnp.asarray([num_reqs], jnp.int32))


def _plans():
    vp = VerifyPlan.allocate(verify_capacity=STATICS["verify_capacity"])
    wp = WritePlan.allocate(write_req_capacity=6)
    fill = lambda p: jax.tree.map(lambda x: jnp.full_like(x, MARK), p)  # noqa: E731
    return fill(vp), fill(wp)


def _same(got, want, what):
    assert type(got) is type(want), what
    flat_got, tree_got = jax.tree_util.tree_flatten_with_path(got)
    flat_want, tree_want = jax.tree_util.tree_flatten_with_path(want)
    assert tree_got == tree_want, what
    for (path, a), (_, b) in zip(flat_got, flat_want):
        assert a.dtype == b.dtype and a.shape == b.shape, (what, path)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{what} {path}")


def _cases():
    out = []
    for impl in with_tpu("plan"):
        name = getattr(impl, "values", (impl,))[0]
        marks = getattr(impl, "marks", ())
        takes_n = plan_api.takes_num_reqs(name)
        for n in (None, 3) if takes_n else (None,):
            out.append(pytest.param(name, n, marks=marks, id=f"{name}-num_reqs{n}"))
    return out


@pytest.mark.parametrize("impl,num_reqs", _cases())
def test_each_half_against_the_reference_half(impl, num_reqs, monkeypatch):
    halves = []
    compose = plan_base.compose

    def watched(offsets_fn, entries_fn, vp, wp, inputs, **statics):
        halves.append((offsets_fn, entries_fn))
        return compose(offsets_fn, entries_fn, vp, wp, inputs, **statics)

    monkeypatch.setattr(plan_base, "compose", watched)
    offsets_kw = dict(swa_window_size=STATICS["swa_window_size"],
                      verify_capacity=STATICS["verify_capacity"])
    entries_kw = dict(swa_window_size=STATICS["swa_window_size"],
                      kv_token_id_vs_position_offset=STATICS["kv_token_id_vs_position_offset"])
    with _config.x64_scope():
        inputs = _batch(num_reqs)
        vp, wp = _plans()
        config = plan_api.OP.config(impl, plan_base.shapes(vp, wp, inputs),
                                    _impls.config("plan", impl))
        whole = plan_api.OP.run(impl, vp, wp, inputs, config=config, **STATICS)
        ((offsets_fn, entries_fn),) = halves

        offsets = offsets_fn(inputs, vp, wp, **offsets_kw)
        assert isinstance(offsets, PlanOffsets) and isinstance(offsets.write_plan, WritePlan)
        want = plan_base.offsets_reference(inputs, vp, wp, **offsets_kw)
        _same(offsets, want, f"{impl} offsets half")

        # the entries half gets the verify plan with the offsets half's count and enable
        vp_in = dataclasses.replace(vp, verify_num_valid=want.verify_num_valid,
                                    enable=want.enable)
        entries = entries_fn(inputs, vp_in, want.verify_offsets, **entries_kw)
        want_entries = plan_base.entries_reference(inputs, vp_in, want.verify_offsets,
                                                   **entries_kw)
        _same(entries, want_entries, f"{impl} entries half")
        assert int(want.verify_num_valid[0]) > 0  # the case fills entries
        assert (np.asarray(want_entries.verify_slot_indices) != MARK).any()

        # and composed, as the implementation's run composed them
        _same(whole, (want_entries, want.write_plan), f"{impl} run")
        _same(whole, plan_base.reference(vp, wp, inputs, **STATICS), f"{impl} reference")
