"""The case builders the suites and the benchmark share (:mod:`kvcanary_jax.testing.cases`): every
keyword argument is the op's own field name (checked against the ops' dataclasses and signatures,
ours and SGLang's, so a field added to a plan or a context fails here until the builders take
it), and the JAX and torch builders build the same case."""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np

import jax

import kvcanary_jax as kc
from kvcanary_jax.testing import cases

import _canary_support as support


def _fields(cls) -> set:
    return {f.name for f in dataclasses.fields(cls)}


def _keywords(fn, *drop) -> set:
    """The names ``fn`` takes by keyword (``**`` excepted), less ``drop``."""
    return {n for n, p in inspect.signature(fn).parameters.items()
            if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)} - set(drop)


def _call_arguments(op) -> set:
    return _keywords(op, "context", "plan", "implementation", "config")


def test_write_builders_take_the_ops_field_names():
    assert set(cases.WRITE_PLAN_FIELDS) == _fields(kc.WritePlan)
    assert set(cases.WRITE_TOKEN_FIELDS) == _call_arguments(kc.canary_write)
    assert _keywords(cases.jax_write_plan) == _fields(kc.WritePlan)
    assert _keywords(cases.torch_write_plan, "api", "device") == _fields(kc.WritePlan)
    assert _keywords(cases.jax_write_args, "context") == set(cases.WRITE_FIELDS)
    assert _keywords(cases.torch_write_args, "api", "context", "device") == set(cases.WRITE_FIELDS)


def test_verify_builders_take_the_ops_field_names():
    assert set(cases.VERIFY_ENTRY_FIELDS) | {"verify_num_valid", "enable"} == _fields(kc.VerifyPlan)
    assert set(cases.VERIFY_FIELDS) == _fields(kc.VerifyPlan) | _call_arguments(kc.canary_verify)
    assert _keywords(cases.jax_verify_plan) == _fields(kc.VerifyPlan)
    assert _keywords(cases.torch_verify_plan, "api", "device") == _fields(kc.VerifyPlan)


def test_context_and_source_cases_take_the_ops_field_names(sgl):
    assert _fields(cases.ContextCase) == _fields(kc.VerifyOrWriteContext)
    # A source case holds bytes (``u8``, read as ``dtype``) where the op's source holds a tensor
    # (and its view); the addressing fields are the op's.
    assert _fields(cases.KvSource) - {"u8", "dtype"} == _fields(kc.RealKvSource) - {"tensor",
                                                                                     "view"}
    for api in (cases.TorchApi.sglang(sgl), cases.TorchApi.bridge()):
        assert _fields(api.context) == _fields(kc.VerifyOrWriteContext)
        assert _fields(api.verify_plan) == _fields(kc.VerifyPlan)
        assert _fields(api.write_plan) == _fields(kc.WritePlan)
        # (A strided view's offset is the torch tensor's own: SGLang's source has no field.)
        assert _fields(api.real_kv_source) >= _fields(cases.KvSource) - {"u8", "dtype",
                                                                         "offset_bytes"}


def _arrays(obj) -> dict:
    """A plan's or a context's array fields as numpy arrays (torch or JAX alike)."""
    return {f.name: np.asarray(getattr(obj, f.name)) for f in dataclasses.fields(obj)
            if hasattr(getattr(obj, f.name), "shape")}


def _assert_same_arrays(ours, theirs):
    a, b = _arrays(ours), _arrays(theirs)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k


def test_jax_and_torch_builders_build_the_same_case(sgl):
    rng = np.random.default_rng(7)
    api = cases.TorchApi.sglang(sgl)
    st = support.State(rng.integers(0, 256, (16, 48), dtype=np.uint8),
                       rng.integers(-9, 9, (4, 8)), 3, 11, 5)
    src = cases.KvSource(rng.integers(0, 256, (8, 64), dtype=np.uint8), 2, 16, 16, "bfloat16",
                         16)
    options = dict(kernel_kind=kc.CanaryLaunchTag.SWEEP_V_SWA, real_kv_sources=[src],
                   real_kv_hash_mode=kc.RealKvHashMode.PARTIAL, enable_chain_position_assert=0)
    ours = support.jax_context(st, **options)
    theirs = support.torch_context(sgl, st, **options)
    support.assert_same(support.state_of(ours), support.state_of(theirs), st)
    _assert_same_arrays(ours, theirs)
    assert (int(ours.kernel_kind), int(ours.real_kv_hash_mode)) == (11, 1)
    assert (int(theirs.kernel_kind), int(theirs.real_kv_hash_mode)) == (11, 1)
    (j,), (t,) = ours.real_kv_sources, theirs.real_kv_sources
    assert (j.page_size, j.num_bytes_per_token, j.read_bytes, j.offset_bytes) == (2, 16, 16, 16)
    assert (t.page_size, t.num_bytes_per_token, t.read_bytes) == (2, 16, 16)
    assert t.tensor.stride() == (96, 1) and t.tensor.storage_offset() == 16  # the strided view

    launch = cases.random_write_launch(rng, True, hazards=True)
    write, _ = cases.split_case(launch, cases.WRITE_FIELDS)
    verify = cases.padded_verify_plan(cases.verify_entries(rng, [[(1, 5, 0), (2, 6, 1)]]), 8)
    with jax.enable_x64(True):
        jw = cases.jax_write_args(context=None, **write)
        jv = cases.jax_verify_args(context=None, **verify, enable=0)
    tw = cases.torch_write_args(api, context=None, **write)
    tv = cases.torch_verify_args(api, context=None, **verify, enable=0)
    _assert_same_arrays(jw.pop("plan"), tw.pop("plan"))
    _assert_same_arrays(jv.pop("plan"), tv.pop("plan"))
    assert jw.pop("enable_write_input_assert") is tw.pop("enable_write_input_assert") is True
    arrays = set(cases.WRITE_TOKEN_FIELDS) - {"enable_write_input_assert"}
    assert jw.keys() == tw.keys() == arrays | {"context"}
    for k in arrays:
        x, y = np.asarray(jw[k]), np.asarray(tw[k])
        assert x.dtype == y.dtype == np.int64 and np.array_equal(x, y), k
    assert jv == tv == {"context": None, "check_verify_expected_token": True}
