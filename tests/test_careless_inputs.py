"""Hostile and careless inputs, round 2: every public entry point refuses what would make the
detector silently blind or raise false alarms, with an error that names the argument, the value
and the rule, raised before anything runs (or gives SGLang's reference result, with
sentinel-filled buffers showing that nothing outside was touched)."""

from __future__ import annotations

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvcanary_jax as kc
from kvcanary_jax.integrations import sglang_jax as ksj


def _raises(cls, message):
    """pytest.raises on the exact message (not a pattern)."""
    return pytest.raises(cls, match="^" + re.escape(message) + "$")


# --------------------------------------------------------------------------------------------
# sglang-jax: the canary's sizes and the host helpers
# --------------------------------------------------------------------------------------------

_SJ = dict(num_slots=64, page_size=4, context_len=10, max_bs=4)


@pytest.mark.parametrize("field,value,cls,message", [
    # page size 0: every cache_loc segment would start at 0 (request 1 checked against request
    # 0's slots: a corrupted slot unseen); negative: every segment misplaced (false alarms).
    ("page_size", 0, ValueError, "page_size must be positive, got 0"),
    ("page_size", -4, ValueError, "page_size must be positive, got -4"),
    ("page_size", 2.0, TypeError, "page_size must be an int, got float 2.0"),
    ("page_size", True, TypeError, "page_size must be an int, got bool True"),
    ("num_slots", 0, ValueError, "num_slots must be positive, got 0"),
    ("context_len", -1, ValueError, "context_len must be positive, got -1"),
    ("max_bs", 0, ValueError, "max_bs must be positive, got 0"),
    ("k_heads", 0, ValueError, "k_heads must be positive, got 0"),
    ("k_heads", 5, ValueError, "k_heads must be in [1, 4] (the canary's source limit), got 5"),
    ("sweep_rows", 0, ValueError, "sweep_rows must be positive, got 0"),
    ("layer", -1, ValueError, "layer must be >= 0, got -1"),
])
def test_sglang_jax_canary_refuses_bad_sizes(field, value, cls, message):
    with _raises(cls, "kv-canary sglang-jax: " + message):
        ksj.SglangJaxCanary(**{**_SJ, field: value})


def _pools(buffer_shape, page_size):
    req = types.SimpleNamespace(max_context_len=16)
    kv = types.SimpleNamespace(kv_buffer=[np.zeros(buffer_shape, np.float32)], page_size=page_size)
    return req, kv


def test_from_pools_refuses_a_page_size_its_buffer_contradicts():
    # HEAD's layout [pages, page_size, heads*2/packing, packing, head_dim] carries the page size.
    with _raises(ValueError, "kv-canary sglang-jax: token_to_kv_pool.page_size is 2 but its fused "
                             "buffer (3, 4, 1, 2, 8) has pages of 4 slots (dimension 1)"):
        ksj.SglangJaxCanary.from_pools(*_pools((3, 4, 1, 2, 8), 2), max_bs=2)
    with _raises(ValueError, "kv-canary sglang-jax: token_to_kv_pool.page_size must be positive, got 0"):
        ksj.SglangJaxCanary.from_pools(*_pools((12, 2, 8), 0), max_bs=2)
    canary = ksj.SglangJaxCanary.from_pools(*_pools((3, 4, 1, 2, 8), 4), max_bs=2)
    assert (canary.num_slots, canary.page_size, canary.context_len) == (12, 4, 16)


@pytest.mark.parametrize("args,cls,message", [
    (([[1, 2]], [2], 8, 0), ValueError, "page_size must be positive, got 0"),
    (([[1, 2]], [2], -1, 4), ValueError, "cache_loc_len must be >= 0, got -1"),
    (([[1, 2]], [-2], 8, 4), ValueError, "seq_lens[0] must be >= 0, got -2"),
    (([[1, 2]], [2, 1], 8, 4), ValueError,
     "seq_lens[1] is 1 but token_ids has 1 requests (padding rows must have seq_len 0)"),
    (([[1, 2], [3]], [2, 1], 6, 4), ValueError, "8 cache_loc entries for a bucket of 6"),
    (([[1, 2]], [[2]], 8, 4), ValueError,
     "seq_lens must be a 1-D sequence of ints, got shape (1, 1) dtype int64"),
])
def test_expected_tokens_refuses_inconsistent_input(args, cls, message):
    with _raises(cls, "kv-canary sglang-jax: " + message):
        ksj.expected_tokens(*args)


