"""canary_plan (offsets + entries kernels, interpret mode on CPU) and its pure-jnp reference against
SGLang 0.5.23's torch reference ``launch_canary_plan_kernels_torch_reference``.

Every output element is compared, untouched tails included: both sides start from plans filled
with the marker -9999. Fuzz cases are drawn inside fixed shape buckets (bs, table shapes and
capacities are shapes; lengths, indices and tokens are data) so each bucket compiles once.
"""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from kvcanary_jax.contracts import Contract
from kvcanary_jax.ops.plan import CONTRACT, canary_plan, canary_plan_reference, plan_metas
from kvcanary_jax.ops.plan import base as plan_base
from kvcanary_jax.testing import cases
import _impls
import _tier
from _impls import implementations, pallas, with_tpu

IMPLS = implementations("plan")
IMPLS_TPU = with_tpu("plan")
PALLAS = pallas("plan")


def _launch(**kw):
    """A launch config of the Pallas kernels (their module imported where they are tested)."""
    from kvcanary_jax.ops.plan.pallas_triton import Config

    return Config(**kw)

M = -9999
V_ARRAYS = plan_base.VERIFY_ARRAYS
KEYS = V_ARRAYS + ("verify_num_valid", "enable", "write_offsets", "write_seed_slot_indices",
                   "write_num_valid_reqs")


@dataclasses.dataclass
class Case:
    rpi: np.ndarray
    prefix: np.ndarray
    extend: np.ndarray
    rtt: np.ndarray
    W: int = 0
    lut: np.ndarray | None = None
    vc: int = 8
    wc: int = 4
    pool: np.ndarray | None = None
    vl: np.ndarray | None = None
    k: int = 0


def case(rpi, prefix, extend, rtt, **kw) -> Case:
    a64 = lambda x: None if x is None else np.asarray(x, np.int64).reshape(-1)  # noqa: E731
    for name in ("lut", "vl"):
        if name in kw:
            kw[name] = a64(kw[name])
    if kw.get("pool") is not None:
        kw["pool"] = np.asarray(kw["pool"], np.int32)
    return Case(a64(rpi), a64(prefix), a64(extend), np.asarray(rtt, np.int32), **kw)


# ------------------------------------------------------------------------------------------------
# Runners
# ------------------------------------------------------------------------------------------------


def run_oracle(sgl, c: Case) -> dict:
    import torch

    t64 = lambda x: torch.from_numpy(np.array(x, np.int64))  # noqa: E731
    api = cases.TorchApi.sglang(sgl)
    vp = cases.torch_verify_plan(api, **{f: [M] * c.vc for f in V_ARRAYS}, verify_num_valid=M,
                                 enable=M)
    wp = cases.torch_write_plan(api, write_offsets=[M] * (c.wc + 1),
                                write_seed_slot_indices=[M] * c.wc, write_num_valid_reqs=M)
    sgl.plan_ref.launch_canary_plan_kernels_torch_reference(
        verify_plan_out=vp, write_plan_out=wp, req_pool_indices=t64(c.rpi),
        prefix_lens=t64(c.prefix), extend_seq_lens=t64(c.extend),
        req_to_token=torch.from_numpy(np.array(c.rtt, np.int32)), swa_window_size=c.W,
        full_to_swa_index_mapping=None if c.lut is None else t64(c.lut),
        verify_capacity=c.vc,
        req_to_verify_expected_tokens=None if c.pool is None else torch.from_numpy(
            np.array(c.pool, np.int32)),
        req_to_verify_expected_tokens_valid_lens=None if c.vl is None else t64(c.vl),
        kv_token_id_vs_position_offset=c.k,
    )
    out = {f: getattr(vp, f).numpy().copy() for f in V_ARRAYS + ("verify_num_valid", "enable")}
    out.update({f: getattr(wp, f).numpy().copy() for f in
                ("write_offsets", "write_seed_slot_indices", "write_num_valid_reqs")})
    return out


def marked_plans(vc: int, wc: int):
    """Output plans holding ``M`` in every cell (what a launch does not write stays ``M``)."""
    vp = cases.jax_verify_plan(**{f: [M] * vc for f in V_ARRAYS}, verify_num_valid=M, enable=M)
    wp = cases.jax_write_plan(write_offsets=[M] * (wc + 1), write_seed_slot_indices=[M] * wc,
                              write_num_valid_reqs=M)
    return vp, wp


def kwargs_of(c: Case) -> dict:
    j = lambda x: None if x is None else jnp.asarray(x)  # noqa: E731
    return dict(
        req_pool_indices=j(c.rpi), prefix_lens=j(c.prefix), extend_seq_lens=j(c.extend),
        req_to_token=j(c.rtt), swa_window_size=c.W, full_to_swa_index_mapping=j(c.lut),
        verify_capacity=c.vc, req_to_verify_expected_tokens=j(c.pool),
        req_to_verify_expected_tokens_valid_lens=j(c.vl), kv_token_id_vs_position_offset=c.k,
    )


def as_dict(vp, wp) -> dict:
    out = {f: np.asarray(getattr(vp, f)) for f in V_ARRAYS + ("verify_num_valid", "enable")}
    out.update({f: np.asarray(getattr(wp, f)) for f in
                ("write_offsets", "write_seed_slot_indices", "write_num_valid_reqs")})
    return out


def run_ours(c: Case, impl: str | None = None, *, config=None,
             reference: bool = False) -> dict:
    """Our plan of case ``c`` with implementation ``impl`` (and launch ``config``), or the
    pure-jnp reference."""
    with jax.enable_x64(True):
        vp, wp = marked_plans(c.vc, c.wc)
        kw = kwargs_of(c)
        if reference:
            return as_dict(*canary_plan_reference(verify_plan_out=vp, write_plan_out=wp, **kw))
        if config is None:
            config = _impls.config("plan", impl)
        return as_dict(*canary_plan(verify_plan_out=vp, write_plan_out=wp, **kw,
                                    implementation=impl, config=config))


def mismatches(got: dict, want: dict) -> list[str]:
    bad = []
    for key in KEYS:
        g, w = np.asarray(got[key]), np.asarray(want[key])
        if g.shape != w.shape or g.dtype != w.dtype or not np.array_equal(g, w):
            bad.append(f"{key}: got {g.tolist()} ({g.dtype}), want {w.tolist()} ({w.dtype})")
    return bad


def assert_same(got, want, c=None):
    bad = mismatches(got, want)
    assert not bad, "\n".join(bad + ([repr(c)] if c is not None else []))


# ------------------------------------------------------------------------------------------------
# Hand-written cases (the spec's regular plan vectors rebuilt inline; expectations from the oracle)
# ------------------------------------------------------------------------------------------------

RTT = [[1, 2, 3, 4, 5, 6], [11, 12, 13, 14, 15, 16], [21, 22, 23, 24, 25, 26],
       [31, 32, 33, 34, 35, 36]]
LUT = [0] + list(range(1001, 1041))
POOL = [[0, 1, 2, 3, 4, 5], [100, 101, 102, 103, 104, 105], [200, 201, 202, 203, 204, 205],
        [300, 301, 302, 303, 304, 305]]

