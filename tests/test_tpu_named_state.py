"""The Mosaic TPU kernels' named state is consistent with what is allocated (no kernel runs).

Each kernel takes its scratch refs as a ``NamedTuple`` built from one shapes function, and
addresses its DMA semaphores and SMEM state words through ``IntEnum`` members, some of them
``+ s`` (one per buffer ``s``). Two members sharing a semaphore or a word would be a race the
interpret suites may not reach; a member past the allocation an out-of-bounds index. Here the
members, each with the span it owns (2 for a per-buffer member), must tile the allocation
exactly: in order, no gap, no overlap, nothing past the end.
"""

from __future__ import annotations

import pytest

from kvcanary_jax.ops import _tpu_fingerprint as fingerprint
from kvcanary_jax.ops import _tpu_lib as tpu
from kvcanary_jax.ops.plan import pallas_mosaic_tpu_kernel as plan
from kvcanary_jax.ops.scatter import pallas_mosaic_tpu as scatter
from kvcanary_jax.ops.verify import pallas_mosaic_tpu as verify
from kvcanary_jax.ops.write import pallas_mosaic_tpu as write


def _assert_tiles(enum_cls, spans: dict, total: int, *, gaps=()):
    """``enum_cls``'s members, member ``m`` owning ``[m, m + spans[m.name])``, cover
    ``[0, total)`` exactly, but for the unused ranges ``gaps`` (``(start, stop)``)."""
    assert set(spans) == {m.name for m in enum_cls}, enum_cls
    owned = sorted([(int(m), int(m) + spans[m.name]) for m in enum_cls] + list(gaps))
    at = 0
    for lo, hi in owned:
        assert lo == at, (enum_cls.__name__, lo, at)
        at = hi
    assert at == total, (enum_cls.__name__, at, total)


def test_plan_offsets_state():
    _assert_tiles(plan._OffsetsSem, dict(CELLS=1, CELLS_TAIL=1, LUT=1, SEEDS=1, WRITE_OFFSETS=1),
                  len(plan._OffsetsSem))
    shapes = plan._offsets_scratch_shapes((8, 128), (8, 128), 512, 200)
    assert len(shapes) == len(plan._OffsetsScratch._fields)


@pytest.mark.parametrize("has_lut", [False, True])
def test_plan_entries_state(has_lut):
    _assert_tiles(plan._EntriesSem, dict(CELLS=2, CELLS_TAIL=2, TOKENS=2, TOKENS_TAIL=2, SYNC=1,
                                         LUT=1, OUT=2, LOAD=1), plan._ENTRIES_SEMS)
    # the copy counters (full, short) per buffer; TAIL_ROW mirrors them, one word per counter
    _assert_tiles(plan._Misc, dict(CELL_COPIES=4, TOKEN_COPIES=4, FLAGS=1, OUT_BUSY=1,
                                   TAIL_ROW=8), plan._MISC_WORDS, gaps=[(10, 16)])
    assert plan._Misc.TAIL_ROW + plan._Misc.TOKEN_COPIES + 4 <= plan._MISC_WORDS
    # flag bits of both item buffers are distinct and fit the word
    bits = [plan._flag_bit(f, s) for f in plan._Flag for s in (0, 1)]
    assert len(set(bits)) == 4 and all(0 < b < 2**31 for b in bits)
    assert sum(bits) == 0b1111
    assert sorted((plan._ACC_SLOW_CELLS, plan._ACC_SLOW_TOKENS)) == [8, 9]  # past 4 fields x 2
    assert plan._ACC_PLANES == 10
    shapes = plan._entries_scratch_shapes(1024, has_lut, 72, 1)
    assert len(shapes) == len(plan._EntriesScratch._fields)
    assert shapes[plan._EntriesScratch._fields.index("acc")].shape[0] == plan._ACC_PLANES
    assert shapes[plan._EntriesScratch._fields.index("misc")].shape == (plan._MISC_WORDS,)


def test_scatter_state():
    _assert_tiles(scatter._Sem, dict(SRC=2, READ=2, READ_TAIL=2, WRITE=2, WRITE_TAIL=2),
                  scatter._SEMS)
    _assert_tiles(scatter._Misc, dict(PEND_ROW=2, PEND_N=2, PEND_TAIL=2, RD_N=2, RD_TAIL=2),
                  scatter._MISC_WORDS)
    assert len(scatter._scratch_shapes(16, 200)) == len(scatter._Scratch._fields)


def test_verify_state():
    _assert_tiles(verify._Sem, dict(PLAN=2, ROWS=2, RING=1, PREV=2), verify._SEMS)
    # the Ring owns two words (W0, COUNT); word 4 is unused
    _assert_tiles(verify._Misc, dict(RUNS=2, RING=2, PREVS=2), verify._MISC_WORDS - 1,
                  gaps=[(4, 5)])
    assert (tpu.Ring.W0, tpu.Ring.COUNT) == (0, 1)
    assert len(verify._scratch_shapes(1024)) == len(verify._Scratch._fields)


@pytest.mark.parametrize("nsrc", [0, 1, 3])
def test_fingerprint_state(nsrc):
    _assert_tiles(fingerprint._Sem, dict(SLOTS=2, OUT=2, STRIPS=2 * nsrc), 4 + 2 * nsrc)
    _assert_tiles(fingerprint._Misc, dict(OUT_BUSY=1, RUNS=2 * nsrc), 2 + 2 * nsrc,
                  gaps=[(1, 2)])
    widths = (4,) * nsrc
    shapes = fingerprint._scratch_shapes(1024, widths)
    scr = fingerprint._Scratch.of(list(range(len(shapes))), nsrc)
    assert len(scr.bufs) == len(scr.words) == nsrc
    assert scr.sems == len(shapes) - 1  # every shape is taken, the semaphores last


def test_write_state():
    _assert_tiles(write._Sem, dict(CHUNK0=2, SEED=1, ROW=1, RING=1,
                                   WRITE0=write.WRITES_IN_FLIGHT),
                  write._Sem.WRITE0 + write.WRITES_IN_FLIGHT)
    shapes = write._scratch_shapes(4, 512, 6)
    assert len(shapes) == len(write._Scratch._fields)
