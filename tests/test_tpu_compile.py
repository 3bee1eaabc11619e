"""The Mosaic TPU kernels compile with libtpu for TPU topologies, on a CPU host (marked
``tpu_compile``; deselected where libtpu is not installed: ``pip install "jax[tpu]==<jax>"``).

Lowering (``tests/test_lowering.py``) and TPU interpret mode do not check Mosaic's own rules (DMA
granularity, tiling, loop carries); libtpu's compiler does. Nothing runs: correctness comes from
the TPU interpret suites. Every compile refuses a fallback (a FallbackWarning is an error), so
what compiles is the Mosaic kernels. Sizes are small to keep compile time low (about 10 s a
compile on two cores); ``python -m bench.tpu_compile`` compiles the serving sizes."""

from __future__ import annotations

import dataclasses
import functools

import pytest

import jax
import jax.numpy as jnp

from kvcanary_jax.bench import tpu_compile as tc

from test_lowering import DIGEST_KERNELS, TPU_KERNELS, _digest_ops, _ops

pytestmark = pytest.mark.tpu_compile


@pytest.fixture(autouse=True, scope="module")
def _through_libtpu_every_time():
    """Every compile here goes through libtpu's compiler: the suite's persistent compilation
    cache (conftest.py) is off for this module, so no test passes on an executable an earlier
    run compiled. (JAX decides whether a process uses that cache once; resetting it makes JAX
    decide again. Test-only: JAX has no public switch for this.)"""
    from jax._src import compilation_cache

    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_enable_compilation_cache", before)
    compilation_cache.reset_cache()

TOPOLOGIES = ("v5e:2x2", "v6e:2x2")

# Small cases of the harness: a short row (5 columns) and a row with a short last segment (200)
# for the scatter, a request row pitch of 128 for the plan, and a small step.
SMALL = (
    tc.Case("scatter 1x5", "scatter", tc.scatter_case(1, 5, 4)),
    tc.Case("scatter 3x200", "scatter", tc.scatter_case(3, 200, 8)),
    tc.Case("plan 4x128", "plan", tc.plan_case(4, 128)),
    tc.Case("step small", "step", tc.step_case(
        max_reqs=8, context_len=128, num_slots=1024, max_bs=4, max_tokens=64,
        verify_capacity=512, ring_capacity=64)),
    tc.Case("step small coverage", "step", tc.step_case(
        max_reqs=8, context_len=128, num_slots=1024, max_bs=4, max_tokens=64,
        verify_capacity=512, ring_capacity=64, coverage_window=4, num_layers=2)),
)


def _compiled_text(fn, args, topology):
    compiled = tc.compile_for(fn, args, tc.topology_device(topology))
    return compiled.as_text()


_CASES = {c.name: c for c in tc.CASES}


@functools.cache
def _measured(case: tc.Case, topology: str) -> dict:
    """``tc.measure`` of a case on a topology, once per process: a pure function of the two (a
    case is a frozen spec, the compiler libtpu's); the tests below that read memory figures ask
    again for cases the serving-size test compiled (about 80 of this module's 370 s)."""
    return tc.measure(case, topology)


def _measure(case: tc.Case, topology: str) -> dict:
    return dict(_measured(case, topology))  # a copy: a test may not edit another's row


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_every_op_compiles(topology):
    """The lowering tests' ops: scatter (a 16-column pool: a row shorter than one segment), plan
    (16-column request rows, with an SWA window and LUT), write and verify (a real-KV source of
    page size 1: the fingerprint kernel too)."""
    with jax.enable_x64(True):
        ops = _ops(tc.TPU)
    for name, fn, args, _ in ops:
        text = _compiled_text(fn, args, topology)
        assert all(k in text for k in TPU_KERNELS[name]), (name, topology)


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("case", SMALL, ids=lambda c: c.name)
def test_small_cases_compile(case, topology):
    row = _measure(case, topology)
    assert row["ok"], row.get("error")
    assert row["generated_code_size_in_bytes"] > 0


# The serving sizes of ``bench.tpu_compile`` (a 1M-slot canary, 64k-entry verify, scatter 256 x
# 8,192 and 1 x 5, plan at 4,096 requests and 1, write 1 x 8,192 and 64 x 1, real-KV sources of
# page size 1 and 16, and the whole step at a serving config): the sizes a server compiles, where
# SMEM budgets, DMA windows and block counts differ from the small cases, and where a layout that
# pads the canary runs out of HBM (the serving step on v5e did, at 16.6 GB of temporaries, before
# the kernels took the canary in place). Memory and cost figures: bench/NOTES.md.
SERVING = tuple((case, topology) for case in tc.CASES for topology in TOPOLOGIES)