HAND_CASES = {
    "full_basic": case([1, 0, 2], [3, 4, 2], [2, 3, 1], RTT, vc=8, wc=4),
    "prefix_zero_and_decode": case([3, 1], [0, 4], [1, 1], RTT, vc=6, wc=2),
    "swa_window_with_lut": case([1, 2], [5, 1], [1, 2], RTT, W=2, lut=LUT, vc=5, wc=3),
    "lut_without_window": case([2], [3], [2], RTT, lut=LUT, vc=4, wc=1),
    "verify_capacity_overflow": case([1, 2], [4, 3], [1, 1], RTT, vc=5, wc=2),
    "verify_capacity_exact": case([1, 2], [2, 3], [1, 1], RTT, vc=5, wc=2),
    "expected_tokens_valid_lens": case([1, 3], [4, 3], [1, 1], RTT, pool=POOL, vl=[2, 6], vc=8,
                                       wc=2),
    "expected_tokens_offset_plus_one": case([2], [4], [1], RTT, pool=POOL, vl=[4], k=1, vc=4,
                                            wc=1),
    "expected_tokens_negative_offset": case([1], [3], [0], RTT, pool=POOL, vl=[6], k=-1, vc=3,
                                            wc=1),
    "bs_zero": case([], [], [], RTT, vc=2, wc=3),
    "nonpositive_extend_and_padding": case([1, 2, 0, 3], [2, 3, 5, 1], [0, -2, 4, 3], RTT, vc=8,
                                           wc=6),
    "unfilled_req_to_token_zero_and_negative": case(
        [1], [3], [1], [[0, 0, 0, 0], [5, 0, -1, 7], [0, 0, 0, 0]], lut=LUT, vc=3, wc=1),
    "negative_prefix_and_swa_window_bigger_than_prefix": case(
        [1, 2, 3], [-3, 2, 6], [1, 1, 1], RTT, W=4, lut=LUT, vc=6, wc=5),
    "negative_swa_window_is_full": case([1, 2], [3, 2], [1, 0], RTT, W=-2, vc=6, wc=2),
}


@pytest.mark.parametrize("impl", IMPLS_TPU)
@pytest.mark.parametrize("name", sorted(HAND_CASES))
def test_hand_cases(sgl, name, impl):
    c = HAND_CASES[name]
    want = run_oracle(sgl, c)
    assert_same(run_ours(c, impl), want, c)
    assert_same(run_ours(c, reference=True), want, c)


@pytest.mark.parametrize("impl", IMPLS_TPU)
def test_hand_case_values_spot_check(sgl, impl):
    # Hand-checked values of the SWA case (window 2 over prefix 5: positions 3, 4; the window's
    # first entry keeps its real predecessor; everything LUT-translated).
    got = run_ours(HAND_CASES["swa_window_with_lut"], impl)
    assert got["verify_slot_indices"].tolist() == [1014, 1015, 1021, M, M]
    assert got["verify_prev_slot_indices"].tolist() == [1013, 1014, -1, M, M]
    assert got["verify_expected_positions"].tolist() == [3, 4, 0, M, M]
    assert got["write_offsets"].tolist() == [0, 1, 3, 0]
    assert got["write_seed_slot_indices"].tolist() == [1015, 1021, M]
    assert got["verify_num_valid"].tolist() == [3] and got["enable"].tolist() == [1]
    assert got["write_num_valid_reqs"].tolist() == [2]


# ------------------------------------------------------------------------------------------------
# Seeded fuzz
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Bucket:
    bs: int
    rows: int
    width: int
    W: int = 0
    lut_len: int = 0  # 0 = no LUT
    pool_width: int = 0  # 0 = no expected-token pool
    k: int = 0
    vc: int = 16
    wc_extra: int = 0  # write_req_capacity = bs + wc_extra
    max_prefix: int | None = None


def gen_case(rng: np.random.Generator, b: Bucket) -> Case:
    bs, rows, width = b.bs, b.rows, b.width
    rpi = rng.integers(1, rows, bs)
    rpi[rng.random(bs) < 0.2] = 0  # padding rows
    maxp = width if b.max_prefix is None else min(b.max_prefix, width)
    prefix = rng.integers(1, maxp + 1, bs)
    u = rng.random(bs)
    prefix[u < 0.15] = 0
    prefix[(u >= 0.15) & (u < 0.2)] = -rng.integers(1, 4, bs)[(u >= 0.15) & (u < 0.2)]
    extend = rng.integers(-2, 6, bs)
    extend[rng.random(bs) < 0.2] = 0
    hi = b.lut_len if b.lut_len else 1 << 30
    rtt = rng.integers(0, hi, (rows, width)).astype(np.int32)
    rtt[rng.random((rows, width)) < 0.1] = 0  # unfilled
    rtt[rng.random((rows, width)) < 0.05] = -1
    lut = None
    if b.lut_len:
        lut = rng.integers(0, 1 << 40, b.lut_len)
        lut[rng.random(b.lut_len) < 0.05] = -1
    pool = vl = None
    if b.pool_width:
        pool = rng.integers(-5, 1 << 31, (rows, b.pool_width), dtype=np.int64).astype(np.int32)
        # valid_lens shorter and longer than the verified positions (bounded by the pool width,
        # past which SGLang's reference raises).
        vl = rng.integers(-1, b.pool_width + 1, bs)
    return Case(rpi.astype(np.int64), prefix.astype(np.int64), extend.astype(np.int64), rtt,
                W=b.W, lut=lut, vc=b.vc, wc=bs + b.wc_extra, pool=pool, vl=vl, k=b.k)


FAMILIES = {
    # family: buckets; the cases of a family are spread evenly over its buckets.
    "full": [Bucket(1, 4, 8, vc=8), Bucket(3, 6, 8, vc=12, wc_extra=2),
             Bucket(8, 10, 6, vc=24), Bucket(21, 24, 5, vc=40, wc_extra=11)],
    "swa_lut": [Bucket(2, 5, 10, W=3, lut_len=64, vc=6), Bucket(7, 9, 12, W=1, lut_len=40, vc=6,
                                                                 wc_extra=1),
                Bucket(16, 20, 9, W=4, lut_len=200, vc=48), Bucket(5, 8, 7, lut_len=30, vc=20)],
    "pool_k0": [Bucket(3, 5, 8, pool_width=10, vc=16), Bucket(12, 14, 6, pool_width=6, vc=40,
                                                               wc_extra=3),
                Bucket(6, 8, 9, W=5, lut_len=50, pool_width=12, vc=24)],
    "pool_k1_swa": [Bucket(4, 6, 8, W=3, lut_len=80, pool_width=9, k=1, vc=10),
                    Bucket(10, 12, 7, W=7, lut_len=60, pool_width=8, k=1, vc=40, wc_extra=4),
                    Bucket(2, 4, 5, pool_width=7, k=1, vc=6)],
}
CASES_PER_FAMILY = _tier.n(40, 2000)

# SGLang's result (and whether our jnp reference equals it) per drawn case, shared by every
# implementation's run of the same fuzz: the cases are a function of (buckets, seed, index).
_ORACLE: dict = {}