@pytest.mark.parametrize("args,message", [
    # numpy would read row -1 as the pool's last row: a wrong table, checked without a word.
    (([-1, 0], [3, 1]), "req_pool_indices[0] must be a row of req_to_token, in [0, 4), got -1"),
    (([4], [1]), "req_pool_indices[0] must be a row of req_to_token, in [0, 4), got 4"),
    (([0, 1], [1]), "req_pool_indices (2) and seq_lens (1) must have one entry per request"),
    (([0], [9]), "seq_lens[0] must be in [0, 6] (context_len), got 9"),
    (([0], [-1]), "seq_lens[0] must be in [0, 6] (context_len), got -1"),
])
def test_host_table_refuses_inconsistent_input(args, message):
    req_to_token = np.arange(24, dtype=np.int32).reshape(4, 6)
    with _raises(ValueError, "kv-canary sglang-jax: " + message):
        ksj.host_table(req_to_token, *args)
    # Padding rows (seq_len 0) may carry any row index, as sglang-jax pads with -1.
    assert ksj.host_table(req_to_token, [2, -1], [2, 0]).tolist() == [
        [0] * 6, [12, 13, 0, 0, 0, 0], [0] * 6]


def test_host_table_and_request_ids_refuse_wrong_objects():
    with _raises(ValueError, "kv-canary sglang-jax: req_to_token must be 2-D [rows, context_len], "
                             "got shape (4,)"):
        ksj.host_table([1, 2, 3, 4], [0], [1])
    with _raises(ValueError, "kv-canary sglang-jax: context_len must be in [1, 6] (req_to_token's "
                             "columns), got 0"):
        ksj.host_table(np.zeros((2, 6), np.int32), [0], [1], 0)
    with pytest.raises(TypeError, match=r"^kv-canary sglang-jax: reqs\[1\] must be an sglang-jax "
                                        r"Req \(with origin_input_ids and output_ids\), got int"):
        ksj.request_token_ids([types.SimpleNamespace(origin_input_ids=[1], output_ids=[2]), 7])


@pytest.mark.parametrize("prefixes,message", [
    ([[1, 2], list(range(1, 12))], "prefixes[1] has 11 slots, more than context_len=10"),
    ([[1, 64]], "prefixes[0][1] must be a slot in [0, 64), got 64"),
    ([[-1]], "prefixes[0][0] must be a slot in [0, 64), got -1"),
])
def test_sweep_refuses_prefixes_it_could_not_check(prefixes, message):
    # Raised before the state is touched (None here: nothing reads it).
    with _raises(ValueError, "kv-canary sglang-jax: " + message):
        ksj.sweep(ksj.SglangJaxCanary(**_SJ), None, None, prefixes)


# --------------------------------------------------------------------------------------------
# runtime.make_batch: lists that disagree are refused, not padded
# --------------------------------------------------------------------------------------------

_CFG = dict(max_reqs=4, context_len=8, num_slots=16, max_bs=2, max_tokens=8)
_GOOD = dict(req_pool_indices=[1, 2], prefix_lens=[0, 2], extend_seq_lens=[2, 1],
             all_ids=[[5, 6], [7, 8, 9]], input_ids=[5, 6, 9], positions=[0, 1, 2],
             out_cache_loc=[3, 4, 7])