@pytest.mark.parametrize("case,topology", SERVING, ids=lambda x: getattr(x, "name", x))
def test_serving_sizes_compile(case, topology):
    row = _measure(case, topology)
    assert row["ok"], row.get("error")
    # Arguments are laid out compactly (what the caller's arrays take, no layout padding).
    assert row["argument_vs_logical"] <= 1.01 or row["logical_bytes"] < 1 << 20, row


def test_default_implementation_follows_tpu_placed_arguments():
    """``implementation=None`` with arguments placed on a TPU topology's device (a one-device
    mesh of it) on this CPU host: the registry picks pallas_mosaic_tpu (no FallbackWarning) and
    libtpu compiles it. Without an abstract mesh in scope, as here, JAX's Mosaic lowering reads
    the TPU generation from the arguments where it can; plan's lowering asks for it elsewhere
    ("Unsupported TPU device kind: cpu" unless inside ``jax.sharding.use_abstract_mesh``), so the
    plan is left out here (``tests/test_lowering.py`` and the tests above lower it in one)."""
    import warnings

    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import kvcanary_jax as kc

    devices = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices
    sharding = NamedSharding(Mesh(np.array(devices[:1]), ("x",)), PartitionSpec())
    with jax.enable_x64(True), warnings.catch_warnings():
        warnings.simplefilter("error", kc.FallbackWarning)
        for name, fn, args, _ in _ops(None):
            if name == "plan":
                continue
            specs = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), args)
            text = fn.trace(*specs).lower(lowering_platforms=("tpu",)).compile().as_text()
            assert all(k in text for k in TPU_KERNELS[name]), name


@pytest.mark.parametrize("name", ["write 64x1", "verify 64k"])
def test_canary_ops_hold_no_copy_of_the_canary(name):
    """Write and verify at serving size (a 1M-slot canary, 32 MiB) on v5e read and write the
    canary in place, as canary tiles (the transpose of SGLang's bytes, a bitcast in XLA's
    layout): their temporaries stay far below one copy of the canary. (An int32 [N, 8] operand,
    which XLA pads to 128 lanes, cost 2-2.5 GiB of temporaries here.)"""
    case = next(c for c in tc.CASES if c.name == name)
    row = _measure(case, "v5e:2x2")
    assert row["ok"], row.get("error")
    canary = tc.SLOTS * 32
    assert row["temp_size_in_bytes"] < canary // 8, row


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_digest_compiles(topology):
    """digest_write and digest_verify over the lowering tests' sources (a fused bf16 layer's
    K and V head strips sharing one buffer, a paged uint8 source read in part, a float32 one)."""
    with jax.enable_x64(True):
        ops = _digest_ops(tc.TPU)
    for name, fn, args in ops:
        text = _compiled_text(fn, args, topology)
        assert all(k in text for k in DIGEST_KERNELS[tc.TPU]), (name, topology)


@functools.lru_cache(maxsize=1)
def _layout_ops(slots: int):
    """digest_write and digest_verify (window 4) over every in-place layout of
    ``_digest_support.in_place_layouts`` at once (one source list, each layer's views sharing
    its array), and the bytes of those arrays."""
    import numpy as np

    import kvcanary_jax as kc

    import _digest_support as ds

    layouts = ds.in_place_layouts(np.random.default_rng(3), slots)
    sources = [s for group in layouts.values() for s in group]
    with jax.enable_x64(True):
        bound = ds.jax_sources(sources)
        arrays = tuple({id(s.tensor): s.tensor for s in bound}.values())
    nbytes = sum(a.nbytes for a in arrays)

    def as_sources(kv):
        at = {id(a): x for a, x in zip(arrays, kv)}
        return tuple(dataclasses.replace(s, tensor=at[id(s.tensor)]) for s in bound)

    write = jax.jit(lambda b, s, kv: kc.digest_write(b, s, as_sources(kv),
                                                     implementation=tc.TPU), donate_argnums=0)

    def verify_fn(ctx, s, pos, nv, phase, kv):
        return kc.digest_verify(ctx, s, pos, nv, phase, window=4, sources=as_sources(kv),
                                implementation=tc.TPU)

    spec = jax.ShapeDtypeStruct
    specs = tuple(spec(a.shape, a.dtype) for a in arrays)
    with jax.enable_x64(True):
        ctx = jax.eval_shape(lambda: kc.DigestContext.allocate(num_slots=slots, ring_capacity=64))
    i32, i64 = spec((1,), jnp.int32), (lambda n: spec((n,), jnp.int64))
    return nbytes, [("digest_write", write, (i64(slots), i64(256), specs)),
                    ("digest_verify", jax.jit(verify_fn, donate_argnums=0),
                     (ctx, i64(1024), i64(1024), i32, i32, specs))]


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_digest_reads_every_layout_in_place(topology):
    """The layouts the Mosaic kernel reads in place (bf16, int16, uint8, fp8, float32 and int8
    rows, pages, partial strips, views at a row offset and stride, fused K/V layers of 3, 5 and 2
    dimensions: ``_digest_support.in_place_layouts``, 400 MiB of KV at 65,539 slots) compile,
    and the compiled ops hold no copy of them: their temporaries stay below 1/64 of the KV's
    bytes (a partial last row group, padded, is the only KV copied; at a few MiB of KV, XLA
    would prefetch whole arrays into VMEM instead, which counts as temporaries)."""
    nbytes, ops = _layout_ops(65539)
    for name, fn, args in ops:
        compiled = tc.compile_for(fn, args, tc.topology_device(topology))
        assert all(k in compiled.as_text() for k in DIGEST_KERNELS[tc.TPU]), name
        temp = compiled.memory_analysis().temp_size_in_bytes
        assert temp < nbytes // 64, (name, temp, nbytes)