def _fuzz(sgl, buckets, n_cases, seed, impl, config=None, check_reference=True):
    rng = np.random.default_rng(seed)
    n_bad = n_overflow = 0
    first_bad = None
    _tier.seeded("plan fuzz", seed, n_cases)
    for i in range(n_cases):
        b = buckets[i % len(buckets)]
        c = gen_case(rng, b)
        key = (repr(buckets), seed, i)
        if key not in _ORACLE:
            want = run_oracle(sgl, c)
            ref_bad = (["reference " + s for s in mismatches(run_ours(c, reference=True), want)]
                       if check_reference else [])
            _ORACLE[key] = want, ref_bad
        want, ref_bad = _ORACLE[key]
        n_overflow += int(want["enable"][0] == 0)
        bad = mismatches(run_ours(c, impl, config=config), want) + ref_bad
        if bad:
            n_bad += 1
            first_bad = first_bad or (f"case #{i} (seed {seed})", c, bad)
    assert n_bad == 0, f"{n_bad} of {n_cases} cases differ; first: {first_bad}"
    return n_overflow


@pytest.mark.fuzz
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fuzz_family(sgl, family, impl):
    n_overflow = _fuzz(sgl, FAMILIES[family], CASES_PER_FAMILY, seed=zlib.crc32(family.encode()),
                       impl=impl)
    # The capacities are chosen so both outcomes occur (over the long tier's draws; the fast
    # tier's first few cases may all fit).
    assert n_overflow < CASES_PER_FAMILY
    if CASES_PER_FAMILY >= 100:
        assert n_overflow > 0


@pytest.mark.fuzz
@pytest.mark.parametrize("impl", PALLAS)
def test_fuzz_small_blocks_multi_block_and_looping_entries(sgl, impl):
    """Tiny launch blocks send bs > 8 through the two-kernel offsets path and a capacity over
    2 x 16 entries through the looping entries grid."""
    config = _launch(single_block_max=8, multi_block=8, block_entries=16, max_programs=2)
    buckets = [Bucket(9, 12, 6, vc=40), Bucket(8, 10, 5, W=2, lut_len=64, pool_width=6, k=1,
                                                     vc=20, wc_extra=9),
               Bucket(33, 40, 4, W=3, lut_len=90, pool_width=5, vc=90, wc_extra=30),
               Bucket(17, 20, 7, pool_width=8, vc=64, wc_extra=16)]
    _fuzz(sgl, buckets, _tier.n(40, 2000), seed=7, impl=impl, config=config)


@pytest.mark.fuzz
@pytest.mark.parametrize("impl", IMPLS)
def test_fuzz_against_jnp_reference(impl):
    """Every implementation against the pure-jnp reference (no SGLang needed), every family."""
    for family, buckets in sorted(FAMILIES.items()):
        seed = zlib.crc32(family.encode()) + 1
        rng = np.random.default_rng(seed)
        for i in _tier.cases(f"plan vs jnp reference, {family}", seed, _tier.n(15, 120)):
            c = gen_case(rng, buckets[i % len(buckets)])
            with _tier.case("plan vs jnp reference", seed, i, family=family):
                assert_same(run_ours(c, impl), run_ours(c, reference=True), c)


def _xla_config(**kw):
    from kvcanary_jax.ops.plan.xla import Config

    return Config(**kw)


@pytest.mark.fuzz
def test_fuzz_xla_live_blocks(sgl):
    """The xla entries step walking the live entries in blocks of 16 and 4 (the last block
    clamped to the capacity, starting below its boundary), not one pass over the capacity."""
    buckets = [Bucket(9, 12, 6, vc=40), Bucket(8, 10, 5, W=2, lut_len=64, pool_width=6, k=1,
                                                     vc=20, wc_extra=9),
               Bucket(33, 40, 4, W=3, lut_len=90, pool_width=5, vc=90, wc_extra=30),
               Bucket(17, 20, 7, pool_width=8, vc=64, wc_extra=16)]
    _fuzz(sgl, buckets, _tier.n(40, 1000), seed=8, impl="xla", config=_xla_config(block=16))
    _fuzz(sgl, buckets[:2], _tier.n(10, 200), seed=9, impl="xla", config=_xla_config(block=4))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bs", [0, 1, 31, 32, 33, 4095, 4096, 4097, 5000])
def test_fuzz_batch_sizes(sgl, bs, impl):
    """bs across the single-program path (<= 4096) and the multi-block path, no cap."""
    n = 3 if bs > 64 else 20
    b = Bucket(bs, max(bs + 1, 4), 4, lut_len=0 if bs % 2 else 50, W=0 if bs % 2 else 1 + bs % 3,
               pool_width=5 if bs % 2 else 0, k=bs % 2, vc=max(2 * bs, 4), wc_extra=bs % 5,
               max_prefix=3)
    _fuzz(sgl, [b], n, seed=bs, impl=impl)


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
def test_bs_16384(sgl, impl):
    b = Bucket(16384, 16385, 3, W=2, lut_len=64, pool_width=4, k=1, vc=32768, wc_extra=100)
    _fuzz(sgl, [b], 1, seed=16384, impl=impl)


@pytest.mark.gpu
def test_gpu_large_batch_and_capacity_against_reference():
    """On the GPU: bs = 16,384 (multi-block offsets) and a capacity past MAX_PROGRAMS x
    BLOCK_ENTRIES (looping entries grid), against the pure-jnp reference (which matches the oracle
    in every fuzz case above; the oracle itself would take minutes on ~1M entries)."""
    rng = np.random.default_rng(11)
    for b in [Bucket(16384, 16385, 160, W=96, lut_len=1 << 20, pool_width=170, k=1,
                     vc=(1 << 21) + 5, wc_extra=7),
              Bucket(4096, 5000, 300, vc=1 << 20, wc_extra=0),
              Bucket(300, 400, 9000, pool_width=9000, vc=3 << 20)]:
        for _ in range(2):
            c = gen_case(rng, b)
            assert_same(run_ours(c, "pallas_triton"), run_ours(c, reference=True),
                        (b, "large case"))


# ------------------------------------------------------------------------------------------------
# Documented in-bounds behaviour where SGLang's GPU kernels would read out of bounds (or its
# reference raises). Hand-checked values; the pure-jnp reference agrees.
# ------------------------------------------------------------------------------------------------


def _both(c, impl):
    got = run_ours(c, impl)
    assert_same(run_ours(c, reference=True), got, c)
    if impl in PALLAS:
        small = _launch(single_block_max=1, multi_block=1, block_entries=2, max_programs=1)
        assert_same(run_ours(c, impl, config=small), got, c)
    return got


@pytest.mark.parametrize("impl", IMPLS_TPU)
def test_lut_index_clamped_like_the_gpu(sgl, impl):
    c = case([1], [1], [2], [[1, 2, 3], [9, 2, 3]], lut=[0, 500, 501, 502], vc=1, wc=1)
    with pytest.raises(ValueError, match="SWA slot 9 is outside"):
        run_oracle(sgl, c)
    got = _both(c, impl)
    assert got["write_seed_slot_indices"].tolist() == [502]
    assert got["verify_slot_indices"].tolist() == [502]
    assert got["verify_prev_slot_indices"].tolist() == [-1]


