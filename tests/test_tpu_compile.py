"""The Mosaic TPU kernels compile with libtpu for TPU topologies, on a CPU host (marked
``tpu_compile``; deselected where libtpu is not installed: ``pip install "jax[tpu]==<jax>"``).

Lowering (``tests/test_lowering.py``) and TPU interpret mode do not check Mosaic's own rules (DMA
granularity, tiling, loop carries); libtpu's compiler does. Nothing runs: correctness comes from
the TPU interpret suites. Every compile refuses a fallback (a FallbackWarning is an error), so
what compiles is the Mosaic kernels. Sizes are small to keep compile time low (about 10 s a
compile on two cores); ``python -m bench.tpu_compile`` compiles the serving sizes."""

from __future__ import annotations

import pytest

import jax

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
    row = tc.measure(case, topology)
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
    row = tc.measure(case, topology)
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
    row = tc.measure(case, "v5e:2x2")
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


@pytest.mark.parametrize("name", [c.name for c in tc.CASES if c.op == "digest"])
def test_digest_reads_the_kv_in_place(name):
    """The digest at serving size (8 GiB of KV: 32 layers' int32 sources) on v5e reads the
    sources where they are: its temporaries stay far below one layer's bytes (a copy of the
    sources would not fit in v5e's HBM at all)."""
    case = next(c for c in tc.CASES if c.name == name)
    row = tc.measure(case, "v5e:2x2")
    assert row["ok"], row.get("error")
    kv = row["logical_bytes"]
    assert kv > 8 << 30 and row["temp_size_in_bytes"] < kv // (32 * 16), row
