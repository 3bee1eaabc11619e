"""The suite's own settings (tests/conftest.py): quick XLA CPU compiles, the garbage collector's
thresholds in the test processes, and where TPU interpret mode's race detector runs."""

from __future__ import annotations

import importlib.util
import os

import pytest

import _impls
import _tier
import conftest

LEVEL = "--xla_backend_optimization_level"
# Where a GPU plugin or libtpu is installed the suite leaves XLA_FLAGS alone.
ON_AN_ACCELERATOR = any(importlib.util.find_spec(m) for m in conftest.ACCELERATOR_PLUGINS)


def test_quick_compiles_join_the_users_flags():
    out = conftest._quick_cpu_compile_flags({"XLA_FLAGS": "--xla_dump_to=/tmp/x"})
    if ON_AN_ACCELERATOR:
        assert out is None
    else:
        assert out.split()[0] == "--xla_dump_to=/tmp/x"
        assert f"{LEVEL}=0" in out.split()


def test_a_flag_the_user_set_is_kept():
    out = conftest._quick_cpu_compile_flags({"XLA_FLAGS": f"{LEVEL}=2"})
    assert out is None or (f"{LEVEL}=2" in out.split() and f"{LEVEL}=0" not in out)


def test_left_out_on_request():
    assert conftest._quick_cpu_compile_flags({"KVCANARY_TEST_XLA_DEFAULTS": "1"}) is None


def test_this_process_compiles_quickly():
    wanted = not ON_AN_ACCELERATOR and not os.environ.get("KVCANARY_TEST_XLA_DEFAULTS")
    assert LEVEL in os.environ.get("XLA_FLAGS", "") or not wanted  # ours, or the user's level


def test_the_collector_runs_at_the_suites_thresholds_in_the_test_process():
    import gc

    assert gc.get_threshold() == conftest.GC_THRESHOLDS


def test_the_package_leaves_the_collector_alone():
    """The thresholds are the suite's: importing the package and running an op in a fresh
    process keeps CPython's defaults."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import gc
        before = gc.get_threshold()
        import jax
        import kvcanary_jax as kc
        with jax.enable_x64(True):
            kc.canary_verify(context=kc.VerifyOrWriteContext.allocate(num_slots=8),
                             plan=kc.VerifyPlan.allocate(verify_capacity=4),
                             check_verify_expected_token=True)
        assert gc.get_threshold() == before, gc.get_threshold()
        print("OK")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_race_detector_off_in_a_hand_written_test_of_the_fast_tier():
    assert _impls.DETECT_RACES is _tier.LONG


@pytest.mark.tpu_races
def test_race_detector_on_where_marked():
    assert _impls.DETECT_RACES is True


def _jax_ordered():
    """JAX's own vector-clock comparison (``lt`` both ways, which the suite leaves alone) as a
    function of two clock arrays. Every JAX the project admits (0.10 to 0.12) has the clocks: if
    a newer one moves them, conftest's speed-up silently stops applying and this fails first."""
    from jax._src.pallas.mosaic.interpret import vector_clock

    cls = getattr(vector_clock, "NpVectorClock", None)
    if cls is None:
        return lambda x, y: vector_clock.lt(x, y) | vector_clock.lt(y, x)

    def ordered(x, y):
        a, b = cls(len(x)), cls(len(y))
        a.clock[:], b.clock[:] = x, y
        return a.lt(b) or b.lt(a)
    return ordered


def test_quick_vector_clock_comparison_is_jaxs():
    """conftest's race-detector speed-up answers as JAX's clocks do: on every pair of clocks of
    sizes 1 to 3 with components 0..2 (both orders, equal clocks, incomparable ones), and on
    random clocks of up to 6 components near the int32 limit."""
    import itertools

    import numpy as np

    jax_ordered = _jax_ordered()
    for n in range(1, 4):
        for x in itertools.product(range(3), repeat=n):
            for y in itertools.product(range(3), repeat=n):
                xa, ya = np.array(x, np.int32), np.array(y, np.int32)
                assert conftest._ordered(xa, ya) == jax_ordered(xa, ya), (x, y)
    rng = np.random.default_rng(0)
    for _ in range(2000):
        n = int(rng.integers(1, 7))
        x = rng.integers(2**31 - 4, 2**31 - 1, n, dtype=np.int32)
        y = (x - rng.integers(0, 3, n)).astype(np.int32)
        assert conftest._ordered(x, y) == jax_ordered(x, y), (x, y)


def test_the_race_detector_uses_the_quick_comparison():
    """Inside a test, the clocks' ``ordered`` is conftest's (and still answers correctly)."""
    from jax._src.pallas.mosaic.interpret import vector_clock

    cls = getattr(vector_clock, "NpVectorClock", None)
    if cls is None:
        assert vector_clock.ordered is conftest._ordered
        return
    assert "_ordered" in cls.ordered.__code__.co_names
    a, b = cls(2), cls(2)
    b.clock[0] = 1
    assert cls.ordered(a, b) is True and cls.ordered(a, a) is False


@pytest.mark.tpu_interpret
@pytest.mark.tpu_races
def test_the_race_detector_still_finds_a_race():
    """With the quick comparison in place, TPU interpret mode's race detector still tells a
    kernel that reads a VMEM buffer while a DMA writes it from one that waits for the DMA."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc

    from kvcanary_jax.ops import _tpu_lib

    def kernel(racy, x_hbm, o_ref, buf, sem):
        dma = pltpu.make_async_copy(x_hbm, buf, sem)
        dma.start()
        if not racy:
            dma.wait()
        o_ref[...] = buf[...] + 1
        if racy:
            dma.wait()

    def found(racy):
        x = jnp.zeros((8, 128), jnp.int32)
        try:
            pl.pallas_call(
                lambda *refs: kernel(racy, *refs),
                out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
                scratch_shapes=[pltpu.VMEM(x.shape, x.dtype), pltpu.SemaphoreType.DMA(())],
                interpret=_tpu_lib.interpret_params(detect_races=True),
            )(x).block_until_ready()
        except Exception as e:  # jax >= 0.11 raises on a race; before, it sets races_found
            if "RACE DETECTED" not in str(e):
                raise
            detector = ipc.races
            ipc.reset_tpu_interpret_mode_state()  # an interpreted kernel that raised
            detector.races_found = False  # expected here: not a failure of this test
            return True
        races, ipc.races.races_found = ipc.races.races_found, False  # as above
        return races

    assert found(racy=True) is True
    assert found(racy=False) is False


def test_every_deep_entry_names_a_test_that_exists():
    """A renamed test would silently leave the deep tier and run in the fast one (or a renamed
    module's tests never run as deep): every entry of ``conftest.DEEP`` names a module and a
    test function that exist, and a parameter substring that one of its ids holds."""
    import re

    here = os.path.dirname(os.path.abspath(__file__))
    for module, test, sub in conftest.DEEP:
        path = os.path.join(here, module)
        assert os.path.exists(path), module
        if test is None:
            continue
        src = open(path).read()
        assert re.search(rf"^def {test}\(", src, re.M), (module, test)
        if sub is not None:
            assert sub in src or sub in ("pallas_interpret", "pallas_mosaic_tpu"), (module, test, sub)