@pytest.mark.parametrize("impl", IMPLS_TPU)
def test_prefix_past_row_width_reads_flat_like_the_gpu(sgl, impl):
    c = case([1], [5], [1], [[1, 2, 3], [11, 12, 13], [21, 22, 23]], vc=8, wc=1)
    with pytest.raises(IndexError):
        run_oracle(sgl, c)
    got = _both(c, impl)
    # rp * 3 + pos: positions 3 and 4 of row 1 are cells (2, 0) and (2, 1), as on the GPU.
    assert got["verify_slot_indices"].tolist() == [11, 12, 13, 21, 22, M, M, M]
    assert got["verify_prev_slot_indices"].tolist() == [-1, 11, 12, 13, 21, M, M, M]
    assert got["write_seed_slot_indices"].tolist() == [22]
    assert got["verify_num_valid"].tolist() == [5]


@pytest.mark.parametrize("impl", IMPLS_TPU)
def test_rows_outside_the_table_read_as_unfilled(impl):
    rtt = [[1, 2, 3], [11, 12, 13], [21, 22, 23]]
    # rp = 5 >= rows: every cell outside the table reads 0; rp = -1: flat -3 + pos, so positions
    # 3 and 4 land on cells (0, 0) and (0, 1) inside the table, the rest read 0.
    got = _both(case([5, -1], [2, 5], [1, 1], rtt, vc=8, wc=2), impl)
    assert got["verify_slot_indices"].tolist() == [0, 0, 0, 0, 0, 1, 2, M]
    assert got["verify_expected_positions"].tolist() == [0, 1, 0, 1, 2, 3, 4, M]
    assert got["verify_prev_slot_indices"].tolist() == [-1, 0, -1, 0, 0, 0, 1, M]
    assert got["write_seed_slot_indices"].tolist() == [0, 2]
    lut = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28]
    got = _both(case([5], [2], [1], rtt, lut=lut, vc=2, wc=1), impl)
    assert got["verify_slot_indices"].tolist() == [7, 7]  # unfilled 0 translated like any cell
    assert got["write_seed_slot_indices"].tolist() == [7]


@pytest.mark.parametrize("impl", IMPLS_TPU)
def test_expected_tokens_past_the_pool(sgl, impl):
    rtt = [[1, 2, 3, 4], [11, 12, 13, 14], [21, 22, 23, 24]]
    pool = [[0, 1, 2], [100, 101, 102], [200, 201, 202]]
    c = case([1, 2], [4, 4], [1, 1], rtt, pool=pool, vl=[9, 9], k=0, vc=8, wc=2)
    with pytest.raises(IndexError):
        run_oracle(sgl, c)
    got = _both(c, impl)
    # Row 1 position 3 reads flat cell 6 = (2, 0) as the GPU; row 2 position 3 is past the pool.
    assert got["verify_expected_tokens"].tolist() == [100, 101, 102, 200, 200, 201, 202, -1]


@pytest.mark.parametrize("impl", IMPLS_TPU)
def test_base_with_row_pitch_wider_than_the_view(sgl, impl):
    """A compact base [rows, pitch] standing for a view of width < pitch: reads go through
    rp * pitch + col, as SGLang's kernels address a strided view."""
    rng = np.random.default_rng(3)
    base = rng.integers(1, 1000, (6, 10)).astype(np.int32)
    view = base[:, :7]
    c = case([1, 0, 4, 5], [7, 3, 2, 0], [1, 2, 3, 1], view, vc=16, wc=4)
    want = run_oracle(sgl, c)
    with jax.enable_x64(True):
        vp, wp = marked_plans(c.vc, c.wc)
        kw = kwargs_of(c)
        kw["req_to_token"] = jnp.asarray(base)
        out = canary_plan(verify_plan_out=vp, write_plan_out=wp, **kw, req_to_token_stride0=10,
                          implementation=impl, config=_impls.config("plan", impl))
    assert_same(as_dict(*out), want, c)


# ------------------------------------------------------------------------------------------------
# In place under jit with donated plans
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS_TPU)
def test_jit_with_donated_plans_updates_in_place(sgl, impl):
    c = HAND_CASES["swa_window_with_lut"]
    want = run_oracle(sgl, c)
    with jax.enable_x64(True):
        kw = kwargs_of(c)

        @jax.jit
        def step(vp, wp, rpi, prefix, extend, rtt, lut):
            return canary_plan(verify_plan_out=vp, write_plan_out=wp, req_pool_indices=rpi,
                               prefix_lens=prefix, extend_seq_lens=extend, req_to_token=rtt,
                               swa_window_size=c.W, full_to_swa_index_mapping=lut,
                               verify_capacity=c.vc, req_to_verify_expected_tokens=None,
                               req_to_verify_expected_tokens_valid_lens=None,
                               kv_token_id_vs_position_offset=0, implementation=impl,
                               config=_impls.config("plan", impl))

        donating = jax.jit(step.__wrapped__, donate_argnums=(0, 1))
        args = (kw["req_pool_indices"], kw["prefix_lens"], kw["extend_seq_lens"],
                kw["req_to_token"], kw["full_to_swa_index_mapping"])
        vp, wp = marked_plans(c.vc, c.wc)
        leaves_in = jax.tree_util.tree_leaves((vp, wp))
        ptrs = [x.unsafe_buffer_pointer() for x in leaves_in]
        vp2, wp2 = donating(vp, wp, *args)
        leaves_out = jax.tree_util.tree_leaves((vp2, wp2))
        assert all(x.is_deleted() for x in leaves_in)
        assert [x.unsafe_buffer_pointer() for x in leaves_out] == ptrs
        assert_same(as_dict(vp2, wp2), want, c)
        # A second step on the same buffers (as a serving loop would) still gives the oracle's
        # answer for elements it rewrites and keeps the rest.
        vp3, wp3 = donating(vp2, wp2, *args)
        assert_same(as_dict(vp3, wp3), want, c)


# ------------------------------------------------------------------------------------------------
# Validation: SGLang's classes and messages, in its order
# ------------------------------------------------------------------------------------------------


def _base():
    return case([1, 2], [2, 3], [1, 1], RTT, lut=LUT, vc=6, wc=3)


def _call(c: Case, vp=None, wp=None, fn=canary_plan, **over):
    with jax.enable_x64(True):
        vp0, wp0 = marked_plans(c.vc, c.wc)
        kw = kwargs_of(c)
        kw.update(over)
        return fn(verify_plan_out=vp0 if vp is None else vp, write_plan_out=wp0 if wp is None
                  else wp, **kw)


def _raises(exc, msg, **kw):
    for fn in (canary_plan, canary_plan_reference):
        with pytest.raises(exc) as e:
            _call(fn=fn, **kw)
        assert str(e.value) == msg


def test_swa_without_lut_is_checked_first():
    c = _base()
    c.lut = None
    c.W = 3
    # The capacity mismatch is also present: the LUT check comes first.
    _raises(ValueError, "kv-canary: launch_canary_plan_kernels requires full_to_swa_index_mapping "
            "when swa_window_size > 0", c=c, verify_capacity=99)


def test_verify_capacity_mismatch_gpu_wording():
    _raises(ValueError, "kv-canary: launch_canary_plan_kernels verify_capacity=7 does not match "
            "verify_plan_out.verify_slot_indices.shape[0]=6", c=_base(), verify_capacity=7)


