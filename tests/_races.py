"""What a launch may give where its programs race, and checks that accept exactly that.

On a GPU (``pallas_triton``, and SGLang's own kernels alike) the programs of one launch run
concurrently in no promised order, and their plain loads and stores are weak ones (the PTX memory
model: each word coherent, no order across words without a fence). The sequential
implementations (the references, ``xla``, ``pallas_interpret``, ``pallas_mosaic_tpu``) resolve
every race in request order, which is one of the outcomes below, and are compared exactly.

What the kernels do, and the outcomes that follow (each check here is exact where a race cannot
reach, and accepts where one can exactly these outcomes):

* scatter (:func:`assert_scatter_outcome`): each cell is one 32-bit store, so a cell that two or
  more requests write holds one of its writers' values; every other cell is exact.
* ring rows, write and verify (:func:`ring_mismatch`): a program reserves the violation rows of
  one block (a write request's tokens ``Config.block`` at a time; ``Config.block`` verify
  entries) with ONE atomic claim on the write index (``_kernel_lib.claim_rows``) and writes them
  at the claim plus their rank, in entry order. The claims of one program follow its program
  order (one word: coherence); those of different programs land in any order. So the launch's
  rows are its claims concatenated in some interleaving of the programs' claim sequences: each
  claim's rows contiguous and in entry order, no claim split. Under the ring guard (from write
  index ``w0 >= 0``) the rows below the capacity land: the first ``capacity - w0`` rows of that
  sequence, the claim that crosses the end landing its first rows; the index becomes ``min(w0 +
  n, 2**31 - 1)``; from ``w0 < 0`` nothing lands and the index stays.
* verify (:func:`assert_verify_outcome`): an entry only reads the canary, so every row and
  counter is the reference's; only the ring order is open: the claims are the blocks of
  ``pallas_triton.launch_grid`` (program ``p`` claims blocks ``p, p + P, ...`` in that order).
* write: :mod:`_write_races` (seed reads, slots two requests write, and the ring as above).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvcanary_jax import consts

import _canary_support as support

# ---------------------------------------------------------------------------------------------
# scatter


def scatter_writes(flat, offsets, rpi, shape, max_cols=None):
    """Per request: ``(row, cols, values)`` it stores (``row`` None when it stores nothing), by
    the op's semantics (``kvcanary_jax.ops.scatter.base``): ``write_len = min(end - start,
    max_cols)`` columns from ``start``, flat indices outside ``flat_in`` and rows outside the
    pool skipped, values wrapped to int32."""
    rows, width = shape
    max_cols = width if max_cols is None else int(max_cols)
    n = len(flat)
    cols = np.arange(width, dtype=np.int64)
    out = []
    for r in range(len(rpi)):
        start, end, row = int(offsets[r]), int(offsets[r + 1]), int(rpi[r])
        src = start + cols
        take = (cols < min(end - start, max_cols)) & (src >= 0) & (src < n)
        if not (0 <= row < rows) or n == 0 or not take.any():
            out.append((None, cols[:0], np.zeros(0, np.int32)))
            continue
        c = cols[take]
        out.append((row, c, np.asarray(flat, np.int64)[start + c].astype(np.int32)))
    return out


def assert_scatter_outcome(got, before, writes):
    """``got`` (the pool after a launch from ``before``) holds, in every cell, one of its
    writers' values, and the cells no request writes are untouched."""
    got, before = np.asarray(got), np.asarray(before)
    assert got.shape == before.shape
    written = np.zeros(before.shape, bool)
    match = np.zeros(before.shape, bool)
    writers = np.zeros(before.shape, np.int64)
    for row, c, v in writes:
        if row is None:
            continue
        written[row, c] = True
        writers[row, c] += 1
        match[row, c] |= got[row, c] == v
    untouched = ~written
    bad = np.argwhere(untouched & (got != before))
    assert not len(bad), f"cells no request writes changed: {bad[:5].tolist()}"
    bad = np.argwhere(written & ~match)
    assert not len(bad), (
        f"cells holding none of their writers' values: "
        f"{[(tuple(x), int(got[tuple(x)]), int(writers[tuple(x)])) for x in bad[:5]]}")


def contested_cells(writes, shape) -> int:
    """How many cells two or more requests write (the races a case draws)."""
    writers = np.zeros(shape, np.int64)
    for row, c, _ in writes:
        if row is not None:
            writers[row, c] += 1
    return int((writers > 1).sum())


def apply_scatter(before, writes, order):
    """The pool after the requests' stores in ``order`` (each request's row at once): one
    outcome a GPU may give."""
    out = np.array(before, copy=True)
    for r in order:
        row, c, v = writes[r]
        if row is not None:
            out[row, c] = v
    return out


# ---------------------------------------------------------------------------------------------
# the violation ring: claims in some order


def as_rows(rows) -> tuple:
    """Ring rows as tuples of ints (comparable, hashable)."""
    return tuple(tuple(int(v) for v in r) for r in rows)