@pytest.mark.parametrize("change,message", [
    (dict(positions=[0, 1]), "positions has 2 entries, input_ids has 3: one entry per token"),
    (dict(out_cache_loc=[3, 4]), "out_cache_loc has 2 entries, input_ids has 3: one entry per token"),
    (dict(expected_input_tokens=[5]),
     "expected_input_tokens has 1 entries, input_ids has 3: one entry per token"),
    (dict(all_ids=[[5, 6]]), "all_ids has 1 entries, req_pool_indices has 2: one entry per request"),
    (dict(prefix_lens=[0]), "prefix_lens has 1 entries, req_pool_indices has 2: one entry per request"),
    # extend_seq_lens summing to 2 for 3 tokens: the next correct step would see false violations.
    (dict(extend_seq_lens=[1, 1]), "extend_seq_lens sum to 2, input_ids has 3 tokens"),
    (dict(extend_seq_lens=[4, -1]), "extend_seq_lens[1] must be >= 0, got -1"),
    (dict(prefix_lens=[-1, 2]), "prefix_lens[0] must be >= 0, got -1"),
    # A history shorter than the prefix turns that request's token check off without a word.
    (dict(all_ids=[[5, 6], [7, 8]]), "all_ids[1] has 2 token ids; a request's history covers its "
                                     "prefix_lens + extend_seq_lens (3) and at most context_len (8)"),
    (dict(all_ids=[[5, 6], list(range(9))]), "all_ids[1] has 9 token ids; a request's history "
     "covers its prefix_lens + extend_seq_lens (3) and at most context_len (8)"),
    (dict(req_pool_indices=[0, 2]),
     "req_pool_indices[0] must be a row in [1, 4) (row 0 is the padding row), got 0"),
    (dict(req_pool_indices=[1, 4]),
     "req_pool_indices[1] must be a row in [1, 4) (row 0 is the padding row), got 4"),
    (dict(req_pool_indices=[2, 2]), "req_pool_indices must be distinct, row 2 appears twice or more"),
    (dict(out_cache_loc=[3, 16, 7]), "out_cache_loc[1] must be a slot in [0, 16), got 16"),
    (dict(out_cache_loc=[3, -1, 7]), "out_cache_loc[1] must be a slot in [0, 16), got -1"),
    (dict(input_ids=[5, 6, 9.5]), "input_ids must be a 1-D list of ints, got shape (3,) dtype float64"),
])
def test_make_batch_refuses_lists_that_disagree(change, message):
    cfg = kc.CanaryConfig(**_CFG)
    with _raises(ValueError, "kv-canary runtime: make_batch " + message):
        kc.make_batch(cfg, **{**_GOOD, **change})


def test_make_batch_pads_a_consistent_batch():
    cfg = kc.CanaryConfig(**_CFG)
    b = kc.make_batch(cfg, **_GOOD, as_numpy=True)
    assert b.all_ids_offsets.tolist() == [0, 2, 5]
    assert b.all_ids_flat[:5].tolist() == [5, 6, 7, 8, 9] and not b.all_ids_flat[5:].any()
    assert b.out_cache_loc.tolist() == [3, 4, 7] + [-1] * 5
    assert b.expected_input_tokens.tolist() == [5, 6, 9] + [0] * 5


# --------------------------------------------------------------------------------------------
# Mosaic TPU launch configs: interpret is None or pltpu.InterpretParams
# --------------------------------------------------------------------------------------------

_TPU_OPS = [("scatter", "scatter_req_token_ids"), ("plan", "canary_plan"),
            ("write", "canary_write"), ("verify", "canary_verify"), ("digest", "digest")]


@pytest.mark.parametrize("op,name", _TPU_OPS)
@pytest.mark.parametrize("value", [True, 1, "yes"])
def test_tpu_config_refuses_an_interpret_that_is_not_interpret_params(op, name, value):
    import importlib

    mod = importlib.import_module(f"kvcanary_jax.ops.{op}.pallas_mosaic_tpu")
    with _raises(TypeError, f"kv-canary: {name} (pallas_mosaic_tpu): interpret must be None "
                            "(compile for TPU) or a jax.experimental.pallas.tpu.InterpretParams "
                            "(TPU interpret mode, e.g. kvcanary_jax.ops._tpu_lib."
                            f"interpret_params()), got {type(value).__name__} {value!r}"):
        mod.Config(interpret=value)
    with _raises(TypeError, f"kv-canary: {name} (pallas_mosaic_tpu): vmem_limit_bytes must be "
                            "None or a positive int, got int 0"):
        mod.Config(vmem_limit_bytes=0)
    from kvcanary_jax.ops import _tpu_lib

    assert mod.Config(interpret=_tpu_lib.interpret_params()).interpret is not None
    assert mod.Config().interpret is None


# --------------------------------------------------------------------------------------------
# buckets: lengths are integers
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n,shown", [(64.5, "float 64.5"), ("65", "str '65'"), (True, "bool True"),
                                     (65.0, "float 65.0")])