@pytest.mark.parametrize("name,bad,cls,message", [
    ("verify_capacity", 6.5, ValueError, "verify_capacity=6.5 does not match "
                                         "verify_plan_out.verify_slot_indices.shape[0]=6"),
    ("verify_capacity", 6.0, TypeError, "verify_capacity must be an int, got float 6.0"),
    ("swa_window_size", 0.0, TypeError, "swa_window_size must be an int, got float 0.0"),
    ("kv_token_id_vs_position_offset", 1.5, TypeError,
     "kv_token_id_vs_position_offset must be an int, got float 1.5"),
    ("kv_token_id_vs_position_offset", np.array(1), TypeError,
     "kv_token_id_vs_position_offset must be an int, got ndarray array(1)"),
    # SGLang compares whatever it is given: its mismatch error, not ours.
    ("verify_capacity", None, ValueError, "verify_capacity=None does not match "
                                          "verify_plan_out.verify_slot_indices.shape[0]=6"),
    ("req_to_token_stride0", 16.5, TypeError,
     "req_to_token_stride0 must be an int, got float 16.5"),
    # Past int64, JAX's argument parsing failed with no word of which argument.
    ("kv_token_id_vs_position_offset", 2**63, ValueError,
     "kv_token_id_vs_position_offset must fit in int64, got 9223372036854775808"),
    ("swa_window_size", -(2**63) - 1, ValueError,
     "swa_window_size must fit in int64, got -9223372036854775809"),
])
def test_the_scalars_must_be_integers(name, bad, cls, message):
    """They were truncated with ``int()`` before the checks: 6.5 passed as 6 where SGLang
    raises, and a fractional offset or window was silently rounded down."""
    _raises(cls, "kv-canary: launch_canary_plan_kernels " + message, c=_base(), **{name: bad})


_DTYPE_CASES = {
    "req_pool_indices": ("req_pool_indices", np.int32),
    "prefix_lens": ("prefix_lens", np.int32),
    "extend_seq_lens": ("extend_seq_lens", np.int32),
    "req_to_token": ("req_to_token", np.int64),
    "lut_tensor": ("full_to_swa_index_mapping", np.int32),
}


@pytest.mark.parametrize("name", sorted(_DTYPE_CASES))
def test_input_dtype_errors_are_value_errors(name):
    arg, bad = _DTYPE_CASES[name]
    c = _base()
    with jax.enable_x64(True):
        value = jnp.asarray(np.asarray(kwargs_of(c)[arg]).astype(bad))
    want = "int32" if bad == np.int64 else "int64"
    got = "int64" if bad == np.int64 else "int32"
    _raises(ValueError, f"kv-canary: {name} must have dtype {want}, got {got}", c=c, **{arg: value})


@pytest.mark.parametrize("field,name,want,bad", [
    ("write_offsets", "out_write_offsets", "int64", jnp.int32),
    ("write_seed_slot_indices", "out_write_seed_slot_indices", "int64", jnp.int32),
    ("verify_num_valid", "out_verify_num_valid", "int32", jnp.int64),
    ("enable", "out_verify_enable", "int32", jnp.int64),
    ("write_num_valid_reqs", "out_write_num_valid_reqs", "int32", jnp.int64),
])
def test_plan_dtype_errors(field, name, want, bad):
    c = _base()
    with jax.enable_x64(True):
        vp, wp = marked_plans(c.vc, c.wc)
        if hasattr(vp, field):
            vp = dataclasses.replace(vp, **{field: getattr(vp, field).astype(bad)})
        else:
            wp = dataclasses.replace(wp, **{field: getattr(wp, field).astype(bad)})
    _raises(ValueError, f"kv-canary: {name} must have dtype {want}, got {jnp.dtype(bad).name}",
            c=c, vp=vp, wp=wp)


def _plans_with(c, **fields):
    with jax.enable_x64(True):
        vp, wp = marked_plans(c.vc, c.wc)
        vf = {k: v for k, v in fields.items() if hasattr(vp, k)}
        wf = {k: v for k, v in fields.items() if not hasattr(vp, k)}
        return dataclasses.replace(vp, **vf), dataclasses.replace(wp, **wf)


def _z(shape, dt):
    with jax.enable_x64(True):
        return jnp.zeros(shape, dt)


def test_write_offsets_len_must_be_positive():
    c = _base()
    vp, wp = _plans_with(c, write_offsets=_z((0,), jnp.int64))
    _raises(ValueError, "kv-canary: write_offsets_len must be positive, got 0", c=c, vp=vp, wp=wp)


@pytest.mark.parametrize("stride", [0, -4])
def test_req_to_token_stride0_must_be_positive(stride):
    for fn in (canary_plan, canary_plan_reference):
        with pytest.raises(ValueError) as e:
            _call(_base(), fn=fn, req_to_token_stride0=stride)
        assert str(e.value) == f"kv-canary: req_to_token_stride0 must be positive, got {stride}"


def test_req_to_token_stride0_must_match():
    for fn in (canary_plan, canary_plan_reference):
        with pytest.raises(ValueError) as e:
            _call(_base(), fn=fn, req_to_token_stride0=7)
        assert str(e.value) == ("kv-canary: req_to_token_stride0=7 does not match "
                                "req_to_token.stride(0)=6")
    _call(_base(), req_to_token_stride0=6)  # the matching stride is accepted


def test_empty_lut():
    _raises(ValueError, "kv-canary: lut_len must be positive when has_swa_lut is True", c=_base(),
            full_to_swa_index_mapping=_z((0,), jnp.int64))


@pytest.mark.parametrize("arg,value,msg", [
    ("req_pool_indices", ((2, 1), jnp.int64),
     "kv-canary: req_pool_indices must be 1-D, got shape (2, 1)"),
    ("prefix_lens", ((2, 1), jnp.int64), "kv-canary: prefix_lens must be 1-D, got shape (2, 1)"),
    ("prefix_lens", ((3,), jnp.int64), "kv-canary: prefix_lens length must be 2, got 3"),
    ("extend_seq_lens", ((1,), jnp.int64), "kv-canary: extend_seq_lens length must be 2, got 1"),
    ("req_to_token", ((6,), jnp.int32), "kv-canary: req_to_token must be 2-D, got shape (6,)"),
    ("full_to_swa_index_mapping", ((4, 2), jnp.int64),
     "kv-canary: lut_tensor must be 1-D, got shape (4, 2)"),
])
def test_input_shape_errors(arg, value, msg):
    _raises(ValueError, msg, c=_base(), **{arg: _z(*value)})


@pytest.mark.parametrize("field,value,msg", [
    ("write_offsets", ((4, 1), jnp.int64),
     "kv-canary: out_write_offsets must be 1-D, got shape (4, 1)"),
    ("write_seed_slot_indices", ((3, 1), jnp.int64),
     "kv-canary: out_write_seed_slot_indices must be 1-D, got shape (3, 1)"),
    ("verify_num_valid", ((2,), jnp.int32),
     "kv-canary: out_verify_num_valid length must be 1, got 2"),
    ("enable", ((1, 1), jnp.int32), "kv-canary: out_verify_enable must be 1-D, got shape (1, 1)"),
    ("write_num_valid_reqs", ((0,), jnp.int32),
     "kv-canary: out_write_num_valid_reqs length must be 1, got 0"),
    ("write_offsets", ((5,), jnp.int64),
     "kv-canary: write_offsets_len must equal write_req_capacity + 1, got 5 and 3"),
])
def test_plan_shape_errors(field, value, msg):
    c = _base()
    vp, wp = _plans_with(c, **{field: _z(*value)})
    _raises(ValueError, msg, c=c, vp=vp, wp=wp)


