"""The Mosaic TPU kernels' named state is consistent with what is allocated (no kernel runs).

Each kernel declares its scratch once, as a :class:`kvcanary_jax.ops._tpu_state.State`: every
buffer by name, memory space and shape, and its SMEM words and DMA semaphores by name and span.
The same declaration gives ``pallas_call`` its scratch shapes and the kernel body its named view,
so the two cannot drift apart. Two members sharing a semaphore or a word would be a race the
interpret suites may not reach, a member past the allocation an out-of-bounds index: here the
members, each with the span it owns (2 for a per-buffer member), tile the allocation exactly, in
order, no gap, no overlap, nothing past the end, and the allocation is what the kernel needs.
"""

from __future__ import annotations

import math

import pytest

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import kvcanary_jax as kc
from kvcanary_jax.ops import _tpu_fingerprint as fingerprint
from kvcanary_jax.ops import _tpu_lib as tpu
from kvcanary_jax.ops import _tpu_state as tpu_state
from kvcanary_jax.ops.plan import pallas_mosaic_tpu_kernel as plan
from kvcanary_jax.ops.scatter import pallas_mosaic_tpu as scatter
from kvcanary_jax.ops.verify import pallas_mosaic_tpu as verify
from kvcanary_jax.ops.write import pallas_mosaic_tpu as write

_SEM = "semaphore_mem"


def _allocation(state: tpu_state.State):
    """``(memory space, shape, dtype)`` of each scratch shape, in order."""
    return [(str(s.memory_space), tuple(s.shape), str(s.dtype)) for s in state.scratch_shapes()]


def _assert_tiles(state: tpu_state.State, name: str, spans: dict):
    """Member ``m`` of ``state``'s words or semaphores ``name`` owns ``spans[m]`` elements (an int,
    or a shape), in the order of ``spans``, and together they are the whole allocation."""
    layout = state.members(name)
    assert list(layout) == list(spans), name
    at = 0
    for member, span in spans.items():
        dims = (span,) if isinstance(span, int) else tuple(span)
        assert layout[member] == (at, dims), (name, member)
        at += math.prod(dims)
    (alloc,) = [s for n, decl in state.fields if n == name for s in decl.shapes()]
    assert tuple(alloc.shape) == (at,), name


# ---------------------------------------------------------------------------------------------
# The declaration itself


def _toy():
    return tpu_state.State(
        buf=tpu_state.vmem((2, 8, 128)),
        each=tpu_state.vmem_each([(4, 128), (2, 128)]),
        misc=tpu_state.words(flag=1, runs=2, grid=(3, 2)),
        tiles=tpu_state.smem((4,), jnp.uint8),
        sems=tpu_state.semaphores(ring=1, rows=2, strips=(2, 2)),
    )


def test_state_generates_shapes_in_declaration_order():
    assert _allocation(_toy()) == [
        ("vmem", (2, 8, 128), "int32"), ("vmem", (4, 128), "int32"), ("vmem", (2, 128), "int32"),
        ("smem", (9,), "int32"), ("smem", (4,), "uint8"), (_SEM, (7,), "dma_sem")]
    _assert_tiles(_toy(), "misc", dict(flag=1, runs=2, grid=(3, 2)))
    _assert_tiles(_toy(), "sems", dict(ring=1, rows=2, strips=(2, 2)))


class _Ref:
    """A stand-in ref: records what is read, written and sliced."""

    def __init__(self):
        self.log = []

    def __getitem__(self, k):
        self.log.append(("get", k))
        return ("word", k)

    def __setitem__(self, k, v):
        self.log.append(("set", k, v))

    @property
    def at(self):
        return self

    def __repr__(self):
        return "ref"


def test_view_names_each_member():
    refs = [_Ref() for _ in range(6)]
    view = _toy().bind(refs)
    assert view.buf is refs[0] and view.each == (refs[1], refs[2]) and view.tiles is refs[4]
    misc, sems = view.misc, view.sems
    assert misc.flag == ("word", 0)  # a one-wide word reads as an attribute
    misc.flag = 7
    misc.runs[1] = 8
    misc.grid[2, 1] = 9
    assert refs[3].log == [("get", 0), ("set", 0, 7), ("set", 2, 8), ("set", 8, 9)]
    assert sems.ring == ("word", 0) and sems.rows[1] == ("word", 2)
    assert sems.strips[1, 0] == ("word", 5)
    tpu_state.fill(misc, ("runs",), 0)
    assert refs[3].log[-2:] == [("set", 1, 0), ("set", 2, 0)]