def test_bucket_refuses_a_length_that_is_not_an_int(n, shown):
    # 64.5 gave 64, a bucket below the length; "65" was parsed.
    from kvcanary_jax import buckets

    with _raises(TypeError, f"kv-canary: a length must be an int, got {shown}"):
        buckets.bucket(n)
    with _raises(TypeError, f"kv-canary: size must be an int, got {shown}"):
        buckets.pad(np.arange(3), n)
    assert buckets.bucket(np.int64(65)) == 128 and buckets.bucket(65) == 128
    with _raises(TypeError, "kv-canary: floor must be an int, got float 8.5"):
        buckets.bucket(3, floor=8.5)


def test_radix_prefixes_refuses_what_is_not_a_radix_cache():
    with _raises(TypeError, "kv-canary sglang-jax: tree_cache must be an sglang-jax RadixCache "
                            "(with root_node.children), got dict"):
        ksj.radix_prefixes({})
    leaf = types.SimpleNamespace(children={}, value=[5, 6])
    root = types.SimpleNamespace(children={"a": leaf}, value=None)
    got = ksj.radix_prefixes(types.SimpleNamespace(root_node=root))
    assert [p.tolist() for p in got] == [[5, 6]]


@pytest.mark.parametrize("kw,cls,message", [
    (dict(batch_argnum=-1, pool_argnum=1), ValueError, "batch_argnum must be >= 0 (an index into "
     "the model step's positional arguments), got -1"),
    (dict(batch_argnum=1, pool_argnum=1), ValueError,
     "batch_argnum and pool_argnum are both 1; the batch and the KV pool are different arguments"),
    (dict(batch_argnum=0, pool_argnum=1, static_argnums=(1,)), ValueError,
     "the batch and the KV pool cannot be static arguments (static_argnums=(1,))"),
    (dict(batch_argnum="0", pool_argnum=1), TypeError, "batch_argnum must be an int, got str '0'"),
])
def test_guard_model_step_refuses_argument_numbers_that_cannot_work(kw, cls, message):
    with _raises(cls, "kv-canary sglang-jax: " + message):
        ksj.guard_model_step(ksj.SglangJaxCanary(**_SJ), lambda *a: a,
                             fused_kv=lambda out, pool: pool, **kw)


# --------------------------------------------------------------------------------------------
# runtime: sizes are integers, ring rows are integers
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field,value,cls,message", [
    ("max_reqs", 4.5, TypeError, "CanaryConfig.max_reqs must be an int, got float 4.5"),
    ("num_slots", "16", TypeError, "CanaryConfig.num_slots must be an int, got str '16'"),
    ("max_bs", True, TypeError, "CanaryConfig.max_bs must be an int, got bool True"),
    ("verify_capacity", 8.0, TypeError, "CanaryConfig.verify_capacity must be an int, got "
     "float 8.0"),
    ("kv_token_id_vs_position_offset", 1.5, TypeError,
     "CanaryConfig.kv_token_id_vs_position_offset must be an int, got float 1.5"),
    ("swa_window_size", -1, ValueError, "swa_window_size must be >= 0 (0: no SWA group), got -1"),
])
def test_canary_config_refuses_sizes_that_are_not_ints(field, value, cls, message):
    with _raises(cls, "kv-canary runtime: " + message):
        kc.CanaryConfig(**{**_CFG, field: value})
    assert kc.CanaryConfig(**{**_CFG, "max_reqs": np.int64(4)}).max_reqs == 4


@pytest.mark.parametrize("start,cls,message", [
    ("3", TypeError, "start must be an int (a ring row), got str '3'"),
    (1.5, TypeError, "start must be an int (a ring row), got float 1.5"),
    (-1, ValueError, "start must be a ring row >= 0, got -1"),
])
def test_reading_the_ring_refuses_a_start_that_is_not_a_row(start, cls, message):
    state = kc.init_state(kc.CanaryConfig(**_CFG))
    with _raises(cls, "kv-canary runtime: " + message):
        kc.read_violations(state, start=start)
    with _raises(cls, "kv-canary runtime: " + message):
        kc.runtime.decode_ring(np.zeros((4, 8), np.int64), 0, start=start)