def test_bs_exceeds_write_req_capacity(sgl):
    c = case([1, 2, 3], [1, 2, 1], [2, 1, 4], RTT, vc=6, wc=2)
    _raises(ValueError, "kv-canary: bs=3 exceeds write_req_capacity=2", c=c)


@pytest.mark.parametrize("impl", IMPLS)
def test_no_cap_on_bs(impl):
    # SGLang's GPU path rejects bs > 4096; here the batch runs (checked in the fuzz above too).
    c = case(np.ones(4100), np.ones(4100), np.ones(4100), RTT, vc=4100, wc=4100)
    got = run_ours(c, impl)
    assert got["verify_num_valid"].tolist() == [4100]
    assert got["write_offsets"][-1] == 4100


def test_pool_without_valid_lens_gpu_wording():
    c = case([1], [3], [1], RTT, pool=POOL, vl=[3], vc=4, wc=1)
    _raises(ValueError, "kv-canary: launch_plan_entries_kernel requires "
            "req_to_verify_expected_tokens_valid_lens when req_to_verify_expected_tokens is set",
            c=c, req_to_verify_expected_tokens_valid_lens=None)


def test_check_order_offsets_before_valid_lens():
    # SGLang's GPU path runs the offsets checks before the entries launcher's valid_lens check.
    c = case([1], [3], [1], RTT, pool=POOL, vl=[3], vc=4, wc=1)
    with jax.enable_x64(True):
        bad = jnp.asarray(np.array([3], np.int32))
    _raises(ValueError, "kv-canary: prefix_lens must have dtype int64, got int32", c=c,
            prefix_lens=bad, req_to_verify_expected_tokens_valid_lens=None)


@pytest.mark.parametrize("what", ["valid_lens_len", "pool_1d", "verify_array_len"])
def test_entries_guards_are_runtime_errors(what):
    c = case([1, 2], [3, 2], [1, 1], RTT, pool=POOL, vl=[3, 3], vc=6, wc=2)
    kw, vp = {}, None
    if what == "valid_lens_len":
        kw["req_to_verify_expected_tokens_valid_lens"] = _z((3,), jnp.int64)
        msg = ("kv-canary: launch_plan_entries_kernel req_to_verify_expected_tokens_valid_lens "
               "must be 1-D int64 of length 2, got shape (3,) dtype int64")
    elif what == "pool_1d":
        kw["req_to_verify_expected_tokens"] = _z((24,), jnp.int32)
        msg = ("kv-canary: launch_plan_entries_kernel req_to_verify_expected_tokens must be "
               "2-D int32, got shape (24,) dtype int32")
    else:
        vp, _ = _plans_with(c, verify_prev_slot_indices=_z((5,), jnp.int64))
        msg = ("kv-canary: launch_plan_entries_kernel out_verify_prev_slot_indices must be 1-D "
               "int64 of length 6, got shape (5,) dtype int64")
    _raises(RuntimeError, msg, c=c, vp=vp, **kw)


@pytest.mark.torch
def test_contract_on_torch_tensors():
    """The bridge evaluates the same contract on torch tensors: contiguity, torch dtype names,
    the stride contract on views, devices."""
    import torch

    def tensors(**over):
        t = dict(
            req_pool_indices=torch.tensor([1, 2]), prefix_lens=torch.tensor([2, 3]),
            extend_seq_lens=torch.tensor([1, 1]),
            req_to_token=torch.zeros((4, 6), dtype=torch.int32),
            full_to_swa_index_mapping=None, req_to_verify_expected_tokens=None,
            req_to_verify_expected_tokens_valid_lens=None,
            out_verify_slot_indices=torch.zeros(6, dtype=torch.int64),
            out_verify_expected_tokens=torch.zeros(6, dtype=torch.int64),
            out_verify_expected_positions=torch.zeros(6, dtype=torch.int64),
            out_verify_prev_slot_indices=torch.zeros(6, dtype=torch.int64),
            out_verify_num_valid=torch.zeros(1, dtype=torch.int32),
            out_verify_enable=torch.zeros(1, dtype=torch.int32),
            out_write_offsets=torch.zeros(4, dtype=torch.int64),
            out_write_seed_slot_indices=torch.zeros(3, dtype=torch.int64),
            out_write_num_valid_reqs=torch.zeros(1, dtype=torch.int32),
        )
        t.update(over)
        return t

    def check(msg, exc=ValueError, stride0=None, **over):
        with pytest.raises(exc) as e:
            CONTRACT.validate_metas(plan_metas(tensors(**over)), swa_window_size=0,
                                    verify_capacity=6, req_to_token_stride0=stride0)
        assert str(e.value) == msg

    CONTRACT.validate_metas(plan_metas(tensors()), swa_window_size=0, verify_capacity=6,
                            req_to_token_stride0=None)
    wide = torch.zeros((4, 8), dtype=torch.int32)
    check("kv-canary: req_to_token must be contiguous", req_to_token=wide[:, :6])
    check("kv-canary: prefix_lens must have dtype torch.int64, got torch.int32",
          prefix_lens=torch.tensor([2, 3], dtype=torch.int32))
    check("kv-canary: lut_tensor must have dtype torch.int64, got torch.int32",
          full_to_swa_index_mapping=torch.zeros(8, dtype=torch.int32))
    check("kv-canary: prefix_lens must be on out_verify_offsets_scratch's device cpu, got meta",
          prefix_lens=torch.zeros(2, dtype=torch.int64, device="meta"))
    # A single-row slice of a wider table is contiguous in torch but has stride(0) = 8.
    one_row = wide[:1, :6]
    CONTRACT.validate_metas(plan_metas(tensors(req_to_token=one_row)), swa_window_size=0,
                            verify_capacity=6, req_to_token_stride0=8)
    check("kv-canary: req_to_token_stride0=6 does not match req_to_token.stride(0)=8",
          stride0=6, req_to_token=one_row)


def test_offsets_checks_unreachable_through_the_api():
    """Checks SGLang's offsets launcher runs that the API's earlier checks pre-empt: evaluated on
    the offsets checks alone."""
    offsets_only = Contract("plan_offsets", plan_base.OFFSETS_CHECKS)
    with jax.enable_x64(True):
        c = _base()
        vp, wp = marked_plans(c.vc, c.wc)
        kw = kwargs_of(c)
    metas = plan_metas(dict(
        req_pool_indices=kw["req_pool_indices"], prefix_lens=kw["prefix_lens"],
        extend_seq_lens=kw["extend_seq_lens"], req_to_token=kw["req_to_token"],
        full_to_swa_index_mapping=kw["full_to_swa_index_mapping"],
        out_write_offsets=wp.write_offsets, out_write_seed_slot_indices=wp.write_seed_slot_indices,
        out_verify_num_valid=vp.verify_num_valid, out_verify_enable=vp.enable,
        out_write_num_valid_reqs=wp.write_num_valid_reqs,
    ))
    with pytest.raises(ValueError) as e:
        offsets_only.validate_metas(metas, verify_capacity=-1, swa_window_size=0)
    assert str(e.value) == "kv-canary: verify_capacity must be non-negative, got -1"
    metas["lut_tensor"] = dataclasses.replace(metas["lut_tensor"], shape=(3,))
    with pytest.raises(ValueError) as e:
        offsets_only.validate_metas(metas, verify_capacity=6, swa_window_size=0)
    assert str(e.value) == "kv-canary: lut_tensor length must be >= 41, got 3"