def test_view_refuses_what_is_not_declared():
    view = _toy().bind([_Ref() for _ in range(6)])
    with pytest.raises(IndexError, match="outside its span"):
        view.misc.runs[2]
    with pytest.raises(IndexError, match="outside its span"):
        view.sems.strips[0, 2]
    with pytest.raises(IndexError, match="coordinate"):
        view.misc.grid[1]
    with pytest.raises(AttributeError, match="no member 'nope'"):
        view.misc.nope
    with pytest.raises(AttributeError, match=r"misc\.runs\[\.\.\.\]"):
        view.misc.runs = 1
    with pytest.raises(TypeError, match="semaphores"):
        view.sems.rows[0] = 1
    with pytest.raises(TypeError, match="6 scratch refs got 5"):
        _toy().bind([_Ref() for _ in range(5)])
    with pytest.raises(ValueError, match="span"):
        tpu_state.words(bad=-1)


def test_traced_index_adds_the_static_part_once():
    """A traced coordinate (a buffer ``slot``) gives the member's offset plus it, scaled by its
    stride; the flat index of a one-wide-per-buffer member at offset 0 is the coordinate."""
    span = _toy().bind([_Ref() for _ in range(6)]).misc.grid
    idx = jax.jit(lambda i, s: span.index((i, s)))(jnp.int32(2), jnp.int32(1))
    assert int(idx) == 3 + 2 * 2 + 1
    first = _toy().bind([_Ref() for _ in range(6)]).misc.span("flag")
    assert first.index(0) == 0


# ---------------------------------------------------------------------------------------------
# The status words


def test_status_words_tile_the_vector():
    spans = dict(NUM_VALID=1, ENABLE=1, WRITE_INDEX=1, SLOT_RUNS=2, KERNEL_RUNS=2, PAD=1)
    assert [m.name for m in tpu.Status] == list(spans)
    at = 0
    for m in tpu.Status:
        assert int(m) == at, m
        at += spans[m.name]
    assert at == tpu.STATUS_WORDS == 8


def test_status_words_round_trip():
    """What the wrappers send (:func:`status_words`) decodes (:func:`from_status`) to the same
    ring guard state, 64-bit counters across the 32-bit boundary included."""
    with jax.enable_x64(True):
        ctx = kc.VerifyOrWriteContext.allocate(num_slots=8, ring_capacity=4)
        ctx = ctx.replace(violation_write_index=jnp.asarray([3], ctx.violation_write_index.dtype),
                          slot_run_counter=jnp.asarray([(5 << 32) + 7], jnp.int64),
                          kernel_run_counter=jnp.asarray([-2], jnp.int64))
        st = tpu.status_words(jnp.asarray([11], jnp.int32), jnp.asarray([1], jnp.int32), ctx)
        assert st.shape == (tpu.STATUS_WORDS,) and st.dtype == jnp.int32
        assert int(st[tpu.Status.NUM_VALID]) == 11 and int(st[tpu.Status.ENABLE]) == 1
        assert int(st[tpu.Status.PAD]) == 0
        back = tpu.from_status(ctx, st, tpu.words32(ctx.violation_ring))
        for f in ("violation_write_index", "slot_run_counter", "kernel_run_counter",
                  "violation_ring"):
            a, b = getattr(back, f), getattr(ctx, f)
            assert a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all()), f