def ring_mismatch(ours: support.State, before: support.State, programs) -> str | None:
    """Why the write index and ring of ``ours`` (a launch from ``before``) are not what the
    launch gives when its programs claim rows as ``programs`` says (None when they are):
    ``programs`` holds, per program, its claims in order, each a sequence of rows in entry order
    (module docstring)."""
    programs = [[as_rows(c) for c in claims if len(c)] for claims in programs]
    programs = [p for p in programs if p]
    total = sum(len(c) for p in programs for c in p)
    w0, cap = before.widx, len(before.ring)
    if w0 < 0:
        want, lo, hi = w0, cap, cap
    else:
        want = min(w0 + total, consts.VIOLATION_WRITE_INDEX_MAX)
        lo, hi = min(w0, cap), min(w0 + total, cap)
    if ours.widx != want:
        return f"write index {ours.widx} != {want} ({total} rows from {w0})"
    if not (np.array_equal(ours.ring[:lo], before.ring[:lo])
            and np.array_equal(ours.ring[hi:], before.ring[hi:])):
        return f"ring rows outside the launch's window [{lo}, {hi}) changed"
    window = as_rows(ours.ring[lo:hi])
    if not _claims_fill(window, programs):
        return (f"ring rows {list(window)} are no interleaving of the programs' claims "
                f"{programs} (each claim contiguous, each program's in order)")
    return None


def _claims_fill(window: tuple, programs: list) -> bool:
    """Whether ``window`` is the start of some interleaving of ``programs``' claim sequences
    (each claim whole, the last one possibly cut by the window's end). A search over how many
    claims of each program are placed; programs with the same claims are interchangeable, so a
    state keeps their counts sorted."""
    copies: dict = {}
    for p in programs:
        copies.setdefault(tuple(p), []).append(0)
    seqs = list(copies)
    end = len(window)
    failed = set()

    def fill(state, at):
        if at >= end:
            return True
        if state in failed:
            return False
        for k, done in enumerate(state):
            seq = seqs[k]
            for j, n in enumerate(done):
                if n == len(seq) or (j and done[j - 1] == n):
                    continue  # finished, or the same as the copy before it
                claim = seq[n]
                cut = min(len(claim), end - at)
                if window[at:at + cut] != claim[:cut]:
                    continue
                moved = tuple(sorted(done[:j] + (n + 1,) + done[j + 1:]))
                if fill(state[:k] + (moved,) + state[k + 1:], at + cut):
                    return True
        failed.add(state)
        return False

    return fill(tuple(tuple(v) for v in copies.values()), 0)


# ---------------------------------------------------------------------------------------------
# verify


@dataclasses.dataclass(frozen=True)
class VerifyClaims:
    """A verify launch's result from write index 0 on a ring with room for every row (the jnp
    reference, ``full``) and its rows as ``pallas_triton``'s programs claim them (``programs``:
    per program its blocks' rows, in its order)."""

    full: support.State
    programs: list


def verify_claims(before: support.State, *, config=None, **case) -> VerifyClaims:
    """:class:`VerifyClaims` of a verify case (``case``: :func:`_canary_support.run_verify`'s)
    launched with ``config`` (None: the op's choice on this machine). A block's rows are the
    reference's rows of its entries: the difference of two runs cut at its ends."""
    from kvcanary_jax.ops.verify import pallas_triton

    capacity = len(case["verify_slot_indices"])
    grid = pallas_triton.launch_grid(capacity, support.triton_config("verify", before, config,
                                                                     **case))
    active = (min(max(int(case["verify_num_valid"]), 0), capacity)
              if case.get("enable", 1) else 0)
    start = support.State(before.canary.copy(), np.zeros((capacity + 1, 8), np.int64), 0,
                          before.sctr, before.kctr)

    def rows_before(entry):
        cut = dict(case, verify_num_valid=entry)
        out, _ = support.run_verify(None, start, **cut, reference=False, jnp_reference=True)
        return out

    full = rows_before(case["verify_num_valid"])
    rows = support.new_rows(start, full)
    blocks = -(-active // grid.block)
    ends = [0] + [rows_before(b * grid.block).widx for b in range(1, blocks)] + [len(rows)]
    claims = [rows[ends[b]:ends[b + 1]] for b in range(blocks)]
    return VerifyClaims(full=full, programs=[claims[p::grid.num_programs]
                                             for p in range(grid.num_programs)])


def verify_mismatch(ours: support.State, before: support.State, claims: VerifyClaims
                    ) -> str | None:
    """Why ``ours`` (a verify launch from ``before``) is no outcome of the launch (None when it
    is one): the canary untouched, the counters the reference's, the ring as the blocks' claims
    in some order (module docstring)."""
    if not np.array_equal(ours.canary, before.canary):
        return "the canary changed"
    want = (claims.full.sctr, claims.full.kctr)
    if (ours.sctr, ours.kctr) != want:
        return f"counters {(ours.sctr, ours.kctr)} != {want}"
    return ring_mismatch(ours, before, claims.programs)


def assert_verify_outcome(ours: support.State, before: support.State, *, config=None,
                          claims: VerifyClaims | None = None, **case) -> VerifyClaims:
    """``ours`` is an outcome of the verify case ``case`` launched from ``before`` with
    ``config`` on ``pallas_triton`` (module docstring); returns the case's claims (pass them
    back as ``claims`` to check another result of the same case)."""
    claims = claims or verify_claims(before, config=config, **case)
    why = verify_mismatch(ours, before, claims)
    assert why is None, f"no order of the verify's claims gives this result: {why}"
    return claims