# ------------------------------------------------------------------------------------------------
# every implementation: fuzz with hostile plans
# ------------------------------------------------------------------------------------------------
# The families' cases against SGLang's reference, and hostile ones against the jnp reference
# (SGLang's reference raises, or reads differently, there): prefixes past the row width (the flat
# address reads the next rows), rows outside the table or negative, valid_lens past the pool width,
# cells past the LUT (clamped), huge prefixes and extends. Every plan array is compared, untouched
# tails included. Every implementation runs FUZZ_PER_FAMILY cases a family over all its buckets
# in CI; pallas_mosaic_tpu in TPU interpret mode FUZZ_TPU_INTERPRETED of the first bucket (the long
# run, all of them, with --tpu-long).
FUZZ_PER_FAMILY = _tier.n(12, 250)  # --long: 250
FUZZ_TPU_INTERPRETED = _tier.n(1, 12)  # --tpu-long: 250 over every bucket
LONG_CASES = 250


def _hostile(rng, c: Case) -> Case:
    bs = c.rpi.shape[0]
    rows, width = c.rtt.shape
    rpi, prefix, extend = c.rpi.copy(), c.prefix.copy(), c.extend.copy()
    u = rng.random(bs)
    prefix[u < 0.3] = rng.integers(width, 3 * width + 2, bs)[u < 0.3]
    prefix[u > 0.95] = 2**40
    bad = rng.random(bs) < 0.2
    rpi[bad] = rng.choice([rows, rows + 2, -1, -3], int(bad.sum()))
    extend[rng.random(bs) < 0.1] = 2**40
    rtt = c.rtt.copy()
    if c.lut is not None:
        rtt[rng.random(rtt.shape) < 0.1] = c.lut.shape[0] + 5  # past the LUT: clamped
    vl = None if c.vl is None else c.vl.copy()
    if vl is not None:
        vl[rng.random(bs) < 0.4] = c.pool.shape[1] + int(rng.integers(1, 12))
    return dataclasses.replace(c, rpi=rpi, prefix=prefix, extend=extend, rtt=rtt, vl=vl)


def _draw_hostile_case(rng, bucket) -> tuple[Case, bool]:
    """A case of ``bucket``, made hostile 4 times in 10: (the case, whether it is hostile)."""
    c = gen_case(rng, bucket)
    hostile = rng.random() < 0.4
    return (_hostile(rng, c) if hostile else c), hostile


def _hostile_fuzz(sgl, buckets, n_cases, seed, implementation):
    """Clean cases against SGLang's reference; hostile ones against the jnp reference (SGLang's
    raises on them, or reads differently by design: the GPU's flat addressing past a row)."""
    rng = np.random.default_rng(seed)
    # Hostile and clean cases (a short run: the first of each, _tier.Coverage).
    cover = _tier.Coverage("plan hostile fuzz", seed, n_cases, ("hostile", "clean"))
    for i in cover.draws():
        c, hostile = _draw_hostile_case(rng, buckets[i % len(buckets)])
        if not cover.wants(hostile=hostile, clean=not hostile):
            continue
        with _tier.case("plan hostile fuzz", seed, i, implementation=implementation,
                        hostile=hostile):
            want = run_ours(c, reference=True) if hostile else run_oracle(sgl, c)
            assert_same(run_ours(c, implementation), want, c)
        cover.ran(hostile=hostile, clean=not hostile)
    cover.check()
    return cover.runs


@pytest.mark.fuzz
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("impl", _impls.with_tpu("plan"))
def test_hostile_fuzz(sgl, impl, family):
    seed = zlib.crc32(family.encode()) + 1
    if _impls.tpu_interpreted(impl):
        _hostile_fuzz(sgl, FAMILIES[family][:1], FUZZ_TPU_INTERPRETED, seed, impl)
    else:
        _hostile_fuzz(sgl, FAMILIES[family], FUZZ_PER_FAMILY, seed, impl)


def test_short_hostile_fuzz_checks_its_coverage(sgl, monkeypatch):
    """TPU interpret mode's short hostile fuzz (FUZZ_TPU_INTERPRETED cases of a family's first
    bucket) runs the coverage check too: its cases cover every kind (xla standing in for the
    interpreter here), and a stream that lacks a kind fails it."""
    family = sorted(FAMILIES)[0]
    seed = zlib.crc32(family.encode()) + 1
    assert _hostile_fuzz(sgl, FAMILIES[family][:1], FUZZ_TPU_INTERPRETED, seed, "xla") == 2
    monkeypatch.setitem(globals(), "_draw_hostile_case", lambda rng, b: (gen_case(rng, b), False))
    with pytest.raises(AssertionError, match="no case of kind"):
        _hostile_fuzz(sgl, FAMILIES[family][:1], FUZZ_TPU_INTERPRETED, seed, "xla")


@pytest.mark.slow
@pytest.mark.tpu_interpret
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hostile_fuzz_tpu_interpreted_long(sgl, family):
    _hostile_fuzz(sgl, FAMILIES[family], LONG_CASES, zlib.crc32(family.encode()) + 2,
                  _impls.TPU)


@pytest.mark.fuzz
@pytest.mark.tpu_interpret
@pytest.mark.parametrize("bs", [1, 31, 32, 33, 130])
def test_tpu_batch_sizes(sgl, bs):
    b = Bucket(bs, max(bs + 1, 4), 4, lut_len=0 if bs % 2 else 50, W=0 if bs % 2 else 1 + bs % 3,
               pool_width=5 if bs % 2 else 0, k=bs % 2, vc=max(2 * bs, 4), wc_extra=bs % 5,
               max_prefix=3)
    rng = np.random.default_rng(bs)
    # One drawn case per batch size in the fast tier (the kernel walks requests serially: at
    # bs 130 a TPU-interpreted case takes about 45 s); --long draws the second.
    for i in _tier.cases(f"plan TPU batch size {bs}", bs, _tier.n(1, 2)):
        c = gen_case(rng, b)
        with _tier.case("plan TPU batch size", bs, i):
            assert_same(run_ours(c, _impls.TPU), run_oracle(sgl, c), c)


@pytest.mark.slow
@pytest.mark.tpu_interpret
@pytest.mark.parametrize("bs", [4096, 4097])
def test_tpu_batch_sizes_past_sglang_cap(sgl, bs):
    b = Bucket(bs, bs + 1, 4, lut_len=0 if bs % 2 else 50, W=0 if bs % 2 else 2,
               pool_width=5 if bs % 2 else 0, k=1, vc=2 * bs, wc_extra=3, max_prefix=3)
    c = gen_case(np.random.default_rng(bs), b)
    assert_same(run_ours(c, _impls.TPU), run_oracle(sgl, c), c)


def test_tpu_batch_past_the_smem_budget_is_refused_with_a_clear_error():
    """The TPU offsets kernel holds the batch in SMEM: past its budget, a clear error that names
    the alternative (never a compile failure or a silent truncation)."""
    c = case(np.ones(40000), np.ones(40000), np.ones(40000), RTT, vc=8, wc=40000)
    with pytest.raises(ValueError, match="implementation='xla'"):
        run_ours(c, _impls.TPU)