@pytest.mark.tpu_interpret
def test_finish_status_in_a_kernel():
    """:func:`finish_status` passes the count and the switch through, writes the ring's new
    index and adds to both counters with a carry into the high word (TPU interpret mode)."""
    st_in = jnp.asarray([5, 1, 2, -1, 0, 9, 0, 0], jnp.int32)  # slot runs 2**32 - 1; kernel 9

    def kernel(st_ref, out_ref, misc, stage, sem):
        ring = tpu.Ring(None, 16, _WordSpan(misc), stage, sem)
        ring.start(st_ref[tpu.Status.WRITE_INDEX])
        misc[1] = jnp.int32(4)  # four violations found
        tpu.finish_status(st_ref, out_ref, ring=ring, slot_runs=jnp.int32(3))

    smem = pl.BlockSpec(memory_space=pltpu.SMEM)
    out = tpu.call(kernel, st_in, in_specs=[smem], out_specs=smem,
                   out_shape=jax.ShapeDtypeStruct((tpu.STATUS_WORDS,), jnp.int32),
                   scratch_shapes=[pltpu.SMEM((2,), jnp.int32), pltpu.SMEM(tpu.RING_STAGE,
                                                                           jnp.int32),
                                   pltpu.SemaphoreType.DMA(())],
                   interpret=tpu.interpret_params(detect_races=False))
    assert [int(x) for x in out] == [5, 1, 6, 2, 1, 10, 0, 0]


class _WordSpan:
    """The ring's two words as a plain SMEM ref (the test kernel declares no State)."""

    def __init__(self, ref):
        self.ref = ref

    def __getitem__(self, k):
        return self.ref[k]

    def __setitem__(self, k, v):
        self.ref[k] = v


# ---------------------------------------------------------------------------------------------
# Each kernel


def test_plan_offsets_state():
    state = plan._offsets_state((8, 128), (8, 128), 512, 200)
    _assert_tiles(state, "sems", dict(cells=1, cells_tail=1, lut=1, seeds=1, write_offsets=1))
    assert _allocation(state) == [
        ("smem", (8, 128), "int32"), ("smem", (8, 128), "int32"), ("smem", (512,), "int32"),
        ("smem", (plan.SEED_BATCH, 128), "int32"), ("smem", (plan.SEED_BATCH, 2), "int32"),
        (_SEM, (5,), "dma_sem"), ("smem", (plan.SEED_BATCH, 200 % 128), "int32")]


@pytest.mark.parametrize("has_lut", [False, True])
def test_plan_entries_state(has_lut):
    state = plan._entries_state(1024, has_lut, 72, 1)
    _assert_tiles(state, "sems", dict(cells=2, cells_tail=2, tokens=2, tokens_tail=2, sync=1,
                                      lut=1, out=2, load=1))
    # per table (req_to_token, pool) and item buffer: the copies in flight and the staging row
    # of the short last segment
    _assert_tiles(state, "misc", dict(cell_copies=2, cell_short_copies=2, token_copies=2,
                                      token_short_copies=2, flags=1, out_busy=1, cell_tail_row=2,
                                      token_tail_row=2))
    # flag bits of both item buffers are distinct and fit the word
    bits = [plan._flag_bit(f, s) for f in plan._Flag for s in (0, 1)]
    assert len(set(bits)) == 4 and all(0 < b < 2**31 for b in bits)
    assert sum(bits) == 0b1111
    assert sorted((plan._ACC_SLOW_CELLS, plan._ACC_SLOW_TOKENS)) == [8, 9]  # past 4 fields x 2
    assert plan._ACC_PLANES == 10
    # the single-cell rows: one per _CellRow, in order
    assert [int(c) for c in plan._CellRow] == list(range(len(plan._CellRow)))
    R, NS = 1024 // 128, 1024 // 128 + 8
    assert _allocation(state) == [
        ("vmem", (2, NS, 128), "int32"),
        ("smem", (2, NS, 128) if has_lut else (1, 128), "int32"),
        ("vmem", (2, NS, 128), "int32"), ("vmem", (R, 128, 2), "int32"),
        ("smem", (len(plan._CellRow), 128), "int32"),
        ("vmem", (plan._ACC_PLANES, R, 128), "int32"), ("vmem", (2, 4, 2 * R, 128), "int32"),
        ("smem", (14,), "int32"), (_SEM, (13,), "dma_sem"), ("vmem", (2, 1, 72), "int32"),
        ("smem", (2, 1, 72) if has_lut else (1, 1, 1), "int32"), ("vmem", (2, 1, 1), "int32"),
        ("smem", (len(plan._CellRow), 72), "int32"), ("smem", (len(plan._CellRow), 1), "int32"),
        ("smem", (1, 2), "int32")]