@pytest.mark.parametrize("name", [c.name for c in tc.CASES if c.op == "digest"])
def test_digest_reads_the_kv_in_place(name):
    """The digest at serving size (8 GiB of KV: 32 layers' int32 or bf16 sources, or 8 fused
    bf16 layers as 32 views of their K and V head strips) on v5e reads the sources where they
    are: its temporaries stay far below one layer's bytes (a copy of the sources would not fit
    in v5e's HBM at all)."""
    case = next(c for c in tc.CASES if c.name == name)
    row = _measure(case, "v5e:2x2")
    assert row["ok"], row.get("error")
    kv = row["logical_bytes"]
    assert kv > 8 << 30 and row["temp_size_in_bytes"] < kv // (32 * 16), row


def test_coverage_step_holds_no_copy_of_the_kv():
    """The serving step with the coverage window on (8 layers' K and V, bf16 [1M, 128] each: 4
    GiB of KV digested every step) on v5e: the digest reads the KV in place, so its temporaries
    exceed the step's without coverage by far less than the KV (a bf16 KV laid out as 32-bit
    rows cost 8.6 GiB of temporaries here, against 1.3 GiB without coverage)."""
    plain = _measure(_CASES["step serving"], "v5e:2x2")
    covered = _measure(_CASES["step serving coverage w64 x8"], "v5e:2x2")
    assert plain["ok"] and covered["ok"], (plain.get("error"), covered.get("error"))
    kv = 16 * tc.SLOTS * tc.KV_BYTES_PER_TOKEN
    assert covered["temp_size_in_bytes"] - plain["temp_size_in_bytes"] < kv // 16, (plain,
                                                                                      covered)


def _fused_layers_write(sources_of):
    """``digest_write`` over 4 fused bf16 layers of 1M slots (4 KV heads of head_dim 128,
    ``[pages, 16, 4, 2, 128]``: sglang-jax's paged layout and tpu-inference's RPA v3 alike,
    2 GiB a layer), the sources each integration's coverage window hands the digest."""
    import kvcanary_jax as kc

    slots, layers = 1 << 20, 4
    shape = (slots // 16, 16, 4, 2, 128)

    def write(digest, at, bufs):
        srcs = [s for b in bufs for s in sources_of(b)]
        return kc.digest_write(digest, at, srcs, implementation=tc.TPU)

    spec = jax.ShapeDtypeStruct
    args = (spec((slots,), jnp.int64), spec((256,), jnp.int64),
            [spec(shape, jnp.bfloat16) for _ in range(layers)])
    return jax.jit(write, donate_argnums=0), args, layers * slots * 4 * 2 * 128 * 2


def _sglang_jax_sources(buf):
    from kvcanary_jax.integrations.sglang_jax import layer_sources

    return layer_sources(buf)


def _tpu_inference_sources(buf):
    from kvcanary_jax.integrations.tpu_inference import kv_layout

    lay = kv_layout(buf.shape, buf.dtype, head_dim=128, kv_heads=4, head_shards=1,
                    block_size=16)
    return lay.row_sources(buf)


# (ids with hyphens: an id is a keyword, and the sglang_jax / tpu_inference markers deselect by
# keyword where those packages are missing; these tests need neither)
@pytest.mark.parametrize("integration", ["sglang-jax", "tpu-inference"])
def test_the_integrations_coverage_sources_are_read_in_place(integration):
    """Each integration's coverage window digests every layer as strips of one 128-lane row
    each (K and V of every head), which the Mosaic kernel reads where they are: no temporaries
    for 8 GiB of KV. (A source spanning a slot's whole row, as both handed it before, was laid
    out as 32-bit rows first: 18 GiB of temporaries here, beyond v5e's HBM.)"""
    sources_of = {"sglang-jax": _sglang_jax_sources,
                  "tpu-inference": _tpu_inference_sources}[integration]
    fn, args, kv = _fused_layers_write(sources_of)
    compiled = tc.compile_for(fn, args, tc.topology_device("v5e:2x2"))
    assert all(k in compiled.as_text() for k in DIGEST_KERNELS[tc.TPU])
    assert compiled.memory_analysis().temp_size_in_bytes < kv // 1024, kv