# ------------------------------------------------------------------------------------------------
# The batch size as an operand: request vectors padded to a bucket, num_reqs the true count
# ------------------------------------------------------------------------------------------------


def run_padded(c: Case, impl: str | None, padded_bs: int, rng, *, config=None,
               reference: bool = False) -> dict:
    """Case ``c`` planned with its request vectors padded to ``padded_bs`` lanes of garbage
    (live-looking rows, prefixes, lengths) and ``num_reqs = bs``."""
    bs = c.rpi.shape[0]
    extra = padded_bs - bs
    rows = c.rtt.shape[0]
    pad = lambda x, fill: np.concatenate([x, fill]).astype(np.int64)  # noqa: E731
    kw_pad = dict(
        req_pool_indices=pad(c.rpi, rng.integers(1, max(rows, 2), extra)),
        prefix_lens=pad(c.prefix, rng.integers(1, 9, extra)),
        extend_seq_lens=pad(c.extend, rng.integers(1, 9, extra)))
    with jax.enable_x64(True):
        vp, wp = marked_plans(c.vc, c.wc)
        kw = kwargs_of(c)
        kw.update({k: jnp.asarray(v) for k, v in kw_pad.items()})
        if c.vl is not None:
            kw["req_to_verify_expected_tokens_valid_lens"] = jnp.asarray(
                pad(c.vl, rng.integers(0, 9, extra)))
        if reference:
            inputs = plan_base.PlanInputs(
                **{k: kw[k] for k in ("req_pool_indices", "prefix_lens", "extend_seq_lens",
                                      "req_to_token", "full_to_swa_index_mapping",
                                      "req_to_verify_expected_tokens",
                                      "req_to_verify_expected_tokens_valid_lens")},
                num_reqs=jnp.asarray([bs], jnp.int32))
            return as_dict(*plan_base.reference(
                vp, wp, inputs, swa_window_size=c.W, verify_capacity=c.vc,
                kv_token_id_vs_position_offset=c.k))
        return as_dict(*canary_plan(verify_plan_out=vp, write_plan_out=wp, **kw,
                                    implementation=impl, config=config, num_reqs=bs))


def _fuzz_padded(sgl, buckets, n_cases, seed, impl, config=None):
    rng = np.random.default_rng(seed)
    n_bad, first_bad, n_overflow = 0, None, 0
    for i in range(n_cases):
        b = buckets[i % len(buckets)]
        c = gen_case(rng, b)
        padded_bs = max(2 * b.bs, b.bs + 3)  # a bucket above the case's bs
        c.wc = max(c.wc, padded_bs)
        want = run_oracle(sgl, c)
        n_overflow += int(want["enable"][0] == 0)
        bad = mismatches(run_padded(c, impl, padded_bs, rng, config=config), want)
        bad += ["reference " + s for s in
                mismatches(run_padded(c, None, padded_bs, rng, reference=True), want)]
        if bad:
            n_bad += 1
            first_bad = first_bad or (c, bad)
    assert n_bad == 0, f"{n_bad} of {n_cases} cases differ; first: {first_bad}"
    return n_overflow


PADDED_IMPLS = [i for i in IMPLS if i != "pallas_mosaic_tpu"]


@pytest.mark.parametrize("impl", PADDED_IMPLS)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_padded_batch_with_num_reqs_equals_sglang(sgl, family, impl):
    """Request vectors padded with live-looking garbage to a bucket, ``num_reqs`` the true batch
    size: every output element equals SGLang's plan of the unpadded batch (write_offsets zero
    past bs, seeds untouched past bs, write_num_valid_reqs = bs), and so does the reference."""
    n_overflow = _fuzz_padded(sgl, FAMILIES[family], 150, seed=zlib.crc32(family.encode()) + 2,
                              impl=impl)
    assert 0 < n_overflow < 150


@pytest.mark.parametrize("impl", PALLAS)
def test_padded_batch_multi_block_offsets(sgl, impl):
    """num_reqs through the two-kernel offsets path (block sums over padded lanes) and the
    looping entries grid."""
    config = _launch(single_block_max=8, multi_block=8, block_entries=16, max_programs=2)
    buckets = [Bucket(9, 12, 6, vc=40), Bucket(17, 20, 7, pool_width=8, k=1, vc=64,
                                                    wc_extra=16),
               Bucket(1, 3, 5, W=2, lut_len=64, pool_width=6, vc=20)]
    _fuzz_padded(sgl, buckets, 150, seed=11, impl=impl, config=config)


@pytest.mark.parametrize("impl", PADDED_IMPLS)
def test_num_reqs_zero_and_clamped(sgl, impl):
    """num_reqs = 0 plans an empty batch (SGLang's bs == 0 plan); a count past the lanes is
    clamped to them."""
    c = HAND_CASES["full_basic"]
    with jax.enable_x64(True):
        vp, wp = marked_plans(c.vc, c.wc)
        got0 = as_dict(*canary_plan(verify_plan_out=vp, write_plan_out=wp, **kwargs_of(c),
                                    implementation=impl, num_reqs=0))
        vp, wp = marked_plans(c.vc, c.wc)
        got9 = as_dict(*canary_plan(verify_plan_out=vp, write_plan_out=wp, **kwargs_of(c),
                                    implementation=impl, num_reqs=9))
    empty = dataclasses.replace(c, rpi=c.rpi[:0], prefix=c.prefix[:0], extend=c.extend[:0])
    assert_same(got0, run_oracle(sgl, empty))
    assert_same(got9, run_oracle(sgl, c))


def _tpu_interpret_config():
    from jax.experimental.pallas import tpu as pltpu

    from kvcanary_jax.ops.plan.pallas_mosaic_tpu import Config

    return Config(interpret=pltpu.InterpretParams())


def test_num_reqs_refused_by_the_per_bs_implementation():
    c = HAND_CASES["full_basic"]
    with jax.enable_x64(True), pytest.raises(ValueError, match="'pallas_mosaic_tpu' compiles per "
                                             "batch size and takes no num_reqs"):
        vp, wp = marked_plans(c.vc, c.wc)
        canary_plan(verify_plan_out=vp, write_plan_out=wp, **kwargs_of(c),
                    implementation="pallas_mosaic_tpu", num_reqs=2,
                    config=_tpu_interpret_config())


@pytest.mark.parametrize("impl", PADDED_IMPLS)
def test_serving_loop_compiles_once_per_bucket(sgl, impl):
    """Batch sizes 1..40 padded to kvcanary_jax.buckets with floor 8: 4 buckets (8, 16, 32, 64),
    so 4 compilations of the plan, each result equal to SGLang's unpadded plan."""
    from kvcanary_jax import buckets
    from kvcanary_jax.ops.plan import api

    rng = np.random.default_rng(5)
    before = api._run._cache_size()
    for bs in range(1, 41):
        c = gen_case(rng, Bucket(bs, 41, 6, pool_width=7, vc=48, wc_extra=64 - bs))
        want = run_oracle(sgl, c)
        assert_same(run_padded(c, impl, buckets.bucket(bs, floor=8), rng), want, c)
    assert api._run._cache_size() - before == 4