def test_scatter_state():
    state = scatter._state(16, 200)
    _assert_tiles(state, "sems", dict(src=2, read=2, read_tail=2, write=2, write_tail=2))
    _assert_tiles(state, "misc", dict(pend_row=2, pend_n=2, pend_tail=2, rd_n=2, rd_tail=2))
    assert _allocation(state) == [
        ("vmem", (2, 24, 128), "int32"), ("vmem", (2, 16, 128), "int32"),
        ("vmem", (2, 16, 128), "int32"), ("smem", (10,), "int32"), (_SEM, (10,), "dma_sem"),
        ("vmem", (2, 1, 72), "int32"), ("vmem", (2, 1, 72), "int32")]


def test_verify_state():
    state = verify._state(1024)
    _assert_tiles(state, "sems", dict(plan=2, rows=2, ring=1, prev=2))
    # the Ring owns two words (W0, COUNT)
    _assert_tiles(state, "misc", dict(runs=2, ring=tpu.Ring.WORDS, prevs=2))
    assert (tpu.Ring.W0, tpu.Ring.COUNT, tpu.Ring.WORDS) == (0, 1, 2)
    r = 1024 // 128
    assert _allocation(state) == [
        ("vmem", (2, 4, 2 * r, 128), "int32"), ("smem", (2, 2, 2 * r, 128), "int32"),
        ("vmem", (2, r, 128, 32, 128), "uint8"), ("vmem", (2, r, 128, 32, 128), "uint8"),
        ("vmem", (8 * r, 128), "int32"), ("vmem", (2, 2 * r, 128), "int32"),
        ("smem", (6,), "int32"), ("smem", (2, 2, r), "int32"), ("smem", (1, 16), "int32"),
        (_SEM, (7,), "dma_sem")]


@pytest.mark.parametrize("nsrc", [0, 1, 3])
def test_fingerprint_state(nsrc):
    widths = tuple(4 * (i + 1) for i in range(nsrc))
    state = fingerprint._state(1024, widths)
    _assert_tiles(state, "sems", dict(slots=2, out=2, strips=(nsrc, 2)))
    _assert_tiles(state, "misc", dict(out_busy=1, runs=(nsrc, 2)))
    r = 1024 // 128
    assert _allocation(state) == [
        ("smem", (2, 2 * r, 128), "int32"), ("vmem", (2, 2 * r, 128), "int32"),
        *(("vmem", (2, r, 128, w), "int32") for w in widths),
        *(("vmem", (w, r, 128), "int32") for w in widths),
        ("vmem", (2, 2 * r, 128), "int32"), ("smem", (1 + 2 * nsrc,), "int32"),
        ("smem", (max(nsrc, 1), 2, 1024), "int32"), (_SEM, (4 + 2 * nsrc,), "dma_sem")]


def test_write_state():
    state = write._state(4, 512, 6)
    _assert_tiles(state, "sems", dict(chunk=2, seed=1, row=1, ring=1,
                                      write=write.WRITES_IN_FLIGHT))
    # the write's misc words by name, sized by their declaration
    _assert_tiles(state, "misc", dict(chunk_now=1, chunk_id=2, fetching=2, opened=1,
                                      ring=tpu.Ring.WORDS, written=1, open_tile=1, open_at=1))
    K = write.WRITES_IN_FLIGHT
    assert _allocation(state) == [
        ("vmem", (128, 32, 128), "uint8"), ("vmem", (2, 4, 128), "int32"),
        ("vmem", (32, 128), "int32"), ("vmem", (2, 8, 128), "int32"),
        ("smem", (2, 8, 128), "int32"), ("smem", (512,), "int32"),
        ("smem", (2, 6, write.CHUNK // 64, 128), "int32"), ("vmem", (K, 32, 128), "uint8"),
        ("smem", (K,), "int32"), ("smem", (11,), "int32"), ("smem", (1, 16), "int32"),
        ("smem", (4,), "int32"), (_SEM, (5 + K,), "dma_sem")]
