"""The KV digest as Pallas kernels (Triton lowering on CUDA GPUs; interpret mode too).

Semantics and bounds: :mod:`kvcanary_jax.ops.digest.base`.

Parallel shape: a program takes ``block`` slots at a time and reads each of their strips
``lanes`` words per load, a ``[block, lanes]`` tile whose rows are contiguous runs of a slot's
strip (coalesced); ``unroll`` tiles are loaded before any is hashed, so that many loads are in
flight per warp (a GPU issues in order and stalls at a load's first use). Terms are summed per
slot in int64 (wrapping, as the definition's mod 2**64). Sources are static: one unrolled piece
per source, a loop over its words; views of one buffer read the same kernel argument.

* write: a persistent grid over the slots (at most ``max_programs`` programs, grid-stride); each
  valid slot's digest is stored into ``digest_buf`` (aliased: in place). Duplicate slots store
  the same bytes.
* verify: the selected entries are compacted first in XLA (a prefix sum over the mask and one
  scatter: :func:`kvcanary_jax.ops.digest.base.compact`); the kernel walks the compacted list in
  blocks of ``block`` entries up to the selected count read from the device (each program a
  contiguous run of blocks), so the KV read follows the selection. Each block compares its
  digests with the stored ones and claims its violation rows with one claim under the ring guard
  (:func:`kvcanary_jax.ops._kernel_lib.claim_rows`): rows keep entry order within a block, the
  order across blocks is the atomics' (in interpret mode, where programs run in order, entry
  order). Program 0 bumps the counters (``slot_run_counter`` by the selected count).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Mapping

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kvcanary_jax import consts, hashing
from kvcanary_jax.context import DigestContext, as_words
from kvcanary_jax.ops import _kernel_lib
from kvcanary_jax.ops._kernel_lib import append_rows, claim_rows
from kvcanary_jax.ops.digest import base

__all__ = ["Config", "heuristics", "run", "BLOCK", "LANES", "UNROLL", "NUM_WARPS",
           "MAX_PROGRAMS"]

# A [4, 128]-word tile per load (4 KiB; 128 consecutive words of each of 4 slots, 1 KiB runs),
# two tiles in flight per step, 4 warps: 8 words per thread per step. A slot of a 32-layer model
# (128 KiB) is 128 loads; a verify at window 64 of a 64k-entry plan selects about 1,000 slots,
# 250 blocks, about two per H200 SM. The persistent grid: 8 programs per SM of the H200's 132
# (a verify's grid is sized for its capacity, most of whose entries a window leaves out; programs
# past the selected blocks exit at once). Untuned: bench/op_digest.py measures the shapes.
BLOCK = 4
LANES = 128
UNROLL = 2
NUM_WARPS = 4
NUM_STAGES = 1
MAX_PROGRAMS = 8 * 132


@dataclasses.dataclass(frozen=True)
class Config:
    """Launch parameters (results do not depend on them): ``block`` slots per step, ``lanes``
    words per slot per load, ``unroll`` loads issued before they are hashed (powers of two),
    ``num_warps``, ``num_stages``, ``max_programs`` (the persistent grid's cap). ``interpret``:
    Pallas interpret mode (any backend; what ``pallas_interpret`` runs)."""

    block: int = BLOCK
    lanes: int = LANES
    unroll: int = UNROLL
    num_warps: int = NUM_WARPS
    num_stages: int = NUM_STAGES
    max_programs: int = MAX_PROGRAMS
    interpret: bool = False

    def __post_init__(self):
        _kernel_lib.check_interpret("digest", self.interpret)
        pow2 = lambda n: n >= 1 and not n & (n - 1)  # noqa: E731
        if not (pow2(self.block) and pow2(self.lanes) and pow2(self.unroll)) or \
                self.num_warps < 1 or self.num_stages < 1 or self.max_programs < 1:
            raise ValueError(f"kv-canary digest: bad launch parameters block={self.block} "
                             f"lanes={self.lanes} unroll={self.unroll} (powers of two) "
                             f"num_warps={self.num_warps} max_programs={self.max_programs}")


def heuristics(shapes: Mapping[str, int]) -> Config:
    """The defaults; narrow strips (under ``lanes`` words a source) take narrower tiles in the
    kernel itself."""
    return Config()


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _slot_digests(slot, ok, refs, specs, *, lanes: int, unroll: int):
    """The digests (int64 ``[block]``) of ``slot`` where ``ok`` (a valid slot; the value is
    meaningless elsewhere). Per source a loop over its strip, ``unroll`` tiles of ``[block,
    lanes]`` words loaded, then hashed; masked lanes read nothing."""
    acc = jnp.zeros(slot.shape, jnp.int64)
    for j, (b, spec) in enumerate(specs):
        ref = refs[b]
        idt = _kernel_lib.index_dtype(ref.shape[0])
        words = spec.read_words
        width = min(lanes, _pow2_at_least(words))
        chunks = -(-words // width)
        group = min(unroll, chunks)
        lane = jnp.arange(width, dtype=jnp.int32)
        s = jnp.where(ok, slot, 0).astype(jnp.int64)
        row = s // spec.page_size
        row_ok = ok & (row < spec.num_rows)
        start = spec.word_offset + row * spec.row_stride_words + \
            (s % spec.page_size) * spec.nbpt_words
        start = jnp.where(row_ok, start, 0).astype(idt)

        def tiles(first, count, part, j=j, ref=ref, idt=idt, start=start, row_ok=row_ok,
                  lane=lane, width=width, words=words):
            # ``count`` tiles loaded, then hashed: word ``first + t * width + lane`` of tile t.
            loaded = []
            for t in range(count):
                i = first + t * width + lane
                in_strip = i < words
                m = row_ok[:, None] & in_strip[None, :]
                at = start[:, None] + jnp.where(in_strip, i, 0).astype(idt)[None, :]
                loaded.append((i, in_strip, plt.load(ref.at[at], mask=m, other=0)))
            for i, in_strip, w in loaded:
                term = hashing.digest_term(w, j, i.astype(jnp.int64)[None, :])
                part = part + jnp.sum(jnp.where(in_strip[None, :], term, 0), axis=1)
            return part

        full, rest = divmod(chunks, group)
        part = jnp.zeros(slot.shape, jnp.int64)
        if full == 1:
            part = tiles(jnp.int32(0), group, part)
        elif full > 1:
            part = jax.lax.fori_loop(
                0, full, lambda c, p: tiles(c * (group * width), group, p), part)
        if rest:
            part = tiles(jnp.int32(full * group * width), rest, part)
        acc = acc + part
    return acc


def _grid(count: int, config: Config) -> int:
    return max(1, min(config.max_programs, pl.cdiv(count, config.block)))


def _write_kernel(slots_ref, *refs, specs, nbuf, num_slots, block, num_programs, lanes,
                  unroll):
    srcs, out = refs[:nbuf], refs[nbuf + 1]  # refs[nbuf]: digest_buf in (aliased to out)
    n = slots_ref.shape[0]
    p = pl.program_id(0)
    r = jnp.arange(block, dtype=jnp.int32)

    def body(b):
        k = b * block + r
        in_plan = k < n
        slot = plt.load(slots_ref.at[jnp.where(in_plan, k, 0)], mask=in_plan, other=-1)
        ok = in_plan & (slot >= 0) & (slot < num_slots)
        d = _slot_digests(slot, ok, srcs, specs, lanes=lanes, unroll=unroll)
        _kernel_lib.scatter(out, slot, d, ok)

    nblocks = pl.cdiv(n, block)
    if num_programs >= nblocks:
        body(p)
        return
    trips = (nblocks - p + num_programs - 1) // num_programs
    jax.lax.fori_loop(0, trips, lambda t, c: (body(p + t * num_programs), c)[1], 0)


def write(digest_buf, slots, sources: base.BoundSources, *, config: Config):
    nbuf = len(sources.buffers)
    n = slots.shape[0]
    num_programs = _grid(n, config)
    kernel = functools.partial(
        _write_kernel, specs=sources.specs, nbuf=nbuf, num_slots=digest_buf.shape[0],
        block=config.block, num_programs=num_programs, lanes=config.lanes, unroll=config.unroll)
    ins = [slots, *(as_words(b) for b in sources.buffers)]
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(digest_buf.shape, digest_buf.dtype),
        grid=(num_programs,),
        input_output_aliases={len(ins): 0},
        interpret=config.interpret,
        compiler_params=None if config.interpret else _kernel_lib.compiler_params(
            config.num_warps, config.num_stages),
        name="kvcanary_digest_write",
    )(*ins, digest_buf)


def _verify_kernel(order_ref, count_ref, slots_ref, pos_ref, digest_ref, *refs, specs, nbuf,
                   kind, ring_cap, block, num_programs, lanes, unroll):
    srcs = refs[:nbuf]
    ring, widx, sctr, kctr = refs[nbuf + 4:]
    cap = order_ref.shape[0]
    p = pl.program_id(0)
    count = count_ref[0]
    i64 = jnp.int64

    @pl.when(p == 0)
    def _counters():
        kctr[0] = kctr[0] + 1
        sctr[0] = sctr[0] + count.astype(i64)

    r = jnp.arange(block, dtype=jnp.int32)

    def body(b):
        k = b * block + r
        live = k < count
        e = plt.load(order_ref.at[jnp.where(live, k, 0)], mask=live, other=0)
        e = jnp.where(live, e, 0)
        slot = plt.load(slots_ref.at[e], mask=live, other=0)
        pos = plt.load(pos_ref.at[e], mask=live, other=0)
        d = _slot_digests(slot, live, srcs, specs, lanes=lanes, unroll=unroll)
        stored = _kernel_lib.gather(digest_ref, slot, live)
        viol = live & (stored != d)
        flags = viol.astype(jnp.int32)
        total = jnp.sum(flags, dtype=jnp.int32)

        @pl.when(total > 0)
        def _record():
            w0 = claim_rows(widx, total, cap)
            rel = jnp.cumsum(flags, dtype=jnp.int32) - flags
            zero = jnp.zeros((block,), i64)
            append_rows(ring, w0, rel, viol, ring_cap, (
                jnp.full((block,), kind, i64), slot, pos, zero, zero, stored, d,
                jnp.full((block,), consts.KV_DIGEST_MISMATCH, i64)))

    # Program p takes a contiguous run of the selected blocks: programs that run one after
    # another (interpret mode) append their rows in entry order.
    nblocks = (count + (block - 1)) // block
    per = (nblocks + (num_programs - 1)) // num_programs
    first = p * per
    trips = jnp.clip(nblocks - first, 0, per)
    jax.lax.fori_loop(0, trips, lambda t, c: (body(first + t), c)[1], 0)


def verify(context: DigestContext, slots, positions, num_valid, phase,
           sources: base.BoundSources, *, window: int, config: Config) -> DigestContext:
    nbuf = len(sources.buffers)
    cap = slots.shape[0]
    order, count = base.compact(base.selection(
        slots, num_valid, phase, window=window, num_slots=context.digest_buf.shape[0]))
    num_programs = _grid(cap, config)
    kernel = functools.partial(
        _verify_kernel, specs=sources.specs, nbuf=nbuf, kind=int(context.kernel_kind),
        ring_cap=context.violation_ring.shape[0], block=config.block,
        num_programs=num_programs, lanes=config.lanes, unroll=config.unroll)
    ins = [order, count, slots, positions, context.digest_buf,
           *(as_words(b) for b in sources.buffers)]
    # The write index is passed as a scalar: the ring guard's compare-and-swap needs a scalar ref.
    outs = [context.violation_ring.reshape(-1), context.violation_write_index.reshape(()),
            context.slot_run_counter, context.kernel_run_counter]
    ring, widx, sctr, kctr = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs],
        grid=(num_programs,),
        input_output_aliases={len(ins) + j: j for j in range(len(outs))},
        interpret=config.interpret,
        compiler_params=None if config.interpret else _kernel_lib.compiler_params(
            config.num_warps, config.num_stages),
        name="kvcanary_digest_verify",
    )(*ins, *outs)
    return context.replace(violation_ring=ring.reshape(context.violation_ring.shape),
                           violation_write_index=widx.reshape(1), slot_run_counter=sctr,
                           kernel_run_counter=kctr)


_FUNCTIONS = {"write": write, "verify": verify}


def run(function: str, *args, config: Config, **kwargs):
    """``function`` (``"write"`` or ``"verify"``) of this implementation."""
    return _FUNCTIONS[function](*args, config=config, **kwargs)
